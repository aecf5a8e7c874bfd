//! Stage 3, resolve_role: scope the job to a role the customer allows. The role the precedence chain
//! derived during `verify` (and checked against the control plane's proposal) is
//! looked up in the customer's switches, read afresh from the install stack (or the
//! local switches file). A disabled or missing role is refused here, before any call
//! to STS, with a reason code, an audit record and what the customer can do about it.

use std::time::Duration;

use byoc_protocol::RejectReason;

use super::{Rejection, VerifiedJob};
use crate::control_plane::retry::{Policy, Retried, retry};
use crate::roles::chain::Derived;
use crate::roles::model::AppRoles;
use crate::runtime::Rt;

pub struct ResolvedJob {
    pub verified: VerifiedJob,
    /// `None`: the job asked for no role and gets no AWS credentials.
    pub role: Option<ResolvedRole>,
}

#[derive(Debug, Clone)]
pub struct ResolvedRole {
    pub derived: Derived,
    pub arn: String,
    /// Where the switch said yes (`stack parameter EnableMaintenanceRole=true, …`).
    pub switch_source: String,
}

const SWITCH_READ_ATTEMPTS: u32 = 3;

pub async fn resolve(rt: &Rt, verified: VerifiedJob) -> Result<ResolvedJob, Box<(VerifiedJob, Rejection)>> {
    let Some(derived) = verified.role.clone() else {
        return Ok(ResolvedJob { verified, role: None });
    };
    let refuse = |verified: VerifiedJob, reason, detail: String| {
        let rejection = super::gate::rejection_of(&verified, reason, detail);
        Err(Box::new((verified, rejection)))
    };
    // Read afresh for every job: a switch flipped a minute ago counts.
    let policy =
        Policy::new(Duration::from_millis(200), Duration::from_secs(2)).attempts(SWITCH_READ_ATTEMPTS);
    let read = retry(policy, &rt.abort, |attempt| async move {
        rt.roles.source.read().await.inspect_err(|e| {
            tracing::warn!(error = %e, attempt, "Reading the role switches failed: {e}.");
        })
    })
    .await;
    let snapshot = match read {
        Retried::Done(s) => s,
        Retried::Exhausted(e) => {
            return refuse(
                verified,
                RejectReason::RoleDisabled,
                format!(
                    "role {:?}: the customer's switches could not be read, so the role is treated as off: {e}",
                    derived.role.name
                ),
            );
        }
        Retried::Stopped => {
            return refuse(
                verified,
                RejectReason::RoleDisabled,
                format!(
                    "role {:?}: the runner stopped while reading the customer's switches",
                    derived.role.name
                ),
            );
        }
    };
    if let Some(app) = &verified.payload.app_config
        && let Ok(roles) = AppRoles::parse(app, &rt.roles.install)
    {
        rt.roles.observe(&roles.roles, &snapshot);
    }
    let switch = snapshot.switch_for(&derived.role);
    let role = &derived.role;
    if !switch.enabled {
        let kind = if role.role_type == crate::roles::model::RoleType::BreakGlass {
            "break-glass role"
        } else {
            "role"
        };
        let how = switch.how_to_enable.clone().unwrap_or_default();
        let (reason, what) = if switch.missing {
            (RejectReason::RoleUnknown, "is not in the install")
        } else {
            (RejectReason::RoleDisabled, "is switched off")
        };
        return refuse(
            verified,
            reason,
            format!("{kind} {:?} {what} ({}); to allow it, {how}", role.name, switch.source),
        );
    }
    // The customer's second key, held on the VM: checked before any call to STS.
    if crate::roles::allowance::required(&rt.roles.require_local_allow, role)
        && let Some(why) =
            crate::roles::allowance::refusal(&rt.honoured_allowances(), &role.name, rt.clock.now_ms())
    {
        return refuse(
            verified,
            RejectReason::RoleDisabled,
            format!("role {:?} is switched on, but {why}", role.name),
        );
    }
    let arn = switch.arn.clone().unwrap_or_default();
    Ok(ResolvedJob { verified, role: Some(ResolvedRole { derived, arn, switch_source: switch.source }) })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::testing;

    #[tokio::test]
    async fn a_job_without_a_role_reads_no_switches() {
        let f = testing::runtime().await;
        let scoped = resolve(&f.rt, testing::verified("job-1", None)).await.ok().expect("scoped");
        assert!(scoped.role.is_none());
        assert_eq!(f.switches.reads.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn an_enabled_role_is_scoped_with_its_arn_and_where_the_switch_said_yes() {
        let f = testing::runtime().await;
        f.switches.set("maintenance", true);
        let scoped =
            resolve(&f.rt, testing::verified("job-1", Some("maintenance"))).await.ok().expect("scoped");
        let role = scoped.role.expect("role");
        assert_eq!(role.arn, "arn:aws:iam::123456789012:role/maintenance");
        assert!(!role.switch_source.is_empty());
        assert_eq!(f.sts.calls.load(Ordering::SeqCst), 0, "scoping never calls STS");
    }

    #[tokio::test]
    async fn a_switched_off_role_is_refused_before_any_call_to_sts() {
        let f = testing::runtime().await;
        f.switches.set("maintenance", false);
        let (_, r) =
            *resolve(&f.rt, testing::verified("job-1", Some("maintenance"))).await.err().expect("refused");
        assert_eq!(r.reason, RejectReason::RoleDisabled);
        assert!(r.detail.contains("switched off") && r.detail.contains("to allow it"), "{}", r.detail);
        assert_eq!(f.sts.calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_break_glass_role_needs_a_local_allowance_as_well_as_its_switch() {
        use crate::roles::allowance;
        let f = testing::runtime().await;
        f.switches.set("maintenance", true);
        let break_glass = || {
            let mut v = testing::verified("job-1", Some("maintenance"));
            if let Some(d) = v.role.as_mut() {
                d.role.role_type = crate::roles::model::RoleType::BreakGlass;
            }
            v
        };
        let (_, r) = *resolve(&f.rt, break_glass()).await.err().expect("refused");
        assert_eq!(r.reason, RejectReason::RoleDisabled);
        assert!(r.detail.contains("local allowance"), "{}", r.detail);
        let now = f.rt.clock.now_ms();
        let grant = |until_ms| allowance::Allowance {
            granted_ms: now,
            until_ms,
            by: "root".into(),
            reason: "t".into(),
        };
        allowance::grant(&f.rt.state_dir, "maintenance", grant(now + 60_000)).expect("grant");
        assert!(resolve(&f.rt, break_glass()).await.is_ok());
        allowance::grant(&f.rt.state_dir, "maintenance", grant(now)).expect("grant");
        let (_, r) = *resolve(&f.rt, break_glass()).await.err().expect("refused");
        assert!(r.detail.contains("expired"), "{}", r.detail);
        // A maintenance role needs none (require_local_allow defaults to break_glass).
        assert!(resolve(&f.rt, testing::verified("job-2", Some("maintenance"))).await.is_ok());
        assert_eq!(f.sts.calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_role_the_install_does_not_have_is_refused_as_unknown() {
        let f = testing::runtime().await;
        f.switches.set("provision", true);
        let (_, r) =
            *resolve(&f.rt, testing::verified("job-1", Some("maintenance"))).await.err().expect("refused");
        assert_eq!(r.reason, RejectReason::RoleUnknown);
    }

    #[tokio::test]
    async fn unreadable_switches_count_as_off_after_a_few_tries() {
        let f = testing::runtime().await;
        f.switches.unreadable.store(true, Ordering::SeqCst);
        let (_, r) =
            *resolve(&f.rt, testing::verified("job-1", Some("maintenance"))).await.err().expect("refused");
        assert_eq!(r.reason, RejectReason::RoleDisabled);
        assert!(r.detail.contains("could not be read"), "{}", r.detail);
        assert_eq!(f.switches.reads.load(Ordering::SeqCst), SWITCH_READ_ATTEMPTS as usize);
    }
}
