//! `sync`: copy an OCI artifact between registries with the engine `oci.sync` jobs use.

use std::path::{Path, PathBuf};

use super::{EX_USAGE, Output};

#[derive(clap::Args)]
pub(super) struct SyncArgs {
    /// The source, host/repository[:tag][@sha256:…]; with a digest, other content is refused.
    source: String,
    /// The destination, host/repository[:tag]; tagged with the source's tag when it names none.
    destination: String,
    /// Source username (password or token from BYOC_SYNC_SRC_TOKEN or --src-token-file;
    /// without a username the token is sent as a bearer token).
    #[arg(long)]
    src_user: Option<String>,
    /// A file holding the source's password or token (instead of BYOC_SYNC_SRC_TOKEN).
    #[arg(long)]
    src_token_file: Option<PathBuf>,
    /// Destination username (password or token from BYOC_SYNC_DEST_TOKEN or
    /// --dest-token-file).
    #[arg(long)]
    dest_user: Option<String>,
    /// A file holding the destination's password or token (instead of BYOC_SYNC_DEST_TOKEN).
    #[arg(long)]
    dest_token_file: Option<PathBuf>,
    /// Do not copy signatures, SBOMs and attestations that refer to the artifact.
    #[arg(long)]
    no_referrers: bool,
    /// Blobs copied at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=32))]
    parallel: u16,
    /// Upload chunk size in MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    chunk_mib: u64,
    /// Extra CA roots (PEM) to trust for both registries.
    #[arg(long)]
    ca_bundle: Option<PathBuf>,
    /// Reach registry HOST at URL instead (repeatable): HOST=URL.
    #[arg(long = "endpoint", value_name = "HOST=URL")]
    endpoints: Vec<String>,
    /// Output format: text for people, json for scripts.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
    output: Output,
}

pub(super) fn secret(file: Option<&Path>, env: &str) -> anyhow::Result<Option<String>> {
    use anyhow::Context as _;
    match file {
        Some(f) => Ok(Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("reading {}", f.display()))?
                .trim()
                .to_string(),
        )),
        None => Ok(std::env::var(env).ok().filter(|v| !v.is_empty())),
    }
}

pub(super) fn credential(
    user: Option<String>,
    token: Option<String>,
) -> anyhow::Result<Option<byoc_oci_sync::Credential>> {
    Ok(match (user, token) {
        (Some(username), Some(secret)) => Some(byoc_oci_sync::Credential::Basic { username, secret }),
        (None, Some(t)) => Some(byoc_oci_sync::Credential::Bearer(t)),
        (Some(u), None) => {
            anyhow::bail!("a username ({u}) but no token: set the token file or environment variable")
        }
        (None, None) => None,
    })
}

pub(super) fn run(a: SyncArgs) -> i32 {
    crate::logging::init_cli();
    let output = a.output;
    let fail = |code: &str, msg: &str| match output {
        Output::Json => println!("{}", serde_json::json!({"ok": false, "code": code, "error": msg})),
        Output::Text => eprintln!("error: {msg}"),
    };
    let (src, dst, endpoints, src_cred, dst_cred) = match prepare(&a) {
        Ok(p) => p,
        Err(e) => {
            fail("usage", &format!("{e:#}"));
            return EX_USAGE;
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            fail("runtime", &e.to_string());
            return 1;
        }
    };
    let result = rt.block_on(async {
        use byoc_oci_sync::{Copier, Options, Registry, Side};
        let http = Registry::http_client_with_ca(a.ca_bundle.as_deref())?;
        let s = Registry::new(
            Side::Source,
            &src.registry,
            endpoints.get(&src.registry).map(String::as_str),
            src_cred,
            http.clone(),
        )?;
        let d = Registry::new(
            Side::Destination,
            &dst.registry,
            endpoints.get(&dst.registry).map(String::as_str),
            dst_cred,
            http,
        )?;
        let options = Options {
            parallel: a.parallel as usize,
            chunk_size: a.chunk_mib << 20,
            referrers: !a.no_referrers,
        };
        let copier = Copier::new(std::sync::Arc::new(s), std::sync::Arc::new(d), options);
        let reference = match (&src.digest, &src.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => "latest".to_string(),
        };
        let tags: Vec<String> = dst.tag.iter().cloned().collect();
        let progress = show_progress(copier.counters.clone(), output);
        let r = copier.copy(&src.repository, &reference, src.digest.as_ref(), &dst.repository, &tags).await;
        progress.abort();
        if output == Output::Text && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            eprintln!();
        }
        r
    });
    match result {
        Ok(r) => {
            print_report(&r, output);
            0
        }
        Err(e) => {
            fail(&e.code(), &e.to_string());
            1
        }
    }
}

type Prepared = (
    byoc_oci_sync::Reference,
    byoc_oci_sync::Reference,
    std::collections::BTreeMap<String, String>,
    Option<byoc_oci_sync::Credential>,
    Option<byoc_oci_sync::Credential>,
);

/// The references (the destination keeps the source's tag unless it names one), the
/// registry endpoints and the credentials.
fn prepare(a: &SyncArgs) -> anyhow::Result<Prepared> {
    let src = byoc_oci_sync::Reference::parse(&a.source).map_err(anyhow::Error::msg)?;
    let mut dst = byoc_oci_sync::Reference::parse(&a.destination).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(dst.digest.is_none(), "the destination names no digest (the source's is kept)");
    if dst.tag.is_none() {
        dst.tag = src.tag.clone();
    }
    let mut endpoints = std::collections::BTreeMap::new();
    for e in &a.endpoints {
        let (h, u) =
            e.split_once('=').ok_or_else(|| anyhow::anyhow!("--endpoint {e:?}: expected HOST=URL"))?;
        endpoints.insert(h.to_string(), u.to_string());
    }
    let src_cred =
        credential(a.src_user.clone(), secret(a.src_token_file.as_deref(), "BYOC_SYNC_SRC_TOKEN")?)?;
    let dst_cred =
        credential(a.dest_user.clone(), secret(a.dest_token_file.as_deref(), "BYOC_SYNC_DEST_TOKEN")?)?;
    Ok((src, dst, endpoints, src_cred, dst_cred))
}

/// Progress on a terminal, four times a second, until aborted.
fn show_progress(
    counters: std::sync::Arc<byoc_oci_sync::Counters>,
    output: Output,
) -> tokio::task::JoinHandle<()> {
    use std::io::IsTerminal as _;
    let on_terminal = output == Output::Text && std::io::stderr().is_terminal();
    tokio::spawn(async move {
        if !on_terminal {
            return;
        }
        let start = std::time::Instant::now();
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(250));
        loop {
            tick.tick().await;
            let o = std::sync::atomic::Ordering::Relaxed;
            let read = counters.bytes_read.load(o);
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            eprint!(
                "\r{}/{} blobs, {:.1}/{:.1} MiB, {:.1} MiB/s   ",
                counters.blobs_done.load(o),
                counters.blobs_total.load(o),
                mib(counters.bytes_done.load(o)),
                mib(counters.bytes_total.load(o)),
                mib(read) / start.elapsed().as_secs_f64().max(0.001),
            );
        }
    })
}

fn print_report(r: &byoc_oci_sync::Report, output: Output) {
    match output {
        Output::Json => println!("{}", serde_json::json!({"ok": true, "report": r})),
        Output::Text => println!(
            "{} -> {}\n{} manifests ({} pushed), {} blobs: {} moved, {} present, {} mounted; {} bytes moved, {} skipped; {} referrers; tags {:?}",
            r.source,
            r.destination,
            r.manifests,
            r.manifests_pushed,
            r.blobs,
            r.blobs_moved,
            r.blobs_skipped,
            r.blobs_mounted,
            r.bytes_moved,
            r.bytes_skipped,
            r.referrers,
            r.tags
        ),
    }
}
