//! What policies are evaluated over: a terraform plan (`terraform show -json`), rendered
//! helm manifests or kubernetes manifests, as a job's tool printed them, through the
//! input builders of every convention. First byte: the source.
#![no_main]

use byoc_policy::{Admission, Context, Convention, Limits, Source};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, doc)) = data.split_first() else { return };
    let source = match selector % 4 {
        0 => Source::Terraform,
        1 => Source::Sandbox,
        2 => Source::Helm,
        _ => Source::Kubernetes,
    };
    let admission = match selector / 4 % 3 {
        0 => Admission::Create,
        1 => Admission::Update,
        _ => Admission::Delete,
    };
    let limits = Limits { max_input_bytes: 1 << 20, ..Limits::default() };
    let Ok(parsed) = byoc_policy::parse_document(source, doc, &limits) else { return };
    let ctx = Context {
        source,
        phase: "maintenance".into(),
        operation: "component.deploy".into(),
        install: "inst-1".into(),
        admission,
        context: Default::default(),
        drift: false,
    };
    for convention in [Convention::Builtin, Convention::Conftest, Convention::Nuon] {
        let _ = byoc_policy::inputs_for(convention, &parsed, &ctx);
    }
});
