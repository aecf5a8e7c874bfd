//! The disk the runner shares with the customer's agents. Three guards:
//! - new jobs are refused with `disk_low` while free space on the state dir's filesystem
//!   is under the threshold (`[disk] min_free_mib` or `min_free_percent` of the
//!   filesystem, whichever is smaller); running jobs finish;
//! - a job's log stops (and the job is stopped) before it takes the last
//!   `reserve_mib` of the disk;
//! - a file of `reserve_mib` is held in the state dir and given back the moment an
//!   evidence write (journal, audit log) finds the disk nearly full, so the records of
//!   what happened are never what a full disk loses.

use std::path::{Path, PathBuf};

use crate::state_dir::StateDir;

/// `[disk]` in runner.toml.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskSettings {
    pub min_free_bytes: u64,
    pub min_free_percent: u64,
    pub reserve_bytes: u64,
}

impl Default for DiskSettings {
    fn default() -> Self {
        DiskSettings { min_free_bytes: 2048 << 20, min_free_percent: 5, reserve_bytes: 32 << 20 }
    }
}

/// Under this much free space an evidence write gives the reserve back first.
const EVIDENCE_FLOOR: u64 = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Space {
    /// Bytes an unprivileged writer may still use (`f_bavail`).
    pub free: u64,
    pub total: u64,
}

pub fn space(path: &Path) -> std::io::Result<Space> {
    let s = nix::sys::statvfs::statvfs(path).map_err(std::io::Error::from)?;
    let unit = s.fragment_size();
    Ok(Space { free: s.blocks_available() * unit, total: s.blocks() * unit })
}

/// What the state dir's filesystem allows now.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DiskCheck {
    pub path: PathBuf,
    pub free_bytes: Option<u64>,
    pub total_bytes: Option<u64>,
    pub threshold_bytes: u64,
    /// Why new jobs are refused (free space under the threshold, or unreadable).
    pub low: Option<String>,
}

impl DiskSettings {
    pub fn threshold(&self, total: u64) -> u64 {
        let pct = (total as u128 * self.min_free_percent as u128 / 100) as u64;
        self.min_free_bytes.min(pct)
    }

    /// Free space against the threshold. Space that cannot be read counts as low: a
    /// guard we cannot check does not let jobs through.
    pub fn check(&self, state_dir: &Path) -> DiskCheck {
        match space(state_dir) {
            Ok(s) => {
                let threshold = self.threshold(s.total);
                DiskCheck {
                    path: state_dir.to_path_buf(),
                    free_bytes: Some(s.free),
                    total_bytes: Some(s.total),
                    threshold_bytes: threshold,
                    low: (s.free < threshold).then(|| {
                        format!(
                            "only {} MiB free on the filesystem of {} (the runner takes new jobs above {} MiB: disk.min_free_mib / disk.min_free_percent); free some space and jobs are taken again",
                            s.free >> 20,
                            state_dir.display(),
                            threshold >> 20
                        )
                    }),
                }
            }
            Err(e) => DiskCheck {
                path: state_dir.to_path_buf(),
                free_bytes: None,
                total_bytes: None,
                threshold_bytes: self.min_free_bytes,
                low: Some(format!("cannot read the free space of {}: {e}", state_dir.display())),
            },
        }
    }
}

/// The held-back space for evidence, and the floor job logs stop at.
#[derive(Debug, Clone)]
pub struct Reserve {
    path: PathBuf,
    bytes: u64,
}

impl Reserve {
    pub fn new(state_dir: &Path, settings: &DiskSettings) -> Reserve {
        Reserve { path: StateDir::of(state_dir).disk_reserve(), bytes: settings.reserve_bytes }
    }

    /// Hold the reserve if it is not held and the disk can spare it (twice its size
    /// free), so taking it never itself fills the disk. Best effort: logged. A reserve
    /// short of its size (a crash while it was written) is written again.
    pub fn hold(&self) {
        if self.bytes == 0 {
            return;
        }
        match std::fs::metadata(&self.path) {
            Ok(m) if m.len() >= self.bytes => return,
            Ok(_) => {
                let _ = std::fs::remove_file(&self.path);
            }
            Err(_) => {}
        }
        let Some(dir) = self.path.parent() else { return };
        if space(dir).is_ok_and(|s| s.free >= 2 * self.bytes)
            && let Err(e) = write_reserve(&self.path, self.bytes)
        {
            let _ = std::fs::remove_file(&self.path);
            tracing::warn!(error = %e, path = %self.path.display(), "Could not hold the disk reserve for the audit log and journal: {e}.");
        }
    }

    /// Before an evidence write: if the disk is nearly full, give the reserve back.
    pub fn make_room_for_evidence(&self) {
        let Some(dir) = self.path.parent() else { return };
        if space(dir).is_ok_and(|s| s.free < EVIDENCE_FLOOR) && self.path.exists() {
            match std::fs::remove_file(&self.path) {
                Ok(()) => tracing::error!(
                    freed_bytes = self.bytes,
                    "The state dir's disk is full: released the reserve so the journal and audit log can still be written."
                ),
                Err(e) => {
                    tracing::error!(error = %e, "The state dir's disk is full and the reserve could not be released: {e}.")
                }
            }
        }
    }
}

fn write_reserve(path: &Path, bytes: u64) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new().create_new(true).write(true).mode(0o600).open(path)?;
    // Real blocks, not a sparse file: the space must be there when given back.
    let zeros = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        f.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_is_the_smaller_of_the_two_settings() {
        let s = DiskSettings::default();
        assert_eq!(s.threshold(8 << 30), (8u64 << 30) * 5 / 100, "a small disk: 5 %");
        assert_eq!(s.threshold(1 << 40), 2048 << 20, "a large disk: 2 GiB");
        let off = DiskSettings { min_free_bytes: 0, ..s };
        assert_eq!(off.threshold(1 << 40), 0);
    }

    #[test]
    fn an_unreadable_filesystem_counts_as_low() {
        let c = DiskSettings::default().check(Path::new("/nonexistent/byoc-state"));
        assert!(c.low.as_deref().is_some_and(|l| l.contains("cannot read the free space")), "{c:?}");
    }

    #[test]
    fn free_space_over_the_threshold_is_not_low() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = DiskSettings { min_free_bytes: 1, min_free_percent: 90, reserve_bytes: 0 }.check(dir.path());
        assert_eq!(c.threshold_bytes, 1);
        assert!(c.low.is_none() || c.free_bytes == Some(0), "{c:?}");
        let c = DiskSettings { min_free_bytes: u64::MAX, min_free_percent: 90, reserve_bytes: 0 }
            .check(dir.path());
        assert!(c.low.is_some(), "90 % of the disk free is not likely here: {c:?}");
    }

    #[test]
    fn the_reserve_is_held_with_real_blocks_and_kept_while_space_is_plenty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = Reserve::new(dir.path(), &DiskSettings { reserve_bytes: 1 << 20, ..Default::default() });
        r.hold();
        let meta = std::fs::metadata(StateDir::of(dir.path()).disk_reserve()).expect("reserve");
        use std::os::unix::fs::MetadataExt as _;
        assert_eq!(meta.len(), 1 << 20);
        assert!(meta.blocks() * 512 >= 1 << 20, "the reserve is sparse");
        r.make_room_for_evidence();
        assert!(StateDir::of(dir.path()).disk_reserve().exists(), "released with plenty of space");
    }

    #[test]
    fn a_reserve_cut_short_by_a_crash_is_written_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(StateDir::of(dir.path()).disk_reserve(), b"partial").expect("partial reserve");
        Reserve::new(dir.path(), &DiskSettings { reserve_bytes: 1 << 20, ..Default::default() }).hold();
        assert_eq!(
            std::fs::metadata(StateDir::of(dir.path()).disk_reserve()).expect("reserve").len(),
            1 << 20
        );
    }
}
