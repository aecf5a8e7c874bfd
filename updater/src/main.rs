//! `byoc-runner-updater`: answer the update or rollback that is asked, as root
//! (`byoc-runner-update.service` runs it; see the library's docs for what it trusts).

use std::path::PathBuf;
use std::process::ExitCode;

use byoc_updater::apply::{self, Paths, SystemHost};
use byoc_updater::terms::Terms;

const USAGE: &str = "\
byoc-runner-updater: install a staged, signed byoc-runner release (or root's rollback),
watch its health and roll back without it. Run by byoc-runner-update.service, as root.

usage: byoc-runner-updater [--config PATH] [--root DIR] [--updater-dir DIR] [--systemctl PATH]
  --config PATH       the runner's config ([update] terms, [runner] state_dir);
                      default $BYOC_RUNNER_CONFIG or /etc/byoc-runner/runner.toml
  --root DIR          the root the package is installed under (dpkg --root); default /
  --updater-dir DIR   default var/lib/byoc-runner-update under --root
  --systemctl PATH    what stops and starts byoc-runner.service; default systemctl";

struct Args {
    config: PathBuf,
    root: PathBuf,
    updater_dir: Option<PathBuf>,
    systemctl: PathBuf,
}

fn parse(mut argv: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut args = Args {
        config: std::env::var_os("BYOC_RUNNER_CONFIG")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/etc/byoc-runner/runner.toml")),
        root: PathBuf::from("/"),
        updater_dir: None,
        systemctl: PathBuf::from("systemctl"),
    };
    while let Some(flag) = argv.next() {
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        let mut value = || argv.next().map(PathBuf::from).ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--config" => args.config = value()?,
            "--root" => args.root = value()?,
            "--updater-dir" => args.updater_dir = Some(value()?),
            "--systemctl" => args.systemctl = value()?,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Some(args))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_target(false).without_time().with_writer(std::io::stderr).init();
    let args = match parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("byoc-runner-updater: {e}\n\n{USAGE}");
            return ExitCode::from(64);
        }
    };
    if !nix::unistd::geteuid().is_root() {
        eprintln!("byoc-runner-updater: it installs packages: it runs as root");
        return ExitCode::from(77);
    }
    // Terms it cannot read refuse everything: nothing is installed, the unit fails and
    // says why in the journal.
    let terms = match Terms::load(&args.config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("byoc-runner-updater: the customer's terms cannot be read, nothing is installed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let updater_dir = args.updater_dir.unwrap_or_else(|| byoc_updater::updater_dir(&args.root));
    let paths = Paths { state_dir: terms.state_dir.clone(), updater_dir };
    let host = SystemHost { config: args.config, root: args.root, systemctl: args.systemctl };
    match apply::run(&host, &terms, &paths) {
        None => println!("nothing is asked"),
        Some(o) => println!(
            "{} {} -> {}{}",
            o.result,
            o.from_version,
            o.to_version,
            o.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
        ),
    }
    ExitCode::SUCCESS
}
