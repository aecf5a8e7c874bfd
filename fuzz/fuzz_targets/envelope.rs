//! A job delivery as the control plane (or anyone on the path) could send it, through
//! the runner's verification. First byte 0: the bytes are the whole poll response (the
//! envelope's format, encodings and signature checks). Otherwise: the bytes are a
//! payload signed with the pinned key, so the fuzzer reaches everything after the
//! signature: payload fields, executor specs, app configs and role derivation.
#![no_main]

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use byoc_runner::journal::Index;
use byoc_runner::pipeline::PolledJob;
use byoc_runner::pipeline::verify::Verifier;
use byoc_runner::roles::template::InstallState;
use libfuzzer_sys::fuzz_target;

struct Fixture {
    key: ed25519_dalek::SigningKey,
    keys: BTreeMap<String, ed25519_dalek::VerifyingKey>,
    install: InstallState,
    index: Index,
    /// The customer's update terms, so `runner.update` specs reach their checks.
    update: byoc_runner::config::UpdateConfig,
    state_dir: std::path::PathBuf,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let keys = [(byoc_protocol::key_id(&key.verifying_key()), key.verifying_key())].into_iter().collect();
        let mut index = Index::default();
        // A spent nonce and a finished job, so replay checks have something to find.
        index.nonces = HashMap::from([("spent".to_string(), ("job-0".to_string(), 2_000_000_000))]);
        Fixture {
            key,
            keys,
            install: InstallState::new("inst-1", Some("acme"), Some("us-east-1"), None),
            index,
            update: byoc_runner::config::UpdateConfig {
                mode: byoc_runner::config::UpdateMode::Auto,
                release_key: byoc_runner::update::minisign::PublicKey::parse(
                    "RWTpvzX1SCQie+b1b2ukH1NaNGEZZsjO1BHIJzyMHfMSjHTInVYVd1fe",
                )
                .ok(),
                ..Default::default()
            },
            // No pin file here: the config's terms decide.
            state_dir: std::env::temp_dir().join("byoc-fuzz-no-state"),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let Some((&mode, rest)) = data.split_first() else { return };
    let polled = if mode == 0 {
        let Ok(resp) = serde_json::from_slice::<byoc_protocol::PollResponse>(rest) else { return };
        PolledJob::from(resp)
    } else {
        PolledJob {
            delivery_id: "dl-1".into(),
            envelope: byoc_protocol::JobEnvelope::sign_bytes(rest, &f.key),
            received_at: Instant::now(),
        }
    };
    let verifier = Verifier {
        keys: &f.keys,
        runner_id: "rn-1",
        install_id: "inst-1",
        max_skew: Duration::from_secs(60),
        max_timeout: Duration::from_secs(6 * 3600),
        now: 1_900_000_000,
        install: &f.install,
        paused: None,
        disk_low: None,
        readiness: &|_| None,
        registries: byoc_oci_sync::Reach::guarded(["registry.allowed.test:5000"]),
        clusters: byoc_oci_sync::Reach::guarded(Vec::<String>::new()),
        job_provider_mirrors: data.len() % 2 == 0,
        resume_held: false,
        update: Some((&f.update, &f.state_dir)),
    };
    let _ = verifier.verify(polled, &f.index);
});
