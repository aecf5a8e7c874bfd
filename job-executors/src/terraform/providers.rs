//! Terraform providers without the internet: a provider mirror shipped as an OCI
//! artifact (terraform's filesystem-mirror layout, `HOST/NAMESPACE/TYPE/…`) is fetched by
//! digest like any component, bound read-only into the job's sandbox straight from the
//! verified cache (never linked or copied into a tree the job can write), and named in
//! a CLI configuration the runner writes: those providers come from the mirror and
//! nowhere else (`filesystem_mirror` + `direct { exclude }`), so an install whose egress
//! reaches only AWS's endpoints can still `terraform init`.

use std::path::Path;

use super::tree::RunnerTree;
use crate::tool::failed;
use crate::{ExecContext, ExecOutcome};

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

/// The CLI configuration: these providers from the mirror at `path` (as terraform sees
/// it), and no provider from anywhere else (no `direct`: the network is never asked).
pub fn cli_config(path: &Path, providers: &[String]) -> String {
    let list =
        providers.iter().map(|p| serde_json::to_string(p).unwrap_or_default()).collect::<Vec<_>>().join(", ");
    format!(
        "provider_installation {{\n  filesystem_mirror {{\n    path    = {}\n    include = [{list}]\n  }}\n}}\n",
        serde_json::to_string(&path.display().to_string()).unwrap_or_default(),
    )
}

/// The CLI configuration when neither the job nor the customer names a provider
/// installation: none (terraform's built-in provider only). A customer who wants
/// providers from the registry says so in `cli_config_file` (`direct {}`).
pub const NO_INSTALLATION: &str = "# byoc-runner: no provider mirror named by the job or the customer (terraform.cli_config_file):\n# no provider is installed from anywhere\nprovider_installation {\n}\n";

impl super::Terraform {
    /// The provider mirror by digest, served read-only from the verified cache by the
    /// runner's tree, and the CLI configuration naming it (as terraform sees it).
    pub(super) async fn provider_mirror(
        &self,
        ctx: &mut ExecContext<'_>,
        reference: &byoc_oci_sync::Reference,
        tree: &mut RunnerTree,
    ) -> Result<Vec<u8>, ExecOutcome> {
        let fail = |code: &str, why: String| {
            failed(code, why, serde_json::json!({"providers": reference.to_string()}))
        };
        if !ctx.settings.tools.job_provider_mirrors {
            // Checked before the claim too; a job recovered after a configuration change
            // meets it here.
            return Err(fail(PROVIDER_MIRROR_NOT_ALLOWED, MIRROR_REFUSED.into()));
        }
        let fetched = match crate::artifact::fetch(&ctx.settings, reference).await {
            Ok(f) => f,
            Err(e) => {
                let _ = ctx.output.write(format!("[terraform] providers {reference}: {e}\n").as_bytes());
                return Err(fail(&e.code(), e.to_string()));
            }
        };
        let found = addresses(&fetched.tree).unwrap_or_default();
        if found.is_empty() {
            return Err(fail(
                "artifact_invalid",
                format!(
                    "providers {reference}: no HOST/NAMESPACE/TYPE directories (terraform's filesystem-mirror layout)"
                ),
            ));
        }
        tree.use_mirror(&fetched.tree)
            .map_err(|e| ExecOutcome::failed(format!("serving the provider mirror: {e}")))?;
        let _ = ctx.output.write(
            format!(
                "[terraform] providers {reference}: {} from the mirror, never the network ({}){}\n",
                found.join(", "),
                fetched.digest,
                if fetched.cached { ", cached" } else { ", fetched and verified" }
            )
            .as_bytes(),
        );
        Ok(cli_config(&tree.providers(), &found).into_bytes())
    }
}

/// Reason code: the job names a provider mirror where the customer's configuration
/// does not allow one.
pub const PROVIDER_MIRROR_NOT_ALLOWED: &str = "provider_mirror_not_allowed";
pub const MIRROR_REFUSED: &str = "the job names its own provider mirror (providers), which this runner's configuration does not allow \
     ([terraform] job_provider_mirrors = \"refuse\", the default where terraform.cli_config_file is set): its providers come \
     from the customer's provider installation";

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
        let rc = cli_config(Path::new("/tf/providers"), &found);
        assert!(rc.contains("path    = \"/tf/providers\""), "{rc}");
        assert!(
            rc.contains("include = [\"example.com/acme/fake\", \"registry.terraform.io/hashicorp/aws\""),
            "{rc}"
        );
        assert!(!rc.contains("direct"), "{rc}");
    }
}
