//! `approvals`, `approve JOB`, `deny JOB`: the customer's answer to jobs held by a
//! `[[guardrails.approval_rule]]` (docs/GUARDRAILS.md). Answering needs root or
//! `roles.admin_group`; the person, uid and reason are audited (`approved`, `denied`)
//! through the daemon's audit inbox before the answer is written.

use super::{Output, StateArgs, print_json, state_dir};
use crate::approvals::{self, Decision};
use crate::inspect::format_ms;

pub(super) fn list(s: &StateArgs) -> anyhow::Result<()> {
    let now = crate::clock::now_ms();
    let pending: Vec<_> = approvals::requests(&state_dir(s))
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
            format_ms(r.requested_at_ms),
            format_ms(r.expires_at_ms)
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
) -> anyhow::Result<()> {
    let admin_group = super::state::admin_group(s);
    let who = crate::roles::pause::authorize(admin_group.as_deref()).map_err(|_| {
        anyhow::anyhow!(
            "approving and denying need root{}",
            admin_group
                .as_ref()
                .map(|g| format!(" or membership of group {g:?} (roles.admin_group)"))
                .unwrap_or_else(|| " (or set roles.admin_group to allow a group)".into())
        )
    })?;
    let dir = state_dir(s);
    anyhow::ensure!(
        dir.is_dir(),
        "state dir {} does not exist (is the runner installed here?)",
        dir.display()
    );
    if !approved {
        anyhow::ensure!(reason.as_ref().is_some_and(|r| !r.trim().is_empty()), "deny needs --reason");
    }
    let decision = Decision {
        approved,
        by: who.clone(),
        uid: nix::unistd::geteuid().as_raw(),
        reason: reason.clone(),
        at_ms: crate::clock::now_ms(),
        plan_digest: None,
    };
    // Checked before it is audited: an answer to nothing leaves no record claiming one.
    let pending = approvals::requests(&dir).into_iter().find(|(r, _)| r.job_id == job_id);
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
    let event = if approved { "approved" } else { "denied" };
    let record = byoc_audit::log::Record {
        event: event.into(),
        job: Some(job_id.to_string()),
        kind: Some(request.kind.clone()),
        operation: Some(request.operation.clone()),
        role: request.role.clone(),
        detail: Some(format!(
            "by {who} (uid {}) under rule {:?}{}{}",
            decision.uid,
            request.rule,
            request.plan_digest.as_deref().map(|d| format!(", plan {d}")).unwrap_or_default(),
            reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
        )),
        ..Default::default()
    };
    // On record before it takes effect.
    crate::roles::inbox::submit(&dir, &record).map_err(|e| {
        anyhow::anyhow!(
            "recording for the audit log in {}: {e}",
            crate::roles::inbox::inbox_dir(&dir).display()
        )
    })?;
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
