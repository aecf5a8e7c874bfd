//! Two runners of one install against the reference control plane: a runner frozen
//! mid-job (SIGSTOP) loses its lease; the job is leased anew, under a higher fencing
//! epoch, to the other runner, which runs it once; when the first resumes, its
//! heartbeat, log and result are refused as fenced, it stops the job and journals
//! `fenced`, and the control plane keeps the second runner's result. A job that changes
//! infrastructure is not leased anew until the vendor says the first runner stopped
//! (the reference control plane's rule, tested in `byoc_control_plane::state`).

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::path::Path;
use std::time::Duration;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_control_plane::server::{ControlPlane, ControlPlaneConfig};
use byoc_protocol::JobStatus;
use common::*;
use nix::sys::signal::Signal;

/// Leases of 3 s (heartbeats every second): a frozen runner loses its job quickly.
const LEASE_SECS: u64 = 3;

struct Pair {
    cp: ControlPlane,
    a: RunnerProcess,
    b: RunnerProcess,
    a_id: String,
    b_id: String,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

async fn pair() -> Pair {
    let cp = ControlPlane::start(ControlPlaneConfig {
        lease_secs: LEASE_SECS,
        offer_timeout: Duration::from_secs(3),
        ..Default::default()
    })
    .await
    .unwrap();
    let opts = |dir: &Path| RunnerOptions { poll_wait_secs: 2, ..test_options(dir) };
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = RunnerProcess::start(Path::new(BIN), da.path(), &cp, &opts(da.path())).unwrap();
    assert!(wait_polling(&cp, WAIT).await, "{}", a.log());
    let a_id = cp.runners()[0].runner_id.clone();
    let b = RunnerProcess::start(Path::new(BIN), db.path(), &cp, &opts(db.path())).unwrap();
    assert!(
        cp.wait_until(WAIT, |cp| cp.runners().iter().filter(|r| r.polls > 0).count() == 2).await,
        "{}",
        b.log()
    );
    let b_id = cp.runners().into_iter().find(|r| r.runner_id != a_id).unwrap().runner_id;
    Pair { cp, a, b, a_id, b_id, _dirs: (da, db) }
}

fn journal_events(state_dir: &Path, job_id: &str) -> Vec<String> {
    std::fs::read_to_string(state_dir.join("journal.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["job_id"] == job_id)
        .map(|v| v["event"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test]
async fn a_frozen_runner_loses_its_lease_and_is_fenced_when_it_wakes() {
    let p = pair().await;
    let job =
        p.cp.enqueue(EnqueueRequest {
            runner_id: Some(p.a_id.clone()),
            ..EnqueueRequest::new(
                "action.script",
                serde_json::json!({"script": "echo begun; sleep 4; echo ended"}),
            )
        })
        .unwrap();
    // Running on A: then A freezes (a hung VM, a stalled disk).
    eventually("A started the job", async || started_count(&p.a.state_dir, &job) == 1).await;
    p.a.signal(Signal::SIGSTOP);

    // The lease runs out; B gets the job under epoch 2 and runs it to the end.
    let view = p.cp.wait_for(&job, WAIT, |v| v.result.is_some()).await.unwrap();
    assert_eq!(view.result.as_ref().unwrap().status, JobStatus::Succeeded, "{}", p.b.log());
    assert_eq!(view.leases, [(p.a_id.clone(), 1), (p.b_id.clone(), 2)]);
    assert_eq!((view.claimed_by.as_deref(), view.epoch), (Some(p.b_id.as_str()), 2));
    assert_eq!(started_count(&p.b.state_dir, &job), 1, "the job ran once on B");
    let b_log = p.cp.log(&job).unwrap();
    assert!(String::from_utf8_lossy(&b_log).contains("ended"));

    // A wakes: its next heartbeat or result is fenced; it stops and journals it.
    p.a.signal(Signal::SIGCONT);
    eventually("A journaled the job as fenced", async || {
        journal_events(&p.a.state_dir, &job).last().map(String::as_str) == Some("fenced")
    })
    .await;
    let after = p.cp.job(&job).unwrap();
    assert!(after.fenced.iter().all(|(r, e, _)| *r == p.a_id && *e == 1), "{:?}", after.fenced);
    assert!(!after.fenced.is_empty());
    // B's result and log stand; A reported nothing.
    assert_eq!(after.result, view.result);
    assert_eq!(p.cp.log(&job).unwrap(), b_log);
    let events = journal_events(&p.a.state_dir, &job);
    assert!(!events.contains(&"reported".to_string()), "{events:?}");
    let fenced = audit_events(&p.a.state_dir, "job_fenced");
    assert_eq!(fenced.len(), 1, "{fenced:?}");
    assert!(fenced[0]["detail"].as_str().unwrap().contains("epoch"), "{fenced:?}");
    // The customer sees it on A.
    let shown = p.a.cli(&["jobs", "show", &job, "-o", "json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["phase"], "fenced", "{shown}");
    // A's job process is gone (stopped when fenced, or ended on its own).
    assert!(gone(&job).await.is_empty());
}

#[tokio::test]
async fn a_runner_killed_while_frozen_comes_back_fenced_under_its_journaled_epoch() {
    let mut p = pair().await;
    let job =
        p.cp.enqueue(EnqueueRequest {
            runner_id: Some(p.a_id.clone()),
            ..EnqueueRequest::new(
                "action.script",
                serde_json::json!({"script": "echo begun; sleep 3; echo ended"}),
            )
        })
        .unwrap();
    eventually("A started the job", async || started_count(&p.a.state_dir, &job) == 1).await;
    p.a.signal(Signal::SIGSTOP);
    let view = p.cp.wait_for(&job, WAIT, |v| v.result.is_some()).await.unwrap();
    assert_eq!(view.epoch, 2);
    // A dies frozen (a reset VM); at its next start it settles the interrupted job and
    // reports it under the epoch its journal holds: fenced, journaled, not reported.
    p.a.kill9().await;
    p.a.spawn(None).unwrap();
    eventually("A journaled the job as fenced after its restart", async || {
        journal_events(&p.a.state_dir, &job).last().map(String::as_str) == Some("fenced")
    })
    .await;
    let after = p.cp.job(&job).unwrap();
    assert_eq!(after.result, view.result, "B's result stands");
    // Its log upload (before the result) is the first thing refused.
    assert!(after.fenced.iter().all(|(r, e, _)| *r == p.a_id && *e == 1), "{:?}", after.fenced);
    assert!(!after.fenced.is_empty());
}
