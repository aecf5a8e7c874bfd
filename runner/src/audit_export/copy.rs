//! Verifying an exported copy alone (`audit verify --from s3://BUCKET/PREFIX | DIR`):
//! fetch every object under one runner's prefix, reassemble the audit directory
//! (`byoc_audit::export::assemble`: gaps and conflicting objects are named), and check
//! it as the log on the VM is checked, naming the object a bad record came from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use byoc_audit::export::{Assembled, ExportError, Stream, assemble};
use byoc_audit::verify::{Report, VerifyError};

use super::{AwsIdentity, SinkError};

/// Where a copy is.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    S3 { bucket: String, prefix: String },
    Dir(PathBuf),
}

impl Source {
    pub fn parse(s: &str) -> Result<Source, String> {
        match s.strip_prefix("s3://") {
            Some(rest) => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(format!("{s}: no bucket (s3://BUCKET/PREFIX)"));
                }
                Ok(Source::S3 { bucket: bucket.into(), prefix: prefix.trim_matches('/').into() })
            }
            None => Ok(Source::Dir(PathBuf::from(s))),
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
            Source::Dir(p) => write!(f, "{}", p.display()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("reading the copy: {0}")]
    Fetch(String),
    #[error(
        "{source_name} holds no exported audit log (no runner.pub){}",
        if runners.is_empty() { String::new() } else { format!("; it holds the copies of: {} (name one: {source_name}/<runner>)", runners.join(", ")) }
    )]
    NoCopy { source_name: String, runners: Vec<String> },
    #[error(transparent)]
    Layout(#[from] ExportError),
    #[error("{error}{}", object.as_ref().map(|o| format!(" (in {o})")).unwrap_or_default())]
    Verify { error: VerifyError, object: Option<String> },
    #[error("{0}")]
    Trust(String),
}

/// An object larger than this is not read (a batch is at most a few MiB).
const MAX_OBJECT: usize = 256 << 20;

/// Every object under the prefix, by its name relative to it.
pub async fn fetch(source: &Source, aws: Option<&S3Access>) -> Result<BTreeMap<String, Vec<u8>>, CopyError> {
    match source {
        Source::Dir(dir) => read_dir(dir).map_err(CopyError::Fetch),
        Source::S3 { bucket, prefix } => {
            let aws = aws.ok_or_else(|| CopyError::Fetch("no AWS access configured".into()))?;
            aws.fetch(bucket, prefix).await.map_err(|e| CopyError::Fetch(e.0))
        }
    }
}

fn read_dir(root: &Path) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries.flatten() {
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                let name = path.strip_prefix(root).unwrap_or(&path).to_string_lossy().to_string();
                if meta.len() as usize > MAX_OBJECT {
                    return Err(format!("{}: larger than {MAX_OBJECT} bytes", path.display()));
                }
                out.insert(name, std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?);
            }
        }
    }
    Ok(out)
}

/// The copies beneath the source, by their path under it (`<runner>/runner.pub`, or
/// `<instance>/<runner>/runner.pub` for the install stack's per-instance prefixes).
pub fn runners_in(objects: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
    let suffix = format!("/{}", byoc_audit::log::RUNNER_PUB);
    let mut runners: Vec<String> = objects
        .keys()
        .filter_map(|k| k.strip_suffix(&suffix))
        .filter(|r| r.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != ".."))
        .map(str::to_string)
        .collect();
    runners.sort();
    runners
}

/// One runner's objects, named relative to its prefix.
pub fn copy_of(objects: &BTreeMap<String, Vec<u8>>, runner: &str) -> BTreeMap<String, Vec<u8>> {
    let prefix = format!("{runner}/");
    objects.iter().filter_map(|(k, v)| k.strip_prefix(&prefix).map(|n| (n.to_string(), v.clone()))).collect()
}

/// Reassemble into `work` and verify; the trust is `pinned` (the customer's keys) or
/// the keys published in the copy.
pub fn verify(
    source: &Source,
    objects: &BTreeMap<String, Vec<u8>>,
    work: &Path,
    pinned: Option<&Path>,
) -> Result<(Report, Assembled, bool), CopyError> {
    if !objects.contains_key(byoc_audit::log::RUNNER_PUB) {
        let runners = runners_in(objects);
        return Err(CopyError::NoCopy {
            source_name: source.to_string().trim_end_matches('/').into(),
            runners,
        });
    }
    let assembled = assemble(objects, work)?;
    let (trust, pinned) =
        crate::audit::load_trust(work, pinned).map_err(|e| CopyError::Trust(e.to_string()))?;
    match byoc_audit::verify::verify_dir(work, &trust) {
        Ok(report) => Ok((report, assembled, pinned)),
        Err(error) => {
            let object = object_of(&assembled, &error);
            Err(CopyError::Verify { error, object })
        }
    }
}

/// The object a verification error points into.
fn object_of(a: &Assembled, e: &VerifyError) -> Option<String> {
    let (stream, line) = match e {
        VerifyError::Record { seq, .. } => (Stream::Records, *seq),
        VerifyError::RootMismatch { first_bad, .. } => (Stream::Records, *first_bad),
        VerifyError::Checkpoint { file, line, .. } if file == byoc_audit::log::COSIGNED => {
            (Stream::Cosigned, line.saturating_sub(1))
        }
        VerifyError::Checkpoint { line, .. } => (Stream::Checkpoints, line.saturating_sub(1)),
        VerifyError::IdleGap { line, .. } => (Stream::Checkpoints, line.saturating_sub(1)),
        _ => return None,
    };
    a.object_of(stream, line).map(str::to_string)
}

/// Reading a bucket with the caller's AWS identity (the customer's, on their machine).
pub struct S3Access {
    pub identity: AwsIdentity,
    pub region: String,
    pub endpoint: Option<String>,
}

impl S3Access {
    pub async fn from_env(region: Option<String>, endpoint: Option<String>) -> Result<S3Access, String> {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        if let Some(r) = &region {
            loader = loader.region(aws_config::Region::new(r.clone()));
        }
        let sdk = loader.load().await;
        let region =
            sdk.region().map(|r| r.to_string()).ok_or("no AWS region: give --region or set AWS_REGION")?;
        let endpoint = endpoint.or_else(|| std::env::var("AWS_ENDPOINT_URL").ok().filter(|u| !u.is_empty()));
        Ok(S3Access { identity: AwsIdentity { provider: sdk.credentials_provider() }, region, endpoint })
    }

    async fn get(
        &self,
        http: &reqwest::Client,
        bucket: &str,
        path: &str,
        query: &[(&str, &str)],
    ) -> Result<Vec<u8>, SinkError> {
        let base = match &self.endpoint {
            Some(e) => format!("{}/{bucket}/", e.trim_end_matches('/')),
            None => format!("https://{bucket}.s3.{}.amazonaws.com/", self.region),
        };
        let mut url = url::Url::parse(&base).map_err(|e| SinkError(format!("{base}: {e}")))?;
        if !path.is_empty() {
            url.path_segments_mut()
                .map_err(|()| SinkError(base.clone()))?
                .pop_if_empty()
                .extend(path.split('/'));
        }
        for (k, v) in query {
            url.query_pairs_mut().append_pair(k, v);
        }
        let keys = self.identity.keys().await?;
        let signed = byoc_job_executors::aws_sign::signed_headers(
            &keys.identity(),
            &byoc_job_executors::aws_sign::Request {
                region: &self.region,
                service: "s3",
                method: "GET",
                url: url.as_str(),
                headers: &[],
                body: &[],
                payload_hash_header: true,
                time: SystemTime::now(),
            },
        )
        .map_err(SinkError)?;
        let mut req = http.get(url.as_str());
        for (k, v) in signed {
            req = req.header(k, v);
        }
        let fail = |e: String| SinkError(format!("s3://{bucket}/{path}: {e}"));
        let mut resp = req.send().await.map_err(|e| fail(byoc_oci_sync::client::error_chain(&e)))?;
        let status = resp.status().as_u16();
        let mut body = Vec::new();
        while let Some(chunk) =
            resp.chunk().await.map_err(|e| fail(byoc_oci_sync::client::error_chain(&e)))?
        {
            if body.len() + chunk.len() > MAX_OBJECT {
                return Err(fail(format!("larger than {MAX_OBJECT} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        if !(200..300).contains(&status) {
            return Err(fail(format!("HTTP {status} {}", super::answer_text(&body))));
        }
        Ok(body)
    }

    async fn fetch(&self, bucket: &str, prefix: &str) -> Result<BTreeMap<String, Vec<u8>>, SinkError> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| SinkError(e.to_string()))?;
        let list_prefix = if prefix.is_empty() { String::new() } else { format!("{prefix}/") };
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut query = vec![("list-type", "2"), ("prefix", list_prefix.as_str())];
            if let Some(t) = &token {
                query.push(("continuation-token", t.as_str()));
            }
            let text = String::from_utf8_lossy(&self.get(&http, bucket, "", &query).await?).to_string();
            keys.extend(byoc_job_executors::terraform::bucket::xml_values(&text, "Key"));
            token = (byoc_job_executors::terraform::bucket::xml_values(&text, "IsTruncated")
                .first()
                .map(String::as_str)
                == Some("true"))
            .then(|| {
                byoc_job_executors::terraform::bucket::xml_values(&text, "NextContinuationToken")
                    .into_iter()
                    .next()
            })
            .flatten();
            if token.is_none() {
                break;
            }
        }
        let mut out = BTreeMap::new();
        for key in keys {
            let Some(name) = key.strip_prefix(&list_prefix) else { continue };
            // Only the layout's names are fetched, at the top or one runner down.
            let in_layout = |n: &str| {
                byoc_audit::export::parse_object_name(n).is_some()
                    || [
                        byoc_audit::log::RUNNER_PUB,
                        byoc_audit::log::CONTROL_PLANE_PUB,
                        byoc_audit::export::RUNNER_VKEY,
                    ]
                    .contains(&n)
            };
            let wanted = in_layout(name) || name.split_once('/').is_some_and(|(_, rest)| in_layout(rest));
            let body = if wanted { self.get(&http, bucket, &key, &[]).await? } else { Vec::new() };
            out.insert(name.to_string(), body);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse() {
        assert_eq!(
            Source::parse("s3://acme-audit/byoc-audit/rn-1/").unwrap(),
            Source::S3 { bucket: "acme-audit".into(), prefix: "byoc-audit/rn-1".into() }
        );
        assert_eq!(
            Source::parse("s3://b").unwrap(),
            Source::S3 { bucket: "b".into(), prefix: String::new() }
        );
        assert!(Source::parse("s3:///x").is_err());
        assert_eq!(Source::parse("/tmp/copy").unwrap(), Source::Dir("/tmp/copy".into()));
    }

    #[test]
    fn copies_are_found_at_any_depth_and_odd_names_are_not_copies() {
        let objects: BTreeMap<String, Vec<u8>> = [
            ("AROAEX:i-1/rn-a/runner.pub".to_string(), vec![]),
            ("rn-b/runner.pub".to_string(), vec![]),
            ("../rn-c/runner.pub".to_string(), vec![]),
            ("x//runner.pub".to_string(), vec![]),
        ]
        .into();
        assert_eq!(runners_in(&objects), ["AROAEX:i-1/rn-a", "rn-b"]);
    }

    #[test]
    fn a_prefix_of_several_runners_names_them() {
        let objects: BTreeMap<String, Vec<u8>> =
            [("rn-b/runner.pub".to_string(), vec![]), ("rn-a/runner.pub".to_string(), vec![])].into();
        let source = Source::parse("s3://b/audit").unwrap();
        let err = verify(&source, &objects, Path::new("/nonexistent"), None).err().unwrap();
        assert_eq!(
            err.to_string(),
            "s3://b/audit holds no exported audit log (no runner.pub); it holds the copies of: rn-a, rn-b (name one: s3://b/audit/<runner>)"
        );
    }
}
