//! The customer's secrets a `terraform` job names (docs/SECRETS.md): each read under
//! the job's role and passed as the terraform variable the app config declares for it.

use std::collections::BTreeMap;

use super::Terraform;
use crate::Executor as _;
use crate::tool::failed;
use crate::{ExecContext, ExecOutcome};

/// The customer's secrets a job passes to terraform, and what its result says of them.
#[derive(Default)]
pub(super) struct CustomerSecrets {
    pub(super) env: Vec<(String, String)>,
    pub(super) report: Option<serde_json::Value>,
}

impl Terraform {
    pub(super) async fn customer_secrets(
        &self,
        ctx: &mut ExecContext<'_>,
    ) -> Result<CustomerSecrets, ExecOutcome> {
        if self.spec.secrets.is_empty() {
            return Ok(CustomerSecrets::default());
        }
        let fetched = crate::secrets::fetch(ctx, &self.secret_uses())
            .await
            .map_err(|e| failed(e.code(), e.to_string(), serde_json::Value::Null))?;
        let mut env = Vec::new();
        let mut written: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for f in &fetched {
            let (Some(variable), Some(value)) = (&f.declared.terraform_variable, &f.value) else { continue };
            if self.spec.vars.contains_key(variable) || self.spec.secret_vars.contains_key(variable) {
                return Err(failed(
                    "invalid_spec",
                    format!(
                        "variable {variable} (of secret {}) is also in vars or secret_vars",
                        f.declared.name
                    ),
                    serde_json::Value::Null,
                ));
            }
            let _ = ctx.output.write(
                format!(
                    "[terraform] secret {} (version {}) as variable {variable}\n",
                    f.declared.name,
                    f.version_id.as_deref().unwrap_or("")
                )
                .as_bytes(),
            );
            env.push((variable.clone(), value.clone()));
            written.entry(f.declared.name.clone()).or_default().push(format!("terraform:var.{variable}"));
        }
        Ok(CustomerSecrets { env, report: Some(crate::secrets::report(&fetched, &written)) })
    }
}
