//! Stage 6, assume_role: for a job with a role, AssumeRole through STS (audited
//! `role_assumed` / `role_assume_failed`), then what carries the session into the
//! sandbox: the credential endpoint inside the job's own network namespace, renewed
//! before expiry, or for a container a renewed credentials file read by its
//! `credential_process`. A failed assumption is `NotAssumed`: `execute::not_run`
//! journals the job started and failed, with the reason in its log, without running it.

use std::sync::Arc;

use byoc_job_executors::mask::SecretFeed;
use byoc_job_executors::{ContainerCredentials, JobCredentials};

use super::gate::ClearedJob;
use super::resolve_role::ResolvedRole;
use crate::clock::rfc3339;
use crate::roles::creds::{
    CONTAINER_BUSYBOX, CONTAINER_CREDENTIALS_DIR, CredentialFile, JobEndpoint, JobSession,
};
use crate::roles::sts::{SessionParams, session_duration, sts_identifier, tag_value};
use crate::runtime::Rt;

pub struct AssumedJob {
    pub cleared: ClearedJob,
    pub session: Session,
}

/// The job's AWS session, if it asked for a role.
#[derive(Default)]
pub struct Session {
    /// What reaches the sandbox; `None` for a job without a role.
    pub credentials: Option<JobCredentials>,
    /// Kept alive while the executor runs; dropping it stops a container's renewal.
    pub keep_alive: Option<RoleSession>,
    /// Lines for the head of the job's log.
    pub log_note: Option<String>,
}

/// The job asked for a role and did not get it: it must not run.
pub struct NotAssumed {
    pub cleared: ClearedJob,
    /// Why, for the head of the job's log.
    pub log_note: String,
    /// The job's error.
    pub error: String,
}

pub async fn assume(rt: &Rt, cleared: ClearedJob) -> Result<AssumedJob, Box<NotAssumed>> {
    let Some(role) = &cleared.role else {
        return Ok(AssumedJob { cleared, session: Session::default() });
    };
    match assume_for_job(rt, &cleared.verified.payload, role).await {
        Ok((keep_alive, credentials, note)) => Ok(AssumedJob {
            session: Session {
                credentials: Some(credentials),
                keep_alive: Some(keep_alive),
                log_note: Some(note),
            },
            cleared,
        }),
        Err(e) => {
            let error = format!(
                "could not assume role {:?}; the job did not run (see the job log)",
                role.derived.role.name
            );
            Err(Box::new(NotAssumed { log_note: format!("[runner] {e}\n"), error, cleared }))
        }
    }
}

/// AssumeRole for the job (audited), then its credential endpoint registration and
/// the environment that reaches the sandbox. Returns a line for the job log.
async fn assume_for_job(
    rt: &Rt,
    p: &byoc_protocol::JobPayload,
    role: &ResolvedRole,
) -> Result<(RoleSession, JobCredentials, String), String> {
    let roles = &rt.roles;
    let name = &role.derived.role.name;
    let Some(assumer) = &roles.assumer else {
        return Err(format!("role {name:?} cannot be assumed: aws.region is not configured on this runner"));
    };
    let (params, allowance_end) = session_params(rt, p, role);
    let audit = |event: &str, detail: String| {
        let r = crate::audit_records::of_job(event, p, Some(name), detail);
        rt.audit.record(r).map_err(|e| format!("auditing {event}: {e}"))
    };
    // A terraform job's processes get a read-only session until its plan is allowed.
    let narrowed = match narrowed_params(rt, p, role, &params) {
        Ok(n) => n,
        Err(why) => {
            let msg = format!("the read-only session for planning cannot be made: {why}");
            audit("role_assume_failed", msg.chars().take(300).collect())?;
            return Err(msg);
        }
    };
    let first_params = narrowed.as_ref().map_or(&params, |(n, _)| n);
    let first = match assumer.assume(first_params).await {
        Ok(c) => c,
        Err(e) => {
            let msg = format!("AssumeRole {} failed: {}", role.arn, e.message);
            audit("role_assume_failed", msg.chars().take(300).collect())?;
            return Err(msg);
        }
    };
    let expires = rfc3339(first.expiration);
    let scope_note = narrowed
        .as_ref()
        .map(|(_, summary)| format!(", read-only until its plan is allowed ({summary})"))
        .unwrap_or_default();
    audit(
        "role_assumed",
        format!(
            "{} session {} for {}s, expires {expires}{scope_note}",
            role.arn, params.session_name, params.duration_secs
        ),
    )?;
    roles.assumed(name, &p.job_id);
    let mut static_env = vec![
        ("AWS_ACCESS_KEY_ID".to_string(), first.access_key_id.clone()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), first.secret_access_key.clone()),
        ("AWS_SESSION_TOKEN".to_string(), first.session_token.clone()),
    ];
    let feed = SecretFeed::default();
    let on_refresh = audit_refreshes(rt, &p.job_id, name);
    let mut session = JobSession::new(
        params.clone(),
        assumer.clone(),
        first,
        roles.refresh_before,
        feed.clone(),
        on_refresh,
    );
    if let Some(end) = allowance_end {
        session = session.renew_until(end);
    }
    let mut full_session = None;
    if let Some((narrowed, _)) = narrowed {
        let full = byoc_job_executors::FullSession::default();
        session = session.narrowed_until(narrowed, full.clone());
        full_session = Some(full);
    }
    let common = role_env(roles, name, &role.arn);
    static_env.extend(common.iter().cloned());
    let intro = format!(
        "[runner] assumed role {name} ({}) chosen by {}; session {} expires {expires}{scope_note}",
        role.arn,
        role.derived.step.as_str(),
        params.session_name
    );
    tracing::info!(role = %name, role_arn = %role.arn, "Assumed the job's role.");

    // Containers cannot reach the loopback endpoint: a renewed credentials file instead.
    if p.kind == "action.container" {
        return Ok(container_credentials(roles, &p.job_id, session, static_env, common, feed, &intro));
    }
    Ok(endpoint_credentials(session, static_env, common, feed, full_session, &intro))
}

/// Each renewal of the job's session, audited (`role_session_refreshed`).
fn audit_refreshes(rt: &Rt, job_id: &str, role_name: &str) -> crate::roles::creds::OnAssume {
    let rt = rt.clone();
    let (job_id, role_name) = (job_id.to_string(), role_name.to_string());
    Arc::new(move |params: &SessionParams, c: &crate::roles::sts::Credentials| {
        let detail =
            format!("{} session {} expires {}", params.role_arn, params.session_name, rfc3339(c.expiration));
        let r = byoc_audit::log::Record {
            job: Some(job_id.clone()),
            role: Some(role_name.clone()),
            ..crate::audit_records::note("role_session_refreshed", detail)
        };
        rt.audit_or_log(r, "a role session refresh");
    })
}

/// A process job's credentials: the endpoint in its own network namespace, renewed by
/// the runner.
fn endpoint_credentials(
    session: JobSession,
    static_env: Vec<(String, String)>,
    common: Vec<(String, String)>,
    feed: SecretFeed,
    full_session: Option<byoc_job_executors::FullSession>,
    intro: &str,
) -> (RoleSession, JobCredentials, String) {
    let endpoint = JobEndpoint::new(session);
    let mut endpoint_env = endpoint.env();
    endpoint_env.extend(common);
    let note = format!(
        "{intro}, renewed before expiry through the credential endpoint in the job's own network namespace\n"
    );
    let endpoint: Arc<dyn byoc_job_executors::jobnet::CredentialEndpoint> = endpoint;
    let creds = JobCredentials {
        endpoint_env,
        endpoint: Some(endpoint),
        static_env,
        container: None,
        feed,
        full_session,
    };
    (RoleSession { _file: None }, creds, note)
}

/// The job's session: named and tagged after the job, as long as its timeout (and no
/// longer than a local allowance it runs under, whose end is returned too).
fn session_params(
    rt: &Rt,
    p: &byoc_protocol::JobPayload,
    role: &ResolvedRole,
) -> (SessionParams, Option<i64>) {
    let roles = &rt.roles;
    let name = &role.derived.role.name;
    // A role under a local allowance: its session lasts no longer than the allowance
    // (STS's 15-minute minimum aside) and is not renewed past it.
    let now_secs = (rt.clock.now_ms() / 1000) as i64;
    let allowance_end = crate::roles::allowance::required(&roles.require_local_allow, &role.derived.role)
        .then(|| {
            // Revoked or unreadable since resolve_role checked it: no renewal at all.
            rt.honoured_allowances()
                .ok()
                .and_then(|all| all.get(name).map(|a| (a.until_ms / 1000) as i64))
                .unwrap_or(now_secs)
        });
    let params = SessionParams {
        role_arn: role.arn.clone(),
        session_name: sts_identifier("byoc-", &p.job_id),
        external_id: roles.external_id.clone(),
        source_identity: sts_identifier("", &p.job_id),
        tags: vec![
            ("install".into(), tag_value(&p.install_id)),
            ("operation".into(), tag_value(&format!("{}.{}", p.entity, p.operation))),
            ("job".into(), tag_value(&p.job_id)),
        ],
        duration_secs: session_duration(
            allowance_end
                .map_or(p.timeout_secs, |end| p.timeout_secs.min(end.saturating_sub(now_secs) as u64)),
            roles.session_min_secs,
            roles.session_max_secs,
        ),
        policy_arns: Vec::new(),
        policy: None,
    };
    (params, allowance_end)
}

/// What every process of the job learns of its role, beside the credentials.
fn role_env(roles: &crate::roles::Roles, name: &str, arn: &str) -> Vec<(String, String)> {
    let mut common =
        vec![("BYOC_ROLE".to_string(), name.to_string()), ("BYOC_ROLE_ARN".to_string(), arn.to_string())];
    if let Some(region) = &roles.region {
        common.push(("AWS_REGION".into(), region.clone()));
        common.push(("AWS_DEFAULT_REGION".into(), region.clone()));
    }
    if let Some(url) = &roles.endpoint_url {
        common.push(("AWS_ENDPOINT_URL".into(), url.clone()));
    }
    common
}

/// A container's credentials: a file its `credential_process` reads, renewed by the
/// runner; without a static busybox to read it, the session's keys as they are.
fn container_credentials(
    roles: &crate::roles::Roles,
    job_id: &str,
    session: JobSession,
    static_env: Vec<(String, String)>,
    common: Vec<(String, String)>,
    feed: SecretFeed,
    intro: &str,
) -> (RoleSession, JobCredentials, String) {
    let file = if !crate::roles::creds::is_static_elf(&roles.busybox) {
        Err(format!(
            "{} is missing or not statically linked (install busybox-static)",
            roles.busybox.display()
        ))
    } else {
        CredentialFile::start(&roles.container_credentials_dir, job_id, session, roles.region.as_deref())
            .map_err(|e| {
                format!(
                    "writing the credentials file under {}: {e}",
                    roles.container_credentials_dir.display()
                )
            })
    };
    match file {
        Ok(file) => {
            let mut env = vec![
                ("AWS_CONFIG_FILE".to_string(), format!("{CONTAINER_CREDENTIALS_DIR}/config")),
                // The Go SDK v1 reads the config file only when asked to.
                ("AWS_SDK_LOAD_CONFIG".to_string(), "1".to_string()),
            ];
            env.extend(common);
            let container = ContainerCredentials {
                host_dir: file.dir.clone(),
                mount: CONTAINER_CREDENTIALS_DIR.into(),
                busybox: roles.busybox.clone(),
                busybox_mount: CONTAINER_BUSYBOX.into(),
                env,
            };
            let note = format!("{intro}, renewed before expiry through the container's credential_process\n");
            let creds = JobCredentials {
                endpoint_env: vec![],
                endpoint: None,
                static_env,
                container: Some(container),
                feed,
                full_session: None,
            };
            (RoleSession { _file: Some(file) }, creds, note)
        }
        Err(why) => {
            tracing::warn!(reason = %why, "A container gets its role session's keys without renewal.");
            let note = format!("{intro}; the container gets its keys without renewal: {why}\n");
            let creds = JobCredentials {
                endpoint_env: vec![],
                endpoint: None,
                static_env,
                container: None,
                feed,
                full_session: None,
            };
            (RoleSession { _file: None }, creds, note)
        }
    }
}

/// For a terraform job: the session parameters that narrow the role to read-only plus
/// what its planning needs (`roles::plan_scope`), and their summary. `None` for other
/// kinds, whose processes get the role's session (docs/ROLES.md says which are decided).
fn narrowed_params(
    rt: &Rt,
    p: &byoc_protocol::JobPayload,
    role: &ResolvedRole,
    params: &SessionParams,
) -> Result<Option<(SessionParams, String)>, String> {
    if p.kind != "terraform" {
        return Ok(None);
    }
    let state = crate::pipeline::execute::terraform_state(rt);
    let own_backend = p.spec["backend_config"].as_object().is_some_and(|o| !o.is_empty());
    let prefix = crate::secrets::store_prefix(&rt.install_id);
    let secret_ids = p.spec["secrets"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(|n| n.as_str())
        .map(|n| format!("{prefix}{n}"))
        .collect();
    let scope = crate::roles::plan_scope::plan_scope(&crate::roles::plan_scope::Needs {
        role_arn: &role.arn,
        backend: (!own_backend).then_some(&state.backend),
        workspace: p.spec["workspace"].as_str(),
        secret_ids,
        region: rt.roles.region.as_deref(),
        plan_actions: &role.derived.role.plan_actions,
    })?;
    let narrowed = SessionParams { policy_arns: scope.policy_arns, policy: scope.policy, ..params.clone() };
    Ok(Some((narrowed, scope.summary)))
}

/// What keeps a container's role session alive while it runs: dropping it stops the
/// renewal and deletes its credentials file.
pub struct RoleSession {
    _file: Option<CredentialFile>,
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::pipeline::authorize::PolicyChoice;
    use crate::testing;

    async fn cleared(f: &testing::Fakes, role: Option<&str>) -> ClearedJob {
        f.switches.set("maintenance", true);
        let scoped = super::super::resolve_role::resolve(&f.rt, testing::verified("job-1", role))
            .await
            .ok()
            .expect("scoped");
        ClearedJob {
            verified: scoped.verified,
            role: scoped.role,
            policy: PolicyChoice::default(),
            window_close: None,
        }
    }

    #[tokio::test]
    async fn a_job_without_a_role_gets_no_credentials_and_no_sts_call() {
        let f = testing::runtime().await;
        let job = assume(&f.rt, cleared(&f, None).await).await.ok().expect("assumed");
        assert!(job.session.credentials.is_none());
        assert_eq!(f.sts.calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn the_session_carries_the_job_id_and_reaches_only_the_sandbox() {
        let f = testing::runtime().await;
        let job = assume(&f.rt, cleared(&f, Some("maintenance")).await).await.ok().expect("assumed");
        let creds = job.session.credentials.expect("credentials");
        assert!(creds.endpoint.is_some(), "served by the endpoint in the job's namespace");
        assert!(creds.static_env.iter().any(|(k, v)| k == "AWS_SECRET_ACCESS_KEY" && v == "fake-secret-key"));
        let params = f.sts.params.lock().unwrap_or_else(|e| e.into_inner())[0].clone();
        assert_eq!(params.role_arn, "arn:aws:iam::123456789012:role/maintenance");
        assert!(params.source_identity.contains("job-1"), "{}", params.source_identity);
        assert!(params.tags.iter().any(|(k, v)| k == "job" && v == "job-1"));
        assert!(f.audit.events().contains(&"role_assumed".to_string()));
        let note = job.session.log_note.expect("note");
        assert!(note.contains("assumed role maintenance") && !note.contains("fake-secret-key"), "{note}");
    }

    #[tokio::test]
    async fn a_session_under_a_local_allowance_asks_for_no_longer_than_it_has_left() {
        use crate::roles::allowance;
        let f = testing::runtime().await;
        let break_glass = |mut job: ClearedJob| {
            if let Some(r) = job.role.as_mut() {
                r.derived.role.role_type = crate::roles::model::RoleType::BreakGlass;
            }
            job
        };
        let now = f.rt.clock.now_ms();
        let grant = |until_ms| allowance::Allowance {
            granted_ms: now,
            until_ms,
            by: "root".into(),
            reason: "t".into(),
        };
        let job = break_glass(cleared(&f, Some("maintenance")).await);
        // 20 minutes left: the session asks for 1,200 s, not the job's whole timeout.
        allowance::grant(&f.rt.state_dir, "maintenance", grant(now + 1_200_000)).expect("grant");
        let mut job = job;
        job.verified.payload.timeout_secs = 7200;
        let _ = assume(&f.rt, job).await;
        // Revoked after resolve_role let the job through: the shortest session STS gives.
        allowance::revoke(&f.rt.state_dir, "maintenance").expect("revoke");
        let mut job = break_glass(cleared(&f, Some("maintenance")).await);
        job.verified.payload.timeout_secs = 7200;
        let _ = assume(&f.rt, job).await;
        let params = f.sts.params.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let min = f.rt.roles.session_min_secs as i32;
        assert_eq!(params.len(), 2);
        assert_eq!(params[0].duration_secs, 1200.max(min).min(f.rt.roles.session_max_secs as i32));
        assert_eq!(params[1].duration_secs, min);
    }

    #[tokio::test]
    async fn a_refused_assume_role_is_audited_and_the_job_marked_not_to_run() {
        let f = testing::runtime().await;
        *f.sts.fail_with.lock().unwrap_or_else(|e| e.into_inner()) = Some("AccessDenied".into());
        let Err(refused) = assume(&f.rt, cleared(&f, Some("maintenance")).await).await else {
            panic!("assumed")
        };
        assert!(refused.error.contains("did not run"), "{}", refused.error);
        assert!(refused.log_note.contains("AccessDenied"), "{}", refused.log_note);
        assert!(f.audit.events().contains(&"role_assume_failed".to_string()));
    }

    #[tokio::test]
    async fn without_a_region_no_role_can_be_assumed() {
        let mut f = testing::runtime().await;
        let job = cleared(&f, Some("maintenance")).await;
        std::sync::Arc::get_mut(&mut f.rt).expect("sole owner").roles.assumer = None;
        let Err(refused) = assume(&f.rt, job).await else { panic!("assumed") };
        assert!(refused.log_note.contains("aws.region"), "{}", refused.log_note);
    }
}
