//! `state list`, `state show WORKSPACE`, `state unlock WORKSPACE LOCK_ID`: the terraform
//! state of the install's workspaces, as resource addresses and serials, never
//! attribute values. With a state bucket (`[terraform.state] bucket`) they read the
//! bucket under a lifecycle role's session (the maintenance role unless `--role`);
//! without one, the state this runner keeps in its state dir.

use clap::Subcommand;

use super::{Output, StateArgs, print_json, state_dir};
use crate::config::Config;
use crate::roles::inbox;
use byoc_audit::log::Record;
use byoc_job_executors::terraform::{bucket, state};

#[derive(Subcommand)]
pub(super) enum TfStateCmd {
    /// Workspaces with state: serial, resources, lock
    ///
    /// Each workspace's serial and resource count, and (in the state bucket) whether
    /// it is locked.
    ///
    /// Example: byoc-runner state list -o json
    List(BucketArgs),
    /// One workspace: addresses, serial, lock (never values)
    ///
    /// Example: byoc-runner state show network
    Show {
        #[command(flatten)]
        args: BucketArgs,
        /// The workspace (`state list` lists them).
        workspace: String,
    },
    /// Remove a stale lock from a workspace (audited)
    ///
    /// Removes a lock a killed runner left on a workspace in the state bucket, as
    /// `terraform force-unlock` does: only if it holds LOCK_ID (the ID the failed job's
    /// log and `state show` print). Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner state unlock network 6f1c…
    Unlock {
        #[command(flatten)]
        args: BucketArgs,
        /// The workspace (`state list` lists them).
        workspace: String,
        /// The lock's ID, as the failed job's log and `state show` print it.
        lock_id: String,
    },
}

#[derive(clap::Args)]
pub(super) struct BucketArgs {
    #[command(flatten)]
    state: StateArgs,
    /// The lifecycle role (name or type) whose session reads the state bucket;
    /// default: the maintenance role. It must be switched on.
    #[arg(long)]
    role: Option<String>,
}

/// Reason code: what was typed is not a workspace, role or lock id (exit 64).
const INVALID_REQUEST: &str = "invalid_request";

/// A refusal with its reason code.
struct Failure {
    code: &'static str,
    message: String,
}

fn failure(code: &'static str, message: impl Into<String>) -> Failure {
    Failure { code, message: message.into() }
}

impl From<bucket::BucketError> for Failure {
    fn from(e: bucket::BucketError) -> Self {
        Failure { code: e.code(), message: e.to_string() }
    }
}

pub(super) fn run(cmd: TfStateCmd) -> i32 {
    crate::logging::init_cli();
    let args = match &cmd {
        TfStateCmd::List(a) | TfStateCmd::Show { args: a, .. } | TfStateCmd::Unlock { args: a, .. } => a,
    };
    let output = args.state.output;
    let config = match args.state.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            return super::exit_code_of(&e);
        }
    };
    let result = match config.filter(|c| c.terraform.state.bucket.is_some()) {
        Some(config) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| failure("runtime", e.to_string()))
            .and_then(|rt| rt.block_on(in_bucket(&cmd, &config))),
        None => on_runner(&cmd),
    };
    match result {
        Ok(()) => 0,
        Err(f) => {
            match output {
                Output::Json => {
                    println!("{}", serde_json::json!({"ok": false, "code": f.code, "error": f.message}))
                }
                Output::Text => eprintln!("error: {} [{}]", f.message, f.code),
            }
            if f.code == INVALID_REQUEST { super::EX_USAGE } else { 1 }
        }
    }
}

fn check_workspace(name: &str) -> Result<(), Failure> {
    if byoc_job_executors::terraform::valid_name(name) {
        Ok(())
    } else {
        Err(failure(INVALID_REQUEST, format!("workspace {name:?}: 1-64 of [a-z0-9_-]")))
    }
}

/// State kept on this runner (no bucket configured).
fn on_runner(cmd: &TfStateCmd) -> Result<(), Failure> {
    let (args, workspace) = match cmd {
        TfStateCmd::List(a) => (a, None),
        TfStateCmd::Show { args, workspace } | TfStateCmd::Unlock { args, workspace, .. } => {
            (args, Some(workspace.as_str()))
        }
    };
    let dir = state_dir(&args.state).map_err(|e| failure("state_dir", format!("{e:#}")))?;
    let root = crate::state_dir::StateDir::of(&dir).tfstate();
    let json = args.state.output == Output::Json;
    let io = |e: std::io::Error| failure("state_io", format!("{}: {e}", root.display()));
    match (cmd, workspace) {
        (TfStateCmd::Unlock { .. }, Some(name)) => {
            check_workspace(name)?;
            // Local state is held with a lock the kernel drops with its holder: a lock
            // can only be held by a job that is still running. Nothing is created here
            // (the CLI runs as root; the daemon's user must keep owning the workspace).
            match state::LocalState::is_held(&root, name).map_err(io)? {
                None => {
                    Err(failure("state_not_found", format!("no workspace {name:?} under {}", root.display())))
                }
                Some(true) => Err(failure(
                    "state_locked",
                    format!(
                        "workspace {name:?} is held by a job running on this runner; it is released when that job ends"
                    ),
                )),
                Some(false) => Err(failure(
                    "state_not_locked",
                    format!(
                        "workspace {name:?} is not locked: state on this runner is locked only while a job holds it, and released when that job (or the runner) exits"
                    ),
                )),
            }
        }
        (_, None) => {
            let all = state::list(&root).map_err(io)?;
            if json {
                return print_json(&all).map_err(|e| failure("output", e.to_string()));
            }
            if all.is_empty() {
                println!("no terraform state on this runner ({})", root.display());
                return Ok(());
            }
            println!("{:<32} {:>8} {:>10} {:>9}", "WORKSPACE", "SERIAL", "RESOURCES", "PREVIOUS");
            for s in all {
                println!(
                    "{:<32} {:>8} {:>10} {:>9}",
                    s.workspace,
                    dash(s.serial),
                    s.resources.len(),
                    s.previous_versions
                );
            }
            Ok(())
        }
        (_, Some(name)) => {
            check_workspace(name)?;
            let s = state::show(&root, name).map_err(|e| {
                failure(
                    "state_not_found",
                    format!("no state for workspace {name:?} under {}: {e}", root.display()),
                )
            })?;
            if json {
                return print_json(&s).map_err(|e| failure("output", e.to_string()));
            }
            print_summary(
                &s,
                &format!("{} ({} previous versions kept)", root.join(name).display(), s.previous_versions),
            );
            Ok(())
        }
    }
}

fn dash(n: Option<u64>) -> String {
    n.map(|n| n.to_string()).unwrap_or_else(|| "-".into())
}

fn print_summary(s: &state::Summary, kept_at: &str) {
    println!("workspace:  {}", s.workspace);
    println!("kept at:    {kept_at}");
    println!("serial:     {}", dash(s.serial));
    println!("terraform:  {}", s.terraform_version.as_deref().unwrap_or("-"));
    println!("size:       {} bytes", s.bytes);
    println!("resources:  {}", s.resources.len());
    for r in &s.resources {
        println!("  {r}");
    }
}

/// State in the install's bucket, under a lifecycle role's session.
async fn in_bucket(cmd: &TfStateCmd, config: &Config) -> Result<(), Failure> {
    let (args, operation) = match cmd {
        TfStateCmd::List(a) => (a, "state.list"),
        TfStateCmd::Show { args, .. } => (args, "state.show"),
        TfStateCmd::Unlock { args, .. } => (args, "state.unlock"),
    };
    if let TfStateCmd::Show { workspace, .. } | TfStateCmd::Unlock { workspace, .. } = cmd {
        check_workspace(workspace)?;
    }
    // Reading the bucket assumes a lifecycle role: the same people who may pause.
    let who = crate::roles::pause::authorize(config.roles.admin_group.as_deref())
        .map_err(|e| failure("not_allowed", e.to_string()))?;
    let dir = state_dir(&args.state).map_err(|e| failure("state_dir", format!("{e:#}")))?;
    let s = &config.terraform.state;
    let bucket_name = s.bucket.clone().unwrap_or_default();
    let key_prefix = match &s.key_prefix {
        Some(p) => p.clone(),
        None => crate::identity::load_enrollment(&dir)
            .ok()
            .flatten()
            .map(|e| e.install_id)
            .ok_or_else(|| failure("not_enrolled", format!("the runner in {} is not enrolled: its install id (the state keys' prefix) is unknown; set terraform.state.key_prefix", dir.display())))?,
    };
    let region = s.region.clone().or_else(|| config.aws.region.clone()).unwrap_or_default();
    let (role, keys) = role_session(config, &dir, args.role.as_deref(), operation, &who).await?;
    let b = bucket::StateBucket::new(&bucket_name, &region, &key_prefix, s.endpoint.as_deref(), keys)?;
    let json = args.state.output == Output::Json;
    if !matches!(cmd, TfStateCmd::Unlock { .. }) {
        // The role's session is audited like a job's: on record before it is used.
        let r = Record {
            event: "state_read".into(),
            operation: Some(operation.into()),
            role: Some(role.clone()),
            detail: Some(format!("s3://{bucket_name}/{key_prefix}/ read by {who} as role {role}")),
            ..Default::default()
        };
        inbox::submit(&dir, &r).map_err(|e| {
            failure(
                "audit_unavailable",
                format!("recording the read for the audit log in {}: {e}", inbox::inbox_dir(&dir).display()),
            )
        })?;
    }
    match cmd {
        TfStateCmd::List(_) => {
            let all = b.list().await?;
            if json {
                return json_out(&all);
            }
            println!("state bucket s3://{bucket_name}/{key_prefix}/ (read as role {role})");
            if all.is_empty() {
                println!("no workspaces");
                return Ok(());
            }
            println!("{:<32} {:>8} {:>10}  LOCK", "WORKSPACE", "SERIAL", "RESOURCES");
            for w in all {
                println!(
                    "{:<32} {:>8} {:>10}  {}",
                    w.summary.workspace,
                    dash(w.summary.serial),
                    w.summary.resources.len(),
                    w.lock.as_ref().map(|l| format!("locked ({})", l.id)).unwrap_or_else(|| "-".into())
                );
            }
            Ok(())
        }
        TfStateCmd::Show { workspace, .. } => {
            let w = b.show(workspace).await?;
            if json {
                return json_out(&w);
            }
            print_summary(&w.summary, &format!("s3://{bucket_name}/{} (read as role {role})", w.key));
            match &w.lock {
                Some(l) => println!(
                    "lock:       {} ({} by {} since {}); if no terraform runs, `byoc-runner state unlock {workspace} {}`",
                    l.id, l.operation, l.who, l.created, l.id
                ),
                None => println!("lock:       -"),
            }
            Ok(())
        }
        TfStateCmd::Unlock { workspace, lock_id, .. } => {
            let at = Unlocking {
                dir: &dir,
                operation,
                role: &role,
                who: &who,
                bucket_name: &bucket_name,
                key_prefix: &key_prefix,
            };
            unlock(&b, &at, workspace, lock_id, json).await
        }
    }
}

/// Who unlocks which bucket's state, as the audit records name it.
struct Unlocking<'a> {
    dir: &'a std::path::Path,
    operation: &'a str,
    role: &'a str,
    who: &'a str,
    bucket_name: &'a str,
    key_prefix: &'a str,
}

/// Remove a stale lock, on record before it goes and after.
async fn unlock(
    b: &bucket::StateBucket,
    at: &Unlocking<'_>,
    workspace: &str,
    lock_id: &str,
    json: bool,
) -> Result<(), Failure> {
    let Unlocking { dir, operation, role, who, bucket_name, key_prefix } = *at;
    let detail = |what: &str| {
        format!(
            "workspace {workspace} s3://{bucket_name}/{key_prefix}/{workspace} lock {lock_id}: {what} by {who} as role {role}"
        )
    };
    let record = |event: &str, reason: Option<&str>, what: &str| {
        let r = Record {
            event: event.into(),
            operation: Some(operation.into()),
            role: Some(role.to_string()),
            reason: reason.map(str::to_string),
            detail: Some(detail(what)),
            ..Default::default()
        };
        inbox::submit(dir, &r).map_err(|e| {
            failure(
                "audit_unavailable",
                format!("recording the unlock for the audit log in {}: {e}", inbox::inbox_dir(dir).display()),
            )
        })
    };
    // On record before the lock goes: an unlock is never unaudited.
    record("state_unlock_requested", None, "requested")?;
    match b.unlock(workspace, lock_id).await {
        Ok(held) => {
            record(
                "state_unlocked",
                None,
                &format!("removed ({} by {} since {})", held.operation, held.who, held.created),
            )?;
            if json {
                return json_out(&serde_json::json!({"ok": true, "workspace": workspace, "removed": held}));
            }
            println!(
                "removed lock {} on workspace {workspace} ({} by {} since {}); the next job takes the lock (audited)",
                held.id, held.operation, held.who, held.created
            );
            Ok(())
        }
        Err(e) => {
            let f = Failure::from(e);
            record("state_unlock_failed", Some(f.code), &f.message)?;
            Err(f)
        }
    }
}

/// The lifecycle role's session the CLI reads the bucket with: its switch read now
/// (a role switched off is refused, never bypassed), then AssumeRole as the daemon does
/// for jobs, with the customer's name as the source identity.
async fn role_session(
    config: &Config,
    state_dir: &std::path::Path,
    wanted: Option<&str>,
    operation: &str,
    who: &str,
) -> Result<(String, bucket::Keys), Failure> {
    use crate::roles::sts::{Assumer as _, SessionParams, StsAssumer, sts_identifier, tag_value};
    let sdk = crate::roles::sdk_config(config).await.ok_or_else(|| {
        failure(
            "aws_not_configured",
            "aws.region is not configured: the state bucket is read under a lifecycle role",
        )
    })?;
    let mut status = crate::roles::RolesStatus::load(state_dir).unwrap_or_default();
    let source = crate::roles::switch_source(config, Some(&sdk));
    let snapshot = source.read().await.map_err(|e| {
        failure("switches_unreadable", format!("reading the role switches ({}): {e}", source.describe()))
    })?;
    status.refresh(&snapshot, source.describe());
    let wanted = wanted.unwrap_or("maintenance");
    let role = status
        .roles
        .iter()
        .find(|r| r.name == wanted)
        .or_else(|| status.roles.iter().find(|r| r.role_type.as_str() == wanted))
        .ok_or_else(|| {
            let known: Vec<&str> = status.roles.iter().map(|r| r.name.as_str()).collect();
            failure(
                "role_unknown",
                format!(
                    "no lifecycle role named or typed {wanted:?} (known: {}); the daemon records the app's roles when it first reads its switches",
                    if known.is_empty() { "none yet".to_string() } else { known.join(", ") }
                ),
            )
        })?;
    let arn = match (&role.arn, role.enabled) {
        (Some(arn), true) => arn.clone(),
        _ => {
            return Err(failure(
                "role_disabled",
                format!(
                    "role {} is switched off{}; switch it on or name another with --role",
                    role.name,
                    role.how_to_enable.as_deref().map(|h| format!(" ({h})")).unwrap_or_default()
                ),
            ));
        }
    };
    let install =
        crate::identity::load_enrollment(state_dir).ok().flatten().map(|e| e.install_id).unwrap_or_default();
    let params = SessionParams {
        role_arn: arn.clone(),
        session_name: sts_identifier("byoc-cli-", who),
        external_id: config.roles.external_id.clone(),
        source_identity: sts_identifier("customer-", who),
        tags: vec![
            ("install".into(), tag_value(&install)),
            ("operation".into(), tag_value(operation)),
            ("job".into(), "none".into()),
        ],
        duration_secs: 900,
        policy_arns: Vec::new(),
        policy: None,
    };
    let assumer = StsAssumer { client: aws_sdk_sts::Client::new(&sdk) };
    let c = assumer
        .assume(&params)
        .await
        .map_err(|e| failure("role_assume_failed", format!("AssumeRole {arn}: {}", e.message)))?;
    Ok((
        role.name.clone(),
        bucket::Keys {
            access_key_id: c.access_key_id,
            secret_access_key: c.secret_access_key,
            session_token: Some(c.session_token),
        },
    ))
}

fn json_out<T: serde::Serialize>(v: &T) -> Result<(), Failure> {
    print_json(v).map_err(|e| failure("output", e.to_string()))
}
