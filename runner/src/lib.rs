//! byoc-runner: the vendor's only actor inside a customer's cloud account.
//!
//! `main.rs` is a one-liner; everything lives here so tests can drive it in-process.
//! A job's path through the code is
//! `pipeline::{poll, verify, resolve_role, claim, execute, report}`; `roles` holds the
//! lifecycle-role model, the customer's switches, STS sessions and the local pause;
//! `daemon` wires the stages to the control plane and to the durable `journal`.

pub mod app_policies;
pub mod audit;
pub mod cli;
pub mod client;
pub mod config;
pub mod daemon;
pub mod doctor;
pub mod identity;
pub mod inspect;
pub mod journal;
pub mod logging;
pub mod pipeline;
pub mod policy;
pub mod roles;
pub mod run_local;
pub mod spool;
