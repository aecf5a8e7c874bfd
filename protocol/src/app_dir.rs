//! An app config directory, read into the form a job carries ([`AppConfig`]): the files
//! that decide roles, policies and secrets, and every file they name by path. Shared by
//! the reference control plane (which signs it into jobs) and `byoc-runner app check`.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use crate::{AppConfig, VendorPolicy};

/// Everything the app config holds, or every problem reading it (missing or unreadable
/// files, paths leaving the app's directory).
pub fn load(dir: &Path) -> Result<AppConfig, Vec<String>> {
    let mut problems = Vec::new();
    let read = |p: &Path, problems: &mut Vec<String>| match std::fs::read_to_string(p) {
        Ok(t) => Some(t),
        Err(e) => {
            problems.push(format!("{}: {e}", p.display()));
            None
        }
    };
    if !dir.is_dir() {
        return Err(vec![format!("{}: not a directory", dir.display())]);
    }
    let optional = |name: &str, problems: &mut Vec<String>| {
        let p = dir.join(name);
        if p.exists() { read(&p, problems) } else { None }
    };
    let mut permissions = BTreeMap::new();
    for path in files_in(&dir.join("permissions"), "toml") {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if let Some(t) = read(&path, &mut problems) {
            permissions.insert(name, t);
        }
    }
    let permissions_toml = optional("permissions.toml", &mut problems);
    // The vendor's policies: declared in `policies.toml` (its files travel by path), or
    // else every `policies/*.rego`, for every decided job.
    let policies_toml = optional("policies.toml", &mut problems);
    let mut policies = BTreeMap::new();
    let mut files = BTreeMap::new();
    for path in files_in(&dir.join("policies"), "") {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if policies_toml.is_some() {
            if let Some(t) = read(&path, &mut problems) {
                files.insert(format!("policies/{name}"), t);
            }
        } else if path.extension().is_some_and(|e| e == "rego")
            && let Some(rego) = read(&path, &mut problems)
        {
            policies.insert(name, VendorPolicy { rego, enforcement: None });
        }
    }
    if let Some(text) = &policies_toml {
        for contents in toml_strings(text, &["policy"], "contents") {
            named_file(dir, dir, &contents, &mut files, &mut problems);
        }
    }
    // Role files name their inline policies' contents and boundaries by path.
    let role_texts = permissions
        .iter()
        .map(|(n, t)| (dir.join("permissions").join(n), t.clone()))
        .chain(permissions_toml.iter().map(|t| (dir.join("permissions.toml"), t.clone())))
        .chain(optional("break_glass.toml", &mut Vec::new()).map(|t| (dir.join("break_glass.toml"), t)))
        .collect::<Vec<_>>();
    for (file, text) in &role_texts {
        let Ok(doc) = toml::from_str::<toml::Table>(text) else { continue };
        for role in role_tables(&doc) {
            for p in role.get("policies").and_then(|p| p.as_array()).into_iter().flatten() {
                if let Some(contents) = p.get("contents").and_then(|c| c.as_str())
                    && is_path(contents)
                {
                    named_file(dir, dir, contents, &mut files, &mut problems);
                }
            }
            if let Some(b) = role.get("permissions_boundary").and_then(|b| b.as_str())
                && !b.trim().is_empty()
            {
                // Beside the file that names it, else at the app's root (as the stack).
                let beside = file.parent().unwrap_or(dir);
                let base = if beside.join(b.trim()).is_file() { beside } else { dir };
                named_file(dir, base, b.trim(), &mut files, &mut problems);
            }
        }
    }
    // The customer's secrets: `secrets.toml`, and one file per secret under
    // `secrets/<name>.toml` or `secrets/<group>/<name>.toml`.
    let mut secret_files = BTreeMap::new();
    for path in files_in(&dir.join("secrets"), "toml") {
        let rel = path.strip_prefix(dir).unwrap_or(&path).to_string_lossy().into_owned();
        if let Some(t) = read(&path, &mut problems) {
            secret_files.insert(rel, t);
        }
    }
    if let Ok(groups) = std::fs::read_dir(dir.join("secrets")) {
        let mut groups: Vec<PathBuf> = groups.flatten().map(|g| g.path()).filter(|g| g.is_dir()).collect();
        groups.sort();
        for group in groups {
            for path in files_in(&group, "toml") {
                let rel = path.strip_prefix(dir).unwrap_or(&path).to_string_lossy().into_owned();
                if let Some(t) = read(&path, &mut problems) {
                    secret_files.insert(rel, t);
                }
            }
        }
    }
    let app = AppConfig {
        permissions,
        permissions_toml,
        break_glass: optional("break_glass.toml", &mut problems),
        operation_roles: optional("operation_roles.toml", &mut problems),
        policies,
        policies_toml,
        files,
        secrets: optional("secrets.toml", &mut problems),
        secret_files,
    };
    if problems.is_empty() { Ok(app) } else { Err(problems) }
}

/// A role policy's `contents` that names a file rather than holding the document.
pub fn is_path(contents: &str) -> bool {
    let t = contents.trim();
    !t.is_empty() && !t.starts_with('{') && !t.contains('\n')
}

/// `./a/b` and `a/b` as one key; `None` for a path that leaves the app's directory.
pub fn normalize(path: &str) -> Option<String> {
    let p = Path::new(path.trim());
    let mut parts = Vec::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
            _ => return None,
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Read `path` (relative to `base`, which is `dir` or inside it) into `files` under its
/// path from `dir`.
fn named_file(
    dir: &Path,
    base: &Path,
    path: &str,
    files: &mut BTreeMap<String, String>,
    problems: &mut Vec<String>,
) {
    let from_base = base.strip_prefix(dir).unwrap_or(Path::new("")).join(path.trim());
    let Some(rel) = normalize(&from_base.to_string_lossy()) else {
        problems.push(format!("{path:?}: a path outside the app's directory"));
        return;
    };
    if files.contains_key(&rel) {
        return;
    }
    let full = dir.join(&rel);
    // A symlink could lead out of the app: only the app's own files travel.
    match std::fs::symlink_metadata(&full) {
        Ok(m) if m.file_type().is_file() => match std::fs::read_to_string(&full) {
            Ok(t) => {
                files.insert(rel, t);
            }
            Err(e) => problems.push(format!("{}: {e}", full.display())),
        },
        Ok(_) => problems.push(format!("{}: not a regular file", full.display())),
        // Missing: reported by the declaration that names it (`app check`, the stack).
        Err(_) => {}
    }
}

/// The role tables of a role file: the file itself (`permissions/*.toml`), the
/// single-file layout's tables, or break-glass `[[role]]` entries.
pub fn role_tables(doc: &toml::Table) -> Vec<&toml::Table> {
    let mut out = Vec::new();
    if doc.contains_key("name") {
        out.push(doc);
    }
    for key in ["provision_role", "maintenance_role", "deprovision_role"] {
        if let Some(t) = doc.get(key).and_then(|t| t.as_table()) {
            out.push(t);
        }
    }
    for key in ["custom_roles", "roles", "role"] {
        out.extend(
            doc.get(key).and_then(|a| a.as_array()).into_iter().flatten().filter_map(|t| t.as_table()),
        );
    }
    out
}

fn toml_strings(text: &str, array: &[&str], field: &str) -> Vec<String> {
    let Ok(doc) = toml::from_str::<toml::Table>(text) else { return Vec::new() };
    array
        .iter()
        .filter_map(|a| doc.get(*a).and_then(|v| v.as_array()))
        .flatten()
        .filter_map(|t| t.get(field).and_then(|c| c.as_str()).map(str::to_string))
        .collect()
}

/// The files of `dir` ending in `.ext` (any file when `ext` is empty), sorted.
fn files_in(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        // Regular files only: a symlink could lead out of the app.
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.path())
        .filter(|p| ext.is_empty() || p.extension().is_some_and(|e| e == ext))
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_and_may_not_leave_the_app() {
        assert_eq!(normalize("./policies/a.json").as_deref(), Some("policies/a.json"));
        assert_eq!(normalize("policies//a.json").as_deref(), Some("policies/a.json"));
        assert_eq!(normalize("../secrets.json"), None);
        assert_eq!(normalize("/etc/passwd"), None);
        assert_eq!(normalize("a/../../b"), None);
        assert!(is_path("./policies/s3.json") && !is_path("{\"Version\": \"2012-10-17\"}"));
    }

    #[test]
    fn an_app_directory_carries_the_files_its_declarations_name() {
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let app = d.path();
        let write = |p: &str, t: &str| {
            let path = app.join(p);
            std::fs::create_dir_all(path.parent().unwrap_or(app)).unwrap_or_else(|e| panic!("{e}"));
            std::fs::write(path, t).unwrap_or_else(|e| panic!("{e}"));
        };
        write(
            "permissions.toml",
            "[maintenance_role]\nname = \"x-maint\"\npermissions_boundary = \"./boundary.json\"\n[[maintenance_role.policies]]\nname = \"s3\"\ncontents = \"./policies/s3.json\"\n",
        );
        write("boundary.json", "{}");
        write("policies/s3.json", "{\"Version\": \"2012-10-17\", \"Statement\": []}");
        write("secrets/db/password.toml", "name = \"password\"\n");
        std::os::unix::fs::symlink("/etc/hostname", app.join("policies/leak.json"))
            .unwrap_or_else(|e| panic!("{e}"));
        write("policies.toml", "");
        let loaded = load(app).unwrap_or_else(|p| panic!("{p:?}"));
        assert!(loaded.permissions_toml.is_some() && loaded.permissions.is_empty());
        assert_eq!(loaded.files.keys().collect::<Vec<_>>(), ["boundary.json", "policies/s3.json"]);
        assert_eq!(loaded.secret_files.keys().collect::<Vec<_>>(), ["secrets/db/password.toml"]);
        assert!(!loaded.files.contains_key("policies/leak.json"), "a symlink is not the app's file");

        write(
            "permissions.toml",
            "[maintenance_role]\nname = \"x\"\n[[maintenance_role.policies]]\nname = \"s3\"\ncontents = \"../outside.json\"\n",
        );
        let problems = load(app).unwrap_err();
        assert!(problems[0].contains("outside the app's directory"), "{problems:?}");
    }
}
