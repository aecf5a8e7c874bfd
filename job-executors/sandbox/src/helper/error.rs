//! What can stop the sandbox from being built, and the exit code each gives the
//! runner: a network boundary that could not be built (nothing of the job ran), a job
//! program that could not be executed, or any other step.

/// Why the sandbox could not be built (printed on the helper's stderr, which is the
/// job's log, and told to the runner by the exit code).
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A named step (a system call, a file, a mount) failed.
    #[error("{step}: {source}")]
    Step { step: String, source: Box<dyn std::error::Error + Send + Sync> },
    /// The spec, or the state of the host, does not allow the sandbox as asked.
    #[error("{0}")]
    Refused(String),
    /// The job's network boundary could not be built: nothing of the job ran.
    #[error("network boundary: {0}")]
    Network(Box<SetupError>),
    /// A file a later stage seals is not a regular file of the job's (a link, say): that
    /// stage never ran.
    #[error("sealing {0}")]
    Seal(String),
    /// Everything was in place but the job's program could not be executed.
    #[error("exec {program}: {source}")]
    Exec { program: String, source: nix::Error },
}

impl SetupError {
    /// The helper's exit code for this failure (see the `EXIT_*` constants).
    pub fn exit_code(&self) -> i32 {
        match self {
            SetupError::Network(_) => super::EXIT_NETWORK_FAILED,
            SetupError::Exec { .. } => super::EXIT_EXEC_FAILED,
            SetupError::Seal(_) => super::EXIT_SEAL_REFUSED,
            SetupError::Step { .. } | SetupError::Refused(_) => super::EXIT_SANDBOX_FAILED,
        }
    }
}

/// `.step("what")`: a failed operation becomes a [`SetupError::Step`] naming it.
pub(crate) trait StepExt<T> {
    fn step(self, what: impl Into<String>) -> Result<T, SetupError>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> StepExt<T> for Result<T, E> {
    fn step(self, what: impl Into<String>) -> Result<T, SetupError> {
        self.map_err(|e| SetupError::Step { step: what.into(), source: Box::new(e) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_has_its_exit_code_and_names_its_step() {
        let step: Result<(), SetupError> = Err(nix::Error::EPERM).step("mount proc on /proc");
        let step = step.expect_err("failed");
        assert_eq!(step.to_string(), "mount proc on /proc: EPERM: Operation not permitted");
        assert_eq!(step.exit_code(), super::super::EXIT_SANDBOX_FAILED);
        let net = SetupError::Network(Box::new(step));
        assert!(net.to_string().starts_with("network boundary: mount proc"));
        assert_eq!(net.exit_code(), super::super::EXIT_NETWORK_FAILED);
        let exec = SetupError::Exec { program: "/bin/nope".into(), source: nix::Error::ENOENT };
        assert_eq!(exec.exit_code(), super::super::EXIT_EXEC_FAILED);
        assert!(exec.to_string().starts_with("exec /bin/nope"));
    }
}
