//! From the bytes a tool printed to the values policies see: one parse of the plan or
//! manifests, then the input each convention expects (the built-in pack's document,
//! conftest's document or one object at a time, nuon's `input.plan` or one admission
//! review per object).

use crate::{Admission, Context, Convention, Document, Limits, Source};

/// Parse `bytes` as `source` expects: a plan (JSON object) or manifests (a JSON array
/// of objects, one object, or a `{"items": [...]}` list). One parse, straight into the
/// evaluator's values.
pub fn parse_document(source: Source, bytes: &[u8], limits: &Limits) -> Result<Document, crate::InputError> {
    if bytes.len() > limits.max_input_bytes {
        return Err(crate::InputError::from(format!(
            "input is {} bytes, over the {} byte limit",
            bytes.len(),
            limits.max_input_bytes
        )));
    }
    let v: regorus::Value = serde_json::from_slice(bytes).map_err(|e| format!("input is not JSON: {e}"))?;
    let key = |v: &regorus::Value, k: &str| {
        v.as_object().ok().and_then(|o| o.get(&regorus::Value::from(k)).cloned())
    };
    match source {
        Source::Terraform | Source::Sandbox => {
            let changes_ok = key(&v, "resource_changes").is_some_and(|r| r.as_array().is_ok());
            if !changes_ok && key(&v, "format_version").is_none() {
                return Err(crate::InputError(
                    "input is not a terraform plan (no format_version or resource_changes)".to_string(),
                ));
            }
            Ok(Document::Plan(v))
        }
        Source::Helm | Source::Kubernetes => {
            let items: Vec<regorus::Value> = if let Ok(a) = v.as_array() {
                a.iter().cloned().collect()
            } else if let Some(items) = key(&v, "items").filter(|i| i.as_array().is_ok()) {
                items.as_array().map(|a| a.iter().cloned().collect()).unwrap_or_default()
            } else if v.as_object().is_ok() {
                vec![v]
            } else {
                return Err(crate::InputError(
                    "manifests must be a JSON object or array of objects".to_string(),
                ));
            };
            if items.iter().any(|m| key(m, "kind").is_none()) {
                return Err(crate::InputError("every manifest must be an object with a kind".to_string()));
            }
            Ok(Document::Manifests(items))
        }
    }
}

/// What each convention is given: the built-in pack one input for the whole document;
/// conftest the plan, or each manifest; nuon `{plan}`, or one admission review per
/// object. Each item carries the object's identity (`Kind/namespace/name`; empty for a
/// plan).
pub(crate) struct Inputs {
    pub(crate) builtin: regorus::Value,
    pub(crate) conftest: Vec<(regorus::Value, String)>,
    pub(crate) nuon: Vec<(regorus::Value, String)>,
}

fn key(k: &str) -> regorus::Value {
    regorus::Value::from(k)
}

fn get<'a>(v: &'a regorus::Value, k: &str) -> Option<&'a regorus::Value> {
    v.as_object().ok()?.get(&key(k))
}

fn get_str(v: &regorus::Value, k: &str) -> Option<String> {
    get(v, k)?.as_string().ok().map(|s| s.to_string())
}

/// `Kind/namespace/name`, the namespace `default` when the object names none.
pub fn object_identity(obj: &regorus::Value) -> String {
    let meta = get(obj, "metadata");
    let field = |k: &str| meta.and_then(|m| get_str(m, k));
    format!(
        "{}/{}/{}",
        get_str(obj, "kind").unwrap_or_default(),
        field("namespace").filter(|n| !n.is_empty()).unwrap_or_else(|| "default".into()),
        field("name").unwrap_or_default()
    )
}

/// The admission review of one object, as Gatekeeper builds it: `group` absent for the
/// core API (`apiVersion: v1`).
fn review(obj: &regorus::Value, admission: Admission, context: &regorus::Value) -> regorus::Value {
    let api_version = get_str(obj, "apiVersion").unwrap_or_default();
    let (group, version) = match api_version.split_once('/') {
        Some((g, v)) => (Some(g.to_string()), v.to_string()),
        None => (None, api_version),
    };
    let mut kind = std::collections::BTreeMap::new();
    kind.insert(key("kind"), regorus::Value::from(get_str(obj, "kind").unwrap_or_default()));
    if let Some(g) = group {
        kind.insert(key("group"), regorus::Value::from(g));
    }
    kind.insert(key("version"), regorus::Value::from(version));
    let mut r = std::collections::BTreeMap::new();
    r.insert(key("kind"), regorus::Value::from(kind));
    r.insert(key("operation"), regorus::Value::from(admission.as_str()));
    r.insert(key("object"), obj.clone());
    let mut input = std::collections::BTreeMap::new();
    input.insert(key("review"), regorus::Value::from(r));
    if *context != regorus::Value::Null {
        input.insert(key("context"), context.clone());
    }
    regorus::Value::from(input)
}

impl Inputs {
    pub(crate) fn new(doc: &Document, ctx: &Context) -> Inputs {
        let byoc = regorus::Value::from(serde_json::to_value(ctx).unwrap_or_default());
        let context = regorus::Value::from(ctx.context.clone());
        match doc {
            Document::Plan(plan) => {
                let mut with_byoc = plan.clone();
                if let Ok(o) = with_byoc.as_object_mut() {
                    o.insert(key("byoc"), byoc);
                }
                // The plan exactly as terraform printed it, under `plan`.
                let mut nuon = std::collections::BTreeMap::new();
                nuon.insert(key("plan"), plan.clone());
                if context != regorus::Value::Null {
                    nuon.insert(key("context"), context.clone());
                }
                Inputs {
                    builtin: with_byoc.clone(),
                    conftest: vec![(with_byoc, String::new())],
                    nuon: vec![(regorus::Value::from(nuon), String::new())],
                }
            }
            Document::Manifests(ms) => {
                let mut o = std::collections::BTreeMap::new();
                o.insert(key("byoc"), byoc);
                o.insert(key("manifests"), regorus::Value::from(ms.clone()));
                Inputs {
                    builtin: regorus::Value::from(o),
                    conftest: ms.iter().map(|m| (m.clone(), object_identity(m))).collect(),
                    nuon: ms
                        .iter()
                        .map(|m| (review(m, ctx.admission, &context), object_identity(m)))
                        .collect(),
                }
            }
        }
    }
}

/// The inputs a policy of `convention` is evaluated over for `doc`, as JSON, each with
/// the identity of the object it reviews (empty for a plan). For tests and tools that
/// compare with another engine.
pub fn inputs_for(convention: Convention, doc: &Document, ctx: &Context) -> Vec<(serde_json::Value, String)> {
    let inputs = Inputs::new(doc, ctx);
    let json = |v: &regorus::Value| {
        v.to_json_str().ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or(serde_json::Value::Null)
    };
    match convention {
        Convention::Builtin => vec![(json(&inputs.builtin), String::new())],
        Convention::Conftest => inputs.conftest.iter().map(|(v, id)| (json(v), id.clone())).collect(),
        Convention::Nuon => inputs.nuon.iter().map(|(v, id)| (json(v), id.clone())).collect(),
    }
}
