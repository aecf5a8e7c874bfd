//! The reference control plane: the vendor's end of the byoc-runner protocol.
//!
//! Used by the end-to-end suites, the local demo and benchmarks. It keeps all state in
//! memory, signs jobs with its own Ed25519 key, and has switches to misbehave (signing
//! with an unknown key, addressing another runner, expiring jobs, replaying nonces) and
//! to fail (down, 5xx, slow, connections cut mid-body) so tests can prove the runner's
//! side holds.

pub mod admin;
pub mod app_config;
pub mod gate;
pub mod grants;
pub mod harness;
pub mod imds;
pub mod kube_api;
pub mod moto;
pub mod netlab;
pub mod otlp;
pub mod ports;
pub mod proxy;
pub mod registry;
pub mod server;
pub mod state;
pub mod tls;
pub mod vm;

pub use server::{ControlPlane, ControlPlaneConfig};
pub use state::{EnqueueRequest, Faults, JobView, Release, Tamper, UpdateRunner};
