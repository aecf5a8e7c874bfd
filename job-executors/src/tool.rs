//! What the tool executors (terraform, helm, kubernetes) share: running one step of a
//! tool in the job's sandbox with the job's remaining time, handing files to the
//! sandbox's uid, the failure outcome with its reason code, path and manifest checks.

use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize as _;
use tokio::process::Command;

use crate::{ExecContext, ExecOutcome, JobStatus};

/// PATH of a tool step: the tool is named by absolute path; this is for what it runs.
pub(crate) const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// A relative path that stays inside the directory it is unpacked in.
pub(crate) fn safe_relative(p: &str) -> bool {
    let path = Path::new(p);
    !p.is_empty()
        && p.len() <= 512
        && !p.contains('\0')
        && path.components().all(|c| matches!(c, Component::Normal(_)))
}

/// As root the sandboxed tool runs as the unprivileged `host_uid`: it must own what it
/// writes to (the module directory, the plan file).
pub(crate) fn hand_over(ctx: &ExecContext<'_>, path: &Path) -> std::io::Result<()> {
    let Some(s) = &ctx.settings.sandbox else { return Ok(()) };
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    // Never through a link (an artifact may carry links inside its tree; a loop of
    // them must not send this round in circles).
    std::os::unix::fs::lchown(path, Some(s.host_uid), Some(s.host_gid))?;
    if std::fs::symlink_metadata(path)?.is_dir() {
        for entry in std::fs::read_dir(path)? {
            hand_over(ctx, &entry?.path())?;
        }
    }
    Ok(())
}

/// A step failed: the outcome to return (and what it says, already in the log).
pub(crate) type Step<T> = Result<T, ExecOutcome>;

pub(crate) struct Run<'c, 'a> {
    /// The tool's name in log lines and errors.
    pub(crate) tool: &'static str,
    pub(crate) ctx: &'c mut ExecContext<'a>,
    pub(crate) started: Instant,
    pub(crate) env: Vec<(String, String)>,
    /// Output that names a condition the runner reports by its own reason code
    /// (terraform's "Error acquiring the state lock"), and whether a step printed it.
    pub(crate) watch: Option<&'static str>,
    pub(crate) seen: bool,
    /// The runner's directories every step of the tool sees (see
    /// [`byoc_sandbox::spec::Bind`]).
    pub(crate) binds: Vec<byoc_sandbox::spec::Bind>,
}

/// Passes output through, noting whether `needle` went by (across chunk boundaries).
struct Watch<'s> {
    inner: &'s mut dyn crate::OutputSink,
    needle: &'static [u8],
    tail: Vec<u8>,
    seen: bool,
}

impl crate::OutputSink for Watch<'_> {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        if !self.seen && !self.needle.is_empty() {
            self.tail.extend_from_slice(chunk);
            self.seen = self.tail.windows(self.needle.len()).any(|w| w == self.needle);
            let keep = self.needle.len().saturating_sub(1);
            if self.tail.len() > keep {
                self.tail.drain(..self.tail.len() - keep);
            }
        }
        self.inner.write(chunk)
    }
}

impl Run<'_, '_> {
    pub(crate) fn log(&mut self, line: &str) {
        let _ = self.ctx.output.write(line.as_bytes());
    }

    pub(crate) fn remaining(&self) -> Duration {
        self.ctx.settings.timeout.saturating_sub(self.started.elapsed())
    }

    /// Run one command (sandboxed when the sandbox is on) with the job's output.
    pub(crate) async fn cmd(&mut self, what: &str, argv: Vec<String>) -> Step<()> {
        self.staged(what, argv, Vec::new(), None).await
    }

    /// Run `argv`, then each of `then` after the one before succeeded, in one sandbox
    /// (one set-up instead of several). Before a stage, the files it names (relative to
    /// the working directory) are sealed: copied into `sealed`, which the job can read
    /// (at [`SealedDir::inside`]) and never change. Without the sandbox each command is
    /// a process of its own and the runner makes the copies.
    pub(crate) async fn staged(
        &mut self,
        what: &str,
        argv: Vec<String>,
        then: Vec<Stage>,
        sealed: Option<&SealedDir>,
    ) -> Step<()> {
        self.step(what, argv, then, sealed, None).await
    }

    /// Run one command whose standard output the runner keeps (at most `max` bytes,
    /// never the job log): what a tool reports for the runner to judge.
    pub(crate) async fn captured(&mut self, what: &str, argv: Vec<String>, max: u64) -> Step<Vec<u8>> {
        let mut capture = crate::process::Capture::new(usize::try_from(max).unwrap_or(usize::MAX));
        let result = self.step(what, argv, vec![], None, Some(&mut capture)).await;
        if capture.overflowed {
            return Err(failed(
                "output_too_large",
                format!("{} {what}: printed more than {max} bytes for the runner", self.tool),
                serde_json::Value::Null,
            ));
        }
        result.map(|()| capture.bytes)
    }

    /// One step with the job's remaining time, its environment and log.
    async fn step(
        &mut self,
        what: &str,
        argv: Vec<String>,
        then: Vec<Stage>,
        sealed: Option<&SealedDir>,
        capture: Option<&mut crate::process::Capture>,
    ) -> Step<()> {
        let step = StepSpec {
            tool: self.tool,
            what,
            env: &self.env,
            watch: self.watch,
            job_timeout: self.ctx.settings.timeout,
            binds: &self.binds,
        };
        let base = self.ctx.settings().timeout(self.remaining(), self.ctx.settings.kill_grace);
        let (result, seen) =
            run_step(step, base, &mut *self.ctx.output, argv, then, sealed, None, capture).await;
        self.seen |= seen;
        result
    }
}

/// What a step runs with, apart from its context (so a step can run while the context's
/// output is shared with something else, as a gate's decision).
#[derive(Clone, Copy)]
pub(crate) struct StepSpec<'s> {
    pub(crate) tool: &'static str,
    pub(crate) what: &'s str,
    pub(crate) env: &'s [(String, String)],
    pub(crate) watch: Option<&'static str>,
    /// The job's whole timeout (for the message when none of it is left).
    pub(crate) job_timeout: Duration,
    pub(crate) binds: &'s [byoc_sandbox::spec::Bind],
}

/// Run one step: `argv`, then each of `then` (see [`Run::staged`]). A gated stage asks
/// on `gate` (the end that is not the runner's) before it starts; `capture` keeps the
/// standard output from the log. Returns the step's result and whether the watched
/// text went by.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_step(
    step: StepSpec<'_>,
    base: crate::ExecSettings,
    output: &mut dyn crate::OutputSink,
    argv: Vec<String>,
    then: Vec<Stage>,
    sealed: Option<&SealedDir>,
    gate: Option<std::os::unix::net::UnixStream>,
    capture: Option<&mut crate::process::Capture>,
) -> (Step<()>, bool) {
    let _ = output.write(format!("[{}] {}\n", step.tool, step.what).as_bytes());
    if base.timeout.is_zero() {
        let outcome = ExecOutcome {
            status: JobStatus::TimedOut,
            exit_code: None,
            error: Some(format!("job exceeded its timeout of {}s", step.job_timeout.as_secs())),
            outputs: serde_json::Value::Null,
        };
        return (Err(outcome), false);
    }
    let step_started = Instant::now();
    let seals = then.iter().any(|s| !s.seal.is_empty());
    let mut watch =
        Watch { inner: output, needle: step.watch.unwrap_or("").as_bytes(), tail: Vec::new(), seen: false };
    // A step gets the job's remaining time and neither containers nor policy.
    let sandbox = base.sandbox.clone();
    let sub = base.isolation(sandbox, None).policy(None).build(&mut watch);
    let outcome = match sub.settings.sandbox.clone() {
        Some(settings) => {
            let work = crate::sandboxed::work_dir_inside();
            let then = then
                .into_iter()
                .map(|s| byoc_sandbox::spec::Stage {
                    argv: s.argv,
                    seal: s.seal.iter().map(|f| work.join(f)).collect(),
                    gate: s.gate,
                    freeze: s.freeze,
                })
                .collect();
            let job = crate::sandboxed::Job {
                argv,
                env: step.env.to_vec(),
                network: true,
                then,
                sealed_dir: sealed.map(|s| s.path.clone()),
                gate: gate.map(std::os::fd::OwnedFd::from),
                binds: step.binds.to_vec(),
                proc: true,
            };
            crate::sandboxed::run_capturing(job, settings, sub, capture).await
        }
        None => stages_without_sandbox(step, sub, argv, then, sealed, gate, step_started, capture).await,
    };
    let seen = watch.seen;
    let _ = output.write(
        format!("[{}] {}: {} ms\n", step.tool, step.what, step_started.elapsed().as_millis()).as_bytes(),
    );
    if outcome.status == JobStatus::Succeeded {
        (Ok(()), seen)
    } else if seals && outcome.exit_code == Some(byoc_sandbox::helper::EXIT_SEAL_REFUSED) {
        let error = format!(
            "{} {}: a file the runner seals for the next stage is not a regular file the job wrote (a link?); that stage never ran",
            step.tool, step.what
        );
        (Err(failed("job_file_refused", error, serde_json::Value::Null)), seen)
    } else {
        let error = format!(
            "{} {}: {}",
            step.tool,
            step.what,
            outcome.error.clone().unwrap_or_else(|| "failed".into())
        );
        (Err(ExecOutcome { error: Some(error), ..outcome }), seen)
    }
}

/// Without the sandbox each stage is a process of its own, the runner makes the sealed
/// copies, and asks at a gate as the sandbox's init would.
#[allow(clippy::too_many_arguments)]
async fn stages_without_sandbox(
    step: StepSpec<'_>,
    sub: ExecContext<'_>,
    argv: Vec<String>,
    then: Vec<Stage>,
    sealed: Option<&SealedDir>,
    gate: Option<std::os::unix::net::UnixStream>,
    step_started: Instant,
    mut capture: Option<&mut crate::process::Capture>,
) -> ExecOutcome {
    let (settings, out) = sub.split();
    let work_dir = settings.work_dir.clone();
    let mut gate = gate
        .and_then(|g| g.set_nonblocking(true).ok().and_then(|()| tokio::net::UnixStream::from_std(g).ok()));
    let mut outcome = ExecOutcome::failed("no command");
    for (i, stage) in
        std::iter::once(Stage { argv, seal: vec![], gate: false, freeze: vec![] }).chain(then).enumerate()
    {
        if i > 0 && outcome.status != JobStatus::Succeeded {
            break;
        }
        for file in &stage.seal {
            // As the sandbox's init seals: a regular file beneath the job's directory, no
            // link followed.
            let copied = match (sealed, file.file_name()) {
                (Some(dir), Some(name)) => {
                    let dest = dir.path.join(name);
                    let _ = std::fs::remove_file(&dest);
                    crate::job_files::JobTree::open(&work_dir)
                        .and_then(|t| t.copy_out(file, &dest, u64::MAX))
                        .map_err(|e| {
                            failed(
                                e.code(),
                                format!("sealing {}: {e}", file.display()),
                                serde_json::Value::Null,
                            )
                        })
                }
                _ => Err(ExecOutcome::failed("no sealed directory")),
            };
            if let Err(outcome) = copied {
                return outcome;
            }
        }
        if stage.gate && !gate_opens(gate.as_mut()).await {
            return ExecOutcome {
                status: JobStatus::Failed,
                exit_code: Some(byoc_sandbox::helper::EXIT_GATE_CLOSED),
                error: Some("the gate stayed closed".into()),
                outputs: serde_json::json!({}),
            };
        }
        let mut cmd = Command::new(&stage.argv[0]);
        cmd.args(&stage.argv[1..]).current_dir(&work_dir).env_clear().envs(step.env.iter().cloned());
        let left = settings.timeout.saturating_sub(step_started.elapsed());
        let this = settings.clone().timeout(left, settings.kill_grace).build(&mut *out);
        outcome = crate::process::run_capturing(cmd, this, None, capture.as_deref_mut()).await;
    }
    outcome
}

/// The stage's side of a gate: ask, and wait for `y`.
async fn gate_opens(gate: Option<&mut tokio::net::UnixStream>) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Some(gate) = gate else { return false };
    let mut answer = [0u8; 1];
    gate.write_all(b"?").await.is_ok() && matches!(gate.read(&mut answer).await, Ok(1)) && answer[0] == b'y'
}

/// The runner's side of a gate: true once a stage asks, false if the sandbox ended
/// without asking.
pub(crate) async fn gate_asked(ours: &mut tokio::net::UnixStream) -> bool {
    use tokio::io::AsyncReadExt as _;
    let mut ask = [0u8; 1];
    matches!(ours.read(&mut ask).await, Ok(1)) && ask[0] == b'?'
}

/// Answer an asked gate (a closed gate needs no answer: dropping the channel closes it).
pub(crate) async fn gate_answer(ours: &mut tokio::net::UnixStream, open: bool) {
    use tokio::io::AsyncWriteExt as _;
    let _ = ours.write_all(if open { b"y" } else { b"n" }).await;
}

/// A gate channel: the runner's end (async) and the end a stage asks on.
pub(crate) fn gate_channel() -> std::io::Result<(tokio::net::UnixStream, std::os::unix::net::UnixStream)> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    Ok((tokio::net::UnixStream::from_std(ours)?, theirs))
}

/// One output sink shared by a running step and what the runner does meanwhile (a
/// gate's decision), each writing whole chunks. Both run on one task (`join!`), so the
/// lock is never contended; it exists to satisfy the borrow checker.
pub(crate) struct SharedSink<'o>(std::sync::Mutex<&'o mut dyn crate::OutputSink>);

impl<'o> SharedSink<'o> {
    pub(crate) fn new(sink: &'o mut dyn crate::OutputSink) -> Self {
        SharedSink(std::sync::Mutex::new(sink))
    }
    pub(crate) fn handle(&self) -> SharedHandle<'_, 'o> {
        SharedHandle(&self.0)
    }
}

pub(crate) struct SharedHandle<'h, 'o>(&'h std::sync::Mutex<&'o mut dyn crate::OutputSink>);

impl crate::OutputSink for SharedHandle<'_, '_> {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).write(chunk)
    }
}

/// A later command of [`Run::staged`]: its argv and the files (relative to the working
/// directory) sealed before it starts.
pub(crate) struct Stage {
    pub(crate) argv: Vec<String>,
    pub(crate) seal: Vec<PathBuf>,
    /// Ask the runner before starting it (see [`byoc_sandbox::spec::Stage::gate`]).
    pub(crate) gate: bool,
    /// Writable binds made read-only before it starts (see
    /// [`byoc_sandbox::spec::Stage::freeze`]); without the sandbox nothing is frozen.
    pub(crate) freeze: Vec<PathBuf>,
}

/// The runner's directory of sealed copies for one job, beside its working directory
/// (never inside it), removed with this value.
pub(crate) struct SealedDir {
    pub(crate) path: PathBuf,
    /// Where commands see it: the sandbox's mount point, or the host path.
    pub(crate) inside: PathBuf,
}

impl SealedDir {
    pub(crate) fn create(ctx: &ExecContext<'_>) -> std::io::Result<SealedDir> {
        use std::os::unix::fs::DirBuilderExt as _;
        let path = crate::beside_work(&ctx.settings.work_dir, ".sealed");
        // Not create_dir_all: a directory already there is someone else's.
        std::fs::DirBuilder::new().mode(0o755).create(&path)?;
        let inside = match ctx.settings.sandbox {
            Some(_) => PathBuf::from(byoc_sandbox::spec::SANDBOX_SEALED_DIR),
            None => path.clone(),
        };
        Ok(SealedDir { path, inside })
    }

    /// `name` as the job's commands see it, quoted for the shell that runs them (the
    /// host path, without the sandbox, may hold spaces).
    pub(crate) fn inside(&self, name: &str) -> String {
        shell_quote(&self.inside.join(name).display().to_string())
    }
}

/// `s` as one word for `sh`: single-quoted, each `'` as `'\''`.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

impl Drop for SealedDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Manifests that are not Kubernetes objects (YAML or JSON): which document, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidManifests(pub String);

impl From<InvalidManifests> for crate::InvalidSpec {
    fn from(e: InvalidManifests) -> Self {
        crate::InvalidSpec(e.0)
    }
}

/// A failed step's outcome, with the reason code in its outputs.
pub(crate) fn failed(reason: &str, error: String, mut outputs: serde_json::Value) -> ExecOutcome {
    if let Some(o) = outputs.as_object_mut() {
        o.insert("reason".into(), reason.into());
    } else {
        outputs = serde_json::json!({ "reason": reason });
    }
    ExecOutcome { status: JobStatus::Failed, exit_code: None, error: Some(error), outputs }
}

/// Multi-document YAML (`helm template`, kustomize) → manifest objects (empty documents skipped).
pub fn parse_manifests(yaml: &str) -> Result<Vec<serde_json::Value>, InvalidManifests> {
    let mut out = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(yaml).enumerate() {
        let v = serde_json::Value::deserialize(doc)
            .map_err(|e| InvalidManifests(format!("document {}: {e}", i + 1)))?;
        match v {
            serde_json::Value::Null => {}
            serde_json::Value::Object(_) => out.push(v),
            _ => return Err(InvalidManifests(format!("document {} is not a Kubernetes object", i + 1))),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quoted_paths_reach_the_command_unchanged() {
        for path in
            ["/sealed/plan.tfplan", "/var/lib/byoc runner/work/j.sealed/plan.tfplan", "/a'b/$HOME/`x`/\"q\""]
        {
            let out = std::process::Command::new("/bin/sh")
                .args(["-c", &format!("printf %s {}", shell_quote(path))])
                .output()
                .expect("sh runs");
            assert_eq!(String::from_utf8_lossy(&out.stdout), path);
        }
    }
}
