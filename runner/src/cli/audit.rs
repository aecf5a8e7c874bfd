//! `audit verify|tail|show|export|prove`: the signed audit log, offline.

use std::path::{Path, PathBuf};

use clap::Subcommand;

use super::{EX_USAGE, Output, StateArgs, state_dir};

#[derive(clap::Args, Clone)]
pub(super) struct AuditArgs {
    #[command(flatten)]
    state: StateArgs,
    /// The audit directory (default: <state dir>/audit); works on a copy elsewhere too.
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(Subcommand)]
pub(super) enum AuditCmd {
    /// Check every record, the tree, every checkpoint and cosignature; exit 1 naming the
    /// first problem.
    Verify {
        #[command(flatten)]
        a: AuditArgs,
        /// Keys to trust: lines `runner <base64>` and `control-plane <base64>` (default:
        /// the keys stored beside the log).
        #[arg(long)]
        trust: Option<PathBuf>,
    },
    /// Print the last records (follow with -f).
    Tail {
        #[command(flatten)]
        a: AuditArgs,
        #[arg(short = 'n', long, default_value_t = 20)]
        lines: usize,
        #[arg(short = 'f', long)]
        follow: bool,
    },
    /// Print one record.
    Show {
        #[command(flatten)]
        a: AuditArgs,
        seq: u64,
    },
    /// Every record and checkpoint as JSON lines (for a SIEM).
    Export {
        #[command(flatten)]
        a: AuditArgs,
    },
    /// An inclusion proof for a record that a third party can check.
    Prove {
        #[command(flatten)]
        a: AuditArgs,
        seq: u64,
    },
}

pub(super) fn run(cmd: AuditCmd) -> i32 {
    match cmd {
        AuditCmd::Verify { a, trust } => verify(&a, trust.as_deref()),
        cmd => super::edge(|| inspect(cmd)),
    }
}

fn audit_dir(a: &AuditArgs) -> PathBuf {
    a.dir.clone().unwrap_or_else(|| state_dir(&a.state).join(crate::audit::AUDIT_DIR))
}

fn verify(a: &AuditArgs, trust: Option<&Path>) -> i32 {
    let dir = audit_dir(a);
    let (trust, pinned) = match crate::audit::load_trust(&dir, trust) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return EX_USAGE;
        }
    };
    match byoc_audit::verify::verify_dir(&dir, &trust) {
        Ok(report) => {
            if a.state.output == Output::Json {
                println!("{}", serde_json::json!({"ok": true, "keys_pinned": pinned, "report": report}));
            } else {
                println!(
                    "ok: {} records, {} checkpoints, {} acknowledged by the control plane (up to {}), root {}",
                    report.records,
                    report.checkpoints,
                    report.cosigned,
                    report.acknowledged_size,
                    report.root
                );
                if !pinned {
                    println!("note: keys taken from {} (pin them with --trust FILE)", dir.display());
                }
            }
            0
        }
        Err(e) => {
            if a.state.output == Output::Json {
                println!("{}", serde_json::json!({"ok": false, "error": e.to_string(), "detail": e}));
            } else {
                eprintln!("FAILED: {e}");
            }
            1
        }
    }
}

fn inspect(cmd: AuditCmd) -> anyhow::Result<()> {
    use anyhow::Context as _;
    match cmd {
        AuditCmd::Verify { .. } => unreachable!("handled before"),
        AuditCmd::Tail { a, lines, follow } => {
            let dir = audit_dir(&a);
            let all = byoc_audit::log::read_lines(&dir, 0, u64::MAX)?;
            let mut printed = all.len();
            for l in all.iter().skip(all.len().saturating_sub(lines)) {
                println!("{l}");
            }
            if !follow {
                return Ok(());
            }
            loop {
                // A file has no change notification we can rely on everywhere; poll gently.
                std::thread::sleep(std::time::Duration::from_millis(500));
                let more = byoc_audit::log::read_lines(&dir, printed as u64, u64::MAX)?;
                printed += more.len();
                for l in more {
                    println!("{l}");
                }
            }
        }
        AuditCmd::Show { a, seq } => {
            let dir = audit_dir(&a);
            let line = byoc_audit::log::read_lines(&dir, seq, seq + 1)?
                .pop()
                .with_context(|| format!("no record {seq} in {}", dir.display()))?;
            if a.state.output == Output::Json {
                println!("{line}");
            } else {
                let v: serde_json::Value = serde_json::from_str(&line)?;
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
            Ok(())
        }
        AuditCmd::Export { a } => {
            let dir = audit_dir(&a);
            for l in byoc_audit::log::read_lines(&dir, 0, u64::MAX)? {
                println!("{{\"type\":\"record\",\"record\":{l}}}");
            }
            for (file, kind) in
                [(byoc_audit::log::CHECKPOINTS, "checkpoint"), (byoc_audit::log::COSIGNED, "cosigned")]
            {
                for c in byoc_audit::log::read_checkpoints(&dir.join(file)) {
                    println!("{}", serde_json::json!({"type": kind, "size": c.size, "note": c.note}));
                }
            }
            Ok(())
        }
        AuditCmd::Prove { a, seq } => {
            let proof = crate::audit::prove(&audit_dir(&a), seq)?;
            println!("{}", serde_json::to_string_pretty(&proof)?);
            Ok(())
        }
    }
}
