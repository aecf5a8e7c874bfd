//! The customer's maintenance windows (`crate::guardrails`) as they bear on a job: a
//! job no rule names goes straight on; outside its windows a job whose rule says
//! `refuse` is refused before its claim (`outside_window`), and one whose rule says
//! `wait` is held by the gate (`gate.rs`). Also what a job's policies read of them
//! (`policy_context`).

use byoc_protocol::RejectReason;

use super::{Rejection, VerifiedJob};
use crate::clock::rfc3339;
use crate::guardrails::{JobAttributes, OnClose, Outside, WindowCheck};
use crate::runtime::Rt;

/// When the window the job runs in closes, if its rule cancels the job then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowClose {
    pub window: String,
    /// Unix seconds.
    pub at: i64,
}

/// The facts about a job the guardrails' rules match it by, owned (`scope()` lends
/// them as a `guardrails::JobAttributes`).
pub struct JobFacts {
    pub role: Option<String>,
    pub role_type: Option<String>,
    /// `entity.operation`.
    pub operation: String,
    pub component: Option<String>,
    pub kind: String,
    /// What the job does, derived by the runner (`Executor::effect`).
    pub effect: byoc_protocol::Effect,
}

impl JobFacts {
    pub fn of(job: &VerifiedJob) -> JobFacts {
        let p = &job.payload;
        JobFacts {
            role: job.role.as_ref().map(|d| d.role.name.clone()),
            role_type: job.role.as_ref().map(|d| d.role.role_type.as_str().to_string()),
            operation: format!("{}.{}", p.entity, p.operation),
            component: p.role_request.as_ref().map(|r| r.entity_name.clone()).filter(|n| !n.is_empty()),
            kind: p.kind.clone(),
            effect: job.executor.effect(),
        }
    }

    pub fn attributes(&self) -> JobAttributes<'_> {
        JobAttributes {
            role: self.role.as_deref(),
            role_type: self.role_type.as_deref(),
            operation: &self.operation,
            component: self.component.as_deref(),
            kind: &self.kind,
            effect: self.effect.as_str(),
        }
    }
}

/// The verdict of the customer's windows on `job` now.
pub fn check(rt: &Rt, job: &VerifiedJob) -> WindowCheck {
    if rt.config.guardrails.is_empty() {
        return WindowCheck::Unbound;
    }
    rt.config.guardrails.check(&JobFacts::of(job).attributes(), rt.clock.unix_now())
}

/// The refusal of a job outside a window whose rule refuses.
pub fn outside_window(job: &VerifiedJob, check: &WindowCheck) -> Option<Rejection> {
    let WindowCheck::Closed { rule, outside: Outside::Refuse, next } = check else { return None };
    let p = &job.payload;
    Some(Rejection {
        delivery_id: job.delivery_id.clone(),
        reason: RejectReason::OutsideWindow,
        detail: format!("outside the maintenance windows of rule {rule:?}; {}", next_opening(next)),
        job_id: Some(p.job_id.clone()),
        nonce: Some(p.nonce.clone()),
        expires_at: Some(p.expires_at),
    })
}

pub(super) fn next_opening(next: &Option<(String, i64)>) -> String {
    match next {
        Some((w, t)) => format!("window {w:?} opens next at {}", rfc3339(*t)),
        None => "no window of the rule opens again (add one in [[guardrails.window]])".into(),
    }
}

/// `input.byoc.context` for the job's policy decisions: when it was admitted, the
/// window it runs in (the one its rule opened, else any of the customer's windows
/// open then, else null), every window open then, and its role.
pub fn policy_context(
    rt: &Rt,
    job: &VerifiedJob,
    check: &WindowCheck,
    approvals: &[serde_json::Value],
) -> serde_json::Value {
    let now = rt.clock.unix_now();
    let g = &rt.config.guardrails;
    let open: Vec<(&str, i64)> = g.open_windows(now);
    let window = match check {
        WindowCheck::Open { rule, window, closes_at, .. } => serde_json::json!({
            "name": window, "rule": rule, "closes_at": rfc3339(*closes_at), "closes_at_unix": closes_at,
        }),
        _ => match open.first() {
            Some((name, closes_at)) => serde_json::json!({
                "name": name, "rule": null, "closes_at": rfc3339(*closes_at), "closes_at_unix": closes_at,
            }),
            None => serde_json::Value::Null,
        },
    };
    let role = job.role.as_ref().map_or(
        serde_json::Value::Null,
        |d| serde_json::json!({"name": d.role.name, "type": d.role.role_type.as_str()}),
    );
    serde_json::json!({
        "now": rfc3339(now),
        "now_unix": now,
        "window": window,
        "windows_open": open.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        "role": role,
        "approvals": approvals,
        // Facts the runner derived, beside the labels the vendor chose.
        "effect": job.executor.effect().as_str(),
        "kind": job.payload.kind,
    })
}

/// What to cancel the job at, for a rule with `on_close = "cancel"`.
pub fn close_of(check: &WindowCheck) -> Option<WindowClose> {
    match check {
        WindowCheck::Open { window, closes_at, on_close: OnClose::Cancel, .. } => {
            Some(WindowClose { window: window.clone(), at: *closes_at })
        }
        _ => None,
    }
}
