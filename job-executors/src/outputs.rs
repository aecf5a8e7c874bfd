//! Job outputs: a job appends `KEY=VALUE` lines to the file named by `$BYOC_OUTPUT`
//! (in its working directory); they come back as a JSON object in the job result.
//!
//! Keys are 1–128 of `[A-Za-z0-9_.-]`; values are single-line UTF-8; a later line for
//! the same key wins; blank lines are ignored. The file may be at most 64 KiB.

use std::path::Path;

use crate::mask::Masker;

pub const OUTPUT_FILE: &str = ".byoc-output";
pub const OUTPUT_ENV: &str = "BYOC_OUTPUT";
pub const MAX_OUTPUT_BYTES: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum OutputsError {
    #[error("outputs file is larger than {0} bytes")]
    TooLarge(u64),
    #[error("outputs file is not UTF-8")]
    NotUtf8,
    #[error("outputs file line {line}: {reason}")]
    Line { line: usize, reason: String },
    #[error("reading the outputs file: {why}")]
    Read { code: &'static str, why: String },
}

impl OutputsError {
    /// The reason code a job whose outputs file is refused fails with.
    pub fn code(&self) -> &'static str {
        match self {
            OutputsError::TooLarge(_) => "outputs_too_large",
            OutputsError::NotUtf8 | OutputsError::Line { .. } => "outputs_invalid",
            OutputsError::Read { code, .. } => code,
        }
    }
}

/// Read and validate the outputs file the job left in `work_dir` (beneath it, no link
/// followed, a regular file: `job_files`); a missing file means no outputs. Values are
/// masked like the log.
pub fn read(work_dir: &Path, masker: &Masker) -> Result<serde_json::Value, OutputsError> {
    use crate::job_files::JobFileError;
    let bytes = match crate::job_files::read_if_exists(work_dir, OUTPUT_FILE, MAX_OUTPUT_BYTES) {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(serde_json::json!({})),
        Err(JobFileError::TooLarge { .. }) => return Err(OutputsError::TooLarge(MAX_OUTPUT_BYTES)),
        Err(e) => return Err(OutputsError::Read { code: e.code(), why: e.to_string() }),
    };
    let text = String::from_utf8(bytes).map_err(|_| OutputsError::NotUtf8)?;
    parse(&text, masker)
}

pub fn parse(text: &str, masker: &Masker) -> Result<serde_json::Value, OutputsError> {
    let mut map = serde_json::Map::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: &str| OutputsError::Line { line: i + 1, reason: reason.to_string() };
        let (key, value) = line.split_once('=').ok_or_else(|| bad("expected KEY=VALUE"))?;
        let valid = !key.is_empty()
            && key.len() <= 128
            && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-');
        if !valid {
            return Err(bad("key must be 1-128 characters of [A-Za-z0-9_.-]"));
        }
        map.insert(key.to_string(), serde_json::Value::String(masker.mask_str(value)));
    }
    Ok(serde_json::Value::Object(map))
}

/// Terraform's outputs (`output -json`, or a state's `outputs`) as a job's outputs, with
/// sensitive values replaced.
pub fn from_terraform(raw: &[u8]) -> Result<serde_json::Value, serde_json::Error> {
    let v: serde_json::Value = serde_json::from_slice(raw)?;
    let mut out = serde_json::Map::new();
    for (k, o) in v.as_object().into_iter().flatten() {
        let value = if o["sensitive"].as_bool().unwrap_or(false) { "***".into() } else { o["value"].clone() };
        out.insert(k.clone(), value);
    }
    Ok(serde_json::Value::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_masks_and_lets_later_lines_win() {
        let m = Masker::new(&["s3cr3t-token"]).unwrap();
        let v = parse("url=https://x\n\nretries=3\nurl=https://y\ntoken=Bearer s3cr3t-token\n", &m).unwrap();
        assert_eq!(v, serde_json::json!({"url": "https://y", "retries": "3", "token": "Bearer ***"}));
    }

    #[test]
    fn bad_lines_name_the_line() {
        let m = Masker::none();
        assert_eq!(
            parse("ok=1\nno equals sign\n", &m),
            Err(OutputsError::Line { line: 2, reason: "expected KEY=VALUE".into() })
        );
        assert!(matches!(parse("bad key=1\n", &m), Err(OutputsError::Line { line: 1, .. })));
    }

    #[test]
    fn oversized_or_odd_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(OUTPUT_FILE);
        let read = |m: &Masker| read(dir.path(), m);
        assert_eq!(read(&Masker::none()).unwrap(), serde_json::json!({}));
        std::fs::write(&p, "k=".to_string() + &"v".repeat(MAX_OUTPUT_BYTES as usize)).unwrap();
        assert!(matches!(read(&Masker::none()), Err(OutputsError::TooLarge(_))));
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert_eq!(read(&Masker::none()), Err(OutputsError::NotUtf8));
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &p).unwrap();
        assert!(matches!(read(&Masker::none()), Err(OutputsError::Read { code: "job_file_refused", .. })));
        std::fs::remove_file(&p).unwrap();
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(
            matches!(read(&Masker::none()), Err(OutputsError::Read { code: "job_file_refused", .. })),
            "a FIFO is refused, not waited on"
        );
    }
}
