//! The destination in the install's ECR: the repository created if missing (with the
//! install's settings) and a registry credential from GetAuthorizationToken, both
//! under the job's assumed role.

use aws_sdk_ecr::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_ecr::types::{
    EncryptionConfiguration, EncryptionType, ImageScanningConfiguration, ImageTagMutability,
};

use crate::client::Credential;
use crate::error::SyncError;

/// The job's role session (never logged: Debug shows names only).
#[derive(Clone)]
pub struct AwsAccess {
    pub region: String,
    pub endpoint_url: Option<String>,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for AwsAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsAccess")
            .field("region", &self.region)
            .field("endpoint_url", &self.endpoint_url)
            .finish()
    }
}

/// How a repository is created when it is missing.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RepositorySettings {
    /// Tags cannot be moved once pushed.
    #[serde(default = "yes")]
    pub immutable: bool,
    #[serde(default = "yes")]
    pub scan_on_push: bool,
    /// `AES256` (default) or `KMS`.
    #[serde(default = "aes256")]
    pub encryption: String,
    #[serde(default)]
    pub kms_key: Option<String>,
}

fn yes() -> bool {
    true
}
fn aes256() -> String {
    "AES256".into()
}

impl Default for RepositorySettings {
    fn default() -> Self {
        RepositorySettings { immutable: true, scan_on_push: true, encryption: aes256(), kms_key: None }
    }
}

impl RepositorySettings {
    pub fn validate(&self) -> Result<(), SyncError> {
        let invalid = |reason: String| SyncError::Invalid { what: "repository".into(), reason };
        match (self.encryption.as_str(), &self.kms_key) {
            ("AES256", None) | ("KMS", _) => Ok(()),
            ("AES256", Some(_)) => Err(invalid("kms_key is only valid with encryption = \"KMS\"".into())),
            (other, _) => Err(invalid(format!("encryption {other:?} must be \"AES256\" or \"KMS\""))),
        }
    }
}

#[derive(Debug)]
pub struct EcrDestination {
    /// `<account>.dkr.ecr.<region>.amazonaws.com`.
    pub registry_host: String,
    pub credential: Credential,
    pub repository_created: bool,
}

fn aws_err(what: &str, e: impl std::error::Error) -> SyncError {
    SyncError::Aws {
        what: format!("ECR {what} under the job's role"),
        reason: crate::client::error_chain(&e),
    }
}

pub fn client(aws: &AwsAccess) -> aws_sdk_ecr::Client {
    let creds = Credentials::new(
        aws.access_key_id.clone(),
        aws.secret_access_key.clone(),
        aws.session_token.clone(),
        None,
        "byoc-job-role",
    );
    let mut b = aws_sdk_ecr::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(aws.region.clone()))
        .credentials_provider(creds);
    if let Some(u) = &aws.endpoint_url {
        b = b.endpoint_url(u.clone());
    }
    aws_sdk_ecr::Client::from_conf(b.build())
}

/// Create `repository` if missing, then a registry credential for pushing to it.
pub async fn prepare(
    aws: &AwsAccess,
    repository: &str,
    settings: &RepositorySettings,
) -> Result<EcrDestination, SyncError> {
    let ecr = client(aws);
    let found = match ecr.describe_repositories().repository_names(repository).send().await {
        Ok(out) => !out.repositories().is_empty(),
        Err(e) if e.as_service_error().is_some_and(|s| s.is_repository_not_found_exception()) => false,
        Err(e) => return Err(aws_err(&format!("DescribeRepositories {repository}"), e)),
    };
    let mut created = false;
    if !found {
        let encryption = EncryptionConfiguration::builder()
            .encryption_type(if settings.encryption == "KMS" {
                EncryptionType::Kms
            } else {
                EncryptionType::Aes256
            })
            .set_kms_key(settings.kms_key.clone())
            .build()
            .map_err(|e| aws_err("encryption settings", e))?;
        match ecr
            .create_repository()
            .repository_name(repository)
            .image_tag_mutability(if settings.immutable {
                ImageTagMutability::Immutable
            } else {
                ImageTagMutability::Mutable
            })
            .image_scanning_configuration(
                ImageScanningConfiguration::builder().scan_on_push(settings.scan_on_push).build(),
            )
            .encryption_configuration(encryption)
            .send()
            .await
        {
            Ok(_) => created = true,
            // Another job created it in between: fine.
            Err(e) if e.as_service_error().is_some_and(|s| s.is_repository_already_exists_exception()) => {}
            Err(e) => return Err(aws_err(&format!("CreateRepository {repository}"), e)),
        }
    }
    let (registry_host, credential) = authorization(&ecr).await?;
    Ok(EcrDestination { registry_host, credential, repository_created: created })
}

/// The install's registry (`<account>.dkr.ecr.<region>.amazonaws.com`) and a
/// credential for it, from ECR's GetAuthorizationToken under the job's role.
pub async fn registry_access(aws: &AwsAccess) -> Result<(String, Credential), SyncError> {
    authorization(&client(aws)).await
}

async fn authorization(ecr: &aws_sdk_ecr::Client) -> Result<(String, Credential), SyncError> {
    let out = ecr.get_authorization_token().send().await.map_err(|e| aws_err("GetAuthorizationToken", e))?;
    let data = out
        .authorization_data()
        .first()
        .ok_or_else(|| aws_err("GetAuthorizationToken", std::io::Error::other("no authorization data")))?;
    let token = data.authorization_token().unwrap_or("");
    let endpoint = data.proxy_endpoint().unwrap_or("");
    let decoded = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(token)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default()
    };
    let (username, secret) = decoded.split_once(':').ok_or_else(|| {
        aws_err("GetAuthorizationToken", std::io::Error::other("token is not base64(user:password)"))
    })?;
    // ECR's token is valid for 12 h (a past expiry, as moto reports, is not checked:
    // the registry is the judge).
    let registry_host = url::Url::parse(endpoint)
        .ok()
        .and_then(|u| {
            u.host_str().map(|h| match u.port() {
                Some(p) => format!("{h}:{p}"),
                None => h.to_string(),
            })
        })
        .ok_or_else(|| {
            aws_err(
                "GetAuthorizationToken",
                std::io::Error::other(format!("proxy endpoint {endpoint:?} is not a URL")),
            )
        })?;
    Ok((registry_host, Credential::Basic { username: username.into(), secret: secret.into() }))
}
