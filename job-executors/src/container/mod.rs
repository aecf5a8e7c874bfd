//! `action.container`: run an image through the Docker Engine API, locked down.
//!
//! ```json
//! {"image": "registry.example/tools/migrate@sha256:…", "command": ["migrate", "up"],
//!  "env": {"NAME": "value"}, "secret_env": {"TOKEN": "…"}, "network": true}
//! ```
//!
//! The container is never privileged: all capabilities dropped, read-only root
//! filesystem, `no-new-privileges`, memory (no swap) and pids limits, an unprivileged
//! user, the job's working directory at `/work` and a private `/tmp`; network per the
//! spec.
//!
//! A networked container gets the same boundary as a sandboxed process: a Docker
//! network of its own (no other container on it; names resolved by the engine's
//! embedded DNS), and a network namespace whose `prohibit` rules refuse the link-local
//! range (IMDS, the ECS/EKS credential addresses), IMDS over IPv6, the host's
//! addresses and the network's gateway, plus the customer's egress settings. Docker
//! cannot join a namespace we built, so a holder container (a static busybox
//! sleeping, no capabilities) owns the namespace, a short-lived configurator joins it
//! with only CAP_NET_ADMIN to set the rules and exits, and then the job joins it with
//! no capabilities at all: it cannot change them. The daemon makes the next job's
//! namespace while none waits (`network::for_job`); it is brought up to date at the
//! job's start and serves that job alone. Output goes into a FIFO the runner reads
//! (`relay`: the engine keeps no log of it and its attach stream is a third as fast)
//! through the same masking and log cap as scripts; a broken stream fails the job
//! (`container_output_broken`). Timeout and cancellation
//! send SIGINT, then stop (SIGTERM, then SIGKILL) after the grace; the container is
//! removed whatever happens. Images must already be in the local engine: the runner
//! never pulls (artifact sync puts them in the install's registry).

use std::collections::{BTreeMap, HashMap};

use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, KillContainerOptionsBuilder, LogsOptionsBuilder,
    RemoveContainerOptionsBuilder, StopContainerOptionsBuilder,
};
use futures_util::StreamExt as _;
use serde::Deserialize;

use crate::{ContainerSettings, ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};

mod network;
mod relay;
pub use network::{check_network, describe_network, prepared_settled, release_prepared};

/// Whether a container's output can be relayed to the runner: a static busybox.
pub fn check_output(settings: &ContainerSettings) -> Result<(), String> {
    if is_static_elf(&settings.busybox) {
        Ok(())
    } else {
        Err(format!(
            "{} is missing or not statically linked: a container's output is relayed by it, so nothing ran \
             (apt-get install busybox-static, or set roles.busybox)",
            settings.busybox.display()
        ))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Container {
    pub image: String,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub secret_env: BTreeMap<String, String>,
    #[serde(default = "crate::default_true")]
    pub network: bool,
}

impl Container {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        let c: Container = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        if c.image.is_empty() || c.image.len() > 512 || c.image.chars().any(|ch| ch.is_whitespace()) {
            return Err(crate::InvalidSpec::from(format!("image {:?} is not a valid reference", c.image)));
        }
        crate::validate_env(&c.env, &c.secret_env)?;
        Ok(c)
    }
}

impl Executor for Container {
    fn effect(&self) -> byoc_protocol::Effect {
        byoc_protocol::Effect::Run
    }

    fn placement(&self) -> crate::Placement {
        crate::Placement::Container { network: self.network }
    }

    fn run<'a>(&'a self, ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move {
            let Some(settings) = ctx.settings.containers.clone() else {
                return ExecOutcome::failed(
                    "container actions are not enabled on this runner ([containers] in the config)",
                );
            };
            let work_dir = ctx.settings.work_dir.clone();
            let mut outcome = run_container(self, &settings, ctx).await;
            match crate::outputs::read(&work_dir, &crate::mask::Masker::none()) {
                Ok(mut o) => {
                    // A refusal's reason code stays; the container cannot have written any.
                    if let (Some(reason), Some(map)) = (outcome.outputs.get("reason"), o.as_object_mut()) {
                        map.insert("reason".into(), reason.clone());
                    }
                    outcome.outputs = o
                }
                Err(e) => {
                    if outcome.status == JobStatus::Succeeded || outcome.outputs.is_null() {
                        outcome.outputs = serde_json::json!({"reason": e.code()});
                    }
                    outcome.error = Some(e.to_string());
                    outcome.status = JobStatus::Failed;
                }
            }
            outcome
        })
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        self.secret_env.values().map(|v| v.as_bytes().to_vec()).collect()
    }
}

fn docker_error(what: &str, e: bollard::errors::Error) -> String {
    format!("docker {what}: {e}")
}

async fn run_container(
    spec: &Container,
    settings: &ContainerSettings,
    mut ctx: ExecContext<'_>,
) -> ExecOutcome {
    let (docker, image) = match connect(settings, &spec.image).await {
        Ok(d) => d,
        Err(e) => return ExecOutcome::failed(e),
    };
    let argv = match relay::argv(spec.entrypoint.as_deref(), &spec.command, image.as_ref()) {
        Ok(argv) => argv,
        Err(e) => return ExecOutcome::failed(format!("image {}: {e}", spec.image)),
    };
    if nix::unistd::geteuid().is_root()
        && let Err(e) =
            std::os::unix::fs::chown(&ctx.settings.work_dir, Some(settings.uid), Some(settings.gid))
    {
        return ExecOutcome::failed(format!(
            "handing {} to the container's uid: {e}",
            ctx.settings.work_dir.display()
        ));
    }
    let (env, mut binds) = env_and_binds(spec, &ctx.settings);
    let output = match output_relay(settings, &ctx.settings.work_dir) {
        Ok(r) => r,
        Err(e) => {
            let _ = ctx.output.write(format!("[sandbox] refused: {e}\n").as_bytes());
            return crate::sandboxed::refused(OUTPUT_UNAVAILABLE, e);
        }
    };
    binds.extend(output.binds(&settings.busybox));
    let net = if spec.network {
        match job_network(&docker, settings, &mut ctx).await {
            Ok(n) => Some(n),
            Err(refused) => return refused,
        }
    } else {
        let _ = ctx.output.write(b"[sandbox] network: none (container without a network)\n");
        None
    };
    let network_mode = match &net {
        Some((n, _)) => format!("container:{}", n.holder),
        None => "none".into(),
    };
    let image_env = image.as_ref().and_then(|c| c.env.clone()).unwrap_or_default();
    let launch = relay::wrapped(argv, &image_env, &env);
    let body = create_body(spec, settings, &ctx.settings.job_id, launch, env, binds, network_mode);
    let name = format!("byoc-job-{}", ctx.settings.job_id);
    // A container left by an earlier, interrupted attempt of this job goes first.
    let _ =
        docker.remove_container(&name, Some(RemoveContainerOptionsBuilder::new().force(true).build())).await;
    let id = match docker
        .create_container(Some(CreateContainerOptionsBuilder::new().name(&name).build()), body)
        .await
    {
        Ok(r) => r.id,
        Err(e) => {
            if let Some((n, _)) = net {
                n.remove(&docker).await;
            }
            return ExecOutcome::failed(docker_error("creating the container", e));
        }
    };
    let (outcome, net) = match net {
        Some((mut n, follower)) => {
            (supervise_following(&docker, &id, settings, ctx, output, &mut n, follower).await, Some(n))
        }
        None => (supervise(&docker, &id, settings, ctx, output).await, None),
    };
    if let Err(e) = docker
        .remove_container(&id, Some(RemoveContainerOptionsBuilder::new().force(true).v(true).build()))
        .await
    {
        tracing::warn!(container = %id, error = %e, "Could not remove the job's container: {e}.");
    }
    if let Some(n) = net {
        n.remove(&docker).await;
    }
    outcome
}

/// The job's network: its own, with the blocked ranges refused before it starts. The
/// host's addresses are followed from before it is built, so that nothing that
/// appears meanwhile is missed. A boundary that cannot be built refuses the job.
async fn job_network(
    docker: &Docker,
    settings: &ContainerSettings,
    ctx: &mut ExecContext<'_>,
) -> Result<(network::JobNetwork, crate::jobnet::HostFollower), ExecOutcome> {
    let follower = match crate::jobnet::HostFollower::open() {
        Ok(f) => f,
        Err(e) => {
            let _ = ctx.output.write(format!("[sandbox] refused: {e}\n").as_bytes());
            return Err(crate::sandboxed::refused(crate::sandboxed::NETWORK_UNAVAILABLE, e.0));
        }
    };
    match network::for_job(docker, settings, &ctx.settings.job_id).await {
        Ok((n, ahead)) => {
            let made = if ahead { " (made ahead of the job, brought up to date at its start)" } else { "" };
            let _ = ctx.output.write(format!("[sandbox] {}{made}\n", describe_network(settings)).as_bytes());
            Ok((n, follower))
        }
        Err(e) => {
            let _ = ctx.output.write(format!("[sandbox] refused: {e}\n").as_bytes());
            Err(crate::sandboxed::refused(
                crate::sandboxed::NETWORK_UNAVAILABLE,
                format!("the container's network boundary could not be built, so nothing ran: {e}"),
            ))
        }
    }
}

/// A networked container runs while the host is followed: every address or subnet
/// that appears is closed to it, and a boundary that cannot follow stops the job.
async fn supervise_following(
    docker: &Docker,
    id: &str,
    settings: &ContainerSettings,
    mut ctx: ExecContext<'_>,
    output: relay::Relay,
    net: &mut network::JobNetwork,
    mut follower: crate::jobnet::HostFollower,
) -> ExecOutcome {
    let stop = ctx.settings.cancel.child_token();
    ctx.settings.cancel = stop.clone();
    // A close in progress is never dropped half-way: a configurator whose creation is
    // still in flight would outlive the job's clean-up.
    let followed = tokio_util::sync::CancellationToken::new();
    let follow = async {
        loop {
            let ranges = tokio::select! {
                r = follower.next_ranges() => r,
                () = followed.cancelled() => return None,
            };
            let closed = match ranges {
                Ok(ranges) => net.close(docker, settings, ranges).await.map_err(|e| e.0),
                Err(e) => Err(e),
            };
            if let Err(why) = closed {
                return Some(why);
            }
        }
    };
    let run = supervise(docker, id, settings, ctx, output);
    tokio::pin!(follow, run);
    tokio::select! {
        outcome = &mut run => {
            followed.cancel();
            let _ = follow.await;
            outcome
        }
        why = &mut follow => {
            let why = why.unwrap_or_default();
            tracing::error!(error = %why, "The container's network boundary could not follow the host; stopping it: {why}.");
            stop.cancel();
            let _ = run.await;
            crate::sandboxed::refused(
                crate::sandboxed::NETWORK_UNAVAILABLE,
                format!("stopped: the container's network boundary could not follow the host ({why})"),
            )
        }
    }
}

/// The Docker Engine, with an API version both speak, and the job's image in it (the
/// runner never pulls), with the image's configuration.
async fn connect(
    settings: &ContainerSettings,
    image: &str,
) -> Result<(Docker, Option<bollard::models::ImageConfig>), String> {
    let socket = settings.docker_socket.display().to_string();
    let docker = match Docker::connect_with_unix(&socket, 120, bollard::API_DEFAULT_VERSION) {
        Ok(d) => d,
        Err(e) => return Err(format!("connecting to the Docker Engine at {socket}: {e}")),
    };
    // Engines speak older API versions than the client's default: agree on one.
    let docker = match docker.negotiate_version().await {
        Ok(d) => d,
        Err(e) => return Err(format!("connecting to the Docker Engine at {socket}: {e}")),
    };
    match docker.inspect_image(image).await {
        Ok(inspected) => Ok((docker, inspected.config)),
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => Err(format!(
            "image {image} is not in the local engine; the runner never pulls images (sync it into the install's registry first)"
        )),
        Err(e) => Err(docker_error("inspecting the image", e)),
    }
}

/// Reason code of a container job refused because its output could not be relayed.
pub const OUTPUT_UNAVAILABLE: &str = "container_output_unavailable";

/// The FIFO the job's output comes through, beside its working directory.
fn output_relay(settings: &ContainerSettings, work_dir: &std::path::Path) -> Result<relay::Relay, String> {
    check_output(settings)?;
    let parent = work_dir.parent().unwrap_or(work_dir);
    relay::Relay::open(parent, settings.uid, settings.gid)
        .map_err(|e| format!("making the pipe for the container's output under {}: {e}", parent.display()))
}

/// The container's environment (the job's, the role's winning over same-named job
/// variables) and its mounts: the job's directory, and with a role the renewed
/// credentials file and the busybox that reads it.
fn env_and_binds(spec: &Container, job: &crate::ExecSettings) -> (Vec<String>, Vec<String>) {
    let mut env = vec![
        format!("BYOC_JOB_ID={}", job.job_id),
        "HOME=/work".to_string(),
        format!("{}=/work/{}", crate::outputs::OUTPUT_ENV, crate::outputs::OUTPUT_FILE),
    ];
    env.extend(spec.env.iter().chain(&spec.secret_env).map(|(k, v)| format!("{k}={v}")));
    // A container cannot reach the host's loopback credential endpoint: it gets an AWS
    // config whose credential_process reads a file the runner renews (or, failing
    // that, the session as of its start). The role's values win over same-named job
    // variables, and no static key is left to shadow the config.
    let mut binds = vec![format!("{}:/work:rw", job.work_dir.display())];
    if let Some(creds) = &job.credentials {
        let role_env = match &creds.container {
            Some(c) => {
                binds.push(format!("{}:{}:ro", c.host_dir.display(), c.mount));
                binds.push(format!("{}:{}:ro", c.busybox.display(), c.busybox_mount));
                &c.env
            }
            None => &creds.static_env,
        };
        env.retain(|kv| {
            kv.split_once('=').is_none_or(|(n, _)| {
                !role_env.iter().any(|(k, _)| k == n) && !creds.static_env.iter().any(|(k, _)| k == n)
            })
        });
        env.extend(role_env.iter().map(|(k, v)| format!("{k}={v}")));
    }
    (env, binds)
}

/// The container as it is created, its first command the output relay's: never
/// privileged, no capabilities, read-only root, the sandbox's system-call policy,
/// limits, an unprivileged user, no engine log.
fn create_body(
    spec: &Container,
    settings: &ContainerSettings,
    job_id: &str,
    (entrypoint, cmd): (Vec<String>, Vec<String>),
    env: Vec<String>,
    binds: Vec<String>,
    network_mode: String,
) -> ContainerCreateBody {
    let host_config = HostConfig {
        privileged: Some(false),
        cap_drop: Some(vec!["ALL".into()]),
        readonly_rootfs: Some(true),
        // The same system-call policy as the process sandbox.
        security_opt: Some(vec![
            "no-new-privileges".into(),
            format!("seccomp={}", byoc_sandbox::seccomp::docker_profile()),
        ]),
        memory: Some(settings.memory_bytes as i64),
        memory_swap: Some(settings.memory_bytes as i64),
        pids_limit: Some(settings.pids as i64),
        network_mode: Some(network_mode),
        // The runner keeps the log (masked, capped, spooled): no unmasked copy in the
        // engine's log files.
        log_config: Some(bollard::models::HostConfigLogConfig { typ: Some("none".into()), config: None }),
        binds: Some(binds),
        tmpfs: Some(HashMap::from([("/tmp".to_string(), "rw,nosuid,nodev,mode=1777,size=256m".to_string())])),
        ..Default::default()
    };
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        cmd: Some(cmd),
        entrypoint: Some(entrypoint),
        env: Some(env),
        working_dir: Some("/work".into()),
        user: Some(format!("{}:{}", settings.uid, settings.gid)),
        network_disabled: Some(!spec.network),
        labels: Some(labels(job_id, &settings.owner)),
        host_config: Some(host_config),
        ..Default::default()
    }
}

/// Whether `path` is an x86-64/aarch64 ELF executable without an interpreter (a static
/// binary runs in any image; a dynamic one needs the image to have its libc).
pub fn is_static_elf(path: &std::path::Path) -> bool {
    let Ok(bytes) = std::fs::read(path) else { return false };
    // 64-bit little-endian ELF only: e_phoff at 0x20, e_phentsize at 0x36, e_phnum at 0x38.
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(bytes[0x20..0x28].try_into().unwrap_or([0; 8])) as usize;
    let (entsize, count) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    (0..count).all(|i| {
        let at = phoff.saturating_add(i.saturating_mul(entsize));
        at.checked_add(4)
            .and_then(|end| bytes.get(at..end))
            .is_some_and(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]) != PT_INTERP)
    }) && count > 0
}

/// Remove every container and network labelled as one of this runner's jobs: at its
/// start no job runs, so they are what it left of interrupted jobs when it was killed.
/// Best effort.
pub async fn remove_leftovers(settings: &ContainerSettings) {
    use bollard::query_parameters::{ListContainersOptionsBuilder, ListNetworksOptionsBuilder};
    let socket = settings.docker_socket.display().to_string();
    let Ok(docker) = Docker::connect_with_unix(&socket, 30, bollard::API_DEFAULT_VERSION) else { return };
    let Ok(docker) = docker.negotiate_version().await else { return };
    let filters =
        HashMap::from([("label".to_string(), vec![format!("byoc-runner.runner={}", settings.owner)])]);
    let containers = docker
        .list_containers(Some(ListContainersOptionsBuilder::new().all(true).filters(&filters).build()))
        .await
        .unwrap_or_default();
    for c in containers.iter().filter_map(|c| c.id.as_deref()) {
        tracing::warn!(container = %c, "Removing a container left by an interrupted job.");
        let _ =
            docker.remove_container(c, Some(RemoveContainerOptionsBuilder::new().force(true).build())).await;
    }
    let networks = docker
        .list_networks(Some(ListNetworksOptionsBuilder::new().filters(&filters).build()))
        .await
        .unwrap_or_default();
    for n in networks.iter().filter_map(|n| n.name.as_deref()) {
        tracing::warn!(network = %n, "Removing a network left by an interrupted job.");
        let _ = docker.remove_network(n).await;
    }
}

/// Remove the output pipes' directories under `work_root` (each job's FIFO lives beside
/// its working directory): at the runner's start no job runs, so they are what killed
/// jobs left.
pub fn remove_output_pipes(work_root: &std::path::Path) {
    relay::remove_left(work_root);
}

/// Every container and network of a job carries its id and its runner's.
fn labels(job_id: &str, owner: &str) -> HashMap<String, String> {
    HashMap::from([
        ("byoc-runner.job".to_string(), job_id.to_string()),
        ("byoc-runner.runner".to_string(), owner.to_string()),
    ])
}

#[derive(PartialEq)]
enum Ending {
    Exited,
    TimedOut,
    Cancelled,
}

/// Reason code of a container job whose output stream broke.
pub const OUTPUT_BROKEN: &str = "container_output_broken";

/// A test fault: the output stream breaks after this many bytes (the suites' stand-in
/// for an engine that drops the connection).
const BREAK_OUTPUT_FAULT_ENV: &str = "BYOC_RUNNER_TEST_FAULT_BREAK_CONTAINER_OUTPUT_AFTER";

/// Start the container and follow it to its end: its output, its deadline, its exit.
async fn supervise(
    docker: &Docker,
    id: &str,
    settings: &ContainerSettings,
    mut ctx: ExecContext<'_>,
    output: relay::Relay,
) -> ExecOutcome {
    if let Err(e) = network::start_container(docker, id, "the job's container").await {
        return ExecOutcome::failed(docker_error("starting the container", e));
    }
    let deadline = tokio::time::sleep(ctx.settings.timeout);
    tokio::pin!(deadline);
    let mut read = read_until_stopped(docker, id, &mut ctx, output, deadline.as_mut()).await;
    if let Some(why) = read.stream_error {
        return ExecOutcome {
            status: JobStatus::Failed,
            exit_code: None,
            error: Some(format!(
                "the container's output stream broke ({why}); the job was stopped so it does not run \
                 unrecorded, and its log is incomplete"
            )),
            outputs: serde_json::json!({ "reason": OUTPUT_BROKEN }),
        };
    }
    // The exit code is the engine's once the container has stopped; a container that
    // closed its output and runs on is still held to its deadline.
    let mut exited = docker.wait_container(id, None);
    loop {
        tokio::select! {
            _ = exited.next() => break,
            _ = &mut deadline, if !read.escalated => {
                read.ending = Ending::TimedOut;
                read.escalated = true;
                stop(docker, id, ctx.settings.kill_grace).await;
            }
            _ = ctx.settings.cancel.cancelled(), if !read.escalated => {
                read.ending = Ending::Cancelled;
                read.escalated = true;
                stop(docker, id, ctx.settings.kill_grace).await;
            }
        }
    }
    match exit_state(docker, id, read.ending == Ending::Exited).await {
        Ok(state) => outcome(read, &state, &ctx.settings, settings),
        Err(e) => ExecOutcome::failed(docker_error("inspecting the finished container", e)),
    }
}

/// How the reading of a container's output ended.
struct Reading {
    ending: Ending,
    /// The container was told to stop (timeout, cancel, an unwritable log).
    escalated: bool,
    sink_error: Option<String>,
    stream_error: Option<String>,
}

/// Read the container's output into the job's log until the container has stopped
/// and every byte it wrote is read; stop it on timeout, cancellation or a log that
/// cannot be written. A container whose stream broke is stopped before this returns.
async fn read_until_stopped(
    docker: &Docker,
    id: &str,
    ctx: &mut ExecContext<'_>,
    output: relay::Relay,
    mut deadline: std::pin::Pin<&mut tokio::time::Sleep>,
) -> Reading {
    let relay::Relay { dir: _fifo_dir, mut reader, mut holder } = output;
    // Asked after the start: a container that has already stopped answers at once.
    let mut stopped = docker.wait_container(id, None);
    let mut buf = vec![0u8; relay::READ_CHUNK];
    let break_after: Option<u64> = std::env::var(BREAK_OUTPUT_FAULT_ENV).ok().and_then(|v| v.parse().ok());
    let mut delivered = 0u64;
    let grace = ctx.settings.kill_grace;
    let mut r = Reading { ending: Ending::Exited, escalated: false, sink_error: None, stream_error: None };
    // Stopping runs beside the reading: a container blocked on a full pipe must have
    // its output drained to stop.
    let mut stopping: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>> = None;
    loop {
        tokio::select! {
            read = tokio::io::AsyncReadExt::read(&mut reader, &mut buf) => match read {
                // Every writer closed, the runner's own last: all that was written is read.
                Ok(0) => break,
                Ok(n) => {
                    delivered += n as u64;
                    if break_after.is_some_and(|n| delivered > n) {
                        r.stream_error = Some("the stream was cut (test fault)".to_string());
                        break;
                    }
                    if r.sink_error.is_none()
                        && let Err(e) = ctx.output.write(&buf[..n])
                    {
                        r.sink_error = Some(e.to_string());
                        // As for processes: a job does not run on unrecorded.
                        if !r.escalated {
                            r.escalated = true;
                            stopping = Some(Box::pin(stop(docker, id, grace)));
                        }
                    }
                }
                Err(e) => {
                    r.stream_error = Some(e.to_string());
                    break;
                }
            },
            // The container stopped: what it wrote is in the pipe, and no more can come.
            _ = stopped.next(), if holder.is_some() => holder = None,
            () = async { if let Some(s) = stopping.as_mut() { s.await } }, if stopping.is_some() => {
                stopping = None;
            }
            _ = &mut deadline, if !r.escalated => {
                r.ending = Ending::TimedOut;
                r.escalated = true;
                stopping = Some(Box::pin(stop(docker, id, grace)));
            }
            _ = ctx.settings.cancel.cancelled(), if !r.escalated => {
                r.ending = Ending::Cancelled;
                r.escalated = true;
                stopping = Some(Box::pin(stop(docker, id, grace)));
            }
        }
    }
    // No more output is read: a container whose stream broke must not run on
    // unrecorded.
    drop(reader);
    drop(holder);
    if let Some(s) = stopping.take() {
        s.await;
    } else if r.stream_error.is_some() && !r.escalated {
        r.escalated = true;
        stop(docker, id, grace).await;
    }
    r
}

/// The job's outcome from how it ended and the engine's view of the container.
fn outcome(
    read: Reading,
    state: &bollard::models::ContainerState,
    job: &crate::ExecSettings,
    settings: &ContainerSettings,
) -> ExecOutcome {
    let exit_code = state.exit_code.map(|c| c as i32);
    let (status, error) = match read.ending {
        Ending::TimedOut => {
            (JobStatus::TimedOut, Some(format!("job exceeded its timeout of {}s", job.timeout.as_secs())))
        }
        Ending::Cancelled => (JobStatus::Cancelled, Some("job was cancelled".into())),
        Ending::Exited if state.oom_killed == Some(true) => (
            JobStatus::Failed,
            Some(format!(
                "killed: the container exceeded its memory limit of {} MiB",
                settings.memory_bytes / (1024 * 1024)
            )),
        ),
        Ending::Exited => match exit_code {
            Some(0) => (JobStatus::Succeeded, None),
            Some(c) => (JobStatus::Failed, Some(format!("exited with code {c}"))),
            None => (JobStatus::Failed, Some("the container ended without an exit code".into())),
        },
    };
    let (status, error) = match read.sink_error {
        Some(e) if matches!(read.ending, Ending::Exited) => (
            JobStatus::Failed,
            Some(format!(
                "the job's log could not be written ({e}); the job was stopped so it does not run on unrecorded"
            )),
        ),
        _ => (status, error),
    };
    ExecOutcome { status, exit_code, error, outputs: serde_json::json!({}) }
}

/// How a finished container ended, as the engine has it. The engine marks an OOM kill
/// from an event of its own that may land just after the exit it caused; a container
/// that died of SIGKILL on its own (`own_end`, exit code 137) is looked at again for
/// up to a second, so that its memory limit is named rather than a bare exit code.
async fn exit_state(
    docker: &Docker,
    id: &str,
    own_end: bool,
) -> Result<bollard::models::ContainerState, bollard::errors::Error> {
    let look = || async {
        Ok::<_, bollard::errors::Error>(docker.inspect_container(id, None).await?.state.unwrap_or_default())
    };
    let mut state = look().await?;
    let sigkilled =
        |s: &bollard::models::ContainerState| s.exit_code == Some(137) && s.oom_killed != Some(true);
    let mut tries = 0;
    while own_end && sigkilled(&state) && tries < 10 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        state = look().await?;
        tries += 1;
    }
    Ok(state)
}

/// SIGINT first (tools release locks), then Docker's stop: SIGTERM, SIGKILL after the grace.
async fn stop(docker: &Docker, id: &str, grace: std::time::Duration) {
    let _ =
        docker.kill_container(id, Some(KillContainerOptionsBuilder::new().signal("SIGINT").build())).await;
    let exited = async {
        let mut wait = docker.wait_container(id, None).boxed();
        let _ = wait.next().await;
    };
    if tokio::time::timeout(grace, exited).await.is_err() {
        let t = grace.as_secs().max(1) as i32;
        let _ = docker.stop_container(id, Some(StopContainerOptionsBuilder::new().t(t).build())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_specs() {
        for spec in [
            serde_json::json!({}),
            serde_json::json!({"image": ""}),
            serde_json::json!({"image": "has space"}),
            serde_json::json!({"image": "x", "env": {"1BAD": "v"}}),
            serde_json::json!({"image": "x", "secret_env": {"T": "abc"}}),
            serde_json::json!({"image": "x", "privileged": true}),
        ] {
            assert!(Container::from_spec(&spec).is_err(), "{spec} accepted");
        }
        let ok =
            Container::from_spec(&serde_json::json!({"image": "x@sha256:00", "secret_env": {"T": "abcd"}}))
                .unwrap();
        assert!(ok.network);
        assert_eq!(ok.secrets(), vec![b"abcd".to_vec()]);
    }
}
