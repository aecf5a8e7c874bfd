//! `[audit.export]`: the customer's own copies of the audit log (docs/AUDIT.md). Set by
//! the install stack from its parameters; a job cannot change the runner's configuration.

use std::path::PathBuf;
use std::time::Duration;

use super::fields::{Fields, validate_url};

#[derive(Debug, Clone, Default)]
pub struct AuditConfig {
    pub export: AuditExportConfig,
}

#[derive(Debug, Clone, Default)]
pub struct AuditExportConfig {
    pub s3: Option<S3SinkConfig>,
    pub cloudwatch: Option<CloudWatchSinkConfig>,
    pub otlp: Option<OtlpSinkConfig>,
    /// Most records (and checkpoints) sent in one request.
    pub batch_records: usize,
    /// The longest wait between retries while a sink is failing.
    pub retry_max: Duration,
}

impl AuditExportConfig {
    pub fn is_empty(&self) -> bool {
        self.s3.is_none() && self.cloudwatch.is_none() && self.otlp.is_none()
    }
}

/// `[audit.export.s3]`: objects under `s3://bucket/prefix/<runner id>/`.
#[derive(Debug, Clone, PartialEq)]
pub struct S3SinkConfig {
    pub bucket: String,
    /// Without slashes at either end; may be empty.
    pub prefix: String,
    /// `None`: `aws.region`.
    pub region: Option<String>,
    /// `None`: `aws.endpoint_url`.
    pub endpoint_url: Option<String>,
}

/// `[audit.export.cloudwatch]`: one log stream per runner.
#[derive(Debug, Clone, PartialEq)]
pub struct CloudWatchSinkConfig {
    pub log_group: String,
    /// `None`: the runner's id.
    pub log_stream: Option<String>,
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
}

/// `[audit.export.otlp]`: OTLP/HTTP logs (JSON encoding) to the customer's collector.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpSinkConfig {
    /// The collector's base URL; `/v1/logs` is appended unless it ends so already.
    pub endpoint: reqwest::Url,
    /// PEM certificates the collector's certificate may chain to, besides the system's.
    pub ca_file: Option<PathBuf>,
    /// Lines `Name: value` sent with every request (an API key): a file, so the value
    /// never sits in runner.toml or reaches a log.
    pub headers_file: Option<PathBuf>,
    pub timeout: Duration,
}

impl AuditConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("audit", table, problems);
        let export_t = f.table("export");
        f.finish();
        let mut f = Fields::new("audit.export", export_t, problems);
        let (s3_t, cw_t, otlp_t) = (f.table("s3"), f.table("cloudwatch"), f.table("otlp"));
        let batch_records = f.ranged("batch_records", 1000, 1..=10_000) as usize;
        let retry_max = f.secs("retry_max_secs", 60, 1..=3600);
        f.finish();
        let export = AuditExportConfig {
            s3: (!s3_t.is_empty()).then(|| parse_s3(s3_t, problems)).flatten(),
            cloudwatch: (!cw_t.is_empty()).then(|| parse_cloudwatch(cw_t, problems)).flatten(),
            otlp: (!otlp_t.is_empty()).then(|| parse_otlp(otlp_t, problems)).flatten(),
            batch_records,
            retry_max,
        };
        AuditConfig { export }
    }
}

fn parse_s3(table: toml::Table, problems: &mut Vec<String>) -> Option<S3SinkConfig> {
    let mut f = Fields::new("audit.export.s3", table, problems);
    let bucket: Option<String> = f.required("bucket");
    let prefix: String = f.get("prefix").unwrap_or_else(|| "byoc-audit".into());
    let region: Option<String> = f.get("region");
    let endpoint_url: Option<String> = f.get("endpoint_url");
    let problems = f.finish();
    let bucket = bucket?;
    // S3's bucket naming rules: no value of the customer's becomes part of a host name
    // or path unchecked.
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !bucket_ok {
        problems.push(format!(
            "audit.export.s3.bucket: {bucket:?} is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-')"
        ));
        return None;
    }
    let prefix = prefix.trim_matches('/').to_string();
    let prefix_ok = prefix.is_empty()
        || (prefix.len() <= 512
            && prefix.bytes().all(|b| b.is_ascii_alphanumeric() || b"!-_.*'()/:@".contains(&b))
            && prefix.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != ".."));
    if !prefix_ok {
        problems.push(format!(
            "audit.export.s3.prefix: {prefix:?}: segments of A-Z a-z 0-9 ! - _ . * ' ( ) : @ separated by '/', no '.' or '..' segment"
        ));
        return None;
    }
    Some(S3SinkConfig { bucket, prefix, region, endpoint_url })
}

fn parse_cloudwatch(table: toml::Table, problems: &mut Vec<String>) -> Option<CloudWatchSinkConfig> {
    let mut f = Fields::new("audit.export.cloudwatch", table, problems);
    let log_group: Option<String> = f.required("log_group");
    let log_stream: Option<String> = f.get("log_stream");
    let region: Option<String> = f.get("region");
    let endpoint_url: Option<String> = f.get("endpoint_url");
    let problems = f.finish();
    let log_group = log_group?;
    // CloudWatch Logs' own rules.
    if log_group.is_empty()
        || log_group.len() > 512
        || !log_group.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-/#".contains(&b))
    {
        problems.push(format!(
            "audit.export.cloudwatch.log_group: {log_group:?} is not a log group name (1-512 of A-Z a-z 0-9 . _ - / #)"
        ));
        return None;
    }
    if let Some(s) = &log_stream
        && (s.is_empty() || s.len() > 512 || s.contains([':', '*']) || s.chars().any(char::is_control))
    {
        problems.push(format!(
            "audit.export.cloudwatch.log_stream: {s:?} is not a log stream name (1-512 characters, no ':' or '*')"
        ));
        return None;
    }
    Some(CloudWatchSinkConfig { log_group, log_stream, region, endpoint_url })
}

fn parse_otlp(table: toml::Table, problems: &mut Vec<String>) -> Option<OtlpSinkConfig> {
    let mut f = Fields::new("audit.export.otlp", table, problems);
    let endpoint: Option<String> = f.required("endpoint");
    let ca_file = f.get::<String>("ca_file").map(PathBuf::from);
    if let Some(p) = &ca_file {
        f.require_absolute("ca_file", p);
    }
    let headers_file = f.get::<String>("headers_file").map(PathBuf::from);
    if let Some(p) = &headers_file {
        f.require_absolute("headers_file", p);
    }
    let allow_insecure_loopback: bool = f.get("allow_insecure_loopback").unwrap_or(false);
    let timeout = f.secs("timeout_secs", 30, 1..=600);
    let problems = f.finish();
    let endpoint = match validate_url(&endpoint?, allow_insecure_loopback) {
        Ok(u) => u,
        Err(e) => {
            // The collector's address is the customer's: say which setting allows http.
            let e = e.replace(
                "control_plane.allow_insecure_loopback",
                "audit.export.otlp.allow_insecure_loopback",
            );
            problems.push(format!("audit.export.otlp.endpoint: {e}"));
            return None;
        }
    };
    Some(OtlpSinkConfig { endpoint, ca_file, headers_file, timeout })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> (AuditConfig, Vec<String>) {
        let mut problems = Vec::new();
        let table: toml::Table = text.parse().unwrap_or_default();
        let audit = table.get("audit").and_then(|t| t.as_table()).cloned().unwrap_or_default();
        (AuditConfig::parse(audit, &mut problems), problems)
    }

    #[test]
    fn every_sink_parses_with_its_defaults() {
        let (c, problems) = parse(
            "[audit.export.s3]\nbucket = \"acme-audit\"\n[audit.export.cloudwatch]\nlog_group = \"/byoc/audit\"\n\
             [audit.export.otlp]\nendpoint = \"https://otel.acme.example:4318\"\nca_file = \"/etc/byoc-runner/otel-ca.pem\"\n",
        );
        assert!(problems.is_empty(), "{problems:?}");
        let e = &c.export;
        assert_eq!(e.s3.as_ref().map(|s| s.prefix.as_str()), Some("byoc-audit"));
        assert_eq!(e.cloudwatch.as_ref().map(|s| s.log_stream.clone()), Some(None));
        assert_eq!(e.otlp.as_ref().map(|o| o.timeout), Some(Duration::from_secs(30)));
        assert_eq!((e.batch_records, e.retry_max), (1000, Duration::from_secs(60)));
        assert!(parse("").0.export.is_empty());
    }

    #[test]
    fn hostile_or_wrong_values_are_refused_with_the_setting_named() {
        for (text, want) in [
            ("[audit.export.s3]\nbucket = \"../etc\"", "audit.export.s3.bucket"),
            ("[audit.export.s3]\nbucket = \"ok-bucket\"\nprefix = \"a/../b\"", "audit.export.s3.prefix"),
            ("[audit.export.s3]\nprefix = \"x\"", "audit.export.s3.bucket: required"),
            ("[audit.export.cloudwatch]\nlog_group = \"a b\"", "audit.export.cloudwatch.log_group"),
            ("[audit.export.cloudwatch]\nlog_group = \"g\"\nlog_stream = \"a:b\"", "log_stream"),
            ("[audit.export.otlp]\nendpoint = \"http://collector.example:4318\"", "use https://"),
            (
                "[audit.export.otlp]\nendpoint = \"http://127.0.0.1:4318\"",
                "audit.export.otlp.allow_insecure_loopback",
            ),
            ("[audit.export.otlp]\nendpoint = \"https://c.example\"\nca_file = \"ca.pem\"", "absolute"),
            ("[audit.export]\nbatch_records = 0", "out of range"),
            ("[audit.export.s3]\nbucket = \"b-1\"\nsecret = 1", "audit.export.s3.secret: unknown setting"),
        ] {
            let (_, problems) = parse(text);
            assert!(problems.iter().any(|p| p.contains(want)), "{text}: {problems:?}");
        }
        let (c, problems) = parse(
            "[audit.export.otlp]\nendpoint = \"http://127.0.0.1:4318\"\nallow_insecure_loopback = true",
        );
        assert!(problems.is_empty() && c.export.otlp.is_some(), "{problems:?}");
    }
}
