//! What a helm upgrade installs is exactly what was judged. helm renders the chart with
//! the cluster's view (`upgrade --install --dry-run=server -o json`: `lookup` answered by
//! the cluster, `.Release.IsUpgrade` and `.Capabilities` as they will be), its output to
//! the runner; the policies judge those manifests, the hooks and the chart's `crds/`.
//! The runner then writes a chart of its own into the sealed directory (read-only to
//! the job) whose one template is `{{ .Files.Get "judged/manifests.yaml" }}` (the judged
//! bytes, which helm inserts without templating them again) and whose `crds/` are the
//! judged ones, and helm installs that: a second render can change nothing, however the
//! original chart uses `lookup`, `rand` or `now`.

use std::path::Path;

use crate::tool::{SealedDir, Step, failed, parse_manifests};

/// The judged chart's directory in the sealed directory.
pub(super) const JUDGED_CHART: &str = "chart";
const JUDGED_FILE: &str = "judged/manifests.yaml";
/// The original chart's CRDs: what helm installs before the first install.
const CRDS_DIR: &str = "crds";
const MAX_CRDS: usize = 256;

/// One rendering, as the runner judges and installs it.
pub(super) struct Rendering {
    /// The manifests and the hooks, as helm rendered them (documents, in order).
    pub(super) text: String,
    /// The chart's CRDs: (file name, content).
    pub(super) crds: Vec<(String, String)>,
    pub(super) name: String,
    pub(super) version: String,
    pub(super) app_version: Option<String>,
}

impl Rendering {
    /// From helm's release JSON (`--dry-run=server -o json`) and the chart's `crds/`.
    pub(super) fn from_release(release: &[u8], crds: Vec<(String, String)>) -> Step<Rendering> {
        let unreadable = |why: String| {
            failed("manifests_unreadable", format!("helm's dry run: {why}"), serde_json::Value::Null)
        };
        let v: serde_json::Value = serde_json::from_slice(release).map_err(|e| unreadable(e.to_string()))?;
        let Some(manifest) = v["manifest"].as_str() else {
            return Err(unreadable("no manifest in the release it printed".into()));
        };
        let mut text = manifest.to_string();
        for hook in v["hooks"].as_array().map(Vec::as_slice).unwrap_or_default() {
            let Some(m) = hook["manifest"].as_str() else {
                return Err(unreadable("a hook without its manifest".into()));
            };
            let path = hook["path"].as_str().unwrap_or("hook");
            text.push_str(&format!("\n---\n# Source: {path}\n{m}\n"));
        }
        let meta = &v["chart"]["metadata"];
        let name = meta["name"].as_str().filter(|n| !n.is_empty()).unwrap_or("release").to_string();
        let version = meta["version"].as_str().filter(|n| !n.is_empty()).unwrap_or("0.0.0").to_string();
        let app_version = meta["appVersion"].as_str().map(str::to_string);
        Ok(Rendering { text, crds, name, version, app_version })
    }

    /// Every document the policies judge: the manifests, the hooks and the CRDs.
    pub(super) fn manifests(&self) -> Step<Vec<serde_json::Value>> {
        let mut all = parse_manifests(&self.text).map_err(|e| {
            failed("manifests_unreadable", format!("helm's dry run: {e}"), serde_json::Value::Null)
        })?;
        for (file, content) in &self.crds {
            all.extend(parse_manifests(content).map_err(|e| {
                failed("manifests_unreadable", format!("crds/{file}: {e}"), serde_json::Value::Null)
            })?);
        }
        Ok(all)
    }

    /// The chart helm installs: the judged bytes and nothing to render.
    pub(super) fn write_chart(&self, sealed: &SealedDir) -> std::io::Result<()> {
        let root = sealed.path.join(JUDGED_CHART);
        for dir in ["templates", "judged", CRDS_DIR] {
            std::fs::create_dir_all(root.join(dir))?;
        }
        // JSON strings are YAML strings: nothing in a name can break out of its value.
        let quote = |s: &str| serde_json::Value::from(s).to_string();
        let mut chart = format!(
            "apiVersion: v2\nname: {}\nversion: {}\ntype: application\ndescription: {}\n",
            quote(&self.name),
            quote(&self.version),
            quote("rendered by helm with the cluster's view and judged by byoc-runner")
        );
        if let Some(app) = &self.app_version {
            chart.push_str(&format!("appVersion: {}\n", quote(app)));
        }
        std::fs::write(root.join("Chart.yaml"), chart)?;
        std::fs::write(
            root.join("templates/judged.yaml"),
            format!("{{{{ .Files.Get {:?} }}}}\n", JUDGED_FILE),
        )?;
        std::fs::write(root.join(JUDGED_FILE), &self.text)?;
        for (file, content) in &self.crds {
            std::fs::write(root.join(CRDS_DIR).join(file), content)?;
        }
        Ok(())
    }
}

/// The chart's own `crds/` (its top level: helm installs these before the first install),
/// read the one safe way: regular files, no link followed, capped.
pub(super) fn chart_crds(work_dir: &Path, chart_dir: &str, max_bytes: u64) -> Step<Vec<(String, String)>> {
    let refused = |e: crate::job_files::JobFileError| {
        failed(e.code(), format!("reading the chart's crds: {e}"), serde_json::Value::Null)
    };
    let dir = work_dir.join(chart_dir).join(CRDS_DIR);
    match std::fs::symlink_metadata(&dir) {
        Err(_) => return Ok(Vec::new()),
        Ok(m) if !m.is_dir() => {
            return Err(failed(
                "job_file_refused",
                format!("{chart_dir}/{CRDS_DIR} is not a directory (a link?)"),
                serde_json::Value::Null,
            ));
        }
        Ok(_) => {}
    }
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| {
            failed("job_file_unreadable", format!("listing the chart's crds: {e}"), serde_json::Value::Null)
        })?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| [".yaml", ".yml", ".json"].iter().any(|x| n.ends_with(x)))
        .collect();
    names.sort();
    if names.len() > MAX_CRDS {
        return Err(failed(
            "job_file_too_large",
            format!("the chart has more than {MAX_CRDS} files in crds/"),
            serde_json::Value::Null,
        ));
    }
    let tree = crate::job_files::JobTree::open(work_dir).map_err(refused)?;
    names
        .into_iter()
        .map(|name| {
            let bytes =
                tree.read(Path::new(chart_dir).join(CRDS_DIR).join(&name), max_bytes).map_err(refused)?;
            let text = String::from_utf8(bytes).map_err(|_| {
                failed("manifests_unreadable", format!("crds/{name}: not UTF-8"), serde_json::Value::Null)
            })?;
            Ok((name, text))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const RELEASE: &str = r#"{"name": "api", "manifest": "---\n# Source: api/templates/svc.yaml\napiVersion: v1\nkind: Service\nmetadata: {name: api}\n",
        "hooks": [{"name": "migrate", "path": "api/templates/job.yaml", "manifest": "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: migrate\n  annotations: {helm.sh/hook: pre-upgrade}\n"}],
        "chart": {"metadata": {"name": "api", "version": "1.2.3", "appVersion": "9"}}, "config": {"password": "never-judged"}}"#;

    #[test]
    fn the_judged_chart_holds_exactly_the_rendered_documents_hooks_and_crds() {
        let crds = vec![(
            "widgets.yaml".to_string(),
            "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata: {name: widgets.example.com}\n"
                .to_string(),
        )];
        let r = Rendering::from_release(RELEASE.as_bytes(), crds).expect("rendering");
        let kinds: Vec<String> = r
            .manifests()
            .expect("manifests")
            .iter()
            .map(|m| m["kind"].as_str().unwrap_or("").to_string())
            .collect();
        assert_eq!(kinds, ["Service", "Job", "CustomResourceDefinition"]);
        assert!(!r.text.contains("never-judged"), "values are not manifests");
        let sealed = tempfile::tempdir().expect("sealed");
        let dir = SealedDir { path: sealed.path().to_path_buf(), inside: "/sealed".into() };
        r.write_chart(&dir).expect("chart");
        let root = sealed.path().join(JUDGED_CHART);
        let read = |p: &str| std::fs::read_to_string(root.join(p)).expect(p);
        assert_eq!(read("templates/judged.yaml"), "{{ .Files.Get \"judged/manifests.yaml\" }}\n");
        assert_eq!(read("judged/manifests.yaml"), r.text);
        assert!(read("crds/widgets.yaml").contains("widgets.example.com"));
        let chart = read("Chart.yaml");
        assert!(
            chart.contains("name: \"api\"")
                && chart.contains("version: \"1.2.3\"")
                && chart.contains("appVersion: \"9\"")
        );
        assert!(!chart.contains("dependencies"), "{chart}");
    }

    #[test]
    fn a_dry_run_that_is_not_a_release_is_refused() {
        for bad in ["not json", "{}", r#"{"manifest": "x", "hooks": [{"name": "h"}]}"#] {
            let e = Rendering::from_release(bad.as_bytes(), vec![]).err().expect(bad);
            assert_eq!(e.outputs["reason"], "manifests_unreadable", "{bad}");
        }
    }

    #[test]
    fn crds_are_read_without_following_links() {
        let work = tempfile::tempdir().expect("work");
        std::fs::create_dir_all(work.path().join("chart/crds")).expect("crds");
        std::fs::write(work.path().join("chart/crds/a.yaml"), "kind: CustomResourceDefinition\n").expect("a");
        std::fs::write(work.path().join("chart/crds/README.md"), "not a crd").expect("readme");
        assert_eq!(chart_crds(work.path(), "chart", 1024).expect("crds").len(), 1);
        std::os::unix::fs::symlink("/etc/passwd", work.path().join("chart/crds/b.yaml")).expect("link");
        let e = chart_crds(work.path(), "chart", 1024).expect_err("refused");
        assert_eq!(e.outputs["reason"], "job_file_refused");
        assert!(chart_crds(work.path(), "nochart", 1024).expect("none").is_empty());
    }
}
