//! `action.container` end to end against the real Docker Engine on this machine, with
//! images built offline (`docker import`): locked-down containers, the sandbox probe
//! inside one, masking, outputs, limits, cancellation, and no container left behind.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::path::Path;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::RunnerOptions;
use byoc_protocol::JobStatus;
use common::*;

/// Every peer has the same addresses: one test at a time has one.
static PEER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn container(spec: serde_json::Value) -> EnqueueRequest {
    EnqueueRequest::new("action.container", spec)
}

#[tokio::test]
async fn a_container_runs_locked_down_with_masking_and_outputs() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env().await;
    let id = e
        .cp
        .enqueue(container(serde_json::json!({
            "image": image,
            "command": ["sh", "-c", "echo \"hi $WHO\"; echo \"token $TOKEN\"; id -u; echo result=ok >> \"$BYOC_OUTPUT\"; touch /etc/x 2>&1 || true"],
            "env": {"WHO": "container"},
            "secret_env": {"TOKEN": "tok-container-4242"}
        })))
        .unwrap();
    let v = e.finished(&id).await;
    let r = v.result.unwrap();
    let out = e.output(&id);
    assert_eq!(r.status, JobStatus::Succeeded, "{out} {:?}", r.error);
    assert!(out.contains("hi container"), "{out}");
    assert!(out.contains("token ***") && !out.contains("tok-container-4242"), "{out}");
    assert!(out.contains("65534"), "runs as the unprivileged uid: {out}");
    assert!(out.contains("Read-only file system"), "root filesystem must be read-only: {out}");
    assert_eq!(r.outputs, serde_json::json!({"result": "ok"}));
    assert!(job_containers(&id).is_empty(), "containers left behind: {:?}", job_containers(&id));
}

#[tokio::test]
async fn probe_inside_a_container_finds_every_escape_closed() {
    let e = env().await;
    // The probe is this binary; its shared libraries go into the image with it.
    let ldd = std::process::Command::new("ldd").arg(BIN).output().unwrap();
    let libs: Vec<std::path::PathBuf> = String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(std::path::PathBuf::from)
        .collect();
    // At /probe: the build dir may sit under /work, where the job's directory is mounted.
    let mut files: Vec<(&Path, &Path)> = libs.iter().map(|p| (p.as_path(), p.as_path())).collect();
    files.push((Path::new(BIN), Path::new("/probe")));
    let image = import_image("byoc-test/probe:1", &files);
    let runner_pid = e.runner.pid().unwrap().to_string();
    let id =
        e.cp.enqueue(container(serde_json::json!({
            "image": image,
            "command": ["/probe", "sandbox-probe", "--runner-pid", runner_pid,
                        "--state-dir", e.runner.state_dir.display().to_string(),
                        "--config-dir", e.runner.config_path.parent().unwrap().display().to_string()],
            "env": {"DECLARED": "yes"}
        })))
        .unwrap();
    let v = e.finished(&id).await;
    let out = e.output(&id);
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{out} {:?}", r.error);
    let report: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("probe printed {out}"));
    let failed: Vec<&serde_json::Value> =
        report["checks"].as_array().unwrap().iter().filter(|c| c["held"] != true).collect();
    assert!(failed.is_empty(), "escapes possible from the container: {failed:#?}");
    let env: Vec<&str> =
        report["env_names"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for name in &env {
        assert!(
            ["BYOC_JOB_ID", "BYOC_OUTPUT", "DECLARED", "HOME", "PATH", "HOSTNAME"].contains(name),
            "unexpected variable {name} in the container"
        );
    }
    assert_eq!(report["uid"], 65534);
    assert!(job_containers(&id).is_empty());
}

#[tokio::test]
async fn cancelling_a_container_stops_and_removes_it() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env().await;
    let id =
        e.cp.enqueue(container(serde_json::json!({
            "image": image,
            "command": ["sh", "-c", "trap '' INT TERM; echo ready; while true; do sleep 1; done"]
        })))
        .unwrap();
    e.log_contains(&id, "ready").await;
    // The job's container and the one holding its network namespace (a configurator
    // closing an address another test made may be there for a moment too).
    let running = job_containers(&id);
    for name in [format!("byoc-job-{id}"), format!("byoc-job-{id}-net")] {
        assert!(running.contains(&name), "{name} not running: {running:?}");
    }
    e.cp.cancel(&id).unwrap();
    let v = e.finished(&id).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Cancelled);
    assert!(job_containers(&id).is_empty(), "cancelled container left behind");
}

/// A container that closes its output and runs on is still held to its deadline:
/// timed out, stopped and removed, with what it printed before kept.
#[tokio::test]
async fn a_container_that_closes_its_output_is_held_to_its_deadline() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env().await;
    let mut req = container(serde_json::json!({
        "image": image, "network": false,
        "command": ["sh", "-c", "echo before; exec >&- 2>&-; trap '' INT TERM; while true; do sleep 1; done"]
    }));
    req.timeout_secs = 3;
    let id = e.cp.enqueue(req).unwrap();
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::TimedOut, "{:?}", r.error);
    assert!(e.output(&id).contains("before"));
    assert!(job_containers(&id).is_empty(), "containers left behind: {:?}", job_containers(&id));
}

#[tokio::test]
async fn container_memory_limit_names_itself_and_network_can_be_off() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env_with(RunnerOptions { sandbox_extra: "memory_mib = 64".into(), ..Default::default() }).await;
    let hog =
        e.cp.enqueue(container(serde_json::json!({
            "image": image,
            "command": ["sh", "-c", "set -e; head -c 400000000 /dev/zero | tail > /dev/null"]
        })))
        .unwrap();
    let offline =
        e.cp.enqueue(container(serde_json::json!({
            "image": image, "network": false,
            "command": ["sh", "-c", "ls /sys/class/net 2>/dev/null || cat /proc/net/dev"]
        })))
        .unwrap();
    let r = e.finished(&hog).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert!(r.error.as_deref().unwrap_or("").contains("memory limit of 64 MiB"), "{:?}", r.error);
    let r = e.finished(&offline).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded);
    let out = e.output(&offline);
    assert!(!out.contains("eth0"), "network was not switched off: {out}");
}

#[tokio::test]
async fn an_image_missing_locally_is_refused_without_pulling() {
    let e = env().await;
    let id =
        e.cp.enqueue(container(serde_json::json!({"image": "byoc-test/never-built:1", "command": ["true"]})))
            .unwrap();
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert!(r.error.unwrap().contains("never pulls"));
}

/// A command the image lacks fails the job with the engine's exit code for it (127)
/// and says which, in the job's log; nothing is left behind.
#[tokio::test]
async fn a_command_the_image_lacks_fails_the_job_and_says_so() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env().await;
    let id =
        e.cp.enqueue(container(
            serde_json::json!({"image": image, "command": ["no-such-tool"], "network": false}),
        ))
        .unwrap();
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.exit_code, Some(127), "{:?}", r.error);
    let log = e.output(&id);
    assert!(log.contains("no-such-tool: executable file not found in $PATH"), "{log}");
    assert!(job_containers(&id).is_empty(), "containers left behind: {:?}", job_containers(&id));
}

/// The container runs what the engine would: the image's entrypoint and command, the
/// job's command after the image's entrypoint, the job's entrypoint without the
/// image's command, and the environment the engine made (the image's, the job's
/// winning), with nothing added by the way its output is read.
#[tokio::test]
async fn a_container_runs_its_images_entrypoint_and_command_as_the_engine_would() {
    let image = import_image_with(
        "byoc-test/busybox:entrypoint",
        &[],
        &[r#"ENTRYPOINT ["/bin/echo", "entry"]"#, r#"CMD ["image-cmd"]"#, "ENV GREETING=hello FROM_IMAGE=1"],
    );
    let e = env().await;
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let cases = [
        (serde_json::json!({"image": image, "network": false}), "entry image-cmd"),
        (serde_json::json!({"image": image, "command": ["job-cmd"], "network": false}), "entry job-cmd"),
        (serde_json::json!({"image": image, "entrypoint": ["echo", "own"], "network": false}), "own"),
    ];
    for (spec, expected) in cases {
        let id = e.cp.enqueue(container(spec.clone())).unwrap();
        let r = e.finished(&id).await.result.unwrap();
        assert_eq!(r.status, JobStatus::Succeeded, "{spec}: {:?}", r.error);
        assert_eq!(e.output(&id).trim(), expected, "{spec}");
    }
    let id =
        e.cp.enqueue(container(serde_json::json!({
            "image": image, "entrypoint": ["env"], "env": {"GREETING": "from-job"}, "network": false
        })))
        .unwrap();
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}", r.error);
    let out = e.output(&id);
    let names: Vec<&str> = out.lines().filter_map(|l| l.split_once('=').map(|(k, _)| k)).collect();
    assert!(
        out.lines().any(|l| l == "GREETING=from-job") && out.lines().any(|l| l == "FROM_IMAGE=1"),
        "{out}"
    );
    for added in ["PWD", "SHLVL"] {
        assert!(!names.contains(&added), "{added} was added to the container's environment: {out}");
    }
    // What the refusal without a busybox is checked against.
    let events = engine_events(&id, since);
    assert!(events.iter().any(|a| a == "create") && events.iter().any(|a| a == "start"), "{events:?}");
    // An image with nothing to run and a job that names nothing: failed, nothing created.
    let bare = import_image("byoc-test/busybox:basic", &[]);
    let id = e.cp.enqueue(container(serde_json::json!({"image": bare, "network": false}))).unwrap();
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert!(r.error.as_deref().unwrap_or_default().contains("no entrypoint or command"), "{:?}", r.error);
    assert_eq!(engine_events(&id, since), Vec::<String>::new());
}

/// Without a static busybox the runner cannot read a container's output, so it
/// refuses the job before claiming it, with a reason and what to install, and the
/// engine is asked for nothing.
#[tokio::test]
async fn a_container_job_is_refused_without_a_static_busybox_and_nothing_is_created() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env_with(RunnerOptions {
        // Dynamically linked: it would not run in an image without its libc.
        extra: "[roles]\nbusybox = \"/bin/ls\"\n".into(),
        ..Default::default()
    })
    .await;
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let id = e
        .cp
        .enqueue(container(serde_json::json!({"image": image, "command": ["echo", "ran"], "network": false})))
        .unwrap();
    let v = e.rejected(&id).await;
    let (reason, detail) = v.rejections[0].clone();
    assert_eq!(reason, byoc_protocol::RejectReason::ContainerOutputUnavailable, "{detail}");
    assert!(detail.contains("/bin/ls is missing or not statically linked"), "{detail}");
    assert!(detail.contains("apt-get install busybox-static"), "{detail}");
    assert!(v.result.is_none());
    assert_eq!(engine_events(&id, since), Vec::<String>::new(), "the engine was asked to do something");
}

/// A networked container gets the same boundary as a sandboxed process: a Docker
/// network of its own, link-local (IMDS, ECS/EKS credentials), IMDS over IPv6, the
/// host's addresses and its gateway refused by rules it cannot change, and egress to
/// the rest (a peer host beside the machine).
#[tokio::test]
async fn a_networked_container_reaches_the_outside_but_not_metadata_or_the_host() {
    use byoc_control_plane::netlab::{Peer, Tripwire};
    let image = import_image("byoc-test/busybox:basic", &[]);
    let _one_peer = PEER.lock().await;
    let peer = Peer::create();
    // A service on every address of the host: no container may reach it.
    let wire = Tripwire::start("0.0.0.0:0".parse().unwrap()).await;
    let host_ips: Vec<String> = nix::ifaddrs::getifaddrs()
        .unwrap()
        .filter_map(|i| i.address?.as_sockaddr_in().map(|a| a.ip().to_string()))
        .collect();
    let e = env().await;
    // No packet is sent unless the rules are in place: the first line checks them.
    let mut script = String::from(
        "ip rule | grep -q 169.254.0.0/16 || { echo NO-RULES; exit 1; }\n\
         gw=$(ip route | awk '/^default/ {print $3}')\n\
         try() { if echo | nc -w 3 \"$1\" \"$2\" >/dev/null 2>&1; then echo \"reached $1 $2\"; else echo \"blocked $1 $2\"; fi; }\n",
    );
    for t in ["169.254.169.254 80", "fd00:ec2::254 80", "169.254.170.2 80", "169.254.170.23 80"] {
        script.push_str(&format!("try {t}\n"));
    }
    let port = wire.addr.port();
    script.push_str(&format!("try \"$gw\" {port}\n"));
    for ip in &host_ips {
        script.push_str(&format!("try {ip} {port}\n"));
    }
    script.push_str(&format!("try {} {}\n", peer.addr.ip(), peer.addr.port()));
    let id =
        e.cp.enqueue(container(serde_json::json!({"image": image, "command": ["sh", "-c", script]})))
            .unwrap();
    let v = e.finished(&id).await;
    let out = e.output(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{out}");
    assert!(!out.contains("NO-RULES"), "{out}");
    assert_eq!(out.matches("reached").count(), 1, "only the peer is reachable:\n{out}");
    assert!(out.contains(&format!("reached {} {}", peer.addr.ip(), peer.addr.port())), "{out}");
    assert_eq!(wire.hits.load(std::sync::atomic::Ordering::SeqCst), 0, "the host's service was reached");
    assert_eq!(peer.hits(), 1);
    let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
    assert!(log.contains("[sandbox] network: own Docker network"), "{log}");
    assert!(job_containers(&id).is_empty(), "containers left behind:\n{}", e.runner.log());
    assert!(job_networks(&id).is_empty(), "the job's network left behind");
}

/// A Docker network created while a networked container runs (another job's, or
/// anything else on the host) is closed to it as it appears: its gateway, a host
/// address, and the subnet behind it.
#[tokio::test]
async fn a_docker_network_created_while_a_container_runs_is_closed_to_it() {
    use byoc_control_plane::netlab::Tripwire;
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env().await;
    // Outside Docker's own pools, which the suites' job networks are using.
    let (subnet, gateway) = ("10.213.250.0/24", "10.213.250.1");
    let later = format!("byoc-test-later-{}", std::process::id());
    let _ = std::process::Command::new("docker").args(["network", "rm", &later]).output();
    let script = format!(
        "echo ready\n\
         i=0; until ip rule | grep -q 'to {subnet}'; do i=$((i+1)); [ $i -gt 600 ] && break; sleep 0.1; done\n\
         ip rule | grep 10.213.250. || true\n\
         if echo | nc -w 3 {gateway} \"$1\" >/dev/null 2>&1; then echo reached gateway; else echo blocked gateway; fi\n"
    );
    let wire_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let id =
        e.cp.enqueue(container(serde_json::json!({
            "image": image, "command": ["sh", "-c", script, "sh", wire_port.to_string()]
        })))
        .unwrap();
    e.log_contains(&id, "ready").await;
    let created = std::process::Command::new("docker")
        .args(["network", "create", "--subnet", subnet, &later])
        .output()
        .expect("docker is required");
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let wire = Tripwire::start(format!("{gateway}:{wire_port}").parse().unwrap()).await;
    let v = e.finished(&id).await;
    let _ = std::process::Command::new("docker").args(["network", "rm", &later]).output();
    let out = e.output(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{out}");
    assert!(out.contains(&format!("to {gateway} lookup")), "the gateway was not closed:\n{out}");
    assert!(out.contains(&format!("to {subnet} lookup")), "the subnet was not closed:\n{out}");
    assert!(out.contains("blocked gateway"), "{out}");
    assert_eq!(wire.hits(), 0, "the new network's gateway was reached");
    assert!(job_containers(&id).is_empty(), "containers left behind");
}

/// A networked container after the first starts in a namespace the runner made ahead
/// of it. What appeared on the host since (here a Docker network: its gateway, a host
/// address, and the subnet behind it) is closed before the job's first instruction, not
/// while it runs; the namespace is the job's alone and goes with it.
#[tokio::test]
async fn a_network_made_ahead_is_closed_to_what_appeared_since_before_the_job_starts() {
    use byoc_control_plane::netlab::Tripwire;
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env().await;
    let first = e.cp.enqueue(container(serde_json::json!({"image": image, "command": ["true"]}))).unwrap();
    assert_eq!(e.finished(&first).await.result.unwrap().status, JobStatus::Succeeded);
    let made = e.cp.wait_until(WAIT, |_| e.runner.log().contains("Made a container network ahead")).await;
    assert!(made, "no network was made ahead:\n{}", e.runner.log());
    let enrollment: serde_json::Value =
        serde_json::from_slice(&std::fs::read(e.runner.state_dir.join("enrollment.json")).unwrap()).unwrap();
    let runner_id = enrollment["runner_id"].as_str().unwrap();
    let prepared = |what: &[&str]| -> Vec<String> {
        let out = std::process::Command::new("docker")
            .args(what)
            .args(["--filter", &format!("label=byoc-runner.runner={runner_id}")])
            .args(["--filter", "label=byoc-runner.job=prepared", "--format", "{{.Name}}"])
            .output()
            .expect("docker is required");
        String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_string).collect()
    };
    let ahead = prepared(&["network", "ls"]);
    assert_eq!(ahead.len(), 1, "{ahead:?}");
    // Appears after the namespace was made, before the job arrives. Outside Docker's
    // own pools and the other test's subnet.
    let (subnet, gateway) = ("10.213.251.0/24", "10.213.251.1");
    let later = format!("byoc-test-ahead-{}", std::process::id());
    let _ = std::process::Command::new("docker").args(["network", "rm", &later]).output();
    let created = std::process::Command::new("docker")
        .args(["network", "create", "--subnet", subnet, &later])
        .output()
        .expect("docker is required");
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let wire = Tripwire::start(format!("{gateway}:0").parse().unwrap()).await;
    let port = wire.addr.port();
    // The first thing the job does: no waiting for rules to arrive.
    let script = format!(
        "ip rule | grep 10.213.251. || true\n\
         if echo | nc -w 3 {gateway} {port} >/dev/null 2>&1; then echo reached gateway; else echo blocked gateway; fi\n"
    );
    let second =
        e.cp.enqueue(container(serde_json::json!({"image": image, "command": ["sh", "-c", script]})))
            .unwrap();
    let v = e.finished(&second).await;
    let _ = std::process::Command::new("docker").args(["network", "rm", &later]).output();
    let out = e.output(&second);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{out}");
    let log = String::from_utf8_lossy(&e.cp.log(&second).unwrap()).into_owned();
    assert!(log.contains("made ahead of the job"), "{log}");
    assert!(out.contains(&format!("to {gateway} lookup")), "the gateway was not closed:\n{out}");
    assert!(out.contains(&format!("to {subnet} lookup")), "the subnet was not closed:\n{out}");
    assert!(out.contains("blocked gateway"), "{out}");
    assert_eq!(wire.hits(), 0, "the new network's gateway was reached");
    // The namespace the job used went with it; the next job's is another.
    let now = prepared(&["network", "ls"]);
    assert!(!now.contains(&ahead[0]), "the used network is still there: {now:?}");
    assert!(job_containers(&second).is_empty(), "containers left behind");
}

/// A container under an egress allow-list resolves the listed names, as the runner
/// resolved them through its own resolvers, and no other: Docker's DNS has no
/// resolver to forward to, so an unlisted name neither resolves nor leaves the host.
#[tokio::test]
async fn a_container_under_an_allow_list_resolves_only_the_listed_names() {
    use byoc_control_plane::netlab::{NameServer, PEER_V4, Peer};
    let image = import_image("byoc-test/busybox:basic", &[]);
    let _one_peer = PEER.lock().await;
    let peer = Peer::create();
    let peer_ip: std::net::IpAddr = PEER_V4.parse().unwrap();
    let dns = NameServer::start(&[("allowed.test", peer_ip), ("other.test", peer_ip)]).await;
    let e = env_with(RunnerOptions {
        sandbox_extra: format!(
            "\n[sandbox.egress]\nnameservers = [\"{}\"]\nallow = [\"allowed.test\"]\n",
            dns.addr
        ),
        ..Default::default()
    })
    .await;
    let port = peer.addr.port();
    let script = format!(
        "grep -q allowed.test /etc/hosts || echo NO-HOSTS-ENTRY\n\
         if nslookup other.test >/dev/null 2>&1; then echo resolved other; else echo unresolved other; fi\n\
         if nslookup other.test 127.0.0.11 >/dev/null 2>&1; then echo docker resolved other; fi\n\
         if echo | nc -w 3 allowed.test {port} >/dev/null 2>&1; then echo reached allowed; else echo blocked allowed; fi\n"
    );
    let id =
        e.cp.enqueue(container(serde_json::json!({"image": image, "command": ["sh", "-c", script]})))
            .unwrap();
    let v = e.finished(&id).await;
    let out = e.output(&id);
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{out}");
    assert!(!out.contains("NO-HOSTS-ENTRY"), "{out}");
    assert!(out.contains("unresolved other") && !out.contains("docker resolved other"), "{out}");
    assert!(out.contains("reached allowed"), "{out}");
    assert_eq!(peer.hits(), 1);
    // The runner asked for the listed name; the unlisted one never left by lookup.
    let asked = dns.asked();
    assert!(asked.iter().any(|n| n == "allowed.test"), "{asked:?}");
    assert!(!asked.iter().any(|n| n.contains("other")), "an unlisted name left by lookup: {asked:?}");
    let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
    assert!(log.contains("only listed names resolve"), "{log}");
}

/// The numbers in a job's output, in order.
fn numbers(log: &str) -> Vec<u64> {
    log.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

/// A container without a network printing 1 to 300,000, a line each (1.9 MB).
fn counting(image: &str) -> EnqueueRequest {
    container(serde_json::json!({"image": image, "command": ["seq", "1", "300000"], "network": false}))
}

/// A container's whole output reaches the log, however long (the engine's log stream
/// used to lose the last half of this one).
#[tokio::test]
async fn a_long_container_output_arrives_whole() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env().await;
    let id = e.cp.enqueue(counting(&image)).unwrap();
    let v = e.finished(&id).await;
    let result = v.result.unwrap();
    assert_eq!(result.status, JobStatus::Succeeded, "{:?}", result.error);
    assert_eq!(result.log_omitted_bytes, 0);
    let seen = numbers(&e.output(&id));
    assert_eq!(seen.len(), 300_000, "lines lost: the last is {:?}", seen.last());
    assert!(seen.iter().copied().eq(1..=300_000), "lines out of order or repeated");
    assert!(job_containers(&id).is_empty(), "containers left behind: {:?}", job_containers(&id));
}

/// Past the log cap a container's log is the process path's: the head, the omission
/// marker, the tail.
#[tokio::test]
async fn a_container_output_past_the_cap_keeps_its_head_a_marker_and_its_tail() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env_with(RunnerOptions { jobs_extra: "log_max_mib = 1".into(), ..Default::default() }).await;
    let id = e.cp.enqueue(counting(&image)).unwrap();
    let v = e.finished(&id).await;
    let result = v.result.unwrap();
    assert_eq!(result.status, JobStatus::Succeeded, "{:?}", result.error);
    assert!(result.log_omitted_bytes > 0);
    let log = String::from_utf8_lossy(&e.cp.log(&id).unwrap()).into_owned();
    assert!(log.contains(&format!("… {} bytes omitted …", result.log_omitted_bytes)), "no marker");
    let seen = numbers(&log);
    assert_eq!(seen.first(), Some(&1), "the head is gone");
    assert_eq!(seen.last(), Some(&300_000), "the tail is gone");
    assert!(log.len() < (1 << 20) + 4096, "{} bytes kept", log.len());
}

/// An output stream that breaks mid-way fails the job with a reason (the record of
/// what the container did is incomplete) and stops the container.
#[tokio::test]
async fn a_broken_output_stream_fails_the_container_job() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = env_with(RunnerOptions {
        env: vec![("BYOC_RUNNER_TEST_FAULT_BREAK_CONTAINER_OUTPUT_AFTER".into(), "100000".into())],
        ..Default::default()
    })
    .await;
    let id = e
        .cp
        .enqueue(container(serde_json::json!({
            "image": image, "command": ["sh", "-c", "seq 1 1000000; echo finished >> /work/finished"], "network": false
        })))
        .unwrap();
    let v = e.finished(&id).await;
    let result = v.result.unwrap();
    assert_eq!(result.status, JobStatus::Failed);
    assert_eq!(result.outputs["reason"], "container_output_broken", "{:?}", result.error);
    assert!(result.error.unwrap_or_default().contains("output stream broke"));
    assert!(numbers(&e.output(&id)).len() < 1_000_000);
    assert!(job_containers(&id).is_empty(), "containers left behind: {:?}", job_containers(&id));
}

/// A runner killed while a networked container runs leaves its containers and network
/// to Docker; the next start removes them (the job is reported interrupted).
#[tokio::test]
async fn a_restart_removes_what_a_killed_runner_left_of_a_container_job() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let mut e = env().await;
    let id =
        e.cp.enqueue(container(
            serde_json::json!({"image": image, "command": ["sh", "-c", "echo ready; sleep 600"]}),
        ))
        .unwrap();
    e.log_contains(&id, "ready").await;
    let running = job_containers(&id);
    for name in [format!("byoc-job-{id}"), format!("byoc-job-{id}-net")] {
        assert!(running.contains(&name), "{name} (the job or its network holder) not running: {running:?}");
    }
    assert_eq!(job_networks(&id).len(), 1);
    let work = e.runner.state_dir.join("work");
    let pipes = move || -> Vec<String> {
        let names = std::fs::read_dir(&work).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>());
        names
            .unwrap_or_default()
            .into_iter()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".container-output-"))
            .collect()
    };
    assert_eq!(pipes().len(), 1, "the job's output pipe");
    e.runner.kill9().await;
    e.runner.spawn(None).unwrap();
    // The start cleans up before it polls: once a job runs again, it is done.
    let next = e.cp.enqueue(script("echo up")).unwrap();
    e.finished(&next).await;
    assert!(job_containers(&id).is_empty(), "containers left behind");
    assert!(job_networks(&id).is_empty(), "network left behind");
    assert!(pipes().is_empty(), "output pipe left behind: {:?}", pipes());
}
