//! A copy of the audit log the customer verifies offline, as any tampering could leave
//! it: the records, the runner's checkpoints and the control plane's cosignatures
//! (separated by NUL bytes in the input), through `audit verify`; and each line of the
//! checkpoint files through the signed-note parser.
#![no_main]

use std::sync::OnceLock;

use byoc_audit::log::{CHECKPOINTS, CONTROL_PLANE_KEY_NAME, COSIGNED, LOG};
use byoc_audit::verify::Trust;
use libfuzzer_sys::fuzz_target;

fn dir() -> &'static std::path::Path {
    static D: OnceLock<std::path::PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("byoc-fuzz-audit-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    // The keys the seeds were made with (fuzz/corpus/audit_log/).
    let runner = ed25519_dalek::SigningKey::from_bytes(&[1; 32]).verifying_key();
    let cp = ed25519_dalek::SigningKey::from_bytes(&[2; 32]).verifying_key();
    let mut parts = data.splitn(3, |&b| b == 0);
    let records = parts.next().unwrap_or_default();
    let checkpoints = parts.next().unwrap_or_default();
    let cosigned = parts.next().unwrap_or_default();
    let d = dir();
    for (file, bytes) in [(LOG, records), (CHECKPOINTS, checkpoints), (COSIGNED, cosigned)] {
        if std::fs::write(d.join(file), bytes).is_err() {
            return;
        }
    }
    let _ = byoc_audit::verify::verify_dir(d, &Trust { runner, control_plane: vec![cp] });
    for line in std::str::from_utf8(checkpoints).unwrap_or("").lines() {
        if let Ok(stored) = serde_json::from_str::<byoc_audit::log::StoredCheckpoint>(line) {
            let _ = byoc_audit::note::open(
                &stored.note,
                &[("byoc-runner/rn-1", &runner), (CONTROL_PLANE_KEY_NAME, &cp)],
            );
        }
    }
});
