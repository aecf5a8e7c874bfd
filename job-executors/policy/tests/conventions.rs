//! Both conventions, as policy authors write them (fixtures in `tests/conventions/`,
//! written for these tests): the exact findings of each policy over a plan with
//! creates, updates, deletes, replaces and values unknown until apply, and over
//! rendered manifests (core and non-core kinds, an empty document) under each
//! admission operation; and every way a policy can fail to be evaluated denies with
//! its reason code.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use byoc_policy::*;

pub fn fixture(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/conventions").join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The objects of a multi-document YAML file (empty documents skipped).
pub fn yaml_objects(text: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize as _;
    serde_norway::Deserializer::from_str(text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn ctx(source: Source, admission: Admission) -> Context {
    Context {
        source,
        phase: "maintenance".into(),
        operation: "component.deploy".into(),
        install: "inst-1".into(),
        admission,
        context: Default::default(),
        drift: false,
    }
}

fn vendor(file: &str) -> Policy {
    Policy {
        name: format!("vendor/{file}"),
        origin: Origin::Vendor,
        enforcement: Enforcement::Mandatory,
        text: fixture(file),
    }
}

/// Evaluate one policy file; the verdict and each finding as `level|rule|object|message`.
fn run(file: &str, source: Source, admission: Admission) -> (Verdict, Vec<String>, Vec<PolicyError>) {
    let bytes = if source.is_plan() {
        fixture("plan_mixed.json").into_bytes()
    } else {
        serde_json::to_vec(&yaml_objects(&fixture("manifests.yaml"))).unwrap()
    };
    let doc = parse_document(source, &bytes, &Limits::default()).unwrap();
    let d = evaluate(
        &[vendor(file)],
        &serde_json::json!({}),
        &ctx(source, admission),
        &doc,
        &bytes,
        &Limits::default(),
    );
    let mut found: Vec<String> = d
        .violations
        .iter()
        .map(|f| ("deny", f))
        .chain(d.warnings.iter().map(|f| ("warn", f)))
        .chain(d.passes.iter().map(|f| ("pass", f)))
        .map(|(level, f)| format!("{level}|{}|{}|{}", f.from_rule, f.address, f.message))
        .collect();
    found.sort();
    (d.verdict, found, d.errors)
}

fn sorted(v: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

#[test]
fn nuon_plan_policies_see_the_plan_under_input_plan() {
    let (verdict, found, errors) = run("nuon_plan_changes.rego", Source::Terraform, Admission::Update);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(verdict, Verdict::Deny);
    assert_eq!(
        found,
        sorted(&[
            "deny|deny||aws_eip.nat: aws_eip deleted",
            "deny|deny||aws_db_instance.main is replaced",
            "warn|warn||aws_security_group.web is updated in place",
            "warn|warn||aws_db_instance.main: 2 values known only after apply",
            "warn|warn||aws_iam_policy.deploy: 2 values known only after apply",
            "warn|warn||aws_s3_bucket.logs: 2 values known only after apply",
        ])
    );
    let (_, found, _) = run("nuon_plan_hygiene.rego", Source::Terraform, Admission::Update);
    assert_eq!(
        found,
        sorted(&[
            "deny|deny||aws_db_instance.main lacks tags cost-center",
            "deny|deny||aws_s3_bucket.logs lacks tags cost-center",
            "deny|deny||aws_security_group.web opens port 22 to 0.0.0.0/0",
            "warn|warn||aws_iam_policy.deploy: tags are unknown until apply",
            "warn|warn||aws_s3_bucket.logs: a second version of a bucket",
        ])
    );
    let (_, found, _) = run("nuon_plan_functions.rego", Source::Sandbox, Admission::Update);
    assert_eq!(
        found,
        sorted(&[
            "deny|deny||aws_db_instance.main grows by 80 GiB",
            "deny|deny||aws_iam_policy.deploy allows every action",
            r#"warn|warn||a wide change: {"aws_db_instance", "aws_eip", "aws_iam_policy", "aws_s3_bucket", "aws_security_group"}"#,
            r#"warn|warn||aws_instance.worker["b"] uses burstable family t3 (t3)"#,
        ])
    );
}

#[test]
fn future_keywords_imports_are_accepted() {
    let (verdict, found, errors) = run("nuon_future_keywords.rego", Source::Terraform, Admission::Update);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(verdict, Verdict::Deny);
    assert_eq!(found, sorted(&["deny|deny||aws_eip.nat is only deleted"]));
}

#[test]
fn nuon_objects_keep_their_other_fields_as_details() {
    let bytes = fixture("plan_mixed.json").into_bytes();
    let doc = parse_document(Source::Terraform, &bytes, &Limits::default()).unwrap();
    let d = evaluate(
        &[vendor("nuon_plan_changes.rego")],
        &serde_json::json!({}),
        &ctx(Source::Terraform, Admission::Update),
        &doc,
        &bytes,
        &Limits::default(),
    );
    let replaced = d.violations.iter().find(|f| f.message.ends_with("is replaced")).unwrap();
    assert_eq!(
        replaced.details,
        Some(serde_json::json!({"severity": "high", "actions": ["delete", "create"]}))
    );
    assert_eq!(replaced.convention, Some(Convention::Nuon));
    assert_eq!(d.warnings[0].enforcement, Enforcement::Mandatory, "warn findings never deny");
    let unknown = d.warnings.iter().find(|f| f.message.starts_with("aws_iam_policy.deploy:")).unwrap();
    assert_eq!(
        unknown.details,
        Some(serde_json::json!({"attributes": ["arn", "tags"]})),
        "a warn object keeps its fields"
    );
}

#[test]
fn nuon_manifest_policies_review_each_object_under_the_jobs_operation() {
    let (_, found, errors) = run("nuon_review.rego", Source::Helm, Admission::Create);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        found,
        sorted(&[
            "deny|deny|Service/shop/api-public|a new public Service api-public in shop",
            "deny|deny|Pod/default/debug|Pod/debug: container shell is privileged",
            "warn|warn|Service/shop/api-public|CREATE api-public is a core v1 object",
            "warn|warn|Pod/default/debug|CREATE debug is a core v1 object",
            "warn|warn|PersistentVolumeClaim/shop/data|CREATE data is a core v1 object",
        ])
    );
    let (_, found, _) = run("nuon_review.rego", Source::Kubernetes, Admission::Delete);
    assert_eq!(
        found,
        sorted(&[
            "deny|deny|Pod/default/debug|Pod/debug: container shell is privileged",
            "deny|deny|PersistentVolumeClaim/shop/data|deleting volume claim shop/data loses data",
            "warn|warn|Service/shop/api-public|DELETE api-public is a core v1 object",
            "warn|warn|Pod/default/debug|DELETE debug is a core v1 object",
            "warn|warn|PersistentVolumeClaim/shop/data|DELETE data is a core v1 object",
        ])
    );
    // An upgrade: the public service is not new, so only the privileged pod denies.
    let (_, found, _) = run("nuon_review.rego", Source::Helm, Admission::Update);
    assert_eq!(found.iter().filter(|f| f.starts_with("deny")).count(), 1, "{found:?}");
    let (_, found, _) = run("nuon_review_limits.rego", Source::Kubernetes, Admission::Update);
    assert_eq!(
        found,
        sorted(&[
            "deny|deny|Deployment/shop/api|api: containers without a memory limit: sidecar",
            "warn|warn|Deployment/shop/api|api asks for 1024 MiB",
        ])
    );
}

#[test]
fn the_review_carries_kind_group_version_and_the_whole_object() {
    let objects = yaml_objects(&fixture("manifests.yaml"));
    let doc = Document::manifests(objects.clone());
    let inputs = inputs_for(Convention::Nuon, &doc, &ctx(Source::Helm, Admission::Create));
    assert_eq!(inputs.len(), 5, "the empty document is no object");
    let (deployment, id) = &inputs[0];
    assert_eq!(id, "Deployment/shop/api");
    assert_eq!(
        deployment["review"]["kind"],
        serde_json::json!({"kind": "Deployment", "group": "apps", "version": "v1"})
    );
    assert_eq!(deployment["review"]["operation"], "CREATE");
    assert_eq!(deployment["review"]["object"], objects[0]);
    let (service, _) = &inputs[1];
    assert_eq!(
        service["review"]["kind"],
        serde_json::json!({"kind": "Service", "version": "v1"}),
        "no group for core"
    );
    assert_eq!(inputs[2].1, "Pod/default/debug", "namespace defaults to default");
    let plan: serde_json::Value = serde_json::from_str(&fixture("plan_mixed.json")).unwrap();
    let inputs = inputs_for(
        Convention::Nuon,
        &Document::plan(plan.clone()),
        &ctx(Source::Terraform, Admission::Update),
    );
    assert_eq!(
        inputs,
        vec![(serde_json::json!({"plan": plan}), String::new())],
        "the plan exactly as printed"
    );
}

#[test]
fn conftest_policies_keep_working_on_plans_and_each_manifest() {
    let (_, found, errors) = run("conftest_plan.rego", Source::Terraform, Admission::Update);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        found,
        sorted(&[
            "deny|deny||aws_eip.nat: elastic IP deleted",
            "deny|violation||aws_iam_policy.deploy changes in phase maintenance",
            r#"warn|warn||aws_instance.worker["b"] has nothing to do"#,
        ])
    );
    let (_, found, _) = run("conftest_plan_v0.rego", Source::Terraform, Admission::Update);
    assert_eq!(
        found,
        sorted(&[
            "deny|deny||aws_db_instance.main: database replaced",
            "warn|warn||aws_iam_policy.deploy: arn known after apply",
            "warn|warn||aws_s3_bucket.logs: arn known after apply",
        ])
    );
    let (_, found, errors) = run("conftest_suffixed.rego", Source::Terraform, Admission::Update);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        found,
        sorted(&[
            "deny|deny_open_ssh||aws_security_group.web opens ssh",
            "warn|warn_unnamed_bucket||aws_s3_bucket.logs: a versioned bucket name",
        ])
    );
    let (_, found, _) = run("conftest_manifest.rego", Source::Kubernetes, Admission::Update);
    assert_eq!(
        found,
        sorted(&[
            "deny|deny|Deployment/shop/api|api needs at least 2 replicas",
            "warn|warn|Ingress/shop/web|web is a public ingress",
        ])
    );
}

#[test]
fn a_policy_that_would_not_be_evaluated_denies_with_its_reason() {
    for (file, code, says) in [
        (
            "unknown_package.rego",
            codes::UNRECOGNISED,
            "package acme.guardrails is not one the runner queries",
        ),
        ("no_queried_rule.rego", codes::UNRECOGNISED, "defines none of deny, warn, pass"),
        ("network_call.rego", codes::LOAD_ERROR, "calls http.send"),
        ("syntax_error.rego", codes::LOAD_ERROR, "does not load"),
        ("conflict_error.rego", codes::EVAL_ERROR, "conflicts"),
        ("bad_items.rego", codes::EVAL_ERROR, "an item is a number"),
    ] {
        let (verdict, found, errors) = run(file, Source::Terraform, Admission::Update);
        assert_eq!(verdict, Verdict::Deny, "{file}");
        assert!(found.is_empty(), "{file}: {found:?}");
        assert_eq!(errors.len(), 1, "{file}: {errors:?}");
        assert_eq!(errors[0].code, code, "{file}: {errors:?}");
        assert!(errors[0].reason.contains(says), "{file}: {}", errors[0].reason);
        assert_eq!(errors[0].policy, format!("vendor/{file}"));
    }
}

#[test]
fn pass_rules_are_recorded_and_never_decide() {
    let (verdict, found, errors) = run("nuon_pass_only.rego", Source::Terraform, Admission::Update);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(verdict, Verdict::Allow);
    assert_eq!(found, sorted(&["pass|pass||aws_s3_bucket.logs has an owner"]));
    let (verdict, found, _) = run("nuon_pass_only.rego", Source::Kubernetes, Admission::Update);
    assert_eq!(verdict, Verdict::Allow);
    assert_eq!(found, sorted(&["pass|pass|api|deployment api was reviewed"]));
    // Beside a denial, a pass changes nothing: the plan is still denied.
    let (verdict, found, _) = run("nuon_review_cpu.rego", Source::Kubernetes, Admission::Update);
    assert_eq!(verdict, Verdict::Deny);
    assert_eq!(found, sorted(&["deny|deny|Deployment/shop/api|api asks for 2 cores"]));
}

#[test]
fn some_in_over_a_string_or_null_is_false_as_in_opa() {
    // plan_mixed's IAM document gives `Action` as the string "*", and resources
    // without tags or CIDR lists: no evaluation error, the same findings OPA gives.
    let (verdict, found, errors) = run("nuon_scalar_collections.rego", Source::Terraform, Admission::Update);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(verdict, Verdict::Deny);
    assert!(found.contains(&"deny|deny||a statement allows every action".to_string()), "{found:?}");
    assert!(!found.iter().any(|f| f.contains("(in a list)")), "{found:?}");
    assert!(
        found.contains(&"warn|warn||aws_security_group.web is open to the world".to_string()),
        "{found:?}"
    );
}

#[test]
fn cpu_quantities_read_as_opa_reads_them() {
    let policy = vendor("nuon_review_cpu.rego");
    // One Deployment whose container's CPU limit is `cpu`, decided by the policy.
    let decide = |cpu: &str| {
        let obj = serde_json::json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "w", "namespace": "shop"},
            "spec": {"template": {"spec": {"containers": [{"name": "w", "resources": {"limits": {"cpu": cpu}}}]}}}});
        let bytes = serde_json::to_vec(&[obj]).unwrap();
        let doc = parse_document(Source::Kubernetes, &bytes, &Limits::default()).unwrap();
        let ctx = ctx(Source::Kubernetes, Admission::Update);
        evaluate(
            std::slice::from_ref(&policy),
            &serde_json::json!({}),
            &ctx,
            &doc,
            &bytes,
            &Limits::default(),
        )
    };
    for (cpu, expect) in [
        (".25", "pass|pass|Deployment/shop/w|w fits in one core"),
        ("+1.", "pass|pass|Deployment/shop/w|w fits in one core"),
        ("1_500m", "deny|deny|Deployment/shop/w|w asks for 1.5 cores"),
        ("0x1p1", "deny|deny|Deployment/shop/w|w asks for 2 cores"),
    ] {
        let d = decide(cpu);
        assert!(d.errors.is_empty(), "{cpu}: {:?}", d.errors);
        let f = d
            .violations
            .iter()
            .map(|f| ("deny", f))
            .chain(d.passes.iter().map(|f| ("pass", f)))
            .next()
            .unwrap();
        assert_eq!(format!("{}|{}|{}|{}", f.0, f.1.from_rule, f.1.address, f.1.message), expect, "{cpu}");
    }
    // What Go's ParseFloat refuses fails the policy (and so denies), as in OPA.
    for cpu in ["Inf", "NaN", " 1", "1e400", "1__0", "0x10", "."] {
        let d = decide(cpu);
        assert_eq!(d.verdict, Verdict::Deny, "{cpu}");
        assert_eq!(d.errors.len(), 1, "{cpu}: {d:?}");
    }
}

#[test]
fn an_advisory_policy_that_is_broken_still_denies() {
    let p = Policy { enforcement: Enforcement::Advisory, ..vendor("unknown_package.rego") };
    let bytes = fixture("plan_mixed.json").into_bytes();
    let doc = parse_document(Source::Terraform, &bytes, &Limits::default()).unwrap();
    let d = evaluate(
        &[p],
        &serde_json::json!({}),
        &ctx(Source::Terraform, Admission::Update),
        &doc,
        &bytes,
        &Limits::default(),
    );
    assert_eq!(d.verdict, Verdict::Deny);
    assert_eq!(d.errors[0].code, codes::UNRECOGNISED);
}

#[test]
fn deletions_are_judged_only_by_policies_that_know_the_operation() {
    let objects = yaml_objects(&fixture("manifests.yaml"));
    let bytes = serde_json::to_vec(&objects).unwrap();
    let doc = parse_document(Source::Kubernetes, &bytes, &Limits::default()).unwrap();
    let mut policies = builtin_pack();
    policies.push(vendor("conftest_manifest.rego"));
    // On an apply the pack and conftest find plenty (a public LoadBalancer, no limits,
    // one replica) ...
    let apply = evaluate(
        &policies,
        &serde_json::json!({}),
        &ctx(Source::Kubernetes, Admission::Update),
        &doc,
        &bytes,
        &Limits::default(),
    );
    assert_eq!(apply.verdict, Verdict::Deny);
    // ... but deleting those objects deploys nothing they judge.
    let delete = evaluate(
        &policies,
        &serde_json::json!({}),
        &ctx(Source::Kubernetes, Admission::Delete),
        &doc,
        &bytes,
        &Limits::default(),
    );
    assert_eq!(delete.verdict, Verdict::Allow, "{delete:#?}");
    assert!(delete.violations.is_empty() && delete.warnings.is_empty() && delete.errors.is_empty());
}
