//! The engine: conftest-style policies unchanged, origins and enforcement levels,
//! errors and limits deny, digests in the decision.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use byoc_policy::*;
use serde_json::json;

fn ctx(source: Source, phase: &str) -> Context {
    Context {
        source,
        phase: phase.into(),
        operation: "component.deploy".into(),
        install: "inst-1".into(),
        admission: Admission::Update,
        context: Default::default(),
        drift: false,
    }
}

fn policy(name: &str, origin: Origin, enforcement: Enforcement, text: &str) -> Policy {
    Policy { name: name.into(), origin, enforcement, text: text.into() }
}

fn bucket_plan() -> (Document, Vec<u8>) {
    let v = json!({"format_version": "1.2", "resource_changes": [
        {"address": "aws_s3_bucket.public", "type": "aws_s3_bucket", "name": "public",
         "change": {"actions": ["create"], "after": {"bucket": "public-assets", "acl": "public-read"}, "after_unknown": {}}}
    ]});
    let bytes = serde_json::to_vec(&v).unwrap();
    (parse_document(Source::Terraform, &bytes, &Limits::default()).unwrap(), bytes)
}

/// Written for conftest (old-style rules, `package main`), used as is.
const CONFTEST_NO_PUBLIC_ACL: &str = r#"
package main

deny[msg] {
  rc := input.resource_changes[_]
  rc.type == "aws_s3_bucket"
  rc.change.after.acl == "public-read"
  msg := sprintf("%s must not be public-read", [rc.address])
}

warn[msg] {
  rc := input.resource_changes[_]
  not rc.change.after.tags
  msg := sprintf("%s has no tags", [rc.address])
}
"#;

#[test]
fn conftest_policies_work_unchanged_on_plans() {
    let (doc, bytes) = bucket_plan();
    let p = policy("vendor/s3.rego", Origin::Vendor, Enforcement::Mandatory, CONFTEST_NO_PUBLIC_ACL);
    let d =
        evaluate(&[p], &json!({}), &ctx(Source::Terraform, "provision"), &doc, &bytes, &Limits::default());
    assert_eq!(d.verdict, Verdict::Deny, "{d:#?}");
    assert_eq!(d.violations.len(), 1);
    assert_eq!(d.violations[0].message, "aws_s3_bucket.public must not be public-read");
    assert_eq!(d.violations[0].rule, "s3");
    assert_eq!(d.warnings[0].message, "aws_s3_bucket.public has no tags");
    assert_eq!(
        d.input_digest,
        format!("sha256:{}", hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes)))
    );
    assert!(d.policies[0].digest.starts_with("sha256:"));
}

#[test]
fn conftest_policies_see_each_manifest_as_input() {
    let ms = json!([
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "api"}, "spec": {"replicas": 1}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}, "spec": {"replicas": 3}}
    ]);
    let bytes = serde_json::to_vec(&ms).unwrap();
    let doc = parse_document(Source::Kubernetes, &bytes, &Limits::default()).unwrap();
    let text = r#"
package main
import rego.v1
deny contains msg if {
  input.kind == "Deployment"
  input.spec.replicas < 2
  msg := sprintf("%s needs at least 2 replicas", [input.metadata.name])
}
"#;
    let p = policy("customer/replicas.rego", Origin::Customer, Enforcement::Mandatory, text);
    let d =
        evaluate(&[p], &json!({}), &ctx(Source::Kubernetes, "maintenance"), &doc, &bytes, &Limits::default());
    let msgs: Vec<&str> = d.violations.iter().map(|v| v.message.as_str()).collect();
    assert_eq!(msgs, vec!["api needs at least 2 replicas"]);
}

#[test]
fn a_customer_policy_denies_what_the_vendors_allows() {
    let (doc, bytes) = bucket_plan();
    let vendor_allows = policy(
        "vendor/ok.rego",
        Origin::Vendor,
        Enforcement::Mandatory,
        "package main\ndeny[msg] { false; msg := \"never\" }\n",
    );
    let customer =
        policy("customer/no-public.rego", Origin::Customer, Enforcement::Mandatory, CONFTEST_NO_PUBLIC_ACL);
    let ctx = ctx(Source::Terraform, "provision");
    let d =
        evaluate(std::slice::from_ref(&vendor_allows), &json!({}), &ctx, &doc, &bytes, &Limits::default());
    assert_eq!(d.verdict, Verdict::Allow);
    let d = evaluate(&[vendor_allows, customer], &json!({}), &ctx, &doc, &bytes, &Limits::default());
    assert_eq!(d.verdict, Verdict::Deny);
    assert_eq!(d.violations[0].origin, Origin::Customer);
}

#[test]
fn advisory_policies_warn_and_do_not_deny() {
    let (doc, bytes) = bucket_plan();
    let p = policy("vendor/s3.rego", Origin::Vendor, Enforcement::Advisory, CONFTEST_NO_PUBLIC_ACL);
    let d =
        evaluate(&[p], &json!({}), &ctx(Source::Terraform, "provision"), &doc, &bytes, &Limits::default());
    assert_eq!(d.verdict, Verdict::Allow);
    assert!(d.violations.is_empty());
    assert!(
        d.warnings
            .iter()
            .any(|w| w.message.contains("public-read") && w.enforcement == Enforcement::Advisory)
    );
}

#[test]
fn a_policy_that_errors_or_runs_too_long_denies() {
    let (doc, bytes) = bucket_plan();
    let c = ctx(Source::Terraform, "provision");
    let broken = policy(
        "vendor/broken.rego",
        Origin::Vendor,
        Enforcement::Advisory,
        "package main\ndeny[msg] { msg := \n",
    );
    let d = evaluate(&[broken], &json!({}), &c, &doc, &bytes, &Limits::default());
    assert_eq!(d.verdict, Verdict::Deny, "even an advisory policy that does not load denies");
    assert!(d.errors[0].reason.contains("does not load"), "{:?}", d.errors);

    let runtime = policy(
        "vendor/runtime.rego",
        Origin::Vendor,
        Enforcement::Mandatory,
        "package main\ndeny[msg] { x := input.resource_changes[0].change.after.bucket; msg := sprintf(\"%d\", [x / 0]) }\n",
    );
    let d = evaluate(&[runtime], &json!({}), &c, &doc, &bytes, &Limits::default());
    assert_eq!(d.verdict, Verdict::Deny, "{d:#?}");
    assert!(!d.errors.is_empty(), "{d:#?}");

    let slow = policy(
        "vendor/slow.rego",
        Origin::Vendor,
        Enforcement::Mandatory,
        "package main\nimport rego.v1\ndeny contains msg if { n := count([1 | some i in numbers.range(1, 5000); some j in numbers.range(1, 5000)]); n < 0; msg := \"x\" }\n",
    );
    let limits = Limits { time_per_policy: Duration::from_millis(100), ..Limits::default() };
    let started = std::time::Instant::now();
    let d = evaluate(&[slow], &json!({}), &c, &doc, &bytes, &limits);
    assert_eq!(d.verdict, Verdict::Deny);
    assert!(!d.errors.is_empty());
    assert!(d.errors[0].reason.to_lowercase().contains("time"), "{:?}", d.errors);
    // 25 million iterations would take far longer than the limit allows.
    assert!(started.elapsed() < Duration::from_secs(5), "the limit stopped it: {:?}", started.elapsed());
}

#[test]
fn inputs_are_checked_before_evaluation() {
    let l = Limits { max_input_bytes: 10, ..Limits::default() };
    assert!(
        parse_document(Source::Terraform, b"{\"format_version\": \"1.2\"}", &l)
            .unwrap_err()
            .0
            .contains("limit")
    );
    assert!(
        parse_document(Source::Terraform, b"not json", &Limits::default())
            .unwrap_err()
            .0
            .contains("not JSON")
    );
    assert!(
        parse_document(Source::Terraform, b"{\"a\": 1}", &Limits::default())
            .unwrap_err()
            .0
            .contains("not a terraform plan")
    );
    assert!(
        parse_document(Source::Kubernetes, b"[{\"metadata\": {}}]", &Limits::default())
            .unwrap_err()
            .0
            .contains("kind")
    );
    let list =
        br#"{"apiVersion": "v1", "kind": "List", "items": [{"kind": "ConfigMap"}, {"kind": "Secret"}]}"#;
    match parse_document(Source::Helm, list, &Limits::default()).unwrap() {
        Document::Manifests(m) => assert_eq!(m.len(), 2),
        Document::Plan(_) => panic!("a list of manifests"),
    }
}
