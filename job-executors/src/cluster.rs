//! How a job reaches a Kubernetes cluster: the kubeconfig it carries, or an EKS cluster
//! with a token signed by the job's role session (`eks.rs`). Shared by `kubernetes`,
//! `helm` drift checks and `secrets.sync`.

use serde::Deserialize;

use crate::ExecContext;

/// An EKS cluster reached with a token signed by the job's role session.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Eks {
    pub(crate) cluster: String,
    /// The cluster's API endpoint.
    pub(crate) server: String,
    /// Base64 PEM of the cluster's CA (as `DescribeCluster` gives it).
    #[serde(default)]
    pub(crate) certificate_authority_data: Option<String>,
}

/// The job's kubeconfig, or one for the EKS cluster with a token signed by the job's
/// role session (`aws eks get-token`).
pub(crate) fn kubeconfig_of(
    kubeconfig: Option<&String>,
    eks: Option<&Eks>,
    ctx: &ExecContext<'_>,
) -> Result<String, crate::eks::ClusterAccessError> {
    if let Some(k) = kubeconfig {
        return Ok(k.clone());
    }
    let Some(eks) = eks else { return Err("no cluster credentials".into()) };
    let env =
        &ctx.settings.credentials.as_ref().ok_or("eks needs the job's role (set requested_role)")?.static_env;
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let (Some(ak), Some(sk), Some(region)) =
        (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY"), get("AWS_REGION"))
    else {
        return Err("the job's role session has no keys or region".into());
    };
    let keys = crate::eks::Keys {
        access_key_id: ak,
        secret_access_key: sk,
        session_token: get("AWS_SESSION_TOKEN"),
    };
    let token = crate::eks::token(&keys, region, &eks.cluster, std::time::SystemTime::now())?;
    let ca = eks
        .certificate_authority_data
        .as_ref()
        .map(|c| format!("    certificate-authority-data: {c}\n"))
        .unwrap_or_default();
    Ok(format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: eks\n  cluster:\n    server: {}\n{ca}contexts:\n- name: eks\n  context:\n    cluster: eks\n    user: role\ncurrent-context: eks\nusers:\n- name: role\n  user:\n    token: {token}\n",
        eks.server
    ))
}

/// A client for the cluster a kubeconfig names.
pub(crate) async fn client(kubeconfig: &str) -> Result<kube::Client, crate::eks::ClusterAccessError> {
    let kc = kube::config::Kubeconfig::from_yaml(kubeconfig).map_err(|e| format!("kubeconfig: {e}"))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| format!("kubeconfig: {e}"))?;
    kube::Client::try_from(config).map_err(|e| crate::eks::ClusterAccessError(format!("cluster client: {e}")))
}
