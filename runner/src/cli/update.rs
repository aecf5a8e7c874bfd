//! `byoc-runner update status | pin | unpin | rollback` for the customer, and the
//! hidden `update apply` the updater unit runs (docs/OPERATIONS.md, "Updates").

use std::path::{Path, PathBuf};

use clap::Subcommand;

use super::{Output, StateArgs, print_json, state_dir};
use crate::config::{Config, DEFAULT_CONFIG_PATH};
use crate::update::{self, apply, release};

#[derive(Subcommand)]
pub enum UpdateCmd {
    /// The running version, the customer's terms (mode, pin, release key), a pending
    /// update, the last outcome and the releases kept for rollback.
    Status {
        #[command(flatten)]
        state: StateArgs,
        #[command(flatten)]
        root: RootArg,
    },
    /// Let in only VERSION, or a range (">= 0.2.0, < 0.3.0"); takes precedence over
    /// [update] pin. Needs root or roles.admin_group.
    ///
    /// Example: byoc-runner update pin 0.2.1
    Pin {
        #[command(flatten)]
        state: StateArgs,
        version: String,
    },
    /// Undo `update pin` ([update] pin in the config applies again, if set).
    Unpin(StateArgs),
    /// Go back to the previous kept release (or --to VERSION), no older than the
    /// current release allows. The updater drains the runner, installs it and checks
    /// its health; if it is not healthy, the current version is installed again. Root.
    Rollback {
        #[command(flatten)]
        state: StateArgs,
        /// A kept version (`update status` lists them); default: the newest older one.
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        root: RootArg,
    },
    /// The updater: apply the staged update, if any (byoc-runner-update.service).
    #[command(hide = true)]
    Apply {
        #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        /// Default: var/lib/byoc-runner-update under --root.
        #[arg(long)]
        updater_dir: Option<PathBuf>,
        #[command(flatten)]
        root: RootArg,
        /// The systemctl that stops and starts byoc-runner.service.
        #[arg(long, default_value = "systemctl")]
        systemctl: PathBuf,
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
        UpdateCmd::Apply { config, updater_dir, root, systemctl } => {
            let updater_dir = updater_dir.unwrap_or_else(|| update::updater_dir(&root.root));
            apply_staged(&config, updater_dir, root.root, systemctl)
        }
    }
}

fn status(s: &StateArgs, root: &Path) -> anyhow::Result<()> {
    let updater_dir = update::updater_dir(root);
    let dir = state_dir(s);
    let config = Config::load(&s.config).ok();
    let terms = config.as_ref().map(|c| &c.update);
    let pin_file: Option<update::PinRecord> =
        std::fs::read(update::pin_path(&dir)).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let pin = pin_file
        .as_ref()
        .map(|p| format!("{} (set by {} with `update pin`)", p.pin, p.by))
        .or_else(|| terms.and_then(|t| t.pin.as_ref()).map(|p| format!("{} ([update] pin)", p.as_str())));
    let pending: Option<update::Request> =
        std::fs::read(update::request_path(&dir)).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let last: Option<update::Outcome> = [updater_dir.join("last.json"), update::outcome_path(&dir)]
        .iter()
        .find_map(|p| std::fs::read(p).ok().and_then(|b| serde_json::from_slice(&b).ok()));
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
    let who = crate::roles::pause::authorize(super::state::admin_group(s).as_deref())?;
    update::version::Pin::parse(pin).map_err(|e| anyhow::anyhow!("{e}"))?;
    let dir = state_dir(s);
    anyhow::ensure!(
        dir.is_dir(),
        "state dir {} does not exist (is the runner installed here?)",
        dir.display()
    );
    let record = update::PinRecord { pin: pin.trim().to_string(), by: who, at_ms: crate::clock::now_ms() };
    std::fs::create_dir_all(crate::state_dir::StateDir::of(&dir).control())?;
    crate::state_dir::write(&update::pin_path(&dir), &serde_json::to_vec_pretty(&record)?, 0o644)?;
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
    crate::roles::pause::authorize(super::state::admin_group(s).as_deref())?;
    let path = update::pin_path(&state_dir(s));
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

/// Stage a kept release as a rollback request; the updater's path unit applies it.
fn rollback(s: &StateArgs, to: Option<&str>, root: &Path) -> anyhow::Result<()> {
    let updater_dir = &update::updater_dir(root);
    anyhow::ensure!(nix::unistd::geteuid().is_root(), "rolling back installs a package: run it as root");
    let config = Config::load(&s.config).map_err(|e| anyhow::anyhow!("{e}"))?;
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
            .ok_or_else(|| anyhow::anyhow!("{v} is not kept (kept: {})", kept.join(", ")))?,
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
    let found = release::verify_signed(&paths.releases().join(&target), &kept_key, &target)
        .map_err(|e| anyhow::anyhow!("{target}: {e}"))?;
    if let Some(min) = apply::read_kept(&paths, &current).min_rollback_version
        && update::version::compare(&target, &min) == std::cmp::Ordering::Less
    {
        anyhow::bail!("{current} may not be rolled back past {min}");
    }
    let staged = update::staged_dir(&paths.state_dir);
    let _ = std::fs::remove_dir_all(&staged);
    std::fs::create_dir_all(&staged)?;
    for name in found.files() {
        let from = found.dir.join(name);
        if from.exists() {
            std::fs::copy(&from, staged.join(name))?;
        }
    }
    let request = update::Request {
        job_id: format!("local-rollback-{}", crate::clock::now_ms()),
        version: target.clone(),
        from_version: current.clone(),
        package: found.package.clone(),
        package_sha256: found.package_sha256.clone(),
        sums_sha256: found.sums_sha256.clone(),
        min_rollback_version: None,
        rollback: true,
        staged_at_ms: crate::clock::now_ms(),
    };
    crate::state_dir::write(
        &update::request_path(&paths.state_dir),
        &serde_json::to_vec_pretty(&request)?,
        0o644,
    )?;
    give_to_state_owner(&paths.state_dir)?;
    if s.output == Output::Json {
        return print_json(&serde_json::json!({ "rollback": request }));
    }
    println!(
        "rolling back {current} -> {target}: the updater drains the runner, installs it and checks its health \
         (journalctl -u byoc-runner-update -f; `byoc-runner update status` shows the outcome)"
    );
    Ok(())
}

/// What root wrote under `<state dir>/update` belongs to the runner, which removes it.
fn give_to_state_owner(state_dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(state_dir)?;
    let (uid, gid) =
        (Some(nix::unistd::Uid::from_raw(meta.uid())), Some(nix::unistd::Gid::from_raw(meta.gid())));
    let dir = update::dir(state_dir);
    let mut paths = vec![dir.clone(), update::request_path(state_dir), update::staged_dir(state_dir)];
    if let Ok(entries) = std::fs::read_dir(update::staged_dir(state_dir)) {
        paths.extend(entries.filter_map(Result::ok).map(|e| e.path()));
    }
    for p in paths {
        match nix::unistd::chown(&p, uid, gid) {
            // The updater removes the request once it has an outcome.
            Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => anyhow::bail!("chown {}: {e}", p.display()),
        }
    }
    Ok(())
}

fn apply_staged(
    config_path: &Path,
    updater_dir: PathBuf,
    root: PathBuf,
    systemctl: PathBuf,
) -> anyhow::Result<()> {
    anyhow::ensure!(nix::unistd::geteuid().is_root(), "the updater installs packages: it runs as root");
    let config = Config::load(config_path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let paths = apply::Paths { state_dir: config.runner.state_dir.clone(), updater_dir };
    std::fs::create_dir_all(paths.releases())?;
    let host = apply::SystemHost { config: config_path.to_path_buf(), root, systemctl };
    match apply::run(&host, &config, &paths) {
        None => println!("no update is staged"),
        Some(o) => {
            // The outcome file is the runner's to remove once it is audited.
            give_to_state_owner(&paths.state_dir)?;
            println!(
                "{} {} -> {}{}",
                o.result,
                o.from_version,
                o.to_version,
                o.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handing_the_update_dir_back_skips_what_the_updater_already_removed() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(update::staged_dir(d.path())).unwrap();
        std::fs::write(update::staged_dir(d.path()).join("SHA256SUMS"), b"x").unwrap();
        assert!(!update::request_path(d.path()).exists());
        give_to_state_owner(d.path()).expect("a removed request is not an error");
        std::fs::write(update::request_path(d.path()), b"{}").unwrap();
        give_to_state_owner(d.path()).expect("with the request");
    }
}
