//! `helm`: render, decide, deploy exactly what was decided. The `helm` CLI runs in the
//! sandbox with the job's role credentials and a kubeconfig the runner renders:
//! `upgrade --install --dry-run=server -o json` (the cluster's view; its output to the
//! runner, never the job log) → the policy decision over the manifests, hooks and CRDs
//! (audited) → `upgrade --install --atomic --wait --timeout` of a chart the runner
//! writes holding exactly those bytes (`judged`); `uninstall` and `rollback` judged on
//! what they delete or restore. The result carries the release status and a summary
//! of what changed against the manifest deployed before.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use serde::Deserialize;
use sha2::Digest as _;

use crate::tool::{Run, failed, parse_manifests};

mod judged;
mod secret_values;
use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};
use secret_values::secret_values;

const CHART_DIR: &str = "chart";
const DEPLOYED: &str = "deployed.yaml";
const STATUS: &str = "status.json";
const VALUES: &str = "values.json";
const SECRET_VALUES: &str = "secret-values.json";
const KUBECONFIG: &str = "kubeconfig";
/// What the runner reads back of helm's files in the job's directory, at most.
const MAX_HELM_FILE_BYTES: u64 = 64 << 20;

/// A file helm wrote in the job's directory, read the one safe way (`job_files`: beneath
/// the directory, no link followed, a regular file, capped).
fn helm_file(run: &Run<'_, '_>, name: &str) -> Result<Vec<u8>, crate::job_files::JobFileError> {
    crate::job_files::read(&run.ctx.settings.work_dir, name, MAX_HELM_FILE_BYTES)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Action {
    Upgrade,
    Uninstall,
    Rollback,
    /// Compare the live objects with what the release deployed; change nothing.
    Drift,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    action: Action,
    release: String,
    namespace: String,
    /// The chart from the install's registry, by digest: `<registry>/<repo>@sha256:…`
    /// (helm's OCI chart artifact, synced there first). The runner fetches, verifies and
    /// unpacks it; helm gets a local path and no registry credential at all.
    #[serde(default)]
    chart: Option<String>,
    /// Or inline, for small charts and tests: relative path → content.
    #[serde(default)]
    files: BTreeMap<String, String>,
    #[serde(default)]
    values: serde_json::Value,
    /// Written to a file of their own and masked wherever output goes.
    #[serde(default)]
    secret_values: BTreeMap<String, String>,
    /// The customer's secrets, by name: each set at the helm value path the app config
    /// declares for it (`helm_value`), in the secret values file (docs/SECRETS.md).
    #[serde(default)]
    secrets: Vec<String>,
    /// Kubeconfig (secret): written to a 0600 file for the tool.
    #[serde(default)]
    kubeconfig: Option<String>,
    #[serde(default = "default_wait")]
    wait_secs: u64,
    /// For rollback: the revision to return to (0: the previous one).
    #[serde(default)]
    revision: u32,
}

fn default_wait() -> u64 {
    300
}

pub struct Helm {
    spec: Spec,
    chart: Option<byoc_oci_sync::Reference>,
    /// The checked kubeconfig (`cluster.rs`): helm gets one rendered from its parts.
    cluster: Option<crate::cluster::ClusterAccess>,
}

fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 53
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl Helm {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        let s: Spec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        if !dns_label(&s.release) {
            return Err(crate::InvalidSpec::from(format!("release {:?}: 1-53 of [a-z0-9-]", s.release)));
        }
        if !dns_label(&s.namespace) {
            return Err(crate::InvalidSpec::from(format!("namespace {:?}: a DNS label", s.namespace)));
        }
        let chart = match (&s.chart, s.files.is_empty()) {
            (Some(c), true) => Some(crate::artifact::parse_reference("chart", c)?),
            (Some(_), false) => {
                return Err(crate::InvalidSpec::from(
                    "name the chart by digest (chart) or inline (files), not both",
                ));
            }
            (None, true) if s.action == Action::Upgrade => {
                return Err(crate::InvalidSpec::from(
                    "upgrade needs the chart: chart = \"<registry>/<repo>@sha256:…\", or files",
                ));
            }
            (None, _) => None,
        };
        if let Some(bad) = s.files.keys().find(|p| !crate::tool::safe_relative(p)) {
            return Err(crate::InvalidSpec::from(format!(
                "files: {bad:?} is not a relative path inside the chart"
            )));
        }
        if let Some((k, _)) = s.secret_values.iter().find(|(_, v)| v.len() < crate::mask::MIN_SECRET_LEN) {
            return Err(crate::InvalidSpec::from(format!(
                "secret_values {k}: shorter than {} bytes cannot be masked",
                crate::mask::MIN_SECRET_LEN
            )));
        }
        if !(s.values.is_null() || s.values.is_object()) {
            return Err(crate::InvalidSpec::from("values must be an object"));
        }
        if let Some(bad) = s.secrets.iter().find(|n| !crate::secrets::valid_name(n)) {
            return Err(crate::InvalidSpec::from(format!("secret name {bad:?}: 1-128 of [A-Za-z0-9_-]")));
        }
        if !s.secrets.is_empty() && s.action != Action::Upgrade {
            return Err(crate::InvalidSpec::from("secrets are set by action = \"upgrade\" only"));
        }
        if s.action == Action::Drift && s.kubeconfig.is_none() {
            return Err(crate::InvalidSpec::from("drift reads the live objects: it needs the kubeconfig"));
        }
        if s.wait_secs == 0 || s.wait_secs > 3600 {
            return Err(crate::InvalidSpec::from("wait_secs: 1..=3600"));
        }
        let cluster = s.kubeconfig.as_deref().map(crate::cluster::parse_kubeconfig).transpose()?;
        Ok(Helm { spec: s, chart, cluster })
    }
}

fn identity(m: &serde_json::Value) -> String {
    format!(
        "{}/{}/{}",
        m["kind"].as_str().unwrap_or("?"),
        m["metadata"]["namespace"].as_str().unwrap_or("-"),
        m["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// What the new manifests add, change and remove against the deployed ones (object
/// identities only: no values leave the VM).
fn diff_summary(before: &[serde_json::Value], after: &[serde_json::Value]) -> serde_json::Value {
    let digest = |m: &serde_json::Value| hex::encode(sha2::Sha256::digest(m.to_string().as_bytes()));
    let b: BTreeMap<String, String> = before.iter().map(|m| (identity(m), digest(m))).collect();
    let a: BTreeMap<String, String> = after.iter().map(|m| (identity(m), digest(m))).collect();
    let keys: BTreeSet<&String> = b.keys().chain(a.keys()).collect();
    let (mut added, mut changed, mut removed, mut unchanged) = (vec![], vec![], vec![], 0);
    for k in keys {
        match (b.get(k), a.get(k)) {
            (None, Some(_)) => added.push(k.clone()),
            (Some(_), None) => removed.push(k.clone()),
            (Some(x), Some(y)) if x != y => changed.push(k.clone()),
            _ => unchanged += 1,
        }
    }
    serde_json::json!({"added": added, "changed": changed, "removed": removed, "unchanged": unchanged})
}

impl Helm {
    async fn go(&self, ctx: &mut ExecContext<'_>) -> ExecOutcome {
        let s = &self.spec;
        let dir = ctx.settings.work_dir.clone();
        let write = |name: &str, content: &[u8], mode: u32| -> std::io::Result<()> {
            use std::os::unix::fs::OpenOptionsExt as _;
            let p = dir.join(name);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let mut f =
                std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(p)?;
            std::io::Write::write_all(&mut f, content)
        };
        if let Some(reference) = &self.chart
            && let Err(outcome) = self.fetch_chart(ctx, reference, &dir.join(CHART_DIR)).await
        {
            return outcome;
        }
        for (rel, content) in &s.files {
            if let Err(e) = write(&format!("{CHART_DIR}/{rel}"), content.as_bytes(), 0o644) {
                return ExecOutcome::failed(format!("writing chart file {rel}: {e}"));
            }
        }
        let values = if s.values.is_null() { serde_json::json!({}) } else { s.values.clone() };
        // JSON is YAML: helm reads both.
        let mut files = vec![(VALUES, values.to_string(), 0o644)];
        let (secret_file, customer_secrets) = match self.secret_values_file(ctx).await {
            Ok(v) => v,
            Err(outcome) => return outcome,
        };
        if let Some(content) = secret_file {
            files.push((SECRET_VALUES, content, 0o600));
        }
        // Not the job's document: one the runner renders from the checked parts.
        if let Some(c) = &self.cluster {
            files.push((KUBECONFIG, c.to_kubeconfig(), 0o600));
        }
        for (name, content, mode) in &files {
            if let Err(e) = write(name, content.as_bytes(), *mode) {
                return ExecOutcome::failed(format!("writing {name}: {e}"));
            }
        }
        if let Err(e) = crate::tool::hand_over(ctx, &dir) {
            return ExecOutcome::failed(format!("handing the chart to the job's uid: {e}"));
        }
        let inside = match &ctx.settings.sandbox {
            Some(_) => crate::sandboxed::work_dir_inside(),
            None => ctx.settings.work_dir.clone(),
        };
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), crate::tool::DEFAULT_PATH.into()),
            ("HOME".into(), inside.display().to_string()),
            ("BYOC_JOB_ID".into(), ctx.settings.job_id.clone()),
            ("HELM_CACHE_HOME".into(), inside.join(".helm/cache").display().to_string()),
            ("HELM_CONFIG_HOME".into(), inside.join(".helm/config").display().to_string()),
            ("HELM_DATA_HOME".into(), inside.join(".helm/data").display().to_string()),
        ];
        if s.kubeconfig.is_some() {
            env.push(("KUBECONFIG".into(), inside.join(KUBECONFIG).display().to_string()));
        }
        crate::add_role_env(ctx, &mut env, true);
        let helm = ctx.settings.tools.helm.display().to_string();
        let mut run =
            Run { tool: "helm", ctx, started: Instant::now(), env, watch: None, seen: false, binds: vec![] };
        let mut outcome = match self.steps(&mut run, &helm).await {
            Ok(o) | Err(o) => o,
        };
        if let (Some(report), Some(o)) = (customer_secrets, outcome.outputs.as_object_mut()) {
            o.insert("secrets".into(), report);
        }
        outcome
    }

    /// The secret values file: the job's `secret_values`, and each customer secret it
    /// names at its declared path. `None` when there is neither.
    async fn secret_values_file(
        &self,
        ctx: &mut ExecContext<'_>,
    ) -> Result<(Option<String>, Option<serde_json::Value>), ExecOutcome> {
        let s = &self.spec;
        if s.secret_values.is_empty() && s.secrets.is_empty() {
            return Ok((None, None));
        }
        let fetched = crate::secrets::fetch(ctx, &self.secret_uses())
            .await
            .map_err(|e| failed(e.code(), e.to_string(), serde_json::Value::Null))?;
        let (file, written) = secret_values(&s.secret_values, &fetched)
            .map_err(|why| failed("invalid_spec", why.0, serde_json::Value::Null))?;
        let report = (!fetched.is_empty()).then(|| crate::secrets::report(&fetched, &written));
        Ok((Some(file.to_string()), report))
    }

    /// The chart by digest, into `to`: helm's chart archive holds one directory (the
    /// chart's name) with `Chart.yaml` in it.
    async fn fetch_chart(
        &self,
        ctx: &mut ExecContext<'_>,
        reference: &byoc_oci_sync::Reference,
        to: &std::path::Path,
    ) -> Result<(), ExecOutcome> {
        let fetched = match crate::artifact::fetch(&ctx.settings, reference).await {
            Ok(f) => f,
            Err(e) => {
                let _ = ctx.output.write(format!("[helm] chart {reference}: {e}\n").as_bytes());
                return Err(failed(
                    &e.code(),
                    e.to_string(),
                    serde_json::json!({"chart": reference.to_string()}),
                ));
            }
        };
        let root = if fetched.tree.join("Chart.yaml").is_file() {
            fetched.tree.clone()
        } else {
            let dirs: Vec<_> = std::fs::read_dir(&fetched.tree)
                .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.join("Chart.yaml").is_file()).collect())
                .unwrap_or_default();
            match dirs.as_slice() {
                [one] => one.clone(),
                _ => {
                    return Err(failed(
                        "artifact_invalid",
                        format!("chart {reference}: no Chart.yaml at its root or in its one directory"),
                        serde_json::json!({"chart": reference.to_string()}),
                    ));
                }
            }
        };
        crate::artifact::copy_tree(&root, to)
            .map_err(|e| ExecOutcome::failed(format!("copying the chart into the job's directory: {e}")))?;
        let _ = ctx.output.write(
            format!(
                "[helm] chart {reference}: {} files{}\n",
                fetched.files,
                if fetched.cached { " (cached)" } else { ", fetched and verified" }
            )
            .as_bytes(),
        );
        ctx.settings.artifact = Some(fetched.digest.to_string());
        Ok(())
    }

    fn chart_args(&self) -> Vec<String> {
        let s = &self.spec;
        let mut v = vec![format!("./{CHART_DIR}")];
        v.extend(["--namespace".into(), s.namespace.clone(), "-f".into(), VALUES.into()]);
        if !s.secret_values.is_empty() || !s.secrets.is_empty() {
            v.extend(["-f".into(), SECRET_VALUES.into()]);
        }
        v
    }

    /// What the release has deployed now (`helm get manifest`): none when there is no
    /// release yet (the command fails), an error only when the step itself could not run.
    async fn deployed(
        &self,
        run: &mut Run<'_, '_>,
        sh: &impl Fn(String, &str) -> Vec<String>,
    ) -> Result<Vec<serde_json::Value>, ExecOutcome> {
        let s = &self.spec;
        let get = sh(format!("get manifest '{}' --namespace '{}'", s.release, s.namespace), DEPLOYED);
        match run.cmd("get manifest", get).await {
            Ok(()) => {
                let raw = helm_file(run, DEPLOYED).map_err(|e| {
                    failed(e.code(), format!("reading the deployed manifests: {e}"), serde_json::Value::Null)
                })?;
                Ok(parse_manifests(&String::from_utf8_lossy(&raw)).unwrap_or_default())
            }
            Err(o) if o.status == JobStatus::Failed => Ok(vec![]),
            Err(o) => Err(o),
        }
    }

    /// A drift check (docs/DRIFT.md): the release's manifest (`helm get manifest`, in the
    /// sandbox) against the live objects, read by the runner with the job's
    /// kubeconfig (GETs only); the policies over the live objects.
    async fn drift(
        &self,
        run: &mut Run<'_, '_>,
        sh: &impl Fn(String, &str) -> Vec<String>,
    ) -> Result<ExecOutcome, ExecOutcome> {
        use crate::kubernetes::drift;
        let s = &self.spec;
        run.log(&format!(
            "[helm] drift check of release {}: live objects against its manifest; nothing is changed\n",
            s.release
        ));
        let deployed = self.deployed(run, sh).await?;
        let objects = crate::kubernetes::objects_of(deployed, &s.namespace).map_err(|e| {
            failed("release_unreadable", format!("the release's manifest: {}", e.0), serde_json::Value::Null)
        })?;
        let digest = drift::manifests_digest(&objects);
        if objects.is_empty() {
            return Ok(drift::not_deployed(run.ctx, "helm", &s.release, &digest));
        }
        let Some(cluster) = &self.cluster else {
            return Err(failed("invalid_spec", "drift needs the kubeconfig".into(), serde_json::Value::Null));
        };
        let client = cluster
            .client(&run.ctx.settings.cluster_reach)
            .await
            .map_err(|e| failed(e.code(), e.to_string(), serde_json::Value::Null))?;
        let cancel = run.ctx.settings.cancel.clone();
        let seen = tokio::select! {
            r = drift::compare_live(&client, &objects) => r.map_err(|(reason, e)| failed(reason, e, serde_json::Value::Null))?,
            _ = cancel.cancelled() => return Err(ExecOutcome { status: JobStatus::Cancelled, exit_code: None, error: Some("job was cancelled".into()), outputs: serde_json::Value::Null }),
        };
        Ok(drift::judge(run.ctx, byoc_policy::Source::Helm, "helm", &s.release, seen, Vec::new(), &digest)
            .await)
    }

    async fn steps(&self, run: &mut Run<'_, '_>, helm: &str) -> Result<ExecOutcome, ExecOutcome> {
        let sh = |args: String, file: &str| {
            vec!["/bin/sh".to_string(), "-c".into(), format!("exec \"$0\" {args} > {file}"), helm.to_string()]
        };
        match self.spec.action {
            Action::Drift => self.drift(run, &sh).await,
            Action::Uninstall => self.uninstall(run, helm, &sh).await,
            Action::Rollback => self.rollback(run, helm, &sh).await,
            Action::Upgrade => self.upgrade(run, helm, &sh).await,
        }
    }

    /// helm's argv: `args`, waiting for the release up to the spec's time, in its namespace.
    fn waited(&self, helm: &str, args: Vec<String>) -> Vec<String> {
        let s = &self.spec;
        let mut v = vec![helm.to_string()];
        v.extend(args);
        v.extend(["--wait".to_string(), "--timeout".into(), format!("{}s", s.wait_secs)]);
        v.extend(["--namespace".to_string(), s.namespace.clone()]);
        v
    }

    /// What the release has deployed is about to be deleted: reviewed as DELETE first
    /// (nothing deployed, nothing to decide).
    async fn uninstall(
        &self,
        run: &mut Run<'_, '_>,
        helm: &str,
        sh: &impl Fn(String, &str) -> Vec<String>,
    ) -> Result<ExecOutcome, ExecOutcome> {
        let s = &self.spec;
        let deployed = self.deployed(run, sh).await?;
        if !deployed.is_empty() {
            let bytes = serde_json::to_vec(&deployed).unwrap_or_default();
            let subject = crate::policy_gate::Subject {
                source: byoc_policy::Source::Helm,
                admission: byoc_policy::Admission::Delete,
                name: "manifests",
                digest: None,
            };
            let decision = crate::policy_gate::decide(run.ctx, subject, &bytes).await.map_err(|e| {
                failed(crate::policy_gate::UNAVAILABLE, e.to_string(), serde_json::Value::Null)
            })?;
            let digest = decision.input_digest.clone();
            if decision.verdict == byoc_policy::Verdict::Deny {
                return Err(failed(
                    "policy_denied",
                    format!("policy denied the uninstall: {}", decision.denials().join(", ")),
                    serde_json::json!({"release": s.release, "manifests_digest": digest}),
                ));
            }
        }
        if run.ctx.settings.decide_only {
            run.log("[helm] stopping after the decision: nothing uninstalled\n");
            return Ok(succeeded(serde_json::json!({"release": s.release})));
        }
        run.cmd("uninstall", self.waited(helm, vec!["uninstall".into(), s.release.clone()])).await?;
        Ok(succeeded(serde_json::json!({"release": s.release, "uninstalled": true})))
    }

    /// A rollback restores a revision's stored manifests and hooks (nothing is rendered
    /// again): those are what is judged.
    async fn rollback(
        &self,
        run: &mut Run<'_, '_>,
        helm: &str,
        sh: &impl Fn(String, &str) -> Vec<String>,
    ) -> Result<ExecOutcome, ExecOutcome> {
        let s = &self.spec;
        let argv = |a: Vec<String>| [vec![helm.to_string()], a].concat();
        let revision = self.rollback_target(run, &argv).await?;
        let get = |what: &str| {
            argv(vec![
                "get".to_string(),
                what.into(),
                s.release.clone(),
                "--revision".into(),
                revision.to_string(),
                "--namespace".into(),
                s.namespace.clone(),
            ])
        };
        let manifest = run.captured("get manifest --revision", get("manifest"), MAX_HELM_FILE_BYTES).await?;
        let hooks = run.captured("get hooks --revision", get("hooks"), MAX_HELM_FILE_BYTES).await?;
        let text =
            format!("{}\n---\n{}", String::from_utf8_lossy(&manifest), String::from_utf8_lossy(&hooks));
        let manifests = parse_manifests(&text).map_err(|e| {
            failed("manifests_unreadable", format!("revision {revision}: {e}"), serde_json::Value::Null)
        })?;
        let mut base = self.judge_release(run, sh, &manifests, "rollback").await?;
        let back = vec!["rollback".into(), s.release.clone(), revision.to_string()];
        run.cmd("rollback", self.waited(helm, back)).await?;
        base["revision_restored"] = revision.into();
        base["status"] = self.status(run, helm).await?;
        Ok(succeeded(base))
    }

    /// helm renders with the cluster's view and reports to the runner; what is judged is
    /// installed as a chart of the runner's with nothing left to render.
    async fn upgrade(
        &self,
        run: &mut Run<'_, '_>,
        helm: &str,
        sh: &impl Fn(String, &str) -> Vec<String>,
    ) -> Result<ExecOutcome, ExecOutcome> {
        let s = &self.spec;
        let mut dry = vec![helm.to_string(), "upgrade".to_string(), "--install".into(), s.release.clone()];
        dry.extend(self.chart_args());
        dry.extend(["--dry-run=server".into(), "--output".into(), "json".into()]);
        let release = run.captured("upgrade --install --dry-run=server", dry, MAX_HELM_FILE_BYTES).await?;
        let crds = judged::chart_crds(&run.ctx.settings.work_dir, CHART_DIR, MAX_HELM_FILE_BYTES)?;
        let rendering = judged::Rendering::from_release(&release, crds)?;
        let manifests = rendering.manifests()?;
        let mut out = self.judge_release(run, sh, &manifests, "release").await?;
        // Exactly the judged bytes.
        let sealed = crate::tool::SealedDir::create(run.ctx)
            .and_then(|sealed| rendering.write_chart(&sealed).map(|()| sealed))
            .map_err(|e| ExecOutcome::failed(format!("writing the judged chart: {e}")))?;
        let chart = sealed.inside.join(judged::JUDGED_CHART).display().to_string();
        let judged = vec!["upgrade".into(), "--install".into(), s.release.clone(), chart];
        let up = self.waited(helm, [judged, vec!["--reset-values".into(), "--atomic".into()]].concat());
        run.staged("upgrade --install (the judged manifests)", up, vec![], Some(&sealed)).await?;
        out["status"] = self.status(run, helm).await?;
        Ok(succeeded(out))
    }

    /// The policies' decision over what a release will hold (`what`: "release",
    /// "rollback"), with the diff against what it holds now; then the customer's approval
    /// of exactly these manifests, if a rule asks for it. Returns the result's outputs so
    /// far, `Err` carrying them when the job stops after the decision (decide-only).
    async fn judge_release(
        &self,
        run: &mut Run<'_, '_>,
        sh: &impl Fn(String, &str) -> Vec<String>,
        manifests: &[serde_json::Value],
        what: &str,
    ) -> Result<serde_json::Value, ExecOutcome> {
        let s = &self.spec;
        // What is deployed now (absent on the first install).
        let before = self.deployed(run, sh).await?;
        let diff = diff_summary(&before, manifests);
        let bytes = serde_json::to_vec(manifests).unwrap_or_default();
        let subject = crate::policy_gate::Subject {
            source: byoc_policy::Source::Helm,
            // A release deployed before is upgraded; a new one is installed.
            admission: if before.is_empty() {
                byoc_policy::Admission::Create
            } else {
                byoc_policy::Admission::Update
            },
            name: "manifests",
            digest: None,
        };
        let decision = crate::policy_gate::decide(run.ctx, subject, &bytes)
            .await
            .map_err(|e| failed(crate::policy_gate::UNAVAILABLE, e.to_string(), serde_json::Value::Null))?;
        let base = serde_json::json!({"release": s.release, "manifests_digest": decision.input_digest, "diff": diff, "verdict": decision.verdict,
            "violations": decision.violations.iter().map(byoc_policy::Finding::reference).collect::<Vec<_>>(),
            "passed": decision.passes.iter().map(byoc_policy::Finding::reference).collect::<Vec<_>>()});
        if decision.verdict == byoc_policy::Verdict::Deny {
            return Err(failed(
                "policy_denied",
                format!("policy denied the {what}: {}", decision.denials().join(", ")),
                base,
            ));
        }
        if run.ctx.settings.decide_only {
            run.log("[helm] stopping after the decision: nothing applied\n");
            return Err(ExecOutcome {
                status: JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                outputs: base,
            });
        }
        let list = |k: &str| diff[k].as_array().cloned().unwrap_or_default();
        let mut counts = serde_json::Map::new();
        let mut addresses = serde_json::Map::new();
        for (action, objs) in
            [("add", list("added")), ("change", list("changed")), ("remove", list("removed"))]
        {
            if !objs.is_empty() {
                counts.insert(action.into(), objs.len().into());
                addresses.insert(action.into(), objs.into());
            }
        }
        let summary = serde_json::json!({"counts": counts, "addresses": addresses});
        run.started += crate::policy_gate::approve_apply(
            run.ctx,
            "helm",
            &decision.input_digest,
            &summary,
            &decision,
            &base,
        )
        .await?;
        Ok(base)
    }

    /// The revision a rollback restores: the one the job names, or (0) the one before the
    /// release's latest, from `helm history`.
    async fn rollback_target(
        &self,
        run: &mut Run<'_, '_>,
        argv: &impl Fn(Vec<String>) -> Vec<String>,
    ) -> Result<u32, ExecOutcome> {
        let s = &self.spec;
        if s.revision > 0 {
            return Ok(s.revision);
        }
        let history = argv(vec![
            "history".into(),
            s.release.clone(),
            "--namespace".into(),
            s.namespace.clone(),
            "--output".into(),
            "json".into(),
        ]);
        let raw = run.captured("history", history, MAX_HELM_FILE_BYTES).await?;
        let v: serde_json::Value = serde_json::from_slice(&raw).map_err(|e| {
            failed("release_unreadable", format!("helm history: {e}"), serde_json::Value::Null)
        })?;
        let latest =
            v.as_array().into_iter().flatten().filter_map(|r| r["revision"].as_u64()).max().unwrap_or(0);
        match u32::try_from(latest.saturating_sub(1)) {
            Ok(previous) if previous > 0 => Ok(previous),
            _ => Err(failed(
                "invalid_spec",
                format!("release {} has no revision before its latest to roll back to", s.release),
                serde_json::Value::Null,
            )),
        }
    }

    async fn status(&self, run: &mut Run<'_, '_>, helm: &str) -> Result<serde_json::Value, ExecOutcome> {
        let s = &self.spec;
        let argv = vec![
            "/bin/sh".to_string(),
            "-c".into(),
            format!("exec \"$0\" status '{}' --namespace '{}' -o json > {STATUS}", s.release, s.namespace),
            helm.to_string(),
        ];
        run.cmd("status", argv).await?;
        let raw = helm_file(run, STATUS)
            .map_err(|e| failed(e.code(), format!("reading the status: {e}"), serde_json::Value::Null))?;
        let v: serde_json::Value = serde_json::from_slice(&raw)
            .map_err(|e| ExecOutcome::failed(format!("helm status -o json: {e}")))?;
        // Name, revision and state only: the status also carries the rendered values.
        Ok(
            serde_json::json!({"revision": v["version"], "status": v["info"]["status"], "last_deployed": v["info"]["last_deployed"]}),
        )
    }
}

impl Executor for Helm {
    fn effect(&self) -> byoc_protocol::Effect {
        use byoc_protocol::Effect;
        match self.spec.action {
            Action::Drift => Effect::Read,
            Action::Upgrade | Action::Rollback => Effect::Change,
            Action::Uninstall => Effect::Destroy,
        }
    }

    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move { self.go(&mut ctx).await })
    }

    fn placement(&self) -> crate::Placement {
        crate::Placement::Sandbox { network: true }
    }

    fn is_drift_check(&self) -> bool {
        self.spec.action == Action::Drift
    }

    fn secret_uses(&self) -> Vec<crate::secrets::SecretUse> {
        crate::secrets::uses(&self.spec.secrets, crate::secrets::Target::HelmValue)
    }

    fn drift_spec(&self) -> Option<serde_json::Value> {
        // The release and the cluster: the check reads what the release deployed.
        (self.spec.action == Action::Upgrade).then(|| {
            serde_json::json!({"action": "drift", "release": self.spec.release, "namespace": self.spec.namespace,
                "kubeconfig": self.spec.kubeconfig})
        })
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = self.spec.secret_values.values().map(|v| v.as_bytes().to_vec()).collect();
        if let Some(c) = &self.cluster {
            v.extend(crate::cluster::ClusterSource::Kubeconfig(c.clone()).secrets());
        }
        v
    }

    fn endpoints(&self) -> Vec<crate::Endpoint> {
        let mut e = Vec::new();
        if let Some(c) = &self.cluster {
            e.push(crate::Endpoint::Cluster {
                field: "kubeconfig: clusters[0].cluster.server",
                url: c.server.clone(),
            });
        }
        if let Some(r) = &self.chart {
            e.push(crate::Endpoint::Registry { field: "chart", name: r.registry.clone() });
        }
        e
    }
}

fn succeeded(outputs: serde_json::Value) -> ExecOutcome {
    ExecOutcome { status: JobStatus::Succeeded, exit_code: Some(0), error: None, outputs }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_document_yaml_parses_and_diffs_by_identity() {
        let y = "---\napiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: acme}\nspec: {type: ClusterIP}\n---\n# empty\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: api\n  namespace: acme\nspec:\n  replicas: 2\n";
        let ms = parse_manifests(y).unwrap_or_default();
        assert_eq!(ms.len(), 2);
        assert_eq!(ms[1]["spec"]["replicas"], 2);
        let mut after = ms.clone();
        after[1]["spec"]["replicas"] = 3.into();
        after.push(serde_json::json!({"kind": "ConfigMap", "metadata": {"name": "c", "namespace": "acme"}}));
        let d = diff_summary(&ms, &after[1..]);
        assert_eq!(d["changed"][0], "Deployment/acme/api");
        assert_eq!(d["added"][0], "ConfigMap/acme/c");
        assert_eq!(d["removed"][0], "Service/acme/api");
        assert!(parse_manifests("- a\n- b\n").is_err());
    }

    #[test]
    fn specs_are_validated() {
        let ok = serde_json::json!({"action": "upgrade", "release": "api", "namespace": "acme", "files": {"Chart.yaml": "name: api"}});
        assert!(Helm::from_spec(&ok).is_ok());
        for bad in [
            serde_json::json!({"action": "upgrade", "release": "API", "namespace": "acme", "files": {"a": ""}}),
            serde_json::json!({"action": "upgrade", "release": "api", "namespace": "acme"}),
            serde_json::json!({"action": "upgrade", "release": "api", "namespace": "acme", "oci": "oci://x/y"}),
            serde_json::json!({"action": "upgrade", "release": "api", "namespace": "acme", "files": {"../x": ""}}),
            serde_json::json!({"action": "upgrade", "release": "api", "namespace": "acme", "files": {"a": ""}, "secret_values": {"p": "x"}}),
        ] {
            assert!(Helm::from_spec(&bad).is_err(), "{bad}");
        }
    }
}
