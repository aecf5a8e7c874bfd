//! The disk the runner shares with the customer's agents (issue 21): new jobs refused
//! while free space is low, evidence written even on a full disk, a job whose log
//! cannot be written stopped cleanly. The state dir is a real tmpfs of a few MiB.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::path::{Path, PathBuf};

use byoc_control_plane::harness::RunnerOptions;
use byoc_protocol::{JobStatus, RejectReason};
use common::*;

/// A tmpfs mounted at a test's state dir, unmounted (lazily: the runner may still be
/// going) and its directory removed when the test ends.
struct Tmpfs {
    mount: PathBuf,
    root: PathBuf,
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.mount).status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// A runner whose state dir is a `size_mib` tmpfs, with `[disk]` settings `disk`.
async fn env_on_tmpfs(size_mib: u64, disk: &str, env: Vec<(String, String)>) -> (Env, Tmpfs) {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size_mib}m,mode=0700"), "byoc-test-state"])
        .arg(&state)
        .status()
        .expect("mount(8)");
    assert!(status.success(), "mounting a tmpfs needs root (CAP_SYS_ADMIN), as the sandbox tests do");
    let guard = Tmpfs { mount: state, root: dir.path().to_path_buf() };
    let opts = RunnerOptions { extra: format!("[disk]\n{disk}\n"), env, ..Default::default() };
    (env_in(dir, opts).await, guard)
}

/// Fill the filesystem of `dir` until it refuses more; the file, to delete later.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write as _;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let block = vec![0x5au8; 64 * 1024];
    while f.write_all(&block).is_ok() {}
    let _ = f.sync_all();
    path
}

fn free_mib(dir: &Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(dir).unwrap();
    (s.blocks_available() * s.fragment_size()) >> 20
}

#[tokio::test]
async fn a_full_disk_refuses_new_jobs_with_disk_low_keeps_its_records_and_recovers() {
    let (e, _tmpfs) =
        env_on_tmpfs(64, "min_free_mib = 24\nmin_free_percent = 50\nreserve_mib = 8", vec![]).await;
    let state = e.runner.state_dir.clone();
    let reserve = state.join("disk-reserve");
    assert!(reserve.exists(), "the runner did not hold its disk reserve");

    let ok = e.cp.enqueue(script("echo before")).unwrap();
    assert_eq!(e.finished(&ok).await.result.unwrap().status, JobStatus::Succeeded);

    // Someone else fills the disk to the last byte.
    let filler = fill(&state);
    assert_eq!(free_mib(&state), 0);
    let refused = e.cp.enqueue(script("echo must not run")).unwrap();
    let v = e.rejected(&refused).await;
    assert_eq!(v.rejections[0].0, RejectReason::DiskLow, "{:?}", v.rejections);
    assert!(
        v.rejections[0].1.contains("MiB free") && v.rejections[0].1.contains("disk.min_free_mib"),
        "{:?}",
        v.rejections
    );
    // The refusal is on the record although the disk was full: the reserve was given
    // back for it.
    assert!(!reserve.exists(), "the reserve was not released for the journal and audit log");
    let local = e.cli_json(&["jobs", "rejections"]);
    assert!(local.as_array().unwrap().iter().any(|r| r["reason"] == "disk_low"), "{local}");
    let status = e.cli_json(&["status"]);
    assert!(status["disk"]["low"].as_str().is_some_and(|l| l.contains("MiB free")), "{status}");
    let audit = std::fs::read_to_string(state.join("audit").join(byoc_audit::log::LOG)).unwrap_or_default();
    assert!(audit.contains("disk_low"), "no audit record of the refusal");
    let verify = e.runner.cli(&["audit", "verify", "-o", "json"]);
    assert!(verify.status.success(), "{}", String::from_utf8_lossy(&verify.stdout));

    // Space returns: jobs run again and the reserve is held again.
    std::fs::remove_file(&filler).unwrap();
    let after = e.cp.enqueue(script("echo after")).unwrap();
    let v = e.finished(&after).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded);
    assert_eq!(e.output(&after).lines().last(), Some("after"));
    assert!(reserve.exists(), "the reserve was not held again once space returned");
    let status = e.cli_json(&["status"]);
    assert!(status["disk"]["low"].is_null(), "{status}");
    assert!(status["disk_use"]["job_logs"].as_u64().is_some_and(|b| b > 0), "{status}");
    assert!(status["disk_use"]["audit"].as_u64().is_some_and(|b| b > 0), "{status}");
    assert_eq!(status["disk_use"]["disk_reserve"], 8 << 20, "{status}");

    // A log gone by retention (here: removed by hand, as the sweep does) is named as such.
    std::fs::remove_file(state.join("spool").join(format!("{after}.log"))).unwrap();
    let out = e.runner.cli(&["jobs", "logs", &after]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("jobs.log_retention_days") && err.contains("acknowledged"), "{err}");
}

#[tokio::test]
async fn a_disk_filling_up_mid_job_stops_the_job_with_its_log_intact() {
    // A job log may grow to 256 MiB; the disk has 48, of which the last 8 stay free for
    // the journal and the audit log.
    let (e, _tmpfs) = env_on_tmpfs(48, "min_free_mib = 1\nreserve_mib = 8", vec![]).await;
    let state = e.runner.state_dir.clone();
    let id = e
        .cp
        .enqueue(script(
            "echo started; head -c 200000000 /dev/zero | tr '\\0' z | fold -w 100; echo never-reached >> \"$BYOC_OUTPUT\"",
        ))
        .unwrap();
    let v = e.finished(&id).await;
    let result = v.result.unwrap();
    assert_eq!(result.status, JobStatus::Failed);
    let error = result.error.clone().unwrap_or_default();
    assert!(
        error.contains("log could not be written") && error.contains("kept for the audit log"),
        "{error}"
    );
    assert!(result.outputs.get("never-reached").is_none());
    // The log holds what was written up to the stop, whole, and its digest is of it.
    let spool = std::fs::read(state.join("spool").join(format!("{id}.log"))).unwrap();
    assert!(spool.len() > 10 << 20, "only {} bytes of log were kept", spool.len());
    assert_eq!(result.log_size, spool.len() as u64);
    assert_eq!(result.log_sha256, byoc_protocol::sha256_hex(&spool));
    assert_eq!(e.cp.log(&id).unwrap(), spool);
    assert!(free_mib(&state) >= 4, "the job's log took the reserve: {} MiB free", free_mib(&state));
    // The records are whole and the runner goes on.
    let verify = e.runner.cli(&["audit", "verify", "-o", "json"]);
    assert!(verify.status.success(), "{}", String::from_utf8_lossy(&verify.stdout));
    let show = e.cli_json(&["jobs", "show", &id]);
    assert_eq!(show["phase"], "reported");
    std::fs::remove_file(state.join("spool").join(format!("{id}.log"))).unwrap();
    let next = e.cp.enqueue(script("echo next")).unwrap();
    assert_eq!(e.finished(&next).await.result.unwrap().status, JobStatus::Succeeded);
}

#[tokio::test]
async fn a_container_whose_log_fills_the_disk_is_stopped_and_removed() {
    let image = import_image("byoc-test/busybox:disk", &[]);
    let (e, _tmpfs) = env_on_tmpfs(48, "min_free_mib = 1\nreserve_mib = 8", vec![]).await;
    let state = e.runner.state_dir.clone();
    let id = e
        .cp
        .enqueue(byoc_control_plane::EnqueueRequest::new(
            "action.container",
            serde_json::json!({
                "image": image,
                "command": ["sh", "-c", "while true; do echo zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz; done"],
                "network": false
            }),
        ))
        .unwrap();
    // What is asserted is the stop, not its speed. Docker's log stream carries about
    // 1 MB/s here, so filling the 48 MiB disk takes some 40 s alone and passed the
    // common 60 s wait on a loaded CI machine (21 MB logged by then).
    let v = e.cp.wait_for(&id, std::time::Duration::from_secs(180), |v| v.result.is_some()).await;
    let result = v.and_then(|v| v.result).unwrap_or_else(|| panic!("not stopped:\n{}", e.runner.log()));
    assert_eq!(result.status, JobStatus::Failed);
    let error = result.error.clone().unwrap_or_default();
    assert!(error.contains("log could not be written") && error.contains("stopped"), "{error}");
    let spool = std::fs::read(state.join("spool").join(format!("{id}.log"))).unwrap();
    assert_eq!(result.log_sha256, byoc_protocol::sha256_hex(&spool));
    assert!(free_mib(&state) >= 4, "the job's log took the reserve: {} MiB free", free_mib(&state));
    assert!(job_containers(&id).is_empty(), "the stopped container was left behind");
}
