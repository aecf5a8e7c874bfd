//! HTTPS to the control plane: a custom CA bundle, an HTTPS_PROXY tunnel, and refusal
//! of a server whose certificate does not chain to a trusted root.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::path::Path;

use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_control_plane::proxy::ConnectProxy;
use byoc_control_plane::tls::test_pki;
use byoc_control_plane::{ControlPlane, ControlPlaneConfig};
use byoc_protocol::JobStatus;
use common::*;

async fn tls_cp() -> (ControlPlane, String) {
    let pki = test_pki().unwrap();
    let cp = ControlPlane::start(ControlPlaneConfig { tls: Some(pki.server), ..Default::default() })
        .await
        .unwrap();
    assert!(cp.runner_url().starts_with("https://localhost:"));
    (cp, pki.ca_pem)
}

#[tokio::test]
async fn https_with_a_custom_ca_through_an_https_proxy() {
    let (cp, ca_pem) = tls_cp().await;
    let proxy = ConnectProxy::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, ca_pem).unwrap();
    let opts = RunnerOptions {
        control_plane_extra: format!("ca_bundle = \"{}\"", ca.display()),
        env: vec![("HTTPS_PROXY".into(), proxy.url()), ("NO_PROXY".into(), String::new())],
        ..Default::default()
    };
    let mut runner = RunnerProcess::start(Path::new(BIN), dir.path(), &cp, &opts).unwrap();
    assert!(wait_polling(&cp, WAIT).await, "runner never polled over TLS:\n{}", runner.log());
    let id = cp.enqueue(script("echo over tls")).unwrap();
    let v = cp.wait_for(&id, WAIT, |v| v.result.is_some()).await.expect("job finished");
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded);
    assert_eq!(job_output(&cp.log(&id).unwrap()), "over tls\n");
    assert!(proxy.tunnels() >= 1, "the runner did not go through HTTPS_PROXY");
    runner.kill9().await;
}

#[tokio::test]
async fn a_certificate_from_an_untrusted_ca_is_refused() {
    let (cp, _) = tls_cp().await;
    let dir = tempfile::tempdir().unwrap();
    let mut runner =
        RunnerProcess::start(Path::new(BIN), dir.path(), &cp, &RunnerOptions::default()).unwrap();
    assert!(wait_log(&runner, "certificate", WAIT).await, "no certificate error logged:\n{}", runner.log());
    assert!(cp.runners().is_empty(), "the runner enrolled with an untrusted server");
    assert!(!runner.state_dir.join("enrollment.json").exists());
    runner.kill9().await;
}
