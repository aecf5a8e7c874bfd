//! What the tool executors (terraform, helm, kubernetes) share: running one step of a
//! tool in the job's sandbox with the job's remaining time, handing files to the
//! sandbox's uid, the failure outcome with its reason code, path and manifest checks.

use std::path::{Component, Path};
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
                let job = crate::sandboxed::Job { argv, env: self.env.clone(), network: true };
                crate::sandboxed::run(job, settings, sub).await
            }
            None => {
                let mut cmd = Command::new(&argv[0]);
                cmd.args(&argv[1..]).current_dir(&sub.settings.work_dir).env_clear().envs(self.env.clone());
                crate::process::run_process_group(cmd, sub, None).await
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
