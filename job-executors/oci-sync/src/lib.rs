//! Copying OCI artifacts between registries: container images (manifests and
//! multi-architecture indexes), Helm charts and Terraform modules stored as OCI
//! artifacts, and their referrers (signatures, SBOMs, attestations).
//!
//! Memory stays bounded whatever the blob size: blobs stream from the source into the
//! destination's upload, hashed on the way; nothing is tagged before every blob and
//! manifest has arrived and been verified.

pub mod auth;
pub mod client;
pub mod copy;
pub mod ecr;
pub mod error;
pub mod manifest;
pub mod reach;
pub mod reference;

pub use client::{Credential, Registry};
pub use copy::{Copier, Counters, Options, Report};
pub use error::{Side, SyncError};
pub use reach::Reach;
pub use reference::{Digest, Reference};
