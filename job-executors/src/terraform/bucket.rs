//! The install's state bucket as the customer's CLI reads it: the workspaces' state
//! objects (addresses and serials, never values) and the S3 lock files terraform's
//! `s3` backend leaves (`<key>.tflock`), which `state unlock` removes.
//!
//! A few signed S3 REST calls (ListObjectsV2, GetObject, DeleteObject) under a role
//! session: the runner needs no S3 SDK for them. Keys are the ones
//! [`super::state::override_file`] gives terraform.

use std::time::{Duration, SystemTime};

use super::state::{Summary, summarize};
use byoc_oci_sync::client::error_chain;

pub const STATE_OBJECT: &str = "terraform.tfstate";
pub const LOCK_SUFFIX: &str = ".tflock";
/// A state or lock object larger than this is not read (state files of real installs
/// are kilobytes to a few megabytes).
const MAX_OBJECT: usize = 64 << 20;

/// A role session's keys (never logged).
#[derive(Clone)]
pub struct Keys {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(<redacted>)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    #[error("s3://{bucket}: {what}: {reason}")]
    Transport { bucket: String, what: String, reason: String },
    #[error("s3://{bucket}: {what}: HTTP {status} {code}")]
    Status { bucket: String, what: String, status: u16, code: String },
    #[error("workspace {workspace:?} has no state in s3://{bucket}/{key}")]
    NoState { bucket: String, key: String, workspace: String },
    #[error("workspace {workspace:?} is not locked (no s3://{bucket}/{key})")]
    NotLocked { bucket: String, key: String, workspace: String },
    #[error(
        "workspace {workspace:?} is locked by lock ID {held:?}, not {given:?}: nothing removed (give the ID the lock holds)"
    )]
    WrongLockId { workspace: String, held: String, given: String },
    #[error("{0}")]
    Invalid(String),
}

impl BucketError {
    pub fn code(&self) -> &'static str {
        match self {
            BucketError::Transport { .. } => "state_bucket_unreachable",
            BucketError::Status { status: 403, .. } => "state_bucket_forbidden",
            BucketError::Status { .. } => "state_bucket_error",
            BucketError::NoState { .. } => "state_not_found",
            BucketError::NotLocked { .. } => "state_not_locked",
            BucketError::WrongLockId { .. } => "lock_id_mismatch",
            BucketError::Invalid(_) => "invalid_request",
        }
    }
}

/// What terraform writes into a lock file (`ID`, `Operation`, `Who`, `Version`,
/// `Created`, `Path`); kept as text, shown to the customer.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct LockInfo {
    #[serde(rename = "ID", default)]
    pub id: String,
    #[serde(rename = "Operation", default)]
    pub operation: String,
    #[serde(rename = "Who", default)]
    pub who: String,
    #[serde(rename = "Version", default)]
    pub version: String,
    #[serde(rename = "Created", default)]
    pub created: String,
}

/// One workspace in the bucket.
#[derive(Debug, serde::Serialize)]
pub struct BucketWorkspace {
    #[serde(flatten)]
    pub summary: Summary,
    pub key: String,
    pub lock: Option<LockInfo>,
}

pub struct StateBucket {
    http: reqwest::Client,
    pub bucket: String,
    region: String,
    /// Path-style base (`<endpoint>/<bucket>`) with an endpoint, else virtual-hosted.
    base: String,
    pub key_prefix: String,
    keys: Keys,
}

impl StateBucket {
    pub fn new(
        bucket: &str,
        region: &str,
        key_prefix: &str,
        endpoint: Option<&str>,
        keys: Keys,
    ) -> Result<StateBucket, BucketError> {
        let base = match endpoint {
            // As the backend is configured (`use_path_style`) for an endpoint of the customer's.
            Some(e) => format!("{}/{bucket}", e.trim_end_matches('/')),
            None => format!("https://{bucket}.s3.{region}.amazonaws.com"),
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| BucketError::Invalid(format!("HTTP client: {e}")))?;
        Ok(StateBucket {
            http,
            bucket: bucket.to_string(),
            region: region.to_string(),
            base,
            key_prefix: key_prefix.trim_matches('/').to_string(),
            keys,
        })
    }

    pub fn state_key(&self, workspace: &str) -> String {
        format!("{}/{workspace}/{STATE_OBJECT}", self.key_prefix)
    }

    /// Every workspace with a state object under the install's prefix, with its lock.
    pub async fn list(&self) -> Result<Vec<BucketWorkspace>, BucketError> {
        let prefix = format!("{}/", self.key_prefix);
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut query = vec![("list-type", "2".to_string()), ("prefix", prefix.clone())];
            if let Some(t) = &token {
                query.push(("continuation-token", t.clone()));
            }
            let body = self.call("GET", "", &query, "listing state objects").await?.ok_or_else(|| {
                BucketError::Status {
                    bucket: self.bucket.clone(),
                    what: "listing state objects".into(),
                    status: 404,
                    code: "NoSuchBucket".into(),
                }
            })?;
            let text = String::from_utf8_lossy(&body);
            keys.extend(xml_values(&text, "Key"));
            token = (xml_values(&text, "IsTruncated").first().map(String::as_str) == Some("true"))
                .then(|| xml_values(&text, "NextContinuationToken").into_iter().next())
                .flatten();
            if token.is_none() {
                break;
            }
        }
        let mut out = Vec::new();
        for key in &keys {
            let Some(workspace) = key
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(&format!("/{STATE_OBJECT}")))
                .filter(|w| super::valid_name(w))
            else {
                continue;
            };
            out.push(self.show(workspace).await?);
        }
        out.sort_by(|a, b| a.summary.workspace.cmp(&b.summary.workspace));
        Ok(out)
    }

    pub async fn show(&self, workspace: &str) -> Result<BucketWorkspace, BucketError> {
        check_workspace(workspace)?;
        let key = self.state_key(workspace);
        let Some(state) = self.call("GET", &key, &[], "reading the state").await? else {
            return Err(BucketError::NoState {
                bucket: self.bucket.clone(),
                key,
                workspace: workspace.into(),
            });
        };
        let lock = self.lock(workspace).await?;
        Ok(BucketWorkspace { summary: summarize(workspace, &state, 0), key, lock })
    }

    /// The workspace's lock file, if one is held.
    pub async fn lock(&self, workspace: &str) -> Result<Option<LockInfo>, BucketError> {
        check_workspace(workspace)?;
        let key = format!("{}{LOCK_SUFFIX}", self.state_key(workspace));
        Ok(self.call("GET", &key, &[], "reading the lock").await?.map(|b| {
            // A lock file we cannot parse is still a lock: show it with no ID, so it
            // can only be removed by giving the ID terraform printed.
            serde_json::from_slice(&b).unwrap_or_default()
        }))
    }

    /// Remove the workspace's lock file if it holds `lock_id` (as `terraform
    /// force-unlock` does). Returns the lock removed.
    pub async fn unlock(&self, workspace: &str, lock_id: &str) -> Result<LockInfo, BucketError> {
        let key = format!("{}{LOCK_SUFFIX}", self.state_key(workspace));
        let Some(held) = self.lock(workspace).await? else {
            return Err(BucketError::NotLocked {
                bucket: self.bucket.clone(),
                key,
                workspace: workspace.into(),
            });
        };
        if held.id.is_empty() || held.id != lock_id {
            return Err(BucketError::WrongLockId {
                workspace: workspace.into(),
                held: held.id.clone(),
                given: lock_id.into(),
            });
        }
        self.call("DELETE", &key, &[], "removing the lock").await?;
        Ok(held)
    }

    /// One signed request; `None` for 404 on an object.
    async fn call(
        &self,
        method: &str,
        key: &str,
        query: &[(&str, String)],
        what: &str,
    ) -> Result<Option<Vec<u8>>, BucketError> {
        let mut url = url::Url::parse(&format!("{}/", self.base))
            .map_err(|e| BucketError::Invalid(format!("state bucket URL {}: {e}", self.base)))?;
        if !key.is_empty() {
            url.path_segments_mut()
                .map_err(|()| BucketError::Invalid(format!("state bucket URL {}", self.base)))?
                .pop_if_empty()
                .extend(key.split('/'));
        }
        for (k, v) in query {
            url.query_pairs_mut().append_pair(k, v);
        }
        let transport = |reason: String| BucketError::Transport {
            bucket: self.bucket.clone(),
            what: what.to_string(),
            reason,
        };
        let headers = self.sign(method, url.as_str(), SystemTime::now()).map_err(transport)?;
        let mut req = self.http.request(
            reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| transport(e.to_string()))?,
            url.as_str(),
        );
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let resp = req.send().await.map_err(|e| transport(error_chain(&e)))?;
        let status = resp.status().as_u16();
        let mut body = Vec::new();
        let mut resp = resp;
        while let Some(chunk) = resp.chunk().await.map_err(|e| transport(error_chain(&e)))? {
            if body.len() + chunk.len() > MAX_OBJECT {
                return Err(transport(format!("larger than {MAX_OBJECT} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        match status {
            200..=299 => Ok(Some(body)),
            404 if !key.is_empty() => Ok(None),
            _ => Err(BucketError::Status {
                bucket: self.bucket.clone(),
                what: what.to_string(),
                status,
                code: xml_values(&String::from_utf8_lossy(&body), "Code")
                    .into_iter()
                    .next()
                    .unwrap_or_default(),
            }),
        }
    }

    fn sign(&self, method: &str, url: &str, now: SystemTime) -> Result<Vec<(String, String)>, String> {
        let identity = crate::aws_sign::Identity {
            access_key_id: &self.keys.access_key_id,
            secret_access_key: &self.keys.secret_access_key,
            session_token: self.keys.session_token.as_deref(),
        };
        crate::aws_sign::signed_headers(
            &identity,
            &crate::aws_sign::Request {
                region: &self.region,
                service: "s3",
                method,
                url,
                headers: &[],
                body: &[],
                payload_hash_header: true,
                time: now,
            },
        )
    }
}

fn check_workspace(workspace: &str) -> Result<(), BucketError> {
    if super::valid_name(workspace) {
        Ok(())
    } else {
        Err(BucketError::Invalid(format!("workspace {workspace:?}: 1-64 of [a-z0-9_-]")))
    }
}

/// The text of every `<tag>…</tag>` in an S3 XML answer, entities decoded. S3's
/// answers here are flat lists; a full XML parser buys nothing.
pub fn xml_values(xml: &str, tag: &str) -> Vec<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        let after = &rest[start + open.len()..];
        let Some(end) = after.find(&close) else { break };
        out.push(
            after[..end]
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&quot;", "\"")
                .replace("&apos;", "'")
                .replace("&amp;", "&"),
        );
        rest = &after[end + close.len()..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_answers_are_read_with_entities_and_continuation() {
        let xml = "<ListBucketResult><IsTruncated>true</IsTruncated><Contents><Key>i/a&amp;b/terraform.tfstate</Key></Contents>\
                   <Contents><Key>i/net/terraform.tfstate</Key></Contents><NextContinuationToken>t1</NextContinuationToken></ListBucketResult>";
        assert_eq!(xml_values(xml, "Key"), ["i/a&b/terraform.tfstate", "i/net/terraform.tfstate"]);
        assert_eq!(xml_values(xml, "NextContinuationToken"), ["t1"]);
        assert!(xml_values(xml, "Missing").is_empty());
        assert!(xml_values("<Key>unclosed", "Key").is_empty());
    }

    #[test]
    fn requests_are_signed_for_s3_with_the_payload_hash_and_session_token() {
        let b = StateBucket::new(
            "inst-state",
            "eu-west-1",
            "/inst-1/",
            None,
            Keys {
                access_key_id: "ASIAEXAMPLE".into(),
                secret_access_key: "secret".into(),
                session_token: Some("session".into()),
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.state_key("network"), "inst-1/network/terraform.tfstate");
        let h = b
            .sign(
                "GET",
                "https://inst-state.s3.eu-west-1.amazonaws.com/inst-1/network/terraform.tfstate",
                SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
            )
            .unwrap_or_default();
        let get = |n: &str| h.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).unwrap_or_default();
        assert!(get("authorization").contains("/eu-west-1/s3/aws4_request"), "{h:?}");
        assert_eq!(get("x-amz-security-token"), "session");
        // SHA-256 of the empty body.
        assert_eq!(
            get("x-amz-content-sha256"),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert!(!format!("{:?}", b.keys).contains("secret"));
    }

    #[test]
    fn hostile_workspace_names_never_become_keys() {
        for w in ["../other", "", "a/b", "A", &"x".repeat(65)] {
            assert_eq!(check_workspace(w).map_err(|e| e.code()), Err("invalid_request"), "{w:?}");
        }
    }
}
