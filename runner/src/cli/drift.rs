//! `drift`: the last drift check of each component, what the runner can check on its
//! own, and `drift run` to ask the daemon for a check now (docs/DRIFT.md).

use super::{Output, StateArgs, print_json, state_dir};
use crate::drift::local;

#[derive(clap::Subcommand)]
pub(super) enum DriftAction {
    /// Ask for a drift check of NAME now (audited)
    ///
    /// NAME is a terraform workspace or kubernetes component a deploy without secrets
    /// left here (`drift targets` lists them). The check starts before the daemon's
    /// next poll and runs like any job: the pause, the role's switch, windows and
    /// policies apply. Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner drift run network --kind terraform
    Run {
        #[command(flatten)]
        state: StateArgs,
        /// The workspace, component or release (`drift targets` lists them).
        name: String,
        /// `terraform`, `kubernetes` or `helm`, when two kinds have the name.
        #[arg(long)]
        kind: Option<String>,
    },
    /// What the runner can check on its own
    ///
    /// Each component a deploy without secrets left, and which deploy.
    ///
    /// Example: byoc-runner drift targets -o json
    Targets(StateArgs),
}

pub(super) fn run(s: &StateArgs, action: Option<DriftAction>) -> anyhow::Result<()> {
    match action {
        None => list(s),
        Some(DriftAction::Targets(s)) => targets(&s),
        Some(DriftAction::Run { state, name, kind }) => request(&state, &name, kind),
    }
}

fn targets(s: &StateArgs) -> anyhow::Result<()> {
    let all = local::targets(&state_dir(s)?);
    if s.output == Output::Json {
        let v: Vec<serde_json::Value> = all
            .iter()
            .map(|t| serde_json::json!({"kind": t.kind, "name": t.name, "from_job": t.from_job, "recorded_at_ms": t.recorded_at_ms}))
            .collect();
        return print_json(&v);
    }
    if all.is_empty() {
        println!(
            "nothing to check yet: a terraform apply or kubernetes apply without secrets leaves its component here"
        );
        return Ok(());
    }
    println!("{:<20} {:<11} {:<21} FROM DEPLOY", "NAME", "KIND", "RECORDED");
    for t in &all {
        println!(
            "{:<20} {:<11} {:<21} {}",
            t.name,
            t.kind,
            crate::clock::rfc3339_ms(t.recorded_at_ms),
            t.from_job
        );
    }
    Ok(())
}

fn request(s: &StateArgs, name: &str, kind: Option<String>) -> anyhow::Result<()> {
    let who = crate::roles::pause::authorize(super::state::admin_group(s)?.as_deref())?;
    if let Some(k) = kind.as_deref()
        && !crate::config::DRIFT_KINDS.contains(&k)
    {
        super::usage!("--kind {k:?}: one of {}", crate::config::DRIFT_KINDS.join(", "));
    }
    let dir = super::control_state_dir(s)?;
    // Refused here, not later in the daemon's log: a name with nothing to check.
    let target = local::find(&dir, name, kind.as_deref())?;
    let record =
        crate::audit_records::note("drift_requested", format!("{} {} by {who}", target.kind, target.name));
    super::state::submit_record(&dir, &record)?;
    let r = local::Request {
        name: target.name.clone(),
        kind: Some(target.kind.clone()),
        by: who,
        at_ms: crate::clock::now_ms(),
    };
    local::request(&dir, &r).map_err(|e| anyhow::anyhow!("asking the daemon: {e}"))?;
    if s.output == Output::Json {
        return print_json(&serde_json::json!({"requested": true, "kind": target.kind, "name": target.name}));
    }
    println!(
        "asked for a drift check of {} {}: the daemon starts it before its next poll; `byoc-runner jobs list` shows it, `byoc-runner drift` its result",
        target.kind, target.name
    );
    Ok(())
}

fn list(s: &StateArgs) -> anyhow::Result<()> {
    let all = crate::drift::list(&state_dir(s)?);
    if s.output == Output::Json {
        return print_json(&all);
    }
    if all.is_empty() {
        println!(
            "no drift check has run (terraform jobs with mode = \"drift\", kubernetes jobs with action = \"drift\"; docs/DRIFT.md)"
        );
        return Ok(());
    }
    println!(
        "{:<20} {:<11} {:<10} {:<21} {:<24} {:>8} {:>12}",
        "WORKSPACE", "KIND", "VERDICT", "CHECKED", "JOB", "DRIFTED", "WOULD CHANGE"
    );
    for r in &all {
        let would: u64 = r.would_change["counts"]
            .as_object()
            .map(|c| c.values().filter_map(|v| v.as_u64()).sum())
            .unwrap_or(0);
        println!(
            "{:<20} {:<11} {:<10} {:<21} {:<24} {:>8} {:>12}",
            r.workspace,
            r.kind,
            r.verdict,
            crate::clock::rfc3339_ms(r.checked_at_ms),
            r.job_id,
            r.drifted.as_array().map_or(0, Vec::len),
            would
        );
        for d in r.drifted.as_array().into_iter().flatten() {
            let paths: Vec<&str> =
                d["paths"].as_array().into_iter().flatten().filter_map(|p| p.as_str()).collect();
            println!("    drifted {}: {}", d["address"].as_str().unwrap_or("?"), paths.join(", "));
        }
        for v in r.violations.as_array().into_iter().flatten() {
            println!(
                "    violates {} [{}] {}",
                v["policy"].as_str().unwrap_or("?"),
                v["rule"].as_str().unwrap_or("?"),
                v["address"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}
