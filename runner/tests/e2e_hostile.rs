//! A hostile vendor with a valid signature. Every job here is signed with the control
//! plane's real key and tries to make the runner itself run, read, follow, fetch or
//! connect to what it must not: a kubeconfig that names a command or a file, an API
//! server or registry on the host's loopback or the metadata address, links where the
//! runner reads what a job wrote, a traversal in place of a state marker, a flood of
//! connections to the job's credential endpoint, an x32 system call, an envelope
//! delivered again after the journal was compacted. Each is refused or fails with its
//! reason code; a canary on the host (a marker file, a file outside every job's tree, a
//! loopback listener) shows nothing happened; and an honest job run alongside completes.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::kube_api::FakeKubeApi;
use byoc_control_plane::state::Tamper;
use byoc_protocol::{JobStatus, RejectReason};
use common::roles::*;
use common::*;

/// Host files and services no job may reach through the runner.
struct Canary {
    dir: tempfile::TempDir,
    listener_port: u16,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

const CANARY_TEXT: &str = "CANARY-4d1f9a7c: a file of the host's that no job may make the runner read\n";

impl Canary {
    async fn start() -> Canary {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("secret"), CANARY_TEXT).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let listener_port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let count = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((_stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
            }
        });
        Canary { dir, listener_port, connections, task }
    }

    /// Where a plugin would leave its mark if the runner ran it.
    fn marker(&self) -> PathBuf {
        self.dir.path().join("pwned")
    }

    /// A file outside every job's tree, with known content.
    fn secret(&self) -> PathBuf {
        self.dir.path().join("secret")
    }

    /// A loopback service of the host's: `127.0.0.1:port`.
    fn service(&self) -> String {
        format!("127.0.0.1:{}", self.listener_port)
    }

    /// Nothing happened on the host: no marker, the canary file untouched, no
    /// connection to the loopback service.
    fn untouched(&self) {
        assert!(!self.marker().exists(), "a command the job named ran on the host");
        assert_eq!(std::fs::read_to_string(self.secret()).unwrap(), CANARY_TEXT, "the canary file changed");
        assert_eq!(self.connections.load(Ordering::SeqCst), 0, "the runner connected to a loopback service");
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An honest job enqueued beside the hostile ones; `finish_honest` checks it completed.
fn honest(e: &Env) -> String {
    e.cp.enqueue(script("echo honest job done")).unwrap()
}

async fn finish_honest(e: &Env, id: &str) {
    let r = e.finished(id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{}", r.error, e.runner.log());
    assert!(e.output(id).contains("honest job done"));
}

fn kubeconfig(server: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\nusers:\n- name: u\n  user:\n{user}"
    )
}

fn kube_job(kind: &str, kubeconfig: String) -> EnqueueRequest {
    let cm = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "harmless"}, "data": {"k": "v"}});
    let spec = match kind {
        "kubernetes" => serde_json::json!({"action": "apply", "component": "api", "namespace": "acme",
            "manifests": [cm], "kubeconfig": kubeconfig, "wait_secs": 5}),
        "secrets.sync" => serde_json::json!({"kubeconfig": kubeconfig, "secrets": []}),
        "helm" => serde_json::json!({"action": "drift", "release": "api", "namespace": "acme",
            "kubeconfig": kubeconfig}),
        other => panic!("{other}"),
    };
    let mut req = EnqueueRequest::new(kind, spec);
    // The operation each job's effect runs as (a drift check runs as one).
    (req.entity, req.operation) = match kind {
        "helm" => ("component".into(), "drift".into()),
        "secrets.sync" => ("secret".into(), "sync".into()),
        _ => ("component".into(), "deploy".into()),
    };
    req
}

/// Each hostile kubeconfig, the field its refusal must name.
fn hostile_kubeconfigs(c: &Canary, identity_key: &Path) -> Vec<(String, &'static str)> {
    let good_server = "https://kube.example.invalid:6443";
    vec![
        (
            kubeconfig(
                good_server,
                &format!(
                    "    exec:\n      apiVersion: client.authentication.k8s.io/v1beta1\n      command: /bin/sh\n      args: [\"-c\", \"id > {}\"]\n",
                    c.marker().display()
                ),
            ),
            "users[0].user.exec",
        ),
        (
            kubeconfig(
                good_server,
                &format!(
                    "    auth-provider:\n      name: gcp\n      config:\n        cmd-path: /bin/sh\n        cmd-args: \"-c 'id > {}'\"\n",
                    c.marker().display()
                ),
            ),
            "users[0].user.auth-provider",
        ),
        (
            kubeconfig(good_server, &format!("    tokenFile: {}\n", identity_key.display())),
            "users[0].user.tokenFile",
        ),
        (
            kubeconfig(
                good_server,
                &format!(
                    "    client-certificate: {}\n    client-key: {}\n",
                    c.secret().display(),
                    identity_key.display()
                ),
            ),
            "users[0].user.client-certificate",
        ),
        (kubeconfig("https://169.254.169.254", "    token: t0k3n-for-imds\n"), "link-local"),
        (kubeconfig("https://[fd00:ec2::254]", "    token: t0k3n-for-imds\n"), "metadata"),
        (kubeconfig(&format!("https://{}", c.service()), "    token: t0k3n-for-loopback\n"), "loopback"),
        (
            kubeconfig(good_server, "    token: t0k3n\n")
                .replace("    server:", &format!("    proxy-url: http://{}\n    server:", c.service())),
            "proxy-url",
        ),
        (
            kubeconfig(good_server, "    token: t0k3n\n")
                .replace("    server:", "    insecure-skip-tls-verify: true\n    server:"),
            "insecure-skip-tls-verify",
        ),
    ]
}

/// The job's `exec` plugin, `auth-provider` command, `tokenFile` at the runner's
/// identity key, file-named client certificates, a server on the metadata address or
/// the host's loopback, a proxy, switched-off TLS checks: refused before the claim for
/// every in-runner cluster user, naming the field; nothing ran, nothing was read or
/// connected to; an honest job at the same time completes.
#[tokio::test]
async fn cluster_access_that_would_run_read_or_reach_anything_is_refused_before_the_claim() {
    let canary = Canary::start().await;
    let e = env().await;
    let key = e.runner.state_dir.join("identity.key");
    let key_before = std::fs::read(&key).unwrap();
    let mut hostile = Vec::new();
    for kind in ["kubernetes", "secrets.sync", "helm"] {
        for (kc, field) in hostile_kubeconfigs(&canary, &key) {
            hostile.push((e.cp.enqueue(kube_job(kind, kc)).unwrap(), kind, field));
        }
    }
    let ok = honest(&e);
    for (id, kind, field) in &hostile {
        let v = e.rejected(id).await;
        let (reason, detail) = &v.rejections[0];
        assert_eq!(*reason, RejectReason::InvalidSpec, "{kind}: {detail}");
        assert!(detail.contains(field), "{kind} {field}: {detail}");
        assert_eq!(started_count(&e.runner.state_dir, id), 0, "{kind} {field} was started");
    }
    finish_honest(&e, &ok).await;
    canary.untouched();
    assert_eq!(std::fs::read(&key).unwrap(), key_before);
    // Each refusal is journaled and audited.
    let rejected = audit_events(&e.runner.state_dir, "job_rejected");
    assert!(
        rejected.len() >= hostile.len(),
        "{} audit records for {} refusals",
        rejected.len(),
        hostile.len()
    );
    assert!(!e.runner.log().contains("t0k3n-for"), "a token reached the runner's log");
}

/// `run-local` refuses the same kubeconfig with a clear message and runs nothing.
#[tokio::test]
async fn run_local_refuses_a_kubeconfig_that_names_a_command() {
    let canary = Canary::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (kc, _) = hostile_kubeconfigs(&canary, Path::new("/nonexistent")).remove(0);
    let job = serde_json::json!({"kind": "kubernetes", "timeout_secs": 30, "spec": kube_job("kubernetes", kc).spec});
    let file = dir.path().join("job.json");
    std::fs::write(&file, job.to_string()).unwrap();
    let out =
        std::process::Command::new(BIN).arg("run-local").arg(&file).arg("--no-sandbox").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("kubeconfig: users[0].user.exec") && stderr.contains("names a command"),
        "{stderr}"
    );
    canary.untouched();
}

/// A server named by a host name that resolves to this machine's loopback (its own
/// name does): the name passes before the claim, the runner's resolver refuses it, the
/// job fails `endpoint_refused`, and the API server listening there saw no request.
#[tokio::test]
async fn a_cluster_name_that_resolves_to_this_host_is_never_connected_to() {
    let me = nix::unistd::gethostname().unwrap().to_string_lossy().into_owned();
    let resolved: Vec<std::net::SocketAddr> =
        tokio::net::lookup_host((me.as_str(), 0)).await.expect("this machine's own name resolves").collect();
    assert!(resolved.iter().any(|a| a.ip().is_loopback()), "{me} resolves to {resolved:?}, not loopback");
    let api = FakeKubeApi::start_named(&[&me]).await;
    let e = env().await;
    let server = format!("https://{me}:{}", api.addr.port());
    // The kubeconfig trusts the server's CA: without the runner's rule it would connect.
    let kc = api.kubeconfig("tok-resolves-home").replace(&api.url(), &server);
    let id = e.cp.enqueue(kube_job("kubernetes", kc)).unwrap();
    let ok = honest(&e);
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "endpoint_refused", "{:?}", r.error);
    assert!(r.error.as_deref().unwrap_or("").contains("resolves to"), "{:?}", r.error);
    assert!(api.requests().is_empty(), "the API server on loopback was reached: {:?}", api.requests());
    finish_honest(&e, &ok).await;
}

/// A registry on the host's loopback or the metadata address, named by an `oci.sync`
/// or a component by digest: refused before the claim; the loopback service never saw a
/// connection.
#[tokio::test]
async fn registries_on_the_hosts_loopback_or_the_metadata_address_are_refused_before_the_claim() {
    let canary = Canary::start().await;
    let e = env().await;
    let digest = format!("sha256:{}", "a".repeat(64));
    let sync = |registry: &str| EnqueueRequest {
        entity: "artifact".into(),
        operation: "sync".into(),
        ..EnqueueRequest::new(
            "oci.sync",
            serde_json::json!({"source": format!("{registry}/vendor/api@{digest}"),
                "source_credential": {"username": "vendor", "token": "one-time-token-0123"},
                "destination": {"repository": "inst-demo/api"}}),
        )
    };
    let module = |registry: &str| EnqueueRequest {
        entity: "component".into(),
        operation: "deploy".into(),
        ..EnqueueRequest::new(
            "terraform",
            serde_json::json!({"mode": "apply", "workspace": "api", "module": format!("{registry}/vendor/net@{digest}")}),
        )
    };
    let mut hostile = Vec::new();
    for registry in [canary.service(), "169.254.169.254".into(), "localhost:5000".into(), "[::1]:5000".into()]
    {
        hostile.push((e.cp.enqueue(sync(&registry)).unwrap(), "source"));
        hostile.push((e.cp.enqueue(module(&registry)).unwrap(), "module"));
    }
    let ok = honest(&e);
    for (id, field) in &hostile {
        let v = e.rejected(id).await;
        let (reason, detail) = &v.rejections[0];
        assert_eq!(*reason, RejectReason::InvalidSpec, "{detail}");
        assert!(detail.starts_with(&format!("{field}: ")), "{detail}");
    }
    finish_honest(&e, &ok).await;
    canary.untouched();
}

/// Job code that leaves a link where the runner reads its outputs (to a file of the
/// host's) or a FIFO there: the runner reads neither (no link followed, regular files
/// only, nothing blocks) and the job fails `job_file_refused`.
#[tokio::test]
async fn outputs_left_as_a_link_or_a_fifo_are_never_read() {
    let canary = Canary::start().await;
    let e = env().await;
    let link =
        e.cp.enqueue(script(&format!("ln -s {} \"$BYOC_OUTPUT\"", canary.secret().display()))).unwrap();
    let dir_link = e
        .cp
        .enqueue(script(&format!(
            "mkdir -p d && ln -s {} d/up && echo 'K=V' > ok && rm -f \"$BYOC_OUTPUT\" && ln -s d/up/secret \"$BYOC_OUTPUT\"",
            canary.dir.path().display()
        )))
        .unwrap();
    let fifo = e.cp.enqueue(script("mkfifo \"$BYOC_OUTPUT\"")).unwrap();
    let ok = honest(&e);
    for id in [&link, &dir_link, &fifo] {
        let r = e.finished(id).await.result.unwrap();
        assert_eq!(r.status, JobStatus::Failed, "{:?}", r.error);
        assert_eq!(r.outputs["reason"], "job_file_refused", "{}", r.outputs);
        let reported = serde_json::to_string(&r).unwrap();
        assert!(!reported.contains("CANARY-4d1f9a7c"), "the canary was read: {reported}");
        assert!(!String::from_utf8_lossy(&e.cp.log(id).unwrap_or_default()).contains("CANARY-4d1f9a7c"));
    }
    finish_honest(&e, &ok).await;
    canary.untouched();
}

/// terraform as hostile job code would make it (providers run inside terraform): in
/// the step that writes what the runner reads next, it swaps the file for a link to a
/// file of the host's. `hostile-*` files in the module choose which.
const HOSTILE_TERRAFORM: &str = r#"#!/bin/sh
set -u
[ "${1#-chdir=}" != "$1" ] && { cd "${1#-chdir=}" || exit 1; shift; }
cmd="$1"; shift
case "$cmd" in
  init) echo "initialized" ;;
  plan)
    for a in "$@"; do case "$a" in -out=*) out="${a#-out=}" ;; esac; done
    if [ -f hostile-plan-backend ]; then
      # What a process alive beside terraform could do to the plan it wrote: name
      # another backend (apply takes the plan's, and show -json never prints it).
      sed -i "s|\"terraform.tfstate\"|\"$(cat hostile-plan-backend)\"|" zz_byoc_backend_override.tf
    fi
    "$(dirname "$0")/fake-plan" write "$out" "$(pwd)" fake-plan.json
    if [ -f hostile-plan-link ]; then rm -f "$out"; ln -s "$(cat hostile-plan-link)" "$out"; fi ;;
  show)
    "$(dirname "$0")/fake-plan" json "$2" ;;
  apply)
    echo '{"version": 4, "serial": 42, "outputs": {}}' > terraform.tfstate
    if [ -f hostile-state-link ]; then rm -f terraform.tfstate; ln -s "$(cat hostile-state-link)" terraform.tfstate; fi
    if [ -f hostile-marker ]; then
      # The old way the runner learnt a crashed job's workspace: a marker in the job's
      # tree. This job writes a traversal there and waits to be interrupted.
      cat hostile-marker > ../.byoc-state-workspace
      echo "HOSTILE-READY"
      while :; do sleep 1; done
    fi
    echo "Apply complete!" ;;
  output) echo '{}' ;;
  *) exit 1 ;;
esac
"#;

const EMPTY_PLAN: &str =
    r#"{"format_version": "1.2", "terraform_version": "1.11.0", "resource_changes": []}"#;

/// A runner whose `[section] binary` is `script` (job code as a tool would run it).
struct ToolEnv {
    env: Env,
    _tools: tempfile::TempDir,
    _policies: tempfile::TempDir,
}

async fn env_with_tool(section: &str, script: &str) -> ToolEnv {
    use std::os::unix::fs::PermissionsExt as _;
    let tools = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tools.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let tool = tools.path().join(section);
    std::fs::write(&tool, script).unwrap();
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The stand-in's plan files (a zip with terraform's backend record), for hostile
    // terraform scripts.
    let fake_plan =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/terraform/fake-plan");
    std::fs::copy(&fake_plan, tools.path().join("fake-plan")).unwrap();
    let policies = tempfile::tempdir().unwrap();
    let opts = byoc_control_plane::harness::RunnerOptions {
        extra: format!(
            "\n[{section}]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n",
            tool.display(),
            policies.path().display()
        ),
        sandbox_ro_paths: vec![tools.path().to_path_buf()],
        ..Default::default()
    };
    ToolEnv { env: env_with(opts).await, _tools: tools, _policies: policies }
}

async fn hostile_terraform_env() -> ToolEnv {
    env_with_tool("terraform", HOSTILE_TERRAFORM).await
}

fn tf_job(workspace: &str, hostile: &[(&str, String)]) -> EnqueueRequest {
    let mut files = serde_json::json!({"main.tf": "", "fake-plan.json": EMPTY_PLAN});
    for (k, v) in hostile {
        files[*k] = v.clone().into();
    }
    EnqueueRequest {
        timeout_secs: 120,
        entity: "component".into(),
        operation: "deploy".into(),
        ..EnqueueRequest::new(
            "terraform",
            serde_json::json!({"mode": "apply", "files": files, "workspace": workspace}),
        )
    }
}

/// The plan the runner seals and judges, and the state it keeps, replaced by job code
/// with links to a file of the host's: neither is read, the job fails
/// `job_file_refused`, the workspace's stored state is not the canary.
#[tokio::test]
async fn terraform_files_swapped_for_links_are_never_followed() {
    let canary = Canary::start().await;
    let e = hostile_terraform_env().await;
    let target = canary.secret().display().to_string();
    let plan = e.env.cp.enqueue(tf_job("plan-link", &[("hostile-plan-link", target.clone())])).unwrap();
    let state = e.env.cp.enqueue(tf_job("state-link", &[("hostile-state-link", target.clone())])).unwrap();
    let ok = honest(&e.env);
    let r = e.env.finished(&plan).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed, "{:?}", r.error);
    assert_eq!(r.outputs["reason"], "job_file_refused", "{:?} {}", r.error, r.outputs);
    assert!(!e.env.output(&plan).contains("Apply complete"), "a plan nobody judged was applied");
    let r = e.env.finished(&state).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed, "{:?}", r.error);
    assert_eq!(r.outputs["reason"], "job_file_refused", "{:?} {}", r.error, r.outputs);
    let stored = e.env.runner.state_dir.join("tfstate/state-link/terraform.tfstate");
    assert!(
        std::fs::read_to_string(&stored).map(|s| !s.contains("CANARY")).unwrap_or(true),
        "the canary became the workspace's state"
    );
    finish_honest(&e.env, &ok).await;
    canary.untouched();
}

/// A plan file rewritten by job code to name another backend (here a local state
/// elsewhere; as well another workspace's key in the bucket): apply would take the
/// plan's backend, which the policies never see. Refused before the decision, nothing
/// applied, nothing written there.
#[tokio::test]
async fn a_plan_rewritten_to_name_another_backend_is_never_decided_or_applied() {
    let e = hostile_terraform_env().await;
    let elsewhere = e.env.dir.path().join("elsewhere.tfstate");
    let id = e
        .env
        .cp
        .enqueue(tf_job("rewritten", &[("hostile-plan-backend", elsewhere.display().to_string())]))
        .unwrap();
    let ok = honest(&e.env);
    let r = e.env.finished(&id).await.result.unwrap();
    let log = e.env.output(&id);
    assert_eq!(r.status, JobStatus::Failed, "{:?}\n{log}", r.error);
    assert_eq!(r.outputs["reason"], "plan_backend_mismatch", "{:?} {}", r.error, r.outputs);
    assert!(!log.contains("Apply complete"), "{log}");
    assert!(!log.contains("[policy]"), "a plan naming another backend was decided: {log}");
    assert!(!elsewhere.exists());
    assert!(audit_events(&e.env.runner.state_dir, "policy_decision").iter().all(|d| d["job"] != id.as_str()));
    finish_honest(&e.env, &ok).await;
}

/// A terraform job killed with the runner after writing its state and a traversal
/// where the runner once kept its workspace marker: on restart the state goes to the
/// workspace journaled when the job started; nothing is written where the marker
/// points.
#[tokio::test]
async fn a_traversal_in_a_workspace_marker_decides_nothing_after_a_crash() {
    let mut e = hostile_terraform_env().await;
    let escape = e.env.dir.path().join("escaped");
    let marker = format!("../../../{}", escape.strip_prefix("/").unwrap().display());
    let id = e.env.cp.enqueue(tf_job("api", &[("hostile-marker", format!("{marker}\n"))])).unwrap();
    e.env.log_contains(&id, "HOSTILE-READY").await;
    e.env.runner.kill9().await;
    e.env.runner.spawn(None).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Interrupted, "{:?}", r.error);
    let kept = std::fs::read_to_string(e.env.runner.state_dir.join("tfstate/api/terraform.tfstate")).unwrap();
    assert!(kept.contains("\"serial\": 42"), "the journaled workspace got the state: {kept}");
    assert!(!escape.exists(), "the marker's traversal was followed");
    let tfstate: Vec<String> = std::fs::read_dir(e.env.runner.state_dir.join("tfstate"))
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(tfstate, ["api"], "no other workspace was made");
    let ok = honest(&e.env);
    finish_honest(&e.env, &ok).await;
}

/// helm as hostile job code would make it: while it renders, the chart's CRDs (which
/// the runner reads to judge) swapped for a link to a file of the host's.
const HOSTILE_HELM: &str = r#"#!/bin/sh
cmd="$1"; shift
case "$cmd" in
  upgrade)
    case " $* " in *" --dry-run=server "*) ;; *) echo "HOSTILE-UPGRADED"; exit 0 ;; esac
    echo '{"manifest": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "hooks": []}'
    if [ -f chart/hostile-link ]; then mkdir -p chart/crds; ln -s "$(cat chart/hostile-link)" chart/crds/stolen.yaml; fi ;;
  get) echo "Error: release: not found" >&2; exit 1 ;;
  *) exit 1 ;;
esac
"#;

#[tokio::test]
async fn helm_files_swapped_for_links_are_never_followed() {
    let canary = Canary::start().await;
    let tool_env = env_with_tool("helm", HOSTILE_HELM).await;
    let e = &tool_env.env;
    let spec = serde_json::json!({"action": "upgrade", "release": "api", "namespace": "acme",
        "files": {"Chart.yaml": "apiVersion: v2\nname: api\nversion: 1.0.0\n",
                  "hostile-link": canary.secret().display().to_string()}});
    let req = EnqueueRequest {
        entity: "component".into(),
        operation: "deploy".into(),
        ..EnqueueRequest::new("helm", spec)
    };
    let id = e.cp.enqueue(req).unwrap();
    let ok = honest(e);
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed, "{:?}", r.error);
    assert_eq!(r.outputs["reason"], "job_file_refused", "{:?} {}", r.error, r.outputs);
    assert!(!e.output(&id).contains("HOSTILE-UPGRADED"), "a release nobody judged was installed");
    finish_honest(e, &ok).await;
    canary.untouched();
}

/// An x32 system call from a job (the ABI a deny list keyed on native numbers would
/// miss): refused with EPERM by the job's filter; what it asked for did not happen.
#[tokio::test]
async fn an_x32_system_call_from_a_job_is_refused() {
    let e = env().await;
    // x32 mkdir (83) and getpid (39): the filter answers EPERM (a kernel without x32
    // would say ENOSYS, so EPERM is the filter's).
    let s = r#"perl -e '
        my $p = "/work/x32-made"; $r = syscall(0x40000000 | 83, $p, 0755); print "x32 mkdir $r errno ", $!+0, "\n";
        $r = syscall(0x40000000 | 39); print "x32 getpid $r errno ", $!+0, "\n";
        print -e $p ? "MADE\n" : "NOT-MADE\n";'"#;
    let id = e.cp.enqueue(script(s)).unwrap();
    let ok = honest(&e);
    let r = e.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}", r.error);
    let out = e.output(&id);
    assert!(out.contains("x32 mkdir -1 errno 1\n") && out.contains("x32 getpid -1 errno 1\n"), "{out}");
    assert!(out.contains("NOT-MADE"), "{out}");
    finish_honest(&e, &ok).await;
}

/// A job opens 2,000 connections to its credential endpoint and holds them while
/// another job of the install asks its own endpoint for credentials: the flood is capped
/// (connections past the cap are closed at once), the runner's descriptors stay
/// bounded, and the other job gets its credentials.
#[tokio::test]
async fn a_flood_of_connections_to_the_credential_endpoint_is_capped() {
    let moto = moto_with_stack(&base_params()).await;
    let go = tempfile::tempdir().unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(go.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut opts = role_options(&moto, "");
    opts.sandbox_ro_paths.push(go.path().to_path_buf());
    let e = env_with(opts).await;
    let runner_pid = e.runner.pid().unwrap();
    let fds = || std::fs::read_dir(format!("/proc/{runner_pid}/fd")).unwrap().count();
    let idle = fds();
    let flood = format!(
        r#"perl -MIO::Socket::INET -MIO::Select -e '
        $| = 1;
        my (@s, $failed);
        for (1..2000) {{
            my $c = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => 80, Proto => "tcp", Timeout => 10);
            if ($c) {{ push @s, $c }} else {{ $failed++ }}
        }}
        print "HELD ", scalar(@s), " failed ", $failed+0, "\n";
        select(undef, undef, undef, 0.05) until -e "{go}/go";
        my $closed = 0;
        for my $c (@s) {{
            if (IO::Select->new($c)->can_read(0)) {{ my $n = sysread($c, my $b, 1); $closed++ unless $n; }}
        }}
        print "CLOSED $closed OPEN ", scalar(@s) - $closed, "\n";'"#,
        go = go.path().display()
    );
    let flooding =
        e.cp.enqueue(role_job("component", "deploy", "inst-demo-maintenance", named("api"), &flood)).unwrap();
    e.log_contains(&flooding, "HELD").await;
    let during = fds();
    let creds = r#"curl -sf -H "Authorization: $AWS_CONTAINER_AUTHORIZATION_TOKEN" "$AWS_CONTAINER_CREDENTIALS_FULL_URI" | grep -q AccessKeyId && echo CREDS-OK"#;
    let other =
        e.cp.enqueue(role_job("component", "deploy", "inst-demo-maintenance", named("api"), creds)).unwrap();
    let r = e.finished(&other).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{}", r.error, e.output(&other));
    assert!(e.output(&other).contains("CREDS-OK"));
    std::fs::write(go.path().join("go"), b"").unwrap();
    let r = e.finished(&flooding).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}", r.error);
    let out = e.output(&flooding);
    let number = |after: &str| -> usize {
        out.split(after)
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap()
    };
    let cap = byoc_job_executors::jobnet::MAX_CREDENTIAL_CONNECTIONS;
    assert!(number("CLOSED ") + number("failed ") >= 2000 - cap, "{out}");
    assert!(number(" OPEN ") <= cap, "{out}");
    // Every connection the runner accepted is one descriptor of its own: capped, not 2,000.
    assert!(during <= idle + 2 * cap + 64, "the runner held {during} descriptors (idle {idle})");
}

/// An envelope delivered again after the runner compacted its journal: refused, never
/// run twice.
#[tokio::test]
async fn an_envelope_delivered_again_after_compaction_is_refused() {
    let opts = byoc_control_plane::harness::RunnerOptions {
        jobs_extra: "journal_keep = 10\nmax_clock_skew_secs = 2".into(),
        ..Default::default()
    };
    let e = env_with(opts).await;
    let mut ids = Vec::new();
    for i in 0..14 {
        let req = EnqueueRequest {
            ttl_secs: 2,
            ..EnqueueRequest::new("runner.noop", serde_json::json!({ "message": format!("job {i}") }))
        };
        let id = e.cp.enqueue(req).unwrap();
        assert_eq!(e.finished(&id).await.result.unwrap().status, JobStatus::Succeeded);
        ids.push(id);
    }
    assert!(
        e.cp.wait_until(std::time::Duration::from_secs(40), |_| {
            !audit_events(&e.runner.state_dir, "journal_compacted").is_empty()
        })
        .await,
        "no compaction:\n{}",
        e.runner.log()
    );
    // The oldest (archived) and the newest (still journaled) envelopes, again; and the
    // newest's nonce under a new job id.
    e.cp.redeliver(&ids[0]).unwrap();
    e.cp.redeliver(&ids[13]).unwrap();
    let newest_nonce = e.cp.job(&ids[13]).unwrap().nonce;
    let reuse =
        e.cp.enqueue(EnqueueRequest {
            tamper: Tamper { nonce: Some(newest_nonce), ..Default::default() },
            ..EnqueueRequest::new("runner.noop", serde_json::json!({"message": "again"}))
        })
        .unwrap();
    let ok = honest(&e);
    let reasons = |id: &str| -> Vec<String> {
        e.cp.job(id)
            .map(|v| v.rejections.iter().map(|(r, _)| r.code().to_string()).collect())
            .unwrap_or_default()
    };
    assert!(
        e.cp.wait_until(std::time::Duration::from_secs(30), |_| !reasons(&ids[0]).is_empty()
            && !reasons(&ids[13]).is_empty()
            && !reasons(&reuse).is_empty())
            .await
    );
    assert!(["expired", "already_finished", "replayed_nonce"].contains(&reasons(&ids[0])[0].as_str()));
    assert!(
        ["expired", "already_finished"].contains(&reasons(&ids[13])[0].as_str()),
        "{:?}",
        reasons(&ids[13])
    );
    assert!(["expired", "replayed_nonce"].contains(&reasons(&reuse)[0].as_str()), "{:?}", reasons(&reuse));
    // The archived job's lines left the journal: a `started` there now would be a re-run.
    assert_eq!(started_count(&e.runner.state_dir, &ids[0]), 0, "the archived job ran again");
    assert_eq!(started_count(&e.runner.state_dir, &ids[13]), 1, "the journaled job ran again");
    finish_honest(&e, &ok).await;
}
