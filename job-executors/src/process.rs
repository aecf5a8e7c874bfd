//! Running a child process tree for a job: its own process group, merged output
//! streamed to the sink, timeout and cancellation escalating interrupt → terminate →
//! kill across the whole group, and nothing of the group left behind when it ends.
//!
//! A child that leaves the process group (setsid) escapes the group kill; the sandbox's
//! pid namespace closes that gap.

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::{ExecContext, ExecOutcome, JobStatus};

const READ_CHUNK: usize = 16 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Exited,
    TimedOut,
    Cancelled,
    /// The log could not be written (a full disk): a job must not run on unrecorded.
    LogFailed,
    /// The captured output passed its limit.
    CaptureOverflowed,
}

/// Spawn `cmd` in a fresh process group and supervise it to the end. `stdin_data`, if
/// any, is written to the child's stdin and closed (the sandbox helper's spec);
/// otherwise stdin is /dev/null.
pub async fn run_process_group(
    cmd: Command,
    ctx: ExecContext<'_>,
    stdin_data: Option<Vec<u8>>,
) -> ExecOutcome {
    run_capturing(cmd, ctx, stdin_data, None).await
}

/// A command's standard output kept by the runner (never the job log), at most `max`
/// bytes: more ends the command (`overflowed`).
#[derive(Debug, Default)]
pub struct Capture {
    pub max: usize,
    pub bytes: Vec<u8>,
    pub overflowed: bool,
}

impl Capture {
    pub fn new(max: usize) -> Capture {
        Capture { max, bytes: Vec::new(), overflowed: false }
    }

    /// Keep `chunk`; false once more than `max` came.
    fn take(&mut self, chunk: &[u8]) -> bool {
        if self.bytes.len() + chunk.len() > self.max {
            self.overflowed = true;
            self.bytes.clear();
            return false;
        }
        self.bytes.extend_from_slice(chunk);
        true
    }
}

/// [`run_process_group`], with the standard output going to `capture` when given (the
/// standard error still goes to the job's log).
pub async fn run_capturing(
    cmd: Command,
    ctx: ExecContext<'_>,
    stdin_data: Option<Vec<u8>>,
    mut capture: Option<&mut Capture>,
) -> ExecOutcome {
    let (mut child, pgid) = match spawn(cmd, stdin_data).await {
        Ok(started) => started,
        Err(outcome) => return outcome,
    };
    tracing::debug!(job_id = %ctx.settings.job_id, pgid = pgid.as_raw(), "Job process started.");
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(64);
    let (captured_tx, mut captured_rx) = mpsc::channel::<Vec<u8>>(64);
    let readers = [
        child
            .stdout
            .take()
            .map(|s| spawn_reader(s, if capture.is_some() { captured_tx.clone() } else { tx.clone() })),
        child.stderr.take().map(|s| spawn_reader(s, tx.clone())),
    ];
    drop(tx);
    drop(captured_tx);
    let mut captured_open = capture.is_some();

    let deadline = tokio::time::sleep(ctx.settings.timeout);
    tokio::pin!(deadline);
    let mut ending = Ending::Exited;
    let mut sink_error: Option<std::io::Error> = None;
    let mut output_open = true;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            chunk = rx.recv(), if output_open => match chunk {
                Some(chunk) => {
                    if let Err(e) = ctx.output.write(&chunk) {
                        sink_error.get_or_insert(e);
                        if ending == Ending::Exited {
                            ending = Ending::LogFailed;
                            break escalate(&mut child, pgid, ctx.settings.kill_grace).await;
                        }
                    }
                }
                None => output_open = false,
            },
            chunk = captured_rx.recv(), if captured_open => match (chunk, capture.as_deref_mut()) {
                (Some(chunk), Some(capture)) => {
                    if !capture.take(&chunk) && ending == Ending::Exited {
                        ending = Ending::CaptureOverflowed;
                        break escalate(&mut child, pgid, ctx.settings.kill_grace).await;
                    }
                }
                _ => captured_open = false,
            },
            _ = &mut deadline, if ending == Ending::Exited => {
                ending = Ending::TimedOut;
                break escalate(&mut child, pgid, ctx.settings.kill_grace).await;
            }
            _ = ctx.settings.cancel.cancelled(), if ending == Ending::Exited => {
                ending = Ending::Cancelled;
                break escalate(&mut child, pgid, ctx.settings.kill_grace).await;
            }
        }
    };
    // The leader is gone; whatever it left running in its group goes with it, which
    // also closes the pipes those stragglers held so the readers below reach EOF.
    let _ = killpg(pgid, Signal::SIGKILL);
    while let Some(chunk) = rx.recv().await {
        if let Err(e) = ctx.output.write(&chunk) {
            sink_error.get_or_insert(e);
        }
    }
    while let Some(chunk) = captured_rx.recv().await {
        if let Some(capture) = capture.as_deref_mut()
            && !capture.overflowed
            && !capture.take(&chunk)
            && ending == Ending::Exited
        {
            ending = Ending::CaptureOverflowed;
        }
    }
    for r in readers.into_iter().flatten() {
        let _ = r.await;
    }

    outcome(
        status,
        ending,
        sink_error,
        ctx.settings.timeout,
        capture.as_ref().map(|c| c.max).unwrap_or_default(),
    )
}

/// The job's outcome from how its process ended and how it was supervised.
fn outcome(
    status: std::io::Result<std::process::ExitStatus>,
    ending: Ending,
    sink_error: Option<std::io::Error>,
    timeout: std::time::Duration,
    capture_max: usize,
) -> ExecOutcome {
    let (exit_code, signal) = match &status {
        Ok(s) => {
            use std::os::unix::process::ExitStatusExt;
            (s.code(), s.signal())
        }
        Err(_) => (None, None),
    };
    let (status, error) = match ending {
        Ending::TimedOut => {
            (JobStatus::TimedOut, Some(format!("job exceeded its timeout of {}s", timeout.as_secs())))
        }
        Ending::Cancelled => (JobStatus::Cancelled, Some("job was cancelled".to_string())),
        Ending::LogFailed => (
            JobStatus::Failed,
            Some(format!(
                "the job's log could not be written ({}); the job was stopped so it does not run on unrecorded",
                sink_error.as_ref().map(|e| e.to_string()).unwrap_or_default()
            )),
        ),
        Ending::CaptureOverflowed => (
            JobStatus::Failed,
            Some(format!("printed more than {} bytes on its standard output; stopped", capture_max)),
        ),
        Ending::Exited => match (&status, exit_code, signal) {
            (Err(e), _, _) => (JobStatus::Failed, Some(format!("waiting for the job process: {e}"))),
            (_, Some(0), _) => (JobStatus::Succeeded, None),
            (_, Some(code), _) => (JobStatus::Failed, Some(format!("exited with code {code}"))),
            (_, None, Some(sig)) => (JobStatus::Failed, Some(format!("killed by signal {sig}"))),
            (_, None, None) => (JobStatus::Failed, Some("ended without an exit status".into())),
        },
    };
    let (status, error) = match sink_error {
        // Losing output is a failure even if the process succeeded: the log is evidence.
        Some(e) if status == JobStatus::Succeeded => {
            (JobStatus::Failed, Some(format!("writing job log to the spool: {e}")))
        }
        _ => (status, error),
    };
    ExecOutcome { status, exit_code, error, outputs: serde_json::json!({}) }
}

/// The job's process in a process group of its own, killed if dropped, its standard
/// input fed `stdin_data` (the sandbox helper's spec).
async fn spawn(mut cmd: Command, stdin_data: Option<Vec<u8>>) -> Result<(Child, Pid), ExecOutcome> {
    cmd.stdin(if stdin_data.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let spawned = cmd.spawn();
    // Whatever the command holds for the child (a hand-over channel) is the child's now.
    drop(cmd);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => return Err(ExecOutcome::failed(format!("starting the job process: {e}"))),
    };
    let Some(pgid) = child.id().map(|p| Pid::from_raw(p as i32)) else {
        return Err(ExecOutcome::failed("job process exited before it could be supervised"));
    };
    if let (Some(data), Some(mut stdin)) = (stdin_data, child.stdin.take()) {
        use tokio::io::AsyncWriteExt as _;
        // The helper reads its spec before anything else; a failure shows in its exit.
        let _ = stdin.write_all(&data).await;
        drop(stdin);
    }
    Ok((child, pgid))
}

fn spawn_reader<R>(mut r: R, tx: mpsc::Sender<Vec<u8>>) -> tokio::task::JoinHandle<()>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).await.is_err() {
                        break;
                    }
                }
            }
        }
    })
}

/// SIGINT to the group (lets terraform release its state lock), then SIGTERM, then
/// SIGKILL, waiting `grace` for the leader between steps.
async fn escalate(
    child: &mut Child,
    pgid: Pid,
    grace: Duration,
) -> std::io::Result<std::process::ExitStatus> {
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        let _ = killpg(pgid, signal);
        if let Ok(status) = tokio::time::timeout(grace, child.wait()).await {
            return status;
        }
    }
    let _ = killpg(pgid, Signal::SIGKILL);
    child.wait().await
}
