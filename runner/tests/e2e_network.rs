//! The job's network boundary, end to end, on a network the test builds
//! (`byoc_control_plane::netlab`): the runner, the control plane and moto run in a
//! namespace whose loopback also answers as IMDS (IPv4 and IPv6) and the ECS/EKS
//! credential addresses, with a service on its 127.0.0.1 and on its own address; an
//! "outside" host (198.51.100.1, 2001:db8::1, `outside.test` through its DNS server)
//! sits behind a veth pair. Nothing leaves the machine.
#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::net::SocketAddr;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::RunnerOptions;
use byoc_control_plane::netlab::{NetLab, RUNNER_V4, Tripwire};
use byoc_protocol::{JobStatus, RejectReason};
use common::*;

/// `[sandbox.egress]` with the outside DNS server as the upstream, plus `extra`.
fn egress(extra: &str) -> RunnerOptions {
    RunnerOptions {
        sandbox_extra: format!("\n[sandbox.egress]\nnameservers = [\"198.51.100.1\"]\n{extra}\n"),
        ..Default::default()
    }
}

/// Fake services a job must never reach, on the runner namespace's addresses.
struct Tripwires {
    all: Vec<(&'static str, Tripwire)>,
}

impl Tripwires {
    async fn start() -> Tripwires {
        let mut all = Vec::new();
        for (name, addr) in [
            ("IMDS", "169.254.169.254:80"),
            ("IMDS over IPv6", "[fd00:ec2::254]:80"),
            ("ECS credentials", "169.254.170.2:80"),
            ("EKS pod identity", "169.254.170.23:80"),
            ("a service on the host's loopback", "127.0.0.1:0"),
        ] {
            all.push((name, Tripwire::start(addr.parse().unwrap()).await));
        }
        let on_host: SocketAddr = format!("{RUNNER_V4}:0").parse().unwrap();
        all.push(("a service on the host's own address", Tripwire::start(on_host).await));
        Tripwires { all }
    }

    fn addrs(&self) -> Vec<SocketAddr> {
        self.all.iter().map(|(_, t)| t.addr).collect()
    }

    fn assert_untouched(&self) {
        for (name, t) in &self.all {
            assert_eq!(t.hits(), 0, "{name} at {} was reached", t.addr);
        }
    }
}

/// A bash script: try each target, print `reached <t>` or `blocked <t>`.
fn reach_script(targets: &[String]) -> serde_json::Value {
    let mut s = String::new();
    for t in targets {
        s.push_str(&format!(
            "if curl -sS -m 5 -o /dev/null -g '{t}' 2>/dev/null; then echo 'reached {t}'; else echo 'blocked {t}'; fi\n"
        ));
    }
    serde_json::json!({ "script": s, "interpreter": "/bin/bash" })
}

fn url(addr: &SocketAddr) -> String {
    format!("http://{addr}/")
}

const OUTSIDE_BY_ADDRESS: &str = "http://198.51.100.1:8080/";
const OUTSIDE_BY_NAME: &str = "http://outside.test:8080/";
const OUTSIDE_BY_IPV6: &str = "http://[2001:db8::1]:8080/";

#[test]
fn a_script_reaches_the_outside_but_not_metadata_the_host_or_the_control_plane() {
    let lab = NetLab::create();
    let outside_hits = lab.outside_hits.clone();
    lab.run(move || async move {
        let wires = Tripwires::start().await;
        let e = env_with(egress("")).await;
        let cp_addr: SocketAddr = e.cp.runner_url().trim_start_matches("http://").parse().unwrap();
        let mut targets: Vec<String> = wires.addrs().iter().map(url).collect();
        targets.push(url(&cp_addr));
        let id = e.cp.enqueue(EnqueueRequest::new("action.script", reach_script(&targets))).unwrap();
        let outside = e
            .cp
            .enqueue(EnqueueRequest::new(
                "action.script",
                reach_script(&[OUTSIDE_BY_ADDRESS.into(), OUTSIDE_BY_NAME.into(), OUTSIDE_BY_IPV6.into()]),
            ))
            .unwrap();
        for job in [&id, &outside] {
            assert_eq!(e.finished(job).await.result.unwrap().status, JobStatus::Succeeded, "{}", e.output(job));
        }
        let out = e.output(&id);
        for t in &targets {
            assert!(out.contains(&format!("blocked {t}")), "{t} was reachable:\n{out}");
        }
        wires.assert_untouched();
        let out = e.output(&outside);
        for t in [OUTSIDE_BY_ADDRESS, OUTSIDE_BY_NAME, OUTSIDE_BY_IPV6] {
            assert!(out.contains(&format!("reached {t}")), "{t} unreachable:\n{out}");
        }
        assert_eq!(outside_hits.load(std::sync::atomic::Ordering::SeqCst), 3);
        // The job's log and its `started` record say which network it got.
        let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
        assert!(
            log.contains("[sandbox] network: user-mode (slirp4netns), egress to any address not blocked, metadata and host blocked"),
            "{log}"
        );
        let started = audit_events(&e.runner.state_dir, "job_started");
        let mine = started.iter().find(|r| r["job"] == id.as_str()).unwrap();
        assert!(mine["detail"].as_str().unwrap().starts_with("network: user-mode"), "{mine}");
    });
}

#[test]
fn the_sandbox_probe_finds_every_network_escape_closed() {
    let lab = NetLab::create();
    lab.run(|| async {
        let wires = Tripwires::start().await;
        let e = env_with(egress("")).await;
        let probe = e.dir.path().join("probe");
        if std::fs::hard_link(BIN, &probe).is_err() {
            std::fs::copy(BIN, &probe).unwrap();
        }
        let cp_addr = e.cp.runner_url().trim_start_matches("http://").to_string();
        let mut args: Vec<String> = wires.addrs().iter().map(|a| format!("--unreachable {a}")).collect();
        args.push(format!("--unreachable {cp_addr}"));
        let id =
            e.cp.enqueue(EnqueueRequest::new(
                "action.script",
                serde_json::json!({"script": format!(
                    "exec {} sandbox-probe --runner-pid {} --state-dir {} {}",
                    probe.display(),
                    e.runner.pid().unwrap(),
                    e.runner.state_dir.display(),
                    args.join(" ")
                )}),
            ))
            .unwrap();
        let v = e.finished(&id).await;
        let out = e.output(&id);
        assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{out}");
        let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let checks = report["checks"].as_array().unwrap();
        let failed: Vec<&serde_json::Value> = checks.iter().filter(|c| c["held"] != true).collect();
        assert!(failed.is_empty(), "escapes possible: {failed:#?}");
        let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
        for needed in [
            "unreachable:169.254.169.254:80",
            "unreachable:[fd00:ec2::254]:80",
            "routes_unchangeable",
            "raw_socket_refused",
        ] {
            assert!(names.contains(&needed), "{needed} not checked: {names:?}");
        }
        assert!(names.contains(&format!("unreachable:{cp_addr}").as_str()));
        wires.assert_untouched();
    });
}

#[test]
fn an_allow_list_limits_egress_to_what_the_customer_listed() {
    let lab = NetLab::create();
    let outside_hits = lab.outside_hits.clone();
    lab.run(move || async move {
        let targets = [OUTSIDE_BY_ADDRESS.to_string(), OUTSIDE_BY_NAME.into(), OUTSIDE_BY_ADDRESS.into()];
        // An allow-list that leaves the outside host out: neither its address nor its
        // name (the lookup itself is refused).
        {
            let e = env_with(egress("allow = [\"203.0.113.0/24\", \"other.test\"]")).await;
            let id = e.cp.enqueue(EnqueueRequest::new("action.script", reach_script(&targets[..2]))).unwrap();
            e.finished(&id).await;
            let out = e.output(&id);
            assert!(out.contains(&format!("blocked {OUTSIDE_BY_ADDRESS}")), "{out}");
            assert!(out.contains(&format!("blocked {OUTSIDE_BY_NAME}")), "{out}");
            let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
            assert!(log.contains("egress allow-list 2 entries"), "{log}");
        }
        assert_eq!(outside_hits.load(std::sync::atomic::Ordering::SeqCst), 0);
        // Its range: by address only (its name is not on the list). The range holds
        // the resolver too, which the job may not ask directly: DNS is the runner's.
        {
            let e = env_with(egress("allow = [\"198.51.100.0/24\"]")).await;
            let mut script = reach_script(&targets[..2]);
            let dns = "if (exec 3<>/dev/udp/198.51.100.1/53) 2>/dev/null; then echo 'resolver open'; \
                       else echo 'resolver closed'; fi\n";
            script["script"] = format!("{}{dns}", script["script"].as_str().unwrap()).into();
            let id = e.cp.enqueue(EnqueueRequest::new("action.script", script)).unwrap();
            e.finished(&id).await;
            let out = e.output(&id);
            assert!(out.contains(&format!("reached {OUTSIDE_BY_ADDRESS}")), "{out}");
            assert!(out.contains(&format!("blocked {OUTSIDE_BY_NAME}")), "{out}");
            assert!(out.contains("resolver closed"), "the job could ask a resolver itself:\n{out}");
        }
        // Its name: what the name resolves to is routed once the job resolves it.
        {
            let e = env_with(egress("allow = [\"outside.test\"]")).await;
            let id = e.cp.enqueue(EnqueueRequest::new("action.script", reach_script(&targets))).unwrap();
            e.finished(&id).await;
            let out: Vec<String> = e.output(&id).lines().map(str::to_string).collect();
            assert_eq!(
                out,
                [
                    format!("blocked {OUTSIDE_BY_ADDRESS}"),
                    format!("reached {OUTSIDE_BY_NAME}"),
                    format!("reached {OUTSIDE_BY_ADDRESS}")
                ]
            );
        }
        // The allow-list never opens what is always blocked, whatever it lists.
        {
            let wires = Tripwires::start().await;
            let e = env_with(egress("allow = [\"0.0.0.0/0\", \"::/0\"]")).await;
            let targets: Vec<String> = wires.addrs().iter().map(url).collect();
            let id = e.cp.enqueue(EnqueueRequest::new("action.script", reach_script(&targets))).unwrap();
            e.finished(&id).await;
            let out = e.output(&id);
            assert!(!out.contains("reached"), "{out}");
            wires.assert_untouched();
        }
    });
}

/// `ip` as the lab creates links with (iproute2).
fn ip(args: &str) {
    let st = std::process::Command::new("ip").args(args.split(' ')).status().expect("ip (iproute2)");
    assert!(st.success(), "ip {args}");
}

/// A bridge created while a job runs (what Docker does for a network created later)
/// is closed to the job as it appears: its gateway, a host address, and the subnet
/// behind it, where another job's containers would be. A job started afterwards has
/// both closed from its start.
#[test]
fn a_network_created_while_a_job_runs_is_closed_to_it() {
    let lab = NetLab::create();
    lab.run(|| async {
        let e = env_with(egress("")).await;
        let go = e.dir.path().join("go");
        let rules = "PATH=$PATH:/usr/sbin:/sbin; ip rule show | grep -F 172.30. || true";
        let script = format!(
            "echo waiting\n\
             while [ ! -e {go} ]; do sleep 0.05; done\n\
             PATH=$PATH:/usr/sbin:/sbin\n\
             for i in $(seq 200); do ip rule show | grep -qF 'to 172.30.0.0/16' && break; sleep 0.05; done\n\
             {rules}\n\
             if curl -sS -m 5 -o /dev/null http://172.30.0.1:8081/ 2>/dev/null; then echo reached gateway; \
             else echo blocked gateway; fi\n",
            go = go.display()
        );
        let id =
            e.cp.enqueue(EnqueueRequest::new(
                "action.script",
                serde_json::json!({ "script": script, "interpreter": "/bin/bash" }),
            ))
            .unwrap();
        e.log_contains(&id, "waiting").await;
        ip("link add byoc-test-br type bridge");
        ip("addr add 172.30.0.1/16 dev byoc-test-br");
        ip("link set byoc-test-br up");
        let gateway = Tripwire::start("172.30.0.1:8081".parse().unwrap()).await;
        std::fs::write(&go, b"").unwrap();
        assert_eq!(e.finished(&id).await.result.unwrap().status, JobStatus::Succeeded, "{}", e.output(&id));
        let out = e.output(&id);
        assert!(out.contains("to 172.30.0.1 prohibit"), "the gateway was not closed:\n{out}");
        assert!(out.contains("to 172.30.0.0/16 prohibit"), "the bridged subnet was not closed:\n{out}");
        assert!(out.contains("blocked gateway"), "{out}");
        assert_eq!(gateway.hits(), 0, "the new network's gateway was reached");
        // A job that starts with the bridge there has it closed from the start.
        let later =
            e.cp.enqueue(EnqueueRequest::new("action.script", serde_json::json!({ "script": rules })))
                .unwrap();
        e.finished(&later).await;
        let out = e.output(&later);
        assert!(out.contains("to 172.30.0.1 prohibit") && out.contains("to 172.30.0.0/16 prohibit"), "{out}");
        assert!(
            e.runner.log().contains("A host address appeared: closed to a running job."),
            "{}",
            e.runner.log()
        );
    });
}

#[test]
fn jobs_get_their_role_credentials_only_inside_their_own_namespace() {
    let lab = NetLab::create();
    lab.run(|| async {
        use common::roles::*;
        let moto = moto_with_stack(&base_params()).await;
        let mut opts = role_options(&moto, "session_min_secs = 1\nsession_max_secs = 3\nrefresh_before_secs = 1");
        opts.sandbox_extra = egress("").sandbox_extra;
        let e = env_with(opts).await;
        let moto_addr = moto.url().trim_start_matches("http://").trim_end_matches('/').to_string();
        // A role job reads its credentials twice, 4 s apart (sessions last 3 s); a job
        // with no role tries the same endpoint address, and moto, at the same time.
        let script = r#"get() { curl -s -H "Authorization: $AWS_CONTAINER_AUTHORIZATION_TOKEN" "$AWS_CONTAINER_CREDENTIALS_FULL_URI"; }
kid() { printf '%s' "$1" | sed 's/.*"AccessKeyId":"\([^"]*\)".*/\1/' | sha256sum | cut -c1-16; }
a=$(get); sleep 4; b=$(get)
echo "URI=$AWS_CONTAINER_CREDENTIALS_FULL_URI" >> "$BYOC_OUTPUT"
echo "FIRST=$(kid "$a")" >> "$BYOC_OUTPUT"
echo "LAST=$(kid "$b")" >> "$BYOC_OUTPUT""#;
        let with_role = e
            .cp
            .enqueue(role_job("component", "deploy", "inst-demo-maintenance", named("api"), script))
            .unwrap();
        e.log_contains(&with_role, "assumed role").await;
        let other = e
            .cp
            .enqueue(EnqueueRequest::new(
                "action.script",
                reach_script(&["http://127.0.0.1:80/v1/credentials".into(), format!("http://{moto_addr}/")]),
            ))
            .unwrap();
        let r = e.finished(&with_role).await.result.unwrap();
        assert_eq!(r.status, JobStatus::Succeeded, "{}", e.output(&with_role));
        assert_eq!(r.outputs["URI"], "http://127.0.0.1:80/v1/credentials");
        assert_ne!(r.outputs["FIRST"], r.outputs["LAST"], "a renewed session: {}", r.outputs);
        assert_eq!(r.outputs["FIRST"].as_str().unwrap().len(), 16);
        e.finished(&other).await;
        let out = e.output(&other);
        assert!(!out.contains("reached"), "{out}");
        // And from the runner's own namespace there is no endpoint at all.
        assert!(std::net::TcpStream::connect("127.0.0.1:80").is_err());
    });
}

#[test]
fn terraform_runs_in_the_jobs_namespace() {
    let lab = NetLab::create();
    let outside_hits = lab.outside_hits.clone();
    lab.run(move || async move {
        let wires = Tripwires::start().await;
        let terraform = which("terraform");
        let policies = tempfile::tempdir().unwrap();
        let mut opts = egress("");
        opts.extra = format!(
            "\n[terraform]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n",
            terraform.display(),
            policies.path().display()
        );
        let e = env_with(opts).await;
        let mut targets = vec![OUTSIDE_BY_NAME.to_string()];
        targets.extend(wires.addrs().iter().map(url));
        let mut command = String::new();
        for t in &targets {
            command.push_str(&format!(
                "if curl -sS -m 5 -o /dev/null -g '{t}' 2>/dev/null; then echo 'reached {t}'; else echo 'blocked {t}'; fi; "
            ));
        }
        let main_tf = format!(
            "resource \"terraform_data\" \"probe\" {{\n  provisioner \"local-exec\" {{\n    command = <<-EOT\n{command}\nEOT\n    interpreter = [\"/bin/bash\", \"-c\"]\n  }}\n}}\n"
        );
        let req = EnqueueRequest {
            timeout_secs: 300,
            entity: "component".into(),
            operation: "deploy".into(),
            ..EnqueueRequest::new(
                "terraform",
                serde_json::json!({"mode": "apply", "files": {"main.tf": main_tf}, "workspace": "net"}),
            )
        };
        let id = e.cp.enqueue(req).unwrap();
        let v = e.finished(&id).await;
        let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
        assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{log}");
        assert!(log.contains(&format!("reached {OUTSIDE_BY_NAME}")), "{log}");
        for t in &targets[1..] {
            assert!(log.contains(&format!("blocked {t}")), "{t}:\n{log}");
        }
        assert!(log.contains("[sandbox] network: user-mode"), "{log}");
        wires.assert_untouched();
        assert_eq!(outside_hits.load(std::sync::atomic::Ordering::SeqCst), 1);
    });
}

/// The real `hashicorp/aws` provider (the filesystem mirror these machines ship beside
/// terraform, named by the customer's `cli_config_file`) plans and applies real
/// `aws_*` resources (an S3 bucket with its encryption, an IAM role) through a sandboxed
/// terraform job: the job reaches AWS (moto, in the outside namespace) through its own
/// network, the render runs offline, and a second apply finds nothing to change.
#[test]
fn real_aws_resources_are_planned_and_applied_through_the_sandbox() {
    const MIRROR: &str = "/opt/tf-plugins";
    let provider = std::path::Path::new(MIRROR)
        .join("registry.terraform.io/hashicorp/aws/5.100.0/linux_amd64/terraform-provider-aws_v5.100.0_x5");
    assert!(
        provider.is_file(),
        "the real hashicorp/aws provider 5.100.0 is required at {}",
        provider.display()
    );
    let lab = NetLab::create();
    let outside = lab.outside_ns.path();
    lab.run(move || async move {
        let aws = byoc_control_plane::moto::MotoServer::start_in(outside, byoc_control_plane::netlab::OUTSIDE_V4).await;
        let terraform = which("terraform");
        let dir = tempfile::tempdir().unwrap();
        let rc = dir.path().join("terraform.rc");
        std::fs::write(
            &rc,
            format!("provider_installation {{\n  filesystem_mirror {{\n    path    = \"{MIRROR}\"\n    include = [\"registry.terraform.io/hashicorp/aws\"]\n  }}\n}}\n"),
        )
        .unwrap();
        let mut opts = egress("");
        opts.extra = format!(
            "\n[terraform]\nbinary = \"{}\"\ncli_config_file = \"{}\"\n\n[policy]\ndir = \"{}\"\n",
            terraform.display(),
            rc.display(),
            dir.path().display()
        );
        let e = env_with(opts).await;
        let main_tf = r#"terraform {
  required_providers {
    aws = { source = "hashicorp/aws", version = "5.100.0" }
  }
}
variable "endpoint" { type = string }
provider "aws" {
  region                      = "us-east-1"
  access_key                  = "test"
  secret_key                  = "test"
  skip_credentials_validation = true
  skip_requesting_account_id  = true
  skip_metadata_api_check     = true
  s3_use_path_style           = true
  endpoints {
    s3  = var.endpoint
    iam = var.endpoint
    sts = var.endpoint
  }
}
resource "aws_s3_bucket" "assets" {
  bucket = "acme-assets-real"
  tags   = { owner = "platform" }
}
resource "aws_s3_bucket_server_side_encryption_configuration" "assets" {
  bucket = aws_s3_bucket.assets.id
  rule {
    apply_server_side_encryption_by_default { sse_algorithm = "AES256" }
  }
}
resource "aws_iam_role" "app" {
  name = "acme-app"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{ Effect = "Allow", Action = "sts:AssumeRole", Principal = { Service = "ec2.amazonaws.com" } }]
  })
}
output "bucket_arn" { value = aws_s3_bucket.assets.arn }
output "role_arn" { value = aws_iam_role.app.arn }
"#;
        let job = || EnqueueRequest {
            timeout_secs: 600,
            entity: "component".into(),
            operation: "deploy".into(),
            ..EnqueueRequest::new(
                "terraform",
                serde_json::json!({"mode": "apply", "files": {"main.tf": main_tf}, "workspace": "real-aws",
                    "vars": {"endpoint": aws.url()}}),
            )
        };
        let id = e.cp.enqueue(job()).unwrap();
        let r = e.finished(&id).await.result.unwrap();
        let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
        assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
        assert!(log.contains("Installing hashicorp/aws v5.100.0"), "{log}");
        assert!(log.contains("[sandbox] network: user-mode"), "{log}");
        assert_eq!(
            r.outputs["summary"]["addresses"]["create"],
            serde_json::json!([
                "aws_iam_role.app",
                "aws_s3_bucket.assets",
                "aws_s3_bucket_server_side_encryption_configuration.assets"
            ]),
            "{}",
            r.outputs
        );
        assert_eq!(r.outputs["outputs"]["bucket_arn"], "arn:aws:s3:::acme-assets-real", "{}", r.outputs);
        // They exist in that AWS.
        let role = aws.query("iam", &[("Action".into(), "GetRole".into()), ("RoleName".into(), "acme-app".into())]).await;
        assert!(role.contains("arn:aws:iam::123456789012:role/acme-app"), "{role}");
        assert_eq!(aws.bucket_versioning("acme-assets-real").await, Some(false), "no bucket acme-assets-real");
        // Applied again: terraform finds what it made, nothing to change.
        let again = e.cp.enqueue(job()).unwrap();
        let r = e.finished(&again).await.result.unwrap();
        let log = String::from_utf8_lossy(&e.cp.log(&again).unwrap()).into_owned();
        assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
        assert!(log.contains("No changes."), "{log}");
    });
}

fn which(tool: &str) -> std::path::PathBuf {
    let out = std::process::Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().unwrap();
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!path.is_empty(), "{tool} is required on PATH (terraform 1.11 on these machines)");
    std::path::PathBuf::from(path)
}

#[tokio::test]
async fn a_missing_user_mode_stack_refuses_network_jobs_before_anything_runs() {
    let e = env_with(RunnerOptions {
        sandbox_extra: "\n[sandbox.egress]\nslirp4netns = \"/nonexistent/slirp4netns\"\n".into(),
        ..Default::default()
    })
    .await;
    let job = serde_json::json!({"script": "echo job-code-ran"});
    let id = e.cp.enqueue(EnqueueRequest::new("action.script", job)).unwrap();
    let v = e.rejected(&id).await;
    assert_eq!(v.rejections[0].0, RejectReason::SandboxNetworkUnavailable);
    assert!(v.rejections[0].1.contains("apt-get install slirp4netns"), "{:?}", v.rejections);
    assert_eq!(started_count(&e.runner.state_dir, &id), 0, "nothing ran");
    let audited = audit_events(&e.runner.state_dir, "job_rejected");
    assert!(audited.iter().any(|r| r["job"] == id.as_str() && r["reason"] == "sandbox_network_unavailable"));
    // An offline job needs no stack and still runs.
    let offline =
        e.cp.enqueue(EnqueueRequest::new(
            "action.script",
            serde_json::json!({"script": "echo offline", "network": false}),
        ))
        .unwrap();
    assert_eq!(e.finished(&offline).await.result.unwrap().status, JobStatus::Succeeded);
}

#[tokio::test]
async fn a_stack_that_fails_to_start_fails_the_job_before_its_code_runs() {
    // An executable that is not a network stack: it exits at once.
    let e = env_with(RunnerOptions {
        sandbox_extra: "\n[sandbox.egress]\nslirp4netns = \"/bin/false\"\n".into(),
        ..Default::default()
    })
    .await;
    let job = serde_json::json!({"script": "echo job-code-ran"});
    let id = e.cp.enqueue(EnqueueRequest::new("action.script", job)).unwrap();
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "sandbox_network_unavailable", "{r:?}");
    assert!(r.error.as_deref().unwrap().contains("nothing ran"), "{r:?}");
    let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
    assert!(log.contains("exited before the job's network was up"), "{log}");
    assert!(!log.contains("job-code-ran"), "{log}");
}
