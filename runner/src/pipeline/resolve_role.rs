//! Stage 3: scope the job to a role the customer allows. The role the precedence chain
//! derived during `verify` (and checked against the control plane's proposal) is
//! looked up in the customer's switches, read afresh from the install stack (or the
//! local switches file). A disabled or missing role is refused here, before any call
//! to STS, with a reason code, an audit record and what the customer can do about it.

use std::time::Duration;

use byoc_protocol::RejectReason;

use super::{Backoff, Rejection, Rt, VerifiedJob};
use crate::roles::chain::Derived;
use crate::roles::model::AppRoles;

pub struct ScopedJob {
    pub verified: VerifiedJob,
    /// `None`: the job asked for no role and gets no AWS credentials.
    pub role: Option<ScopedRole>,
}

#[derive(Debug, Clone)]
pub struct ScopedRole {
    pub derived: Derived,
    pub arn: String,
    /// Where the switch said yes (`stack parameter EnableMaintenanceRole=true, …`).
    pub switch_source: String,
}

const SWITCH_READ_ATTEMPTS: u32 = 3;

pub async fn scope(rt: &Rt, verified: VerifiedJob) -> Result<ScopedJob, Box<(VerifiedJob, Rejection)>> {
    let Some(derived) = verified.role.clone() else {
        return Ok(ScopedJob { verified, role: None });
    };
    let refuse = |verified: VerifiedJob, reason, detail: String| {
        let p = &verified.payload;
        let rejection = Rejection {
            delivery_id: verified.delivery_id.clone(),
            reason,
            detail,
            job_id: Some(p.job_id.clone()),
            nonce: Some(p.nonce.clone()),
            expires_at: Some(p.expires_at),
        };
        Err(Box::new((verified, rejection)))
    };
    // Read afresh for every job: a switch flipped a minute ago counts.
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
    let mut attempt = 0;
    let snapshot = loop {
        attempt += 1;
        match rt.roles.source.read().await {
            Ok(s) => break s,
            Err(e) if attempt >= SWITCH_READ_ATTEMPTS => {
                return refuse(
                    verified,
                    RejectReason::RoleDisabled,
                    format!(
                        "role {:?}: the customer's switches could not be read, so the role is treated as off: {e}",
                        derived.role.name
                    ),
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, attempt, "reading the role switches failed; retrying");
                tokio::time::sleep(backoff.next_delay()).await;
            }
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
    let arn = switch.arn.clone().unwrap_or_default();
    Ok(ScopedJob { verified, role: Some(ScopedRole { derived, arn, switch_source: switch.source }) })
}
