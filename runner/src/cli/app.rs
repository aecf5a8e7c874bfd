//! `byoc-runner app check DIR`.

use std::path::PathBuf;

use clap::Subcommand;

use super::Output;

#[derive(Subcommand)]
pub(super) enum AppCmd {
    /// Load an app config directory; print every problem
    ///
    /// As the runner and the install stack generator would: roles (permissions.toml or
    /// permissions/*.toml, break_glass.toml, operation_roles.toml), the files role
    /// policies and boundaries name, the vendor's policies, the secrets and the stack
    /// parameters they become. Prints every problem at once (exit 1), or ok (exit 0).
    ///
    /// Example: byoc-runner app check ./my-app
    Check {
        /// The app config directory.
        dir: PathBuf,
        /// Output format: text for people, json for scripts.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
}

pub(super) fn run(cmd: AppCmd) -> i32 {
    let AppCmd::Check { dir, output } = cmd;
    if !dir.is_dir() {
        eprintln!("byoc-runner app check: {} is not a directory", dir.display());
        return 64;
    }
    let report = crate::app_check::check(&dir);
    let ok = report.problems.is_empty();
    match output {
        Output::Json => {
            let mut v = serde_json::to_value(&report).unwrap_or_default();
            v["ok"] = serde_json::Value::Bool(ok);
            println!("{v}");
        }
        Output::Text => {
            for p in &report.problems {
                println!("problem: {p}");
            }
            if ok {
                println!(
                    "ok: {} roles, {} policies, {} secrets; stack parameters: {}",
                    report.roles.len(),
                    report.policies.len(),
                    report.secrets.len(),
                    if report.stack_parameters.is_empty() {
                        "-".into()
                    } else {
                        report.stack_parameters.join(", ")
                    }
                );
            } else {
                println!("{} problem(s) in {}", report.problems.len(), dir.display());
            }
        }
    }
    if ok { 0 } else { 1 }
}
