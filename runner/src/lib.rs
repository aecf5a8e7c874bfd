//! byoc-runner: the vendor's only actor inside a customer's cloud account.
//!
//! `main.rs` is a one-liner; everything lives here so tests can drive it in-process.
//! A job's path through the code is `pipeline::run_job` (receive → verify →
//! resolve_role → authorize → claim → assume_role → execute → report; `recover` after
//! a crash); `roles` holds the lifecycle-role model, the customer's switches, STS
//! sessions and the local pause; `daemon` keeps startup order, slots, enrollment and
//! systemd; `runtime` is what every stage may use, its outside world behind traits
//! (`control_plane::ControlPlane`, `journal::JobJournal`, `audit::AuditSink`,
//! `clock::Clock`, `roles::sts::Assumer`, `roles::switches::SwitchSource`) with fakes
//! in `testing`.

pub mod app_check;
pub mod app_policies;
pub mod approvals;
pub mod audit;
pub mod audit_export;
pub mod audit_records;
pub mod cli;
pub mod clock;
pub mod config;
pub mod config_check;
pub mod contact;
pub mod control_plane;
pub mod customer_policies;
pub mod daemon;
pub mod disk;
pub mod drift;
pub mod guardrails;
pub mod identity;
pub mod inspect;
pub mod journal;
pub mod leases;
pub mod lifecycle;
pub mod logging;
pub mod metrics;
pub mod pipeline;
pub mod retention;
pub mod roles;
pub mod run_local;
pub mod runtime;
pub mod secrets;
pub mod spool;
pub mod state_dir;
#[cfg(test)]
pub mod testing;
pub mod update;
