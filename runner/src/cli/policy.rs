//! `policy list`, `policy test`, and the hidden `policy-eval` (the evaluator process
//! jobs and `policy test` run under an address-space limit).

use std::path::{Path, PathBuf};

use clap::Subcommand;

use super::{EX_DATAERR, EX_USAGE, Output};

#[derive(Subcommand)]
pub(super) enum PolicyCmd {
    /// The built-in rules, the customer's policies, parameters
    ///
    /// The built-in rules at the customer's levels, the customer's own policies and
    /// the parameters, as the runner would decide with them.
    ///
    /// Example: byoc-runner policy list --app ./my-app
    List {
        /// The customer's policy directory (`*.rego`, `policies.toml`).
        #[arg(long, default_value = crate::customer_policies::DEFAULT_POLICY_DIR)]
        policies: PathBuf,
        /// An app config directory: list its `policies.toml` declarations too.
        #[arg(long)]
        app: Option<PathBuf>,
        /// Output format: text for people, json for scripts.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Decide a plan or manifests; print violations and verdict
    ///
    /// Evaluates every policy over the input. Exit 0 if allowed, 1 if denied, 64 on
    /// unusable input.
    ///
    /// Example: terraform show -json plan.tfplan > plan.json && byoc-runner policy test --input plan.json --phase maintenance
    Test(TestArgs),
}

#[derive(clap::Args)]
pub(super) struct TestArgs {
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
    /// The customer's policy directory (`*.rego`, `policies.toml`).
    #[arg(long, default_value = crate::customer_policies::DEFAULT_POLICY_DIR)]
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
    /// A JSON object given to the policies as `input.byoc.context`, as a job's
    /// guardrails would be (`{"now": …, "window": {…} or null, "role": {…}}`; see
    /// docs/GUARDRAILS.md), to test policies that depend on it.
    #[arg(long)]
    context: Option<PathBuf>,
    /// Output format: text for people, json for scripts.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
    output: Output,
}

pub(super) fn run(cmd: PolicyCmd) -> i32 {
    match cmd {
        PolicyCmd::List { policies, app, output } => list(&policies, app.as_deref(), output),
        PolicyCmd::Test(args) => test(args),
    }
}

fn load_policies(dir: &Path) -> Result<crate::customer_policies::CustomerPolicies, i32> {
    crate::customer_policies::load(dir).map_err(|problems| {
        eprintln!("error: the policy directory {} has problems:", dir.display());
        for p in problems {
            eprintln!("  {p}");
        }
        EX_USAGE
    })
}

fn list(dir: &Path, app_dir: Option<&Path>, output: Output) -> i32 {
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
            "description": crate::customer_policies::description(p),
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
        Output::Text => print_list(&c, &declared),
    }
    0
}

/// A vendor policy of the app config, as listed.
fn vendor_entry(d: &crate::app_policies::Declared) -> serde_json::Value {
    let p = d.policy();
    let applied = d.kind == crate::app_policies::PolicyType::KubernetesCluster;
    serde_json::json!({
        "name": p.name, "origin": "vendor", "type": d.kind.as_str(), "components": d.components_str(),
        "engine": if d.engine == crate::app_policies::Engine::Opa { "opa" } else { "kyverno" },
        "convention": if applied { "kyverno".to_string() } else { crate::app_policies::convention_of(&p) },
        "enforcement": if applied { "applied to the cluster" } else { "mandatory" }, "digest": p.digest(),
    })
}

fn print_list(c: &crate::customer_policies::CustomerPolicies, declared: &[crate::app_policies::Declared]) {
    if !declared.is_empty() {
        println!(
            "{:<40} {:<8} {:<20} {:<20} {:<12} LEVEL",
            "VENDOR POLICY", "ORIGIN", "TYPE", "COMPONENTS", "CONVENTION"
        );
        for d in declared {
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
            crate::customer_policies::description(p)
        );
    }
    for id in &c.off {
        println!(
            "{:<36} {:<9} {:<10} switched off in {}",
            format!("builtin/{id}"),
            "builtin",
            "off",
            crate::customer_policies::SETTINGS_FILE
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

fn test(t: TestArgs) -> i32 {
    use byoc_policy::{Context, Limits, Source, Verdict};
    let usage = |msg: String| {
        eprintln!("error: {msg}");
        EX_USAGE
    };
    let c = match load_policies(&t.policies) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut vendor =
        match crate::customer_policies::load_files(&t.vendor_policies, byoc_policy::Origin::Vendor) {
            Ok(v) => v,
            Err(e) => return usage(e.to_string()),
        };
    let app = match t.app.as_deref().map(crate::app_policies::load_dir).transpose() {
        Ok(a) => a,
        Err(e) => return usage(e.to_string()),
    };
    let context = match t.context.as_deref().map(read_context).transpose() {
        Ok(c) => c.unwrap_or(serde_json::Value::Null),
        Err(e) => return usage(e),
    };
    let (bytes, source) = match read_input(&t.input, t.source.as_deref()) {
        Ok(input) => input,
        Err(e) => return usage(e),
    };
    let limits =
        Limits { time_per_policy: std::time::Duration::from_millis(t.time_limit_ms), ..Limits::default() };
    if let Err(e) = byoc_policy::parse_document(source, &bytes, &limits) {
        return usage(format!("{}: {e}", t.input.display()));
    }
    let (operation, admission) = match operation_of(&t.operation) {
        Ok(o) => o,
        Err(e) => return usage(e),
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
    let ctx = Context {
        source,
        phase: t.phase,
        operation,
        install: String::new(),
        admission,
        context,
        drift: false,
    };
    // The same evaluator process, under the same memory limit, as jobs use.
    let about = crate::customer_policies::Decision {
        phase: ctx.phase.clone(),
        operation: ctx.operation.clone(),
        ..Default::default()
    };
    let scope = c.scope(vendor, about, limits, t.memory_mib);
    let decision = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt.block_on(scope.decide(ctx, &bytes)),
        Err(e) => return usage(format!("starting the runtime: {e}")),
    };
    print_decision(&decision, t.output);
    match decision.verdict {
        Verdict::Allow => 0,
        Verdict::Deny => 1,
    }
}

/// `--context FILE`: a JSON object.
fn read_context(path: &std::path::Path) -> Result<serde_json::Value, String> {
    match std::fs::read(path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).map_err(|e| format!("not JSON: {e}")))
    {
        Ok(v @ serde_json::Value::Object(_)) => Ok(v),
        Ok(_) => Err(format!("--context {}: must be a JSON object", path.display())),
        Err(e) => Err(format!("--context {}: {e}", path.display())),
    }
}

/// The document to decide, as JSON, and what it is: `--source`, or a plan when it has
/// terraform's `format_version`, else manifests (YAML converted).
fn read_input(
    path: &std::path::Path,
    source: Option<&str>,
) -> Result<(Vec<u8>, byoc_policy::Source), String> {
    use byoc_policy::Source;
    let mut bytes = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    // Rendered manifests are usually YAML (`helm template`, kustomize): convert them.
    if serde_json::from_slice::<serde_json::Value>(&bytes).is_err()
        && let Ok(text) = std::str::from_utf8(&bytes)
        && let Ok(manifests) = byoc_job_executors::tool::parse_manifests(text)
        && !manifests.is_empty()
    {
        bytes = serde_json::to_vec(&manifests).unwrap_or_default();
    }
    let source = match source {
        Some(s) => Source::parse(s).map_err(|e| e.to_string())?,
        None => {
            let looks_like_plan = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .is_some_and(|v| v.get("format_version").is_some());
            if looks_like_plan { Source::Terraform } else { Source::Kubernetes }
        }
    };
    Ok((bytes, source))
}

/// `--operation`: the job's operation (entity.operation), or the admission operation.
fn operation_of(operation: &str) -> Result<(String, byoc_policy::Admission), String> {
    use byoc_policy::Admission;
    Ok(match operation.to_ascii_lowercase().as_str() {
        "create" | "install" => ("component.deploy".to_string(), Admission::Create),
        "update" | "upgrade" | "apply" => ("component.deploy".to_string(), Admission::Update),
        "delete" | "uninstall" | "teardown" | "prune" => {
            ("component.teardown".to_string(), Admission::Delete)
        }
        _ if operation.contains('.') => {
            let admission = if operation.ends_with(".teardown") || operation.ends_with(".deprovision") {
                Admission::Delete
            } else {
                Admission::Update
            };
            (operation.to_string(), admission)
        }
        _ => {
            return Err(format!(
                "--operation {operation:?}: use entity.operation (component.deploy) or CREATE, UPDATE, DELETE"
            ));
        }
    })
}

fn print_decision(decision: &byoc_policy::Decision, output: Output) {
    use byoc_policy::Verdict;
    match output {
        Output::Json => println!("{}", serde_json::to_string(&decision).unwrap_or_default()),
        Output::Text => {
            let findings = decision
                .violations
                .iter()
                .map(|f| ("DENY ", f))
                .chain(decision.warnings.iter().map(|f| ("WARN ", f)))
                .chain(decision.passes.iter().map(|f| ("PASS ", f)));
            for (label, f) in findings {
                let address = if f.address.is_empty() { "-" } else { &f.address };
                let convention = f.convention.map(|c| c.as_str()).unwrap_or("builtin");
                let level = match (f.from_rule.as_str(), f.enforcement) {
                    ("warn", _) => "warn",
                    ("pass", _) => "informational",
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
                "{} policies, {} violations, {} warnings, {} passed, {} errors: {} ({} ms; input {})",
                decision.policies.len(),
                decision.violations.len(),
                decision.warnings.len(),
                decision.passes.len(),
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
}

/// The evaluator process: limit our own address space first (no unsafe needed: the
/// limit applies to this process from here on), then read, evaluate, answer. Running
/// out of memory aborts, which the caller turns into a denial.
pub(super) fn eval(memory_mib: u64) -> i32 {
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
