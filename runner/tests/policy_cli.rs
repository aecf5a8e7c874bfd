//! `byoc-runner policy list|test`: the customer's directory, vendor policies, verdicts
//! and exit codes, over the example plans and manifests in `examples/policy/`.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/policy")
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_byoc-runner")).arg("policy").args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn customer_dir(settings: &str, policies: &[(&str, &str)]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("policies.toml"), settings).unwrap();
    for (name, text) in policies {
        std::fs::write(d.path().join(name), text).unwrap();
    }
    d
}

const NO_PUBLIC_BUCKETS: &str = "package main\nimport rego.v1\ndeny contains msg if {\n  rc := input.resource_changes[_]\n  rc.type == \"aws_s3_bucket\"\n  rc.change.after.tags[\"cost-center\"] == \"42\"\n  msg := sprintf(\"%s: cost center 42 is closed\", [rc.address])\n}\n";

#[test]
fn list_shows_the_pack_at_the_customers_levels_and_their_policies() {
    let d = customer_dir(
        "[params]\nrequired_tags = [\"owner\"]\n[builtin]\nrequired_tags = \"advisory\"\ncontainer_limits = \"off\"\n[enforcement]\n\"buckets.rego\" = \"advisory\"\n",
        &[("buckets.rego", NO_PUBLIC_BUCKETS)],
    );
    let (code, out, err) = run(&["list", "--policies", d.path().to_str().unwrap(), "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let builtin = v["builtin"].as_array().unwrap();
    assert_eq!(builtin.len(), 6);
    let tags = builtin.iter().find(|p| p["name"] == "builtin/required_tags").unwrap();
    assert_eq!(tags["enforcement"], "advisory");
    assert!(tags["description"].as_str().unwrap().contains("required tags"));
    assert_eq!(v["builtin_off"][0], "container_limits");
    assert_eq!(v["customer"][0]["name"], "customer/buckets.rego");
    assert_eq!(v["customer"][0]["enforcement"], "advisory");
    assert_eq!(v["params"]["required_tags"][0], "owner");
    let (code, out, _) = run(&["list", "--policies", d.path().to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(
        out.contains("builtin/public_ingress")
            && out.contains("customer/buckets.rego")
            && out.contains("off"),
        "{out}"
    );
}

#[test]
fn test_prints_violations_and_the_verdict_and_exits_by_it() {
    let empty = tempfile::tempdir().unwrap();
    let plan = examples().join("plan-open-ingress.json");
    let (code, out, err) =
        run(&["test", "--input", plan.to_str().unwrap(), "--policies", empty.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains(
            "DENY  builtin/public_ingress (builtin, mandatory) [public_ingress] aws_security_group.web"
        ),
        "{out}"
    );
    assert!(
        out.contains("DENY  builtin/database_protection (builtin, mandatory) [database_protection] aws_db_instance.main"),
        "{out}"
    );
    assert!(out.contains(": DENY ("), "{out}");
    let (code, out, _) = run(&[
        "test",
        "--input",
        plan.to_str().unwrap(),
        "--policies",
        empty.path().to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(code, 1);
    let d: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(d["verdict"], "deny");
    assert_eq!(d["violations"].as_array().unwrap().len(), 2);
    assert!(d["input_digest"].as_str().unwrap().starts_with("sha256:"));

    // Allowed: exit 0. Then the customer's own policy denies what everything else allows.
    let tags = examples().join("plan-tags-only.json");
    let (code, out, _) =
        run(&["test", "--input", tags.to_str().unwrap(), "--policies", empty.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(": ALLOW ("), "{out}");
    let strict = customer_dir("", &[("buckets.rego", NO_PUBLIC_BUCKETS)]);
    let (code, out, _) =
        run(&["test", "--input", tags.to_str().unwrap(), "--policies", strict.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("DENY  customer/buckets.rego") && out.contains("cost center 42 is closed"), "{out}");
}

#[test]
fn vendor_policies_and_manifests() {
    let empty = tempfile::tempdir().unwrap();
    let ms = examples().join("manifests.json");
    let vendor = examples().join("require-replicas.rego");
    let (code, out, _) = run(&[
        "test",
        "--input",
        ms.to_str().unwrap(),
        "--policies",
        empty.path().to_str().unwrap(),
        "--vendor-policy",
        vendor.to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(code, 1);
    let d: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rules: Vec<&str> =
        d["violations"].as_array().unwrap().iter().map(|v| v["rule"].as_str().unwrap()).collect();
    assert!(rules.contains(&"require-replicas"), "{rules:?}");
    assert!(rules.contains(&"public_ingress"), "{rules:?}");
    assert!(rules.contains(&"container_limits"), "{rules:?}");
}

#[test]
fn bad_directories_and_inputs_are_usage_errors() {
    let bad = customer_dir("[builtin]\nno_such_rule = \"off\"\nrequired_tags = \"sometimes\"\n", &[]);
    let (code, _, err) = run(&["list", "--policies", bad.path().to_str().unwrap()]);
    assert_eq!(code, 64);
    assert!(err.contains("no_such_rule") && err.contains("sometimes"), "{err}");
    let empty = tempfile::tempdir().unwrap();
    let junk = empty.path().join("junk.json");
    std::fs::write(&junk, "not json").unwrap();
    let (code, _, err) =
        run(&["test", "--input", junk.to_str().unwrap(), "--policies", empty.path().to_str().unwrap()]);
    assert_eq!(code, 64);
    assert!(err.contains("not JSON"), "{err}");
    let (code, _, err) = run(&["test", "--input", "/nonexistent.json", "--source", "cloudformation"]);
    assert_eq!(code, 64, "{err}");
}

#[test]
fn rendered_yaml_is_tested_and_the_evaluator_has_a_memory_limit() {
    let d = tempfile::tempdir().unwrap();
    let yaml = d.path().join("rendered.yaml");
    std::fs::write(
        &yaml,
        "---\n# Source: api/templates/service.yaml\napiVersion: v1\nkind: Service\nmetadata:\n  name: api\n  namespace: acme\nspec:\n  type: LoadBalancer\n",
    )
    .unwrap();
    let (code, out, err) =
        run(&["test", "--input", yaml.to_str().unwrap(), "--policies", d.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("DENY  builtin/public_ingress (builtin, mandatory) [public_ingress] Service/acme/api"),
        "{out}"
    );

    let hungry = d.path().join("hungry.rego");
    std::fs::write(
        &hungry,
        "package main\nimport rego.v1\ndeny contains msg if {\n  xs := [sprintf(\"%d-padding-padding\", [i]) | some i in numbers.range(1, 50000000)]\n  count(xs) < 0\n  msg := \"never\"\n}\n",
    )
    .unwrap();
    let plan = examples().join("plan-tags-only.json");
    let (code, out, err) = run(&[
        "test",
        "--input",
        plan.to_str().unwrap(),
        "--policies",
        d.path().to_str().unwrap(),
        "--vendor-policy",
        hungry.to_str().unwrap(),
        "--memory-mib",
        "256",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("256 MiB memory limit"), "{out}");
}

/// The evaluator that runs vendor Rego for jobs gives itself a network namespace of its
/// own before it reads anything: no interface but a loopback that is down, no route.
#[test]
fn the_policy_evaluator_runs_without_any_network() {
    use std::io::Write as _;
    let mut child = Command::new(env!("CARGO_BIN_EXE_byoc-runner"))
        .args(["policy-eval", "--memory-mib", "512"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
    // It isolates itself first, then blocks reading its request: wait (bounded) for it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let theirs = loop {
        let ns = std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
        if ns != ours || std::time::Instant::now() > deadline {
            break ns;
        }
        std::thread::yield_now();
    };
    assert_ne!(theirs, ours, "the evaluator shares the runner's network namespace");
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let ifaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(ifaces, ["lo"], "{dev}");
    let routes = std::fs::read_to_string(format!("/proc/{pid}/net/route")).unwrap();
    assert!(routes.lines().nth(1).is_none(), "no IPv4 route at all: {routes}");
    // And it still decides.
    let req = byoc_policy::EvalRequest {
        policies: vec![],
        params: serde_json::json!({}),
        context: byoc_policy::Context {
            source: byoc_policy::Source::Terraform,
            phase: "maintenance".into(),
            operation: "component.deploy".into(),
            install: "inst-1".into(),
            admission: Default::default(),
            context: Default::default(),
            drift: false,
        },
        input: r#"{"resource_changes": []}"#.into(),
        time_per_policy_ms: 5000,
        max_input_bytes: 1 << 20,
    };
    child.stdin.take().unwrap().write_all(&serde_json::to_vec(&req).unwrap()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let decision: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(decision.is_object(), "{decision}");
}

/// The report that opened issue 14: a `package nuon` vendor policy over a plan that
/// deletes an elastic IP must deny (it printed ALLOW before).
#[test]
fn a_nuon_vendor_policy_decides_as_written() {
    let empty = tempfile::tempdir().unwrap();
    let plan = examples().join("plan-deletes-eip.json");
    let nuon = examples().join("nuon/no-eip-delete.rego");
    let (code, out, err) = run(&[
        "test",
        "--input",
        plan.to_str().unwrap(),
        "--policies",
        empty.path().to_str().unwrap(),
        "--vendor-policy",
        nuon.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("DENY  vendor/no-eip-delete.rego (nuon, mandatory) [no-eip-delete] -: aws_eip.nat: elastic IP deleted"),
        "{out}"
    );
}

#[test]
fn a_policy_in_a_package_no_convention_queries_denies_and_says_so() {
    let d = tempfile::tempdir().unwrap();
    let plan = examples().join("plan-tags-only.json");
    let unknown = d.path().join("guardrails.rego");
    std::fs::write(&unknown, "package acme.guardrails\nimport rego.v1\ndeny contains \"x\" if true\n")
        .unwrap();
    // As a customer's advisory policy too: a broken policy is never quiet.
    let customer = customer_dir(
        "[enforcement]\n\"quiet.rego\" = \"advisory\"\n",
        &[("quiet.rego", "package nuon\nimport rego.v1\nallow if true\n")],
    );
    let (code, out, _) = run(&[
        "test",
        "--input",
        plan.to_str().unwrap(),
        "--policies",
        customer.path().to_str().unwrap(),
        "--vendor-policy",
        unknown.to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(code, 1, "{out}");
    let d: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(d["verdict"], "deny");
    let errors = d["errors"].as_array().unwrap();
    let by_policy =
        |name: &str| errors.iter().find(|e| e["policy"] == name).unwrap_or_else(|| panic!("{name}: {d}"));
    assert_eq!(by_policy("vendor/guardrails.rego")["code"], "policy_unrecognised");
    assert!(
        by_policy("vendor/guardrails.rego")["reason"].as_str().unwrap().contains("package acme.guardrails")
    );
    assert_eq!(by_policy("customer/quiet.rego")["code"], "policy_unrecognised");
}

#[test]
fn pass_rules_are_shown_and_a_network_call_is_refused_at_load() {
    let empty = tempfile::tempdir().unwrap();
    let d = tempfile::tempdir().unwrap();
    let plan = examples().join("plan-tags-only.json");
    let passing = d.path().join("checked.rego");
    std::fs::write(
        &passing,
        "package nuon\nimport rego.v1\npass contains msg if {\n  some rc in input.plan.resource_changes\n  msg := sprintf(\"%s was checked\", [rc.address])\n}\n",
    )
    .unwrap();
    let calling = d.path().join("calls-home.rego");
    std::fs::write(
        &calling,
        "package nuon\nimport rego.v1\nok := http.send({\"method\": \"get\", \"url\": \"http://127.0.0.1:9/\"})\ndeny contains \"no\" if not ok\n",
    )
    .unwrap();
    let test = |policy: &std::path::Path, json: bool| {
        let mut args = vec![
            "test",
            "--input",
            plan.to_str().unwrap(),
            "--policies",
            empty.path().to_str().unwrap(),
            "--vendor-policy",
            policy.to_str().unwrap(),
        ];
        if json {
            args.extend(["--output", "json"]);
        }
        run(&args)
    };
    let (code, out, err) = test(&passing, false);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(
            "PASS  vendor/checked.rego (nuon, informational) [checked] -: aws_s3_bucket.assets was checked"
        ),
        "{out}"
    );
    assert!(out.contains(", 0 violations, 0 warnings, 1 passed, 0 errors: ALLOW"), "{out}");
    let (_, out, _) = test(&passing, true);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["passes"][0]["from_rule"], "pass", "{v}");
    assert_eq!(v["verdict"], "allow");

    let (code, out, err) = test(&calling, false);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("ERROR vendor/calls-home.rego [policy_load_error]: calls http.send"), "{out}");
}

#[test]
fn manifests_are_reviewed_under_the_operation_given() {
    let empty = tempfile::tempdir().unwrap();
    let d = tempfile::tempdir().unwrap();
    let yaml = d.path().join("rendered.yaml");
    std::fs::write(
        &yaml,
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: debug\nspec:\n  containers:\n  - name: sh\n    image: busybox\n    resources: {limits: {cpu: '1', memory: 64Mi}}\n    securityContext: {privileged: true}\n---\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings, namespace: web}\n",
    )
    .unwrap();
    let nuon = examples().join("nuon/no-privileged.rego");
    let args = |op: &'static str| {
        vec![
            "test".to_string(),
            "--input".into(),
            yaml.display().to_string(),
            "--source".into(),
            "helm".into(),
            "--operation".into(),
            op.into(),
            "--policies".into(),
            empty.path().display().to_string(),
            "--vendor-policy".into(),
            nuon.display().to_string(),
        ]
    };
    let run_owned = |a: Vec<String>| run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let (code, out, _) = run_owned(args("CREATE"));
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[no-privileged] Pod/default/debug: Pod/debug: container sh is privileged"),
        "{out}"
    );
    assert!(!out.contains("is being removed"), "{out}");
    let (_, out, _) = run_owned(args("DELETE"));
    assert!(out.contains("WARN  vendor/no-privileged.rego (nuon, warn) [no-privileged] ConfigMap/web/settings: ConfigMap settings is being removed"), "{out}");
    let (code, _, err) = run_owned(args("REPLACE"));
    assert_eq!(code, 64, "{err}");
}

#[test]
fn an_app_configs_declarations_are_listed_and_tested() {
    let empty = tempfile::tempdir().unwrap();
    let app = examples().join("app");
    let (code, out, err) = run(&[
        "list",
        "--policies",
        empty.path().to_str().unwrap(),
        "--app",
        app.to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let vendor = v["vendor"].as_array().unwrap();
    let summary: Vec<(String, String, String, String)> = vendor
        .iter()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap().to_string();
            (s("name"), s("type"), s("components"), s("convention"))
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                "vendor/policies/no-eip-delete.rego".into(),
                "terraform_module".into(),
                "*".into(),
                "nuon".into()
            ),
            (
                "vendor/policies/no-privileged.rego".into(),
                "kubernetes_manifest".into(),
                "api".into(),
                "nuon".into()
            ),
            (
                "vendor/policies/require-limits.yaml".into(),
                "kubernetes_cluster".into(),
                "-".into(),
                "kyverno".into()
            ),
        ]
    );
    let plan = examples().join("plan-deletes-eip.json");
    let (code, out, _) = run(&[
        "test",
        "--input",
        plan.to_str().unwrap(),
        "--policies",
        empty.path().to_str().unwrap(),
        "--app",
        app.to_str().unwrap(),
        "--component",
        "db",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("vendor/policies/no-eip-delete.rego (nuon, mandatory)"), "{out}");
    assert!(!out.contains("no-privileged"), "a kubernetes_manifest policy is not evaluated on a plan: {out}");
}

/// A customer policy that reads `input.byoc.context` (docs/GUARDRAILS.md), tried with
/// `--context`: the database replacement is denied outside a window, allowed inside.
#[test]
fn a_policy_on_the_guardrails_context_decides_by_the_window() {
    let policy = std::fs::read_to_string(examples().join("no-db-replacement-outside-window.rego")).unwrap();
    // The built-in checks that would deny this plan anyway are off, so only the
    // window policy decides.
    let d = customer_dir(
        "[builtin]\npublic_ingress = \"off\"\ndatabase_protection = \"off\"\n",
        &[("windows.rego", &policy)],
    );
    let plan = examples().join("plan-open-ingress.json");
    let ctx = tempfile::tempdir().unwrap();
    let outside = ctx.path().join("outside.json");
    std::fs::write(&outside, r#"{"now": "2026-11-25T12:00:00Z", "window": null, "windows_open": []}"#)
        .unwrap();
    let inside = ctx.path().join("inside.json");
    std::fs::write(
        &inside,
        r#"{"now": "2026-11-28T02:00:00Z", "window": {"name": "weekend", "rule": "db"}, "windows_open": ["weekend"]}"#,
    )
    .unwrap();
    let args = |context: &std::path::Path| {
        run(&[
            "test",
            "--input",
            plan.to_str().unwrap(),
            "--policies",
            d.path().to_str().unwrap(),
            "--context",
            context.to_str().unwrap(),
        ])
    };
    let (code, out, err) = args(&outside);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("aws_db_instance.main would be replaced outside a maintenance window"), "{out}");
    let (code, out, err) = args(&inside);
    assert_eq!(code, 0, "{out}{err}");
    // Not a JSON object: a usage error, nothing decided.
    let bad = ctx.path().join("bad.json");
    std::fs::write(&bad, "[1]").unwrap();
    let (code, _, err) = args(&bad);
    assert_eq!(code, 64, "a usage error (EX_USAGE): {err}");
    assert!(err.contains("must be a JSON object"), "{err}");
}

/// `byoc-runner app check DIR`: ok (exit 0) with what the app holds, every problem at
/// once (exit 1), JSON for tools, and a usage error for what is not a directory.
#[test]
fn app_check_prints_ok_or_every_problem() {
    let app = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_byoc-runner")).arg("app").args(args).output().unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let example = examples().join("../app");
    let (code, out) = app(&["check", example.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("ok: 5 roles, 0 policies, 3 secrets; stack parameters: "), "{out}");

    let bad = tempfile::tempdir().unwrap();
    std::fs::write(
        bad.path().join("permissions.toml"),
        "[maintenance_role]\nname = \"m\"\n[[maintenance_role.policies]]\nname = \"p\"\ncontents = \"./nowhere.json\"\n",
    )
    .unwrap();
    std::fs::write(
        bad.path().join("secrets.toml"),
        "[[secret]]\nname = \"s\"\nrequired = true\nauto_generate = true\n",
    )
    .unwrap();
    let (code, out) = app(&["check", bad.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(
            "problem: permissions.toml (m): policies[0].contents: \"./nowhere.json\" is not a file of the app"
        ),
        "{out}"
    );
    assert!(
        out.contains("problem: secrets.toml secret[0] (s): auto_generate and required cannot both be set"),
        "{out}"
    );
    assert!(out.trim_end().ends_with(&format!("2 problem(s) in {}", bad.path().display())), "{out}");
    let (code, out) = app(&["check", "-o", "json", bad.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((v["ok"].as_bool(), v["problems"].as_array().map(Vec::len)), (Some(false), Some(2)), "{v}");
    let (code, _) = app(&["check", "/nonexistent/app"]);
    assert_eq!(code, 64);
}
