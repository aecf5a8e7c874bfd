//! `byoc-runner update status | pin | unpin | rollback` for the customer
//! (docs/OPERATIONS.md, "Updates"). The updater itself is `byoc-runner-updater`.

use std::path::{Path, PathBuf};

use clap::Subcommand;

use super::{Output, StateArgs, print_json, state_dir};
use crate::config::Config;
use crate::update::{self, release};
use byoc_updater::apply;

#[derive(Subcommand)]
pub enum UpdateCmd {
    /// Version, terms, pending update, last outcome
    ///
    /// The running version, the customer's terms (mode, pin, release key), a pending
    /// update, the last outcome and the releases kept for rollback.
    ///
    /// Example: byoc-runner update status -o json
    Status {
        #[command(flatten)]
        state: StateArgs,
        #[command(flatten)]
        root: RootArg,
    },
    /// Let in only a version or a range of versions
    ///
    /// Takes precedence over [update] pin. Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner update pin ">= 0.2.0, < 0.3.0"
    Pin {
        #[command(flatten)]
        state: StateArgs,
        /// A version (0.2.1) or a range (">= 0.2.0, < 0.3.0").
        version: String,
    },
    /// Undo `update pin`
    ///
    /// [update] pin in the configuration applies again, if set.
    ///
    /// Example: byoc-runner update unpin
    Unpin(StateArgs),
    /// Go back to a kept release (root)
    ///
    /// The previous kept release (or --to VERSION), no older than the current release
    /// allows. The updater drains the runner, installs it and checks its health; if it
    /// is not healthy, the current version is installed again.
    ///
    /// Example: sudo byoc-runner update rollback --to 0.2.0
    Rollback {
        #[command(flatten)]
        state: StateArgs,
        /// A kept version (`update status` lists them); default: the newest older one.
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        root: RootArg,
    },
}

#[derive(clap::Args)]
pub struct RootArg {
    /// The root the package is installed under (`dpkg --root`).
    #[arg(long, default_value = "/")]
    root: PathBuf,
}

pub(super) fn run(cmd: UpdateCmd) -> anyhow::Result<()> {
    match cmd {
        UpdateCmd::Status { state, root } => status(&state, &root.root),
        UpdateCmd::Pin { state, version } => pin(&state, &version),
        UpdateCmd::Unpin(s) => unpin(&s),
        UpdateCmd::Rollback { state, to, root } => rollback(&state, to.as_deref(), &root.root),
    }
}

fn status(s: &StateArgs, root: &Path) -> anyhow::Result<()> {
    let updater_dir = update::updater_dir(root);
    let dir = state_dir(s)?;
    let config = s.config()?;
    let terms = config.as_ref().map(|c| &c.update);
    let pin_file: Option<update::PinRecord> =
        std::fs::read(update::pin_path(&update::terms_dir(&updater_dir)))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
    let pin = pin_file
        .as_ref()
        .map(|p| format!("{} (set by {} with `update pin`)", p.pin, p.by))
        .or_else(|| terms.and_then(|t| t.pin.as_ref()).map(|p| format!("{} ([update] pin)", p.as_str())));
    let pending: Option<update::Request> =
        std::fs::read(update::request_path(&dir)).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let last: Option<update::Outcome> =
        std::fs::read(update::last_path(&updater_dir)).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let kept = kept_versions(&updater_dir);
    let installed = update::installed_version(&update::dpkg_status(root));
    let view = serde_json::json!({
        "running_version": installed.clone().unwrap_or_else(|| update::running_version().to_string()),
        "installed_by_dpkg": installed.is_some(),
        "mode": terms.map(|t| t.mode.as_str()),
        "release_key": terms.and_then(|t| t.release_key.as_ref()).map(|k| k.id()),
        "pin": pin,
        "pending": pending,
        "last": last,
        "kept": kept,
    });
    if s.output == Output::Json {
        return print_json(&view);
    }
    let show = |v: &serde_json::Value| v.as_str().map(str::to_string).unwrap_or_else(|| "-".into());
    println!("version:     {}", show(&view["running_version"]));
    println!("mode:        {}", terms.map(|t| t.mode.as_str()).unwrap_or("(config unreadable)"));
    println!(
        "release key: {}",
        view["release_key"].as_str().unwrap_or("none pinned: every update is refused")
    );
    println!("pin:         {}", view["pin"].as_str().unwrap_or("none"));
    match &pending {
        Some(p) => println!(
            "pending:     {} -> {} (job {}), the updater applies it",
            p.from_version, p.version, p.job_id
        ),
        None => println!("pending:     none"),
    }
    match &last {
        Some(o) => println!(
            "last:        {} {} -> {} at {}{}",
            o.result,
            o.from_version,
            o.to_version,
            crate::clock::rfc3339_ms(o.at_ms),
            o.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
        ),
        None => println!("last:        none"),
    }
    println!("kept:        {}", if kept.is_empty() { "-".to_string() } else { kept.join(", ") });
    Ok(())
}

fn kept_versions(updater_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(updater_dir.join("releases")) else { return Vec::new() };
    let mut v: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|v| update::version::valid(v))
        .collect();
    v.sort_by(|a, b| update::version::compare(b, a));
    v
}

fn pin(s: &StateArgs, pin: &str) -> anyhow::Result<()> {
    let who = crate::roles::pause::authorize(super::state::admin_group(s)?.as_deref())?;
    if let Err(e) = update::version::Pin::parse(pin) {
        super::usage!("{pin:?} is not a version or a range (\"0.2.1\", \">= 0.2.0, < 0.3.0\"): {e}");
    }
    super::control_state_dir(s)?;
    let record = update::PinRecord { pin: pin.trim().to_string(), by: who, at_ms: crate::clock::now_ms() };
    // In the updater's terms directory, which the runner's user cannot write (root
    // makes it, group-writable by roles.admin_group: user-data does).
    let terms = update::terms_dir(&update::own_updater_dir());
    if nix::unistd::geteuid().is_root() && !terms.is_dir() {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new().recursive(true).mode(0o755).create(&terms)?;
    }
    crate::state_dir::write(&update::pin_path(&terms), &serde_json::to_vec_pretty(&record)?, 0o644).map_err(
        |e| anyhow::anyhow!("{}: {e} (root makes that directory: re-run user-data)", terms.display()),
    )?;
    if s.output == Output::Json {
        return print_json(&serde_json::json!({ "pinned": true, "pin": record }));
    }
    println!(
        "pinned to {:?}: updates to other versions are refused (update_pinned) until `byoc-runner update unpin`",
        record.pin
    );
    Ok(())
}

fn unpin(s: &StateArgs) -> anyhow::Result<()> {
    crate::roles::pause::authorize(super::state::admin_group(s)?.as_deref())?;
    let path = update::pin_path(&update::terms_dir(&update::own_updater_dir()));
    let was = match std::fs::remove_file(&path) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(anyhow::anyhow!("removing {}: {e}", path.display())),
    };
    if s.output == Output::Json {
        return print_json(&serde_json::json!({ "pinned": false, "was_pinned": was }));
    }
    println!("{}", if was { "unpinned" } else { "no pin was set with `update pin`" });
    Ok(())
}

/// Ask the updater for a rollback to a kept release: root's request, in the updater's
/// own directory (no request the runner's user can write is ever a rollback). The
/// updater verifies the kept release again and its path unit starts it.
fn rollback(s: &StateArgs, to: Option<&str>, root: &Path) -> anyhow::Result<()> {
    let updater_dir = &update::updater_dir(root);
    anyhow::ensure!(nix::unistd::geteuid().is_root(), "rolling back installs a package: run it as root");
    let config = Config::load(s.config_path()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let key = config
        .update
        .release_key
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no release key is pinned ([update] release_public_key)"))?;
    let current = update::installed_version(&update::dpkg_status(root))
        .ok_or_else(|| anyhow::anyhow!("byoc-runner is not installed by dpkg here"))?;
    let kept = kept_versions(updater_dir);
    let target = match to {
        Some(v) => kept
            .iter()
            .find(|k| k.as_str() == v)
            .cloned()
            .ok_or_else(|| super::UsageError(format!("{v} is not kept (kept: {})", kept.join(", "))))?,
        None => kept
            .iter()
            .find(|k| update::version::compare(k, &current) == std::cmp::Ordering::Less)
            .cloned()
            .ok_or_else(|| {
                anyhow::anyhow!("no release older than {current} is kept (kept: {})", kept.join(", "))
            })?,
    };
    anyhow::ensure!(target != current, "{current} is already running");
    let paths =
        apply::Paths { state_dir: config.runner.state_dir.clone(), updater_dir: updater_dir.to_path_buf() };
    let kept_key = apply::kept_key(&paths, &target, key);
    release::verify_signed(&paths.releases().join(&target), &kept_key, &target)
        .map_err(|e| anyhow::anyhow!("{target}: {e}"))?;
    let request = update::RollbackRequest {
        version: target.clone(),
        by: crate::roles::pause::authorize(None).map_err(|e| anyhow::anyhow!("{e}"))?,
        at_ms: crate::clock::now_ms(),
    };
    crate::state_dir::write(
        &update::rollback_path(updater_dir),
        &serde_json::to_vec_pretty(&request)?,
        0o600,
    )?;
    if s.output == Output::Json {
        return print_json(
            &serde_json::json!({ "rollback": { "from_version": current, "request": request } }),
        );
    }
    println!(
        "rolling back {current} -> {target}: the updater drains the runner, installs it and checks its health \
         (journalctl -u byoc-runner-update -f; `byoc-runner update status` shows the outcome)"
    );
    Ok(())
}
