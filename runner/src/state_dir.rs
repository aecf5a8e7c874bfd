//! The state directory (`runner.state_dir`, `/var/lib/byoc-runner` on a VM): every name
//! in it, in one table, and the one way a file in it is written durably. Modules reach
//! their part of it through `StateDir`; what goes in each part is theirs.
//!
//! | name | what | module |
//! |---|---|---|
//! | `identity.key` | the runner's signing key (0600) | `identity` |
//! | `enrollment.json` | runner and install ids | `identity` |
//! | `journal.jsonl`, `journal-archive/` | the job journal and its compacted past | `journal` |
//! | `audit/` | the signed audit log | `audit` |
//! | `audit-export/` | each export sink's cursor and state | `audit_export` |
//! | `spool/` | job logs | `spool` |
//! | `work/` | jobs' working directories | `pipeline::execute` |
//! | `plans/`, `tfstate/`, `artifacts/` | saved plans, local terraform state, fetched components | `pipeline::execute` |
//! | `roots/` | sandbox roots | `runtime` |
//! | `held/` | envelopes of jobs held by the guardrails | `pipeline::held` |
//! | `drift/`, `secrets/` | drift results and targets; the secrets ledger and key | `drift`, `secrets` |
//! | `control/` | what the admin group writes: the pause, allowances, `approvals/` (requests and answers), `audit-inbox/` (its CLI's audit records) | `roles`, `approvals` |
//! | `contact.json` | the last contact with the control plane | `contact` |
//! | `daemon.pid` | the daemon's pid while it runs | `inspect` |
//! | `disk-reserve` | space held back for the journal and audit log | `disk` |

use std::path::{Path, PathBuf};

pub const KEY_FILE: &str = "identity.key";
pub const ENROLLMENT_FILE: &str = "enrollment.json";
pub const JOURNAL_FILE: &str = "journal.jsonl";
pub const ARCHIVE_DIR: &str = "journal-archive";
pub const AUDIT_DIR: &str = "audit";
pub const EXPORT_DIR: &str = "audit-export";
pub const SPOOL_DIR: &str = "spool";
pub const WORK_DIR: &str = "work";
pub const PLANS_DIR: &str = "plans";
pub const TFSTATE_DIR: &str = "tfstate";
pub const ARTIFACTS_DIR: &str = "artifacts";
pub const ROOTS_DIR: &str = "roots";
pub const HELD_DIR: &str = "held";
pub const APPROVALS_DIR: &str = "approvals";
pub const DRIFT_DIR: &str = "drift";
pub const SECRETS_DIR: &str = "secrets";
pub const CONTROL_DIR: &str = "control";
pub const INBOX_DIR: &str = "audit-inbox";
pub const CONTACT_FILE: &str = "contact.json";
pub const PID_FILE: &str = "daemon.pid";
pub const RESERVE_FILE: &str = "disk-reserve";

/// A state directory, by its root.
#[derive(Debug, Clone, Copy)]
pub struct StateDir<'a>(&'a Path);

impl<'a> StateDir<'a> {
    pub fn of(root: &'a Path) -> StateDir<'a> {
        StateDir(root)
    }

    pub fn root(self) -> &'a Path {
        self.0
    }

    pub fn key(self) -> PathBuf {
        self.0.join(KEY_FILE)
    }

    pub fn enrollment(self) -> PathBuf {
        self.0.join(ENROLLMENT_FILE)
    }

    pub fn journal(self) -> PathBuf {
        self.0.join(JOURNAL_FILE)
    }

    pub fn journal_archive(self) -> PathBuf {
        self.0.join(ARCHIVE_DIR)
    }

    pub fn audit(self) -> PathBuf {
        self.0.join(AUDIT_DIR)
    }

    pub fn audit_export(self) -> PathBuf {
        self.0.join(EXPORT_DIR)
    }

    pub fn spool(self) -> PathBuf {
        self.0.join(SPOOL_DIR)
    }

    pub fn work(self) -> PathBuf {
        self.0.join(WORK_DIR)
    }

    pub fn plans(self) -> PathBuf {
        self.0.join(PLANS_DIR)
    }

    pub fn tfstate(self) -> PathBuf {
        self.0.join(TFSTATE_DIR)
    }

    pub fn artifacts(self) -> PathBuf {
        self.0.join(ARTIFACTS_DIR)
    }

    pub fn roots(self) -> PathBuf {
        self.0.join(ROOTS_DIR)
    }

    pub fn held(self) -> PathBuf {
        self.0.join(HELD_DIR)
    }

    /// In `control/`: the admin group answers there.
    pub fn approvals(self) -> PathBuf {
        self.control().join(APPROVALS_DIR)
    }

    pub fn drift(self) -> PathBuf {
        self.0.join(DRIFT_DIR)
    }

    pub fn secrets(self) -> PathBuf {
        self.0.join(SECRETS_DIR)
    }

    pub fn control(self) -> PathBuf {
        self.0.join(CONTROL_DIR)
    }

    /// In `control/`: the admin group's CLI writes its records there.
    pub fn audit_inbox(self) -> PathBuf {
        self.control().join(INBOX_DIR)
    }

    pub fn contact(self) -> PathBuf {
        self.0.join(CONTACT_FILE)
    }

    pub fn pid(self) -> PathBuf {
        self.0.join(PID_FILE)
    }

    pub fn disk_reserve(self) -> PathBuf {
        self.0.join(RESERVE_FILE)
    }
}

/// The one durable write of a file in the state directory (`byoc_statefs`): after a
/// crash the file holds the old or the new content, never a torn mix; it is never
/// written through a link; its mode is exactly `mode`.
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    byoc_statefs::write(path, bytes, byoc_statefs::Options::mode(mode))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_distinct_and_a_plain_name() {
        let names = [
            KEY_FILE,
            ENROLLMENT_FILE,
            JOURNAL_FILE,
            ARCHIVE_DIR,
            AUDIT_DIR,
            EXPORT_DIR,
            SPOOL_DIR,
            WORK_DIR,
            PLANS_DIR,
            TFSTATE_DIR,
            ARTIFACTS_DIR,
            ROOTS_DIR,
            HELD_DIR,
            APPROVALS_DIR,
            DRIFT_DIR,
            SECRETS_DIR,
            CONTROL_DIR,
            INBOX_DIR,
            CONTACT_FILE,
            PID_FILE,
            RESERVE_FILE,
        ];
        let unique: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        assert!(names.iter().all(|n| !n.is_empty() && !n.contains('/') && !n.starts_with('.')));
        let dir = StateDir::of(Path::new("/var/lib/byoc-runner"));
        assert_eq!(dir.journal(), Path::new("/var/lib/byoc-runner/journal.jsonl"));
        assert_eq!(dir.control(), Path::new("/var/lib/byoc-runner/control"));
    }

    #[test]
    fn a_write_replaces_the_file_whole_with_its_mode() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json");
        write(&path, b"one", 0o600).unwrap();
        write(&path, b"two", 0o640).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o640);
    }
}
