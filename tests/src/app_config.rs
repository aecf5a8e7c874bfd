//! Loading an app config from a directory into the form jobs carry.

use std::path::{Path, PathBuf};

/// The examples shipped with the repository (`examples/`).
pub fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

pub fn load(dir: &Path) -> anyhow::Result<byoc_protocol::AppConfig> {
    byoc_protocol::app_dir::load(dir).map_err(|problems| anyhow::anyhow!("{}", problems.join("; ")))
}
