//! Metrics (issue 21): the daemon's textfile for node_exporter and `byoc-runner metrics`
//! say the same, parsed here as Prometheus' text format.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;

use byoc_control_plane::harness::RunnerOptions;
use byoc_control_plane::{EnqueueRequest, Tamper};
use byoc_protocol::JobStatus;
use common::*;

/// `name{labels}` → value, every sample line; each family has its HELP and TYPE.
fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut samples = BTreeMap::new();
    let mut typed = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let name = parts.next().unwrap();
            let kind = parts.next().unwrap();
            assert!(["gauge", "counter", "summary"].contains(&kind), "{line}");
            typed.insert(name.to_string());
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not a sample: {line:?}"));
        let name = key.split('{').next().unwrap();
        assert!(typed.contains(name), "{name} has no TYPE line before its samples");
        assert!(name.starts_with("byoc_runner_"), "{line}");
        samples.insert(key.to_string(), value.parse::<f64>().unwrap_or_else(|_| panic!("bad value: {line}")));
    }
    samples
}

#[tokio::test]
async fn the_textfile_and_the_command_report_jobs_refusals_audit_and_disk() {
    let e = env_with(RunnerOptions {
        extra: "[metrics]\ntextfile = \"@RUNNER_DIR@/metrics.prom\"\n".into(),
        ..Default::default()
    })
    .await;
    let ok = e.cp.enqueue(script("echo measured")).unwrap();
    let bad =
        e.cp.enqueue(EnqueueRequest {
            tamper: Tamper { bad_signature: true, ..Default::default() },
            ..EnqueueRequest::new("runner.noop", serde_json::Value::Null)
        })
        .unwrap();
    assert_eq!(e.finished(&ok).await.result.unwrap().status, JobStatus::Succeeded);
    e.rejected(&bad).await;

    // The daemon rewrites the file every 15 s: wait for one that has seen both jobs.
    let path = e.dir.path().join("metrics.prom");
    let deadline = std::time::Instant::now() + WAIT;
    let file = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let m = parse(&text);
        if m.get("byoc_runner_jobs{status=\"succeeded\"}") == Some(&1.0)
            && m.get("byoc_runner_rejections{reason=\"bad_signature\"}") == Some(&1.0)
        {
            break m;
        }
        assert!(std::time::Instant::now() < deadline, "the textfile never showed both jobs:\n{text}");
        // Condition polling on a file the daemon replaces; not a timed wait.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_eq!(file["byoc_runner_daemon_running"], 1.0);
    assert_eq!(file["byoc_runner_jobs_running"], 0.0);
    assert!(file["byoc_runner_audit_records"] >= 8.0, "{file:?}");
    assert!(file["byoc_runner_disk_free_bytes"] > 0.0);
    assert_eq!(file["byoc_runner_disk_low"], 0.0);
    assert!(file["byoc_runner_state_bytes{part=\"job_logs\"}"] > 0.0);
    assert!(file["byoc_runner_resident_memory_bytes"] > 1e6, "{file:?}");
    assert!(file.contains_key("byoc_runner_pickup_seconds{quantile=\"0.5\"}"));
    assert_eq!(file["byoc_runner_policy_decisions_total{verdict=\"deny\"}"], 0.0);
    assert_eq!(file["byoc_runner_jobs_finished_total{status=\"succeeded\"}"], 1.0, "{file:?}");
    assert!(!path.with_extension("prom.tmp").exists(), "the textfile is not replaced atomically");

    // The command reads the same state.
    let out = e.runner.cli(&["metrics"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cli = parse(&String::from_utf8_lossy(&out.stdout));
    for key in [
        "byoc_runner_jobs{status=\"succeeded\"}",
        "byoc_runner_rejections{reason=\"bad_signature\"}",
        "byoc_runner_daemon_running",
        "byoc_runner_jobs_finished_total{status=\"succeeded\"}",
    ] {
        assert_eq!(cli[key], file[key], "{key}");
    }
    let json = e.cli_json(&["metrics"]);
    assert!(
        json.as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == "byoc_runner_jobs" && s["labels"]["status"] == "succeeded")
    );
}
