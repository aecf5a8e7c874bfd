//! The precedence chain, highest first: runtime override → break-glass role (actions
//! only) → entity role → matrix rule → default role for the operation. Pure: the same
//! inputs always give the same role, so the runner can check the control plane's
//! proposal instead of taking its word for it.

use byoc_protocol::{JobPayload, RejectReason, RoleRequest};
use serde::Serialize;

use super::model::{AppRoles, RoleDef, RoleType, known_operation};
use super::template::InstallState;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    RuntimeOverride,
    BreakGlass,
    EntityRole,
    MatrixRule,
    Default,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Step::RuntimeOverride => "runtime_override",
            Step::BreakGlass => "break_glass",
            Step::EntityRole => "entity_role",
            Step::MatrixRule => "matrix_rule",
            Step::Default => "default",
        }
    }
}

/// The role the chain yields for a job, and which step decided it.
#[derive(Debug, Clone, PartialEq)]
pub struct Derived {
    pub role: RoleDef,
    pub step: Step,
    /// The reference as written at that step (`maintenance`, `{{.install.id}}-x`).
    pub reference: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChainError {
    pub reason: RejectReason,
    pub detail: String,
}

fn err(reason: RejectReason, detail: String) -> ChainError {
    ChainError { reason, detail }
}

pub fn derive(
    app: &AppRoles,
    install: &InstallState,
    entity: &str,
    operation: &str,
    req: &RoleRequest,
) -> Result<Derived, ChainError> {
    if !known_operation(entity, operation) {
        return Err(err(
            RejectReason::InvalidSpec,
            format!("{entity}.{operation} is not an operation that takes a role (see docs/ROLES.md)"),
        ));
    }
    if req.break_glass_role.is_some() && entity != "action" {
        return Err(err(
            RejectReason::InvalidSpec,
            format!("a break_glass_role is only valid for actions, not {entity}.{operation}"),
        ));
    }
    let lookup = |reference: &str, step: Step| -> Result<Derived, ChainError> {
        let role = app.lookup(reference, install).map_err(|e| {
            err(RejectReason::RoleUnknown, format!("{} {reference:?}: {e}", step.as_str().replace('_', " ")))
        })?;
        let break_glass = role.role_type == RoleType::BreakGlass;
        match step {
            Step::BreakGlass if !break_glass => Err(err(
                RejectReason::InvalidSpec,
                format!("break_glass_role {reference:?} is not defined in break_glass.toml"),
            )),
            Step::EntityRole | Step::MatrixRule | Step::Default if break_glass => Err(err(
                RejectReason::InvalidSpec,
                format!(
                    "{} {reference:?} is a break-glass role; only an action's break_glass_role or a runtime override may name one",
                    step.as_str().replace('_', " ")
                ),
            )),
            _ => Ok(Derived { role: role.clone(), step, reference: reference.to_string() }),
        }
    };
    if let Some(r) = &req.runtime_override {
        return lookup(r, Step::RuntimeOverride);
    }
    if let Some(r) = &req.break_glass_role {
        return lookup(r, Step::BreakGlass);
    }
    if let Some(r) = &req.entity_role {
        return lookup(r, Step::EntityRole);
    }
    if let Some(rule) = app.rules.iter().find(|r| r.matches(entity, &req.entity_name, operation)) {
        return lookup(&rule.role, Step::MatrixRule);
    }
    let key = format!("{entity}.{operation}");
    match app.defaults.get(&key) {
        Some(r) => lookup(r, Step::Default),
        None => Err(err(RejectReason::RoleUnknown, format!("no default role for {key}"))),
    }
}

/// The role the chain gives `payload` (its entity, operation and role request), for a
/// job the runner proposes itself (its own drift checks): `None` when the payload asks
/// for no role.
pub fn own_proposal(payload: &JobPayload, install: &InstallState) -> Result<Option<String>, ChainError> {
    if payload.requested_role.is_none() {
        return Ok(None);
    }
    let Some(app_config) = &payload.app_config else {
        return Err(err(RejectReason::RoleUnknown, "a role is needed but no app config says which".into()));
    };
    let app =
        AppRoles::parse(app_config, install).map_err(|e| err(RejectReason::InvalidSpec, e.to_string()))?;
    let req = payload.role_request.clone().unwrap_or_default();
    Ok(Some(derive(&app, install, &payload.entity, &payload.operation, &req)?.role.name))
}

/// What a job's payload says about roles, checked: `None` when the job asked for no
/// role (it gets no AWS credentials at all).
pub fn derive_for_job(payload: &JobPayload, install: &InstallState) -> Result<Option<Derived>, ChainError> {
    let Some(requested) = &payload.requested_role else {
        return Ok(None);
    };
    let Some(app_config) = &payload.app_config else {
        return Err(err(
            RejectReason::RoleUnknown,
            format!("the job asks for role {requested:?} but carries no app config to derive a role from"),
        ));
    };
    let app =
        AppRoles::parse(app_config, install).map_err(|e| err(RejectReason::InvalidSpec, e.to_string()))?;
    let req = payload.role_request.clone().unwrap_or_default();
    let derived = derive(&app, install, &payload.entity, &payload.operation, &req)?;
    let requested_name = install.render(requested).unwrap_or_else(|_| requested.clone());
    if requested_name != derived.role.name {
        return Err(err(
            RejectReason::RoleMismatch,
            format!(
                "control plane proposed role {requested_name:?}, but the precedence chain yields {:?} (by {} {:?}) for {}.{}",
                derived.role.name,
                derived.step.as_str(),
                derived.reference,
                payload.entity,
                payload.operation
            ),
        ));
    }
    Ok(Some(derived))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roles::model::tests::{app, install};

    fn roles() -> AppRoles {
        AppRoles::parse(&app(), &install()).unwrap()
    }

    fn chain(entity: &str, operation: &str, req: RoleRequest) -> Result<(String, Step), ChainError> {
        derive(&roles(), &install(), entity, operation, &req).map(|d| (d.role.name, d.step))
    }

    fn named(name: &str) -> RoleRequest {
        RoleRequest { entity_name: name.into(), ..Default::default() }
    }

    #[test]
    fn the_runner_proposes_the_role_of_the_operation_it_runs_not_the_deploys() {
        // The cluster's deploys run under its own role; a drift check of it under the
        // default for component.drift.
        let mut p = crate::testing::payload("local-drift-terraform-cluster-1");
        (p.entity, p.operation) = ("component".into(), "drift".into());
        p.requested_role = Some("{{.install.id}}-eks-upgrade-role".into());
        p.app_config = Some(app());
        p.role_request = Some(named("cluster"));
        assert_eq!(derive_for_job(&p, &install()).unwrap_err().reason, RejectReason::RoleMismatch);
        let proposed = own_proposal(&p, &install()).unwrap();
        assert_eq!(proposed.as_deref(), Some("inst-1-maintenance"));
        p.requested_role = proposed;
        assert_eq!(derive_for_job(&p, &install()).unwrap().unwrap().role.name, "inst-1-maintenance");
        // No role asked for: none proposed.
        p.requested_role = None;
        assert_eq!(own_proposal(&p, &install()).unwrap(), None);
    }

    #[test]
    fn each_step_wins_over_the_ones_below_it() {
        // Default for the operation (built in, and from the app's [defaults]).
        assert_eq!(
            chain("component", "deploy", named("api")).unwrap(),
            ("inst-1-maintenance".into(), Step::Default)
        );
        assert_eq!(
            chain("sandbox", "provision", named("")).unwrap(),
            ("inst-1-provision".into(), Step::Default)
        );
        assert_eq!(
            chain("sandbox", "reprovision", named("")).unwrap(),
            ("inst-1-provision".into(), Step::Default)
        );
        assert_eq!(
            chain("sandbox", "deprovision", named("")).unwrap(),
            ("inst-1-deprovision".into(), Step::Default)
        );
        assert_eq!(
            chain("component", "teardown", named("api")).unwrap(),
            ("inst-1-deprovision".into(), Step::Default)
        );
        // Matrix rule beats the default.
        assert_eq!(
            chain("component", "deploy", named("cluster")).unwrap(),
            ("inst-1-eks-upgrade-role".into(), Step::MatrixRule)
        );
        assert_eq!(
            chain("action", "trigger", named("x")).unwrap(),
            ("inst-1-maintenance".into(), Step::MatrixRule)
        );
        // Entity role beats the matrix.
        let entity = RoleRequest { entity_role: Some("deprovision".into()), ..named("cluster") };
        assert_eq!(
            chain("component", "deploy", entity.clone()).unwrap(),
            ("inst-1-deprovision".into(), Step::EntityRole)
        );
        // Break-glass beats the entity role (actions only).
        let bg = RoleRequest {
            break_glass_role: Some("{{.nuon.install.id}}-s3-object-break-glass".into()),
            entity_role: Some("maintenance".into()),
            ..named("empty_bucket")
        };
        assert_eq!(
            chain("action", "trigger", bg.clone()).unwrap(),
            ("inst-1-s3-object-break-glass".into(), Step::BreakGlass)
        );
        // Runtime override beats everything.
        let over = RoleRequest { runtime_override: Some("{{.install.id}}-eks-upgrade-role".into()), ..bg };
        assert_eq!(
            chain("action", "trigger", over).unwrap(),
            ("inst-1-eks-upgrade-role".into(), Step::RuntimeOverride)
        );
    }

    #[test]
    fn refusals_carry_reasons() {
        let r = chain("component", "explode", named("x")).unwrap_err();
        assert_eq!(r.reason, RejectReason::InvalidSpec);
        let bg_on_component = RoleRequest {
            break_glass_role: Some("{{.install.id}}-s3-object-break-glass".into()),
            ..named("api")
        };
        assert_eq!(
            chain("component", "deploy", bg_on_component).unwrap_err().reason,
            RejectReason::InvalidSpec
        );
        let not_bg = RoleRequest { break_glass_role: Some("maintenance".into()), ..named("a") };
        assert_eq!(chain("action", "trigger", not_bg).unwrap_err().reason, RejectReason::InvalidSpec);
        let bg_as_entity =
            RoleRequest { entity_role: Some("inst-1-s3-object-break-glass".into()), ..named("a") };
        assert_eq!(chain("action", "trigger", bg_as_entity).unwrap_err().reason, RejectReason::InvalidSpec);
        let unknown = RoleRequest { entity_role: Some("ghost".into()), ..named("a") };
        let e = chain("action", "trigger", unknown).unwrap_err();
        assert_eq!(e.reason, RejectReason::RoleUnknown);
        assert!(e.detail.contains("ghost"), "{}", e.detail);
        let bad_template = RoleRequest { entity_role: Some("{{.install.nope}}-x".into()), ..named("a") };
        assert_eq!(chain("action", "trigger", bad_template).unwrap_err().reason, RejectReason::RoleUnknown);
        // An app without a deprovision role cannot run a sandbox deprovision.
        let mut small = app();
        small.permissions.remove("deprovision.toml");
        small.operation_roles = None;
        let a = AppRoles::parse(&small, &install()).unwrap();
        let e = derive(&a, &install(), "sandbox", "deprovision", &named("")).unwrap_err();
        assert_eq!(e.reason, RejectReason::RoleUnknown);
        assert!(e.detail.contains("no deprovision role"), "{}", e.detail);
    }

    fn payload(requested: Option<&str>) -> JobPayload {
        JobPayload {
            job_id: "job-1".into(),
            runner_id: "r".into(),
            install_id: "inst-1".into(),
            issued_at: 0,
            expires_at: 1,
            nonce: "n".into(),
            attempt: 1,
            kind: "action.script".into(),
            operation: "deploy".into(),
            entity: "component".into(),
            requested_role: requested.map(str::to_string),
            timeout_secs: 60,
            spec: serde_json::Value::Null,
            app_config: Some(app()),
            role_request: Some(named("api")),
        }
    }

    #[test]
    fn the_proposed_role_must_be_what_the_chain_yields() {
        let ok = derive_for_job(&payload(Some("inst-1-maintenance")), &install()).unwrap().unwrap();
        assert_eq!(ok.role.name, "inst-1-maintenance");
        // A template the runner resolves the same way is the same role.
        assert!(derive_for_job(&payload(Some("{{.install.id}}-maintenance")), &install()).is_ok());
        let e = derive_for_job(&payload(Some("inst-1-provision")), &install()).unwrap_err();
        assert_eq!(e.reason, RejectReason::RoleMismatch);
        assert!(e.detail.contains("\"inst-1-maintenance\"") && e.detail.contains("default"), "{}", e.detail);
        assert_eq!(derive_for_job(&payload(None), &install()).unwrap(), None);
        let bare = JobPayload { app_config: None, ..payload(Some("inst-1-maintenance")) };
        assert_eq!(derive_for_job(&bare, &install()).unwrap_err().reason, RejectReason::RoleUnknown);
        let mut broken = payload(Some("inst-1-maintenance"));
        broken.app_config.as_mut().unwrap().break_glass = Some("[[role]]\nnope = 1\n".into());
        assert_eq!(derive_for_job(&broken, &install()).unwrap_err().reason, RejectReason::InvalidSpec);
    }
}
