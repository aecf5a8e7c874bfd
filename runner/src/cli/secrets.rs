//! `secrets`: each customer secret a job wrote on this runner, at which version, with
//! its keyed digest, where and by which job (docs/SECRETS.md). Never a value: the
//! runner keeps none.

use super::{Output, StateArgs, print_json, state_dir};

pub(super) fn list(s: &StateArgs) -> anyhow::Result<()> {
    let all = crate::secrets::ledger(&state_dir(s)?);
    if s.output == Output::Json {
        return print_json(&all);
    }
    if all.is_empty() {
        println!(
            "no secret written yet: a secrets.sync job, or a terraform, helm or kubernetes job naming secrets, writes them"
        );
        return Ok(());
    }
    println!("{:<24} {:<38} {:<21} {:<28} WRITTEN TO", "NAME", "VERSION", "WRITTEN", "JOB");
    for e in &all {
        println!(
            "{:<24} {:<38} {:<21} {:<28} {}",
            e.name,
            e.version_id.as_deref().unwrap_or("(not set)"),
            crate::clock::rfc3339_ms(e.at_ms),
            e.job_id,
            if e.written_to.is_empty() { "nothing".to_string() } else { e.written_to.join(", ") }
        );
    }
    Ok(())
}
