//! Command line: the daemon entry point and the customer's inspection commands.
//! anyhow lives only here, at the edge.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::{Config, DEFAULT_CONFIG_PATH, DEFAULT_STATE_DIR};
use crate::inspect;

/// sysexits.h: the command was used incorrectly (bad arguments or configuration).
pub const EX_USAGE: i32 = 64;
/// sysexits.h: the input data was incorrect.
pub const EX_DATAERR: i32 = 65;

#[derive(Parser)]
#[command(
    name = "byoc-runner",
    version,
    about = "Runs the vendor's signed jobs in this cloud account, and shows what it did"
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum, PartialEq, Eq)]
pub enum Output {
    #[default]
    Text,
    Json,
}

#[derive(clap::Args, Clone)]
struct StateArgs {
    /// Configuration file (for the state dir location).
    #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// State directory; overrides the config file.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon (systemd's ExecStart).
    Run {
        #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
    /// Show enrollment, daemon and job summary from the state dir.
    Status(StateArgs),
    /// Inspect jobs recorded in the local journal.
    Jobs {
        #[command(subcommand)]
        cmd: JobsCmd,
    },
    /// Run a job file locally with no control plane (for vendors testing actions).
    RunLocal {
        /// JSON job file: {"kind": "...", "spec": {...}, "timeout_secs": N}
        job_file: PathBuf,
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
        /// Run without the sandbox (the job gets your user's privileges).
        #[arg(long)]
        no_sandbox: bool,
    },
    /// Internal: build a job sandbox from the spec on stdin and exec the job.
    #[command(hide = true)]
    SandboxExec,
    /// Internal: evaluate the policy request on stdin under an address-space limit and
    /// print the decision.
    #[command(hide = true)]
    PolicyEval {
        #[arg(long)]
        memory_mib: u64,
    },
    /// Internal: report, from inside a sandbox, what a job can see and do (JSON).
    #[command(hide = true)]
    SandboxProbe {
        #[arg(long)]
        runner_pid: i32,
        #[arg(long)]
        state_dir: PathBuf,
        #[arg(long, default_value = "/etc/byoc-runner")]
        config_dir: PathBuf,
        /// Another `host:port` the job must not reach (repeatable), besides IMDS
        /// (IPv4 and IPv6) and the ECS/EKS credential addresses, always tried.
        #[arg(long = "unreachable", value_name = "HOST:PORT")]
        unreachable: Vec<String>,
    },
    /// Inspect and verify the signed audit log (offline).
    Audit {
        #[command(subcommand)]
        cmd: AuditCmd,
    },
    /// Pause the runner: it refuses new jobs (reason `paused`) until `resume`; running
    /// jobs finish. Survives restarts. Needs root or roles.admin_group.
    Pause {
        #[command(flatten)]
        state: StateArgs,
        /// Why (shown to the vendor in heartbeats and kept in the audit log).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Undo `pause`.
    Resume(StateArgs),
    /// List the lifecycle roles: enabled or not, ARN, where the switch came from, last
    /// assumed.
    Roles {
        #[command(flatten)]
        state: StateArgs,
        /// Read the switches now (install stack or switches file) instead of showing the
        /// daemon's last reading.
        #[arg(long)]
        refresh: bool,
    },
    /// Copy an OCI artifact (image, index, chart, module, and its referrers) between
    /// two registries with the engine `oci.sync` jobs use. Loopback registries are
    /// plain HTTP; others HTTPS. Secrets come from the environment or files, never argv.
    Sync(SyncArgs),
    /// The policies that decide plans and manifests: list them, or test an input.
    Policy {
        #[command(subcommand)]
        cmd: PolicyCmd,
    },
    /// Configuration commands.
    Config {
        #[command(subcommand)]
        cmd: ConfigCmd,
    },
}

#[derive(Subcommand)]
enum PolicyCmd {
    /// The built-in rules (at the customer's levels), the customer's own policies and
    /// the parameters.
    List {
        /// The customer's policy directory (`*.rego`, `policies.toml`).
        #[arg(long, default_value = crate::policy::DEFAULT_POLICY_DIR)]
        policies: PathBuf,
        /// An app config directory: list its `policies.toml` declarations too.
        #[arg(long)]
        app: Option<PathBuf>,
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Evaluate every policy over an input and print the violations and the verdict.
    /// Exit 0 if allowed, 1 if denied, 64 on unusable input.
    Test {
        /// A terraform plan (`terraform show -json PLAN`), or manifests: rendered YAML
        /// (`helm template`, several documents) or JSON (an object, an array, a List).
        #[arg(long)]
        input: PathBuf,
        /// terraform, sandbox, helm or kubernetes (default: terraform if the input has
        /// `format_version`, else kubernetes).
        #[arg(long)]
        source: Option<String>,
        /// Lifecycle phase the decision is for.
        #[arg(long, default_value = "maintenance")]
        phase: String,
        /// The job's operation (`component.deploy`, `sandbox.provision`, …), or the
        /// admission operation manifests are reviewed under: CREATE (install), UPDATE
        /// (upgrade, apply; the default) or DELETE (uninstall, teardown, prune).
        #[arg(long, default_value = "component.deploy")]
        operation: String,
        #[arg(long, default_value = crate::policy::DEFAULT_POLICY_DIR)]
        policies: PathBuf,
        /// A vendor policy file to include (repeatable), as the app config would bring it.
        #[arg(long = "vendor-policy")]
        vendor_policies: Vec<PathBuf>,
        /// An app config directory: its `policies.toml` declarations that apply to this
        /// source (and --component) are included.
        #[arg(long)]
        app: Option<PathBuf>,
        /// The component the decision is for (selects the app's declarations).
        #[arg(long, default_value = "")]
        component: String,
        /// Per-policy time limit, milliseconds.
        #[arg(long, default_value_t = 5000)]
        time_limit_ms: u64,
        /// Memory limit of the evaluator process, MiB.
        #[arg(long, default_value_t = 2048)]
        memory_mib: u64,
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
}

#[derive(clap::Args)]
struct SyncArgs {
    /// host/repository[:tag][@sha256:…]; with a digest, other content is refused.
    source: String,
    /// host/repository[:tag]; tagged with the source's tag when it names none.
    destination: String,
    /// Source username (password or token from BYOC_SYNC_SRC_TOKEN or --src-token-file;
    /// without a username the token is sent as a bearer token).
    #[arg(long)]
    src_user: Option<String>,
    #[arg(long)]
    src_token_file: Option<PathBuf>,
    #[arg(long)]
    dest_user: Option<String>,
    /// Destination password or token (or BYOC_SYNC_DEST_TOKEN).
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
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Subcommand)]
enum JobsCmd {
    /// List jobs, newest first.
    List {
        #[command(flatten)]
        state: StateArgs,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Show one job's journal record.
    Show {
        #[command(flatten)]
        state: StateArgs,
        job_id: String,
    },
    /// Print a job's log from the local spool.
    Logs {
        #[command(flatten)]
        state: StateArgs,
        job_id: String,
    },
    /// List refused deliveries with their reason codes, newest first.
    Rejections {
        #[command(flatten)]
        state: StateArgs,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
}

#[derive(clap::Args, Clone)]
struct AuditArgs {
    #[command(flatten)]
    state: StateArgs,
    /// The audit directory (default: <state dir>/audit); works on a copy elsewhere too.
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum AuditCmd {
    /// Check every record, the tree, every checkpoint and cosignature; exit 1 naming the
    /// first problem.
    Verify {
        #[command(flatten)]
        a: AuditArgs,
        /// Keys to trust: lines `runner <base64>` and `control-plane <base64>` (default:
        /// the keys stored beside the log).
        #[arg(long)]
        trust: Option<PathBuf>,
    },
    /// Print the last records (follow with -f).
    Tail {
        #[command(flatten)]
        a: AuditArgs,
        #[arg(short = 'n', long, default_value_t = 20)]
        lines: usize,
        #[arg(short = 'f', long)]
        follow: bool,
    },
    /// Print one record.
    Show {
        #[command(flatten)]
        a: AuditArgs,
        seq: u64,
    },
    /// Every record and checkpoint as JSON lines (for a SIEM).
    Export {
        #[command(flatten)]
        a: AuditArgs,
    },
    /// An inclusion proof for a record that a third party can check.
    Prove {
        #[command(flatten)]
        a: AuditArgs,
        seq: u64,
    },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Check this host can run the runner: the config, the state dir's disk, DNS, TCP and
    /// TLS to the control plane (through the proxy if set), clock skew, the instance
    /// metadata service, the install stack and its role ARNs, journald and the sandbox.
    /// Each line is ok/warn/FAIL/skip with what to do; exit 1 if any check fails.
    Check {
        #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Validate the configuration and print every problem (no network).
    Validate {
        #[arg(long, env = "BYOC_RUNNER_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
}

pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EX_USAGE } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    match cli.cmd {
        // First and without a runtime: the helper must stay single-threaded.
        Cmd::SandboxExec => byoc_sandbox::helper::sandbox_exec_main(),
        Cmd::PolicyEval { memory_mib } => policy_eval(memory_mib),
        Cmd::SandboxProbe { runner_pid, state_dir, config_dir, unreachable } => {
            let key = state_dir.join(crate::identity::KEY_FILE);
            let report = byoc_sandbox::probe::run(&byoc_sandbox::probe::ProbeArgs {
                runner_pid,
                state_dir: &state_dir,
                identity_key: &key,
                config_dir: &config_dir,
                unreachable: &unreachable,
            });
            match serde_json::to_string(&report) {
                Ok(s) => {
                    println!("{s}");
                    0
                }
                Err(_) => 1,
            }
        }
        Cmd::Run { config } => run_daemon(&config),
        Cmd::Status(s) => edge(|| status(&s)),
        Cmd::Jobs { cmd } => edge(|| jobs(cmd)),
        Cmd::Audit { cmd: AuditCmd::Verify { a, trust } } => audit_verify(&a, trust.as_deref()),
        Cmd::Audit { cmd } => edge(|| audit(cmd)),
        Cmd::RunLocal { job_file, output, no_sandbox } => run_local(&job_file, output, !no_sandbox),
        Cmd::Config { cmd: ConfigCmd::Validate { config, output } } => validate(&config, output),
        Cmd::Config { cmd: ConfigCmd::Check { config, output } } => config_check(&config, output),
        Cmd::Pause { state, reason } => edge(|| pause(&state, reason)),
        Cmd::Resume(state) => edge(|| resume(&state)),
        Cmd::Roles { state, refresh } => edge(|| roles(&state, refresh)),
        Cmd::Sync(args) => sync(args),
        Cmd::Policy { cmd: PolicyCmd::List { policies, app, output } } => {
            policy_list(&policies, app.as_deref(), output)
        }
        Cmd::Policy {
            cmd:
                PolicyCmd::Test {
                    input,
                    source,
                    phase,
                    operation,
                    policies,
                    vendor_policies,
                    app,
                    component,
                    time_limit_ms,
                    memory_mib,
                    output,
                },
        } => policy_test(PolicyTest {
            input,
            source,
            phase,
            operation,
            policies,
            vendor_policies,
            app,
            component,
            time_limit: std::time::Duration::from_millis(time_limit_ms),
            memory_mib,
            output,
        }),
    }
}

fn load_policies(dir: &Path) -> Result<crate::policy::CustomerPolicies, i32> {
    crate::policy::load(dir).map_err(|problems| {
        eprintln!("error: the policy directory {} has problems:", dir.display());
        for p in problems {
            eprintln!("  {p}");
        }
        EX_USAGE
    })
}

fn policy_list(dir: &Path, app_dir: Option<&Path>, output: Output) -> i32 {
    let c = match load_policies(dir) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let declared = match app_dir.map(crate::app_policies::load_dir).transpose() {
        Ok(None) => vec![],
        Ok(Some(app)) => match crate::app_policies::parse(&app) {
            Ok(d) => d,
            Err(problems) => {
                for p in &problems {
                    eprintln!("error: {p}");
                }
                return EX_USAGE;
            }
        },
        Err(e) => {
            eprintln!("error: {e}");
            return EX_USAGE;
        }
    };
    let entry = |p: &byoc_policy::Policy| {
        serde_json::json!({
            "name": p.name, "origin": p.origin, "enforcement": p.enforcement, "digest": p.digest(),
            "convention": crate::app_policies::convention_of(p),
            "description": crate::policy::description(p),
        })
    };
    let vendor_entry = |d: &crate::app_policies::Declared| {
        let p = d.policy();
        let applied = d.kind == crate::app_policies::PolicyType::KubernetesCluster;
        serde_json::json!({
            "name": p.name, "origin": "vendor", "type": d.kind.as_str(), "components": d.components_str(),
            "engine": if d.engine == crate::app_policies::Engine::Opa { "opa" } else { "kyverno" },
            "convention": if applied { "kyverno".to_string() } else { crate::app_policies::convention_of(&p) },
            "enforcement": if applied { "applied to the cluster" } else { "mandatory" }, "digest": p.digest(),
        })
    };
    match output {
        Output::Json => {
            let v = serde_json::json!({
                "dir": c.dir, "builtin": c.builtin.iter().map(entry).collect::<Vec<_>>(), "builtin_off": c.off,
                "customer": c.own.iter().map(entry).collect::<Vec<_>>(), "params": c.params,
                "vendor": declared.iter().map(vendor_entry).collect::<Vec<_>>(),
            });
            println!("{v}");
        }
        Output::Text => {
            if !declared.is_empty() {
                println!(
                    "{:<40} {:<8} {:<20} {:<20} {:<12} LEVEL",
                    "VENDOR POLICY", "ORIGIN", "TYPE", "COMPONENTS", "CONVENTION"
                );
                for d in &declared {
                    let e = vendor_entry(d);
                    println!(
                        "{:<40} {:<8} {:<20} {:<20} {:<12} {}",
                        d.policy().name,
                        "vendor",
                        d.kind.as_str(),
                        d.components_str(),
                        e["convention"].as_str().unwrap_or(""),
                        e["enforcement"].as_str().unwrap_or("")
                    );
                }
                println!();
            }
            println!("{:<36} {:<9} {:<10} DESCRIPTION", "POLICY", "ORIGIN", "LEVEL");
            let level = |e: byoc_policy::Enforcement| match e {
                byoc_policy::Enforcement::Mandatory => "mandatory",
                byoc_policy::Enforcement::Advisory => "advisory",
            };
            for p in &c.builtin {
                println!(
                    "{:<36} {:<9} {:<10} {}",
                    p.name,
                    "builtin",
                    level(p.enforcement),
                    crate::policy::description(p)
                );
            }
            for id in &c.off {
                println!(
                    "{:<36} {:<9} {:<10} switched off in {}",
                    format!("builtin/{id}"),
                    "builtin",
                    "off",
                    crate::policy::SETTINGS_FILE
                );
            }
            for p in &c.own {
                println!(
                    "{:<36} {:<9} {:<10} {} ({})",
                    p.name,
                    "customer",
                    level(p.enforcement),
                    crate::app_policies::convention_of(p),
                    p.digest()
                );
            }
            println!("\nparameters (data.byoc.params): {}", c.params);
            println!("vendor policies arrive with each job, in the signed app config");
        }
    }
    0
}

struct PolicyTest {
    input: PathBuf,
    source: Option<String>,
    phase: String,
    operation: String,
    policies: PathBuf,
    vendor_policies: Vec<PathBuf>,
    app: Option<PathBuf>,
    component: String,
    time_limit: std::time::Duration,
    memory_mib: u64,
    output: Output,
}

fn policy_test(t: PolicyTest) -> i32 {
    use byoc_policy::{Context, Limits, Source, Verdict};
    let usage = |msg: String| {
        eprintln!("error: {msg}");
        EX_USAGE
    };
    let c = match load_policies(&t.policies) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut vendor = match crate::policy::load_files(&t.vendor_policies, byoc_policy::Origin::Vendor) {
        Ok(v) => v,
        Err(e) => return usage(e),
    };
    let app = match t.app.as_deref().map(crate::app_policies::load_dir).transpose() {
        Ok(a) => a,
        Err(e) => return usage(e),
    };
    let mut bytes = match std::fs::read(&t.input) {
        Ok(b) => b,
        Err(e) => return usage(format!("reading {}: {e}", t.input.display())),
    };
    // Rendered manifests are usually YAML (`helm template`, kustomize): convert them.
    if serde_json::from_slice::<serde_json::Value>(&bytes).is_err()
        && let Ok(text) = std::str::from_utf8(&bytes)
        && let Ok(manifests) = byoc_job_executors::helm::parse_manifests(text)
        && !manifests.is_empty()
    {
        bytes = serde_json::to_vec(&manifests).unwrap_or_default();
    }
    let source = match t.source.as_deref() {
        Some(s) => match Source::parse(s) {
            Ok(s) => s,
            Err(e) => return usage(e),
        },
        None => {
            let looks_like_plan = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .is_some_and(|v| v.get("format_version").is_some());
            if looks_like_plan { Source::Terraform } else { Source::Kubernetes }
        }
    };
    let limits = Limits { time_per_policy: t.time_limit, ..Limits::default() };
    if let Err(e) = byoc_policy::parse_document(source, &bytes, &limits) {
        return usage(format!("{}: {e}", t.input.display()));
    }
    // --operation names the job's operation, or the admission operation.
    let (operation, admission) = match t.operation.to_ascii_lowercase().as_str() {
        "create" | "install" => ("component.deploy".to_string(), byoc_policy::Admission::Create),
        "update" | "upgrade" | "apply" => ("component.deploy".to_string(), byoc_policy::Admission::Update),
        "delete" | "uninstall" | "teardown" | "prune" => {
            ("component.teardown".to_string(), byoc_policy::Admission::Delete)
        }
        _ if t.operation.contains('.') => {
            let admission = if t.operation.ends_with(".teardown") || t.operation.ends_with(".deprovision") {
                byoc_policy::Admission::Delete
            } else {
                byoc_policy::Admission::Update
            };
            (t.operation.clone(), admission)
        }
        _ => {
            return usage(format!(
                "--operation {:?}: use entity.operation (component.deploy) or CREATE, UPDATE, DELETE",
                t.operation
            ));
        }
    };
    let source = if source == Source::Terraform && operation.starts_with("sandbox.") {
        Source::Sandbox
    } else {
        source
    };
    if let Some(app) = &app {
        let (kind, entity) = match source {
            Source::Terraform => ("terraform", "component"),
            Source::Sandbox => ("terraform", "sandbox"),
            Source::Helm => ("helm", "component"),
            Source::Kubernetes => ("kubernetes", "component"),
        };
        match crate::app_policies::for_job(app, kind, entity, &t.component) {
            Ok(v) => vendor.extend(v),
            Err(problems) => return usage(problems.join("; ")),
        }
    }
    let ctx = Context { source, phase: t.phase, operation, install: String::new(), admission };
    // The same evaluator process, under the same memory limit, as jobs use.
    let scope = byoc_job_executors::PolicyScope {
        policies: c.with_vendor(vendor),
        params: c.params.clone(),
        phase: ctx.phase.clone(),
        operation: ctx.operation.clone(),
        install: String::new(),
        limits,
        evaluator: std::env::current_exe().ok().map(|program| byoc_job_executors::Evaluator {
            program,
            args: vec!["policy-eval".into()],
            memory_mib: t.memory_mib,
        }),
        cluster_policies: vec![],
    };
    let decision = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt.block_on(scope.decide(ctx, &bytes)),
        Err(e) => return usage(format!("starting the runtime: {e}")),
    };
    match t.output {
        Output::Json => println!("{}", serde_json::to_string(&decision).unwrap_or_default()),
        Output::Text => {
            let findings = decision
                .violations
                .iter()
                .map(|f| ("DENY ", f))
                .chain(decision.warnings.iter().map(|f| ("WARN ", f)));
            for (label, f) in findings {
                let address = if f.address.is_empty() { "-" } else { &f.address };
                let convention = f.convention.map(|c| c.as_str()).unwrap_or("builtin");
                let level = match (f.from_rule.as_str(), f.enforcement) {
                    ("warn", _) => "warn",
                    (_, byoc_policy::Enforcement::Mandatory) => "mandatory",
                    (_, byoc_policy::Enforcement::Advisory) => "advisory",
                };
                println!(
                    "{label} {} ({convention}, {level}) [{}] {address}: {}",
                    f.policy, f.rule, f.message
                );
            }
            for e in &decision.errors {
                println!("ERROR {} [{}]: {}", e.policy, e.code, e.reason);
            }
            println!(
                "{} policies, {} violations, {} warnings, {} errors: {} ({} ms; input {})",
                decision.policies.len(),
                decision.violations.len(),
                decision.warnings.len(),
                decision.errors.len(),
                match decision.verdict {
                    Verdict::Allow => "ALLOW",
                    Verdict::Deny => "DENY",
                },
                decision.elapsed_ms,
                decision.input_digest
            );
        }
    }
    match decision.verdict {
        Verdict::Allow => 0,
        Verdict::Deny => 1,
    }
}

/// The evaluator process: limit our own address space first (no unsafe needed: the
/// limit applies to this process from here on), then read, evaluate, answer. Running
/// out of memory aborts, which the caller turns into a denial.
fn policy_eval(memory_mib: u64) -> i32 {
    use nix::sys::resource::{Resource, setrlimit};
    // The vendor's Rego runs here: give it no network at all (an empty namespace of
    // its own), whatever builtins the engine grows. Still single-threaded, as unshare
    // of a user namespace requires. Failing that, no decision: the job is denied.
    if let Err(e) =
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER | nix::sched::CloneFlags::CLONE_NEWNET)
    {
        eprintln!("error: isolating the policy evaluator from the network: {e}");
        return 71;
    }
    let bytes = memory_mib.saturating_mul(1 << 20);
    if let Err(e) = setrlimit(Resource::RLIMIT_AS, bytes, bytes) {
        eprintln!("error: setting the memory limit: {e}");
        return 71;
    }
    let mut text = String::new();
    if let Err(e) = std::io::Read::read_to_string(&mut std::io::stdin(), &mut text) {
        eprintln!("error: reading the request: {e}");
        return EX_DATAERR;
    }
    let req: byoc_policy::EvalRequest = match serde_json::from_str(&text) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: not an evaluation request: {e}");
            return EX_DATAERR;
        }
    };
    drop(text);
    let decision = req.evaluate();
    match serde_json::to_string(&decision) {
        Ok(s) => {
            println!("{s}");
            0
        }
        Err(e) => {
            eprintln!("error: encoding the decision: {e}");
            1
        }
    }
}

fn secret(file: Option<&Path>, env: &str) -> anyhow::Result<Option<String>> {
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

fn credential(
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

fn sync(a: SyncArgs) -> i32 {
    crate::logging::init_cli();
    let output = a.output;
    let fail = |code: &str, msg: &str| match output {
        Output::Json => println!("{}", serde_json::json!({"ok": false, "code": code, "error": msg})),
        Output::Text => eprintln!("error: {msg}"),
    };
    let prepared = (|| -> anyhow::Result<_> {
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
    })();
    let (src, dst, endpoints, src_cred, dst_cred) = match prepared {
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
        let progress = {
            use std::io::IsTerminal as _;
            let counters = copier.counters.clone();
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
        };
        let r = copier.copy(&src.repository, &reference, src.digest.as_ref(), &dst.repository, &tags).await;
        progress.abort();
        if output == Output::Text && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            eprintln!();
        }
        r
    });
    match result {
        Ok(r) => {
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
            0
        }
        Err(e) => {
            fail(&e.code(), &e.to_string());
            1
        }
    }
}

fn edge(f: impl FnOnce() -> anyhow::Result<()>) -> i32 {
    crate::logging::init_cli();
    match f() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

fn load_config(path: &Path) -> Result<Config, i32> {
    Config::load(path).map_err(|e| {
        eprintln!("error: {e}");
        EX_USAGE
    })
}

fn run_daemon(path: &Path) -> i32 {
    let config = match load_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let sink = crate::logging::init(config.logging.target, &config.logging.level);
    tracing::debug!(sink, "logging initialised");
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
            tracing::error!(error = %e, "runner failed");
            eprintln!("error: {e}");
            match e {
                crate::daemon::DaemonError::NoBootstrapToken
                | crate::daemon::DaemonError::InstallMismatch { .. } => EX_USAGE,
                _ => 1,
            }
        }
    }
}

fn validate(path: &Path, output: Output) -> i32 {
    match Config::load(path) {
        Ok(c) => {
            if output == Output::Json {
                println!("{}", serde_json::json!({"valid": true, "digest": c.digest, "problems": []}));
            } else {
                println!("{}: ok (digest {})", path.display(), c.digest);
            }
            0
        }
        Err(e) => {
            if output == Output::Json {
                println!("{}", serde_json::json!({"valid": false, "problems": e.problems}));
            } else {
                eprintln!("error: {e}");
            }
            EX_USAGE
        }
    }
}

fn config_check(path: &Path, output: Output) -> i32 {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return 1;
        }
    };
    let checks = rt.block_on(crate::doctor::run(path));
    let failed = checks.iter().any(|c| c.status == crate::doctor::Status::Fail);
    if output == Output::Json {
        println!("{}", serde_json::json!({ "ok": !failed, "checks": checks }));
    } else {
        for c in &checks {
            println!("{:<5} {:<16} {}", c.status.label(), c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("{:<22} fix: {fix}", "");
            }
        }
        println!("{}", if failed { "some checks failed" } else { "all checks passed" });
    }
    i32::from(failed)
}

fn state_dir(s: &StateArgs) -> PathBuf {
    if let Some(d) = &s.state_dir {
        return d.clone();
    }
    // The inspection CLI must work with a broken config too: fall back to the default.
    match Config::load(&s.config) {
        Ok(c) => c.runner.state_dir,
        Err(_) => PathBuf::from(DEFAULT_STATE_DIR),
    }
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn status(s: &StateArgs) -> anyhow::Result<()> {
    let st = inspect::status(&state_dir(s))?;
    if s.output == Output::Json {
        return print_json(&st);
    }
    let or_dash = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    println!("state dir:      {}", st.state_dir);
    println!("enrolled:       {}", if st.enrolled { "yes" } else { "no" });
    println!("runner id:      {}", or_dash(&st.runner_id));
    println!("install id:     {}", or_dash(&st.install_id));
    println!("control plane:  {}", or_dash(&st.control_plane_url));
    match st.daemon_pid {
        Some(pid) => println!("daemon:         running (pid {pid})"),
        None => println!("daemon:         not running"),
    }
    let counts: Vec<String> = st.jobs_by_status.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!(
        "jobs:           {} ({})",
        st.jobs_total,
        if counts.is_empty() { "none".into() } else { counts.join(", ") }
    );
    println!(
        "running:        {}",
        if st.jobs_running.is_empty() { "-".into() } else { st.jobs_running.join(", ") }
    );
    println!(
        "unreported:     {}",
        if st.jobs_unreported.is_empty() { "-".into() } else { st.jobs_unreported.join(", ") }
    );
    match &st.paused {
        Some(p) => println!(
            "paused:         yes, by {} since {}{}",
            p.by,
            inspect::format_ms(p.paused_at_ms),
            p.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
        ),
        None => println!("paused:         no"),
    }
    match &st.last_rejection {
        Some(r) => {
            println!("rejections:     {} (last: {} at {})", st.rejections, r.reason, inspect::format_ms(r.ts))
        }
        None => println!("rejections:     0"),
    }
    Ok(())
}

fn admin_group(s: &StateArgs) -> Option<String> {
    Config::load(&s.config).ok().and_then(|c| c.roles.admin_group)
}

fn pause(s: &StateArgs, reason: Option<String>) -> anyhow::Result<()> {
    use crate::roles::pause;
    let who = pause::authorize(admin_group(s).as_deref())?;
    let dir = state_dir(s);
    anyhow::ensure!(
        dir.is_dir(),
        "state dir {} does not exist (is the runner installed here?)",
        dir.display()
    );
    let p = pause::pause(&dir, reason, who)?;
    if s.output == Output::Json {
        return print_json(&serde_json::json!({ "paused": true, "pause": p }));
    }
    println!(
        "paused by {}{}: new jobs are refused (reason code `paused`) until `byoc-runner resume`; running jobs finish",
        p.by,
        p.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
    );
    Ok(())
}

fn resume(s: &StateArgs) -> anyhow::Result<()> {
    use crate::roles::pause;
    pause::authorize(admin_group(s).as_deref())?;
    let was = pause::resume(&state_dir(s))?;
    if s.output == Output::Json {
        return print_json(&serde_json::json!({ "paused": false, "was_paused": was }));
    }
    println!(
        "{}",
        if was { "resumed: the runner takes new jobs again" } else { "the runner was not paused" }
    );
    Ok(())
}

fn roles(s: &StateArgs, refresh: bool) -> anyhow::Result<()> {
    let dir = state_dir(s);
    let mut status = crate::roles::RolesStatus::load(&dir).unwrap_or_default();
    if refresh {
        let config = Config::load(&s.config).map_err(|e| anyhow::anyhow!("{e}"))?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async {
            let sdk = crate::roles::sdk_config(&config).await;
            let source = crate::roles::switch_source(&config, sdk.as_ref());
            let snapshot = source.read().await?;
            status.refresh(&snapshot, source.describe());
            anyhow::Ok(())
        })?;
    }
    if s.output == Output::Json {
        return print_json(&status);
    }
    if status.roles.is_empty() {
        println!(
            "no roles known yet: they are learned from the first job that asks for a role (switch source: {})",
            if status.switch_source.is_empty() { "not read yet" } else { &status.switch_source }
        );
        return Ok(());
    }
    println!(
        "switches: {} (read {})",
        status.switch_source,
        status.switches_read_ms.map(inspect::format_ms).unwrap_or_else(|| "never".into())
    );
    println!(
        "{:<36} {:<12} {:<8} {:<21} {:<24} SWITCH",
        "ROLE", "TYPE", "ENABLED", "LAST ASSUMED", "LAST JOB"
    );
    for r in &status.roles {
        println!(
            "{:<36} {:<12} {:<8} {:<21} {:<24} {}",
            r.name,
            r.role_type.as_str(),
            if r.enabled { "yes" } else { "no" },
            r.last_assumed_ms.map(inspect::format_ms).unwrap_or_else(|| "-".into()),
            r.last_job.as_deref().unwrap_or("-"),
            r.source
        );
        if let Some(arn) = &r.arn {
            println!("    arn: {arn}");
        }
        if let Some(how) = r.how_to_enable.as_ref().filter(|_| !r.enabled) {
            println!("    to enable: {how}");
        }
    }
    Ok(())
}

fn jobs(cmd: JobsCmd) -> anyhow::Result<()> {
    match cmd {
        JobsCmd::List { state, limit } => {
            let jobs = inspect::jobs(&state_dir(&state), limit)?;
            if state.output == Output::Json {
                return print_json(&jobs);
            }
            println!("{:<24} {:<16} {:<12} {:<21} {:>10}", "JOB", "KIND", "STATUS", "RECEIVED", "DURATION");
            for j in jobs {
                let dur = match (j.started_at_ms, j.finished.as_ref().map(|f| f.finished_at_ms)) {
                    (Some(s), Some(f)) => format!("{:.1}s", f.saturating_sub(s) as f64 / 1000.0),
                    _ => "-".into(),
                };
                println!(
                    "{:<24} {:<16} {:<12} {:<21} {:>10}",
                    j.job_id,
                    j.kind,
                    inspect::status_label(&j),
                    inspect::format_ms(j.received_at_ms),
                    dur
                );
            }
            Ok(())
        }
        JobsCmd::Show { state, job_id } => {
            let j = inspect::job(&state_dir(&state), &job_id)?;
            if state.output == Output::Json {
                return print_json(&j);
            }
            println!("job:        {}", j.job_id);
            println!("kind:       {} ({} {})", j.kind, j.entity, j.operation);
            println!("status:     {}", inspect::status_label(&j));
            println!("phase:      {}", j.phase.as_str());
            println!("received:   {}", inspect::format_ms(j.received_at_ms));
            if let Some(s) = j.started_at_ms {
                println!("started:    {}", inspect::format_ms(s));
            }
            if let Some(f) = &j.finished {
                println!("finished:   {}", inspect::format_ms(f.finished_at_ms));
                println!("exit code:  {}", f.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()));
                println!("log:        {} bytes, sha256 {}", f.log_size, f.log_sha256);
                if let Some(e) = &f.error {
                    println!("error:      {e}");
                }
            }
            if let Some(d) = &j.detail {
                println!("detail:     {d}");
            }
            println!("payload:    sha256 {}", j.payload_sha256);
            Ok(())
        }
        JobsCmd::Logs { state, job_id } => {
            let log = inspect::log(&state_dir(&state), &job_id)?;
            if state.output == Output::Json {
                return print_json(&serde_json::json!({
                    "job_id": job_id,
                    "size": log.len(),
                    "sha256": byoc_protocol::sha256_hex(&log),
                    "log": String::from_utf8_lossy(&log),
                }));
            }
            std::io::stdout().write_all(&log)?;
            Ok(())
        }
        JobsCmd::Rejections { state, limit } => {
            let rs = inspect::rejections(&state_dir(&state), limit)?;
            if state.output == Output::Json {
                return print_json(&rs);
            }
            println!("{:<21} {:<20} {:<24} DETAIL", "TIME", "REASON", "JOB");
            for r in rs {
                println!(
                    "{:<21} {:<20} {:<24} {}",
                    inspect::format_ms(r.ts),
                    r.reason.code(),
                    r.job_id.as_deref().unwrap_or("-"),
                    r.detail
                );
            }
            Ok(())
        }
    }
}

fn audit_dir(a: &AuditArgs) -> PathBuf {
    a.dir.clone().unwrap_or_else(|| state_dir(&a.state).join(crate::audit::AUDIT_DIR))
}

fn audit_verify(a: &AuditArgs, trust: Option<&Path>) -> i32 {
    let dir = audit_dir(a);
    let (trust, pinned) = match crate::audit::load_trust(&dir, trust) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return EX_USAGE;
        }
    };
    match byoc_audit::verify::verify_dir(&dir, &trust) {
        Ok(report) => {
            if a.state.output == Output::Json {
                println!("{}", serde_json::json!({"ok": true, "keys_pinned": pinned, "report": report}));
            } else {
                println!(
                    "ok: {} records, {} checkpoints, {} acknowledged by the control plane (up to {}), root {}",
                    report.records,
                    report.checkpoints,
                    report.cosigned,
                    report.acknowledged_size,
                    report.root
                );
                if !pinned {
                    println!("note: keys taken from {} (pin them with --trust FILE)", dir.display());
                }
            }
            0
        }
        Err(e) => {
            if a.state.output == Output::Json {
                println!("{}", serde_json::json!({"ok": false, "error": e.to_string(), "detail": e}));
            } else {
                eprintln!("FAILED: {e}");
            }
            1
        }
    }
}

fn audit(cmd: AuditCmd) -> anyhow::Result<()> {
    use anyhow::Context as _;
    match cmd {
        AuditCmd::Verify { .. } => unreachable!("handled before"),
        AuditCmd::Tail { a, lines, follow } => {
            let dir = audit_dir(&a);
            let all = byoc_audit::log::read_lines(&dir, 0, u64::MAX)?;
            let mut printed = all.len();
            for l in all.iter().skip(all.len().saturating_sub(lines)) {
                println!("{l}");
            }
            if !follow {
                return Ok(());
            }
            loop {
                // A file has no change notification we can rely on everywhere; poll gently.
                std::thread::sleep(std::time::Duration::from_millis(500));
                let more = byoc_audit::log::read_lines(&dir, printed as u64, u64::MAX)?;
                printed += more.len();
                for l in more {
                    println!("{l}");
                }
            }
        }
        AuditCmd::Show { a, seq } => {
            let dir = audit_dir(&a);
            let line = byoc_audit::log::read_lines(&dir, seq, seq + 1)?
                .pop()
                .with_context(|| format!("no record {seq} in {}", dir.display()))?;
            if a.state.output == Output::Json {
                println!("{line}");
            } else {
                let v: serde_json::Value = serde_json::from_str(&line)?;
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
            Ok(())
        }
        AuditCmd::Export { a } => {
            let dir = audit_dir(&a);
            for l in byoc_audit::log::read_lines(&dir, 0, u64::MAX)? {
                println!("{{\"type\":\"record\",\"record\":{l}}}");
            }
            for (file, kind) in
                [(byoc_audit::log::CHECKPOINTS, "checkpoint"), (byoc_audit::log::COSIGNED, "cosigned")]
            {
                for c in byoc_audit::log::read_checkpoints(&dir.join(file)) {
                    println!("{}", serde_json::json!({"type": kind, "size": c.size, "note": c.note}));
                }
            }
            Ok(())
        }
        AuditCmd::Prove { a, seq } => {
            let proof = crate::audit::prove(&audit_dir(&a), seq).map_err(anyhow::Error::msg)?;
            println!("{}", serde_json::to_string_pretty(&proof)?);
            Ok(())
        }
    }
}

fn run_local(path: &Path, output: Output, sandboxed: bool) -> i32 {
    crate::logging::init_cli();
    let (job, exec) = match crate::run_local::load(path) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("error: {e}");
            return if e.is_usage() { EX_DATAERR } else { 1 };
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return 1;
        }
    };
    let mut captured = Vec::new();
    let capture = (output == Output::Json).then_some(&mut captured);
    match rt.block_on(crate::run_local::run(&job, exec.as_ref(), capture, sandboxed)) {
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
            1
        }
    }
}
