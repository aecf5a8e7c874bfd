//! `byoc-demo`: the local demo. Starts the reference control plane and a real
//! `byoc-runner` on loopback with temp dirs, sends the example jobs from
//! `examples/demo.toml`, waits for each, prints a table and exits non-zero if any job
//! did not end as expected.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_control_plane::state::JobState;
use byoc_control_plane::{ControlPlane, ControlPlaneConfig, EnqueueRequest, JobView, Tamper};
use clap::Parser;
use serde::Deserialize;

#[derive(Parser)]
#[command(
    name = "byoc-demo",
    about = "Run the byoc-runner demo: control plane + runner + example jobs, on loopback"
)]
struct Args {
    /// Demo plan.
    #[arg(long, default_value = "examples/demo.toml")]
    plan: PathBuf,
    /// The runner binary (default: byoc-runner next to this program).
    #[arg(long)]
    runner_bin: Option<PathBuf>,
    /// Keep the runner's state dir and logs here instead of a temp dir.
    #[arg(long)]
    keep: Option<PathBuf>,
    /// Seconds to wait for each job.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
    /// The demo's stand-in for `systemctl` (the demo plays systemd for its runner): ask
    /// the demo at SOCKET to stop or start byoc-runner.service.
    #[arg(long, hide = true, value_name = "SOCKET")]
    service_ctl: Option<PathBuf>,
    #[arg(hide = true, trailing_var_arg = true, allow_hyphen_values = true)]
    service_args: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Plan {
    /// The install's AWS side (lifecycle roles); a moto server stands in for AWS.
    #[serde(default)]
    install: Option<Install>,
    /// The vendor's registry and the install's ECR, for `oci.sync` jobs.
    #[serde(default)]
    registry: Option<RegistryDemo>,
    /// The terraform the runner uses (no real one can be downloaded on the build
    /// machines: the demo uses the tests' stand-in, which says so in every job log).
    #[serde(default)]
    terraform: Option<TerraformDemo>,
    /// A terraform module published to the vendor's registry (`${MODULE_DIGEST}`).
    #[serde(default)]
    component: Option<ComponentDemo>,
    /// The customer's guardrails: TOML appended to the runner's configuration
    /// (`[[guardrails.window]]`, `[[guardrails.approval_rule]]`, docs/GUARDRAILS.md).
    #[serde(default)]
    guardrails: Option<GuardrailsDemo>,
    /// The runner updates itself once the jobs have settled, and goes back.
    #[serde(default)]
    runner_update: Option<RunnerUpdateDemo>,
    job: Vec<PlannedJob>,
}

/// The runner's own update, played through on loopback: the runner is installed from a
/// signed package into a throwaway root (`dpkg --root`), the vendor publishes the next
/// release to the install's registry and sends `runner.update`, the customer approves
/// it, the updater applies it, and the customer rolls back with `update rollback`. The
/// demo plays systemd: the updater's path unit, and the runner's service that the
/// updater stops and starts.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RunnerUpdateDemo {
    /// `packaging/build-deb`, relative to the plan.
    packager: PathBuf,
    /// The version the runner is installed at, and the vendor's next release: the
    /// runner under demonstration packaged twice.
    from_version: String,
    to_version: String,
    /// Install stack parameters the customer changes first (the update is fetched under
    /// the maintenance role).
    #[serde(default)]
    stack: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GuardrailsDemo {
    runner_config: String,
}

/// A component module the demo publishes as an OCI artifact (one tar.gz layer).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ComponentDemo {
    /// Relative to the plan file.
    module_dir: PathBuf,
    repository: String,
    tag: String,
}

/// Two local registries: the vendor's (in token mode: it trusts the control plane's
/// token service, where a job's one-time grant is exchanged once) and one standing in
/// for the install's ECR (moto's registry host mapped to it). An image with a signature
/// is pushed to the vendor's; job files name it with placeholders: `${VENDOR_REGISTRY}`,
/// `${IMAGE_DIGEST}`, and ask the control plane for a grant (`source_grant`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TerraformDemo {
    /// The stand-in, relative to the plan file: for modules whose plans only a
    /// provider could make (they carry fake-plan.json).
    binary: PathBuf,
    /// The real terraform for every other module: a path, or a name on PATH.
    #[serde(default)]
    real: Option<String>,
    /// A filesystem mirror of the real `hashicorp/aws` provider (these machines ship one
    /// beside terraform): the customer's `cli_config_file` names it, and jobs plan and
    /// apply real `aws_*` resources against a moto of their own (`${AWS_ENDPOINT}`),
    /// reached through the job's own network.
    #[serde(default)]
    aws_provider_mirror: Option<PathBuf>,
}

/// Where the real aws provider's calls go: a moto on a neighbour host.
struct RealAws {
    moto: byoc_control_plane::moto::MotoServer,
    _host: byoc_control_plane::netlab::NeighbourHost,
    cli_config: PathBuf,
}

/// A moto of its own on a neighbour host (a job reaches it through its own network, as
/// it reaches AWS), and the customer's CLI configuration naming the provider mirror.
async fn real_aws(mirror: &Path, tools: &Path) -> anyhow::Result<RealAws> {
    let provider = mirror.join("registry.terraform.io/hashicorp/aws");
    if !provider.is_dir() {
        bail!(
            "the demo applies real aws_* resources with the hashicorp/aws provider from the filesystem mirror {}, which has none ({} is missing)",
            mirror.display(),
            provider.display()
        );
    }
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "the demo's real AWS resources need root (a neighbour host: a network namespace and a veth pair)"
        );
    }
    let host = byoc_control_plane::netlab::NeighbourHost::create("203.0.113.2/30", "203.0.113.1/30");
    let moto = byoc_control_plane::moto::MotoServer::start_in(host.ns.path(), "203.0.113.1").await;
    let cli_config = tools.join("terraform.rc");
    std::fs::write(
        &cli_config,
        format!(
            "provider_installation {{\n  filesystem_mirror {{\n    path    = \"{}\"\n    include = [\"registry.terraform.io/hashicorp/aws\"]\n  }}\n}}\n",
            mirror.display()
        ),
    )?;
    println!(
        "aws for jobs   {} (moto on a neighbour host; the real hashicorp/aws provider from {})",
        moto.url(),
        mirror.display()
    );
    Ok(RealAws { moto, _host: host, cli_config })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistryDemo {
    image_repository: String,
    image_tag: String,
    layers: usize,
    layer_bytes: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Install {
    /// CloudFormation template (JSON) of the install stack: role switches and ARNs.
    stack_template: PathBuf,
    /// Directory with `permissions/*.toml`, `break_glass.toml`, `operation_roles.toml`.
    app_config: PathBuf,
    external_id: String,
    /// The customer's secrets, as the install stack would have stored them in Secrets
    /// Manager (`<install id>/secrets/<name>`; moto's CloudFormation does not create them).
    #[serde(default)]
    secrets: std::collections::BTreeMap<String, String>,
}

/// The role a job asks for, and the per-job inputs of the precedence chain.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlannedRole {
    entity: String,
    operation: String,
    #[serde(default)]
    entity_name: String,
    requested: String,
    #[serde(default)]
    runtime_override: Option<String>,
    #[serde(default)]
    break_glass_role: Option<String>,
    #[serde(default)]
    entity_role: Option<String>,
}

const DEMO_STACK: &str = "byoc-install-demo";
const DEMO_ACCOUNT: &str = "123456789012";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlannedJob {
    file: PathBuf,
    expect: String,
    #[serde(default)]
    cancel: bool,
    #[serde(default)]
    tamper: Tamper,
    #[serde(default)]
    replay_of: Option<usize>,
    /// Sent with the source grant minted for this earlier job (a copy of it, as from a
    /// captured request) instead of a grant of its own.
    #[serde(default)]
    grant_of: Option<usize>,
    #[serde(default)]
    role: Option<PlannedRole>,
    /// Install stack parameters to change (a stack update) before this job is sent.
    #[serde(default)]
    stack: std::collections::BTreeMap<String, String>,
    /// Send only once every earlier job has settled.
    #[serde(default)]
    after_earlier: bool,
    /// Once the job awaits approval, the customer approves it on the VM with this
    /// reason (`byoc-runner approve`).
    #[serde(default)]
    approve: Option<String>,
    /// Once the job awaits approval, the customer denies it with this reason.
    #[serde(default)]
    deny: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JobFile {
    /// For people and `run-local` only (what the job shows, why run-local cannot run it).
    #[serde(default)]
    #[allow(dead_code)]
    about: Option<String>,
    kind: String,
    #[serde(default)]
    spec: serde_json::Value,
    #[serde(default = "default_timeout")]
    timeout_secs: u64,
}

fn default_timeout() -> u64 {
    600
}

fn outcome(v: &JobView) -> Option<String> {
    if let Some(r) = &v.result {
        return Some(r.status.as_str().to_string());
    }
    v.rejections.first().map(|(reason, _)| format!("rejected:{}", reason.code()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(socket) = &args.service_ctl {
        return service_ctl(socket, &args.service_args);
    }
    if !args.service_args.is_empty() {
        bail!("unexpected arguments: {} (see --help)", args.service_args.join(" "));
    }
    let plan_text =
        std::fs::read_to_string(&args.plan).with_context(|| format!("reading {}", args.plan.display()))?;
    let plan: Plan =
        toml::from_str(&plan_text).with_context(|| format!("parsing {}", args.plan.display()))?;
    let base = args.plan.parent().unwrap_or(Path::new(".")).to_path_buf();
    if plan.runner_update.is_some() && (plan.install.is_none() || plan.registry.is_none()) {
        bail!(
            "[runner_update] needs [install] and [registry]: the release is fetched from the install's registry"
        );
    }
    let built_runner = match args.runner_bin {
        Some(p) => p,
        None => std::env::current_exe()?.with_file_name("byoc-runner"),
    };
    if !built_runner.exists() {
        bail!(
            "runner binary {} not found: build it with `cargo build -p byoc-runner`",
            built_runner.display()
        );
    }

    let cp =
        ControlPlane::start(ControlPlaneConfig::default()).await.context("starting the control plane")?;
    let tmp = tempfile::tempdir()?;
    let dir = match &args.keep {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => tmp.path().to_path_buf(),
    };
    println!("control plane  {} (admin {})", cp.runner_url(), cp.admin_url());
    let mut options = RunnerOptions::default();
    let mut aws = match &plan.install {
        Some(install) => Some(aws_side(install, &base, &cp, &mut options).await?),
        None => None,
    };
    let (registries, placeholders) = match &plan.registry {
        Some(r) => {
            if aws.is_none() {
                bail!("[registry] needs an [install] section (ECR is reached under the job's role)");
            }
            let (registries, placeholders) =
                start_registries(r, plan.component.as_ref(), &base, &cp, &mut options).await?;
            (Some(registries), placeholders)
        }
        None => (None, Vec::new()),
    };
    // Copied out of the source tree: inside the sandbox the job's directory is /work.
    let tools = tempfile::tempdir()?;
    let policies = tempfile::tempdir()?;
    let mut placeholders = placeholders;
    let real_aws = match plan.terraform.as_ref().and_then(|t| t.aws_provider_mirror.as_ref()) {
        Some(mirror) => {
            let aws = real_aws(mirror, tools.path()).await?;
            placeholders.push(("${AWS_ENDPOINT}".into(), aws.moto.url()));
            Some(aws)
        }
        None => None,
    };
    if let Some(t) = &plan.terraform {
        let cli_config = real_aws.as_ref().map(|a| a.cli_config.as_path());
        terraform_tools(t, &base, tools.path(), policies.path(), cli_config, &mut options)?;
    }
    if let Some(g) = &plan.guardrails {
        options.extra.push('\n');
        options.extra.push_str(&g.runner_config);
        println!("guardrails     the customer's approval rules and windows (docs/GUARDRAILS.md)");
    }
    let installed = match &plan.runner_update {
        Some(u) => Some(install_from_package(u, &base, &built_runner, &dir, &mut options)?),
        None => None,
    };
    let runner_bin = installed.as_ref().map(|i| i.binary()).unwrap_or(built_runner);
    let mut runner = RunnerProcess::start(&runner_bin, &dir, &cp, &options)?;
    println!("runner         {} (state {})", runner_bin.display(), runner.state_dir.display());
    if !wait_polling(&cp, Duration::from_secs(30)).await {
        bail!("the runner did not enroll and poll within 30 s; its log:\n{}", runner.log());
    }
    println!("runner enrolled and polling; sending {} jobs\n", plan.job.len());

    let wait = Duration::from_secs(args.timeout_secs);
    let started = Instant::now();
    let (ids, names) = send_jobs(&plan, &base, &cp, &runner, aws.as_mut(), &placeholders, wait).await?;
    let mut failures = report(&plan, &cp, &ids, &names, wait).await;
    println!("\nall jobs settled in {:.1} s", started.elapsed().as_secs_f64());
    if let (Some(u), Some(aws)) = (&plan.runner_update, aws.as_mut())
        && !u.stack.is_empty()
    {
        aws.params.extend(u.stack.clone());
        let list: Vec<(&str, &str)> = aws.params.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        aws.moto.put_stack("UpdateStack", DEMO_STACK, &aws.template, &list).await;
        let change: Vec<String> = u.stack.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("customer updated the install stack: {}", change.join(", "));
    }
    if let (Some(installed), Some(aws), Some((_, ecr))) = (&installed, &aws, &registries)
        && let Err(e) = update_and_back(installed, &cp, &mut runner, &aws.app, ecr, wait).await
    {
        failures += 1;
        println!("the runner's update FAILED: {e:#}");
    }

    // Stop the runner the way systemd does, and check it drains cleanly.
    runner.signal(nix::sys::signal::Signal::SIGTERM);
    match runner.wait_exit(Duration::from_secs(30)).await {
        Some(s) if s.success() => println!("runner drained and stopped cleanly"),
        other => {
            failures += 1;
            println!("runner did not stop cleanly: {other:?}");
        }
    }
    customer_view(&plan, &cp, &runner_bin, &runner, &ids, aws.is_some())?;
    drop(registries);
    if !status_and_verify(&runner_bin, &runner.state_dir)? {
        failures += 1;
    }
    if failures > 0 {
        eprintln!(
            "demo FAILED: {failures} job(s) did not end as expected; runner log: {}",
            runner.log_path.display()
        );
        if args.keep.is_none() {
            eprintln!("{}", runner.log());
        }
        std::process::exit(1);
    }
    println!("demo passed: every job ended as expected");
    Ok(())
}

/// The install's AWS side, in moto: the install stack, the customer's secrets, and the
/// runner's configuration for them.
struct AwsSide {
    moto: byoc_control_plane::moto::MotoServer,
    template: serde_json::Value,
    params: std::collections::BTreeMap<String, String>,
    app: byoc_protocol::AppConfig,
}

async fn aws_side(
    install: &Install,
    base: &Path,
    cp: &ControlPlane,
    options: &mut RunnerOptions,
) -> anyhow::Result<AwsSide> {
    let moto = byoc_control_plane::moto::MotoServer::start().await;
    let path = base.join(&install.stack_template);
    let template: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))?;
    let params: std::collections::BTreeMap<String, String> = [
        ("InstallId".to_string(), cp.install_id()),
        (
            "RunnerInstanceRoleArn".to_string(),
            format!("arn:aws:iam::{DEMO_ACCOUNT}:role/byoc-runner-instance"),
        ),
        ("ExternalId".to_string(), install.external_id.clone()),
    ]
    .into_iter()
    .collect();
    let list: Vec<(&str, &str)> = params.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    moto.put_stack("CreateStack", DEMO_STACK, &template, &list).await;
    println!("aws (moto)     {} (install stack {DEMO_STACK})", moto.url());
    for (name, value) in &install.secrets {
        let id = format!("{}/secrets/{name}", cp.install_id());
        moto.json_call(
            "secretsmanager",
            "secretsmanager.CreateSecret",
            serde_json::json!({"Name": id, "SecretString": value}),
        )
        .await;
        println!("secret         {id} (the customer's; jobs name it, the vendor never sees it)");
    }
    options.extra = format!(
        "\n[aws]\nregion = \"us-east-1\"\nendpoint_url = \"{}\"\n\n[roles]\nstack_name = \"{DEMO_STACK}\"\nexternal_id = \"{}\"\n",
        moto.url(),
        install.external_id
    );
    // The runner's own identity (its instance role on EC2).
    options.env = vec![
        ("AWS_ACCESS_KEY_ID".into(), "demo-runner-identity".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "demo-runner-identity-secret".into()),
        ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
    ];
    let app = byoc_control_plane::app_config::load(&base.join(&install.app_config))?;
    Ok(AwsSide { moto, template, params, app })
}

type Registries = (byoc_control_plane::registry::LocalRegistry, byoc_control_plane::registry::LocalRegistry);

/// The vendor's registry with a signed image (and the component's module) and the
/// install's ECR; the job files' placeholders for them.
async fn start_registries(
    r: &RegistryDemo,
    component: Option<&ComponentDemo>,
    base: &Path,
    cp: &ControlPlane,
    options: &mut RunnerOptions,
) -> anyhow::Result<(Registries, Vec<(String, String)>)> {
    let tokens = byoc_control_plane::grants::RegistryTokens::start("vendor-registry").await;
    cp.use_registry_tokens(tokens.clone());
    let vendor = byoc_control_plane::registry::LocalRegistry::start_token(&tokens).await;
    let ecr = byoc_control_plane::registry::LocalRegistry::start(None).await;
    let image =
        vendor.push_random_image(&r.image_repository, Some(&r.image_tag), r.layers, r.layer_bytes, 42).await;
    vendor
        .push_referrer(
            &r.image_repository,
            &image,
            byoc_control_plane::registry::COSIGN_SIG,
            b"demo-signature",
        )
        .await;
    let ecr_host = format!("{DEMO_ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com");
    println!(
        "vendor registry {} ({}:{} {}, signed)",
        vendor.host(),
        r.image_repository,
        r.image_tag,
        image.digest
    );
    println!("install ECR     {ecr_host} -> {}", ecr.url());
    println!("grant tokens    {} (one-time grants, minted with each sync)", tokens.realm());
    let realm = tokens.addr.to_string();
    options.extra.push_str(&format!(
        "\n[oci]\nregistry_endpoints = {{ \"{ecr_host}\" = \"{}\", \"{}\" = \"{}\", \"{realm}\" = \"http://{realm}\" }}\n",
        ecr.url(),
        vendor.host(),
        vendor.url()
    ));
    let mut placeholders: Vec<(String, String)> =
        vec![("${VENDOR_REGISTRY}".into(), vendor.host()), ("${IMAGE_DIGEST}".into(), image.digest.clone())];
    placeholders.push(("${INSTALL_REGISTRY}".into(), ecr_host.clone()));
    if let Some(c) = component {
        let files = module_files(&base.join(&c.module_dir))?;
        let refs: Vec<(&str, &str)> = files.iter().map(|(p, t)| (p.as_str(), t.as_str())).collect();
        let module = vendor
            .push_tar_artifact(&c.repository, Some(&c.tag), "application/vnd.opentofu.modulepkg", &refs)
            .await;
        println!("component       {}:{} {} ({} files)", c.repository, c.tag, module.digest, files.len());
        placeholders.push(("${MODULE_DIGEST}".into(), module.digest.clone()));
    }
    Ok(((vendor, ecr), placeholders))
}

/// The terraform the runner uses (the real one, or the tests' stand-in for modules
/// whose plans only a provider could make), copied out of the source tree: inside the
/// sandbox the job's directory is /work.
fn terraform_tools(
    t: &TerraformDemo,
    base: &Path,
    tools: &Path,
    policies: &Path,
    cli_config: Option<&Path>,
    options: &mut RunnerOptions,
) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(tools, std::fs::Permissions::from_mode(0o755))?;
    let stand_in = tools.join("terraform-stand-in");
    std::fs::copy(base.join(&t.binary), &stand_in)
        .with_context(|| format!("copying {}", t.binary.display()))?;
    // What the stand-in writes its plan files with, beside it.
    let fake_plan = base.join(&t.binary).with_file_name("fake-plan");
    std::fs::copy(&fake_plan, tools.join("fake-plan"))
        .with_context(|| format!("copying {}", fake_plan.display()))?;
    let bin = tools.join("terraform");
    let real = match &t.real {
        None => None,
        Some(r) => Some(which(r).with_context(|| {
            format!("the demo applies a real module with terraform ({r}), which is not on PATH")
        })?),
    };
    // One binary for the runner: the real terraform, unless the module carries the
    // stand-in's fixtures (its plan holds aws_* resources no provider can make here) or
    // the plan to show is the stand-in's (the render runs in the sealed directory).
    let script = match &real {
        Some(real) => format!(
            "#!/bin/sh\ndir=.\ncase \"${{1:-}}\" in -chdir=*) dir=\"${{1#-chdir=}}\" ;; esac\nif [ -f \"$dir/fake-plan.json\" ] || [ -f \"$dir/fake-destroy-plan.json\" ]; then exec {} \"$@\"; fi\nfor last; do :; done\nif grep -qsa fake-plan.json \"$last\"; then exec {} \"$@\"; fi\nexec {} \"$@\"\n",
            stand_in.display(),
            stand_in.display(),
            real.display()
        ),
        None => format!("#!/bin/sh\nexec {} \"$@\"\n", stand_in.display()),
    };
    std::fs::write(&bin, script)?;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))?;
    let cli_config =
        cli_config.map(|c| format!("cli_config_file = \"{}\"\n", c.display())).unwrap_or_default();
    options.extra.push_str(&format!(
        "\n[terraform]\nbinary = \"{}\"\n{cli_config}\n[policy]\ndir = \"{}\"\n",
        bin.display(),
        policies.display()
    ));
    options.sandbox_ro_paths.push(tools.to_path_buf());
    match &real {
        Some(real) => {
            let version = std::process::Command::new(real).arg("version").output().ok();
            let version = version
                .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").to_string())
                .unwrap_or_default();
            println!(
                "terraform       {} ({version}); the tests' stand-in {} for the plans no moto can make",
                real.display(),
                t.binary.display()
            );
        }
        None => println!(
            "terraform       {} (the tests' stand-in: no terraform can be downloaded here)",
            t.binary.display()
        ),
    }
    Ok(())
}

/// Send the plan's jobs in order, switching the install stack, replaying, cancelling,
/// approving or denying where the plan says; the ids and the names to show.
async fn send_jobs(
    plan: &Plan,
    base: &Path,
    cp: &ControlPlane,
    runner: &RunnerProcess,
    mut aws: Option<&mut AwsSide>,
    placeholders: &[(String, String)],
    wait: Duration,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let mut ids: Vec<String> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for (i, job) in plan.job.iter().enumerate() {
        let mut name = job.file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        if job.after_earlier {
            for id in &ids {
                cp.wait_for(id, wait, |v| outcome(v).is_some())
                    .await
                    .context("an earlier job never settled")?;
            }
        }
        if !job.stack.is_empty() {
            let Some(AwsSide { moto, template, params, .. }) = aws.as_deref_mut() else {
                bail!("job {i}: `stack` needs an [install] section");
            };
            // Every earlier job must have been decided under the old switches.
            for id in &ids {
                cp.wait_for(id, wait, |v| outcome(v).is_some())
                    .await
                    .context("an earlier job never settled")?;
            }
            params.extend(job.stack.clone());
            let list: Vec<(&str, &str)> = params.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            moto.put_stack("UpdateStack", DEMO_STACK, template, &list).await;
            let change: Vec<String> = job.stack.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("customer updated the install stack: {}", change.join(", "));
            name = format!("{name} (stack updated)");
        }
        let id = if let Some(orig) = job.replay_of {
            let orig_id =
                ids.get(orig).with_context(|| format!("job {i}: replay_of {orig} is not an earlier job"))?;
            cp.wait_for(orig_id, wait, |v| v.result.is_some())
                .await
                .context("original job never finished")?;
            cp.redeliver(orig_id).map_err(|e| anyhow::anyhow!("{e}"))?;
            names.push(format!("{name} (replay)"));
            orig_id.clone()
        } else {
            let mut req = job_request(job, i, base, placeholders, aws.as_deref())?;
            if let Some(orig) = job.grant_of {
                let orig_id = ids
                    .get(orig)
                    .with_context(|| format!("job {i}: grant_of {orig} is not an earlier job"))?;
                let grant = cp
                    .registry_tokens()
                    .and_then(|t| t.grant_of_job(orig_id))
                    .with_context(|| format!("job {i}: job {orig} was given no grant"))?;
                req.spec.as_object_mut().map(|o| o.remove("source_grant"));
                req.spec["source_credential"] =
                    serde_json::json!({"username": byoc_control_plane::grants::GRANT_USER, "token": grant});
                name = format!("{name} (spent grant)");
            }
            names.push(if job.tamper.unknown_key { format!("{name} (forged)") } else { name });
            cp.enqueue(req).map_err(|e| anyhow::anyhow!("{e}"))?
        };
        if job.cancel {
            cp.wait_for(&id, wait, |v| v.state == JobState::Claimed)
                .await
                .context("job to cancel was never claimed")?;
            cp.cancel(&id).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        answer_approval(job, i, &id, cp, runner, wait).await?;
        ids.push(id);
    }
    Ok((ids, names))
}

/// A planned job's request: its file with the placeholders filled in (`${FILE:path}`: a
/// file's content as a JSON string), tampered with or given a role as planned.
fn job_request(
    job: &PlannedJob,
    i: usize,
    base: &Path,
    placeholders: &[(String, String)],
    aws: Option<&AwsSide>,
) -> anyhow::Result<EnqueueRequest> {
    let path = base.join(&job.file);
    let mut text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    for (k, v) in placeholders {
        text = text.replace(k, v);
    }
    // "${FILE:path}": that file's content as a JSON string (paths relative to the plan).
    while let Some(start) = text.find("\"${FILE:") {
        let Some(len) = text[start..].find("}\"") else { break };
        let rel = &text[start + 8..start + len];
        let content = std::fs::read_to_string(base.join(rel)).with_context(|| format!("reading {rel}"))?;
        text.replace_range(start..start + len + 2, &serde_json::to_string(&content)?);
    }
    let jf: JobFile = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut req = EnqueueRequest::new(&jf.kind, jf.spec);
    req.timeout_secs = jf.timeout_secs;
    req.tamper = job.tamper.clone();
    if let Some(role) = &job.role {
        let Some(AwsSide { app, .. }) = aws else {
            bail!("job {i}: `role` needs an [install] section");
        };
        req.entity = role.entity.clone();
        req.operation = role.operation.clone();
        req.requested_role = Some(role.requested.clone());
        req.app_config = Some(app.clone());
        req.role_request = Some(byoc_protocol::RoleRequest {
            entity_name: role.entity_name.clone(),
            runtime_override: role.runtime_override.clone(),
            break_glass_role: role.break_glass_role.clone(),
            entity_role: role.entity_role.clone(),
        });
    }
    Ok(req)
}

/// The customer's answer to a job held for approval, given with the CLI as planned.
async fn answer_approval(
    job: &PlannedJob,
    i: usize,
    id: &str,
    cp: &ControlPlane,
    runner: &RunnerProcess,
    wait: Duration,
) -> anyhow::Result<()> {
    let answer = match (&job.approve, &job.deny) {
        (Some(reason), None) => Some(("approve", reason)),
        (None, Some(reason)) => Some(("deny", reason)),
        (None, None) => None,
        (Some(_), Some(_)) => bail!("job {i}: approve and deny both given"),
    };
    if let Some((verb, reason)) = answer {
        let held = cp
            .wait_for(id, wait, |v| v.waiting.as_ref().is_some_and(|w| w.state == "awaiting_approval"))
            .await
            .context("the job never awaited approval")?;
        let detail = held.waiting.map(|w| w.detail).unwrap_or_default();
        println!(
            "job {id} awaits approval ({detail}); the customer runs: byoc-runner {verb} {id} --reason {reason:?}"
        );
        let out = runner.cli(&[verb, id, "--reason", reason]);
        if !out.status.success() {
            bail!("byoc-runner {verb} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    Ok(())
}

/// The customer's `status`, then `audit verify`: offline, from the files alone. Whether
/// the audit log verifies.
fn status_and_verify(runner_bin: &Path, state_dir: &Path) -> anyhow::Result<bool> {
    let status =
        std::process::Command::new(runner_bin).args(["status", "--state-dir"]).arg(state_dir).output()?;
    println!(
        "\n$ byoc-runner status --state-dir {}\n{}",
        state_dir.display(),
        String::from_utf8_lossy(&status.stdout)
    );
    let verify = std::process::Command::new(runner_bin)
        .args(["audit", "verify", "--state-dir"])
        .arg(state_dir)
        .output()?;
    println!(
        "$ byoc-runner audit verify --state-dir {}\n{}{}",
        state_dir.display(),
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    Ok(verify.status.success())
}

/// Wait for each job's end and print it against what the plan expects; how many did
/// not end as expected.
async fn report(plan: &Plan, cp: &ControlPlane, ids: &[String], names: &[String], wait: Duration) -> usize {
    println!(
        "{:<20} {:<32} {:<14} {:<28} {:<28} {:>9} {:>9}",
        "JOB", "EXAMPLE", "KIND", "EXPECTED", "GOT", "DURATION", "PICKUP"
    );
    let mut failures = 0;
    for (i, job) in plan.job.iter().enumerate() {
        let id = &ids[i];
        let is_replay = job.replay_of.is_some();
        let view = cp
            .wait_for(id, wait, |v| {
                if is_replay {
                    v.rejections.iter().any(|(r, _)| r.code() == "already_finished")
                } else {
                    outcome(v).is_some()
                }
            })
            .await;
        let got = match (&view, is_replay) {
            (Some(v), true) => {
                v.rejections.last().map(|(r, _)| format!("rejected:{}", r.code())).unwrap_or_default()
            }
            (Some(v), false) => outcome(v).unwrap_or_default(),
            (None, _) => "no outcome (timed out)".into(),
        };
        // "failed:<reason>" when the plan names why the job must fail.
        let got = match &view {
            Some(v) if got == "failed" && job.expect.starts_with("failed:") => format!(
                "failed:{}",
                v.result.as_ref().and_then(|r| r.outputs["reason"].as_str()).unwrap_or("?")
            ),
            _ => got,
        };
        let ok = got == job.expect;
        failures += usize::from(!ok);
        let ms = |o: Option<u64>| o.map(|m| format!("{m} ms")).unwrap_or_else(|| "-".into());
        let (dur, pickup, kind) = match &view {
            Some(v) if !is_replay => (ms(v.duration_ms), ms(v.pickup_ms), v.kind.clone()),
            Some(v) => ("-".into(), "-".into(), v.kind.clone()),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:<20} {:<32} {:<14} {:<28} {:<28} {:>9} {:>9} {}",
            id,
            names[i],
            kind,
            job.expect,
            got,
            dur,
            pickup,
            if ok { "ok" } else { "UNEXPECTED" }
        );
    }
    failures
}

/// What the customer sees on the VM: the roles, a role job's masked log, what each
/// terraform job and artifact sync did.
fn customer_view(
    plan: &Plan,
    cp: &ControlPlane,
    runner_bin: &Path,
    runner: &RunnerProcess,
    ids: &[String],
    with_roles: bool,
) -> anyhow::Result<()> {
    if with_roles {
        // The customer's view of the roles: switches, ARNs, last use.
        let roles = std::process::Command::new(runner_bin)
            .args(["roles", "--state-dir"])
            .arg(&runner.state_dir)
            .output()?;
        println!(
            "\n$ byoc-runner roles --state-dir {}\n{}",
            runner.state_dir.display(),
            String::from_utf8_lossy(&roles.stdout)
        );
        // What a job with a role saw: its credentials, masked before they were logged.
        if let Some(i) = plan.job.iter().position(|j| j.role.is_some() && j.expect == "succeeded") {
            let logs = std::process::Command::new(runner_bin)
                .args(["jobs", "logs", &ids[i], "--state-dir"])
                .arg(&runner.state_dir)
                .output()?;
            println!(
                "$ byoc-runner jobs logs {} --state-dir {}\n{}",
                ids[i],
                runner.state_dir.display(),
                String::from_utf8_lossy(&logs.stdout)
            );
        }
    }
    // What each artifact sync moved (the second moves nothing) and what policy decided.
    for (i, job) in plan.job.iter().enumerate() {
        let Some(v) = cp.job(&ids[i]) else { continue };
        if v.kind == "terraform"
            && let Some(r) = &v.result
        {
            let o = &r.outputs;
            let counts = &o["summary"]["counts"];
            let changes = if counts.as_object().is_some_and(|c| c.is_empty()) {
                "no changes".to_string()
            } else {
                format!("changes {counts}")
            };
            let state = o["state_serial"].as_u64().map(|n| format!(", state serial {n}")).unwrap_or_default();
            // What the control plane learns of a customer secret: name, version, digest.
            let secrets: String = o["secrets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| {
                    format!(
                        "; secret {} version {} {} -> {}",
                        s["name"].as_str().unwrap_or("-"),
                        s["version_id"].as_str().unwrap_or("-"),
                        s["digest"].as_str().unwrap_or("-"),
                        s["written_to"]
                    )
                })
                .collect();
            println!(
                "{} terraform {}: policy {} on plan {} ({changes}{state}){secrets}{}",
                ids[i],
                r.status.as_str(),
                o["verdict"].as_str().unwrap_or("-"),
                o["plan_digest"].as_str().unwrap_or("-"),
                r.error.as_deref().map(|e| format!("; {e}")).unwrap_or_default()
            );
            continue;
        }
        if v.kind != "oci.sync" {
            continue;
        }
        if let Some(r) = &v.result {
            let o = &r.outputs;
            if let Some(e) = &r.error {
                println!("{} oci.sync {}: {}: {e}", ids[i], job.expect, o["source"].as_str().unwrap_or("-"));
                continue;
            }
            println!(
                "{} oci.sync {}: {} -> {}, {} bytes moved, {} bytes skipped, {} referrers{}",
                ids[i],
                job.expect,
                o["source"].as_str().unwrap_or("-"),
                o["destination"].as_str().unwrap_or("-"),
                o["bytes_moved"],
                o["bytes_skipped"],
                o["referrers"],
                r.error.as_deref().map(|e| format!(" ({e})")).unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// A name on PATH (or a path) as an absolute path.
fn which(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(name);
    if p.is_absolute() {
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).map(|d| d.join(name)).find(|f| f.is_file()))
}

/// A module directory's files (path relative to it → content), directories first.
fn module_files(dir: &std::path::Path) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = vec![("./".to_string(), String::new())];
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        if e.file_type()?.is_file() {
            let name = e.file_name().to_string_lossy().into_owned();
            out.push((name, std::fs::read_to_string(e.path())?));
        }
    }
    Ok(out)
}

// ---- the runner's own update ---------------------------------------------------------

/// A runner installed from its signed package into a throwaway root, as the install
/// stack's user-data installs it on a VM.
struct Installed {
    root: PathBuf,
    /// `<version>/`: the package, SHA256SUMS and its signature, for each release.
    releases: PathBuf,
    /// The demo's `systemctl` (this program with `--service-ctl`) and its socket.
    systemctl: PathBuf,
    socket: PathBuf,
    from_version: String,
    to_version: String,
}

impl Installed {
    fn binary(&self) -> PathBuf {
        self.root.join("usr/bin/byoc-runner")
    }

    fn updater(&self) -> PathBuf {
        self.root.join(byoc_updater::UPDATER_BINARY.trim_start_matches('/'))
    }
}

fn run_tool(cmd: &mut std::process::Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Package the runner twice (the installed version and the vendor's next release),
/// sign both with a release key made here, install the first into `<dir>/root` with
/// dpkg and keep it for rollback, and pin the key in the runner's `[update]`.
fn install_from_package(
    u: &RunnerUpdateDemo,
    base: &Path,
    built: &Path,
    dir: &Path,
    options: &mut RunnerOptions,
) -> anyhow::Result<Installed> {
    let packager = base.join(&u.packager);
    let (releases, keys, root) = (dir.join("releases"), dir.join("release-keys"), dir.join("root"));
    for d in [&releases, &keys, &root] {
        if d.exists() {
            std::fs::remove_dir_all(d)?;
        }
        std::fs::create_dir_all(d)?;
    }
    let (public, secret) = (keys.join("release.pub"), keys.join("release.key"));
    run_tool(
        std::process::Command::new("minisign").args(["-G", "-W", "-p"]).arg(&public).arg("-s").arg(&secret),
    )
    .context("making the demo's release key (minisign; scripts/setup installs it)")?;
    // Debug info stripped: the demo's build is unoptimised and large.
    let stripped = keys.join("byoc-runner");
    run_tool(std::process::Command::new("objcopy").arg("--strip-debug").arg(built).arg(&stripped))?;
    // The updater, its own binary, built beside the runner (scripts/demo builds it).
    let updater = keys.join("byoc-runner-updater");
    let built_updater = built.with_file_name("byoc-runner-updater");
    run_tool(std::process::Command::new("objcopy").arg("--strip-debug").arg(&built_updater).arg(&updater))
        .with_context(|| format!("{} (cargo build -p byoc-runner-updater)", built_updater.display()))?;
    for version in [&u.from_version, &u.to_version] {
        let out = releases.join(version);
        run_tool(
            std::process::Command::new(&packager)
                .arg(&stripped)
                .arg(&out)
                .arg(version)
                .env("BYOC_DEB_COMPRESSION", "none")
                .env("UPDATER", &updater),
        )?;
        run_tool(
            std::process::Command::new("minisign")
                .arg("-S")
                .arg("-s")
                .arg(&secret)
                .arg("-m")
                .arg(out.join("SHA256SUMS")),
        )?;
    }
    std::fs::remove_file(&stripped)?;
    std::fs::remove_file(&updater)?;

    // An empty dpkg database and user files in the root; the package's scripts honour
    // DPKG_ROOT (its user and group are made in the root's files, nothing on the host).
    for d in ["var/lib/dpkg/info", "var/lib/dpkg/updates", "etc"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "")?;
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")?;
    std::fs::write(root.join("etc/group"), "root:x:0:\n")?;
    std::fs::write(root.join("etc/shadow"), "root:*::0:99999:7:::\n")?;
    std::fs::write(root.join("etc/gshadow"), "root:*::\n")?;
    let first = releases.join(&u.from_version);
    let deb = std::fs::read_dir(&first)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("the packager made no .deb")?;
    run_tool(
        std::process::Command::new("dpkg")
            .arg(format!("--root={}", root.display()))
            .args(["--force-script-chrootless", "--force-not-root", "--force-depends", "-i"])
            .arg(&deb),
    )?;
    // The updater goes back only to a release it keeps: the installed one is the first.
    let kept = root.join("var/lib/byoc-runner-update/releases").join(&u.from_version);
    std::fs::create_dir_all(&kept)?;
    for d in
        [kept.as_path(), kept.parent().unwrap_or(&kept), root.join("var/lib/byoc-runner-update").as_path()]
    {
        std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    }
    for entry in std::fs::read_dir(&first)? {
        let path = entry?.path();
        std::fs::copy(&path, kept.join(path.file_name().unwrap_or_default()))?;
    }

    let socket = dir.join("systemctl.sock");
    let systemctl = dir.join("systemctl");
    let me = std::env::current_exe()?;
    std::fs::write(
        &systemctl,
        format!("#!/bin/sh\nexec '{}' --service-ctl '{}' \"$@\"\n", me.display(), socket.display()),
    )?;
    std::fs::set_permissions(&systemctl, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let key_line =
        std::fs::read_to_string(&public)?.lines().nth(1).context("minisign wrote no key line")?.to_string();
    options.extra.push_str(&format!("\n[update]\nmode = \"approve\"\nrelease_public_key = \"{key_line}\"\n"));
    println!(
        "runner package  byoc-runner {} installed from its signed .deb into {} (next release: {})",
        u.from_version,
        root.display(),
        u.to_version
    );
    Ok(Installed {
        root,
        releases,
        systemctl,
        socket,
        from_version: u.from_version.clone(),
        to_version: u.to_version.clone(),
    })
}

/// `byoc-demo --service-ctl SOCKET stop|start byoc-runner.service`: the updater's
/// systemctl in the demo.
fn service_ctl(socket: &Path, args: &[String]) -> anyhow::Result<()> {
    use std::io::{BufRead as _, Write as _};
    let mut stream = std::os::unix::net::UnixStream::connect(socket)
        .with_context(|| format!("the demo is not listening at {}", socket.display()))?;
    writeln!(stream, "{}", args.join(" "))?;
    let mut line = String::new();
    std::io::BufReader::new(stream).read_line(&mut line)?;
    match line.trim_end() {
        "ok" => Ok(()),
        other => bail!("{}", other.strip_prefix("error: ").unwrap_or(other)),
    }
}

/// The vendor's update to the next release, approved by the customer; a job on it;
/// the customer's rollback; a job on the version before; both updates in the audit log.
async fn update_and_back(
    installed: &Installed,
    cp: &ControlPlane,
    runner: &mut RunnerProcess,
    app: &byoc_protocol::AppConfig,
    ecr: &byoc_control_plane::registry::LocalRegistry,
    wait: Duration,
) -> anyhow::Result<()> {
    let (from, to) = (&installed.from_version, &installed.to_version);
    let _ = std::fs::remove_file(&installed.socket);
    let listener = tokio::net::UnixListener::bind(&installed.socket)?;
    let install = cp.install_id();
    let ecr_host = format!("{DEMO_ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com");
    println!("\nthe runner updates itself: {from} -> {to}, then the customer rolls back");

    // The vendor publishes the release (package, SHA256SUMS, signature) to the
    // install's registry and sends it to the runner.
    let dir = installed.releases.join(to);
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        files.push((
            path.file_name().unwrap_or_default().to_string_lossy().into_owned(),
            std::fs::read(&path)?,
        ));
    }
    let refs: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
    let repository = format!("{install}/byoc-runner");
    let pushed = ecr
        .push_tar_artifact_bytes(&repository, Some(to), "application/vnd.byoc.runner.release", &refs)
        .await;
    cp.publish_release(byoc_control_plane::Release {
        version: to.clone(),
        reference: format!("{ecr_host}/{repository}@{}", pushed.digest),
        min_rollback_version: Some(from.clone()),
        downgrade: false,
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let runner_id = cp.runners().first().context("no runner enrolled")?.runner_id.clone();
    let id = cp
        .update_runner(
            &runner_id,
            byoc_control_plane::UpdateRunner {
                version: to.clone(),
                requested_role: Some(format!("{install}-maintenance")),
                app_config: Some(app.clone()),
            },
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("vendor published {to} ({}) and sent runner.update as job {id}", pushed.digest);

    // [update] mode = "approve": the update waits for someone on the customer's side.
    let held = cp
        .wait_for(&id, wait, |v| {
            outcome(v).is_some() || v.waiting.as_ref().is_some_and(|w| w.state == "awaiting_approval")
        })
        .await
        .context("the update never awaited the customer's approval")?;
    if let Some(ended) = outcome(&held) {
        bail!("the update ended {ended} before it awaited approval: {:?}", held.rejections);
    }
    println!(
        "job {id} awaits approval; the customer runs: byoc-runner approve {id} --version {to} --reason \"runner {to}\""
    );
    let out = runner.cli(&["approve", &id, "--version", to, "--reason", &format!("runner {to}")]);
    if !out.status.success() {
        bail!("byoc-runner approve: {}", String::from_utf8_lossy(&out.stderr));
    }
    let staged =
        cp.wait_for(&id, wait, |v| v.result.is_some()).await.context("the update job never ended")?;
    let result = staged.result.context("no result")?;
    if result.status.as_str() != "succeeded" {
        bail!("the update job ended {}: {:?} {}", result.status.as_str(), result.error, result.outputs);
    }
    println!("job {id} verified the release with the pinned key and staged it");
    let applying = Instant::now();
    play_systemd(installed, cp, runner, &listener, to, wait * 3).await?;
    println!(
        "the updater drained the runner, installed {to}, started it and saw it healthy ({:.1} s)",
        applying.elapsed().as_secs_f64()
    );
    job_runs_on(cp, to, wait).await?;
    print_cli(runner, &["update", "status", "--root", &installed.root.to_string_lossy()]);

    // The customer goes back to the version before.
    println!("$ byoc-runner update rollback --root {}", installed.root.display());
    let out = runner.cli(&["update", "rollback", "--root", &installed.root.to_string_lossy()]);
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        bail!("byoc-runner update rollback: {}", String::from_utf8_lossy(&out.stderr));
    }
    let applying = Instant::now();
    play_systemd(installed, cp, runner, &listener, from, wait * 3).await?;
    println!("the runner is back on {from} ({:.1} s)", applying.elapsed().as_secs_f64());
    job_runs_on(cp, from, wait).await?;

    let export = run_tool(
        std::process::Command::new(installed.binary())
            .args(["audit", "export", "--state-dir"])
            .arg(&runner.state_dir),
    )?;
    let count = |event: &str| export.matches(&format!("\"{event}\"")).count();
    let (started, applied) = (count("update_started"), count("update_applied"));
    println!("audit log: update_started {started}, update_applied {applied}");
    if applied != 2 {
        bail!("the audit log holds {applied} update_applied records, not 2 (the update and the rollback)");
    }
    Ok(())
}

/// A job on the version the runner now runs: it must succeed.
async fn job_runs_on(cp: &ControlPlane, version: &str, wait: Duration) -> anyhow::Result<()> {
    let message = serde_json::json!({ "message": format!("hello from {version}") });
    let job = cp.enqueue(EnqueueRequest::new("runner.noop", message)).map_err(|e| anyhow::anyhow!("{e}"))?;
    expect_succeeded(cp, &job, wait).await?;
    println!("job {job} succeeded on {version}");
    Ok(())
}

async fn expect_succeeded(cp: &ControlPlane, id: &str, wait: Duration) -> anyhow::Result<()> {
    let v = cp
        .wait_for(id, wait, |v| v.result.is_some())
        .await
        .with_context(|| format!("job {id} never ended"))?;
    match v.result {
        Some(r) if r.status.as_str() == "succeeded" => Ok(()),
        other => bail!("job {id} did not succeed: {other:?}"),
    }
}

fn print_cli(runner: &RunnerProcess, args: &[&str]) {
    let out = runner.cli(args);
    println!("$ byoc-runner {}\n{}", args.join(" "), String::from_utf8_lossy(&out.stdout));
}

/// Play systemd until the control plane hears `version` from the runner with no update
/// pending: the updater's path unit (start the updater when the staged request changes,
/// or root's rollback request or the updater's progress is there) and the runner's
/// service (the updater stops and starts it through the demo's systemctl).
async fn play_systemd(
    installed: &Installed,
    cp: &ControlPlane,
    runner: &mut RunnerProcess,
    listener: &tokio::net::UnixListener,
    version: &str,
    wait: Duration,
) -> anyhow::Result<()> {
    let request = runner.state_dir.join("update/request.json");
    let updater_dir = byoc_updater::updater_dir(&installed.root);
    let asked_by_root =
        || byoc_updater::rollback_path(&updater_dir).exists() || updater_dir.join("progress.json").exists();
    let updater_log = runner.dir.join("updater.log");
    let deadline = tokio::time::Instant::now() + wait;
    let mut updater: Option<tokio::process::Child> = None;
    // PathChanged: the request's bytes as the updater was last started for them.
    let mut seen: Option<Vec<u8>> = None;
    loop {
        let staged = std::fs::read(&request).ok();
        let changed = staged.is_some() && staged != seen;
        if updater.is_none() && (changed || asked_by_root()) {
            seen = staged;
            let log = std::fs::OpenOptions::new().create(true).append(true).open(&updater_log)?;
            // The updater is the installed one, run as root, as the updater's unit runs it.
            let child = tokio::process::Command::new(installed.updater())
                .arg("--config")
                .arg(&runner.config_path)
                .arg("--root")
                .arg(&installed.root)
                .arg("--systemctl")
                .arg(&installed.systemctl)
                .envs(runner.env().iter().cloned())
                .stdin(std::process::Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .kill_on_drop(true)
                .spawn()?;
            updater = Some(child);
        }
        let heard =
            cp.runners().iter().any(|r| r.version.as_deref() == Some(version) && r.pending_update.is_none());
        if updater.is_none() && !request.exists() && heard {
            return Ok(());
        }
        tokio::select! {
            conn = listener.accept() => serve_systemctl(conn?.0, runner).await,
            status = async { updater.as_mut().expect("guarded").wait().await }, if updater.is_some() => {
                updater = None;
                let status = status?;
                let log = std::fs::read_to_string(&updater_log).unwrap_or_default();
                if !status.success() {
                    bail!("the updater failed ({status}):\n{log}");
                }
                if let Some(last) = log.lines().last() {
                    println!("updater: {last}");
                }
            }
            // The path unit notices a staged request within this tick.
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = tokio::time::sleep_until(deadline) => {
                bail!("the runner did not come up on {version} within {wait:?}; updater log:\n{}\nrunner log:\n{}",
                    std::fs::read_to_string(&updater_log).unwrap_or_default(), runner.log());
            }
        }
    }
}

/// One request from the demo's systemctl: `stop` drains the runner (SIGTERM, as the
/// unit's KillMode=mixed does), `start` starts it on the same config and state.
async fn serve_systemctl(conn: tokio::net::UnixStream, runner: &mut RunnerProcess) {
    use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
    let (read, mut write) = conn.into_split();
    let mut line = String::new();
    if tokio::io::BufReader::new(read).read_line(&mut line).await.is_err() {
        return;
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let reply = match words.as_slice() {
        ["stop", "byoc-runner.service"] if runner.pid().is_none() => "ok".to_string(),
        ["stop", "byoc-runner.service"] => {
            runner.signal(nix::sys::signal::Signal::SIGTERM);
            match runner.wait_exit(Duration::from_secs(300)).await {
                Some(_) => "ok".into(),
                None => "error: byoc-runner.service did not stop within 300 s".into(),
            }
        }
        ["start", "byoc-runner.service"] => match runner.spawn(None) {
            Ok(()) => "ok".into(),
            Err(e) => format!("error: starting byoc-runner.service: {e}"),
        },
        other => format!("error: the demo's systemctl does not {other:?}"),
    };
    let _ = write.write_all(format!("{reply}\n").as_bytes()).await;
}
