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
    std::os::unix::fs::chown(path, Some(s.host_uid), Some(s.host_gid))?;
    if path.is_dir() {
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
    /// (at [`Run::sealed_path`]) and never change. Without the sandbox each command is
    /// a process of its own and the runner makes the copies.
    pub(crate) async fn staged(
        &mut self,
        what: &str,
        argv: Vec<String>,
        then: Vec<Stage>,
        sealed: Option<&SealedDir>,
    ) -> Step<()> {
        self.log(&format!("[{}] {what}\n", self.tool));
        if self.remaining().is_zero() {
            return Err(ExecOutcome {
                status: JobStatus::TimedOut,
                exit_code: None,
                error: Some(format!("job exceeded its timeout of {}s", self.ctx.settings.timeout.as_secs())),
                outputs: serde_json::Value::Null,
            });
        }
        let step_started = Instant::now();
        // A step gets the job's remaining time and neither containers nor policy.
        let settings = self.ctx.settings().timeout(self.remaining(), self.ctx.settings.kill_grace);
        let mut watch = Watch {
            inner: &mut *self.ctx.output,
            needle: self.watch.unwrap_or("").as_bytes(),
            tail: Vec::new(),
            seen: false,
        };
        let sub = settings.isolation(self.ctx.settings.sandbox.clone(), None).policy(None).build(&mut watch);
        let outcome = match sub.settings.sandbox.clone() {
            Some(settings) => {
                let work = crate::sandboxed::work_dir_inside();
                let then = then
                    .into_iter()
                    .map(|s| byoc_sandbox::spec::Stage {
                        argv: s.argv,
                        seal: s.seal.iter().map(|f| work.join(f)).collect(),
                    })
                    .collect();
                let job = crate::sandboxed::Job {
                    argv,
                    env: self.env.clone(),
                    network: true,
                    then,
                    sealed_dir: sealed.map(|s| s.path.clone()),
                };
                crate::sandboxed::run(job, settings, sub).await
            }
            None => {
                let (settings, out) = sub.split();
                let work_dir = settings.work_dir.clone();
                let mut outcome = ExecOutcome::failed("no command");
                for (i, stage) in std::iter::once(Stage { argv, seal: vec![] }).chain(then).enumerate() {
                    if i > 0 && outcome.status != JobStatus::Succeeded {
                        break;
                    }
                    for file in &stage.seal {
                        let copied = match (sealed, file.file_name()) {
                            (Some(dir), Some(name)) => {
                                std::fs::copy(work_dir.join(file), dir.path.join(name))
                            }
                            _ => Err(std::io::Error::other("no sealed directory")),
                        };
                        if let Err(e) = copied {
                            return Err(ExecOutcome::failed(format!("sealing {}: {e}", file.display())));
                        }
                    }
                    let mut cmd = Command::new(&stage.argv[0]);
                    cmd.args(&stage.argv[1..]).current_dir(&work_dir).env_clear().envs(self.env.clone());
                    let left = settings.timeout.saturating_sub(step_started.elapsed());
                    let this = settings.clone().timeout(left, settings.kill_grace).build(&mut *out);
                    outcome = crate::process::run_process_group(cmd, this, None).await;
                }
                outcome
            }
        };
        self.seen |= watch.seen;
        self.log(&format!("[{}] {what}: {} ms\n", self.tool, step_started.elapsed().as_millis()));
        if outcome.status == JobStatus::Succeeded {
            Ok(())
        } else {
            let error =
                format!("{} {what}: {}", self.tool, outcome.error.clone().unwrap_or_else(|| "failed".into()));
            Err(ExecOutcome { error: Some(error), ..outcome })
        }
    }
}

/// A later command of [`Run::staged`]: its argv and the files (relative to the working
/// directory) sealed before it starts.
pub(crate) struct Stage {
    pub(crate) argv: Vec<String>,
    pub(crate) seal: Vec<PathBuf>,
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
        let mut path = ctx.settings.work_dir.clone().into_os_string();
        path.push(".sealed");
        let path = PathBuf::from(path);
        // Not create_dir_all: a directory already there is someone else's.
        std::fs::DirBuilder::new().mode(0o755).create(&path)?;
        let inside = match ctx.settings.sandbox {
            Some(_) => PathBuf::from(byoc_sandbox::spec::SANDBOX_SEALED_DIR),
            None => path.clone(),
        };
        Ok(SealedDir { path, inside })
    }

    /// `name` as the job's commands see it.
    pub(crate) fn inside(&self, name: &str) -> String {
        self.inside.join(name).display().to_string()
    }
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
