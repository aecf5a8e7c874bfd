//! `action.script`: a script run as a child process with only the environment the
//! job declares. Spec:
//!
//! ```json
//! {"script": "echo hello", "interpreter": "/bin/sh", "env": {"NAME": "value"},
//!  "secret_env": {"TOKEN": "masked wherever it would appear"}}
//! ```
//!
//! `secret_env` is passed like `env`, and its values are masked in the job's log, error
//! and outputs. Outputs: `KEY=VALUE` lines appended to `$BYOC_OUTPUT` (see `outputs`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;
use tokio::process::Command;

use crate::{ExecContext, ExecFuture, ExecOutcome, Executor};

/// PATH given to jobs that do not declare one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const MAX_SCRIPT_BYTES: usize = 128 * 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    pub script: String,
    #[serde(default = "default_interpreter")]
    pub interpreter: PathBuf,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub secret_env: BTreeMap<String, String>,
    /// Network access (default on: tools must reach cloud APIs). Off gives the job an
    /// empty network namespace.
    #[serde(default = "crate::default_true")]
    pub network: bool,
}

fn default_interpreter() -> PathBuf {
    PathBuf::from("/bin/sh")
}

impl Script {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        let s: Script = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        if s.script.len() > MAX_SCRIPT_BYTES {
            return Err(crate::InvalidSpec::from(format!(
                "script is {} bytes, limit {MAX_SCRIPT_BYTES}",
                s.script.len()
            )));
        }
        if !s.interpreter.is_absolute() {
            return Err(crate::InvalidSpec::from(format!(
                "interpreter {:?} must be an absolute path",
                s.interpreter
            )));
        }
        crate::validate_env(&s.env, &s.secret_env)?;
        Ok(s)
    }
}

impl Executor for Script {
    fn effect(&self) -> byoc_protocol::Effect {
        byoc_protocol::Effect::Run
    }

    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move {
            let script_path = ctx.settings.work_dir.join("script");
            if let Err(e) = std::fs::write(&script_path, &self.script) {
                return ExecOutcome::failed(format!("writing {}: {e}", script_path.display()));
            }
            let work_dir = ctx.settings.work_dir.clone();
            // Inside the sandbox the working directory is /work; unsandboxed it is the
            // host path. The job sees only this environment.
            let dir = match &ctx.settings.sandbox {
                Some(_) => crate::sandboxed::work_dir_inside(),
                None => ctx.settings.work_dir.clone(),
            };
            let mut env: Vec<(String, String)> = vec![
                ("PATH".into(), DEFAULT_PATH.into()),
                ("HOME".into(), dir.display().to_string()),
                ("BYOC_JOB_ID".into(), ctx.settings.job_id.clone()),
                (
                    crate::outputs::OUTPUT_ENV.into(),
                    dir.join(crate::outputs::OUTPUT_FILE).display().to_string(),
                ),
            ];
            env.extend(self.env.iter().map(|(k, v)| (k.clone(), v.clone())));
            env.extend(self.secret_env.iter().map(|(k, v)| (k.clone(), v.clone())));
            // The role's credential endpoint, served inside the job's namespace.
            crate::add_role_env(&mut ctx, &mut env, self.network);
            let argv = vec![self.interpreter.display().to_string(), dir.join("script").display().to_string()];
            let mut outcome = match ctx.settings.sandbox.clone() {
                Some(settings) => {
                    let job = crate::sandboxed::Job {
                        argv,
                        env,
                        network: self.network,
                        then: vec![],
                        sealed_dir: None,
                        gate: None,
                        binds: vec![],
                        proc: true,
                    };
                    crate::sandboxed::run(job, settings, ctx).await
                }
                None => {
                    if !self.network {
                        return ExecOutcome::failed("network = false needs the sandbox, which is disabled");
                    }
                    let mut cmd = Command::new(&argv[0]);
                    cmd.args(&argv[1..]).current_dir(&ctx.settings.work_dir).env_clear().envs(env);
                    crate::process::run_process_group(cmd, ctx, None).await
                }
            };
            match crate::outputs::read(&work_dir, &crate::mask::Masker::none()) {
                Ok(mut outputs) => {
                    // A refusal's reason code stays; the job cannot have written any.
                    if let (Some(reason), Some(o)) = (outcome.outputs.get("reason"), outputs.as_object_mut())
                    {
                        o.insert("reason".into(), reason.clone());
                    }
                    outcome.outputs = outputs
                }
                Err(e) => {
                    // The reason is the outputs': the job's own exit status stays in its log.
                    if outcome.status == crate::JobStatus::Succeeded || outcome.outputs.is_null() {
                        outcome.outputs = serde_json::json!({"reason": e.code()});
                    }
                    outcome.error = Some(match outcome.error.take() {
                        Some(prev) => format!("{prev}; {e}"),
                        None => e.to_string(),
                    });
                    if outcome.status == crate::JobStatus::Succeeded {
                        outcome.status = crate::JobStatus::Failed;
                    }
                }
            }
            outcome
        })
    }

    fn placement(&self) -> crate::Placement {
        crate::Placement::Sandbox { network: self.network }
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        self.secret_env.values().map(|v| v.as_bytes().to_vec()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobStatus;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    fn script(s: &str) -> Script {
        Script::from_spec(&serde_json::json!({"script": s})).unwrap()
    }

    async fn run(s: &Script, timeout: Duration, cancel: CancellationToken) -> (ExecOutcome, String) {
        let dir = tempfile::tempdir().unwrap();
        let mut out = Vec::new();
        let ctx = ExecContext::builder("job-1", dir.path())
            .timeout(timeout, Duration::from_millis(500))
            .cancel(cancel)
            .build(&mut out);
        let outcome = crate::run_masked(s, ctx).await;
        (outcome, String::from_utf8_lossy(&out).into_owned())
    }

    #[tokio::test]
    async fn runs_with_only_declared_environment() {
        // SAFETY-free: the test process env is inherited by default, so set a marker
        // through the command itself rather than std::env::set_var.
        let s = Script::from_spec(&serde_json::json!({
            "script": "echo \"A=$A\"; env | sort",
            "env": {"A": "1"}
        }))
        .unwrap();
        let (outcome, out) = run(&s, Duration::from_secs(10), CancellationToken::new()).await;
        assert_eq!(outcome.status, JobStatus::Succeeded, "{out}");
        assert!(out.contains("A=1"));
        let names: Vec<&str> = out.lines().skip(1).filter_map(|l| l.split('=').next()).collect();
        for n in &names {
            assert!(
                ["A", "PATH", "HOME", "BYOC_JOB_ID", "BYOC_OUTPUT", "PWD", "SHLVL", "_", "OLDPWD"]
                    .contains(n),
                "unexpected variable {n} leaked into the job"
            );
        }
        assert!(!out.contains("CARGO"), "runner environment leaked: {out}");
    }

    #[tokio::test]
    async fn nonzero_exit_is_failure_with_code() {
        let (outcome, out) =
            run(&script("echo out; echo err >&2; exit 3"), Duration::from_secs(10), CancellationToken::new())
                .await;
        assert_eq!(outcome.status, JobStatus::Failed);
        assert_eq!(outcome.exit_code, Some(3));
        assert!(out.contains("out") && out.contains("err"));
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_group() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pids");
        let s = script(&format!(
            "sleep 300 & echo $! > {p}; sleep 300 & echo $! >> {p}; wait",
            p = pidfile.display()
        ));
        let (outcome, _) = run(&s, Duration::from_millis(300), CancellationToken::new()).await;
        assert_eq!(outcome.status, JobStatus::TimedOut);
        for pid in std::fs::read_to_string(&pidfile).unwrap().split_whitespace() {
            assert!(!process_alive(pid.parse().unwrap()), "pid {pid} survived the job");
        }
    }

    #[tokio::test]
    async fn cancellation_escalates_past_ignored_signals() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pid");
        // Ignores SIGINT and SIGTERM: only SIGKILL ends it.
        let s = script(&format!("trap '' INT TERM; sleep 300 & echo $! > {}; wait; wait", pidfile.display()));
        let cancel = CancellationToken::new();
        let c2 = cancel.clone();
        let pf = pidfile.clone();
        tokio::spawn(async move {
            // Cancel once the child has recorded its pid (no sleep-based sync).
            while !pf.exists() || std::fs::read_to_string(&pf).unwrap_or_default().trim().is_empty() {
                tokio::task::yield_now().await;
            }
            c2.cancel();
        });
        let (outcome, _) = run(&s, Duration::from_secs(60), cancel).await;
        assert_eq!(outcome.status, JobStatus::Cancelled);
        let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
        assert!(!process_alive(pid));
    }

    #[tokio::test]
    async fn background_children_do_not_outlive_a_successful_job() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pid");
        let s = script(&format!("sleep 300 & echo $! > {}; echo done", pidfile.display()));
        let (outcome, out) = run(&s, Duration::from_secs(10), CancellationToken::new()).await;
        assert_eq!(outcome.status, JobStatus::Succeeded);
        assert!(out.contains("done"));
        let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
        assert!(!process_alive(pid));
    }

    #[tokio::test]
    async fn secrets_are_masked_in_log_and_outputs_and_outputs_come_back() {
        let s = Script::from_spec(&serde_json::json!({
            "script": "echo \"token=$TOKEN\"; printf %s \"$TOKEN\" | base64; echo \"url=https://x\" >> \"$BYOC_OUTPUT\"; echo \"leak=$TOKEN\" >> \"$BYOC_OUTPUT\"",
            "secret_env": {"TOKEN": "tok-9f8e7d6c5b"}
        }))
        .unwrap();
        let (outcome, out) = run(&s, Duration::from_secs(10), CancellationToken::new()).await;
        assert_eq!(outcome.status, JobStatus::Succeeded, "{outcome:?} {out}");
        assert!(!out.contains("tok-9f8e7d6c5b") && !out.contains("dG9rLTlmOGU3ZDZjNWI"), "{out}");
        assert!(out.contains("token=***"), "{out}");
        assert_eq!(outcome.outputs, serde_json::json!({"url": "https://x", "leak": "***"}));
    }

    #[tokio::test]
    async fn a_bad_outputs_file_fails_the_job_with_the_reason() {
        let s = script("echo 'not a key value line' >> \"$BYOC_OUTPUT\"");
        let (outcome, _) = run(&s, Duration::from_secs(10), CancellationToken::new()).await;
        assert_eq!(outcome.status, JobStatus::Failed);
        assert!(outcome.error.unwrap().contains("outputs file line 1"));
    }

    #[test]
    fn rejects_bad_specs() {
        for spec in [
            serde_json::json!({}),
            serde_json::json!({"script": "x", "interpreter": "sh"}),
            serde_json::json!({"script": "x", "env": {"1BAD": "v"}}),
            serde_json::json!({"script": "x", "unknown": 1}),
            serde_json::json!({"script": "x", "secret_env": {"T": "abc"}}),
            serde_json::json!({"script": "x", "env": {"T": "a"}, "secret_env": {"T": "abcdef"}}),
        ] {
            assert!(Script::from_spec(&spec).is_err(), "{spec} accepted");
        }
    }

    fn process_alive(pid: i32) -> bool {
        // A zombie is dead for our purposes; /proc/PID/stat state 'Z'.
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
            Err(_) => false,
        }
    }
}
