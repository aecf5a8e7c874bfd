//! How the runner reaches a job's Kubernetes cluster: built from data only.
//!
//! A kubeconfig is a document that can name commands (`exec`, `auth-provider`), files
//! (`tokenFile`, `client-certificate`, `certificate-authority`), a proxy and switches
//! that turn TLS checks off. Handed to a client library, it makes the runner run the
//! vendor's command or send one of the runner's files to the vendor's server. So a job
//! gives data only, checked before the claim (`invalid_spec`, naming the field): one
//! cluster with an `https://` server and inline CA data, one user with an inline bearer
//! token or inline client certificate and key, at most one context naming them. The
//! client is built from those parts, its resolver refusing loopback, link-local,
//! metadata and host addresses (`byoc_oci_sync::reach`), and sandboxed helm gets a
//! kubeconfig the runner renders from the same parts. Every in-runner cluster user
//! (kubernetes jobs, secrets sync, both drift checks, cluster policies) comes here.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use base64::Engine as _;
use byoc_oci_sync::Reach;
use serde::Deserialize;
use url::Url;

use crate::ExecContext;
use crate::eks::ClusterAccessError;

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

/// How a bearer of the cluster's trust proves who it is.
#[derive(Clone)]
pub(crate) enum Auth {
    Token(String),
    /// Base64 PEM, as a kubeconfig's `*-data` fields carry them.
    ClientCert {
        cert_data: String,
        key_data: String,
    },
}

/// Everything the runner needs to reach a cluster, checked.
#[derive(Clone)]
pub(crate) struct ClusterAccess {
    pub(crate) server: Url,
    /// Base64 PEM of the CA bundle (`None`: the system's roots).
    pub(crate) ca_data: Option<String>,
    pub(crate) auth: Auth,
}

/// Where a job's cluster access comes from.
#[derive(Clone)]
pub(crate) enum ClusterSource {
    Kubeconfig(ClusterAccess),
    /// Credentials derived from the job's role when the job runs.
    Eks {
        eks: Eks,
        server: Url,
    },
}

/// The job's `kubeconfig` or `eks`: exactly one, each checked.
pub(crate) fn source(
    kubeconfig: Option<&String>,
    eks: Option<&Eks>,
) -> Result<ClusterSource, crate::InvalidSpec> {
    match (kubeconfig, eks) {
        (Some(k), None) => Ok(ClusterSource::Kubeconfig(parse_kubeconfig(k)?)),
        (None, Some(e)) => {
            if e.cluster.is_empty() || e.cluster.len() > 100 {
                return Err(crate::InvalidSpec::from("eks.cluster: 1-100 characters"));
            }
            if let Some(ca) = &e.certificate_authority_data {
                pem_data("eks.certificate_authority_data", ca)?;
            }
            Ok(ClusterSource::Eks { server: server_url("eks.server", &e.server)?, eks: e.clone() })
        }
        _ => Err(crate::InvalidSpec::from("exactly one of kubeconfig or eks")),
    }
}

impl ClusterSource {
    /// The API server the runner (and sandboxed tools) will connect to.
    pub(crate) fn server(&self) -> &Url {
        match self {
            ClusterSource::Kubeconfig(a) => &a.server,
            ClusterSource::Eks { server, .. } => server,
        }
    }

    /// The field the server came from, for refusals.
    pub(crate) fn server_field(&self) -> &'static str {
        match self {
            ClusterSource::Kubeconfig(_) => "kubeconfig: clusters[0].cluster.server",
            ClusterSource::Eks { .. } => "eks.server",
        }
    }

    /// Values to mask wherever the job's output goes.
    pub(crate) fn secrets(&self) -> Vec<Vec<u8>> {
        match self {
            ClusterSource::Kubeconfig(a) => a.secrets(),
            ClusterSource::Eks { .. } => Vec::new(),
        }
    }

    /// The parts to connect with now (for EKS, a token signed by the job's role
    /// session, as `aws eks get-token` makes).
    pub(crate) fn access(&self, ctx: &ExecContext<'_>) -> Result<ClusterAccess, ClusterAccessError> {
        let (eks, server) = match self {
            ClusterSource::Kubeconfig(a) => return Ok(a.clone()),
            ClusterSource::Eks { eks, server } => (eks, server),
        };
        let env = &ctx
            .settings
            .credentials
            .as_ref()
            .ok_or("eks needs the job's role (set requested_role)")?
            .static_env;
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
        Ok(ClusterAccess {
            server: server.clone(),
            ca_data: eks.certificate_authority_data.clone(),
            auth: Auth::Token(token),
        })
    }
}

/// The only fields a job's kubeconfig may carry, by level.
const TOP_FIELDS: &[&str] =
    &["apiVersion", "kind", "clusters", "users", "contexts", "current-context", "preferences"];
const CLUSTER_FIELDS: &[&str] = &["server", "certificate-authority-data"];
const USER_FIELDS: &[&str] = &["token", "client-certificate-data", "client-key-data"];
const CONTEXT_FIELDS: &[&str] = &["cluster", "user", "namespace"];
const ALLOWED: &str = "the runner builds its cluster client from data only: one cluster (server: https://…, \
     certificate-authority-data), one user (token, or client-certificate-data and client-key-data), at most one context";

/// Check a job's kubeconfig and keep its parts.
pub(crate) fn parse_kubeconfig(text: &str) -> Result<ClusterAccess, crate::InvalidSpec> {
    let bad = |field: &str, why: &str| crate::InvalidSpec(format!("kubeconfig: {field}: {why}"));
    let doc: serde_json::Value =
        serde_norway::from_str(text).map_err(|e| crate::InvalidSpec(format!("kubeconfig: not YAML: {e}")))?;
    let top = doc.as_object().ok_or_else(|| bad("(document)", "not a mapping"))?;
    only_fields("", top, TOP_FIELDS)?;
    let one =
        |list: &str| -> Result<Option<&serde_json::Map<String, serde_json::Value>>, crate::InvalidSpec> {
            let entries = match top.get(list) {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::Array(a)) => a,
                Some(_) => return Err(bad(list, "not a list")),
            };
            match entries.as_slice() {
                [] => Ok(None),
                [e] => e.as_object().map(Some).ok_or_else(|| bad(&format!("{list}[0]"), "not a mapping")),
                _ => Err(bad(list, &format!("{} entries; {ALLOWED}", entries.len()))),
            }
        };
    let inner =
        |list: &str, entry: &serde_json::Map<String, serde_json::Value>, key: &str, fields: &[&str]| {
            only_fields(&format!("{list}[0]"), entry, &["name", key])?;
            let body = entry
                .get(key)
                .and_then(|v| v.as_object())
                .cloned()
                .ok_or_else(|| bad(&format!("{list}[0].{key}"), "missing"))?;
            only_fields(&format!("{list}[0].{key}"), &body, fields)?;
            let name = entry.get("name").and_then(|n| n.as_str()).unwrap_or_default().to_string();
            Ok::<_, crate::InvalidSpec>((name, body))
        };
    let cluster = one("clusters")?.ok_or_else(|| bad("clusters", &format!("none; {ALLOWED}")))?;
    let (cluster_name, cluster) = inner("clusters", cluster, "cluster", CLUSTER_FIELDS)?;
    let user = one("users")?.ok_or_else(|| bad("users", &format!("none; {ALLOWED}")))?;
    let (user_name, user) = inner("users", user, "user", USER_FIELDS)?;
    if let Some(context) = one("contexts")? {
        let (context_name, context) = inner("contexts", context, "context", CONTEXT_FIELDS)?;
        let names = |k: &str| context.get(k).and_then(|v| v.as_str()).unwrap_or_default().to_string();
        if names("cluster") != cluster_name || names("user") != user_name {
            return Err(bad(
                "contexts[0].context",
                "names another cluster or user than the kubeconfig's one",
            ));
        }
        if let Some(current) = top.get("current-context").and_then(|c| c.as_str())
            && !current.is_empty()
            && current != context_name
        {
            return Err(bad("current-context", "names a context the kubeconfig does not have"));
        }
    }
    let text_field =
        |map: &serde_json::Map<String, serde_json::Value>, at: &str, key: &str| match map.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(bad(&format!("{at}.{key}"), "not a string")),
        };
    let server = text_field(&cluster, "clusters[0].cluster", "server")?
        .ok_or_else(|| bad("clusters[0].cluster.server", "missing"))?;
    let server = server_url("kubeconfig: clusters[0].cluster.server", &server)?;
    let ca_data = text_field(&cluster, "clusters[0].cluster", "certificate-authority-data")?;
    if let Some(ca) = &ca_data {
        pem_data("kubeconfig: clusters[0].cluster.certificate-authority-data", ca)?;
    }
    let token = text_field(&user, "users[0].user", "token")?;
    let cert = text_field(&user, "users[0].user", "client-certificate-data")?;
    let key = text_field(&user, "users[0].user", "client-key-data")?;
    let auth = match (token, cert, key) {
        (Some(t), None, None) => {
            // It becomes an Authorization header: printable, one line.
            if t.is_empty() || t.len() > 16 << 10 || !t.bytes().all(|b| (0x21..0x7f).contains(&b)) {
                return Err(bad("users[0].user.token", "not a bearer token (1-16384 printable characters)"));
            }
            Auth::Token(t)
        }
        (None, Some(c), Some(k)) => {
            pem_data("kubeconfig: users[0].user.client-certificate-data", &c)?;
            pem_data("kubeconfig: users[0].user.client-key-data", &k)?;
            Auth::ClientCert { cert_data: c, key_data: k }
        }
        _ => {
            return Err(bad(
                "users[0].user",
                "give a token, or client-certificate-data with client-key-data (one of them, not both)",
            ));
        }
    };
    Ok(ClusterAccess { server, ca_data, auth })
}

fn only_fields(
    at: &str,
    map: &serde_json::Map<String, serde_json::Value>,
    allowed: &[&str],
) -> Result<(), crate::InvalidSpec> {
    if let Some(k) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        let field = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
        let why = match k.as_str() {
            "exec" | "auth-provider" => "names a command for the runner to run; refused",
            "tokenFile" | "client-certificate" | "client-key" | "certificate-authority" => {
                "names a file for the runner to read; refused (give the value inline: token, *-data)"
            }
            "proxy-url" => "routes the runner's connection through the job's proxy; refused",
            "insecure-skip-tls-verify" | "tls-server-name" => "changes how the server is verified; refused",
            _ => "not a field the runner accepts",
        };
        return Err(crate::InvalidSpec(format!("kubeconfig: {field}: {why} ({ALLOWED})")));
    }
    Ok(())
}

/// An API server URL: `https://host[:port]` with no credentials, path or query. The
/// address it names is checked against the runner's rule before the claim
/// (`Reach::check_url`) and again when it resolves.
fn server_url(field: &str, s: &str) -> Result<Url, crate::InvalidSpec> {
    let bad = |why: &str| crate::InvalidSpec(format!("{field}: {why}"));
    let u = Url::parse(s).map_err(|e| bad(&format!("not a URL: {e}")))?;
    if u.scheme() != "https" {
        return Err(bad("the runner reaches a cluster over https:// only"));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if !u.username().is_empty() || u.password().is_some() || u.query().is_some() || u.fragment().is_some() {
        return Err(bad("credentials, a query or a fragment in the URL are refused"));
    }
    Ok(u)
}

/// Base64 of PEM text (a kubeconfig's `*-data`).
fn pem_data(field: &str, data: &str) -> Result<(), crate::InvalidSpec> {
    let raw = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|_| crate::InvalidSpec(format!("{field}: not base64")))?;
    if !String::from_utf8_lossy(&raw).contains("-----BEGIN ") {
        return Err(crate::InvalidSpec(format!("{field}: not base64 of PEM")));
    }
    Ok(())
}

impl ClusterAccess {
    fn secrets(&self) -> Vec<Vec<u8>> {
        match &self.auth {
            Auth::Token(t) => vec![t.as_bytes().to_vec()],
            Auth::ClientCert { key_data, .. } => vec![key_data.as_bytes().to_vec()],
        }
    }

    /// A kubeconfig holding exactly these parts (for helm in the sandbox).
    pub(crate) fn to_kubeconfig(&self) -> String {
        let mut cluster = serde_json::json!({"server": self.server.as_str()});
        if let Some(ca) = &self.ca_data {
            cluster["certificate-authority-data"] = ca.clone().into();
        }
        let user = match &self.auth {
            Auth::Token(t) => serde_json::json!({"token": t}),
            Auth::ClientCert { cert_data, key_data } => {
                serde_json::json!({"client-certificate-data": cert_data, "client-key-data": key_data})
            }
        };
        // JSON is YAML.
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "cluster", "cluster": cluster}],
            "users": [{"name": "job", "user": user}],
            "contexts": [{"name": "job", "context": {"cluster": "cluster", "user": "job"}}],
            "current-context": "job",
        })
        .to_string()
    }

    /// The client: kube's configuration built field by field from the checked parts
    /// (nothing that runs or reads anything), over a connector whose resolver refuses
    /// what `reach` refuses. A literal address was checked before the claim; it is
    /// checked again here.
    pub(crate) async fn client(&self, reach: &Reach) -> Result<kube::Client, ClientError> {
        use kube::client::ConfigExt as _;
        use kube::config::{
            AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
        };
        let refused =
            |e: byoc_oci_sync::reach::Refused| ClientError::Refused(format!("cluster API server: {e}"));
        reach.check_url(&self.server).map_err(refused)?;
        // A name is looked up once now, so that one answering with a refused address
        // fails the job with that reason before any request; the connector's resolver
        // checks every later lookup as well (an answer that changes is refused then).
        if let Some(url::Host::Domain(host)) = self.server.host()
            && !reach.allows_authority(&authority(&self.server))
        {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, 0))
                .await
                .map_err(|e| ClientError::Build(format!("resolving the cluster API server {host}: {e}")))?
                .collect();
            reach.check_resolved(host, &addrs).map_err(refused)?;
        }
        let build = |what: &str, e: &dyn std::fmt::Display| ClientError::Build(format!("{what}: {e}"));
        let mut user = AuthInfo::default();
        match &self.auth {
            Auth::Token(t) => user.token = Some(t.clone().into()),
            Auth::ClientCert { cert_data, key_data } => {
                user.client_certificate_data = Some(cert_data.clone());
                user.client_key_data = Some(key_data.clone().into());
            }
        }
        let kc = Kubeconfig {
            clusters: vec![NamedCluster {
                name: "cluster".into(),
                cluster: Some(Cluster {
                    server: Some(self.server.to_string()),
                    certificate_authority_data: self.ca_data.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            auth_infos: vec![NamedAuthInfo {
                name: "job".into(),
                auth_info: Some(user),
                ..Default::default()
            }],
            contexts: vec![NamedContext {
                name: "job".into(),
                context: Some(Context {
                    cluster: "cluster".into(),
                    user: Some("job".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            current_context: Some("job".into()),
            ..Default::default()
        };
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| build("cluster access", &e))?;
        let mut http =
            hyper_util::client::legacy::connect::HttpConnector::new_with_resolver(GuardedDns(reach.clone()));
        http.enforce_http(false);
        http.set_connect_timeout(Some(std::time::Duration::from_secs(15)));
        let https =
            config.rustls_https_connector_with_connector(http).map_err(|e| build("cluster TLS", &e))?;
        let transport =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build(https);
        let auth = config.auth_layer().map_err(|e| build("cluster credentials", &e))?;
        let service = tower::ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(auth)
            .map_err(tower::BoxError::from)
            .service(transport);
        Ok(kube::Client::new(service, config.default_namespace))
    }
}

/// Why no cluster client was made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ClientError {
    /// The server is somewhere the runner does not connect for a job.
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Build(String),
}

impl ClientError {
    pub(crate) fn code(&self) -> &'static str {
        match self {
            ClientError::Refused(_) => "endpoint_refused",
            ClientError::Build(_) => "cluster_unreachable",
        }
    }
}

fn authority(url: &Url) -> String {
    match url.port() {
        Some(p) => format!("{}:{p}", url.host_str().unwrap_or_default()),
        None => url.host_str().unwrap_or_default().to_string(),
    }
}

/// The cluster client's resolver: the system's answer, refused whole when one address
/// is one the runner may not reach for a job.
#[derive(Clone)]
struct GuardedDns(Reach);

impl tower::Service<hyper_util::client::legacy::connect::dns::Name> for GuardedDns {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: hyper_util::client::legacy::connect::dns::Name) -> Self::Future {
        let reach = self.0.clone();
        Box::pin(async move {
            let host = name.as_str().to_string();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            reach.check_resolved(&host, &addrs).map_err(std::io::Error::other)?;
            Ok(addrs.into_iter())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CA: &str = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUIKLS0tLS1FTkQgQ0VSVElGSUNBVEUtLS0tLQo=";

    fn kubeconfig(cluster: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n{cluster}contexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\nusers:\n- name: u\n  user:\n{user}"
        )
    }

    fn good_cluster() -> String {
        format!("    server: https://api.example.com:6443\n    certificate-authority-data: {CA}\n")
    }

    #[test]
    fn data_only_kubeconfigs_are_taken() {
        let a = parse_kubeconfig(&kubeconfig(&good_cluster(), "    token: abc.def\n")).expect("token");
        assert_eq!(a.server.as_str(), "https://api.example.com:6443/");
        assert!(matches!(a.auth, Auth::Token(ref t) if t == "abc.def"));
        let a = parse_kubeconfig(&kubeconfig(
            &good_cluster(),
            &format!("    client-certificate-data: {CA}\n    client-key-data: {CA}\n"),
        ))
        .expect("cert");
        assert!(matches!(a.auth, Auth::ClientCert { .. }));
        // What the runner renders for helm is itself taken, with the same parts.
        let again = parse_kubeconfig(&a.to_kubeconfig()).expect("rendered");
        assert_eq!(again.server, a.server);
        assert_eq!(again.ca_data, a.ca_data);
    }

    #[test]
    fn anything_that_runs_reads_or_redirects_is_refused_naming_the_field() {
        let cases = [
            (
                kubeconfig(
                    &good_cluster(),
                    "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: sh\n      args: [-c, id > /tmp/pwned]\n",
                ),
                "users[0].user.exec",
            ),
            (
                kubeconfig(
                    &good_cluster(),
                    "    auth-provider:\n      name: gcp\n      config:\n        cmd-path: /bin/sh\n",
                ),
                "users[0].user.auth-provider",
            ),
            (
                kubeconfig(&good_cluster(), "    tokenFile: /var/lib/byoc-runner/identity.key\n"),
                "users[0].user.tokenFile",
            ),
            (
                kubeconfig(
                    &good_cluster(),
                    "    client-certificate: /etc/x.crt\n    client-key: /etc/x.key\n",
                ),
                "users[0].user.client-certificate",
            ),
            (
                kubeconfig(
                    "    server: https://api.example.com\n    certificate-authority: /etc/ssl/ca.pem\n",
                    "    token: t\n",
                ),
                "clusters[0].cluster.certificate-authority",
            ),
            (
                kubeconfig(
                    "    server: https://api.example.com\n    proxy-url: http://127.0.0.1:9\n",
                    "    token: t\n",
                ),
                "proxy-url",
            ),
            (
                kubeconfig(
                    "    server: https://api.example.com\n    insecure-skip-tls-verify: true\n",
                    "    token: t\n",
                ),
                "insecure-skip-tls-verify",
            ),
            (kubeconfig("    server: http://api.example.com\n", "    token: t\n"), "https:// only"),
            (kubeconfig(&good_cluster(), "    username: a\n    password: b\n"), "users[0].user.password"),
            (kubeconfig(&good_cluster(), "    token: t\n    as: system:admin\n"), "users[0].user.as"),
            (kubeconfig(&good_cluster(), "    token: \"a\\nb\"\n"), "bearer token"),
            (kubeconfig(&good_cluster(), "    {}\n"), "give a token"),
            ("not: [yaml".into(), "not YAML"),
        ];
        for (doc, field) in cases {
            let e = parse_kubeconfig(&doc).err().map(|e| e.0).unwrap_or_default();
            assert!(e.contains(field), "{field}: {e}");
        }
        // Two users (which one the client would take is the library's choice): refused.
        let two = kubeconfig(&good_cluster(), "    token: a\n- name: v\n  user:\n    exec: {command: sh}\n");
        assert!(parse_kubeconfig(&two).err().map(|e| e.0).unwrap_or_default().contains("users: 2 entries"));
        // A context naming another user than the one given.
        let other = kubeconfig(&good_cluster(), "    token: a\n").replace("    user: u\n", "    user: w\n");
        assert!(parse_kubeconfig(&other).is_err());
        // EKS: the same server rule.
        let eks = |server: &str| Eks {
            cluster: "c".into(),
            server: server.into(),
            certificate_authority_data: None,
        };
        assert!(source(None, Some(&eks("https://ABC.gr7.eu-west-1.eks.amazonaws.com"))).is_ok());
        assert!(source(None, Some(&eks("http://ABC.gr7.eu-west-1.eks.amazonaws.com"))).is_err());
    }

    #[tokio::test]
    async fn the_client_refuses_a_refused_address_before_connecting() {
        let a = parse_kubeconfig(&kubeconfig("    server: https://169.254.169.254\n", "    token: t\n"))
            .expect("parses");
        let e = a.client(&Reach::guarded(Vec::<String>::new())).await.err().expect("refused");
        assert_eq!(e.code(), "endpoint_refused");
        assert!(e.to_string().contains("link-local"), "{e}");
        let a = parse_kubeconfig(&kubeconfig("    server: https://localhost:6443\n", "    token: t\n"))
            .expect("parses");
        assert!(a.client(&Reach::guarded(Vec::<String>::new())).await.is_err());
        // A name that is not a loopback name but resolves to one of this machine's
        // addresses (its own host name does): refused when it resolves.
        let me = nix::unistd::gethostname().expect("hostname").to_string_lossy().into_owned();
        let resolved: Vec<SocketAddr> =
            tokio::net::lookup_host((me.as_str(), 0)).await.expect("this machine's name resolves").collect();
        let server = format!("    server: https://{me}:6443\n");
        let a = parse_kubeconfig(&kubeconfig(&server, "    token: t\n")).expect("parses");
        let e = a.client(&Reach::guarded(Vec::<String>::new())).await.err().expect("refused");
        assert_eq!(e.code(), "endpoint_refused", "{me} -> {resolved:?}: {e}");
        assert!(e.to_string().contains("resolves to"), "{e}");
    }
}
