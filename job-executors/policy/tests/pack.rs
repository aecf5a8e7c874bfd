//! The built-in pack: every rule with passing and failing fixtures in the real formats
//! (`terraform show -json` plan format 1.2, Kubernetes manifests).
#![allow(clippy::unwrap_used)]

use byoc_policy::*;
use serde_json::{Value, json};

fn plan(changes: Vec<Value>) -> Document {
    plan_with_config(changes, json!({"root_module": {"resources": []}}))
}

fn plan_with_config(changes: Vec<Value>, configuration: Value) -> Document {
    Document::plan(json!({
        "format_version": "1.2",
        "terraform_version": "1.9.5",
        "resource_changes": changes,
        "configuration": configuration,
    }))
}

fn rc(address: &str, actions: &[&str], after: Value) -> Value {
    rc_unknown(address, actions, after, json!({}))
}

fn rc_unknown(address: &str, actions: &[&str], after: Value, after_unknown: Value) -> Value {
    let (ty, name) = address.rsplit_once('.').map(|(t, n)| (t.rsplit('.').next().unwrap(), n)).unwrap();
    json!({
        "address": address, "mode": "managed", "type": ty, "name": name,
        "provider_name": "registry.terraform.io/hashicorp/aws",
        "change": {"actions": actions, "before": null, "after": after, "after_unknown": after_unknown,
                   "before_sensitive": false, "after_sensitive": {}}
    })
}

fn manifests(ms: Vec<Value>) -> Document {
    Document::manifests(ms)
}

fn deployment(name: &str, containers: Value) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "app"},
           "spec": {"template": {"spec": {"containers": containers}}}})
}

fn limited(name: &str, image: &str) -> Value {
    json!({"name": name, "image": image, "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}}})
}

fn decide(doc: &Document, phase: &str, params: Value) -> Decision {
    let source = match doc {
        Document::Plan(_) => Source::Terraform,
        Document::Manifests(_) => Source::Kubernetes,
    };
    let ctx = Context {
        source,
        phase: phase.into(),
        operation: "component.deploy".into(),
        install: "inst-1".into(),
        admission: Default::default(),
        context: Default::default(),
        drift: false,
    };
    evaluate(&builtin_pack(), &params, &ctx, doc, b"fixture", &Limits::default())
}

/// The rule's violations (asserting nothing else failed to evaluate).
fn hits(rule: &str, doc: Document, phase: &str, params: Value) -> Vec<Finding> {
    let d = decide(&doc, phase, params);
    assert!(d.errors.is_empty(), "{:?}", d.errors);
    d.violations.into_iter().filter(|v| v.rule == rule).collect()
}

fn fails(rule: &str, doc: Document, phase: &str, params: Value, address: &str) {
    let h = hits(rule, doc, phase, params);
    assert!(h.iter().any(|v| v.address == address), "{rule}: expected a violation at {address}, got {h:#?}");
}

fn passes(rule: &str, doc: Document, phase: &str, params: Value) {
    let h = hits(rule, doc, phase, params);
    assert!(h.is_empty(), "{rule}: expected no violation, got {h:#?}");
}

const NO: fn() -> Value = || json!({});

#[test]
fn database_protection() {
    let r = "database_protection";
    let db = "aws_db_instance.main";
    fails(r, plan(vec![rc(db, &["delete", "create"], json!({}))]), "maintenance", NO(), db);
    fails(
        r,
        plan(vec![rc("aws_rds_cluster.c", &["create", "delete"], json!({}))]),
        "provision",
        NO(),
        "aws_rds_cluster.c",
    );
    fails(
        r,
        plan(vec![rc("module.data.aws_dynamodb_table.t", &["delete"], json!(null))]),
        "maintenance",
        NO(),
        "module.data.aws_dynamodb_table.t",
    );
    // Replacing during deprovision is still refused.
    fails(r, plan(vec![rc(db, &["delete", "create"], json!({}))]), "deprovision", NO(), db);
    passes(r, plan(vec![rc(db, &["update"], json!({"allocated_storage": 50}))]), "maintenance", NO());
    passes(r, plan(vec![rc(db, &["delete"], json!(null))]), "deprovision", NO());
    passes(r, plan(vec![rc("aws_s3_bucket.logs", &["delete", "create"], json!({}))]), "maintenance", NO());
    passes(r, plan(vec![rc(db, &["create"], json!({"storage_encrypted": true}))]), "provision", NO());
}

#[test]
fn public_ingress() {
    let r = "public_ingress";
    let sg = "aws_security_group.web";
    let open = json!({"ingress": [{"from_port": 443, "to_port": 443, "protocol": "tcp", "cidr_blocks": ["0.0.0.0/0"], "ipv6_cidr_blocks": []}]});
    fails(r, plan(vec![rc(sg, &["create"], open)]), "provision", NO(), sg);
    let v6 = json!({"ingress": [{"cidr_blocks": [], "ipv6_cidr_blocks": ["::/0"]}]});
    fails(r, plan(vec![rc(sg, &["update"], v6)]), "maintenance", NO(), sg);
    // A CIDR unknown until apply counts as open.
    let unknown = rc_unknown(
        "aws_security_group_rule.in",
        &["create"],
        json!({"type": "ingress"}),
        json!({"cidr_blocks": true}),
    );
    fails(r, plan(vec![unknown]), "provision", NO(), "aws_security_group_rule.in");
    let v2 = rc("aws_vpc_security_group_ingress_rule.any", &["create"], json!({"cidr_ipv4": "0.0.0.0/0"}));
    fails(r, plan(vec![v2]), "provision", NO(), "aws_vpc_security_group_ingress_rule.any");
    let ing = json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "web", "namespace": "app"}, "spec": {}});
    fails(r, manifests(vec![ing]), "maintenance", NO(), "Ingress/app/web");
    let lb = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api"}, "spec": {"type": "LoadBalancer"}});
    fails(r, manifests(vec![lb]), "maintenance", NO(), "Service/default/api");

    let private = json!({"ingress": [{"cidr_blocks": ["10.0.0.0/8"], "ipv6_cidr_blocks": []}]});
    passes(r, plan(vec![rc(sg, &["create"], private)]), "provision", NO());
    passes(
        r,
        plan(vec![rc(
            "aws_security_group_rule.out",
            &["create"],
            json!({"type": "egress", "cidr_blocks": ["0.0.0.0/0"]}),
        )]),
        "provision",
        NO(),
    );
    let internal = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api", "annotations": {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"}}, "spec": {"type": "LoadBalancer"}});
    let cluster_ip = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "db"}, "spec": {"type": "ClusterIP"}});
    passes(r, manifests(vec![internal, cluster_ip]), "maintenance", NO());
    // Deleting an open group adds no ingress.
    passes(r, plan(vec![rc(sg, &["delete"], json!(null))]), "deprovision", NO());
}

#[test]
fn container_limits() {
    let r = "container_limits";
    fails(
        r,
        manifests(vec![deployment("api", json!([{"name": "api", "image": "x"}]))]),
        "maintenance",
        NO(),
        "Deployment/app/api",
    );
    let cpu_only = json!([{"name": "api", "image": "x", "resources": {"limits": {"cpu": "1"}}}]);
    fails(r, manifests(vec![deployment("api", cpu_only)]), "maintenance", NO(), "Deployment/app/api");
    let cron = json!({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "nightly", "namespace": "ops"},
        "spec": {"jobTemplate": {"spec": {"template": {"spec": {"containers": [limited("a", "x")], "initContainers": [{"name": "init", "image": "x"}]}}}}}});
    fails(r, manifests(vec![cron]), "maintenance", NO(), "CronJob/ops/nightly");

    passes(
        r,
        manifests(vec![deployment("api", json!([limited("api", "x"), limited("sidecar", "y")]))]),
        "maintenance",
        NO(),
    );
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [limited("c", "x")]}});
    passes(r, manifests(vec![pod]), "maintenance", NO());
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {}});
    passes(r, manifests(vec![cm]), "maintenance", NO());
}

#[test]
fn storage_encryption() {
    let r = "storage_encryption";
    fails(
        r,
        plan(vec![rc("aws_ebs_volume.data", &["create"], json!({"encrypted": false, "size": 100}))]),
        "provision",
        NO(),
        "aws_ebs_volume.data",
    );
    let unknown =
        rc_unknown("aws_db_instance.main", &["create"], json!({}), json!({"storage_encrypted": true}));
    fails(r, plan(vec![unknown]), "provision", NO(), "aws_db_instance.main");
    fails(
        r,
        plan(vec![rc("aws_s3_bucket.logs", &["create"], json!({"bucket": "logs"}))]),
        "provision",
        NO(),
        "aws_s3_bucket.logs",
    );
    fails(
        r,
        plan(vec![rc("aws_rds_cluster.c", &["create"], json!({"engine": "aurora-postgresql"}))]),
        "provision",
        NO(),
        "aws_rds_cluster.c",
    );

    passes(
        r,
        plan(vec![rc("aws_ebs_volume.data", &["create"], json!({"encrypted": true}))]),
        "provision",
        NO(),
    );
    passes(
        r,
        plan(vec![rc("aws_db_instance.main", &["create"], json!({"storage_encrypted": true}))]),
        "provision",
        NO(),
    );
    let with_sse = plan_with_config(
        vec![
            rc("aws_s3_bucket.logs", &["create"], json!({"bucket": "logs"})),
            rc("aws_s3_bucket_server_side_encryption_configuration.logs", &["create"], json!({})),
        ],
        json!({"root_module": {"resources": [
            {"address": "aws_s3_bucket_server_side_encryption_configuration.logs", "type": "aws_s3_bucket_server_side_encryption_configuration",
             "expressions": {"bucket": {"references": ["aws_s3_bucket.logs.id", "aws_s3_bucket.logs"]}}}
        ]}}),
    );
    passes(r, with_sse, "provision", NO());
}

#[test]
fn approved_registries() {
    let r = "approved_registries";
    let ecr = json!({"approved_registries": ["123456789012.dkr.ecr.eu-west-1.amazonaws.com/"]});
    let ok_image = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/acme/api@sha256:ab";
    fails(
        r,
        manifests(vec![deployment("api", json!([limited("api", "docker.io/library/nginx:1.27")]))]),
        "maintenance",
        ecr.clone(),
        "Deployment/app/api",
    );
    fails(
        r,
        manifests(vec![deployment(
            "api",
            json!([limited("api", ok_image), limited("proxy", "quay.io/x/y:1")]),
        )]),
        "maintenance",
        ecr.clone(),
        "Deployment/app/api",
    );
    // A look-alike host is not the approved registry.
    fails(
        r,
        manifests(vec![deployment(
            "api",
            json!([limited("api", "123456789012.dkr.ecr.eu-west-1.amazonaws.com.evil.io/x")]),
        )]),
        "maintenance",
        ecr.clone(),
        "Deployment/app/api",
    );

    passes(
        r,
        manifests(vec![deployment("api", json!([limited("api", ok_image)]))]),
        "maintenance",
        ecr.clone(),
    );
    passes(
        r,
        manifests(vec![json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}})]),
        "maintenance",
        ecr,
    );
    // Not configured: inactive.
    passes(
        r,
        manifests(vec![deployment("api", json!([limited("api", "docker.io/x")]))]),
        "maintenance",
        NO(),
    );
}

#[test]
fn required_tags() {
    let r = "required_tags";
    let need = json!({"required_tags": ["owner", "cost-center"]});
    fails(
        r,
        plan(vec![rc(
            "aws_s3_bucket.b",
            &["create"],
            json!({"tags": {"owner": "x"}, "tags_all": {"owner": "x"}}),
        )]),
        "provision",
        need.clone(),
        "aws_s3_bucket.b",
    );
    fails(
        r,
        plan(vec![rc("aws_instance.i", &["update"], json!({"tags": null, "tags_all": {}}))]),
        "maintenance",
        need.clone(),
        "aws_instance.i",
    );
    fails(
        r,
        plan(vec![rc("aws_sqs_queue.q", &["create"], json!({"tags": {}}))]),
        "provision",
        need.clone(),
        "aws_sqs_queue.q",
    );

    let tagged = json!({"owner": "team-a", "cost-center": "42"});
    passes(
        r,
        plan(vec![rc("aws_s3_bucket.b", &["create"], json!({"tags": {}, "tags_all": tagged}))]),
        "provision",
        need.clone(),
    );
    // Untaggable resources and deletions are out of scope.
    passes(
        r,
        plan(vec![rc("aws_iam_role_policy_attachment.a", &["create"], json!({"role": "r"}))]),
        "provision",
        need.clone(),
    );
    passes(r, plan(vec![rc("aws_s3_bucket.old", &["delete"], json!(null))]), "deprovision", need);
}

#[test]
fn iam_in_maintenance() {
    let r = "iam_in_maintenance";
    fails(
        r,
        plan(vec![rc("aws_iam_role.new", &["create"], json!({"name": "new"}))]),
        "maintenance",
        NO(),
        "aws_iam_role.new",
    );
    fails(
        r,
        plan(vec![rc("aws_iam_policy.p", &["update"], json!({}))]),
        "maintenance",
        NO(),
        "aws_iam_policy.p",
    );
    fails(
        r,
        plan(vec![rc("module.x.aws_iam_role_policy_attachment.a", &["create"], json!({}))]),
        "maintenance",
        NO(),
        "module.x.aws_iam_role_policy_attachment.a",
    );

    passes(r, plan(vec![rc("aws_iam_role.new", &["create"], json!({}))]), "provision", NO());
    passes(r, plan(vec![rc("aws_iam_role.old", &["delete"], json!(null))]), "maintenance", NO());
    passes(r, plan(vec![rc("aws_s3_bucket.b", &["create"], json!({}))]), "maintenance", NO());
}
