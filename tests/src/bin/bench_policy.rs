//! `byoc-bench-policy`: the built-in policy pack end to end (JSON parse + evaluation)
//! over generated terraform plans of N resource changes, then vendor policies in the
//! `nuon` convention over the same plans and over N kubernetes objects (one admission
//! review each). Figures, not assertions.

use std::time::{Duration, Instant};

use byoc_policy::{
    Admission, Context, Enforcement, Limits, Origin, Policy, Source, builtin_pack, evaluate, parse_document,
};
use clap::Parser;
use serde_json::json;

#[derive(Parser)]
#[command(name = "byoc-bench-policy", about = "Policy evaluation time on generated plans")]
struct Args {
    /// Plan sizes (resource changes).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Kubernetes objects for the nuon manifest figure.
    #[arg(long, default_value_t = 1000)]
    objects: usize,
}

/// Vendor policies in the nuon convention (the policy suites' own fixtures).
fn nuon(files: &[(&str, &str)]) -> Vec<Policy> {
    files
        .iter()
        .map(|(name, text)| Policy {
            name: format!("vendor/{name}"),
            origin: Origin::Vendor,
            enforcement: Enforcement::Mandatory,
            text: text.to_string(),
        })
        .collect()
}

/// Kubernetes objects of a few kinds, every tenth privileged.
fn objects(n: usize) -> Vec<u8> {
    let objs: Vec<serde_json::Value> = (0..n)
        .map(|i| match i % 4 {
            0 => json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": format!("d{i}"), "namespace": "shop"},
                        "spec": {"replicas": 2, "template": {"spec": {"containers": [
                            {"name": "app", "image": "registry.example/app:1", "resources": {"limits": {"memory": "512Mi"}}},
                            {"name": "proxy", "image": "registry.example/proxy:1", "securityContext": {"privileged": i % 10 == 0}}]}}}}),
            1 => json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": format!("s{i}"), "namespace": "shop"}, "spec": {"type": "ClusterIP"}}),
            2 => json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("c{i}")}, "data": {"k": "v"}}),
            _ => json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": format!("i{i}"), "namespace": "web"}, "spec": {}}),
        })
        .collect();
    serde_json::to_vec(&objs).unwrap_or_default()
}

fn median_ms(times: &mut [Duration]) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1000.0
}

/// A plan in the real format with a realistic mix: buckets, security groups and rules,
/// volumes, databases, instances, IAM; a few of them violating.
fn plan(n: usize) -> Vec<u8> {
    let mut changes = Vec::with_capacity(n);
    for i in 0..n {
        let (ty, after, unknown) = match i % 8 {
            0 => (
                "aws_s3_bucket",
                json!({"bucket": format!("b-{i}"), "tags": {"owner": "x", "cost-center": "1"}, "tags_all": {"owner": "x", "cost-center": "1"}, "server_side_encryption_configuration": [{"rule": [{}]}]}),
                json!({"arn": true, "id": true}),
            ),
            1 => (
                "aws_security_group",
                json!({"name": format!("sg-{i}"), "ingress": [{"cidr_blocks": ["10.0.0.0/8"], "ipv6_cidr_blocks": [], "from_port": 443, "to_port": 443, "protocol": "tcp"}], "egress": [], "tags": {"owner": "x", "cost-center": "1"}}),
                json!({"id": true, "tags_all": true}),
            ),
            2 => (
                "aws_security_group_rule",
                json!({"type": "ingress", "cidr_blocks": ["10.1.0.0/16"], "from_port": 22, "to_port": 22}),
                json!({"id": true}),
            ),
            3 => (
                "aws_ebs_volume",
                json!({"size": 100, "encrypted": true, "tags": {"owner": "x", "cost-center": "1"}}),
                json!({"id": true, "kms_key_id": true}),
            ),
            4 => (
                "aws_db_instance",
                json!({"identifier": format!("db-{i}"), "storage_encrypted": true, "engine": "postgres", "tags": {"owner": "x"}}),
                json!({"endpoint": true}),
            ),
            5 => (
                "aws_instance",
                json!({"instance_type": "m7g.large", "ami": "ami-123", "tags": {"owner": "x", "cost-center": "1"}}),
                json!({"id": true, "private_ip": true}),
            ),
            6 => (
                "aws_iam_role_policy_attachment",
                json!({"role": "r", "policy_arn": "arn:aws:iam::aws:policy/ReadOnlyAccess"}),
                json!({"id": true}),
            ),
            _ => (
                "aws_cloudwatch_log_group",
                json!({"name": format!("/acme/{i}"), "retention_in_days": 30, "tags": {"owner": "x", "cost-center": "1"}}),
                json!({"arn": true}),
            ),
        };
        let actions = if i % 97 == 0 {
            json!(["delete", "create"])
        } else if i % 5 == 0 {
            json!(["update"])
        } else {
            json!(["create"])
        };
        changes.push(json!({
            "address": format!("module.m{}.{ty}.r{i}", i % 20),
            "module_address": format!("module.m{}", i % 20),
            "mode": "managed", "type": ty, "name": format!("r{i}"),
            "provider_name": "registry.terraform.io/hashicorp/aws",
            "change": {"actions": actions, "before": null, "after": after, "after_unknown": unknown,
                       "before_sensitive": false, "after_sensitive": {}}
        }));
    }
    serde_json::to_vec(&json!({
        "format_version": "1.2", "terraform_version": "1.9.5",
        "resource_changes": changes,
        "configuration": {"root_module": {"resources": []}}
    }))
    .unwrap_or_default()
}

fn main() {
    let a = Args::parse();
    let pack = builtin_pack();
    let params = json!({"required_tags": ["owner", "cost-center"], "approved_registries": ["123456789012.dkr.ecr.eu-west-1.amazonaws.com/"]});
    let ctx = Context {
        source: Source::Terraform,
        phase: "maintenance".into(),
        operation: "component.deploy".into(),
        install: "inst-bench".into(),
        admission: Default::default(),
        context: Default::default(),
        drift: false,
    };
    let limits = Limits { time_per_policy: Duration::from_secs(60), ..Limits::default() };
    for &n in &a.sizes {
        let bytes = plan(n);
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..a.runs {
            let t = Instant::now();
            let doc = match parse_document(Source::Terraform, &bytes, &limits) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("generated plan did not parse: {e}");
                    std::process::exit(1);
                }
            };
            let d = evaluate(&pack, &params, &ctx, &doc, &bytes, &limits);
            times.push(t.elapsed());
            last = Some(d);
        }
        times.sort();
        let d = last.expect("at least one run");
        if std::env::var_os("BYOC_BENCH_BREAKDOWN").is_some() {
            let doc = parse_document(Source::Terraform, &bytes, &limits).expect("parses");
            let t = Instant::now();
            let _ = parse_document(Source::Terraform, &bytes, &limits);
            println!("  parse {:.1} ms", t.elapsed().as_secs_f64() * 1000.0);
            for p in &pack {
                let t = Instant::now();
                evaluate(std::slice::from_ref(p), &params, &ctx, &doc, &bytes, &limits);
                println!("  {} {:.1} ms", p.name, t.elapsed().as_secs_f64() * 1000.0);
            }
            let t = Instant::now();
            evaluate(&[], &params, &ctx, &doc, &bytes, &limits);
            println!("  no policy (input conversion) {:.1} ms", t.elapsed().as_secs_f64() * 1000.0);
        }
        println!(
            "{n:>6} resource changes ({:.1} MiB plan): median {:.1} ms, min {:.1} ms over {} runs; {} violations, {} errors, verdict {:?}",
            bytes.len() as f64 / (1 << 20) as f64,
            times[times.len() / 2].as_secs_f64() * 1000.0,
            times[0].as_secs_f64() * 1000.0,
            a.runs,
            d.violations.len(),
            d.errors.len(),
            d.verdict
        );
    }

    // The nuon convention: vendor policies over `input.plan`, and one admission review
    // per object.
    let plan_policies = nuon(&[
        (
            "nuon_plan_changes.rego",
            include_str!("../../../job-executors/policy/tests/conventions/nuon_plan_changes.rego"),
        ),
        (
            "nuon_plan_hygiene.rego",
            include_str!("../../../job-executors/policy/tests/conventions/nuon_plan_hygiene.rego"),
        ),
    ]);
    for &n in &a.sizes {
        let bytes = plan(n);
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..a.runs {
            let t = Instant::now();
            let doc = parse_document(Source::Terraform, &bytes, &limits).expect("parses");
            last = Some(evaluate(&plan_policies, &params, &ctx, &doc, &bytes, &limits));
            times.push(t.elapsed());
        }
        let d = last.expect("at least one run");
        println!(
            "{n:>6} resource changes, 2 nuon policies over input.plan: median {:.1} ms over {} runs; {} violations, {} errors",
            median_ms(&mut times),
            a.runs,
            d.violations.len(),
            d.errors.len()
        );
    }
    let review_policies = nuon(&[
        (
            "nuon_review.rego",
            include_str!("../../../job-executors/policy/tests/conventions/nuon_review.rego"),
        ),
        (
            "nuon_review_limits.rego",
            include_str!("../../../job-executors/policy/tests/conventions/nuon_review_limits.rego"),
        ),
    ]);
    let bytes = objects(a.objects);
    let kctx = Context { source: Source::Kubernetes, admission: Admission::Update, ..ctx.clone() };
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..a.runs {
        let t = Instant::now();
        let doc = parse_document(Source::Kubernetes, &bytes, &limits).expect("parses");
        last = Some(evaluate(&review_policies, &params, &kctx, &doc, &bytes, &limits));
        times.push(t.elapsed());
    }
    let d = last.expect("at least one run");
    let ms = median_ms(&mut times);
    println!(
        "{:>6} kubernetes objects, 2 nuon policies, one admission review each: median {ms:.1} ms over {} runs = {:.0} objects/s; {} violations, {} errors",
        a.objects,
        a.runs,
        a.objects as f64 / (ms / 1000.0),
        d.violations.len(),
        d.errors.len()
    );
}
