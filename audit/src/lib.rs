//! The audit log's formats and checks, shared by the runner (writer, offline
//! verifier) and the control plane (acknowledgement by cosignature).

pub mod export;
pub mod log;
pub mod merkle;
pub mod note;
pub mod verify;
