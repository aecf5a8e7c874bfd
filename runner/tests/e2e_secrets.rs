//! The customer's secrets (docs/SECRETS.md), end to end against moto (CloudFormation,
//! STS, KMS, Secrets Manager), the fake Kubernetes API server and the real terraform:
//! the install stack generated from the example app's secrets is created in moto, a
//! `secrets.sync` job writes them into Kubernetes Secrets, a terraform job passes one
//! as a variable of a real `terraform_data` apply, a rotation is picked up, and no value
//! (nor its base64 or JSON form) reaches the state dir, the uploaded log, the result,
//! the runner's journald or the audit log. A role the app config does not let read a
//! secret, a missing required secret and a forged target are refused.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use base64::Engine as _;
use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::RunnerOptions;
use byoc_control_plane::kube_api::FakeKubeApi;
use byoc_control_plane::moto::MotoServer;
use byoc_protocol::{JobStatus, RejectReason};
use common::roles::*;
use common::*;

/// Characters a JSON encoder escapes, and ones base64 and URLs treat specially.
const DB_PASSWORD: &str = "Db-pa55/w0rd+\"quoted\"&more";
const ROTATED: &str = "r0tated/Db+pa55\"word\"-v2";

fn repo_template() -> serde_json::Value {
    template_at(&repo().join("ami/install-stack.yaml"))
}

/// moto's CloudFormation does not model `AWS::SecretsManager::Secret` (it skips the
/// type), so the test creates each of the template's app secrets as CloudFormation
/// would from its properties: the name (`${InstallId}/secrets/<name>`), the install's
/// KMS key (which moto's CloudFormation did create), the parameter's value, a generated
/// value for an `auto_generate` secret left empty, nothing for an optional one left
/// empty. Returns name → value.
async fn create_template_secrets(
    moto: &MotoServer,
    template: &serde_json::Value,
    install_id: &str,
    params: &BTreeMap<&str, &str>,
) -> BTreeMap<String, String> {
    let keys = moto.json_call("kms", "TrentService.ListKeys", serde_json::json!({})).await;
    let key_id = keys["Keys"][0]["KeyId"].as_str().expect("the stack's SecretsKey").to_string();
    let param = |name: &str| -> String {
        params
            .get(name)
            .map(|v| v.to_string())
            .or_else(|| template["Parameters"][name]["Default"].as_str().map(str::to_string))
            .unwrap_or_default()
    };
    let mut created = BTreeMap::new();
    for (logical, r) in template["Resources"].as_object().unwrap() {
        if !logical.starts_with("AppSecret") {
            continue;
        }
        assert_eq!(r["Type"], "AWS::SecretsManager::Secret");
        let props = &r["Properties"];
        assert_eq!(props["KmsKeyId"], serde_json::json!({"Ref": "SecretsKey"}), "{logical}");
        let given = |cond: &str| {
            let c = &template["Conditions"][cond]["Fn::Not"][0]["Fn::Equals"];
            assert_eq!(c[1], "", "{cond}");
            !param(c[0]["Ref"].as_str().unwrap()).is_empty()
        };
        if let Some(cond) = r["Condition"].as_str()
            && !given(cond)
        {
            continue;
        }
        let value = match &props["SecretString"] {
            serde_json::Value::Object(o) if o.contains_key("Ref") => param(o["Ref"].as_str().unwrap()),
            serde_json::Value::Object(o) if o.contains_key("Fn::If") => {
                let branch = &o["Fn::If"];
                if given(branch[0].as_str().unwrap()) {
                    param(branch[1]["Ref"].as_str().unwrap())
                } else {
                    assert_eq!(props["GenerateSecretString"]["Fn::If"][2]["PasswordLength"], 32);
                    byoc_protocol::random_hex(16)
                }
            }
            other => panic!("{logical}: SecretString {other}"),
        };
        let name = props["Name"]["Fn::Sub"].as_str().unwrap().replace("${InstallId}", install_id);
        moto.json_call(
            "secretsmanager",
            "secretsmanager.CreateSecret",
            serde_json::json!({"Name": name, "SecretString": value, "KmsKeyId": key_id}),
        )
        .await;
        created.insert(name.rsplit('/').next().unwrap().to_string(), value);
    }
    created
}

struct SecretsEnv {
    env: Env,
    moto: MotoServer,
    kube: FakeKubeApi,
    values: BTreeMap<String, String>,
    /// The runner's private journald: its journal, and where its pid is.
    journal: tempfile::TempDir,
    _policies: tempfile::TempDir,
}

impl Drop for SecretsEnv {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.journal.path().join("journald.pid"))
            && let Ok(pid) = pid.trim().parse()
        {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// The runner started in a mount namespace of its own with a journald of its own, its
/// journal in `journal/log` for journalctl to read (the runner logs to journald there,
/// as it does under systemd).
fn with_private_journald(opts: &mut RunnerOptions, journal: &Path) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this suite needs root (a private journald in a mount namespace)"
    );
    assert!(
        Path::new("/lib/systemd/systemd-journald").exists(),
        "systemd-journald is required (apt-get install systemd)"
    );
    let log = journal.join("log");
    std::fs::create_dir(&log).unwrap();
    let script = format!(
        "mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/journal /run/log/journal && \
         mount --bind {log} /run/log/journal && {{ /lib/systemd/systemd-journald & echo $! > {pid}; }} && \
         for i in $(seq 1 200); do [ -S /run/systemd/journal/socket ] && break; sleep 0.05; done; exec \"$0\" \"$@\"",
        log = log.display(),
        pid = journal.join("journald.pid").display()
    );
    opts.wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", &script].map(String::from).to_vec();
    opts.env.push(("BYOC_RUNNER__LOGGING__TARGET".into(), "journald".into()));
}

/// Everything the runner's journald holds, as `journalctl -o json` prints it.
fn journal_text(journal: &Path) -> String {
    let out = std::process::Command::new("journalctl")
        .arg("--directory")
        .arg(journal.join("log"))
        .args(["-o", "json", "--no-pager"])
        .output()
        .expect("journalctl is required (apt-get install systemd)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The example app's generated stack in moto (its secrets given or generated), the
/// state bucket, the fake cluster, and a runner whose jobs run unsandboxed (terraform's
/// `s3` backend must reach moto on this host's loopback, which the sandbox refuses).
async fn secrets_env() -> SecretsEnv {
    let moto = MotoServer::start().await;
    let template = repo_template();
    let params: BTreeMap<&str, &str> = [
        ("EnableMaintenanceRole", "true"),
        ("EnableProvisionRole", "true"),
        ("SecretDbPassword", DB_PASSWORD),
    ]
    .into_iter()
    .collect();
    let switches: Vec<(&str, &str)> = params.iter().map(|(k, v)| (*k, *v)).collect();
    let described = create_stack(&moto, STACK, &template, "inst-demo", &switches).await;
    assert!(described.contains("CREATE_COMPLETE"), "{described}");
    // Each secret is asked for NoEcho, so CloudFormation never shows it (moto's
    // DescribeStacks does not honour NoEcho: it compares values with the keys' names).
    assert!(described.contains("<ParameterKey>SecretDbPassword</ParameterKey>"), "{described}");
    for p in ["SecretDbPassword", "SecretSessionKey", "SecretSlackWebhook"] {
        assert_eq!(template["Parameters"][p]["NoEcho"], true, "{p}");
    }
    assert_eq!(template["Parameters"]["SecretDbPassword"]["MinLength"], 1, "required");
    let values = create_template_secrets(&moto, &template, "inst-demo", &params).await;
    moto.create_bucket("inst-demo-state").await;
    let kube = FakeKubeApi::start().await;
    let policies = tempfile::tempdir().unwrap();
    let mut opts = role_options(&moto, "");
    let terraform = std::process::Command::new("sh").args(["-c", "command -v terraform"]).output().unwrap();
    let terraform = String::from_utf8_lossy(&terraform.stdout).trim().to_string();
    assert!(!terraform.is_empty(), "terraform is required on PATH (terraform 1.11 on these machines)");
    opts.extra.push_str(&format!(
        "\n[terraform]\nbinary = \"{terraform}\"\n\n[terraform.state]\nbucket = \"inst-demo-state\"\nendpoint = \"{}\"\n\n[policy]\ndir = \"{}\"\n",
        moto.url(),
        policies.path().display()
    ));
    opts.sandbox_extra = "enabled = false".into();
    opts.extra.push_str(&kube.runner_config());
    let journal = tempfile::tempdir().unwrap();
    with_private_journald(&mut opts, journal.path());
    let env = env_with(opts).await;
    SecretsEnv { env, moto, kube, values, journal, _policies: policies }
}

fn job(kind: &str, entity: &str, operation: &str, role: &str, spec: serde_json::Value) -> EnqueueRequest {
    EnqueueRequest {
        entity: entity.into(),
        operation: operation.into(),
        requested_role: Some(role.into()),
        app_config: Some(app_config()),
        role_request: Some(named("db")),
        ..EnqueueRequest::new(kind, spec)
    }
}

fn sync(e: &SecretsEnv, secrets: serde_json::Value) -> EnqueueRequest {
    job(
        "secrets.sync",
        "secret",
        "sync",
        "inst-demo-maintenance",
        serde_json::json!({"secrets": secrets, "kubeconfig": e.kube.kubeconfig("cluster-token-5e6f7a8b9c0d1e2f")}),
    )
}

async fn run(e: &SecretsEnv, req: EnqueueRequest) -> (String, byoc_protocol::JobResult, String) {
    let id = e.env.cp.enqueue(req).unwrap();
    let v = e.env.finished(&id).await;
    (id.clone(), v.result.unwrap(), e.env.output(&id))
}

fn b64(v: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(v)
}

fn secret_writes(kube: &FakeKubeApi) -> Vec<byoc_control_plane::kube_api::Recorded> {
    kube.requests().into_iter().filter(|r| r.method == "PATCH" && r.path.contains("/secrets/")).collect()
}

/// Every file under `dir`, recursively (sockets and the like skipped).
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let (path, kind) = (entry.path(), entry.file_type().unwrap());
        if kind.is_dir() {
            out.extend(files_under(&path));
        } else if kind.is_file() {
            out.push(path);
        }
    }
    out
}

/// The value, its base64 and its JSON string form appear nowhere we can look.
fn assert_nowhere(e: &SecretsEnv, value: &str, ids: &[String]) {
    let json = serde_json::to_string(value).unwrap();
    let forms = [value.to_string(), b64(value), json.trim_matches('"').to_string()];
    for f in files_under(&e.env.runner.state_dir) {
        let bytes = std::fs::read(&f).unwrap_or_default();
        for form in &forms {
            assert!(
                !bytes.windows(form.len()).any(|w| w == form.as_bytes()),
                "{form:?} is in {}",
                f.display()
            );
        }
    }
    let journal = journal_text(e.journal.path());
    for id in ids {
        assert!(journal.contains(id.as_str()), "the journal has no record of {id}");
    }
    for id in ids {
        let log = e.env.output(id);
        let view = serde_json::to_string(&e.env.cp.job(id)).unwrap();
        for form in &forms {
            assert!(!log.contains(form.as_str()), "{form:?} in the uploaded log of {id}:\n{log}");
            assert!(!view.contains(form.as_str()), "{form:?} in the result of {id}: {view}");
        }
    }
    for form in &forms {
        // journalctl's JSON escapes as JSON does; the raw form is what a value would be.
        assert!(!journal.contains(form.as_str()), "{form:?} in the journal");
    }
}

const MODULE: &str = r#"
variable "db_password" {
  type      = string
  sensitive = true
}

resource "terraform_data" "db" {
  input = var.db_password
}

output "password_length" {
  value = nonsensitive(length(var.db_password))
}

output "password" {
  value     = var.db_password
  sensitive = true
}
"#;

fn terraform_job(module: &str, secrets: &[&str]) -> EnqueueRequest {
    job(
        "terraform",
        "component",
        "deploy",
        "inst-demo-maintenance",
        serde_json::json!({"mode": "apply", "workspace": "db", "files": {"main.tf": module}, "secrets": secrets}),
    )
}

#[tokio::test]
async fn secrets_reach_the_cluster_and_terraform_and_never_the_vendor() {
    let e = secrets_env().await;
    assert_eq!(e.values["db_password"], DB_PASSWORD);
    assert_eq!(e.values["session_key"].len(), 32, "auto_generate left empty: generated");
    assert!(!e.values.contains_key("slack_webhook"), "optional and left empty: not created");
    let mut ids = Vec::new();

    // Every declared Kubernetes target, by server-side apply.
    let (id, r, log) = run(&e, sync(&e, serde_json::json!([]))).await;
    ids.push(id.clone());
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}\n{}", r.error, e.env.runner.log());
    let writes = secret_writes(&e.kube);
    let db = writes.iter().find(|w| w.path == "/api/v1/namespaces/app/secrets/db").expect("Secret app/db");
    assert_eq!(db.content_type, "application/apply-patch+yaml");
    assert!(
        db.query.contains("fieldManager=byoc-runner-secrets") && db.query.contains("force=true"),
        "{}",
        db.query
    );
    assert_eq!(db.body["kind"], "Secret");
    assert_eq!(db.body["data"]["value"], b64(DB_PASSWORD), "{}", db.body);
    let session = writes.iter().find(|w| w.path == "/api/v1/namespaces/app/secrets/session").unwrap();
    assert_eq!(session.body["data"]["key"], b64(&e.values["session_key"]));
    assert!(!writes.iter().any(|w| w.path.ends_with("/alerts")), "an unset optional secret is not written");
    // The vendor learns names, versions and keyed digests.
    let reported = r.outputs["secrets"].as_array().unwrap();
    let db_report = reported.iter().find(|s| s["name"] == "db_password").unwrap();
    let described = e
        .moto
        .json_call(
            "secretsmanager",
            "secretsmanager.DescribeSecret",
            serde_json::json!({"SecretId": "inst-demo/secrets/db_password"}),
        )
        .await;
    let current = described["VersionIdsToStages"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, stages)| stages.as_array().unwrap().iter().any(|s| s == "AWSCURRENT"))
        .map(|(v, _)| v.clone())
        .unwrap();
    assert_eq!(db_report["version_id"], current.as_str(), "{db_report}");
    assert_eq!(db_report["written_to"], serde_json::json!(["kubernetes:app/db#value"]));
    let key = std::fs::read(e.env.runner.state_dir.join("secrets/digest.key")).unwrap();
    assert_eq!(
        db_report["digest"],
        byoc_job_executors::secrets::digest(&key, DB_PASSWORD.as_bytes()).as_str()
    );
    let slack = reported.iter().find(|s| s["name"] == "slack_webhook").unwrap();
    assert!(slack["version_id"].is_null() && slack["written_to"] == serde_json::json!([]), "{slack}");
    // Each read audited: name, version, digest.
    let reads = audit_events(&e.env.runner.state_dir, "secret_read");
    assert!(
        reads.iter().any(|a| a["job"] == id.as_str() && a["detail"].as_str().unwrap().contains(&current))
    );
    // Under the job's role session (moto's STS), never the runner's own identity.
    assert!(
        e.moto
            .calls_of("AssumeRole")
            .await
            .iter()
            .any(|c| c.params["RoleArn"].ends_with("/inst-demo-maintenance"))
    );

    // A real terraform apply with the secret as a variable; its state in the customer's
    // bucket, so nothing of it on the runner's disk.
    let (id, r, log) = run(&e, terraform_job(MODULE, &["db_password"])).await;
    ids.push(id.clone());
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("secret db_password (version"), "{log}");
    assert_eq!(r.outputs["outputs"]["password_length"], DB_PASSWORD.len() as u64, "{}", r.outputs);
    assert_eq!(r.outputs["secrets"][0]["written_to"], serde_json::json!(["terraform:var.db_password"]));
    let state = e.moto.s3_object("inst-demo-state", "inst-demo/db/terraform.tfstate").await.unwrap();
    assert!(String::from_utf8_lossy(&state).contains("terraform_data"), "the apply reached the bucket");

    // A kubernetes deploy naming the secret writes its declared Secret with the manifests.
    let before = secret_writes(&e.kube).len();
    let spec = serde_json::json!({
        "action": "apply", "component": "api", "namespace": "app", "wait_secs": 30,
        "manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "api-config"}, "data": {"mode": "prod"}}],
        "kubeconfig": e.kube.kubeconfig("cluster-token-5e6f7a8b9c0d1e2f"),
        "secrets": ["db_password"],
    });
    let (id, r, log) = run(&e, job("kubernetes", "component", "deploy", "inst-demo-maintenance", spec)).await;
    ids.push(id.clone());
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert_eq!(secret_writes(&e.kube).len(), before + 1);
    assert!(e.kube.object("/api/v1/namespaces/app/configmaps/api-config").is_some());
    assert_eq!(
        r.outputs["secrets"][0]["written_to"],
        serde_json::json!(["kubernetes:app/db#value"]),
        "{}",
        r.outputs
    );

    // Rotation: a new version is what the next sync writes.
    e.moto
        .json_call(
            "secretsmanager",
            "secretsmanager.PutSecretValue",
            serde_json::json!({"SecretId": "inst-demo/secrets/db_password", "SecretString": ROTATED}),
        )
        .await;
    let (id, r, log) = run(&e, sync(&e, serde_json::json!(["db_password"]))).await;
    ids.push(id.clone());
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let rotated_version = r.outputs["secrets"][0]["version_id"].as_str().unwrap().to_string();
    assert_ne!(rotated_version, current);
    assert_ne!(r.outputs["secrets"][0]["digest"], db_report["digest"]);
    let live = e.kube.object("/api/v1/namespaces/app/secrets/db").unwrap();
    assert_eq!(live["data"]["value"], b64(ROTATED));
    // The customer's view: names, versions, where; never a value.
    let listed = e.env.cli_json(&["secrets"]);
    let row = listed.as_array().unwrap().iter().find(|s| s["name"] == "db_password").unwrap();
    assert_eq!(row["version_id"], rotated_version.as_str(), "{listed}");
    assert_eq!(row["job_id"], id.as_str());
    let text = e.env.runner.cli(&["secrets"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("kubernetes:app/db#value"));

    for v in [DB_PASSWORD, ROTATED, e.values["session_key"].as_str()] {
        assert_nowhere(&e, v, &ids);
    }
}

#[tokio::test]
async fn what_the_app_config_does_not_allow_is_refused_and_nothing_is_written() {
    let e = secrets_env().await;
    // A forged job: a declared secret sent to a Secret the app config does not name.
    let forged = serde_json::json!([{"name": "db_password", "kubernetes": {"namespace": "vendor", "name": "exfil", "key": "value"}}]);
    let id = e.env.cp.enqueue(sync(&e, forged)).unwrap();
    let v = e.env.rejected(&id).await;
    assert_eq!(v.rejections[0].0, RejectReason::SecretTargetNotDeclared, "{:?}", v.rejections);
    assert!(v.rejections[0].1.contains("kubernetes:vendor/exfil#value"), "{}", v.rejections[0].1);
    // A secret without a terraform_variable cannot be passed to terraform.
    let id = e.env.cp.enqueue(terraform_job(MODULE, &["slack_webhook"])).unwrap();
    let v = e.env.rejected(&id).await;
    assert_eq!(v.rejections[0].0, RejectReason::SecretTargetNotDeclared, "{:?}", v.rejections);
    // A name the app config does not declare.
    let id = e.env.cp.enqueue(sync(&e, serde_json::json!(["root_password"]))).unwrap();
    assert_eq!(e.env.rejected(&id).await.rejections[0].0, RejectReason::SecretTargetNotDeclared);
    let refusals = audit_events(&e.env.runner.state_dir, "job_rejected");
    assert!(
        refusals.iter().filter(|r| r.to_string().contains("secret_target_not_declared")).count() >= 3,
        "{refusals:?}"
    );

    // A role the app config does not let read session_key (read_by = ["maintenance"]).
    let mut as_provision = sync(&e, serde_json::json!(["session_key"]));
    as_provision.requested_role = Some("inst-demo-provision".into());
    let app = as_provision.app_config.as_mut().unwrap();
    app.operation_roles = Some(
        app.operation_roles
            .clone()
            .unwrap()
            .replace("[defaults]\n", "[defaults]\n\"secret.sync\" = \"provision\"\n"),
    );
    let (_, r, log) = run(&e, as_provision).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "secret_forbidden", "{}\n{log}", r.outputs);
    assert!(r.error.unwrap().contains("may not read it"));

    // A value not in the declared format: refused, never named.
    let mut as_base64 = sync(&e, serde_json::json!(["db_password"]));
    let app = as_base64.app_config.as_mut().unwrap();
    let declared = app.secrets.clone().unwrap();
    app.secrets =
        Some(declared.replace("terraform_variable          = \"db_password\"", "format = \"base64\""));
    assert_ne!(app.secrets.as_deref(), Some(declared.as_str()));
    let (_, r, log) = run(&e, as_base64).await;
    assert_eq!(r.outputs["reason"], "secret_format_invalid", "{}\n{log}", r.outputs);
    assert!(!r.error.unwrap().contains("Db-pa55"));

    // A required secret gone from Secrets Manager: refused before anything is written.
    e.moto
        .json_call(
            "secretsmanager",
            "secretsmanager.DeleteSecret",
            serde_json::json!({"SecretId": "inst-demo/secrets/db_password", "ForceDeleteWithoutRecovery": true}),
        )
        .await;
    let (_, r, log) = run(&e, sync(&e, serde_json::json!(["session_key", "db_password"]))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "secret_missing", "{}\n{log}", r.outputs);
    assert!(secret_writes(&e.kube).is_empty(), "nothing half-written: {:?}", secret_writes(&e.kube).len());
    assert!(e.moto.calls_of("GetSecretValue").await.len() >= 2, "both read before any write");
}

#[tokio::test]
async fn a_plan_whose_addresses_carry_a_secret_is_not_reported() {
    let e = secrets_env().await;
    // A careless module: the variable is not marked sensitive, and keys a resource.
    let module = "variable \"db_password\" {\n  type = string\n}\n\nresource \"terraform_data\" \"per_password\" {\n  for_each = toset([var.db_password])\n  input    = each.key\n}\n";
    let (id, r, log) = run(&e, terraform_job(module, &["db_password"])).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "secret_in_plan_summary", "{}\n{log}", r.outputs);
    assert!(
        e.moto.s3_object("inst-demo-state", "inst-demo/db/terraform.tfstate").await.is_none(),
        "never applied"
    );
    assert_nowhere(&e, DB_PASSWORD, &[id]);
}
