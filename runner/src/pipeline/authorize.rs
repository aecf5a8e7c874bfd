//! Stage 4, authorize: the resolved role is audited (`role_resolved`, with the app
//! config's digest) and the policies that will judge this job are chosen and loaded:
//! the built-in pack at the customer's levels, the vendor's from the signed app config
//! for this job's type and component, the customer's own. The decision itself is made
//! by the executor against the exact plan, through the one policy gate
//! (`byoc_job_executors::policy_gate`); a job of a kind that policy does not decide
//! gets no scope. Policies that cannot be loaded leave no scope, so every decision
//! denies (fail closed), and say why in the job's log.

use super::VerifiedJob;
use super::resolve_role::{ResolvedJob, ResolvedRole};
use crate::runtime::Rt;

pub struct AuthorizedJob {
    pub verified: VerifiedJob,
    pub role: Option<ResolvedRole>,
    pub policy: PolicyChoice,
}

/// The policies for the job's decisions, or why there are none.
#[derive(Default)]
pub struct PolicyChoice {
    /// `None`: the job is not decided by policy, or its policies could not be loaded
    /// (then `note` says why and every decision denies).
    pub scope: Option<byoc_job_executors::JobPolicies>,
    /// A line for the job's log.
    pub note: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthorizeError {
    #[error("auditing the resolved role: {0}")]
    Audit(#[from] byoc_audit::log::AuditError),
}

pub fn authorize(rt: &Rt, job: ResolvedJob) -> Result<AuthorizedJob, AuthorizeError> {
    if let Some(role) = &job.role {
        rt.audit.record(role_resolved(&job.verified, role))?;
    }
    let decided = byoc_protocol::JobKind::parse(&job.verified.payload.kind)
        .is_some_and(byoc_protocol::JobKind::decided_by_policy);
    let policy = if decided { policy_scope(rt, &job) } else { PolicyChoice::default() };
    Ok(AuthorizedJob { verified: job.verified, role: job.role, policy })
}

fn role_resolved(job: &VerifiedJob, role: &ResolvedRole) -> byoc_audit::log::Record {
    let p = &job.payload;
    let detail = format!(
        "{} by {} {:?}; {}",
        role.arn,
        role.derived.step.as_str(),
        role.derived.reference,
        role.switch_source
    );
    let mut r = crate::audit_records::of_job("role_resolved", p, Some(&role.derived.role.name), detail);
    if let Some(app) = &p.app_config {
        r.digests.insert(
            "app_config_sha256".into(),
            byoc_protocol::sha256_hex(&serde_json::to_vec(app).unwrap_or_default()),
        );
    }
    r
}

/// The policies this job's decisions are made with: the built-in pack at the customer's
/// levels, the vendor's from the signed app config, the customer's own. No scope (and a
/// line for the job log) when the customer's directory has problems: decisions then deny.
fn policy_scope(rt: &Rt, job: &ResolvedJob) -> PolicyChoice {
    let p = &job.verified.payload;
    let customer = match crate::customer_policies::load(&rt.config.policy.dir) {
        Ok(c) => c,
        Err(problems) => {
            let line = format!(
                "[runner] the customer's policy directory {} has problems, so policy decisions deny: {}\n",
                rt.config.policy.dir.display(),
                problems.join("; ")
            );
            return PolicyChoice { scope: None, note: Some(line) };
        }
    };
    // The app config's blanket policies and the declarations for this job's type and
    // component (checked when the job was verified).
    let vendor = match &p.app_config {
        None => vec![],
        Some(app) => {
            let component = p.role_request.as_ref().map(|r| r.entity_name.as_str()).unwrap_or("");
            match crate::app_policies::for_job(app, &p.kind, &p.entity, component) {
                Ok(v) => v,
                Err(problems) => {
                    let line = format!(
                        "[runner] the app config's policies have problems, so policy decisions deny: {}\n",
                        problems.join("; ")
                    );
                    return PolicyChoice { scope: None, note: Some(line) };
                }
            }
        }
    };
    let decision = crate::customer_policies::Decision {
        phase: job
            .role
            .as_ref()
            .map(|r| r.derived.role.role_type.as_str().to_string())
            .unwrap_or_else(|| "none".into()),
        operation: format!("{}.{}", p.entity, p.operation),
        install: p.install_id.clone(),
        cluster_policies: p
            .app_config
            .as_ref()
            .and_then(|app| crate::app_policies::cluster_policies(app).ok())
            .unwrap_or_default()
            .iter()
            .map(|d| (d.policy().name, d.text.clone()))
            .collect(),
    };
    let limits = byoc_policy::Limits {
        time_per_policy: rt.config.policy.time_limit,
        max_input_bytes: rt.config.policy.max_input_bytes,
    };
    let scope = customer.scope(vendor, decision, limits, rt.config.policy.memory_mib);
    PolicyChoice { scope: Some(scope), note: None }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::pipeline::resolve_role::ResolvedJob;
    use crate::testing;

    async fn scoped(f: &testing::Fakes, kind: &str, role: Option<&str>) -> ResolvedJob {
        let mut verified = testing::verified("job-1", role);
        verified.payload.kind = kind.into();
        f.switches.set("maintenance", true);
        super::super::resolve_role::resolve(&f.rt, verified).await.ok().expect("scoped")
    }

    #[tokio::test]
    async fn the_resolved_role_is_audited_with_its_arn_and_how_it_was_chosen() {
        let f = testing::runtime().await;
        let job = authorize(&f.rt, scoped(&f, "action.script", Some("maintenance")).await).expect("audited");
        assert!(job.policy.scope.is_none(), "scripts are not decided by policy");
        let records = f.audit.records.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let r = records.iter().find(|r| r.event == "role_resolved").expect("role_resolved");
        assert_eq!(r.role.as_deref(), Some("maintenance"));
        assert!(
            r.detail.as_deref().is_some_and(|d| d.contains("arn:aws:iam::123456789012:role/maintenance"))
        );
    }

    #[tokio::test]
    async fn kinds_policy_decides_get_the_policies_loaded() {
        let f = testing::runtime().await;
        let job = authorize(&f.rt, scoped(&f, "terraform", None).await).expect("authorized");
        let scope = job.policy.scope.expect("a scope");
        assert!(!scope.policies.is_empty(), "the built-in pack at least");
        assert_eq!(scope.operation, "action.trigger");
    }

    #[tokio::test]
    async fn a_customer_policy_directory_with_problems_leaves_no_scope_so_decisions_deny() {
        let mut f = testing::runtime().await;
        let dir = f.dir.path().join("policies");
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("policies.toml"), "builtin = [not toml").expect("write");
        std::sync::Arc::get_mut(&mut f.rt).expect("sole owner").config.policy.dir = dir;
        let job = authorize(&f.rt, scoped(&f, "terraform", None).await).expect("authorized");
        assert!(job.policy.scope.is_none());
        assert!(job.policy.note.as_deref().is_some_and(|n| n.contains("policy decisions deny")));
    }

    #[tokio::test]
    async fn a_role_that_cannot_be_audited_stops_the_job() {
        let f = testing::runtime().await;
        let job = scoped(&f, "action.script", Some("maintenance")).await;
        f.audit.fail.store(true, Ordering::SeqCst);
        assert!(authorize(&f.rt, job).is_err());
    }
}
