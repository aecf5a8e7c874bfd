//! The customer's runner.toml (and BYOC_RUNNER__ overrides) through the validation that
//! runs before any side effect: every problem reported, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    // After the first NUL: one environment override `NAME=value` a line.
    let (file, env) = text.split_once('\0').unwrap_or((text, ""));
    let env: Vec<(String, String)> = env
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (format!("{}{k}", byoc_runner::config::ENV_PREFIX), v.to_string()))
        .collect();
    let _ = byoc_runner::config::Config::parse(file, "fuzz", env);
});
