//! Where a terraform workspace's state lives, so that it never vanishes with a job's
//! scratch directory: the customer's state bucket through terraform's `s3` backend
//! (under the job's role session, one key per workspace, S3 lock files), or, without a
//! bucket, a local state per workspace in the runner's state dir, held with a lock for
//! the whole job, fsynced, the previous versions kept before each change.
//!
//! Either way the runner writes the backend, as an override file terraform merges over
//! whatever backend the module declares; a job may name its own backend only where the
//! customer's configuration allows it.

use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

/// The override file beside the module: terraform reads `*_override.tf` last and its
/// `backend` replaces the module's own.
pub const OVERRIDE_FILE: &str = "zz_byoc_backend_override.tf";
/// The module's local state file, inside the job's directory while the job runs.
pub const LOCAL_STATE: &str = "terraform.tfstate";
/// Previous versions kept per workspace.
const HISTORY: usize = 10;

/// Where state goes (the customer's choice, never the job's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// Per-workspace state files under `root` (`<state dir>/tfstate`).
    Local { root: PathBuf },
    /// The install's state bucket.
    S3 {
        bucket: String,
        region: String,
        /// Keys are `<prefix>/<workspace>/terraform.tfstate`.
        key_prefix: String,
        /// An S3 endpoint other than AWS's (a VPC endpoint; a test server).
        endpoint: Option<String>,
    },
}

#[derive(Debug, Clone)]
pub struct StateSettings {
    pub backend: Backend,
    /// Jobs may bring their own backend (`backend_config`) instead.
    pub allow_job_backend: bool,
}

impl Default for StateSettings {
    fn default() -> Self {
        StateSettings {
            backend: Backend::Local { root: PathBuf::from("/var/lib/byoc-runner/tfstate") },
            allow_job_backend: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(
        "workspace {workspace:?}'s state is held by another job on this runner; it is released when that job ends"
    )]
    Locked { workspace: String },
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("the state terraform left: {0}")]
    JobFile(crate::job_files::JobFileError),
}

impl StateError {
    pub fn code(&self) -> &'static str {
        match self {
            StateError::Locked { .. } => "state_locked",
            StateError::Io { .. } => "state_io",
            StateError::JobFile(e) => e.code(),
        }
    }
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StateError {
    let path = path.to_path_buf();
    move |source| StateError::Io { op, path, source }
}

/// HCL string literal.
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// The backend override for `workspace`.
pub fn override_file(backend: &Backend, workspace: &str) -> String {
    match backend {
        Backend::Local { .. } => {
            format!("terraform {{\n  backend \"local\" {{\n    path = {}\n  }}\n}}\n", quoted(LOCAL_STATE))
        }
        Backend::S3 { bucket, region, key_prefix, endpoint } => {
            let key = format!("{}/{workspace}/terraform.tfstate", key_prefix.trim_matches('/'));
            // No STS call to check the credentials when the backend is configured: the
            // runner renders the plan offline and without credentials (`render`), and
            // terraform configures the plan's backend to do so.
            let mut body = format!(
                "    bucket = {}\n    key = {}\n    region = {}\n    encrypt = true\n    use_lockfile = true\n    skip_metadata_api_check = true\n    skip_credentials_validation = true\n    skip_requesting_account_id = true\n",
                quoted(bucket),
                quoted(&key),
                quoted(region)
            );
            if let Some(url) = endpoint {
                // An endpoint of the customer's.
                body.push_str(&format!(
                    "    endpoints = {{ s3 = {} }}\n    use_path_style = true\n    skip_region_validation = true\n",
                    quoted(url)
                ));
            }
            format!("terraform {{\n  backend \"s3\" {{\n{body}  }}\n}}\n")
        }
    }
}

/// The backend record a plan made under [`override_file`] carries (type and the
/// configuration it sets; terraform stores every other setting as null): what the
/// runner holds a sealed plan to before it is decided or applied.
pub fn plan_backend(backend: &Backend, workspace: &str) -> (&'static str, serde_json::Value) {
    match backend {
        Backend::Local { .. } => ("local", serde_json::json!({"path": LOCAL_STATE})),
        Backend::S3 { bucket, region, key_prefix, endpoint } => {
            let mut config = serde_json::json!({
                "bucket": bucket,
                "key": format!("{}/{workspace}/terraform.tfstate", key_prefix.trim_matches('/')),
                "region": region,
                "encrypt": true,
                "use_lockfile": true,
                "skip_metadata_api_check": true,
                "skip_credentials_validation": true,
                "skip_requesting_account_id": true,
            });
            if let Some(url) = endpoint {
                config["endpoints"] = serde_json::json!({"s3": url});
                config["use_path_style"] = true.into();
                config["skip_region_validation"] = true.into();
            }
            ("s3", config)
        }
    }
}

/// A workspace's local state, held for the whole job: no two jobs on this runner
/// change one workspace at once. Released when dropped (and by the kernel if the
/// runner dies).
pub struct LocalState {
    dir: PathBuf,
    _lock: std::fs::File,
}

impl LocalState {
    pub fn acquire(root: &Path, workspace: &str) -> Result<LocalState, StateError> {
        let dir = root.join(workspace);
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(io("creating", &dir))?;
        let lock_path = dir.join("lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io("opening", &lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StateError::Locked { workspace: workspace.to_string() });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io("locking", &lock_path)(e)),
        }
        Ok(LocalState { dir, _lock: lock })
    }

    /// Whether a job holds the workspace now (`None`: no such workspace). Reads only:
    /// creates nothing, and releases the probe's own lock at once.
    pub fn is_held(root: &Path, workspace: &str) -> std::io::Result<Option<bool>> {
        let lock_path = root.join(workspace).join("lock");
        let lock = match std::fs::File::open(&lock_path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(root.join(workspace).join(LOCAL_STATE).is_file().then_some(false));
            }
            Err(e) => return Err(e),
        };
        match lock.try_lock_shared() {
            Ok(()) => Ok(Some(false)),
            Err(std::fs::TryLockError::WouldBlock) => Ok(Some(true)),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }

    fn stored(&self) -> PathBuf {
        self.dir.join(LOCAL_STATE)
    }

    /// Put the stored state (if any) beside the module, where the backend reads it.
    /// (The runner journals the workspace when the job starts: after a crash it knows
    /// which state the directory holds without reading anything of the job's.)
    pub fn stage(&self, module: &Path) -> Result<(), StateError> {
        let stored = self.stored();
        if stored.is_file() {
            let to = module.join(LOCAL_STATE);
            std::fs::copy(&stored, &to).map_err(io("copying the state to", &to))?;
        }
        Ok(())
    }

    /// Keep what terraform left beside the module, if it changed: the stored version
    /// goes to the history first, the new one is written, fsynced and renamed into
    /// place. Called after every step that may write state, whatever its outcome (a
    /// failed apply's partial state is the truth about what exists). The file is the
    /// job's: read beneath its directory, no link followed, a regular file, capped
    /// (`job_files`); anything else is an error and the stored state stays as it was.
    pub fn keep(&self, module: &Path) -> Result<Option<u64>, StateError> {
        let new = match super::module_file_if_exists(module, LOCAL_STATE, super::MAX_STATE_BYTES) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(None),
            Err(e) => return Err(StateError::JobFile(e)),
        };
        let stored = self.stored();
        let old = std::fs::read(&stored).ok();
        if old.as_deref() == Some(new.as_slice()) {
            return Ok(serial(&new));
        }
        if let Some(old) = &old {
            let history = self.dir.join("history");
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&history)
                .map_err(io("creating", &history))?;
            let name = format!(
                "{:020}-{}.tfstate",
                serial(old).unwrap_or(0),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis())
                    .unwrap_or(0)
            );
            write_durably(&history.join(name), old)?;
            prune(&history);
        }
        write_durably(&stored, &new)?;
        Ok(serial(&new))
    }
}

/// Write `bytes` to `path` through a temporary file: fsynced, renamed, directory fsynced.
fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    byoc_statefs::write(path, bytes, byoc_statefs::Options::mode(0o600)).map_err(io("writing", path))
}

/// Keep the newest `HISTORY` versions.
fn prune(history: &Path) {
    let Ok(entries) = std::fs::read_dir(history) else { return };
    let mut names: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    names.sort();
    let excess = names.len().saturating_sub(HISTORY);
    for old in names.into_iter().take(excess) {
        let _ = std::fs::remove_file(old);
    }
}

/// A state file's serial.
pub fn serial(state: &[u8]) -> Option<u64> {
    serde_json::from_slice::<serde_json::Value>(state).ok()?["serial"].as_u64()
}

/// After a crash: the state a killed job's terraform wrote beside its module is put
/// back into `workspace` (as journaled when the job started) before the job's directory
/// goes. `None` when the directory held none.
pub fn salvage(work_dir: &Path, root: &Path, workspace: &str) -> Result<Option<u64>, StateError> {
    if !super::valid_name(workspace) {
        return Err(StateError::Io {
            op: "naming the workspace of",
            path: work_dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{workspace:?}")),
        });
    }
    let state = LocalState::acquire(root, workspace)?;
    state.keep(&work_dir.join(super::MODULE_DIR))
}

/// What the customer may see of a workspace's state: resource addresses and the
/// serial, never attribute values.
#[derive(Debug, serde::Serialize)]
pub struct Summary {
    pub workspace: String,
    pub serial: Option<u64>,
    pub terraform_version: Option<String>,
    pub resources: Vec<String>,
    pub previous_versions: usize,
    pub bytes: u64,
}

/// Every workspace with local state under `root`.
pub fn list(root: &Path) -> std::io::Result<Vec<Summary>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries.flatten() {
        if entry.path().join(LOCAL_STATE).is_file()
            && let Some(name) = entry.file_name().to_str()
        {
            out.push(show(root, name)?);
        }
    }
    out.sort_by(|a, b| a.workspace.cmp(&b.workspace));
    Ok(out)
}

/// One workspace's summary.
pub fn show(root: &Path, workspace: &str) -> std::io::Result<Summary> {
    let dir = root.join(workspace);
    let bytes = std::fs::read(dir.join(LOCAL_STATE))?;
    let previous_versions = std::fs::read_dir(dir.join("history")).map(|d| d.count()).unwrap_or(0);
    Ok(summarize(workspace, &bytes, previous_versions))
}

/// A state file's summary: addresses, serial and size; attribute values are never read
/// out of it.
pub fn summarize(workspace: &str, state: &[u8], previous_versions: usize) -> Summary {
    let v: serde_json::Value = serde_json::from_slice(state).unwrap_or_default();
    let mut resources: Vec<String> = v["resources"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| {
            let module = r["module"].as_str().map(|m| format!("{m}.")).unwrap_or_default();
            let prefix = if r["mode"] == "data" { "data." } else { "" };
            let base = format!(
                "{module}{prefix}{}.{}",
                r["type"].as_str().unwrap_or("?"),
                r["name"].as_str().unwrap_or("?")
            );
            let instances = r["instances"].as_array().cloned().unwrap_or_default();
            if instances.len() <= 1 && instances.first().is_none_or(|i| i.get("index_key").is_none()) {
                vec![base]
            } else {
                instances.iter().map(|i| format!("{base}[{}]", i["index_key"])).collect()
            }
        })
        .collect();
    resources.sort();
    Summary {
        workspace: workspace.to_string(),
        serial: v["serial"].as_u64(),
        terraform_version: v["terraform_version"].as_str().map(str::to_string),
        resources,
        previous_versions,
        bytes: state.len() as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(serial: u64, resources: &str) -> String {
        format!(
            r#"{{"version":4,"terraform_version":"1.11.4","serial":{serial},"lineage":"l","resources":{resources}}}"#
        )
    }

    #[test]
    fn whether_a_workspace_is_held_is_read_without_creating_anything() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(LocalState::is_held(root.path(), "none").unwrap(), None);
        assert!(!root.path().join("none").exists(), "the probe created the workspace");
        let held = LocalState::acquire(root.path(), "api").expect("lock");
        assert_eq!(LocalState::is_held(root.path(), "api").unwrap(), Some(true));
        drop(held);
        assert_eq!(LocalState::is_held(root.path(), "api").unwrap(), Some(false));
        // The probe let go: a job takes the workspace at once.
        LocalState::acquire(root.path(), "api").expect("lock after the probe");
    }

    #[test]
    fn one_job_at_a_time_holds_a_workspace() {
        let root = tempfile::tempdir().expect("tempdir");
        let held = LocalState::acquire(root.path(), "api").expect("first");
        let e = LocalState::acquire(root.path(), "api").err().expect("second is refused");
        assert_eq!(e.code(), "state_locked");
        assert!(LocalState::acquire(root.path(), "db").is_ok(), "other workspaces are free");
        drop(held);
        assert!(LocalState::acquire(root.path(), "api").is_ok(), "released when the job ends");
    }

    #[test]
    fn state_survives_the_job_and_previous_versions_are_kept() {
        let root = tempfile::tempdir().expect("tempdir");
        let work = tempfile::tempdir().expect("tempdir");
        let module = work.path().join("module");
        std::fs::create_dir_all(&module).expect("module");
        let s = LocalState::acquire(root.path(), "api").expect("lock");
        s.stage(&module).expect("stage");
        assert!(!module.join(LOCAL_STATE).exists(), "nothing stored yet");
        std::fs::write(module.join(LOCAL_STATE), state(1, "[]")).expect("write");
        assert_eq!(s.keep(&module).expect("keep"), Some(1));
        std::fs::write(module.join(LOCAL_STATE), state(2, "[]")).expect("write");
        assert_eq!(s.keep(&module).expect("keep"), Some(2));
        assert_eq!(s.keep(&module).expect("unchanged"), Some(2));
        let history: Vec<_> = std::fs::read_dir(root.path().join("api/history")).expect("history").collect();
        assert_eq!(history.len(), 1, "the serial-1 version, kept before serial 2 replaced it");
        // The next job gets the stored state.
        drop(s);
        let work2 = tempfile::tempdir().expect("tempdir");
        let module2 = work2.path().join("module");
        std::fs::create_dir_all(&module2).expect("module");
        let s = LocalState::acquire(root.path(), "api").expect("lock");
        s.stage(&module2).expect("stage");
        assert_eq!(serial(&std::fs::read(module2.join(LOCAL_STATE)).expect("staged")), Some(2));
    }

    #[test]
    fn a_crashed_jobs_state_is_salvaged_from_its_directory() {
        let root = tempfile::tempdir().expect("tempdir");
        let work = tempfile::tempdir().expect("tempdir");
        let module = work.path().join("module");
        std::fs::create_dir_all(&module).expect("module");
        {
            let s = LocalState::acquire(root.path(), "api").expect("lock");
            s.stage(&module).expect("stage");
            std::fs::write(module.join(LOCAL_STATE), state(7, "[]")).expect("write");
            // The runner dies here: nothing kept.
        }
        assert_eq!(salvage(work.path(), root.path(), "api").expect("salvage"), Some(7));
        assert_eq!(show(root.path(), "api").expect("show").serial, Some(7));
        let empty = tempfile::tempdir().expect("tempdir");
        assert_eq!(salvage(empty.path(), root.path(), "api").expect("nothing"), None);
        // A journaled name is still checked before it names a directory.
        assert!(salvage(work.path(), root.path(), "../elsewhere").is_err());
        assert!(!root.path().join("../elsewhere").exists());
    }

    /// The job's code replaced its state file with a link to a file of the runner's (or
    /// made it a FIFO): nothing is kept, the stored state is unchanged, nothing blocks.
    #[test]
    fn a_state_file_the_job_replaced_with_a_link_or_fifo_is_refused() {
        let root = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        let key = outside.path().join("identity.key");
        std::fs::write(&key, state(99, "[]")).expect("key");
        let work = tempfile::tempdir().expect("tempdir");
        let module = work.path().join("module");
        std::fs::create_dir_all(&module).expect("module");
        let s = LocalState::acquire(root.path(), "api").expect("lock");
        std::fs::write(module.join(LOCAL_STATE), state(1, "[]")).expect("write");
        assert_eq!(s.keep(&module).expect("keep"), Some(1));
        std::fs::remove_file(module.join(LOCAL_STATE)).expect("rm");
        std::os::unix::fs::symlink(&key, module.join(LOCAL_STATE)).expect("link");
        let e = s.keep(&module).expect_err("a link is not read");
        assert_eq!(e.code(), "job_file_refused");
        assert_eq!(show(root.path(), "api").expect("show").serial, Some(1), "the stored state is unchanged");
        std::fs::remove_file(module.join(LOCAL_STATE)).expect("rm");
        nix::unistd::mkfifo(&module.join(LOCAL_STATE), nix::sys::stat::Mode::from_bits_truncate(0o600))
            .expect("fifo");
        assert_eq!(s.keep(&module).expect_err("a FIFO is not read").code(), "job_file_refused");
        // The module directory itself a link to elsewhere: refused as well.
        drop(s);
        std::fs::remove_dir_all(&module).expect("rm");
        std::fs::write(outside.path().join(LOCAL_STATE), state(50, "[]")).expect("elsewhere");
        std::os::unix::fs::symlink(outside.path(), &module).expect("dir link");
        assert!(salvage(work.path(), root.path(), "api").is_err());
        assert_eq!(show(root.path(), "api").expect("show").serial, Some(1));
    }

    #[test]
    fn the_summary_names_resources_not_values() {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(root.path().join("api")).expect("dir");
        let resources = r#"[{"mode":"managed","type":"terraform_data","name":"a","instances":[{"attributes":{"input":"s3cr3t-value"}}]},
            {"mode":"managed","type":"terraform_data","name":"n","instances":[{"index_key":0,"attributes":{}},{"index_key":1,"attributes":{}}]},
            {"module":"module.db","mode":"data","type":"aws_caller_identity","name":"me","instances":[{"attributes":{}}]}]"#;
        std::fs::write(root.path().join("api").join(LOCAL_STATE), state(3, resources)).expect("write");
        let all = list(root.path()).expect("list");
        assert_eq!(all.len(), 1);
        assert_eq!(
            all[0].resources,
            [
                "module.db.data.aws_caller_identity.me",
                "terraform_data.a",
                "terraform_data.n[0]",
                "terraform_data.n[1]"
            ]
        );
        assert_eq!(all[0].serial, Some(3));
        assert!(!serde_json::to_string(&all[0]).unwrap_or_default().contains("s3cr3t"));
    }

    #[test]
    fn the_backend_is_the_customers() {
        let local = override_file(&Backend::Local { root: "/x".into() }, "api");
        assert!(local.contains("backend \"local\"") && local.contains("terraform.tfstate"));
        let s3 = override_file(
            &Backend::S3 {
                bucket: "inst-1-state".into(),
                region: "eu-west-1".into(),
                key_prefix: "inst-1".into(),
                endpoint: None,
            },
            "api",
        );
        assert!(s3.contains("key = \"inst-1/api/terraform.tfstate\""), "{s3}");
        assert!(s3.contains("use_lockfile = true") && s3.contains("encrypt = true"));
        // Configurable offline (the runner renders the plan without credentials), with
        // AWS's own endpoints.
        assert!(s3.contains("skip_credentials_validation = true"), "{s3}");
        assert!(!s3.contains("endpoints") && !s3.contains("skip_region_validation"), "{s3}");
    }
}
