//! `runner.noop`: proves the pipeline end to end without touching the host.

use serde::Deserialize;

use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Noop {
    /// Optional line written to the job log.
    #[serde(default)]
    pub message: Option<String>,
}

impl Noop {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        if spec.is_null() {
            return Ok(Noop::default());
        }
        serde_json::from_value(spec.clone()).map_err(|e| crate::InvalidSpec(e.to_string()))
    }
}

impl Executor for Noop {
    fn effect(&self) -> byoc_protocol::Effect {
        byoc_protocol::Effect::Read
    }

    fn run<'a>(&'a self, ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move {
            let line = format!("{}\n", self.message.as_deref().unwrap_or("noop"));
            if let Err(e) = ctx.output.write(line.as_bytes()) {
                return ExecOutcome::failed(format!("writing job log: {e}"));
            }
            ExecOutcome {
                status: JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                outputs: serde_json::json!({}),
            }
        })
    }
}
