//! What terraform runs with that no process of the job can write. Everything a step
//! whose output the runner believes (the render) or that holds the role's credentials
//! (the apply) runs, or reads as configuration, comes from here:
//!
//! ```text
//! <work>.tf/        the runner's, bound read-only at /tf in every terraform sandbox
//!   home/           HOME: empty, so no ~/.terraformrc or ~/.terraform.d is ever read
//!   cli.tfrc        TF_CLI_CONFIG_FILE: the customer's file, the job's mirror, or empty
//!   providers/      mount point of the job's provider mirror (the verified cache entry, read-only)
//!   module/         the module as verified (artifact and inline files): every step's
//!                   module directory is a fresh copy of it
//! <work>.tfdata/    TF_DATA_DIR at /tfdata: written by `init` alone, frozen (read-only)
//!                   before the first program of the job's (plan) starts
//! ```
//!
//! Without the sandbox the same directories are used by their host paths (nothing is
//! frozen then: the customer switched isolation off).

use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};

use byoc_sandbox::spec::Bind;

use crate::ExecContext;

/// Where the tree and the data directory appear inside the sandbox.
pub(super) const TREE_INSIDE: &str = "/tf";
pub(super) const DATA_INSIDE: &str = "/tfdata";
/// The lock file terraform keeps beside the module (and inside every plan file).
pub(super) const LOCK_FILE: &str = ".terraform.lock.hcl";
/// Largest customer CLI configuration the runner copies.
const MAX_CLI_CONFIG_BYTES: u64 = 1 << 20;

/// Reason code: the customer's `terraform.cli_config_file` cannot be read.
pub(super) const CONFIG_UNREADABLE: &str = "terraform_config_unreadable";

pub(super) struct RunnerTree {
    root: PathBuf,
    data: PathBuf,
    sandboxed: bool,
    /// The verified cache tree bound at `providers/`, when the job names a mirror.
    mirror: Option<PathBuf>,
}

impl RunnerTree {
    /// Both directories, new (one already there is someone else's, as the sealed one).
    pub(super) fn create(ctx: &ExecContext<'_>) -> std::io::Result<RunnerTree> {
        let work = &ctx.settings.work_dir;
        let tree = RunnerTree {
            root: crate::beside_work(work, ".tf"),
            data: crate::beside_work(work, ".tfdata"),
            sandboxed: ctx.settings.sandbox.is_some(),
            mirror: None,
        };
        let mut dirs = std::fs::DirBuilder::new();
        dirs.mode(0o755).create(&tree.root)?;
        for sub in ["home", "providers", "module"] {
            dirs.create(tree.root.join(sub))?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(&tree.data)?;
        // init writes the data directory as the job's uid (the runner's, unless it runs
        // as root and maps another).
        if let Some(s) = &ctx.settings.sandbox
            && nix::unistd::geteuid().is_root()
        {
            std::os::unix::fs::lchown(&tree.data, Some(s.host_uid), Some(s.host_gid))?;
        }
        Ok(tree)
    }

    /// `rel` of the tree as terraform sees it.
    fn seen(&self, rel: &str) -> PathBuf {
        if self.sandboxed { Path::new(TREE_INSIDE).join(rel) } else { self.root.join(rel) }
    }

    pub(super) fn home(&self) -> PathBuf {
        self.seen("home")
    }

    pub(super) fn cli_config(&self) -> PathBuf {
        self.seen("cli.tfrc")
    }

    pub(super) fn providers(&self) -> PathBuf {
        match (&self.mirror, self.sandboxed) {
            (Some(m), false) => m.clone(),
            _ => self.seen("providers"),
        }
    }

    pub(super) fn data_dir(&self) -> PathBuf {
        if self.sandboxed { PathBuf::from(DATA_INSIDE) } else { self.data.clone() }
    }

    /// The verified module, on the host.
    pub(super) fn module(&self) -> PathBuf {
        self.root.join("module")
    }

    pub(super) fn write_cli_config(&self, text: &[u8]) -> std::io::Result<()> {
        std::fs::write(self.root.join("cli.tfrc"), text)
    }

    /// Serve the job's mirror (a verified cache tree, never changed through this bind).
    pub(super) fn use_mirror(&mut self, tree: &Path) {
        self.mirror = Some(tree.to_path_buf());
    }

    /// The sandbox's binds: the tree and the mirror read-only, the data directory
    /// writable only for a sandbox whose first program is `init` (a later stage freezes
    /// it, see [`Self::data_dir`]).
    pub(super) fn binds(&self, data_writable: bool) -> Vec<Bind> {
        let mut binds = vec![Bind { host: self.root.clone(), inside: TREE_INSIDE.into(), writable: false }];
        if let Some(m) = &self.mirror {
            binds.push(Bind {
                host: m.clone(),
                inside: Path::new(TREE_INSIDE).join("providers"),
                writable: false,
            });
        }
        binds.push(Bind { host: self.data.clone(), inside: DATA_INSIDE.into(), writable: data_writable });
        binds
    }
}

impl Drop for RunnerTree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// The customer's CLI configuration, read by the runner (the sandbox hides the
/// runner's configuration directory) to be copied into the tree.
pub(super) fn read_customer_cli_config(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read as _;
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let meta = f.metadata().map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    let mut bytes = Vec::new();
    f.take(MAX_CLI_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_CLI_CONFIG_BYTES {
        return Err(format!("{} is larger than {MAX_CLI_CONFIG_BYTES} bytes", path.display()));
    }
    Ok(bytes)
}

/// What a module may not carry: terraform's working data (`.terraform/`: installed
/// providers and modules it would run), implied provider mirrors (`terraform.d/`) and
/// CLI configuration (`.terraformrc`, `*.tfrc`). Any path component counts.
pub fn refused_module_path(rel: &Path) -> Option<&'static str> {
    rel.components().find_map(|c| {
        let name = c.as_os_str().to_string_lossy();
        match name.as_ref() {
            ".terraform" => {
                Some("terraform's working data (.terraform/): providers come only from the runner's mirror")
            }
            "terraform.d" => Some("an implied provider mirror (terraform.d/)"),
            ".terraformrc" | "terraform.rc" => Some("a terraform CLI configuration"),
            n if n.ends_with(".tfrc") => Some("a terraform CLI configuration (*.tfrc)"),
            _ => None,
        }
    })
}

/// The first path under `dir` (relative) a module may not carry, and why.
pub(super) fn find_refused(dir: &Path) -> std::io::Result<Option<(PathBuf, &'static str)>> {
    fn walk(base: &Path, dir: &Path) -> std::io::Result<Option<(PathBuf, &'static str)>> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let path = entry.path();
            let rel = path.strip_prefix(base).unwrap_or(&path).to_path_buf();
            if let Some(why) = refused_module_path(&rel) {
                return Ok(Some((rel, why)));
            }
            if entry.file_type()?.is_dir()
                && let Some(found) = walk(base, &path)?
            {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }
    walk(dir, dir)
}

/// A fresh module directory for the next step: whatever the job's processes made of the
/// last one is moved aside and removed (no link followed), the verified module copied
/// in its place.
pub(super) fn restage_module(verified: &Path, module: &Path) -> std::io::Result<()> {
    let aside = crate::beside_work(module, &format!(".old-{}", std::process::id()));
    match std::fs::rename(module, &aside) {
        Ok(()) => std::fs::remove_dir_all(&aside)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    crate::artifact::copy_tree(verified, module)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terraforms_own_files_are_refused_anywhere_in_a_module() {
        for bad in [
            ".terraform/providers/registry.terraform.io/hashicorp/null/3.2.3/linux_amd64/terraform-provider-null_v3.2.3_x5",
            "modules/net/.terraform/modules/modules.json",
            "terraform.d/plugins/example.com/a/b/1.0.0/linux_amd64/x",
            ".terraformrc",
            "sub/terraform.rc",
            "dev.tfrc",
        ] {
            assert!(refused_module_path(Path::new(bad)).is_some(), "{bad} allowed");
        }
        for good in
            [".terraform.lock.hcl", "main.tf", "terraform.tfvars", "scripts/tfrc.sh", "docs/terraform.md"]
        {
            assert_eq!(refused_module_path(Path::new(good)), None, "{good} refused");
        }
    }

    #[test]
    fn a_refused_path_is_found_deep_in_a_tree() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(d.path().join("a/b/.terraform/providers")).expect("dirs");
        std::fs::write(d.path().join("main.tf"), "").expect("write");
        let (rel, _) = find_refused(d.path()).expect("walk").expect("found");
        assert_eq!(rel, Path::new("a/b/.terraform"));
        std::fs::remove_dir_all(d.path().join("a")).expect("rm");
        assert!(find_refused(d.path()).expect("walk").is_none());
    }

    #[test]
    fn a_restaged_module_is_the_verified_one_whatever_the_job_left() {
        let d = tempfile::tempdir().expect("tempdir");
        let verified = d.path().join("verified");
        let module = d.path().join("work/module");
        std::fs::create_dir_all(&verified).expect("dirs");
        std::fs::write(verified.join("main.tf"), "ok").expect("write");
        std::fs::create_dir_all(&module).expect("dirs");
        std::fs::write(module.join("main.tf"), "changed by the job").expect("write");
        std::fs::write(module.join(".terraformrc"), "dev_overrides").expect("write");
        // A link the job left where the module was: moved aside, never followed.
        let outside = d.path().join("outside");
        std::fs::create_dir_all(&outside).expect("dirs");
        std::fs::write(outside.join("keep"), "runner's").expect("write");
        std::os::unix::fs::symlink(&outside, module.join("link")).expect("link");
        restage_module(&verified, &module).expect("restage");
        assert_eq!(std::fs::read_to_string(module.join("main.tf")).expect("read"), "ok");
        assert!(!module.join(".terraformrc").exists() && !module.join("link").exists());
        assert_eq!(std::fs::read_to_string(outside.join("keep")).expect("read"), "runner's");
        // The module itself a link: replaced, its target untouched.
        std::fs::remove_dir_all(&module).expect("rm");
        std::os::unix::fs::symlink(&outside, &module).expect("link");
        restage_module(&verified, &module).expect("restage");
        assert!(module.join("main.tf").is_file() && outside.join("keep").is_file());
        assert!(!std::fs::symlink_metadata(&module).expect("meta").file_type().is_symlink());
    }
}
