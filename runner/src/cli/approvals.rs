//! `approvals [show JOB]`, `approve JOB`, `deny JOB`: the customer's answer to jobs held by a
//! `[[guardrails.approval_rule]]` (docs/GUARDRAILS.md). Answering needs root or
//! `roles.admin_group`; the person, uid and reason are audited (`approved`, `denied`)
//! through the daemon's audit inbox before the answer is written.

use super::{Output, StateArgs, control_state_dir, print_json, usage};
use crate::approvals::{self, Decision};
use crate::clock::rfc3339_ms;
use crate::state_dir::StateDir;

pub(super) fn list(s: &StateArgs) -> anyhow::Result<()> {
    let now = crate::clock::now_ms();
    let pending: Vec<_> = approvals::requests_checked(&control_state_dir(s)?)?
        .into_iter()
        .filter(|(r, d)| d.is_none() && r.expires_at_ms > now)
        .map(|(r, _)| r)
        .collect();
    if s.output == Output::Json {
        return print_json(&pending);
    }
    if pending.is_empty() {
        println!("no job is awaiting approval");
        return Ok(());
    }
    println!(
        "{:<24} {:<16} {:<20} {:<16} {:<12} {:<21} {:<21}",
        "JOB", "KIND", "OPERATION", "ROLE", "COMPONENT", "REQUESTED", "EXPIRES"
    );
    for r in pending {
        println!(
            "{:<24} {:<16} {:<20} {:<16} {:<12} {:<21} {:<21}",
            r.job_id,
            r.kind,
            r.operation,
            r.role.as_deref().unwrap_or("-"),
            r.component.as_deref().unwrap_or("-"),
            rfc3339_ms(r.requested_at_ms),
            rfc3339_ms(r.expires_at_ms)
        );
        if let Some(d) = &r.plan_digest {
            println!("    plan {d}: {}", plan_line(r.summary.as_ref()));
            if let Some(j) = &r.judged_digest {
                println!("    judged as JSON {j} (the runner's rendering of that plan)");
            }
            for f in &r.findings {
                println!("    because: {f}");
            }
        }
    }
    Ok(())
}

/// `create 3, replace 1 (aws_db_instance.main)`: what a plan summary says it does.
fn plan_line(summary: Option<&serde_json::Value>) -> String {
    let Some(s) = summary else { return "no summary".into() };
    let counts = s["counts"].as_object().cloned().unwrap_or_default();
    if counts.is_empty() {
        return "no changes".into();
    }
    counts
        .iter()
        .map(|(action, n)| {
            let addrs: Vec<&str> = s["addresses"][action]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
                .unwrap_or_default();
            let shown: Vec<&str> = addrs.iter().take(5).copied().collect();
            let more = addrs.len().saturating_sub(shown.len());
            format!(
                "{action} {n} ({}{})",
                shown.join(", "),
                if more > 0 { format!(", +{more} more") } else { String::new() }
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

pub(super) fn decide(
    s: &StateArgs,
    job_id: &str,
    approved: bool,
    reason: Option<String>,
    version: Option<String>,
) -> anyhow::Result<()> {
    // Before anything is written: the id names files.
    if !byoc_updater::plain_job_id(job_id) {
        usage!("{job_id:?} is not a job id");
    }
    if !approved && reason.as_ref().is_none_or(|r| r.trim().is_empty()) {
        usage!(
            "deny needs a --reason that is not empty (it is kept in the audit log and reported to the vendor)"
        );
    }
    let admin_group = super::state::admin_group(s)?;
    let who = crate::roles::pause::authorize(admin_group.as_deref()).map_err(|_| {
        anyhow::anyhow!(
            "approving and denying need root{}",
            admin_group
                .as_ref()
                .map(|g| format!(" or membership of group {g:?} (roles.admin_group)"))
                .unwrap_or_else(|| " (or set roles.admin_group to allow a group)".into())
        )
    })?;
    let dir = control_state_dir(s)?;
    let decision = Decision {
        approved,
        by: who.clone(),
        uid: nix::unistd::geteuid().as_raw(),
        reason: reason.clone(),
        at_ms: crate::clock::now_ms(),
        plan_digest: None,
    };
    // Checked before it is audited: an answer to nothing leaves no record claiming one.
    let pending = approvals::requests_checked(&dir)?.into_iter().find(|(r, _)| r.job_id == job_id);
    let Some((request, None)) = pending else {
        // decide() says why (unknown, already answered, bad id).
        approvals::decide(&dir, job_id, decision, crate::clock::now_ms())?;
        anyhow::bail!("job {job_id:?} cannot be answered");
    };
    anyhow::ensure!(
        request.expires_at_ms > decision.at_ms,
        "the approval request of job {job_id:?} expired; the job will be refused (approval_expired)"
    );
    // A plan approval binds to the plan the person was shown.
    let decision = Decision { plan_digest: request.plan_digest.clone(), ..decision };
    // An approved update is also left for the root updater, in its terms directory
    // (which the runner's user cannot write), with the version the person typed: the
    // request file is the runner's, so what it says the job installs is not taken.
    if approved && (request.kind == "runner.update" || version.is_some()) {
        let Some(version) = &version else {
            anyhow::bail!(
                "job {job_id} updates the runner: say which version you approve with --version \
                 (`byoc-runner approvals show {job_id}` shows the signed job's)"
            );
        };
        let note = crate::update::UpdateApproval {
            job_id: job_id.to_string(),
            version: version.clone(),
            by: who.clone(),
            uid: decision.uid,
            at_ms: decision.at_ms,
        };
        let terms = crate::update::terms_dir(&crate::update::own_updater_dir());
        if nix::unistd::geteuid().is_root() && !terms.is_dir() {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new().recursive(true).mode(0o755).create(&terms)?;
        }
        let path = crate::update::update_approval_path(&terms, job_id);
        crate::state_dir::write(&path, &serde_json::to_vec_pretty(&note).unwrap_or_default(), 0o644).map_err(
            |e| {
                anyhow::anyhow!(
                    "leaving the approval for the updater in {}: {e} (root makes that directory: re-run user-data)",
                    path.display()
                )
            },
        )?;
    }
    let event = if approved { "approved" } else { "denied" };
    let detail = format!(
        "by {who} (uid {}) under rule {:?}{}{}",
        decision.uid,
        request.rule,
        request.plan_digest.as_deref().map(|d| format!(", plan {d}")).unwrap_or_default(),
        reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
    );
    // The request says `entity.operation`; the record, as every record of the job,
    // the operation alone and the entity in its own field.
    let (entity, operation) = request.operation.split_once('.').unwrap_or(("", &request.operation));
    let record = byoc_audit::log::Record {
        entity: Some(entity.to_string()).filter(|e| !e.is_empty()),
        ..crate::audit_records::about_job(
            event,
            [job_id, &request.kind, operation],
            request.role.as_deref(),
            detail,
        )
    };
    // On record before it takes effect.
    super::state::submit_record(&dir, &record)?;
    approvals::decide(&dir, job_id, decision.clone(), decision.at_ms)?;
    if s.output == Output::Json {
        return print_json(
            &serde_json::json!({ "job_id": job_id, "decision": decision, "request": request }),
        );
    }
    if approved {
        println!("job {job_id} approved by {who}: it runs within a few seconds");
    } else {
        println!("job {job_id} denied by {who}: it will be refused (approval_denied) and never run");
    }
    Ok(())
}

#[derive(clap::Subcommand)]
pub(super) enum ApprovalsCmd {
    /// Everything a held job will do
    ///
    /// Its request (rule, plan summary with the plan's digest and that of the JSON
    /// judged, findings) and, from the signed job the runner keeps while it waits, the
    /// script, image, files or manifests it runs.
    ///
    /// Example: byoc-runner approvals show job-01J…
    Show {
        #[command(flatten)]
        state: StateArgs,
        /// The held job's id, in full (`byoc-runner approvals` lists them).
        job_id: String,
    },
}

/// Spec fields shown as they are: what a job runs, never a credential.
const SHOWN_FIELDS: &[&str] = &[
    "interpreter",
    "script",
    "image",
    "command",
    "args",
    "entrypoint",
    "mode",
    "module",
    "workspace",
    "action",
    "release",
    "namespace",
    "chart",
    "version",
    "providers",
    "source",
    "destination",
    "revision",
];

/// What a signed job will run, from its spec: the fields in [`SHOWN_FIELDS`] as they
/// are, the names of the files it brings and a `kind/name` per manifest; every other
/// field by name only (it may hold values the vendor sends for the job, secrets among
/// them).
pub(crate) fn what_it_runs(spec: &serde_json::Value) -> serde_json::Value {
    let Some(fields) = spec.as_object() else { return serde_json::json!({}) };
    let mut shown = serde_json::Map::new();
    let mut withheld = Vec::new();
    for (key, value) in fields {
        match key.as_str() {
            k if SHOWN_FIELDS.contains(&k) => {
                shown.insert(key.clone(), value.clone());
            }
            "files" => {
                let names: Vec<&String> = value.as_object().map(|m| m.keys().collect()).unwrap_or_default();
                shown.insert("files".into(), serde_json::json!(names));
            }
            "manifests" | "manifests_yaml" => {
                let mut names = manifest_names(value);
                if let Some(serde_json::Value::Array(before)) = shown.remove("manifests") {
                    names.splice(0..0, before.iter().filter_map(|v| v.as_str().map(str::to_string)));
                }
                shown.insert("manifests".into(), serde_json::json!(names));
            }
            _ => withheld.push(key.clone()),
        }
    }
    if !withheld.is_empty() {
        shown.insert("other_fields".into(), serde_json::json!(withheld));
    }
    serde_json::Value::Object(shown)
}

/// `Kind/namespace/name` of each manifest (a YAML stream or a list of documents).
fn manifest_names(manifests: &serde_json::Value) -> Vec<String> {
    let docs: Vec<serde_json::Value> = match manifests {
        serde_json::Value::String(text) => match byoc_job_executors::tool::parse_manifests(text) {
            Ok(docs) => docs,
            Err(e) => return vec![format!("(not valid YAML: {})", e.0)],
        },
        serde_json::Value::Array(items) => items.clone(),
        _ => vec![],
    };
    docs.iter()
        .filter(|d| !d.is_null())
        .map(|d| {
            format!(
                "{}/{}/{}",
                d["kind"].as_str().unwrap_or("?"),
                d["metadata"]["namespace"].as_str().unwrap_or("-"),
                d["metadata"]["name"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

pub(super) fn run(cmd: ApprovalsCmd) -> anyhow::Result<()> {
    match cmd {
        ApprovalsCmd::Show { state, job_id } => show(&state, &job_id),
    }
}

fn show(s: &StateArgs, job_id: &str) -> anyhow::Result<()> {
    let dir = control_state_dir(s)?;
    let (request, decision) =
        approvals::requests_checked(&dir)?.into_iter().find(|(r, _)| r.job_id == job_id).ok_or_else(
            || anyhow::anyhow!("no approval request for job {job_id:?} (`byoc-runner approvals` lists them)"),
        )?;
    // The held job's signed envelope: the runner's own file (0600). An admin who is not
    // root sees the request only.
    let runs = match crate::pipeline::held::kept_delivery(&dir, job_id) {
        Some(d) => {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(&d.envelope.payload)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).map_err(|e| e.to_string()))
                .map(|payload| what_it_runs(&payload["spec"]))
                .map_err(|e| format!("the kept job does not decode: {e}"))
        }
        None => Err(format!(
            "not readable here: the signed job is kept in {} for the runner's user and root",
            StateDir::of(&dir).held().display()
        )),
    };
    if s.output == Output::Json {
        return print_json(&serde_json::json!({
            "request": request,
            "decision": decision,
            "runs": runs.as_ref().ok(),
            "runs_unavailable": runs.as_ref().err(),
        }));
    }
    println!("job:        {}", request.job_id);
    println!("kind:       {} ({})", request.kind, request.operation);
    println!("role:       {}", request.role.as_deref().unwrap_or("-"));
    println!("component:  {}", request.component.as_deref().unwrap_or("-"));
    println!("rule:       {}", request.rule);
    println!("requested:  {}", rfc3339_ms(request.requested_at_ms));
    println!("expires:    {}", rfc3339_ms(request.expires_at_ms));
    match &decision {
        Some(d) => println!(
            "decided:    {} by {} at {}{}",
            if d.approved { "approved" } else { "denied" },
            d.by,
            rfc3339_ms(d.at_ms),
            d.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
        ),
        None => {
            println!("decided:    not yet (`byoc-runner approve {job_id}` or `deny {job_id} --reason …`)")
        }
    }
    if let Some(d) = &request.plan_digest {
        println!("plan:       {d}");
        if let Some(j) = &request.judged_digest {
            println!("judged:     JSON {j} (the runner's rendering of that plan)");
        }
        let summary = request.summary.clone().unwrap_or_default();
        let counts = summary["counts"].as_object().cloned().unwrap_or_default();
        if counts.is_empty() {
            println!("changes:    none");
        }
        for (action, n) in counts {
            println!("{:<12}{n}", format!("{action}:"));
            for a in summary["addresses"][&action].as_array().into_iter().flatten() {
                println!("              {}", a.as_str().unwrap_or("?"));
            }
        }
        for f in &request.findings {
            println!("because:    {f}");
        }
        for p in &request.passed {
            println!("passed:     {p}");
        }
    }
    match runs {
        Ok(v) => {
            println!("runs:");
            for (key, value) in v.as_object().into_iter().flatten() {
                match value {
                    serde_json::Value::String(text) if text.contains('\n') => {
                        println!("  {key}:");
                        for line in text.lines() {
                            println!("    | {line}");
                        }
                    }
                    serde_json::Value::String(text) => println!("  {key}: {text}"),
                    serde_json::Value::Array(items) => {
                        println!("  {key}:");
                        for i in items {
                            println!(
                                "    - {}",
                                i.as_str().map(str::to_string).unwrap_or_else(|| i.to_string())
                            );
                        }
                    }
                    other => println!("  {key}: {other}"),
                }
            }
        }
        Err(why) => println!("runs:       {why}"),
    }
    Ok(())
}

#[cfg(test)]
mod show_tests {
    #[test]
    fn what_a_job_runs_is_shown_and_its_values_are_not() {
        let spec = serde_json::json!({
            "script": "echo hi\nrm -rf /data",
            "interpreter": "/bin/sh",
            "secret_vars": {"db_password": "hunter2"},
            "files": {"main.tf": "resource …", "vars.tf": "…"},
            "manifests": [{"kind": "Service", "metadata": {"name": "api", "namespace": "acme"}}],
            "manifests_yaml": "kind: ConfigMap\nmetadata:\n  name: cfg\n---\nkind: Secret\nmetadata:\n  name: s\n",
        });
        let shown = super::what_it_runs(&spec);
        assert_eq!(shown["script"], "echo hi\nrm -rf /data");
        assert_eq!(shown["files"], serde_json::json!(["main.tf", "vars.tf"]));
        assert_eq!(
            shown["manifests"],
            serde_json::json!(["Service/acme/api", "ConfigMap/-/cfg", "Secret/-/s"])
        );
        assert_eq!(shown["other_fields"], serde_json::json!(["secret_vars"]));
        assert!(!shown.to_string().contains("hunter2"), "{shown}");
    }
}
