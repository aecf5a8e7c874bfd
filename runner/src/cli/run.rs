//! `run` (the daemon, as systemd starts it) and `run-local` (one job file, no control
//! plane).

use std::path::{Path, PathBuf};

use super::{EX_USAGE, Output, load_config};

/// Run a job file locally with no control plane: vendors trying an action or a
/// component. terraform, helm and kubernetes jobs are decided by the same policies a
/// customer's runner would use (the local customer policies, `--vendor-policy`, an app
/// config's declarations), and the decision is printed before anything is applied.
#[derive(clap::Args)]
pub(super) struct LocalArgs {
    /// JSON job file: {"kind": "...", "spec": {...}, "timeout_secs": N}
    job_file: PathBuf,
    /// Output format: text for people, json for scripts.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
    output: Output,
    /// Run without the sandbox (the job gets your user's privileges).
    #[arg(long)]
    no_sandbox: bool,
    /// Stop after the policy decision: plan (render, read the manifests), decide,
    /// apply nothing.
    #[arg(long)]
    plan_only: bool,
    /// The customer's policy directory to decide with (`*.rego`, `policies.toml`).
    #[arg(long, default_value = crate::customer_policies::DEFAULT_POLICY_DIR)]
    policies: PathBuf,
    /// A vendor policy file to include (repeatable).
    #[arg(long = "vendor-policy")]
    vendor_policies: Vec<PathBuf>,
    /// An app config directory: its `policies.toml` declarations for this job's type
    /// and --component are included.
    #[arg(long)]
    app_config: Option<PathBuf>,
    /// The component the job deploys (selects the app config's declarations).
    #[arg(long, default_value = "")]
    component: String,
    /// The lifecycle phase (role type) decided under.
    #[arg(long, default_value = "maintenance")]
    phase: String,
    /// The operation decided under (`sandbox.provision` decides a plan as a sandbox's).
    #[arg(long, default_value = "component.deploy")]
    operation: String,
    /// Where terraform state and saved plans are kept between local runs.
    #[arg(long, default_value = ".byoc-run-local")]
    state_dir: PathBuf,
    /// The terraform binary (default: `terraform` on PATH).
    #[arg(long)]
    terraform: Option<PathBuf>,
    /// The helm binary (default: `helm` on PATH).
    #[arg(long)]
    helm: Option<PathBuf>,
    /// Username for the registry a component by digest comes from (password or token
    /// from BYOC_REGISTRY_TOKEN or --registry-token-file; without a username the token
    /// is sent as a bearer token). Any registry will do locally: the digest is verified
    /// all the same. A runner fetches only from the install's own registry.
    #[arg(long)]
    registry_user: Option<String>,
    /// A file holding that registry's password or token (instead of BYOC_REGISTRY_TOKEN).
    #[arg(long)]
    registry_token_file: Option<PathBuf>,
    /// Extra CA roots (PEM) to trust for that registry.
    #[arg(long)]
    ca_bundle: Option<PathBuf>,
    /// Reach registry HOST at URL instead (repeatable): HOST=URL. Only such a registry
    /// may be reached over plain HTTP or on a loopback or link-local address.
    #[arg(long = "endpoint", value_name = "HOST=URL")]
    endpoints: Vec<String>,
    /// A cluster API server (https://HOST:PORT) the job may name although it is on a
    /// loopback, link-local or this machine's own address (repeatable).
    #[arg(long = "allow-cluster-server", value_name = "URL")]
    allowed_cluster_servers: Vec<String>,
}

pub(super) fn daemon(path: &Path) -> i32 {
    // Before any thread or allocation of note: the settings apply to what comes after.
    let lean_allocator = byoc_sandbox::keep_allocator_lean();
    let config = match load_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let sink = crate::logging::init(config.logging.target, &config.logging.level);
    tracing::debug!(sink, "Logging initialised.");
    if !lean_allocator {
        // Memory only: the daemon works the same, it may keep more freed memory.
        tracing::warn!("The C library did not take the allocator settings; idle memory may be higher.");
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(crate::daemon::run(config)) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!(error = %e, "Runner failed: {e}.");
            eprintln!("error: {e}");
            match e {
                crate::daemon::DaemonError::NoBootstrapToken
                | crate::daemon::DaemonError::InstallMismatch { .. } => EX_USAGE,
                _ => 1,
            }
        }
    }
}

/// `run-local`'s own failures (the job file, the options, an endpoint, the runner
/// itself), kept apart from the job's exit codes as `docker run` keeps its own.
pub(super) const EX_RUNNER: i32 = crate::run_local::EXIT_RUNNER;

pub(super) fn local(args: LocalArgs) -> i32 {
    crate::logging::init_cli();
    let output = args.output;
    let (job, exec) = match crate::run_local::load(&args.job_file) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("error: {e}");
            return EX_RUNNER;
        }
    };
    if let Some(about) = &job.about {
        eprintln!("about this job: {about}");
    }
    let options = match local_options(&args, &job.kind) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return EX_RUNNER;
        }
    };
    if let Err(e) = crate::run_local::check_endpoints(&args.job_file, exec.as_ref(), &options) {
        eprintln!("error: {e}");
        return EX_RUNNER;
    }
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return EX_RUNNER;
        }
    };
    let mut captured = Vec::new();
    let capture = (output == Output::Json).then_some(&mut captured);
    match rt.block_on(crate::run_local::run(&job, exec.as_ref(), capture, &options)) {
        Ok(outcome) => {
            if output == Output::Json {
                println!(
                    "{}",
                    serde_json::json!({
                        "status": outcome.status,
                        "exit_code": outcome.exit_code,
                        "error": outcome.error,
                        "outputs": outcome.outputs,
                        "log": String::from_utf8_lossy(&captured),
                    })
                );
            } else if let Some(e) = &outcome.error {
                eprintln!("job {}: {e}", outcome.status.as_str());
            } else {
                eprintln!("job {}", outcome.status.as_str());
            }
            crate::run_local::exit_code(&outcome)
        }
        Err(e) => {
            eprintln!("error: {e}");
            EX_RUNNER
        }
    }
}

/// The policies, tools and state a local run decides and deploys with.
fn local_options(args: &LocalArgs, kind: &str) -> Result<crate::run_local::LocalOptions, String> {
    let decided = byoc_protocol::JobKind::parse(kind).is_some_and(byoc_protocol::JobKind::decided_by_policy);
    let policy = if decided {
        let customer = crate::customer_policies::load(&args.policies).map_err(|problems| {
            format!("the policy directory {} has problems: {}", args.policies.display(), problems.join("; "))
        })?;
        let mut vendor =
            crate::customer_policies::load_files(&args.vendor_policies, byoc_policy::Origin::Vendor)
                .map_err(|e| e.to_string())?;
        let mut cluster_policies = vec![];
        if let Some(dir) = &args.app_config {
            let app = crate::app_policies::load_dir(dir).map_err(|e| e.to_string())?;
            let entity = args.operation.split('.').next().unwrap_or("component");
            vendor.extend(
                crate::app_policies::for_job(&app, kind, entity, &args.component)
                    .map_err(|p| p.join("; "))?,
            );
            cluster_policies = crate::app_policies::cluster_policies(&app)
                .map_err(|p| p.join("; "))?
                .iter()
                .map(|d| (d.policy().name, d.text.clone()))
                .collect();
        }
        let about = crate::customer_policies::Decision {
            phase: args.phase.clone(),
            operation: args.operation.clone(),
            install: "local".into(),
            cluster_policies,
        };
        Some(customer.scope(vendor, about, byoc_policy::Limits::default(), 2048))
    } else {
        None
    };
    let on_path = |tool: &str| {
        std::env::var_os("PATH")
            .and_then(|p| std::env::split_paths(&p).map(|d| d.join(tool)).find(|f| f.is_file()))
            .unwrap_or_else(|| PathBuf::from(format!("/usr/bin/{tool}")))
    };
    let state_dir = std::path::absolute(&args.state_dir).map_err(|e| format!("--state-dir: {e}"))?;
    let token = super::sync::secret(args.registry_token_file.as_deref(), "BYOC_REGISTRY_TOKEN")
        .map_err(|e| format!("{e:#}"))?;
    let registry_credential =
        super::sync::credential(args.registry_user.clone(), token).map_err(|e| format!("{e:#}"))?;
    let mut registry_endpoints = std::collections::BTreeMap::new();
    for e in &args.endpoints {
        let (host, url) = e.split_once('=').ok_or_else(|| format!("--endpoint {e:?}: expected HOST=URL"))?;
        registry_endpoints.insert(host.to_string(), url.to_string());
    }
    Ok(crate::run_local::LocalOptions {
        registry_credential,
        registry_endpoints,
        allowed_cluster_servers: args.allowed_cluster_servers.clone(),
        ca_bundle: args.ca_bundle.clone(),
        sandboxed: !args.no_sandbox,
        decide_only: args.plan_only,
        policy,
        terraform: args.terraform.clone().unwrap_or_else(|| on_path("terraform")),
        helm: args.helm.clone().unwrap_or_else(|| on_path("helm")),
        state_dir,
    })
}
