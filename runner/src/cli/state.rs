//! `status`, `pause`, `resume`, `roles`: the runner's state as the customer sees it.

use super::{Output, StateArgs, control_state_dir, print_json, state_dir};
use crate::config::Config;
use crate::inspect;
use crate::state_dir::StateDir;

/// `status`'s exit code when the daemon is not running (systemctl's "not running").
pub(super) const EXIT_NOT_RUNNING: i32 = 3;

/// Prints the runner's state; the exit code is 0 with the daemon running, else
/// [`EXIT_NOT_RUNNING`].
pub(super) fn status(s: &StateArgs) -> anyhow::Result<i32> {
    let dir = state_dir(s)?;
    let st = inspect::status(&dir)?;
    let code = if st.daemon_pid.is_some() { 0 } else { EXIT_NOT_RUNNING };
    // The customer's thresholds if the config reads, else the defaults the daemon uses.
    let disk = s.config()?.map(|c| c.disk).unwrap_or_default().check(&dir);
    let contact = crate::contact::read(&dir);
    if s.output == Output::Json {
        let mut v = serde_json::to_value(&st)?;
        v["version"] = crate::update::running_version().into();
        v["contact"] = serde_json::to_value(&contact)?;
        v["disk"] = serde_json::to_value(&disk)?;
        v["drift"] = serde_json::to_value(crate::drift::list(&dir))?;
        print_json(&v)?;
        return Ok(code);
    }
    print_identity(&st, &contact);
    print_work(&st, &crate::drift::list(&dir), &disk);
    Ok(code)
}

/// Who the runner is and when it last heard from the control plane.
fn print_identity(st: &inspect::Status, contact: &crate::contact::Contact) {
    let or_dash = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    println!("version:        {}", crate::update::running_version());
    println!("state dir:      {}", st.state_dir);
    println!("enrolled:       {}", if st.enrolled { "yes" } else { "no" });
    println!("runner id:      {}", or_dash(&st.runner_id));
    println!("install id:     {}", or_dash(&st.install_id));
    println!("control plane:  {}", or_dash(&st.control_plane_url));
    match st.daemon_pid {
        Some(pid) => println!("daemon:         running (pid {pid})"),
        None => println!("daemon:         not running"),
    }
    let ago = |ms: u64| {
        let secs = crate::clock::now_ms().saturating_sub(ms) / 1000;
        format!("{} ({secs} s ago)", crate::clock::rfc3339_ms(ms))
    };
    println!("last poll:      {}", contact.last_poll_ms.map(ago).unwrap_or_else(|| "never answered".into()));
    if let Some(e) = &contact.poll_error {
        println!("poll failed:    {}: {}", ago(e.at_ms), e.error);
    }
    println!(
        "last result:    {}",
        match (contact.last_result_ms, &contact.last_result_job) {
            (Some(ms), Some(job)) => format!("{} acknowledged {}", job, ago(ms)),
            _ => "none acknowledged yet".into(),
        }
    );
}

/// Its jobs, drift, pause, disk and refusals.
fn print_work(st: &inspect::Status, drift: &[crate::drift::DriftRecord], disk: &crate::disk::DiskCheck) {
    let counts: Vec<String> = st.jobs_by_status.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!(
        "jobs:           {} ({})",
        st.jobs_total,
        if counts.is_empty() { "none".into() } else { counts.join(", ") }
    );
    println!(
        "running:        {}",
        if st.jobs_running.is_empty() { "-".into() } else { st.jobs_running.join(", ") }
    );
    let drift: Vec<String> = drift
        .iter()
        .filter(|r| r.verdict != "clean")
        .map(|r| match r.kind.as_str() {
            "terraform" => format!("{} {}", r.workspace, r.verdict),
            kind => format!("{kind}:{} {}", r.workspace, r.verdict),
        })
        .collect();
    if !drift.is_empty() {
        println!("drift:          {} (byoc-runner drift)", drift.join(", "));
    }
    if !st.jobs_waiting.is_empty() {
        println!("held:           {} (byoc-runner jobs list; approvals)", st.jobs_waiting.join(", "));
    }
    println!(
        "unreported:     {}",
        if st.jobs_unreported.is_empty() { "-".into() } else { st.jobs_unreported.join(", ") }
    );
    match &st.paused {
        Some(p) => println!(
            "paused:         yes, by {} since {}{}",
            p.by,
            crate::clock::rfc3339_ms(p.paused_at_ms),
            p.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
        ),
        None => println!("paused:         no"),
    }
    let mib = |b: Option<u64>| b.map(|b| format!("{} MiB", b >> 20)).unwrap_or_else(|| "?".into());
    println!(
        "disk:           {} free of {}, new jobs refused under {}{}",
        mib(disk.free_bytes),
        mib(disk.total_bytes),
        mib(Some(disk.threshold_bytes)),
        disk.low.as_deref().map(|why| format!("\n                LOW (disk_low): {why}")).unwrap_or_default()
    );
    let used: Vec<String> =
        st.disk_use.iter().map(|(k, v)| format!("{k} {:.1} MiB", *v as f64 / 1048576.0)).collect();
    println!("disk use:       {}", used.join(", "));
    for e in &st.audit_export {
        let health = match (&e.failing_since_ms, &e.last_error) {
            (Some(since), error) => format!(
                "FAILING since {} ({}); jobs go on, the copy catches up",
                crate::clock::rfc3339_ms(*since),
                error.as_deref().unwrap_or("?")
            ),
            (None, _) if e.lag_records == 0 => "up to date".into(),
            (None, _) => format!("{} records behind", e.lag_records),
        };
        println!("audit copy:     {} {} records, {health}", e.target, e.delivered_records);
    }
    match &st.last_rejection {
        Some(r) => {
            println!(
                "rejections:     {} (last: {} at {})",
                st.rejections,
                r.reason,
                crate::clock::rfc3339_ms(r.ts)
            )
        }
        None => println!("rejections:     0"),
    }
}

pub(super) fn metrics(s: &StateArgs) -> anyhow::Result<()> {
    let dir = state_dir(s)?;
    let disk = s.config()?.map(|c| c.disk).unwrap_or_default();
    let mut tally = crate::metrics::AuditTally::default();
    tally.update(&StateDir::of(&dir).audit())?;
    let families = crate::metrics::collect(&dir, &disk, &tally, crate::clock::now_ms())?;
    if s.output == Output::Json {
        return print_json(&crate::metrics::samples(&families));
    }
    print!("{}", crate::metrics::render(&families));
    Ok(())
}

/// The admin group: the configuration's; for a member, who cannot read runner.toml
/// (it is the runner's), the group `control/` is shared with, which only root can set.
/// A `--config` that does not exist is a usage error, as everywhere.
pub(super) fn admin_group(s: &StateArgs) -> anyhow::Result<Option<String>> {
    if s.config.is_some() {
        s.config()?;
    }
    Ok(match Config::load(s.config_path()) {
        Ok(c) => c.roles.admin_group,
        Err(_) => super::state_dir_unchecked(s).ok().and_then(|d| crate::roles::control::shared_group(&d)),
    })
}

pub(super) fn pause(s: &StateArgs, reason: Option<String>) -> anyhow::Result<()> {
    use crate::roles::pause;
    let who = pause::authorize(admin_group(s)?.as_deref())?;
    let dir = control_state_dir(s)?;
    // A pause in force stays as it is (who paused and when are its record): pausing
    // again changes nothing and says so.
    if let Some(p) = pause::read(&dir) {
        if s.output == Output::Json {
            return print_json(&serde_json::json!({ "paused": true, "already": true, "pause": p }));
        }
        println!(
            "already paused by {} since {}{}; nothing changed (`byoc-runner resume` first to pause anew)",
            p.by,
            crate::clock::rfc3339_ms(p.paused_at_ms),
            p.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
        );
        return Ok(());
    }
    if reason.as_ref().is_some_and(|r| r.chars().count() > 500) {
        super::usage!("--reason is longer than 500 characters");
    }
    let p = pause::Pause { paused_at_ms: crate::clock::now_ms(), reason, by: who };
    // On record, with who did it, before it takes effect (as an approval is).
    let record = crate::audit_records::pause_requested(&p, nix::unistd::geteuid().as_raw());
    let left = submit_record(&dir, &record)?;
    if let Err(e) = pause::write(&dir, &p) {
        // Not paused: take back the record if the daemon has not audited it yet.
        let _ = std::fs::remove_file(left);
        return Err(e.into());
    }
    if s.output == Output::Json {
        return print_json(&serde_json::json!({ "paused": true, "pause": p }));
    }
    println!(
        "paused by {}{}: new jobs are refused (reason code `paused`) until `byoc-runner resume`; running jobs finish",
        p.by,
        p.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
    );
    Ok(())
}

pub(super) fn resume(s: &StateArgs) -> anyhow::Result<()> {
    use crate::roles::pause;
    let who = pause::authorize(admin_group(s)?.as_deref())?;
    let dir = control_state_dir(s)?;
    let was = match pause::read(&dir) {
        None => false,
        Some(lifted) => {
            let now = crate::clock::now_ms();
            let uid = nix::unistd::geteuid().as_raw();
            let left = submit_record(&dir, &crate::audit_records::resume_requested(&who, uid, now, &lifted))?;
            match pause::resume(&dir) {
                Ok(was) => was,
                Err(e) => {
                    // Still paused: take back the record if the daemon has not audited it
                    // yet (if it has, it records the pause as still in force).
                    let _ = std::fs::remove_file(left);
                    return Err(e.into());
                }
            }
        }
    };
    if s.output == Output::Json {
        return print_json(&serde_json::json!({ "paused": false, "was_paused": was }));
    }
    println!(
        "{}",
        if was { "resumed: the runner takes new jobs again" } else { "the runner was not paused" }
    );
    Ok(())
}

/// Leave a record for the daemon's audit log; an error says where it could not go.
pub(super) fn submit_record(
    dir: &std::path::Path,
    record: &byoc_audit::log::Record,
) -> anyhow::Result<std::path::PathBuf> {
    use crate::roles::inbox;
    inbox::submit(dir, record).map_err(|e| {
        anyhow::anyhow!("recording for the audit log in {}: {e}", inbox::inbox_dir(dir).display())
    })
}

pub(super) fn roles(s: &StateArgs, refresh: bool) -> anyhow::Result<()> {
    let dir = control_state_dir(s)?;
    let mut status = crate::roles::RolesStatus::read(&dir).map_err(anyhow::Error::msg)?.unwrap_or_default();
    if refresh {
        let config = Config::load(s.config_path()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async {
            let sdk = crate::roles::sdk_config(&config).await;
            let source = crate::roles::switch_source(&config, sdk.as_ref());
            let snapshot = source.read().await?;
            status.refresh(&snapshot, source.describe());
            anyhow::Ok(())
        })?;
    }
    let require =
        s.config()?.map(|c| c.roles.require_local_allow).unwrap_or_else(|| vec!["break_glass".into()]);
    let allowances = crate::roles::allowance::read(&dir);
    let now = crate::clock::now_ms();
    // What each role's local allowance says, for the roles that need one.
    let local: std::collections::BTreeMap<String, String> = status
        .roles
        .iter()
        .filter(|r| require.iter().any(|q| *q == r.name || q == r.role_type.as_str()))
        .map(|r| {
            let said = match &allowances {
                Err(e) => format!("none holds: {e}"),
                Ok(all) => match all.get(&r.name) {
                    Some(a) if a.until_ms > now => format!(
                        "allowed until {} by {} ({})",
                        crate::clock::rfc3339((a.until_ms / 1000) as i64),
                        a.by,
                        a.reason
                    ),
                    Some(a) => {
                        format!("expired {}", crate::clock::rfc3339((a.until_ms / 1000) as i64))
                    }
                    None => format!("needs `byoc-runner roles allow {} --for DURATION --reason …`", r.name),
                },
            };
            (r.name.clone(), said)
        })
        .collect();
    if s.output == Output::Json {
        let mut v = serde_json::to_value(&status)?;
        v["local_allowance"] = serde_json::to_value(&local)?;
        return print_json(&v);
    }
    if status.roles.is_empty() {
        println!(
            "no roles known yet: they are learned from the first job that asks for a role (switch source: {})",
            if status.switch_source.is_empty() { "not read yet" } else { &status.switch_source }
        );
        return Ok(());
    }
    println!(
        "switches: {} (read {})",
        status.switch_source,
        status.switches_read_ms.map(crate::clock::rfc3339_ms).unwrap_or_else(|| "never".into())
    );
    println!(
        "{:<36} {:<12} {:<8} {:<21} {:<24} SWITCH",
        "ROLE", "TYPE", "ENABLED", "LAST ASSUMED", "LAST JOB"
    );
    for r in &status.roles {
        println!(
            "{:<36} {:<12} {:<8} {:<21} {:<24} {}",
            r.name,
            r.role_type.as_str(),
            if r.enabled { "yes" } else { "no" },
            r.last_assumed_ms.map(crate::clock::rfc3339_ms).unwrap_or_else(|| "-".into()),
            r.last_job.as_deref().unwrap_or("-"),
            r.source
        );
        if let Some(arn) = &r.arn {
            println!("    arn: {arn}");
        }
        if let Some(how) = r.how_to_enable.as_ref().filter(|_| !r.enabled) {
            println!("    to enable: {how}");
        }
        if let Some(said) = local.get(&r.name) {
            println!("    local allowance: {said}");
        }
        if !r.plan_actions.is_empty() {
            println!("    while terraform plans (read-only) also: {}", r.plan_actions.join(", "));
        }
    }
    Ok(())
}

#[derive(clap::Subcommand)]
pub(super) enum RolesAction {
    /// Allow a role that needs a local allowance, for a while
    ///
    /// A second key beside the role's stack switch, for the roles
    /// `roles.require_local_allow` names (break-glass roles by default). Audited before
    /// it takes effect. Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner roles allow inst-1-break-glass --for 2h --reason INC-7
    Allow {
        #[command(flatten)]
        state: StateArgs,
        /// The role's name (as `byoc-runner roles` lists it).
        role: String,
        /// How long: 90s, 30m, 2h, 1d (at most 7d).
        #[arg(long = "for", value_name = "DURATION")]
        duration: String,
        /// Why (kept in the audit log).
        #[arg(long)]
        reason: String,
    },
    /// Withdraw a role's local allowance now (audited)
    ///
    /// Example: byoc-runner roles revoke inst-1-break-glass
    Revoke {
        #[command(flatten)]
        state: StateArgs,
        /// The role's name (as `byoc-runner roles` lists it).
        role: String,
    },
    /// Not here: switches live in the install stack (says where).
    #[command(hide = true)]
    Enable {
        #[command(flatten)]
        state: StateArgs,
        role: String,
    },
    /// Not here: switches live in the install stack (says where).
    #[command(hide = true)]
    Disable {
        #[command(flatten)]
        state: StateArgs,
        role: String,
    },
}

pub(super) fn roles_action(action: RolesAction) -> anyhow::Result<()> {
    use crate::roles::allowance;
    let (s, role, allow) = match &action {
        RolesAction::Allow { state, role, duration, reason } => (state, role, Some((duration, reason))),
        RolesAction::Revoke { state, role } => (state, role, None),
        RolesAction::Enable { role, .. } | RolesAction::Disable { role, .. } => anyhow::bail!(
            "a role's switch is not on this VM: it is the install stack's Enable…Role parameter for {role:?}, \
             changed in CloudFormation by whoever owns the stack (`byoc-runner roles` shows each switch and how \
             to turn it on); `byoc-runner roles allow` gives a role that also needs a local allowance its second key"
        ),
    };
    let who = crate::roles::pause::authorize(admin_group(s)?.as_deref())?;
    let dir = control_state_dir(s)?;
    // Only roles the runner knows: a typo must not look like a grant.
    let known = crate::roles::RolesStatus::read(&dir).map_err(anyhow::Error::msg)?.unwrap_or_default();
    let Some(status) = known.roles.iter().find(|r| r.name == *role) else {
        super::usage!(
            "no role {role:?} known to this runner (known: {}); `byoc-runner roles` lists them",
            known.roles.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", ")
        );
    };
    // An allowance for a role that needs none would change nothing: say so, grant
    // nothing. Only when the configuration says so: a member of the admin group cannot
    // read runner.toml, and a guess must not refuse a grant the customer requires.
    if matches!(action, RolesAction::Allow { .. })
        && let Some(config) = s.config()?
    {
        let require = config.roles.require_local_allow;
        anyhow::ensure!(
            require.iter().any(|q| *q == status.name || q == status.role_type.as_str()),
            "role {role:?} needs no local allowance (roles.require_local_allow = {require:?}): its stack \
             switch alone decides; nothing was granted"
        );
    }
    let audit = |event: &str, detail: String| {
        let r =
            byoc_audit::log::Record { role: Some(role.clone()), ..crate::audit_records::note(event, detail) };
        submit_record(&dir, &r)
    };
    match allow {
        Some((duration, reason)) => {
            let reason = reason.clone();
            let secs = match crate::clock::parse_duration(duration) {
                Ok(secs) => secs,
                Err(e) => super::usage!("--for {e}"),
            };
            if reason.trim().is_empty() || reason.chars().count() > 500 {
                super::usage!("--reason: 1 to 500 characters");
            }
            let now = crate::clock::now_ms();
            let a = allowance::Allowance { granted_ms: now, until_ms: now + secs * 1000, by: who, reason };
            let until = crate::clock::rfc3339((a.until_ms / 1000) as i64);
            // On record before it takes effect.
            audit("allowance_granted", format!("until {until} ({secs}s) by {}: {}", a.by, a.reason))?;
            allowance::grant(&dir, role, a.clone())?;
            if s.output == Output::Json {
                return print_json(&serde_json::json!({ "role": role, "allowance": a }));
            }
            println!(
                "role {role} is allowed until {until} (its stack switch must be on too); `byoc-runner roles revoke {role}` ends it sooner"
            );
        }
        None => {
            audit("allowance_revoked", format!("by {who}"))?;
            let removed = allowance::revoke(&dir, role)?;
            if s.output == Output::Json {
                return print_json(&serde_json::json!({ "role": role, "revoked": removed.is_some() }));
            }
            println!(
                "{}",
                if removed.is_some() {
                    format!("role {role}'s local allowance is withdrawn")
                } else {
                    format!("role {role} had no local allowance")
                }
            );
        }
    }
    Ok(())
}
