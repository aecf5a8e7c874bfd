//! AWS Secrets Manager's GetSecretValue under the job's role session: one signed JSON
//! call, so the runner needs no Secrets Manager SDK. The install stack stores each
//! secret as `<install id>/secrets/<name>` (ami/render-install-stack).

use std::time::{Duration, SystemTime};

use super::SessionKeys;
use byoc_oci_sync::client::error_chain;

/// A secret larger than this is not read (Secrets Manager's own limit is 64 KiB).
const MAX_ANSWER: usize = 256 << 10;

/// Where the install's secrets are.
#[derive(Debug, Clone)]
pub struct Store {
    /// Every AWS API's endpoint (`[aws] endpoint_url`: VPC endpoints, a local test
    /// server); `None`: `https://secretsmanager.<region>.amazonaws.com`.
    pub endpoint: Option<String>,
    /// `<install id>/secrets/`.
    pub prefix: String,
}

/// One version of a secret. The value is never shown by `Debug`.
pub struct Value {
    pub value: String,
    pub version_id: String,
}

impl std::fmt::Debug for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Value").field("version_id", &self.version_id).finish_non_exhaustive()
    }
}

/// Why a secret could not be read. Never carries the value or the keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    /// AccessDenied (the role may not read it, or not decrypt it with the install's key).
    Forbidden(String),
    /// ResourceNotFound, or a secret with no string value.
    NotFound,
    /// Anything else: the endpoint, a throttle, an answer we cannot read.
    Store(String),
}

#[derive(serde::Deserialize)]
struct Answer {
    #[serde(rename = "SecretString", default)]
    secret_string: Option<String>,
    #[serde(rename = "VersionId", default)]
    version_id: String,
}

#[derive(serde::Deserialize)]
struct ErrorAnswer {
    #[serde(rename = "__type", default)]
    kind: String,
    #[serde(default, alias = "Message")]
    message: String,
}

impl Store {
    pub fn secret_id(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The current version (`AWSCURRENT`) of the install's secret `name`.
    pub async fn get(&self, keys: &SessionKeys, name: &str) -> Result<Value, ReadError> {
        let url = match &self.endpoint {
            Some(e) => format!("{}/", e.trim_end_matches('/')),
            None => format!("https://secretsmanager.{}.amazonaws.com/", keys.region),
        };
        let body = serde_json::to_vec(&serde_json::json!({ "SecretId": self.secret_id(name) }))
            .map_err(|e| ReadError::Store(e.to_string()))?;
        let headers = sign_request(keys, &url, &body, SystemTime::now())?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ReadError::Store(format!("HTTP client: {e}")))?;
        let mut req = http.post(&url).body(body);
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let mut resp = req.send().await.map_err(|e| ReadError::Store(error_chain(&e)))?;
        let status = resp.status().as_u16();
        let mut answer = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| ReadError::Store(error_chain(&e)))? {
            if answer.len() + chunk.len() > MAX_ANSWER {
                return Err(ReadError::Store(format!("an answer larger than {MAX_ANSWER} bytes")));
            }
            answer.extend_from_slice(&chunk);
        }
        if (200..300).contains(&status) {
            let a: Answer = serde_json::from_slice(&answer)
                .map_err(|e| ReadError::Store(format!("GetSecretValue's answer: {e}")))?;
            return match a.secret_string {
                Some(value) => Ok(Value { value, version_id: a.version_id }),
                // A binary secret is not what the install stack stores.
                None => Err(ReadError::NotFound),
            };
        }
        let e: ErrorAnswer = serde_json::from_slice(&answer)
            .unwrap_or(ErrorAnswer { kind: String::new(), message: String::new() });
        // `__type` may carry a namespace (`com.amazonaws...#ResourceNotFoundException`).
        let kind = e.kind.rsplit('#').next().unwrap_or("").to_string();
        Err(match kind.as_str() {
            "ResourceNotFoundException" => ReadError::NotFound,
            "AccessDeniedException" | "AccessDenied" => ReadError::Forbidden(e.message),
            // The value is encrypted with the install's key, which the role may not use.
            "DecryptionFailure" | "KMSAccessDeniedException" => ReadError::Forbidden(e.message),
            _ if status == 403 => ReadError::Forbidden(e.message),
            _ => ReadError::Store(format!("HTTP {status} {kind} {}", e.message).trim_end().to_string()),
        })
    }
}

fn sign_request(
    keys: &SessionKeys,
    url: &str,
    body: &[u8],
    now: SystemTime,
) -> Result<Vec<(String, String)>, ReadError> {
    let identity = crate::aws_sign::Identity {
        access_key_id: &keys.access_key_id,
        secret_access_key: &keys.secret_access_key,
        session_token: keys.session_token.as_deref(),
    };
    crate::aws_sign::signed_headers(
        &identity,
        &crate::aws_sign::Request {
            region: &keys.region,
            service: "secretsmanager",
            method: "POST",
            url,
            headers: &[
                ("content-type", "application/x-amz-json-1.1"),
                ("x-amz-target", "secretsmanager.GetSecretValue"),
            ],
            body,
            payload_hash_header: false,
            time: now,
        },
    )
    .map_err(|e| ReadError::Store(format!("signing: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A one-answer HTTP server on loopback: what Secrets Manager says, as it says it.
    async fn answering(status: &str, body: &'static str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let status = status.to_string();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 16 << 10];
            let _ = conn.read(&mut buf).await;
            let answer = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/x-amz-json-1.1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(answer.as_bytes()).await;
        });
        url
    }

    fn keys() -> SessionKeys {
        SessionKeys {
            access_key_id: "ASIAEXAMPLE".into(),
            secret_access_key: "secret-example-key".into(),
            session_token: Some("token".into()),
            region: "us-east-1".into(),
        }
    }

    async fn get(status: &str, body: &'static str) -> Result<Value, ReadError> {
        let store = Store { endpoint: Some(answering(status, body).await), prefix: "inst-1/secrets/".into() };
        store.get(&keys(), "db_password").await
    }

    #[tokio::test]
    async fn secrets_managers_refusals_map_to_their_reasons() {
        let denied = get(
            "400 Bad Request",
            r#"{"__type":"AccessDeniedException","message":"not authorized to perform secretsmanager:GetSecretValue"}"#,
        )
        .await;
        assert!(matches!(denied, Err(ReadError::Forbidden(m)) if m.contains("not authorized")));
        let kms =
            get("400 Bad Request", r#"{"__type":"DecryptionFailure","Message":"no kms:Decrypt"}"#).await;
        assert!(matches!(kms, Err(ReadError::Forbidden(_))));
        let missing = get(
            "400 Bad Request",
            r#"{"__type":"com.amazonaws.secretsmanager#ResourceNotFoundException","message":"not found"}"#,
        )
        .await;
        assert_eq!(missing.unwrap_err(), ReadError::NotFound);
        let throttled =
            get("400 Bad Request", r#"{"__type":"ThrottlingException","message":"slow down"}"#).await;
        assert!(matches!(throttled, Err(ReadError::Store(m)) if m.contains("ThrottlingException")));
        let ok = get(
            "200 OK",
            r#"{"SecretString":"hunter2-pw","VersionId":"v-1","Name":"inst-1/secrets/db_password"}"#,
        )
        .await
        .unwrap();
        assert_eq!((ok.value.as_str(), ok.version_id.as_str()), ("hunter2-pw", "v-1"));
        // Debug never shows the value.
        assert!(!format!("{ok:?}").contains("hunter2"));
    }
}
