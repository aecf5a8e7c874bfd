//! init, plan and apply in one sandbox: init alone, then plan with the data directory
//! frozen; the sandbox's init ends every process of the plan, seals the plan and its
//! lock file and stops at a gate before apply; meanwhile the runner renders the sealed
//! plan in a sandbox of its own (offline, no credentials), decides, puts a fresh copy
//! of the verified module where the job's was, and opens the gate only for a plan the
//! policies allowed (one sandbox set-up fewer than plan and apply apart). Used when
//! nothing can hold the plan between decision and apply (no customer approval, not
//! plan-only, not decide-only).

use std::path::Path;

use super::judge::{read_outputs, still_the_plan};
use super::tree::LOCK_FILE;
use super::{MODULE_DIR, OUTPUTS_JSON, PLAN_FILE, Restage, Terraform};
use crate::tool::{Run, SealedDir, SharedSink, Stage, Step, StepSpec, gate_answer, gate_asked, run_step};
use crate::{ExecOutcome, JobStatus};

/// In the sealed directory: apply's stage runs `output -json` after it only when the
/// runner put this there (it knows once it has read the plan).
const WANT_OUTPUTS: &str = "want-outputs";

/// The terraform commands of each stage.
pub(super) struct Commands {
    pub(super) init: Vec<String>,
    /// The plan's stage (it freezes the data directory, see `after_init`).
    pub(super) plan: Stage,
    pub(super) apply: Vec<String>,
}

impl Terraform {
    pub(super) async fn plan_decide_apply(
        &self,
        run: &mut Run<'_, '_>,
        policy: &crate::JobPolicies,
        module: &Path,
        restage: Restage<'_>,
        sealed: &SealedDir,
        commands: Commands,
    ) -> Step<ExecOutcome> {
        let state_beside_module = restage.local_state.is_some();
        let plan_path = sealed.path.join(PLAN_FILE);
        let (mut ours, theirs) = crate::tool::gate_channel()
            .map_err(|e| ExecOutcome::failed(format!("creating the apply gate: {e}")))?;
        let mut apply = commands.apply;
        // Outputs from `output -json` only where the state is not beside the module.
        if !state_beside_module {
            let want = sealed.inside(WANT_OUTPUTS);
            apply[2].push_str(&format!(
                "if [ -e {want} ]; then echo '[terraform] output -json'; \"$0\" -chdir={MODULE_DIR} output -json > {MODULE_DIR}/{OUTPUTS_JSON} || exit $?; fi\n"
            ));
        }
        let apply = Stage {
            argv: apply,
            seal: vec![Path::new(MODULE_DIR).join(PLAN_FILE), Path::new(MODULE_DIR).join(LOCK_FILE)],
            gate: true,
            freeze: vec![],
        };
        let stages = vec![commands.plan, apply];
        let step = StepSpec {
            tool: run.tool,
            what: "init, plan, apply",
            env: &run.env,
            watch: run.watch,
            job_timeout: run.ctx.settings.timeout,
            binds: &run.binds,
        };
        let remaining = run.remaining();
        let decision_started = std::time::Instant::now();
        let env = &run.env.clone();
        let settings = run.ctx.settings().timeout(remaining, run.ctx.settings.kill_grace);
        let shared = SharedSink::new(&mut *run.ctx.output);
        let mut step_out = shared.handle();
        let sandbox = run_step(
            step,
            settings.clone(),
            &mut step_out,
            commands.init,
            stages,
            Some(sealed),
            Some(theirs),
            None,
        );
        let decision = async {
            if !gate_asked(&mut ours).await {
                return None;
            }
            let mut out = shared.handle();
            let decided = async {
                // The data directory is frozen: what init installed stays what is checked.
                super::providers_verified(restage.tree, &mut out)?;
                super::plan_backend_is_ours(&settings, &self.spec, &plan_path)?;
                let max = policy.limits.max_input_bytes as u64;
                let left = settings.timeout.saturating_sub(decision_started.elapsed());
                let render = settings.clone().timeout(left, settings.kill_grace);
                let plan_json =
                    super::render::render(render, &mut out, env, sealed, restage.tree, PLAN_FILE, max)
                        .await?;
                let mut ctx = settings.clone().build(&mut out);
                let judged = self.judge(&mut ctx, &plan_path, plan_json).await?;
                still_the_plan(&ctx, &plan_path, &judged.plan_digest, &judged.base)?;
                crate::open_full_session(&mut ctx, &judged.plan_digest)?;
                // Nothing of the job is alive at the gate: apply starts from the verified
                // module, not from what plan's processes left of it.
                super::restage(&ctx, restage.tree, module, restage.local_state, Some(sealed))?;
                let declares_outputs = declares_outputs(&judged.plan_value);
                if declares_outputs && !state_beside_module {
                    std::fs::write(sealed.path.join(WANT_OUTPUTS), b"")
                        .map_err(|e| ExecOutcome::failed(format!("asking for the outputs: {e}")))?;
                }
                Ok((judged, declares_outputs))
            }
            .await;
            // Open only for an allowed plan; anything else ends the sandbox before apply.
            gate_answer(&mut ours, decided.is_ok()).await;
            Some(decided)
        };
        let ((ran, seen), decided) = tokio::join!(sandbox, decision);
        run.seen |= seen;
        // A closed gate (denied, or the decision failed) ends the sandbox before apply.
        let (judged, declares_outputs) = match decided {
            Some(Ok(d)) => d,
            Some(Err(outcome)) => return Err(outcome),
            None => {
                ran?;
                return Err(ExecOutcome::failed("the sandbox ended before the plan was decided"));
            }
        };
        ran?;
        let raw = read_outputs(module, declares_outputs, declares_outputs && !state_beside_module)?;
        let outputs = crate::outputs::from_terraform(&raw)
            .map_err(|e| ExecOutcome::failed(format!("terraform output -json is not JSON: {e}")))?;
        let mut result = judged.base;
        result["outputs"] = outputs;
        Ok(ExecOutcome { status: JobStatus::Succeeded, exit_code: Some(0), error: None, outputs: result })
    }
}

/// Whether the module declares outputs (none: nothing to read after apply).
pub(super) fn declares_outputs(plan: &serde_json::Value) -> bool {
    plan["configuration"]["root_module"]["outputs"].as_object().is_some_and(|o| !o.is_empty())
}
