//! An artifact's archive (tar or tar.gz) as a registry could serve it, unpacked with the
//! runner's strict rules. Beyond not panicking: whatever an accepted archive held, no
//! path in the unpacked tree leads outside it.
#![no_main]

use std::path::Path;

use byoc_job_executors::artifact::unpack::{Limits, unpack};
use libfuzzer_sys::fuzz_target;

/// Small limits, so the fuzzer reaches them.
const LIMITS: Limits = Limits { max_entries: 64, max_bytes: 1 << 20, max_depth: 8 };

fn assert_inside(root: &Path, dir: &Path) {
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        let meta = std::fs::symlink_metadata(&path).expect("metadata");
        if meta.file_type().is_symlink() {
            // A dangling link is harmless; one that resolves must stay inside.
            if let Ok(real) = std::fs::canonicalize(&path) {
                assert!(real.starts_with(root), "{} leads to {}", path.display(), real.display());
            }
        } else if meta.is_dir() {
            assert_inside(root, &path);
        } else {
            assert!(meta.is_file(), "{} is neither file, directory nor link", path.display());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let scratch = tempfile::tempdir().expect("temp dir");
    let root = std::fs::canonicalize(scratch.path()).expect("canonical temp dir");
    let dest = root.join("unpacked");
    std::fs::create_dir(&dest).expect("dest");
    if unpack(data, &dest, &LIMITS).is_ok() {
        assert_inside(&dest, &dest);
    }
});
