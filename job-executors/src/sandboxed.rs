//! Running a process executor's command inside the sandbox: per-job cgroup, the
//! helper's spec, and the explanation of how it ended (which limit, if any, killed it).

use std::os::unix::fs::DirBuilderExt as _;
use std::path::PathBuf;

use byoc_sandbox::cgroup::JobCgroup;
use byoc_sandbox::helper::{EXIT_EXEC_FAILED, EXIT_LEASE_EXPIRED, EXIT_NETWORK_FAILED, EXIT_SANDBOX_FAILED};
use byoc_sandbox::spec::SANDBOX_WORK_DIR;
use tokio::process::Command;

use crate::jobnet::{self, NetworkUse};
use crate::{ExecContext, ExecOutcome, JobStatus, SandboxSettings};

/// A command to run in the sandbox: program and args as seen inside, and the complete
/// environment (nothing else is inherited). `network`: egress through the user-mode
/// stack (false: an offline namespace).
pub struct Job {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub network: bool,
    /// Programs run after `argv` in the same sandbox (see [`byoc_sandbox::spec::Stage`]).
    pub then: Vec<byoc_sandbox::spec::Stage>,
    /// The runner's directory the job sees read-only at `/sealed`.
    pub sealed_dir: Option<PathBuf>,
    /// The sandbox's end of the gate channel, when a stage is gated.
    pub gate: Option<std::os::fd::OwnedFd>,
    /// The runner's directories the job sees (see [`byoc_sandbox::spec::Bind`]).
    pub binds: Vec<byoc_sandbox::spec::Bind>,
    /// Mount /proc (see [`byoc_sandbox::SandboxSpec::proc`]).
    pub proc: bool,
}

/// Reason codes (in the result's `outputs.reason`) for a job the sandbox refused.
pub const NETWORK_UNAVAILABLE: &str = "sandbox_network_unavailable";
pub const LIMITS_UNAVAILABLE: &str = "sandbox_limits_unavailable";
/// The job's lease ran out unrenewed and the sandbox stopped it.
pub const LEASE_EXPIRED: &str = "lease_expired";

/// A job refused before anything of it ran, with the reason code and what to fix.
pub fn refused(reason: &str, error: String) -> ExecOutcome {
    ExecOutcome {
        status: JobStatus::Failed,
        exit_code: None,
        error: Some(error),
        outputs: serde_json::json!({ "reason": reason }),
    }
}

/// Inside the sandbox the working directory is always here.
pub fn work_dir_inside() -> PathBuf {
    PathBuf::from(SANDBOX_WORK_DIR)
}

pub async fn run(job: Job, settings: SandboxSettings, ctx: ExecContext<'_>) -> ExecOutcome {
    run_capturing(job, settings, ctx, None).await
}

/// [`run`], with the job's standard output kept by the runner in `capture` (see
/// [`crate::process::Capture`]) instead of the log.
pub async fn run_capturing(
    job: Job,
    settings: SandboxSettings,
    mut ctx: ExecContext<'_>,
    capture: Option<&mut crate::process::Capture>,
) -> ExecOutcome {
    // Its own mount point: a job's sandboxes can overlap (a plan rendered while the
    // planning sandbox waits at its gate), and removing one's directory would detach
    // the other's root.
    let name = sandbox_name(&ctx.settings.job_id);
    let new_root = settings.roots_dir.join(&name);
    if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&new_root) {
        return ExecOutcome::failed(format!("creating sandbox root {}: {e}", new_root.display()));
    }
    // As root the job runs as the unprivileged `host_uid`: it must own its directory.
    if nix::unistd::geteuid().is_root()
        && let Err(e) =
            std::os::unix::fs::chown(&ctx.settings.work_dir, Some(settings.host_uid), Some(settings.host_gid))
    {
        return ExecOutcome::failed(format!(
            "handing {} to the job's uid: {e}",
            ctx.settings.work_dir.display()
        ));
    }
    let use_ = if job.network { NetworkUse::UserMode } else { NetworkUse::Offline };
    let _ = ctx.output.write(format!("[sandbox] {}\n", jobnet::describe(use_, &settings.network)).as_bytes());
    if use_ == NetworkUse::UserMode
        && let Err(why) = jobnet::check_available(&settings.network)
    {
        let _ = ctx.output.write(format!("[sandbox] refused: {why}\n").as_bytes());
        return refused(NETWORK_UNAVAILABLE, format!("the job's network boundary cannot be built: {why}"));
    }
    let cgroup = match job_cgroup(&name, &settings, &mut ctx) {
        Ok(cg) => cg,
        Err(refusal) => return refusal,
    };
    let credentials = ctx.settings.credentials.as_ref().and_then(|c| c.endpoint.clone());
    let network = jobnet::spec(use_, &settings.network, credentials.is_some());
    let lease = ctx.settings.lease.clone();
    let lease_pipe = match lease.as_deref().map(|l| l.attach()).transpose() {
        Ok(pipe) => pipe,
        Err(e) => {
            if let Some(cg) = cgroup {
                let _ = tokio::task::spawn_blocking(move || cg.kill_all_and_remove()).await;
            }
            return ExecOutcome::failed(format!("holding the job to its lease (a pipe): {e}"));
        }
    };
    let spec = byoc_sandbox::SandboxSpec {
        argv: job.argv,
        env: job.env,
        work_dir: ctx.settings.work_dir.clone(),
        new_root: new_root.clone(),
        ro_paths: settings.ro_paths.clone(),
        hidden_paths: settings.hidden_paths.clone(),
        network,
        tmp_size_mib: settings.tmp_size_mib,
        nofile: settings.nofile,
        host_uid: settings.host_uid,
        host_gid: settings.host_gid,
        cgroup_procs: cgroup.as_ref().map(|c| c.procs.clone()).unwrap_or_default(),
        cgroup_born_in: cgroup.as_ref().and_then(|c| c.v2_dir()).map(|d| d.to_path_buf()),
        hostname: "byoc-job".into(),
        then: job.then,
        sealed_dir: job.sealed_dir,
        lease: lease
            .as_deref()
            .map(|l| byoc_sandbox::spec::LeaseSpec { grace_ms: l.grace().as_millis() as u64 }),
        binds: job.binds,
        proc: job.proc,
    };
    let spec_bytes = serde_json::to_vec(&spec).expect("sandbox spec serialises");
    let mut cmd = Command::new(&settings.helper);
    cmd.args(&settings.helper_args).env_clear().current_dir("/");
    let services = if use_ == NetworkUse::UserMode {
        match start_services(&mut cmd, job.gate, lease_pipe, &settings, &mut ctx, credentials) {
            Ok(services) => Some(services),
            Err(why) => {
                if let Some(cg) = cgroup {
                    let _ = tokio::task::spawn_blocking(move || cg.kill_all_and_remove()).await;
                }
                let _ = ctx.output.write(format!("[sandbox] refused: {why}\n").as_bytes());
                return refused(NETWORK_UNAVAILABLE, why);
            }
        }
    } else {
        byoc_sandbox::pass_channels(cmd.as_std_mut(), None, job.gate, lease_pipe);
        None
    };
    ctx.settings.sandbox = None;
    let mut outcome = crate::process::run_capturing(cmd, ctx, Some(spec_bytes), capture).await;
    let network_up = services.as_ref().and_then(|s| s.outcome());
    let boundary_lost = services.as_ref().and_then(|s| s.lost());
    drop(services);
    if let Some(why) = boundary_lost {
        outcome.status = JobStatus::Failed;
        outcome.error =
            Some(format!("stopped: the job's network boundary could not follow the host ({why})"));
        outcome.outputs = serde_json::json!({ "reason": NETWORK_UNAVAILABLE });
    }

    if let Some(cg) = &cgroup {
        name_a_limit(&mut outcome, cg, &settings);
    }
    if let Some(cg) = cgroup {
        retire(cg);
    }
    name_a_sandbox_failure(&mut outcome, matches!(network_up, Some(Ok(()))));
    if outcome.exit_code == Some(EXIT_LEASE_EXPIRED) && lease.as_deref().is_some_and(|l| l.expired()) {
        outcome.status = JobStatus::Failed;
        outcome.error = Some(
            "stopped: the job's lease ran out before this runner could renew it (the control plane unreachable, \
             or this runner stopped), so it may run on another runner of the install"
                .into(),
        );
        outcome.outputs = serde_json::json!({ "reason": LEASE_EXPIRED });
    }
    let _ = std::fs::remove_dir(&new_root);
    outcome
}

/// The runner's services inside the job's namespace (DNS, the role's endpoint), served
/// on sockets the sandbox's init makes there and hands over on a channel; the host's
/// addresses followed, the job stopped if its boundary cannot follow them.
fn start_services(
    cmd: &mut Command,
    gate: Option<std::os::fd::OwnedFd>,
    lease: Option<std::os::fd::OwnedFd>,
    settings: &SandboxSettings,
    ctx: &mut ExecContext<'_>,
    credentials: Option<std::sync::Arc<dyn jobnet::CredentialEndpoint>>,
) -> Result<jobnet::Services, String> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    let (ours, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
        .map_err(|e| format!("creating the hand-over channel: {e}"))?;
    let follower = jobnet::HostFollower::open().map_err(|e| e.0)?;
    byoc_sandbox::pass_channels(cmd.as_std_mut(), Some(theirs), gate, lease);
    let stop = ctx.settings.cancel.child_token();
    ctx.settings.cancel = stop.clone();
    Ok(jobnet::Services::start(ours, &settings.network, credentials, follower, stop))
}

/// The job's cgroup with its limits, or none where the customer allows that; a limit
/// that cannot be applied refuses the job unless `sandbox.require_limits` is off.
fn job_cgroup(
    name: &str,
    settings: &SandboxSettings,
    ctx: &mut ExecContext<'_>,
) -> Result<Option<JobCgroup>, ExecOutcome> {
    if !settings.cgroups {
        let _ = ctx
            .output
            .write(b"[sandbox] cgroup limits disabled by configuration (sandbox.cgroups = false)\n");
        return Ok(None);
    }
    match JobCgroup::create(name, settings.limits) {
        Ok(cg) => {
            let line = format!("[sandbox] cgroup {:?} limits: {}\n", cg.version, cg.applied.join(", "));
            let _ = ctx.output.write(line.as_bytes());
            Ok(Some(cg))
        }
        Err(e) if settings.require_limits => {
            let _ = ctx
                .output
                .write(format!("[sandbox] refused: cgroup limits cannot be applied: {e}\n").as_bytes());
            Err(refused(
                LIMITS_UNAVAILABLE,
                format!(
                    "the job's memory/pids/cpu limits cannot be applied ({e}); fix the cgroup delegation \
                     (the packaged unit has Delegate=yes) or set sandbox.require_limits = false"
                ),
            ))
        }
        Err(e) => {
            let _ = ctx.output.write(
                format!("[sandbox] cgroup limits not applied (sandbox.require_limits = false): {e}\n")
                    .as_bytes(),
            );
            Ok(None)
        }
    }
}

/// A failed job that met its memory or process limit says so.
fn name_a_limit(outcome: &mut ExecOutcome, cg: &JobCgroup, settings: &SandboxSettings) {
    if outcome.status == JobStatus::Succeeded {
        return;
    }
    if cg.oom_killed() {
        outcome.status = JobStatus::Failed;
        outcome.error = Some(format!(
            "killed: the job exceeded its memory limit of {} MiB",
            settings.limits.memory_bytes / (1024 * 1024)
        ));
    } else if cg.pids_limited() {
        outcome.error = Some(format!(
            "{}; the job hit its limit of {} processes",
            outcome.error.take().unwrap_or_else(|| "failed".into()),
            settings.limits.pids
        ));
    }
}

/// The sandbox helper's own exit codes: what failed before the job's program ran.
fn name_a_sandbox_failure(outcome: &mut ExecOutcome, network_built: bool) {
    if outcome.status != JobStatus::Failed {
        return;
    }
    match outcome.exit_code {
        Some(EXIT_NETWORK_FAILED) if !network_built => {
            outcome.error = Some(
                "the job's network boundary could not be built, so nothing ran; the job log says why".into(),
            );
            outcome.outputs = serde_json::json!({ "reason": NETWORK_UNAVAILABLE });
        }
        Some(EXIT_SANDBOX_FAILED) => {
            outcome.error = Some("the sandbox could not be built; the job log says why".into())
        }
        Some(EXIT_EXEC_FAILED) if outcome.error.as_deref().is_some_and(|e| e.starts_with("exited")) => {
            outcome.error =
                Some("the job's program could not be executed in the sandbox; the job log says why".into())
        }
        _ => {}
    }
}

/// Each sandbox gets a cgroup and a root directory of its own (a job may run several,
/// one after another while the previous one's cgroup is still being removed, or one
/// beside another; two runners sharing a cgroup may run the same job when one hands it
/// over to the other): `<job id>-<runner pid>-s<n>`.
fn sandbox_name(job_id: &str) -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!("{job_id}-{}-s{}", std::process::id(), SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// Removals of finished sandboxes' cgroups still under way.
static RETIRING: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>> = std::sync::Mutex::new(Vec::new());

/// Whatever is left in a finished sandbox's cgroup is killed now; waiting for it to go
/// and removing the directory happen off the job's path. When init exits, the kernel
/// has already killed and reaped the job's whole pid namespace; what is left is the
/// user-mode network stack, whose exit (tearing down its own namespaces) takes about
/// 20 ms that no job should wait for. [`settle`] waits for these removals.
fn retire(cg: JobCgroup) {
    let _ = cg.kill_all();
    let handle = tokio::task::spawn_blocking(move || cg.kill_all_and_remove());
    let mut pending = RETIRING.lock().unwrap_or_else(|e| e.into_inner());
    pending.retain(|h| !h.is_finished());
    pending.push(handle);
}

/// Wait until every finished sandbox's cgroup is removed (before the process exits).
pub async fn settle() {
    let pending = std::mem::take(&mut *RETIRING.lock().unwrap_or_else(|e| e.into_inner()));
    for handle in pending {
        let _ = handle.await;
    }
}

/// The spec of a sandbox the runner builds to check this host (no cgroup, a tiny /tmp).
fn check_spec(
    settings: &SandboxSettings,
    argv: Vec<String>,
    work: &std::path::Path,
    root: &std::path::Path,
    ro_paths: Vec<std::path::PathBuf>,
    network: byoc_sandbox::spec::NetworkSpec,
) -> byoc_sandbox::SandboxSpec {
    byoc_sandbox::SandboxSpec {
        argv,
        env: vec![],
        work_dir: work.to_path_buf(),
        new_root: root.to_path_buf(),
        ro_paths,
        hidden_paths: settings.hidden_paths.clone(),
        network,
        tmp_size_mib: 1,
        nofile: settings.nofile,
        host_uid: settings.host_uid,
        host_gid: settings.host_gid,
        cgroup_procs: vec![],
        cgroup_born_in: None,
        hostname: "byoc-selftest".into(),
        then: vec![],
        sealed_dir: None,
        lease: None,
        binds: vec![],
        proc: true,
    }
}

/// Prove the network boundary here: run the runner's own probe
/// (`<helper> sandbox-probe`) in a sandbox with the user-mode network, let it try IMDS
/// (IPv4 and IPv6), the ECS/EKS credential addresses and `targets` (services on the
/// host), and return each attempt as (target, refused, detail).
pub async fn probe_boundary(
    settings: &SandboxSettings,
    scratch: &std::path::Path,
    targets: &[std::net::SocketAddr],
) -> Result<Vec<(String, bool, String)>, crate::jobnet::NetworkUnavailable> {
    jobnet::check_available(&settings.network)?;
    let work = scratch.join("boundary-work");
    let root = scratch.join("boundary-root");
    for d in [&work, &root] {
        std::fs::create_dir_all(d).map_err(|e| format!("creating {}: {e}", d.display()))?;
    }
    // The probe is the runner's own binary, placed where the sandbox binds it whatever
    // its install path (a build tree under /work would be hidden by the job's /work).
    let probe = scratch.join("boundary-probe");
    let _ = std::fs::remove_file(&probe);
    if std::fs::hard_link(&settings.helper, &probe).is_err() {
        std::fs::copy(&settings.helper, &probe).map_err(|e| format!("placing the probe: {e}"))?;
    }
    let mut argv = vec![
        probe.display().to_string(),
        "sandbox-probe".into(),
        "--runner-pid".into(),
        std::process::id().to_string(),
        "--state-dir".into(),
        scratch.display().to_string(),
    ];
    for t in targets {
        argv.extend(["--unreachable".into(), t.to_string()]);
    }
    let mut ro_paths = settings.ro_paths.clone();
    ro_paths.push(probe.clone());
    let network = jobnet::spec(NetworkUse::UserMode, &settings.network, false);
    let spec = check_spec(settings, argv, &work, &root, ro_paths, network);
    let mut cmd = Command::new(&settings.helper);
    cmd.args(&settings.helper_args)
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    let (ours, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
        .map_err(|e| format!("creating the hand-over channel: {e}"))?;
    byoc_sandbox::pass_channels(cmd.as_std_mut(), Some(theirs), None, None);
    let follower = jobnet::HostFollower::open()?;
    let services = jobnet::Services::start(
        ours,
        &settings.network,
        None,
        follower,
        tokio_util::sync::CancellationToken::new(),
    );
    let mut child = cmd.spawn().map_err(|e| format!("starting {}: {e}", settings.helper.display()))?;
    drop(cmd);
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt as _;
        let _ = stdin.write_all(&serde_json::to_vec(&spec).expect("spec serialises")).await;
    }
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), child.wait_with_output())
        .await
        .map_err(|_| "the boundary probe did not finish within 60 s".to_string())?
        .map_err(|e| format!("waiting for the sandbox helper: {e}"))?;
    drop(services);
    let _ = std::fs::remove_dir_all(&work);
    let _ = std::fs::remove_dir(&root);
    let _ = std::fs::remove_file(&probe);
    if !out.status.success() {
        return Err(crate::jobnet::NetworkUnavailable::from(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("the probe's report: {e}: {}", String::from_utf8_lossy(&out.stdout)))?;
    Ok(report["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let target = c["name"].as_str()?.strip_prefix("unreachable:")?;
            Some((target.to_string(), c["held"] == true, c["detail"].as_str().unwrap_or("").to_string()))
        })
        .collect())
}

/// Why the sandbox self-test failed.
#[derive(Debug, thiserror::Error)]
pub enum SelfTestError {
    #[error("creating {path}: {source}")]
    Scratch { path: std::path::PathBuf, source: std::io::Error },
    #[error("running the sandbox helper {helper}: {source}")]
    Helper { helper: std::path::PathBuf, source: std::io::Error },
    /// The helper could not build the sandbox; what it printed.
    #[error("{0}")]
    Failed(String),
}

/// Build one sandbox around `/bin/true` (no cgroup) to prove this host can: run at
/// daemon start so a host without user namespaces fails loudly once, not every job.
pub async fn self_test(settings: &SandboxSettings, scratch: &std::path::Path) -> Result<(), SelfTestError> {
    let work = scratch.join("selftest-work");
    let root = scratch.join("selftest-root");
    for d in [&work, &root] {
        std::fs::create_dir_all(d)
            .map_err(|source| SelfTestError::Scratch { path: d.to_path_buf(), source })?;
    }
    let helper_err = |source| SelfTestError::Helper { helper: settings.helper.clone(), source };
    let spec = check_spec(
        settings,
        vec!["/bin/true".into()],
        &work,
        &root,
        settings.ro_paths.clone(),
        byoc_sandbox::spec::NetworkSpec::Off,
    );
    let mut child = Command::new(&settings.helper)
        .args(&settings.helper_args)
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(helper_err)?;
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt as _;
        let _ = stdin.write_all(&serde_json::to_vec(&spec).expect("spec serialises")).await;
    }
    let out = child.wait_with_output().await.map_err(helper_err)?;
    let _ = std::fs::remove_dir(&work);
    let _ = std::fs::remove_dir(&root);
    if out.status.success() {
        Ok(())
    } else {
        Err(SelfTestError::Failed(String::from_utf8_lossy(&out.stderr).trim().to_string()))
    }
}
