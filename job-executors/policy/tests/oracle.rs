//! The real OPA as an oracle: for every policy of `tests/conventions/` in both
//! conventions, over the fixture plan and manifests (each admission operation) and over
//! generated plans and manifests, byoc-policy's findings — the verdict and the messages
//! of each rule — equal what OPA (PyPI's opa-golib-python-bindings, installed into the
//! project's .venv by scripts/setup) evaluates over the very same inputs. Where OPA
//! reports an evaluation error, byoc-policy denies.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;

use byoc_policy::*;
use serde_json::{Value, json};

fn conventions_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/conventions")
}

fn yaml_objects(text: &str) -> Vec<Value> {
    use serde::Deserialize as _;
    serde_norway::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// A small deterministic generator (no dependency, same inputs every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[(self.next() as usize) % xs.len()]
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

fn generated_plan(seed: u64, n: usize) -> Value {
    let mut r = Lcg(seed);
    let types = [
        "aws_eip",
        "aws_db_instance",
        "aws_s3_bucket",
        "aws_security_group",
        "aws_iam_policy",
        "aws_instance",
    ];
    let actions: [&[&str]; 6] =
        [&["create"], &["update"], &["delete"], &["delete", "create"], &["create", "delete"], &["no-op"]];
    let mut changes = Vec::new();
    for i in 0..n {
        let ty = *r.pick(&types);
        let act = *r.pick(&actions);
        let mut tags = serde_json::Map::new();
        for t in ["owner", "cost-center", "team"] {
            if r.chance(50) {
                tags.insert(t.into(), json!(format!("{t}-{}", r.next() % 7)));
            }
        }
        // Providers leave unset attributes null: `tags` among them.
        let mut after = if r.chance(15) { json!({"tags": null}) } else { json!({"tags": tags}) };
        match ty {
            "aws_db_instance" => {
                after["allocated_storage"] = json!(20 + (r.next() % 200));
                after["storage_encrypted"] = json!(r.chance(70));
            }
            "aws_s3_bucket" => {
                after["bucket"] = json!(format!(
                    "{}bucket-{i}{}",
                    if r.chance(60) { "acme-" } else { "" },
                    if r.chance(30) { "-v2" } else { "" }
                ));
            }
            "aws_security_group" => {
                let cidr = *r.pick(&["10.0.0.0/8", "0.0.0.0/0", "192.168.0.0/16"]);
                let cidrs = if r.chance(20) { Value::Null } else { json!([cidr]) };
                after["ingress"] = json!([{"cidr_blocks": cidrs, "from_port": *r.pick(&[22, 443, 5432])}]);
            }
            "aws_iam_policy" => {
                // IAM takes an action as a string or a list of strings.
                let action = r
                    .pick(&[json!("*"), json!("s3:GetObject"), json!(["s3:*", "*"]), json!(["s3:GetObject"])])
                    .clone();
                after["name"] = json!(format!("p{i}"));
                after["policy"] = json!(
                    json!({"Statement": [{"Effect": "Allow", "Action": action, "Resource": "*"}]})
                        .to_string()
                );
            }
            "aws_instance" => after["instance_type"] = json!(*r.pick(&["t3.large", "m5.large", "t3.micro"])),
            _ => {}
        }
        let before = if act.contains(&"create") && act.len() == 1 {
            Value::Null
        } else {
            json!({"allocated_storage": 20 + (r.next() % 50)})
        };
        let mut unknown = serde_json::Map::new();
        if r.chance(30) {
            unknown.insert("tags".into(), json!(true));
        }
        if r.chance(40) {
            unknown.insert("arn".into(), json!(true));
        }
        changes.push(json!({
            "address": format!("{ty}.r{i}"), "type": ty, "name": format!("r{i}"),
            "change": {"actions": act, "before": before, "after": if act == ["delete"] { Value::Null } else { after }, "after_unknown": unknown}
        }));
    }
    json!({"format_version": "1.2", "terraform_version": "1.11.4", "resource_changes": changes})
}

fn generated_objects(seed: u64, n: usize) -> Vec<Value> {
    let mut r = Lcg(seed);
    let mut out = Vec::new();
    for i in 0..n {
        let mut meta = json!({"name": format!("o{i}")});
        if r.chance(70) {
            meta["namespace"] = json!(*r.pick(&["shop", "web", "kube-system"]));
        }
        let container = |r: &mut Lcg| {
            let mut c = json!({"name": format!("c{}", r.next() % 9), "image": "registry.example/x:1"});
            if r.chance(60) {
                c["resources"] = json!({"limits": {"memory": *r.pick(&["256Mi", "1024Mi", "2Gi"])}});
                if r.chance(70) {
                    // Every form a CPU quantity takes.
                    c["resources"]["limits"]["cpu"] =
                        json!(*r.pick(&["250m", ".25", "1", "0.5", "2", "1500m", "+1.", "3"]));
                }
            }
            if r.chance(20) {
                c["securityContext"] = json!({"privileged": true});
            }
            c
        };
        let obj = match r.next() % 5 {
            0 => json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                        "spec": {"replicas": r.next() % 4, "template": {"spec": {"containers": [container(&mut r), container(&mut r)]}}}}),
            1 => json!({"apiVersion": "v1", "kind": "Service", "metadata": meta,
                        "spec": {"type": *r.pick(&["ClusterIP", "LoadBalancer", "NodePort"])}}),
            2 => {
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [container(&mut r)]}})
            }
            3 => json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": {}}),
            _ => {
                let mut m = meta;
                if r.chance(50) {
                    m["annotations"] =
                        json!({"kubernetes.io/ingress.class": *r.pick(&["public", "internal"])});
                }
                json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": m, "spec": {}})
            }
        };
        out.push(obj);
    }
    out
}

/// One document to evaluate: a plan, or one object under an admission operation.
struct Case {
    label: String,
    source: Source,
    admission: Admission,
    doc: Value,
}

fn documents() -> Vec<Case> {
    let mut cases = Vec::new();
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(conventions_dir().join("plan_mixed.json")).unwrap())
            .unwrap();
    cases.push(Case {
        label: "plan_mixed".into(),
        source: Source::Terraform,
        admission: Admission::Update,
        doc: plan,
    });
    for seed in 1..=4 {
        cases.push(Case {
            label: format!("generated plan {seed}"),
            source: Source::Terraform,
            admission: Admission::Update,
            doc: generated_plan(seed, 40),
        });
    }
    let fixture = yaml_objects(&std::fs::read_to_string(conventions_dir().join("manifests.yaml")).unwrap());
    let generated = generated_objects(7, 60);
    for (i, obj) in fixture.iter().chain(&generated).enumerate() {
        for admission in [Admission::Create, Admission::Update, Admission::Delete] {
            cases.push(Case {
                label: format!("object {i} {}", admission.as_str()),
                source: Source::Kubernetes,
                admission,
                doc: obj.clone(),
            });
        }
    }
    cases
}

/// An item of a rule's value, as a message (what a finding's message is).
fn message(item: &Value) -> String {
    match item {
        Value::String(s) => s.clone(),
        Value::Object(o) => o
            .get("msg")
            .or_else(|| o.get("message"))
            .and_then(|m| m.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| item.to_string()),
        other => other.to_string(),
    }
}

#[test]
fn findings_equal_opas_for_every_policy_and_input() {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    let probe = std::process::Command::new(&python).args(["-c", "import opa_bindings"]).output();
    assert!(
        probe.as_ref().is_ok_and(|o| o.status.success()),
        "the OPA oracle is missing: run scripts/setup (it installs opa-golib-python-bindings into .venv): {probe:?}"
    );
    let mut policies: Vec<(String, String)> = std::fs::read_dir(conventions_dir())
        .unwrap()
        .filter_map(|e| {
            let p = e.ok()?.path();
            (p.extension()? == "rego").then(|| {
                (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(&p).unwrap())
            })
        })
        .collect();
    // The compatibility corpus's policies (examples/compat/*/policies/*.rego) too.
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/compat");
    for app in std::fs::read_dir(&corpus).unwrap().flatten() {
        for f in std::fs::read_dir(app.path().join("policies")).into_iter().flatten().flatten() {
            let p = f.path();
            if p.extension().is_some_and(|e| e == "rego") {
                let name = format!(
                    "compat-{}-{}",
                    app.file_name().to_string_lossy(),
                    p.file_name().unwrap().to_string_lossy()
                );
                policies.push((name, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    policies.sort();
    assert!(policies.len() >= 14, "{}", policies.len());
    let docs = documents();
    let limits = Limits::default();

    // Ours first, and the request for OPA over the same inputs.
    struct Ours {
        file: String,
        case: usize,
        verdict: Verdict,
        by_rule: BTreeMap<String, Vec<String>>,
        errors: Vec<PolicyError>,
    }
    let mut ours = Vec::new();
    let mut request = Vec::new();
    let mut index = Vec::new();
    for (file, text) in &policies {
        let p = Policy {
            name: format!("vendor/{file}"),
            origin: Origin::Vendor,
            enforcement: Enforcement::Mandatory,
            text: text.clone(),
        };
        let loaded = load(&p, &limits);
        for (ci, c) in docs.iter().enumerate() {
            let ctx = Context {
                source: c.source,
                phase: "maintenance".into(),
                operation: "component.deploy".into(),
                install: "inst-1".into(),
                admission: c.admission,
                context: Default::default(),
                drift: false,
            };
            let doc = if c.source.is_plan() {
                Document::plan(c.doc.clone())
            } else {
                Document::manifests(vec![c.doc.clone()])
            };
            let bytes = serde_json::to_vec(&c.doc).unwrap();
            let d = evaluate(std::slice::from_ref(&p), &json!({}), &ctx, &doc, &bytes, &limits);
            let mut by_rule: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for f in d.violations.iter().chain(&d.warnings).chain(&d.passes) {
                by_rule.entry(f.from_rule.clone()).or_default().push(f.message.clone());
            }
            ours.push(Ours { file: file.clone(), case: ci, verdict: d.verdict, by_rule, errors: d.errors });
            if let Ok(l) = &loaded {
                let inputs: Vec<Value> =
                    inputs_for(l.convention, &doc, &ctx).into_iter().map(|(v, _)| v).collect();
                request.push(json!({
                    "name": file, "policy": text, "package": l.package.trim_start_matches("data."),
                    "rules": l.rules.iter().map(|(r, _)| r.as_str()).collect::<Vec<_>>(), "inputs": inputs
                }));
                index.push(Some(request.len() - 1));
            } else {
                index.push(None);
            }
        }
    }
    let mut child = std::process::Command::new(&python)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/opa_oracle.py"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let body = serde_json::to_vec(&json!({"cases": request})).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&body).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(out.status.success(), "the oracle failed");
    let theirs: Value = serde_json::from_slice(&out.stdout).unwrap();
    let theirs = theirs["cases"].as_array().unwrap();

    let mut compared = 0;
    let mut with_findings = 0;
    let mut mismatches = Vec::new();
    for (o, idx) in ours.iter().zip(&index) {
        let label = format!("{} on {}", o.file, docs[o.case].label);
        let Some(idx) = idx else {
            // Refused before evaluation (unknown package, no queried rule, not Rego):
            // OPA would evaluate nothing either; we deny.
            assert_eq!(o.verdict, Verdict::Deny, "{label}");
            continue;
        };
        if !docs[o.case].source.is_plan()
            && docs[o.case].admission == Admission::Delete
            && !o.file.starts_with("nuon")
            && !o.file.starts_with("compat-")
        {
            // Deletions are decided only by policies that know the operation (nuon);
            // conftest's convention judges what is deployed and is not asked.
            assert!(o.by_rule.is_empty() && o.errors.is_empty(), "{label}: {:?}", o.by_rule);
            continue;
        }
        let t = &theirs[*idx];
        if let Some(e) = t.get("load_error") {
            // OPA 1.x parses Rego v1 only; a v0 policy loads here as conftest would
            // load it (`--rego-version v0`), so there is nothing to compare.
            assert!(o.file.ends_with("_v0.rego"), "{label}: OPA could not load it: {e}");
            continue;
        }
        let results = t["results"].as_array().unwrap();
        assert_eq!(results.len(), 1, "{label}: one input per document");
        let mut opa_error = None;
        let mut opa_by_rule: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for r in results[0].as_array().unwrap() {
            let rule = r["rule"].as_str().unwrap().to_string();
            if let Some(e) = r.get("error") {
                opa_error = Some(e.to_string());
            } else if let Some(v) = r.get("value") {
                let items: Vec<Value> = match v {
                    Value::Array(a) => a.clone(),
                    Value::Bool(false) | Value::Null => vec![],
                    other => vec![other.clone()],
                };
                if !items.is_empty() {
                    opa_by_rule.insert(rule, items.iter().map(message).collect());
                }
            }
        }
        compared += 1;
        if let Some(e) = opa_error {
            if o.errors.is_empty() || o.verdict != Verdict::Deny {
                mismatches.push(format!("{label}: OPA reports an error ({e}) and byoc-policy did not deny"));
            }
            continue;
        }
        if !o.errors.is_empty() {
            // Stricter than OPA only where the nuon convention demands it: items that
            // are neither strings nor objects with `msg`.
            let strict = o.errors.iter().all(|e| e.reason.contains("not a string or an object with `msg`"));
            if !strict {
                mismatches.push(format!("{label}: byoc-policy failed where OPA did not: {:?}", o.errors));
            }
            continue;
        }
        let mut ours_sorted = o.by_rule.clone();
        for v in ours_sorted.values_mut() {
            v.sort();
        }
        for v in opa_by_rule.values_mut() {
            v.sort();
        }
        if !opa_by_rule.is_empty() {
            with_findings += 1;
        }
        if ours_sorted != opa_by_rule {
            mismatches
                .push(format!("{label}:\n  byoc-policy {ours_sorted:?}\n  OPA         {opa_by_rule:?}"));
        }
    }
    assert!(compared > 1000, "only {compared} comparisons");
    assert!(
        with_findings > 200,
        "only {with_findings} comparisons found anything: the inputs do not exercise the policies"
    );
    println!("{compared} comparisons with OPA, {with_findings} with findings, all equal");
    assert!(mismatches.is_empty(), "{} of {compared} differ:\n{}", mismatches.len(), mismatches.join("\n"));
}
