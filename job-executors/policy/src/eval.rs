//! Loading each policy into an engine of its own and evaluating it over its
//! convention's inputs: findings, errors with reason codes, and the verdict.

use std::num::NonZeroU32;
use std::time::Instant;

use sha2::Digest as _;

use crate::input::Inputs;
use crate::{
    Admission, Context, Convention, Decision, Document, Enforcement, Finding, Limits, Origin, Policy,
    PolicyError, PolicyRef, RuleKind, Verdict, codes,
};

/// Evaluate every policy over the document. `params` become `data.byoc.params`.
pub fn evaluate(
    policies: &[Policy],
    params: &serde_json::Value,
    ctx: &Context,
    doc: &Document,
    input_bytes: &[u8],
    limits: &Limits,
) -> Decision {
    let started = Instant::now();
    let inputs = Inputs::new(doc, ctx);
    let data = serde_json::json!({"byoc": {"params": params}});

    let mut d = Decision {
        verdict: Verdict::Allow,
        input_digest: format!("sha256:{}", hex::encode(sha2::Sha256::digest(input_bytes))),
        policies: policies.iter().map(PolicyRef::of).collect(),
        violations: vec![],
        warnings: vec![],
        passes: vec![],
        errors: vec![],
        elapsed_ms: 0,
    };
    // Policies are independent (one engine each): evaluate them on every core, then
    // collect the results in policy order so the decision does not depend on timing.
    let threads =
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(policies.len()).max(1);
    // Each thread takes the next policy not yet taken, so one slow policy does not hold
    // up a fixed share of the others.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let is_plan = matches!(doc, Document::Plan(_));
    let results: Vec<Result<Findings, PolicyError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (inputs, data, next) = (&inputs, &data, &next);
                scope.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(p) = policies.get(i) else { break };
                        done.push((i, eval_policy(p, data, inputs, is_plan, ctx.admission, limits)));
                    }
                    done
                })
            })
            .collect();
        let mut all: Vec<(usize, Result<Findings, PolicyError>)> =
            handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|_| vec![])).collect();
        all.sort_by_key(|(i, _)| *i);
        all.into_iter().map(|(_, r)| r).collect()
    });
    if results.len() != policies.len() {
        // A panicking evaluation thread: deny rather than decide on a partial set.
        d.errors.push(PolicyError {
            policy: "(evaluator)".into(),
            origin: Origin::Builtin,
            reason: "a policy evaluation thread failed".into(),
            code: codes::EVAL_ERROR.into(),
        });
    }
    for (p, result) in policies.iter().zip(results) {
        match result {
            Ok(found) => {
                for f in found.denials {
                    match p.enforcement {
                        Enforcement::Mandatory => d.violations.push(f),
                        Enforcement::Advisory => d.warnings.push(f),
                    }
                }
                d.warnings.extend(found.warnings);
                d.passes.extend(found.passes);
            }
            Err(e) => d.errors.push(e),
        }
    }
    if !d.violations.is_empty() || !d.errors.is_empty() {
        d.verdict = Verdict::Deny;
    }
    d.elapsed_ms = started.elapsed().as_millis() as u64;
    d
}

/// One policy's findings, by what its rules do.
#[derive(Default)]
struct Findings {
    denials: Vec<Finding>,
    warnings: Vec<Finding>,
    passes: Vec<Finding>,
}

/// Built-in rules that only look at resources of the types they name: they are given
/// only those resource changes (most of a large plan is other types), which keeps a
/// 10,000-change plan well inside its time budget.
const SCOPED_BY_TYPE: [&str; 4] =
    ["database_protection", "public_ingress", "storage_encryption", "iam_in_maintenance"];

/// The `"aws_…"` type names a scoped built-in rule's source mentions.
fn type_scope(p: &Policy) -> Option<std::collections::BTreeSet<String>> {
    let id = p.name.strip_prefix("builtin/")?;
    if !SCOPED_BY_TYPE.contains(&id) {
        return None;
    }
    Some(
        p.text
            .split('"')
            .skip(1)
            .step_by(2)
            .filter(|lit| {
                lit.starts_with("aws_")
                    && lit.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            })
            .map(str::to_string)
            .collect(),
    )
}

/// The plan with only the resource changes of `types` (everything else shared).
fn only_types(plan: &regorus::Value, types: &std::collections::BTreeSet<String>) -> regorus::Value {
    let key = regorus::Value::from("resource_changes");
    let ty = regorus::Value::from("type");
    let mut out = plan.clone();
    let Ok(o) = out.as_object_mut() else { return out };
    let Some(changes) = o.get(&key).and_then(|c| c.as_array().ok()) else { return out };
    let kept: Vec<regorus::Value> = changes
        .iter()
        .filter(|rc| {
            rc.as_object()
                .ok()
                .and_then(|m| m.get(&ty))
                .and_then(|t| t.as_string().ok())
                .is_some_and(|t| types.contains(t.as_ref()))
        })
        .cloned()
        .collect();
    o.insert(key, regorus::Value::from(kept));
    out
}

/// A policy loaded into an engine of its own (no module can read another's rules or
/// data), with its convention and the queried rules it declares.
pub struct Loaded {
    engine: regorus::Engine,
    /// `data.<package>`.
    pub package: String,
    pub convention: Convention,
    /// The rules queried, in order, and what each one's findings do.
    pub rules: Vec<(String, RuleKind)>,
}

fn policy_error(p: &Policy, code: &str, reason: String) -> PolicyError {
    PolicyError { policy: p.name.clone(), origin: p.origin, reason, code: code.into() }
}

/// Parse `p` (Rego v1, or v0 as conftest's older policies are written), tell its
/// convention from its package and check it defines a rule that convention queries.
/// Anything else is an error: a policy that would never be evaluated must not pass
/// for one that allows.
pub fn load(p: &Policy, limits: &Limits) -> Result<Loaded, PolicyError> {
    let new_engine = |v0: bool| {
        let mut e = regorus::Engine::new();
        e.set_rego_v0(v0);
        e.set_execution_timer_config(regorus::utils::limits::ExecutionTimerConfig {
            limit: limits.time_per_policy,
            check_interval: NonZeroU32::new(256).unwrap_or(NonZeroU32::MIN),
        });
        e
    };
    if let Some(call) = network_builtin_calls(&p.text).first() {
        return Err(policy_error(
            p,
            codes::LOAD_ERROR,
            format!(
                "calls {call}: the runner gives policies no network (a decision must depend only on \
                 what was judged), so a policy that reaches out is refused rather than run"
            ),
        ));
    }
    let mut engine = new_engine(false);
    let package = match engine.add_policy(p.name.clone(), p.text.clone()) {
        Ok(pkg) => pkg,
        Err(v1_error) => {
            engine = new_engine(true);
            engine.add_policy(p.name.clone(), p.text.clone()).map_err(|_| {
                policy_error(p, codes::LOAD_ERROR, format!("does not load (not valid Rego): {v1_error}"))
            })?
        }
    };
    let convention = match (p.origin, package.as_str()) {
        (Origin::Builtin, _) => Convention::Builtin,
        (_, "data.main") => Convention::Conftest,
        (_, "data.nuon") => Convention::Nuon,
        (_, other) => {
            return Err(policy_error(
                p,
                codes::UNRECOGNISED,
                format!(
                    "package {} is not one the runner queries, so nothing in it would be evaluated: \
                     use `package nuon` (deny, warn) or `package main` (conftest: deny, violation, warn)",
                    other.trim_start_matches("data.")
                ),
            ));
        }
    };
    let declared = |r: &str| engine.has_declared_rule_rooted_at(&p.name, r).unwrap_or(false);
    let mut rules: Vec<(String, RuleKind)> =
        convention.rules().iter().filter(|(r, _)| declared(r)).map(|(r, k)| (r.to_string(), *k)).collect();
    if convention == Convention::Conftest {
        // conftest also queries rules named with a suffix: deny_public_bucket,
        // violation_x, warn_y. Candidates come from the text, the engine confirms each.
        for name in suffixed_rule_candidates(&p.text) {
            if !rules.iter().any(|(r, _)| *r == name) && declared(&name) {
                let kind = if name.starts_with("warn_") { RuleKind::Warn } else { RuleKind::Deny };
                rules.push((name, kind));
            }
        }
    }
    if rules.is_empty() {
        let wanted: Vec<&str> = convention.rules().iter().map(|(r, _)| *r).collect();
        return Err(policy_error(
            p,
            codes::UNRECOGNISED,
            format!(
                "package {} defines none of {}, so nothing in it would be evaluated",
                package.trim_start_matches("data."),
                wanted.join(", ")
            ),
        ));
    }
    Ok(Loaded { engine, package, convention, rules })
}

fn eval_policy(
    p: &Policy,
    data: &serde_json::Value,
    inputs: &Inputs,
    is_plan: bool,
    admission: Admission,
    limits: &Limits,
) -> Result<Findings, PolicyError> {
    let Loaded { mut engine, package, convention, rules } = load(p, limits)?;
    // Deleting objects is reviewed by policies that know the operation (nuon's
    // `input.review.operation`): the built-in pack and conftest's convention judge what
    // is deployed (limits, ingress, registries), which a deletion does not deploy.
    if !is_plan && admission == Admission::Delete && convention != Convention::Nuon {
        return Ok(Findings::default());
    }
    let eval_error = |reason: String| policy_error(p, codes::EVAL_ERROR, reason);
    engine.add_data_json(&data.to_string()).map_err(|e| eval_error(format!("parameters: {e}")))?;
    let scoped;
    let items: Vec<(&regorus::Value, &str)> = match convention {
        Convention::Builtin => match type_scope(p) {
            Some(types) if is_plan => {
                scoped = only_types(&inputs.builtin, &types);
                vec![(&scoped, "")]
            }
            _ => vec![(&inputs.builtin, "")],
        },
        Convention::Conftest => inputs.conftest.iter().map(|(v, id)| (v, id.as_str())).collect(),
        Convention::Nuon => inputs.nuon.iter().map(|(v, id)| (v, id.as_str())).collect(),
    };
    let mut found = Findings::default();
    for (input, object) in items {
        engine.set_input(input.clone());
        for (rule, kind) in &rules {
            let (rule, kind) = (rule.as_str(), *kind);
            let results = engine
                .eval_query(format!("{package}.{rule}"), false)
                .map_err(|e| eval_error(format!("evaluating {rule}{}: {e}", on(object))))?;
            let Some(value) =
                results.result.into_iter().next().and_then(|r| r.expressions.into_iter().next())
            else {
                continue;
            };
            let json: serde_json::Value = match value.value {
                regorus::Value::Undefined => continue,
                v => serde_json::from_str(&v.to_json_str().map_err(|e| eval_error(format!("{rule}: {e}")))?)
                    .map_err(|e| eval_error(format!("{rule}: {e}")))?,
            };
            let items = match convention {
                Convention::Nuon => {
                    nuon_items(json).map_err(|why| eval_error(format!("{rule}{}: {why}", on(object))))?
                }
                _ => as_items(json),
            };
            for item in items {
                let f = finding(p, convention, rule, item, object);
                match kind {
                    RuleKind::Deny => found.denials.push(f),
                    RuleKind::Warn => found.warnings.push(f),
                    RuleKind::Pass => found.passes.push(f),
                }
            }
        }
    }
    Ok(found)
}

/// OPA builtins that reach the network: never available to a policy.
const NETWORK_BUILTINS: [&str; 2] = ["http.send", "net.lookup_ip_addr"];

/// The network builtins the Rego text calls (outside comments and string literals).
/// A lexical check, so it cannot be hidden behind evaluation order or an unused rule.
fn network_builtin_calls(text: &str) -> Vec<&'static str> {
    let code = without_comments_and_strings(text);
    let mut found = Vec::new();
    for name in NETWORK_BUILTINS {
        let called = code.match_indices(name).any(|(at, _)| {
            let before = code[..at].chars().next_back();
            let after = code[at + name.len()..].trim_start().chars().next();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.') && after == Some('(')
        });
        if called {
            found.push(name);
        }
    }
    found
}

/// Rego source with comments removed and string literals ("…" with escapes, `…` raw)
/// replaced by empty ones, so only code is searched.
fn without_comments_and_strings(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '#' => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '"' => {
                out.push_str("\"\"");
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            '`' => {
                out.push_str("``");
                for c in chars.by_ref() {
                    if c == '`' {
                        break;
                    }
                }
            }
            c => out.push(c),
        }
    }
    out
}

/// Names at the start of a line that look like conftest's suffixed rules
/// (`deny_x`, `violation_x`, `warn_x`), each once.
fn suffixed_rule_candidates(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let name: String = line.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let suffixed =
            ["deny_", "violation_", "warn_"].iter().any(|p| name.len() > p.len() && name.starts_with(p));
        if suffixed && !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

fn on(object: &str) -> String {
    if object.is_empty() { String::new() } else { format!(" on {object}") }
}

/// `deny`/`warn`/`pass` of a nuon policy: a set or array of strings or of objects with a
/// non-empty string `msg`. Anything else is an error (which denies): a policy whose
/// findings cannot be read must not pass for one that found nothing.
fn nuon_items(v: serde_json::Value) -> Result<Vec<serde_json::Value>, String> {
    let items = match v {
        serde_json::Value::Array(a) => a,
        other => return Err(format!("must be a set or an array of messages, not {}", kind_of(&other))),
    };
    for item in &items {
        match item {
            serde_json::Value::String(_) => {}
            serde_json::Value::Object(o)
                if o.get("msg").and_then(|m| m.as_str()).is_some_and(|m| !m.is_empty()) => {}
            serde_json::Value::Object(_) => return Err("an object item has no non-empty string `msg`".into()),
            other => {
                return Err(format!("an item is {}, not a string or an object with `msg`", kind_of(other)));
            }
        }
    }
    Ok(items)
}

fn kind_of(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn as_items(v: serde_json::Value) -> Vec<serde_json::Value> {
    match v {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Null | serde_json::Value::Bool(false) => vec![],
        // A boolean `deny` (`deny if …`): a denial without a message.
        serde_json::Value::Bool(true) => vec![serde_json::Value::String(String::new())],
        other => vec![other],
    }
}

fn finding(
    p: &Policy,
    convention: Convention,
    from_rule: &str,
    item: serde_json::Value,
    object: &str,
) -> Finding {
    let default_rule = p.name.rsplit('/').next().unwrap_or(&p.name).trim_end_matches(".rego").to_string();
    let get = |k: &str| item.get(k).and_then(|v| v.as_str()).map(str::to_string);
    let (rule, address, message, details) = match &item {
        serde_json::Value::String(s) => (default_rule, object.to_string(), s.clone(), None),
        serde_json::Value::Object(o) => {
            let rest: serde_json::Map<String, serde_json::Value> =
                o.iter().filter(|(k, _)| k.as_str() != "msg").map(|(k, v)| (k.clone(), v.clone())).collect();
            (
                get("rule").unwrap_or(default_rule),
                get("address").or_else(|| get("resource")).unwrap_or_else(|| object.to_string()),
                get("msg").or_else(|| get("message")).unwrap_or_else(|| item.to_string()),
                (!rest.is_empty() && convention != Convention::Builtin)
                    .then_some(serde_json::Value::Object(rest)),
            )
        }
        other => (default_rule, object.to_string(), other.to_string(), None),
    };
    Finding {
        policy: p.name.clone(),
        origin: p.origin,
        enforcement: p.enforcement,
        rule,
        address,
        message,
        convention: (convention != Convention::Builtin).then_some(convention),
        from_rule: if convention == Convention::Builtin { String::new() } else { from_rule.to_string() },
        details,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin_pack;

    #[test]
    fn network_builtins_are_found_in_code_only() {
        let calls = |t: &str| network_builtin_calls(t);
        assert_eq!(calls("r := http.send({\"url\": \"x\"})"), vec!["http.send"]);
        assert_eq!(calls("r := http.send\n(\n{})"), vec!["http.send"]);
        assert_eq!(calls("ips := net.lookup_ip_addr(\"example.com\")"), vec!["net.lookup_ip_addr"]);
        // Mentions that call nothing.
        assert!(calls("# r := http.send({})\nmsg := \"http.send( is refused\"").is_empty());
        assert!(calls("msg := `http.send(` \nx := \"a\\\"http.send(\"").is_empty());
        assert!(calls("my_http.send(x)\ndata.lib.http.send(x)\nhttp.sender(x)").is_empty());
    }

    #[test]
    fn scoped_rules_name_their_types_and_others_see_everything() {
        let pack = builtin_pack();
        let scope = |id: &str| {
            type_scope(pack.iter().find(|p| p.name == format!("builtin/{id}")).unwrap_or(&pack[0]))
        };
        let db = scope("database_protection").unwrap_or_default();
        assert!(
            db.contains("aws_db_instance")
                && db.contains("aws_dynamodb_table")
                && !db.contains("aws_s3_bucket")
        );
        let storage = scope("storage_encryption").unwrap_or_default();
        assert!(storage.contains("aws_s3_bucket_server_side_encryption_configuration"));
        assert!(scope("required_tags").is_none());
        assert!(scope("container_limits").is_none());
    }
}
