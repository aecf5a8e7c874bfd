//! `config validate` (no network), `config check` (this host, end to end) and `config
//! write` (the install's file from the stack's values).

use std::path::{Path, PathBuf};

use clap::Subcommand;

use super::{EX_USAGE, Output};
use crate::config::{Config, DEFAULT_CONFIG_PATH};

#[derive(Subcommand)]
pub(super) enum ConfigCmd {
    /// Check this host can run the runner, end to end
    ///
    /// The config, the state dir's disk, DNS, TCP and TLS to the control plane (through
    /// the proxy if set), clock skew, the instance metadata service, the install stack
    /// and its role ARNs, journald and the sandbox. Each line is ok/warn/FAIL/skip with
    /// what to do; exit 1 if any check fails.
    ///
    /// Example: sudo byoc-runner config check
    Check {
        /// Configuration file.
        #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        /// Output format: text for people, json for scripts.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Validate the configuration; print every problem
    ///
    /// No network: the file alone. Exit 0 if it loads, 64 with every problem if not.
    ///
    /// Example: byoc-runner config validate --config /etc/byoc-runner/runner.toml.new
    Validate {
        /// Configuration file.
        #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        /// Output format: text for people, json for scripts.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Write runner.toml from the install stack's values
    ///
    /// From the BYOC_* variables user-data sets: BYOC_CONTROL_PLANE_URL,
    /// BYOC_CONTROL_PLANE_KEYS, BYOC_INSTALL_ID, BYOC_REGION, BYOC_RELEASE_PUBKEY, and
    /// the optional ones packaging/user-data.sh lists, with TOML's escaping; refused,
    /// nothing written, if a value does not read back as itself or the file would not
    /// load.
    ///
    /// Example: BYOC_INSTALL_ID=inst-1 … byoc-runner config write --out /etc/byoc-runner/runner.toml.new
    Write {
        /// Where to write (mode 0640; replaced whole).
        #[arg(long)]
        out: PathBuf,
    },
}

pub(super) fn run(cmd: ConfigCmd) -> i32 {
    match cmd {
        ConfigCmd::Validate { config, output } => validate(&config, output),
        ConfigCmd::Check { config, output } => check(&config, output),
        ConfigCmd::Write { out } => super::config_write::write(&out),
    }
}

fn validate(path: &Path, output: Output) -> i32 {
    match Config::load(path) {
        Ok(c) => {
            if output == Output::Json {
                println!("{}", serde_json::json!({"valid": true, "digest": c.digest, "problems": []}));
            } else {
                println!("{}: ok (digest {})", path.display(), c.digest);
            }
            0
        }
        Err(e) => {
            if output == Output::Json {
                println!("{}", serde_json::json!({"valid": false, "problems": e.problems}));
            } else {
                eprintln!("error: {e}");
            }
            EX_USAGE
        }
    }
}

fn check(path: &Path, output: Output) -> i32 {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return 1;
        }
    };
    let checks = rt.block_on(crate::config_check::run(path));
    let failed = checks.iter().any(|c| c.status == crate::config_check::Status::Fail);
    if output == Output::Json {
        println!("{}", serde_json::json!({ "ok": !failed, "checks": checks }));
    } else {
        for c in &checks {
            println!("{:<5} {:<16} {}", c.status.label(), c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("{:<22} fix: {fix}", "");
            }
        }
        println!("{}", if failed { "some checks failed" } else { "all checks passed" });
    }
    i32::from(failed)
}
