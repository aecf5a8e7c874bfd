//! Loading an app's role config from a directory (`permissions/*.toml`,
//! `break_glass.toml`, `operation_roles.toml`) into the form jobs carry.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// The examples shipped with the repository (`examples/`).
pub fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

pub fn load(dir: &Path) -> anyhow::Result<byoc_protocol::AppConfig> {
    let read = |p: PathBuf| std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()));
    let mut permissions = std::collections::BTreeMap::new();
    let perm_dir = dir.join("permissions");
    for entry in std::fs::read_dir(&perm_dir).with_context(|| format!("reading {}", perm_dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "toml") {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            permissions.insert(name, read(path)?);
        }
    }
    let optional = |name: &str| {
        let p = dir.join(name);
        if p.exists() { read(p).map(Some) } else { Ok(None) }
    };
    // The vendor's policies: declared in `policies.toml` (the files under `policies/`
    // travel by path), or else every `policies/*.rego`, for every decided job.
    let policies_toml = optional("policies.toml")?;
    let mut policies = std::collections::BTreeMap::new();
    let mut files = std::collections::BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(dir.join("policies")) {
        for entry in entries.flatten() {
            let path = entry.path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if policies_toml.is_some() {
                files.insert(format!("policies/{name}"), read(path)?);
            } else if path.extension().is_some_and(|e| e == "rego") {
                policies.insert(name, byoc_protocol::VendorPolicy { rego: read(path)?, enforcement: None });
            }
        }
    }
    // The customer's secrets: `secrets.toml`, and one file per secret under
    // `secrets/<group>/<name>.toml`.
    let mut secret_files = std::collections::BTreeMap::new();
    if let Ok(groups) = std::fs::read_dir(dir.join("secrets")) {
        for group in groups.flatten().filter(|g| g.path().is_dir()) {
            for entry in std::fs::read_dir(group.path())?.flatten() {
                let path = entry.path();
                if path.extension().is_some_and(|e| e == "toml") {
                    let rel = path.strip_prefix(dir).unwrap_or(&path).to_string_lossy().into_owned();
                    secret_files.insert(rel, read(path)?);
                }
            }
        }
    }
    Ok(byoc_protocol::AppConfig {
        permissions,
        break_glass: optional("break_glass.toml")?,
        operation_roles: optional("operation_roles.toml")?,
        policies,
        policies_toml,
        files,
        secrets: optional("secrets.toml")?,
        secret_files,
    })
}
