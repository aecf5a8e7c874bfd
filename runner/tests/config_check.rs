//! `byoc-runner config check` against a healthy install (TLS control plane with a custom
//! CA, a fake IMDSv2, the install stack in moto) and against broken ones: each check
//! says ok or names what is wrong and what to do.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use tokio::process::Command;

use byoc_control_plane::harness::{RunnerOptions, RunnerProcess};
use byoc_control_plane::imds::{FakeImds, INSTANCE_ID};
use byoc_control_plane::tls::test_pki;
use byoc_control_plane::{ControlPlane, ControlPlaneConfig};
use common::roles::*;
use common::*;

async fn config_check(
    config: &Path,
    env: &[(String, String)],
) -> (i32, BTreeMap<String, (String, String, String)>) {
    let out = Command::new(BIN)
        .args(["config", "check", "-o", "json", "--config"])
        .arg(config)
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy")
        .envs(env.iter().cloned())
        .output()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    });
    assert_eq!(v["ok"], out.status.success(), "{v}");
    let checks = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
            (s("name"), (s("status"), s("detail"), s("fix")))
        })
        .collect();
    (out.status.code().unwrap_or(-1), checks)
}

fn status<'a>(
    checks: &'a BTreeMap<String, (String, String, String)>,
    name: &str,
) -> &'a (String, String, String) {
    checks.get(name).unwrap_or_else(|| panic!("no {name} check in {checks:#?}"))
}

#[tokio::test]
async fn a_healthy_install_passes_every_check() {
    let pki = test_pki().unwrap();
    let cp = ControlPlane::start(ControlPlaneConfig { tls: Some(pki.server), ..Default::default() })
        .await
        .unwrap();
    let moto = moto_with_stack(&base_params()).await;
    let imds = FakeImds::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    let opts = RunnerOptions {
        control_plane_extra: format!("ca_bundle = \"{}\"", ca.display()),
        ..role_options(&moto, "")
    };
    let runner = RunnerProcess::prepare(Path::new(BIN), dir.path(), &cp, &opts).unwrap();
    let mut env = opts.env.clone();
    env.push(("AWS_EC2_METADATA_SERVICE_ENDPOINT".into(), imds.url.clone()));
    env.retain(|(k, _)| k != "AWS_EC2_METADATA_DISABLED");
    let (code, checks) = config_check(&runner.config_path, &env).await;
    for name in [
        "config",
        "state_dir",
        "admin_group",
        "dns",
        "tcp",
        "tls",
        "clock",
        "install_stack",
        "role_arns",
        "terraform",
        "user_namespaces",
        "seccomp",
        "sandbox",
        "cgroups",
        "network_stack",
        "network_boundary",
        "container_busybox",
    ] {
        let (s, detail, _) = status(&checks, name);
        assert_eq!(s, "ok", "{name}: {detail}");
    }
    assert!(status(&checks, "tls").1.contains("certificate trusted"));
    assert!(status(&checks, "imds").1.contains(INSTANCE_ID), "{:?}", status(&checks, "imds"));
    let arns = &status(&checks, "role_arns").1;
    assert!(arns.contains("inst-demo-maintenance") && !arns.contains("inst-demo-deprovision"), "{arns}");
    assert!(status(&checks, "install_stack").1.contains("Deprovision=false"));
    let boundary = &status(&checks, "network_boundary").1;
    for target in ["169.254.169.254:80", "[fd00:ec2::254]:80", "169.254.170.2:80", "127.0.0.1:"] {
        assert!(boundary.contains(target), "{target} not probed: {boundary}");
    }
    assert_eq!(code, 0, "{checks:#?}");
}

#[tokio::test]
async fn a_broken_install_fails_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let moto = moto_with_stack(&base_params()).await;
    // Free now, and no server this suite starts is given it.
    let closed = byoc_control_plane::ports::free_port();
    let config = dir.path().join("runner.toml");
    std::fs::write(
        &config,
        format!(
            "[control_plane]\nurl = \"https://localhost:{closed}\"\npublic_keys = [\"11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=\"]\n\n\
             [runner]\ninstall_id = \"inst-demo\"\nstate_dir = \"{}\"\n\n\
             [aws]\nregion = \"us-east-1\"\nendpoint_url = \"{}\"\n\n[roles]\nstack_name = \"no-such-stack\"\nbusybox = \"/bin/ls\"\n\n\
             [sandbox.egress]\nslirp4netns = \"/nonexistent/slirp4netns\"\n",
            dir.path().join("state").display(),
            moto.url()
        ),
    )
    .unwrap();
    let env = vec![
        // The runner's identity comes from IMDS here, and IMDS does not answer.
        ("AWS_EC2_METADATA_SERVICE_ENDPOINT".to_string(), format!("http://127.0.0.1:{closed}")),
        ("AWS_ACCESS_KEY_ID".to_string(), "x".to_string()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), "y".to_string()),
    ];
    let (code, checks) = config_check(&config, &env).await;
    assert_eq!(code, 1);
    let (s, detail, fix) = status(&checks, "tcp");
    assert_eq!(s, "fail", "{detail}");
    assert!(detail.contains("refused"), "{detail}");
    // Refused is an answer: the host is reached, nothing listens on that port.
    assert!(fix.contains(&format!("nothing listens on port {closed}")) && !fix.contains("egress"), "{fix}");
    assert_eq!(status(&checks, "tls").0, "skip");
    assert_eq!(status(&checks, "clock").0, "skip");
    let (s, detail, fix) = status(&checks, "install_stack");
    assert_eq!(s, "fail");
    assert!(detail.contains("no-such-stack"), "{detail}");
    assert!(fix.contains("cloudformation:DescribeStacks"), "{fix}");
    let (s, detail, _) = status(&checks, "imds");
    assert_eq!(s, "warn", "the runner has other credentials here: {detail}");
    let (s, detail, fix) = status(&checks, "container_busybox");
    assert_eq!(s, "fail", "{detail}");
    assert!(detail.contains("/bin/ls is missing or not statically linked"), "{detail}");
    assert!(detail.contains("sandbox_network_unavailable"), "{detail}");
    assert!(detail.contains("container_output_unavailable"), "{detail}");
    assert!(fix.contains("busybox-static"), "{fix}");
    let (s, detail, fix) = status(&checks, "network_stack");
    assert_eq!(s, "fail", "{detail}");
    assert!(
        detail.contains("/nonexistent/slirp4netns") && detail.contains("sandbox_network_unavailable"),
        "{detail}"
    );
    assert!(fix.contains("apt-get install slirp4netns"), "{fix}");
    assert_eq!(status(&checks, "network_boundary").0, "skip");

    // Without other credentials, IMDS is the runner's identity: a failure.
    let env: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| !k.starts_with("AWS_ACCESS") && !k.starts_with("AWS_SECRET"))
        .collect();
    let (_, checks) = config_check(&config, &env).await;
    assert_eq!(status(&checks, "imds").0, "fail");

    // A configuration that does not validate: named, and the rest that needs it skipped.
    std::fs::write(&config, "[control_plane]\nurl = \"http://example.com\"\n").unwrap();
    let (code, checks) = config_check(&config, &[]).await;
    assert_eq!(code, 1);
    let (s, detail, _) = status(&checks, "config");
    assert_eq!(s, "fail");
    assert!(detail.contains("install_id") && detail.contains("public_keys"), "{detail}");
    for name in ["dns", "tcp", "tls", "imds", "install_stack", "sandbox"] {
        assert_eq!(status(&checks, name).0, "skip", "{name}");
    }
    assert_eq!(status(&checks, "seccomp").0, "ok", "host checks still run");
}

/// No AWS credentials anywhere (no instance role, variables or profile): `roles
/// --refresh` and `config check` say so in a sentence with what to check, not the
/// SDK's debug dump, and without colour codes in a pipe.
#[tokio::test]
async fn without_aws_credentials_the_cli_says_so_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let key = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        ed25519_dalek::SigningKey::from_bytes(&[7u8; 32]).verifying_key().to_bytes(),
    );
    let config = dir.path().join("runner.toml");
    std::fs::write(
        &config,
        format!(
            "[control_plane]\nurl = \"https://cp.vendor.example\"\npublic_keys = [\"{key}\"]\n\n\
             [runner]\ninstall_id = \"inst-1\"\nstate_dir = \"{}\"\n\n[roles]\nstack_name = \"byoc-inst-1\"\n\n\
             [aws]\nregion = \"us-east-1\"\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    // A state dir the runner has used (it made `control/`).
    std::fs::create_dir_all(dir.path().join("state/control")).unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(BIN)
            .args(args)
            .arg("--config")
            .arg(&config)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", dir.path())
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .output()
            .unwrap()
    };
    let out = run(&["roles", "--refresh"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no AWS credentials were found"), "{stderr}");
    assert!(stderr.contains("AWS_EC2_METADATA_DISABLED"), "{stderr}");
    for dump in ["DispatchFailure", "ProviderChainError", "\u{1b}["] {
        assert!(!stderr.contains(dump), "{dump:?} in {stderr}");
    }
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let out = run(&["config", "check", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let stack = v["checks"].as_array().unwrap().iter().find(|c| c["name"] == "install_stack").unwrap();
    assert_eq!(stack["status"], "fail", "{stack}");
    assert!(stack["detail"].as_str().unwrap().contains("no AWS credentials were found"), "{stack}");
    assert!(stack["fix"].as_str().unwrap().contains("instance profile"), "{stack}");
    assert!(!stack["fix"].as_str().unwrap().contains("DescribeStacks"), "{stack}");
}
