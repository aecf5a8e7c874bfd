//! `byoc-bench-terraform`: the runner's overhead over bare terraform, in one run, and
//! the cost of fetching a component by digest. Figures, not assertions.
//!
//! 1. The same module of N `terraform_data` resources (local state), median of R runs
//!    each: bare `terraform init + plan -out + show -json + apply` against the same
//!    through a `terraform` job of a real runner (sandbox for every step, the policy
//!    decision in its own process, the audit log, the state kept by the runner).
//! 2. Fetching a module artifact of about S MiB from the install's registry (moto for
//!    ECR's token, a local docker-registry for the registry): cold (download, verify,
//!    unpack) and cached.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_control_plane::registry::LocalRegistry;
use byoc_control_plane::{ControlPlane, ControlPlaneConfig, EnqueueRequest};
use clap::Parser;

#[derive(Parser)]
#[command(name = "byoc-bench-terraform", about = "bare terraform vs a terraform job; component fetch")]
struct Args {
    #[arg(long)]
    runner_bin: Option<PathBuf>,
    #[arg(long, default_value = "terraform")]
    terraform: String,
    /// `terraform_data` resources in the module.
    #[arg(long, default_value_t = 50)]
    resources: usize,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Size of the module artifact for the fetch figures, MiB.
    #[arg(long, default_value_t = 20)]
    artifact_mib: usize,
}

fn module(resources: usize) -> String {
    (0..resources)
        .map(|i| format!("resource \"terraform_data\" \"r{i}\" {{\n  input = \"value-{i}\"\n}}\n"))
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run(dir: &Path, terraform: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(terraform)
        .current_dir(dir)
        .args(args)
        .env("TF_IN_AUTOMATION", "1")
        .env("CHECKPOINT_DISABLE", "1")
        .env_remove("TF_CLI_CONFIG_FILE")
        .output()
        .with_context(|| format!("terraform {args:?}"))?;
    ensure!(out.status.success(), "terraform {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// init + plan -out + show -json (to a file) + apply, in a fresh directory: the whole
/// and each step's time, ms.
fn bare(terraform: &Path, main_tf: &str) -> anyhow::Result<(Duration, [f64; 4])> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("main.tf"), main_tf)?;
    let t = Instant::now();
    let mut steps = [0.0; 4];
    let mut lap = Instant::now();
    let mut mark = |i: usize| {
        steps[i] = lap.elapsed().as_secs_f64() * 1000.0;
        lap = Instant::now();
    };
    run(dir.path(), terraform, &["init", "-input=false", "-no-color"])?;
    mark(0);
    run(dir.path(), terraform, &["plan", "-input=false", "-no-color", "-out=plan.tfplan"])?;
    mark(1);
    let show =
        Command::new(terraform).current_dir(dir.path()).args(["show", "-json", "plan.tfplan"]).output()?;
    ensure!(show.status.success(), "terraform show");
    std::fs::write(dir.path().join("plan.json"), &show.stdout)?;
    mark(2);
    run(dir.path(), terraform, &["apply", "-input=false", "-no-color", "-auto-approve", "plan.tfplan"])?;
    mark(3);
    Ok((t.elapsed(), steps))
}

/// Where the last job's time went between its audit records: enqueued → received
/// (the long poll's answer, verification) → claimed → started → finished (the sandboxed
/// steps) → reported (the result acknowledged).
fn path_of(state_dir: &Path, job_id: &str, enqueued_ms: u64) -> String {
    let Ok(lines) = byoc_audit::log::read_lines(&state_dir.join("audit"), 0, u64::MAX) else {
        return "no audit log".into();
    };
    let mut last = enqueued_ms;
    let mut out = Vec::new();
    for l in lines {
        let Ok(r) = serde_json::from_str::<serde_json::Value>(&l) else { continue };
        if r["job"] != job_id {
            continue;
        }
        let (Some(event), Some(t)) = (r["event"].as_str(), r["time_ms"].as_u64()) else { continue };
        if ["job_received", "job_claimed", "job_started", "job_finished", "job_reported"].contains(&event) {
            out.push(format!("{event} +{} ms", t.saturating_sub(last)));
            last = t;
        }
    }
    out.join(", ")
}

fn which(name: &str) -> anyhow::Result<PathBuf> {
    let p = PathBuf::from(name);
    if p.is_absolute() {
        return Ok(p);
    }
    std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).map(|d| d.join(name)).find(|f| f.is_file()))
        .with_context(|| format!("{name} is not on PATH"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runner_bin = match &args.runner_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("byoc-runner"),
    };
    let terraform = which(&args.terraform)?;
    let version = Command::new(&terraform).arg("version").output()?;
    println!(
        "byoc-runner terraform benchmark: {} ({}), {} terraform_data resources, median of {}",
        terraform.display(),
        String::from_utf8_lossy(&version.stdout).lines().next().unwrap_or(""),
        args.resources,
        args.runs
    );
    let main_tf = module(args.resources);

    let cp = ControlPlane::start(ControlPlaneConfig::default()).await?;
    let dir = tempfile::tempdir()?;
    let policies = tempfile::tempdir()?;
    let opts = RunnerOptions {
        extra: format!(
            "\n[terraform]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n",
            terraform.display(),
            policies.path().display()
        ),
        ..Default::default()
    };
    let mut runner = RunnerProcess::start(&runner_bin, dir.path(), &cp, &opts)?;
    if !wait_polling(&cp, Duration::from_secs(30)).await {
        bail!("runner did not start:\n{}", runner.log());
    }
    // Bare and through the runner alternately, so drift in the machine's speed falls
    // on both alike.
    let (mut bare_ms, mut job_ms) = (Vec::new(), Vec::new());
    let mut bare_steps: [Vec<f64>; 4] = Default::default();
    let mut last_id = String::new();
    let mut enqueued_ms = 0;
    for i in 0..args.runs {
        let (whole, steps) = bare(&terraform, &main_tf)?;
        bare_ms.push(whole.as_secs_f64() * 1000.0);
        for (all, step) in bare_steps.iter_mut().zip(steps) {
            all.push(step);
        }
        // A workspace of its own each time: every run creates all the resources.
        let req = EnqueueRequest {
            timeout_secs: 600,
            entity: "component".into(),
            operation: "deploy".into(),
            ..EnqueueRequest::new(
                "terraform",
                serde_json::json!({"mode": "apply", "workspace": format!("bench-{i}"), "files": {"main.tf": main_tf}}),
            )
        };
        let t = Instant::now();
        enqueued_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let id = cp.enqueue(req).map_err(|e| anyhow::anyhow!("{e}"))?;
        let v = cp
            .wait_for(&id, Duration::from_secs(600), |v| v.result.is_some())
            .await
            .context("the terraform job did not finish")?;
        let elapsed = t.elapsed();
        let r = v.result.as_ref().context("no result")?;
        ensure!(
            r.status == byoc_protocol::JobStatus::Succeeded,
            "job failed: {:?}\n{}",
            r.error,
            runner.log()
        );
        job_ms.push(elapsed.as_secs_f64() * 1000.0);
        last_id = id;
    }
    // Where a job's time goes, by the job's own log (the last run).
    let log = String::from_utf8_lossy(&cp.log(&last_id).unwrap_or_default()).into_owned();
    let steps: Vec<&str> = log
        .lines()
        .filter(|l| l.ends_with(" ms") || l.contains("] decided in "))
        .map(|l| l.trim_start_matches("[terraform] ").trim_start_matches("[policy] "))
        .collect();
    println!("last job's steps: {}", steps.join("; "));
    println!("last job's path (audit record times): {}", path_of(&runner.state_dir, &last_id, enqueued_ms));
    runner.signal(nix::sys::signal::Signal::SIGTERM);
    let _ = runner.wait_exit(Duration::from_secs(30)).await;
    let [init, plan, show, apply] = bare_steps.map(median);
    println!(
        "bare terraform's steps (medians): init {init:.0} ms, plan {plan:.0} ms, show -json {show:.0} ms, apply {apply:.0} ms"
    );
    let (b, j) = (median(bare_ms), median(job_ms));
    println!(
        "init + plan + show -json + apply: bare terraform median {b:.0} ms; through a terraform job (enqueue to result: sandboxed steps, policy decision, audit, state kept) median {j:.0} ms: {:.2}x",
        j / b
    );

    fetch_figures(args.artifact_mib).await
}

/// Cold and cached fetch of a module artifact of about `mib` MiB.
async fn fetch_figures(mib: usize) -> anyhow::Result<()> {
    let moto = byoc_control_plane::moto::MotoServer::start().await;
    let ecr = LocalRegistry::start(None).await;
    let host = "123456789012.dkr.ecr.us-east-1.amazonaws.com";
    // Text that compresses as source does (about 4:1), in 256 KiB files.
    let per = 256 << 10;
    let count = (mib << 20) / per;
    let files: Vec<(String, String)> = (0..count)
        .map(|i| {
            let mut text = String::with_capacity(per);
            let mut n = i as u64 * 7919 + 1;
            while text.len() < per {
                n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                text.push_str(&format!("variable \"v{:x}\" {{ default = \"{:016x}\" }}\n", n >> 40, n));
            }
            (format!("modules/m{i}.tf"), text)
        })
        .collect();
    let refs: Vec<(&str, &str)> = files.iter().map(|(p, c)| (p.as_str(), c.as_str())).collect();
    let pushed =
        ecr.push_tar_artifact("bench/module", Some("1"), "application/vnd.opentofu.modulepkg", &refs).await;
    let compressed: u64 = serde_json::from_slice::<serde_json::Value>(&pushed.bytes)?["layers"][0]["size"]
        .as_u64()
        .unwrap_or(0);
    let reference = byoc_oci_sync::Reference::parse(&format!("{host}/bench/module@{}", pushed.digest))
        .map_err(anyhow::Error::msg)?;
    let cache = tempfile::tempdir()?;
    let work = tempfile::tempdir()?;
    let mut settings = byoc_job_executors::ExecContext::builder("bench", work.path());
    settings.oci.registry_endpoints.insert(host.to_string(), ecr.url());
    settings.tools.artifacts.dir = Some(cache.path().to_path_buf());
    settings.credentials = Some(byoc_job_executors::JobCredentials {
        endpoint_env: vec![],
        endpoint: None,
        static_env: vec![
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ENDPOINT_URL".into(), moto.url()),
            ("AWS_ACCESS_KEY_ID".into(), "bench".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "bench-secret".into()),
        ],
        container: None,
        feed: Default::default(),
        full_session: None,
    });
    let t = Instant::now();
    let cold = byoc_job_executors::artifact::fetch(&settings, &reference).await?;
    let cold_ms = t.elapsed().as_secs_f64() * 1000.0;
    ensure!(!cold.cached, "the first fetch must not be a cache hit");
    let mut hits = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let hit = byoc_job_executors::artifact::fetch(&settings, &reference).await?;
        ensure!(hit.cached, "a second fetch must be a cache hit");
        hits.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    println!(
        "component fetch of {:.1} MiB unpacked ({} files, {:.1} MiB compressed): cold (ECR token, download, verify, unpack) {cold_ms:.0} ms; cached median {:.0} ms (the ECR token is asked for every time: only a job whose role can read the registry gets the cached tree)",
        cold.bytes as f64 / (1 << 20) as f64,
        cold.files,
        compressed as f64 / (1 << 20) as f64,
        median(hits)
    );
    Ok(())
}
