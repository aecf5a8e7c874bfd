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
  --systemctl PATH    what stops and starts byoc-runner.service; default systemctl

For user-data, which runs as root in the runner's state directory (never through a link):
       byoc-runner-updater put-dir PATH --mode MODE --owner UID:GID
       byoc-runner-updater put-file PATH --mode MODE --owner UID:GID < CONTENT";

/// `put-dir` / `put-file`: the path, mode and owner.
fn put(kind: &str, mut argv: impl Iterator<Item = String>) -> Result<(), String> {
    let path = argv.next().map(PathBuf::from).ok_or_else(|| format!("{kind} needs a PATH"))?;
    let (mut mode, mut owner) = (None, None);
    while let Some(flag) = argv.next() {
        let value = argv.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--mode" => {
                mode = Some(
                    u32::from_str_radix(&value, 8).map_err(|_| format!("--mode {value:?} is not octal"))?,
                )
            }
            "--owner" => {
                let (u, g) =
                    value.split_once(':').ok_or_else(|| format!("--owner {value:?} is not UID:GID"))?;
                let id = |s: &str| s.parse::<u32>().map_err(|_| format!("--owner {value:?} is not UID:GID"));
                owner = Some((id(u)?, id(g)?));
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let (Some(mode), Some((uid, gid))) = (mode, owner) else {
        return Err(format!("{kind} needs --mode and --owner"));
    };
    if mode > 0o7777 {
        return Err(format!("--mode {mode:o} is not a file mode"));
    }
    let done = if kind == "put-dir" {
        byoc_updater::place::put_dir(&path, mode, uid, gid)
    } else {
        let mut bytes = Vec::new();
        let max = byoc_updater::place::MAX_FILE_BYTES;
        std::io::Read::read_to_end(&mut std::io::Read::take(std::io::stdin(), max + 1), &mut bytes)
            .map_err(|e| format!("reading standard input: {e}"))?;
        if bytes.len() as u64 > max {
            return Err(format!("the content is larger than {max} bytes"));
        }
        byoc_updater::place::put_file(&path, &bytes, mode, uid, gid)
    };
    done.map_err(|e| format!("{}: {e}", path.display()))
}

/// Requests answered in one run at most.
const MAX_ANSWERS: usize = 16;

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
    let mut argv = std::env::args().skip(1).peekable();
    if let Some(kind) = argv.peek().cloned().filter(|a| a == "put-dir" || a == "put-file") {
        argv.next();
        return match put(&kind, argv) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("byoc-runner-updater {kind}: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let args = match parse(argv) {
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
    // Whatever was asked while it ran too (its path unit does not start it again for a
    // change made while it runs); bounded, so that a flood of requests cannot hold it.
    for answered in 0..MAX_ANSWERS {
        match apply::run(&host, &terms, &paths) {
            None => {
                if answered == 0 {
                    println!("nothing is asked");
                }
                break;
            }
            Some(o) => println!(
                "{} {} -> {}{}",
                o.result,
                o.from_version,
                o.to_version,
                o.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
            ),
        }
    }
    ExitCode::SUCCESS
}
