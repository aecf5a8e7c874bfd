//! The short soak (issue 21): 2,000 jobs through the reference control plane, and the
//! runner's memory, descriptors and journal stay bounded. The long one, with figures,
//! is `scripts/bench soak`.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::RunnerOptions;
use byoc_protocol::JobStatus;
use common::*;

/// (RSS KiB, open descriptors) of a process.
fn figures(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    (rss, std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count())
}

async fn run(e: &Env, n: usize) {
    for _ in 0..n {
        let req =
            EnqueueRequest { ttl_secs: 5, ..EnqueueRequest::new("runner.noop", serde_json::Value::Null) };
        let id = e.cp.enqueue(req).unwrap();
        let v = e.cp.wait_for(&id, std::time::Duration::from_secs(30), |v| v.result.is_some()).await;
        assert_eq!(v.and_then(|v| v.result).map(|r| r.status), Some(JobStatus::Succeeded));
    }
}

#[tokio::test]
async fn two_thousand_jobs_leave_memory_descriptors_and_journal_bounded() {
    // Envelopes valid 5 s with no skew allowance, so settled jobs can leave the journal
    // during the test as they would over months; journal_keep small enough to be
    // crossed many times.
    let opts = RunnerOptions {
        heartbeat_secs: 15,
        jobs_extra: "journal_keep = 100\nmax_clock_skew_secs = 0".into(),
        ..Default::default()
    };
    let e = env_with(opts).await;
    let pid = e.runner.pid().unwrap();
    // Past the first compactions, so what is measured next is the steady state.
    run(&e, 500).await;
    let (rss0, fds0) = figures(pid);
    run(&e, 1500).await;
    let (rss1, fds1) = figures(pid);
    let growth_kib = rss1 as i64 - rss0 as i64;
    eprintln!(
        "soak: RSS {rss0} -> {rss1} KiB ({growth_kib:+} KiB) over 1,500 jobs; descriptors {fds0} -> {fds1}"
    );
    assert!(growth_kib < 2048, "RSS grew {growth_kib} KiB over 1,500 jobs ({rss0} -> {rss1} KiB)");
    assert!(fds1 <= fds0 + 2, "open descriptors {fds0} -> {fds1}");
    // The journal holds what journal_keep allows plus the jobs whose nonces are still
    // valid (5 s of jobs), not 2,000.
    let index = e.cli_json(&["jobs", "list", "--limit", "100000"]);
    let kept = index.as_array().unwrap().len();
    assert!(kept < 1000, "the journal holds {kept} jobs");
    let all = e.cli_json(&["jobs", "list", "--all", "--limit", "100000"]);
    assert_eq!(all.as_array().unwrap().len(), 2000, "every job is still listed");
    assert!(!audit_events(&e.runner.state_dir, "journal_compacted").is_empty());
}
