//! End to end under failure: control-plane outage, error storms, `kill -9`, drain on
//! SIGTERM, cancel on the second SIGTERM.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::path::Path;
use std::time::Duration;

use byoc_control_plane::Faults;
use byoc_control_plane::harness::{RunnerOptions, wait_polling};
use byoc_control_plane::state::JobState;
use byoc_protocol::JobStatus;
use common::*;
use nix::sys::signal::Signal;

fn lines(n: usize, tag: &str) -> String {
    (1..=n).map(|i| format!("{tag} {i}\n")).collect()
}

#[tokio::test]
async fn control_plane_down_60s_mid_job_loses_and_duplicates_nothing() {
    let e = env().await;
    let go = e.dir.path().join("go");
    // Writes half its output, waits for the test to say go (after the outage began),
    // then writes the rest.
    let id =
        e.cp.enqueue(script(&format!(
            "for i in $(seq 1 500); do echo \"a $i\"; done; \
             while [ ! -f {g} ]; do sleep 0.05; done; for i in $(seq 1 500); do echo \"b $i\"; done",
            g = go.display()
        )))
        .unwrap();
    e.log_contains(&id, "a 500\n").await;
    e.cp.set_faults(Faults { down: true, ..Default::default() }).await.unwrap();
    std::fs::write(&go, "1").unwrap();
    // The outage itself: the scenario under test lasts 60 s.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(e.cp.job(&id).unwrap().result.is_none());
    e.cp.set_faults(Faults::default()).await.unwrap();

    let v = e.finished(&id).await;
    let r = v.result.clone().unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{v:?}");
    let expected = format!("{}{}", lines(500, "a"), lines(500, "b"));
    assert_eq!(e.output(&id), expected, "log lost or duplicated bytes");
    assert_eq!(r.log_size, e.cp.log(&id).unwrap().len() as u64);
    assert_eq!(v.claims, 1);
}

#[tokio::test]
async fn thirty_percent_5xx_for_a_minute_every_job_runs_exactly_once() {
    let e = env_with(RunnerOptions { actions_limit: 4, ..Default::default() }).await;
    e.cp.set_faults(Faults { error_rate: 0.3, ..Default::default() }).await.unwrap();
    let window = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut ids = Vec::new();
    // Keep jobs flowing through the whole minute of errors.
    while tokio::time::Instant::now() < window {
        let id = e.cp.enqueue(script("for i in $(seq 1 50); do echo \"out $i\"; done")).unwrap();
        ids.push(id);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    e.cp.set_faults(Faults::default()).await.unwrap();
    let expected = lines(50, "out");
    for id in &ids {
        let v = e.finished(id).await;
        assert_eq!(v.result.as_ref().unwrap().status, JobStatus::Succeeded, "{v:?}");
        assert_eq!(e.output(id), expected, "job {id} log");
    }
    for id in &ids {
        assert_eq!(started_count(&e.runner.state_dir, id), 1, "job {id} did not run exactly once");
    }
    let counts = e.cp.request_counts();
    assert!(ids.len() >= 25, "only {} jobs in the minute", ids.len());
    assert!(counts.values().sum::<u64>() > 100, "{counts:?}");
}

#[tokio::test]
async fn kill_9_mid_job_is_reported_interrupted_not_rerun() {
    let mut e = env().await;
    let id = e.cp.enqueue(script("echo partial; exec sleep 3201")).unwrap();
    e.log_contains(&id, "partial").await;
    assert_eq!(processes_matching("sleep 3201").len(), 1);
    e.runner.kill9().await;
    // The sandbox dies with the runner (PR_SET_PDEATHSIG down to its pid namespace).
    assert_eq!(gone("sleep 3201").await, Vec::<i32>::new(), "the job outlived a kill -9 of the runner");

    e.runner.spawn(None).unwrap();
    let v = e.finished(&id).await;
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::Interrupted);
    assert!(r.error.unwrap().contains("not re-run"));
    assert_eq!(started_count(&e.runner.state_dir, &id), 1, "the job ran again after restart");
    // The spooled output from before the crash is delivered.
    assert_eq!(e.output(&id), "partial\n");
    let show = e.cli_json(&["jobs", "show", &id]);
    assert_eq!(show["finished"]["status"], "interrupted");
    // And the restarted runner keeps working.
    let next = e.cp.enqueue(script("echo after")).unwrap();
    assert_eq!(e.finished(&next).await.result.unwrap().status, JobStatus::Succeeded);
}

/// Past its log cap a job's tail is in a ring beside the spool: a runner killed then
/// puts it after the head on restart, as the job's end would have.
#[tokio::test]
async fn kill_9_past_the_log_cap_keeps_the_head_and_the_tail() {
    let mut e = env_with(RunnerOptions { jobs_extra: "log_max_mib = 1".into(), ..Default::default() }).await;
    let id = e.cp.enqueue(script("seq 1 600000; echo last-line-before-the-crash; exec sleep 3203")).unwrap();
    let ring = e.runner.state_dir.join(format!("spool/{id}.tail"));
    let deadline = std::time::Instant::now() + WAIT;
    while !std::fs::read(&ring)
        .is_ok_and(|b| String::from_utf8_lossy(&b).contains("last-line-before-the-crash"))
    {
        assert!(std::time::Instant::now() < deadline, "the job's tail never reached its ring");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    e.runner.kill9().await;
    e.runner.spawn(None).unwrap();
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Interrupted);
    let log = e.output(&id);
    assert!(log.starts_with("1\n2\n3\n"), "the head: {}", &log[..200]);
    // Omitted: all the job printed past the cap, give or take the runner's note at the cap.
    let printed: u64 = (1..=600_000u64).map(|i| i.to_string().len() as u64 + 1).sum::<u64>() + 27;
    let beyond = (r.log_omitted_bytes + (1 << 20))
        .checked_sub(printed)
        .expect("less omitted than printed past the cap");
    assert!(beyond < 1024, "{beyond} bytes more than the job printed");
    assert!(log.contains(&format!("[runner] … {} bytes omitted …\n", r.log_omitted_bytes)), "no marker");
    let end = log.rfind("last-line-before-the-crash\n").expect("the tail is in the log");
    assert!(log[end..].contains("log truncated"), "{}", &log[end..]);
    assert!(log.contains("599999\n600000\nlast-line"), "the tail is in order");
    assert!(!ring.exists(), "the ring was left behind");
}

#[tokio::test]
async fn first_sigterm_drains_the_running_job_then_exits() {
    let (mut e, notify) = env_with_notify().await;
    let go = e.dir.path().join("go");
    let id =
        e.cp.enqueue(script(&format!(
            "echo waiting; while [ ! -f {g} ]; do sleep 0.05; done; echo finished",
            g = go.display()
        )))
        .unwrap();
    e.log_contains(&id, "waiting").await;
    e.runner.signal(Signal::SIGTERM);
    wait_notify(&notify, "STOPPING=1").await;
    // Jobs enqueued after the stop request are not picked up.
    let later = e.cp.enqueue(script("echo should-not-run")).unwrap();
    std::fs::write(&go, "1").unwrap();
    let v = e.finished(&id).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded);
    let status = e.runner.wait_exit(WAIT).await.expect("runner exits after draining");
    assert!(status.success(), "{status:?}\n{}", e.runner.log());
    // The server may have handed it to the poll the runner abandoned when it began to
    // drain (it is offered again later); what matters is that it was never claimed.
    let later = e.cp.job(&later).unwrap();
    assert!(matches!(later.state, JobState::Pending | JobState::Offered), "{later:?}");
    assert_eq!(later.claims, 0, "a job was claimed while draining");
    // The CLI still works with the daemon stopped; `status` says so (exit 3).
    let out = e.runner.cli(&["status", "--output", "json"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["daemon_running"], false);
    assert_eq!(st["jobs_by_status"]["succeeded"], 1);
}

#[tokio::test]
async fn second_sigterm_cancels_the_running_job() {
    let (mut e, notify) = env_with_notify().await;
    let id = e.cp.enqueue(script("echo started; exec sleep 300")).unwrap();
    e.log_contains(&id, "started").await;
    e.runner.signal(Signal::SIGTERM);
    wait_notify(&notify, "STOPPING=1").await;
    e.runner.signal(Signal::SIGTERM);
    let v = e.finished(&id).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Cancelled);
    let status = e.runner.wait_exit(WAIT).await.expect("runner exits");
    assert!(status.success());
}

#[tokio::test]
async fn bad_config_reports_every_error_at_once_with_ex_usage() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(
        &cfg,
        "[control_plane]\nurl = \"http://192.0.2.1\"\npublic_keys = []\ncolour = \"blue\"\n[poll]\nwait_secs = 0\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN).args(["run", "--config"]).arg(&cfg).output().unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "control_plane.url",
        "control_plane.public_keys",
        "control_plane.colour",
        "runner.install_id",
        "poll.wait_secs",
    ] {
        assert!(err.contains(needle), "missing {needle} in:\n{err}");
    }
    assert!(!dir.path().join("state").exists());
    // Same problems, machine-readable.
    let out = std::process::Command::new(BIN)
        .args(["config", "validate", "-o", "json", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["problems"].as_array().unwrap().len(), 5);
    // A missing file is a usage error too.
    let out =
        std::process::Command::new(BIN).args(["run", "--config", "/nonexistent.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(64));
}

#[tokio::test]
async fn used_bootstrap_token_is_refused_with_a_clear_error() {
    use byoc_control_plane::harness::RunnerProcess;
    let cp = start_cp().await;
    let token = cp.bootstrap_token();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut first =
        RunnerProcess::prepare(Path::new(BIN), d1.path(), &cp, &RunnerOptions::default()).unwrap();
    first.spawn(Some(token.clone())).unwrap();
    assert!(wait_polling(&cp, WAIT).await);
    let mut second =
        RunnerProcess::prepare(Path::new(BIN), d2.path(), &cp, &RunnerOptions::default()).unwrap();
    second.spawn(Some(token)).unwrap();
    let status = second.wait_exit(WAIT).await.expect("second runner exits");
    assert!(!status.success());
    assert!(second.log().contains("one-time"), "{}", second.log());
    assert_eq!(cp.runners().len(), 1);
    first.kill9().await;
}

#[tokio::test]
async fn a_claim_answered_after_the_runner_died_is_settled_as_interrupted_on_restart() {
    let (mut e, notify) = env_with_notify().await;
    e.runner.signal(Signal::SIGTERM);
    wait_notify(&notify, "STOPPING=1").await;
    assert!(e.runner.wait_exit(WAIT).await.unwrap().success());
    // The runner journaled `received` and sent the claim; the control plane recorded it;
    // the runner died before the answer came back (no `claimed` in its journal).
    let id = e.cp.enqueue(script("echo must-not-run")).unwrap();
    let delivery = e.cp.simulate_lost_claim_answer(&id).unwrap();
    let line = serde_json::json!({
        "ts": 1, "event": "received", "job_id": id, "delivery_id": delivery,
        "nonce": e.cp.job(&id).unwrap().nonce, "expires_at": i64::MAX, "kind": "action.script",
        "operation": "trigger", "entity": "action", "payload_sha256": "00", "timeout_secs": 60
    });
    let journal = e.runner.state_dir.join("journal.jsonl");
    let mut text = std::fs::read_to_string(&journal).unwrap();
    text.push_str(&format!("{line}\n"));
    std::fs::write(&journal, text).unwrap();

    e.runner.spawn(None).unwrap();
    let v = e.finished(&id).await;
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::Interrupted);
    assert!(r.error.unwrap().contains("it was not run"));
    assert_eq!(started_count(&e.runner.state_dir, &id), 0, "the job was run");
    assert_eq!(e.output(&id), "");
}
