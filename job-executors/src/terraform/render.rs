//! The plan JSON the policies and the approver judge, made by the runner from the sealed
//! plan: `terraform show -json` in a sandbox of its own (nothing of the job's earlier
//! steps is alive), offline, without the role's credentials or the job's variables,
//! its standard output straight to the runner and never a file in the job's tree. It
//! runs in the sealed directory (the plan and its lock file; the plan carries its
//! configuration), with the runner's HOME and CLI configuration and the data directory
//! init left (frozen since), all read-only, and without /proc: a provider it starts can
//! reach no other process's descriptors, so nothing but terraform writes the bytes the
//! runner reads. What the job's code ran during plan can have left nothing that reaches
//! the judged bytes but the sealed plan itself.

use std::time::Instant;

use tokio::process::Command;

use super::tree::RunnerTree;
use crate::process::Capture;
use crate::tool::{SealedDir, Step, failed};
use crate::{ExecOutcome, ExecSettings, JobStatus, OutputSink};

/// Of the job's environment, what rendering keeps: terraform's own switches and where
/// its providers are. No `TF_VAR_*` (the plan holds its variables), no credentials.
const RENDER_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "TF_IN_AUTOMATION",
    "TF_INPUT",
    "CHECKPOINT_DISABLE",
    "TF_CLI_CONFIG_FILE",
    "TF_DATA_DIR",
];

/// Reason code: terraform could not render the sealed plan offline.
pub(crate) const RENDER_FAILED: &str = "plan_render_failed";
/// Reason code: the rendered plan is larger than the policies take.
pub(crate) const TOO_LARGE: &str = "plan_too_large";

/// `terraform show -json <sealed plan>` as above; at most `max` bytes (the policies'
/// input limit) or `plan_too_large`. `settings` carry the time left and the sandbox.
pub(super) async fn render(
    settings: ExecSettings,
    output: &mut dyn OutputSink,
    env: &[(String, String)],
    sealed: &SealedDir,
    tree: &RunnerTree,
    plan: &str,
    max: u64,
) -> Step<Vec<u8>> {
    let env: Vec<(String, String)> =
        env.iter().filter(|(k, _)| RENDER_ENV.contains(&k.as_str())).cloned().collect();
    let terraform = settings.tools.terraform.display().to_string();
    let started = Instant::now();
    let _ = output.write(
        format!("[terraform] show -json {plan}: rendered by the runner (offline, no credentials)\n")
            .as_bytes(),
    );
    let mut capture = Capture::new(usize::try_from(max).unwrap_or(usize::MAX));
    let sandbox = settings.sandbox.clone();
    let mut settings = settings;
    if sandbox.is_some() {
        // Its /work: an empty directory of its own, not the job's (it needs none).
        settings.work_dir = tree
            .render_scratch()
            .map_err(|e| ExecOutcome::failed(format!("making the render's directory: {e}")))?;
    }
    let sub = settings.clone().isolation(sandbox.clone(), None).credentials(None).policy(None).build(output);
    let outcome = match sandbox {
        Some(sandbox) => {
            let job = crate::sandboxed::Job {
                argv: vec![
                    terraform,
                    format!("-chdir={}", sealed.inside.display()),
                    "show".into(),
                    "-json".into(),
                    sealed.inside.join(plan).display().to_string(),
                ],
                env,
                network: false,
                then: vec![],
                sealed_dir: Some(sealed.path.clone()),
                gate: None,
                binds: tree.binds(false),
                proc: false,
            };
            crate::sandboxed::run_capturing(job, sandbox, sub, Some(&mut capture)).await
        }
        None => {
            let mut cmd = Command::new(&terraform);
            cmd.arg(format!("-chdir={}", sealed.path.display()))
                .args(["show", "-json"])
                .arg(sealed.path.join(plan))
                .current_dir(&settings.work_dir)
                .env_clear()
                .envs(env);
            crate::process::run_capturing(cmd, sub, None, Some(&mut capture)).await
        }
    };
    let _ = output
        .write(format!("[terraform] show -json {plan}: {} ms\n", started.elapsed().as_millis()).as_bytes());
    if capture.overflowed {
        return Err(failed(
            TOO_LARGE,
            format!(
                "the plan's JSON is larger than the policies take ({max} bytes, [policy] max_input_bytes): nothing was decided or applied"
            ),
            serde_json::Value::Null,
        ));
    }
    match outcome.status {
        JobStatus::Succeeded => Ok(capture.bytes),
        JobStatus::Failed => Err(failed(
            RENDER_FAILED,
            format!(
                "terraform show -json of the sealed plan failed ({}; terraform's message is in the job log). It runs \
                 offline and without credentials: a backend the job names must configure without the network \
                 (s3: skip_credentials_validation = true)",
                outcome.error.unwrap_or_else(|| "failed".into())
            ),
            serde_json::Value::Null,
        )),
        // Timed out or cancelled: as any step.
        _ => Err(ExecOutcome {
            error: Some(format!(
                "terraform show -json: {}",
                outcome.error.clone().unwrap_or_else(|| "stopped".into())
            )),
            ..outcome
        }),
    }
}
