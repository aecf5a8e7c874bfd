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
    work: PathBuf,
    root: PathBuf,
    data: PathBuf,
    sandboxed: bool,
    /// The verified cache tree bound at `providers/`, when the job names a mirror.
    mirror: Option<PathBuf>,
    /// The job names a provider mirror (see [`Self::verify_installed`]).
    uses_mirror: bool,
    /// The module was staged for apply: from now on terraform writes the state there
    /// (before, only job code could have: plan never writes it).
    apply_staged: std::sync::atomic::AtomicBool,
}

/// In the tree, once the module is staged for apply: recovery keeps the state a killed
/// job left only then.
const APPLYING: &str = "applying";

/// Whether a job's module was staged for apply (`None`: no terraform tree, a job of an
/// earlier version).
pub fn apply_staged(work: &Path) -> Option<bool> {
    let tree = crate::beside_work(work, ".tf");
    tree.is_dir().then(|| tree.join(APPLYING).exists())
}

impl RunnerTree {
    /// Both directories, new (one already there is someone else's, as the sealed one).
    pub(super) fn create(ctx: &ExecContext<'_>) -> std::io::Result<RunnerTree> {
        let work = &ctx.settings.work_dir;
        let tree = RunnerTree {
            work: work.clone(),
            root: crate::beside_work(work, ".tf"),
            data: crate::beside_work(work, ".tfdata"),
            sandboxed: ctx.settings.sandbox.is_some(),
            mirror: None,
            apply_staged: std::sync::atomic::AtomicBool::new(false),
            uses_mirror: false,
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
        self.seen("providers")
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

    /// Serve the job's mirror: the verified cache tree, bound read-only. Without the
    /// sandbox nothing can be bound: a copy of the job's own (the job runs as the
    /// runner then, and could change the cache entry itself).
    pub(super) fn use_mirror(&mut self, tree: &Path) -> std::io::Result<()> {
        self.uses_mirror = true;
        if self.sandboxed {
            self.mirror = Some(tree.to_path_buf());
        } else {
            crate::artifact::copy_tree(tree, &self.root.join("providers"))?;
        }
        Ok(())
    }

    /// Every provider package init installed from the job's mirror is the verified one:
    /// terraform's link to the package in the mirror as served, or a copy whose every
    /// file is byte for byte the mirror's. Called once the data directory is frozen (or,
    /// without the sandbox, once nothing of the job runs), before anything renders or
    /// applies with them. Without a job's mirror there is nothing of the runner's to
    /// compare with: the customer's provider installation decides.
    pub(super) fn verify_installed(&self) -> Result<usize, String> {
        if !self.uses_mirror {
            return Ok(0);
        }
        let served = self.providers();
        let source = self.mirror.clone().unwrap_or_else(|| self.root.join("providers"));
        let installed = self.data.join("providers");
        let mut packages = Vec::new();
        collect_packages(&installed, PathBuf::new(), &mut packages)?;
        for rel in &packages {
            let at = installed.join(rel);
            let meta = std::fs::symlink_metadata(&at).map_err(|e| format!("{}: {e}", rel.display()))?;
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&at).map_err(|e| format!("{}: {e}", rel.display()))?;
                if target != served.join(rel) {
                    return Err(format!(
                        "{} leads to {}, not the mirror's package",
                        rel.display(),
                        target.display()
                    ));
                }
            } else if meta.is_dir() && source.join(rel).is_dir() {
                same_tree(&at, &source.join(rel)).map_err(|why| format!("{}: {why}", rel.display()))?;
            } else if meta.is_dir() {
                // A packed mirror (`terraform providers mirror`'s default): the package's
                // zip, which init unpacked.
                same_as_zip(&at, &packed(&source, rel)).map_err(|why| format!("{}: {why}", rel.display()))?;
            } else {
                return Err(format!("{} is not a provider package", rel.display()));
            }
        }
        Ok(packages.len())
    }

    /// Mark the module as staged for apply (see [`apply_staged`]), on disk first.
    pub(super) fn mark_apply_staged(&self) -> std::io::Result<()> {
        std::fs::write(self.root.join(APPLYING), b"")?;
        std::fs::File::open(&self.root)?.sync_all()?;
        self.apply_staged.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn is_apply_staged(&self) -> bool {
        self.apply_staged.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// An empty directory the render gets as its `/work`: it needs none, and what its
    /// providers write there reaches nothing.
    pub(super) fn render_scratch(&self) -> std::io::Result<PathBuf> {
        let dir = crate::beside_work(&self.work, ".render");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        Ok(dir)
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
        let _ = std::fs::remove_dir_all(crate::beside_work(&self.work, ".render"));
    }
}

/// terraform's installed packages: `HOST/NAMESPACE/TYPE/VERSION/OS_ARCH` under
/// `dir`, every level above a package a real directory (no link followed).
fn collect_packages(dir: &Path, rel: PathBuf, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = match std::fs::read_dir(dir.join(&rel)) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && rel.as_os_str().is_empty() => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", rel.display())),
    };
    for entry in entries {
        let entry = entry.map_err(|e| e.to_string())?;
        let next = rel.join(entry.file_name());
        if next.components().count() == 5 {
            out.push(next);
        } else if entry.file_type().map_err(|e| e.to_string())?.is_dir() {
            collect_packages(dir, next, out)?;
        } else {
            return Err(format!("{} is not a directory of terraform's provider layout", next.display()));
        }
    }
    Ok(())
}

/// Where a packed mirror keeps `HOST/NS/TYPE/VERSION/OS_ARCH`:
/// `HOST/NS/TYPE/terraform-provider-TYPE_VERSION_OS_ARCH.zip`.
fn packed(source: &Path, rel: &Path) -> PathBuf {
    let parts: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    match parts.as_slice() {
        [host, ns, kind, version, platform] => source
            .join(host)
            .join(ns)
            .join(kind)
            .join(format!("terraform-provider-{kind}_{version}_{platform}.zip")),
        _ => source.join(rel),
    }
}

/// `dir` holds exactly the regular files of the zip at `zip`, byte for byte.
fn same_as_zip(dir: &Path, zip: &Path) -> Result<(), String> {
    let bytes = std::fs::read(zip).map_err(|e| format!("no package of the mirror's ({e})"))?;
    let files = super::planfile::zip_files(&bytes, MAX_PROVIDER_FILE_BYTES)?;
    let mut found = Vec::new();
    list_files(dir, PathBuf::new(), &mut found)?;
    found.sort();
    let mut want: Vec<&String> = files.iter().map(|(n, _)| n).collect();
    want.sort();
    if found.iter().map(|p| p.to_string_lossy().into_owned()).collect::<Vec<_>>()
        != want.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    {
        return Err("its files are not the package's".into());
    }
    for (name, data) in &files {
        if !same_file(&dir.join(name), data)? {
            return Err(format!("{name} is not the package's"));
        }
    }
    Ok(())
}

/// A provider binary is large: at most this much of one file is compared.
const MAX_PROVIDER_FILE_BYTES: u64 = 2 << 30;

/// Regular files under `dir`, relative; anything else (a link) refused.
fn list_files(dir: &Path, rel: PathBuf, out: &mut Vec<PathBuf>) -> Result<(), String> {
    for entry in std::fs::read_dir(dir.join(&rel)).map_err(|e| e.to_string())? {
        let entry = entry.map_err(|e| e.to_string())?;
        let t = entry.file_type().map_err(|e| e.to_string())?;
        let next = rel.join(entry.file_name());
        if t.is_dir() {
            list_files(dir, next, out)?;
        } else if t.is_file() {
            out.push(next);
        } else {
            return Err(format!("{} is not a regular file", next.display()));
        }
    }
    Ok(())
}

/// The file at `path` (never through a link) holds exactly `data`, read in pieces.
fn same_file(path: &Path, data: &[u8]) -> Result<bool, String> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut at = 0;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            return Ok(at == data.len());
        }
        if data.get(at..at + n) != Some(&buf[..n]) {
            return Ok(false);
        }
        at += n;
    }
}

/// `a` holds exactly `b`'s regular files and directories, byte for byte (no link).
fn same_tree(a: &Path, b: &Path) -> Result<(), String> {
    let names = |d: &Path| -> Result<std::collections::BTreeSet<std::ffi::OsString>, String> {
        std::fs::read_dir(d)
            .map_err(|e| format!("{}: {e}", d.display()))?
            .map(|e| e.map(|e| e.file_name()).map_err(|e| e.to_string()))
            .collect()
    };
    let (ours, theirs) = (names(a)?, names(b)?);
    if ours != theirs {
        return Err("its files are not the mirror's".into());
    }
    for name in ours {
        let (x, y) = (a.join(&name), b.join(&name));
        let (mx, my) = (
            std::fs::symlink_metadata(&x).map_err(|e| e.to_string())?,
            std::fs::symlink_metadata(&y).map_err(|e| e.to_string())?,
        );
        if mx.is_dir() && my.is_dir() {
            same_tree(&x, &y)?;
        } else if !(mx.is_file() && my.is_file() && same_files(&x, &y)?) {
            return Err(format!("{} is not the mirror's", name.to_string_lossy()));
        }
    }
    Ok(())
}

/// Two regular files (neither through a link) with the same bytes, compared in pieces
/// (a provider binary is hundreds of MiB).
fn same_files(a: &Path, b: &Path) -> Result<bool, String> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let open = |p: &Path| {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(p)
            .map_err(|e| format!("{}: {e}", p.display()))
    };
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (ma, mb) = (fa.metadata().map_err(|e| e.to_string())?, fb.metadata().map_err(|e| e.to_string())?);
    if ma.len() != mb.len() {
        return Ok(false);
    }
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = fa.read(&mut ba).map_err(|e| e.to_string())?;
        if n == 0 {
            return Ok(true);
        }
        fb.read_exact(&mut bb[..n]).map_err(|e| e.to_string())?;
        if ba[..n] != bb[..n] {
            return Ok(false);
        }
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
/// providers and modules it would run), implied provider mirrors (`terraform.d/`), CLI
/// configuration (`.terraformrc`, `*.tfrc`) and state (`terraform.tfstate*`: the state
/// is the runner's or the customer's bucket's, never the vendor's to supply). Any path
/// component counts.
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
            n if n.starts_with("terraform.tfstate") => Some("terraform state"),
            _ => None,
        }
    })
}

/// A root-module override file (`override.tf`, `*_override.tf`, and `.tf.json`):
/// terraform merges them last, in name order, so one could replace the backend the
/// runner writes (`zz_byoc_backend_override.tf`). Refused where the runner decides the
/// backend.
pub fn refused_root_override(rel: &Path) -> Option<&'static str> {
    let mut parts = rel.components();
    let (Some(only), None) = (parts.next(), parts.next()) else { return None };
    let name = only.as_os_str().to_string_lossy();
    let stem = name.strip_suffix(".tf").or_else(|| name.strip_suffix(".tf.json"))?;
    (stem == "override" || stem.ends_with("_override"))
        .then_some("an override file in the root module (it could replace the backend the runner configures)")
}

/// The first path under `dir` (relative) a module may not carry, and why (override
/// files too where the runner decides the backend).
pub(super) fn find_refused(
    dir: &Path,
    runner_backend: bool,
) -> std::io::Result<Option<(PathBuf, &'static str)>> {
    fn walk(
        base: &Path,
        dir: &Path,
        runner_backend: bool,
    ) -> std::io::Result<Option<(PathBuf, &'static str)>> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let path = entry.path();
            let rel = path.strip_prefix(base).unwrap_or(&path).to_path_buf();
            let override_file = if runner_backend { refused_root_override(&rel) } else { None };
            if let Some(why) = refused_module_path(&rel).or(override_file) {
                return Ok(Some((rel, why)));
            }
            if entry.file_type()?.is_dir()
                && let Some(found) = walk(base, &path, runner_backend)?
            {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }
    walk(dir, dir, runner_backend)
}

/// A fresh module directory for the next step: whatever the job's processes made of the
/// last one is moved aside and removed (no link followed), the verified module copied
/// in its place.
pub(super) fn restage_module(verified: &Path, module: &Path) -> std::io::Result<()> {
    // Beside the job's directory, where no process of the job can put anything first.
    let aside = crate::beside_work(module.parent().unwrap_or(module), ".old");
    let _ = std::fs::remove_dir_all(&aside);
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
        for state in
            ["terraform.tfstate", "terraform.tfstate.backup", "terraform.tfstate.d/prod/terraform.tfstate"]
        {
            assert!(refused_module_path(Path::new(state)).is_some(), "{state} allowed");
        }
    }

    #[test]
    fn root_override_files_are_refused_where_the_runner_decides_the_backend() {
        for bad in ["override.tf", "zzz_override.tf", "zz_c_override.tf.json", "override.tf.json"] {
            assert!(refused_root_override(Path::new(bad)).is_some(), "{bad} allowed");
        }
        for good in ["main.tf", "modules/net/override.tf", "overrides.tf", "x_override.tfvars", "override"] {
            assert_eq!(refused_root_override(Path::new(good)), None, "{good} refused");
        }
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("zzz_override.tf"), "").expect("write");
        assert!(find_refused(d.path(), true).expect("walk").is_some());
        assert!(find_refused(d.path(), false).expect("walk").is_none());
    }

    #[test]
    fn installed_providers_must_be_the_mirrors_own() {
        let d = tempfile::tempdir().expect("tempdir");
        let pkg = "registry.terraform.io/hashicorp/aws/5.100.0/linux_amd64";
        let mirror = d.path().join("cache");
        std::fs::create_dir_all(mirror.join(pkg)).expect("dirs");
        std::fs::write(mirror.join(pkg).join("terraform-provider-aws"), "verified").expect("write");
        let tree = RunnerTree {
            work: d.path().join("work"),
            root: d.path().join("work.tf"),
            data: d.path().join("work.tfdata"),
            sandboxed: true,
            mirror: Some(mirror.clone()),
            apply_staged: Default::default(),
            uses_mirror: true,
        };
        let installed = tree.data.join("providers").join(pkg);
        std::fs::create_dir_all(installed.parent().expect("parent")).expect("dirs");
        // terraform's link to the package as served: verified.
        std::os::unix::fs::symlink(Path::new("/tf/providers").join(pkg), &installed).expect("link");
        assert_eq!(tree.verify_installed(), Ok(1));
        // A link elsewhere, a copy that differs, a copy with more: refused.
        std::fs::remove_file(&installed).expect("rm");
        std::os::unix::fs::symlink("/work/evil", &installed).expect("link");
        assert!(tree.verify_installed().is_err());
        std::fs::remove_file(&installed).expect("rm");
        std::fs::create_dir(&installed).expect("dir");
        std::fs::write(installed.join("terraform-provider-aws"), "verified").expect("write");
        assert_eq!(tree.verify_installed(), Ok(1));
        std::fs::write(installed.join("terraform-provider-aws"), "changed").expect("write");
        assert!(tree.verify_installed().is_err());
        std::fs::write(installed.join("terraform-provider-aws"), "verified").expect("write");
        std::fs::write(installed.join("extra"), "x").expect("write");
        assert!(tree.verify_installed().is_err());
    }

    #[test]
    fn a_package_from_a_packed_mirror_must_be_its_zips_files() {
        let d = tempfile::tempdir().expect("tempdir");
        let mirror = d.path().join("cache");
        let kind_dir = mirror.join("example.com/acme/fake");
        std::fs::create_dir_all(&kind_dir).expect("dirs");
        let zip =
            crate::terraform::planfile::tests::stored_zip(&[("terraform-provider-fake_v1.0.0", b"verified")]);
        std::fs::write(kind_dir.join("terraform-provider-fake_1.0.0_linux_amd64.zip"), zip).expect("write");
        let tree = RunnerTree {
            work: d.path().join("work"),
            root: d.path().join("work.tf"),
            data: d.path().join("work.tfdata"),
            sandboxed: true,
            mirror: Some(mirror),
            apply_staged: Default::default(),
            uses_mirror: true,
        };
        let installed = tree.data.join("providers/example.com/acme/fake/1.0.0/linux_amd64");
        std::fs::create_dir_all(&installed).expect("dirs");
        std::fs::write(installed.join("terraform-provider-fake_v1.0.0"), "verified").expect("write");
        assert_eq!(tree.verify_installed(), Ok(1));
        std::fs::write(installed.join("terraform-provider-fake_v1.0.0"), "changed!").expect("write");
        assert!(tree.verify_installed().is_err());
    }

    #[test]
    fn a_refused_path_is_found_deep_in_a_tree() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(d.path().join("a/b/.terraform/providers")).expect("dirs");
        std::fs::write(d.path().join("main.tf"), "").expect("write");
        let (rel, _) = find_refused(d.path(), true).expect("walk").expect("found");
        assert_eq!(rel, Path::new("a/b/.terraform"));
        std::fs::remove_dir_all(d.path().join("a")).expect("rm");
        assert!(find_refused(d.path(), true).expect("walk").is_none());
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
