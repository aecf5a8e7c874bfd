//! Terraform providers without the internet: a provider mirror shipped as an OCI
//! artifact (terraform's filesystem-mirror layout, `HOST/NAMESPACE/TYPE/…`) is fetched by
//! digest like any component, linked into the job's directory, and named in a CLI
//! configuration the runner writes: those providers come from the mirror and nowhere
//! else (`filesystem_mirror` + `direct { exclude }`), so an install whose egress reaches
//! only AWS's endpoints can still `terraform init`.

use std::path::Path;

use crate::tool::failed;
use crate::{ExecContext, ExecOutcome};

/// The job's provider mirror, beside (not inside) the module: it is never handed to the
/// job's uid, so the job can read it and change nothing (its files are hard links to
/// the verified cache).
pub const MIRROR_DIR: &str = "providers";
/// The CLI configuration the runner writes for the job.
pub const CLI_CONFIG: &str = "byoc-terraform.rc";

/// Every provider address (`HOST/NAMESPACE/TYPE`) in a filesystem mirror.
pub fn addresses(mirror: &Path) -> std::io::Result<Vec<String>> {
    let mut out = Vec::new();
    let dirs = |p: &Path| -> std::io::Result<Vec<String>> {
        let mut names: Vec<String> = std::fs::read_dir(p)?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect();
        names.sort();
        Ok(names)
    };
    for host in dirs(mirror)? {
        for namespace in dirs(&mirror.join(&host))? {
            for kind in dirs(&mirror.join(&host).join(&namespace))? {
                out.push(format!("{host}/{namespace}/{kind}"));
            }
        }
    }
    Ok(out)
}

/// The CLI configuration: these providers from the mirror at `path` (as the job sees
/// it) and never from the network; any other provider as terraform would fetch it.
pub fn cli_config(path: &Path, providers: &[String]) -> String {
    let list = |v: &[String]| {
        v.iter().map(|p| serde_json::to_string(p).unwrap_or_default()).collect::<Vec<_>>().join(", ")
    };
    format!(
        "provider_installation {{\n  filesystem_mirror {{\n    path    = {}\n    include = [{}]\n  }}\n  direct {{\n    exclude = [{}]\n  }}\n}}\n",
        serde_json::to_string(&path.display().to_string()).unwrap_or_default(),
        list(providers),
        list(providers)
    )
}

/// Link an unpacked tree into `to`: files as hard links (the cache's verified bytes,
/// no copy of a provider's hundreds of MiB), links as links; a copy where linking is
/// impossible (another filesystem).
pub fn link_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(entry.path())?, &target)?;
        } else if kind.is_dir() {
            link_tree(&entry.path(), &target)?;
        } else if kind.is_file() && std::fs::hard_link(entry.path(), &target).is_err() {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

impl super::Terraform {
    /// The provider mirror by digest, linked into the job's directory, and the CLI
    /// configuration naming it (its path as the job sees it, `inside`).
    pub(super) async fn provider_mirror(
        &self,
        ctx: &mut ExecContext<'_>,
        reference: &byoc_oci_sync::Reference,
        inside: &Path,
    ) -> Result<String, ExecOutcome> {
        let fail = |code: &str, why: String| {
            failed(code, why, serde_json::json!({"providers": reference.to_string()}))
        };
        let fetched = match crate::artifact::fetch(&ctx.settings, reference).await {
            Ok(f) => f,
            Err(e) => {
                let _ = ctx.output.write(format!("[terraform] providers {reference}: {e}\n").as_bytes());
                return Err(fail(&e.code(), e.to_string()));
            }
        };
        let mirror = ctx.settings.work_dir.join(MIRROR_DIR);
        link_tree(&fetched.tree, &mirror).map_err(|e| {
            ExecOutcome::failed(format!("linking the provider mirror into the job's directory: {e}"))
        })?;
        let found = addresses(&mirror).unwrap_or_default();
        if found.is_empty() {
            return Err(fail(
                "artifact_invalid",
                format!(
                    "providers {reference}: no HOST/NAMESPACE/TYPE directories (terraform's filesystem-mirror layout)"
                ),
            ));
        }
        let rc = ctx.settings.work_dir.join(CLI_CONFIG);
        std::fs::write(&rc, cli_config(&inside.join(MIRROR_DIR), &found))
            .map_err(|e| ExecOutcome::failed(format!("writing the terraform CLI configuration: {e}")))?;
        if ctx.settings.tools.cli_config_file.is_some() {
            let _ = ctx.output.write(
                b"[terraform] the job's provider mirror replaces terraform.cli_config_file for this job\n",
            );
        }
        let _ = ctx.output.write(
            format!(
                "[terraform] providers {reference}: {} from the mirror, never the network ({}){}\n",
                found.join(", "),
                fetched.digest,
                if fetched.cached { ", cached" } else { ", fetched and verified" }
            )
            .as_bytes(),
        );
        Ok(inside.join(CLI_CONFIG).display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mirror_names_its_providers_and_only_those_skip_the_network() {
        let m = tempfile::tempdir().expect("tempdir");
        for p in [
            "registry.terraform.io/hashicorp/aws/5.70.0/linux_amd64",
            "registry.terraform.io/hashicorp/random/3.6.0/linux_amd64",
            "example.com/acme/fake/1.0.0/linux_amd64",
        ] {
            std::fs::create_dir_all(m.path().join(p)).expect("dirs");
        }
        let found = addresses(m.path()).expect("read");
        assert_eq!(
            found,
            [
                "example.com/acme/fake",
                "registry.terraform.io/hashicorp/aws",
                "registry.terraform.io/hashicorp/random"
            ]
        );
        let rc = cli_config(Path::new("/work/providers"), &found);
        assert!(rc.contains("path    = \"/work/providers\""), "{rc}");
        assert!(
            rc.contains("exclude = [\"example.com/acme/fake\", \"registry.terraform.io/hashicorp/aws\""),
            "{rc}"
        );
    }
}
