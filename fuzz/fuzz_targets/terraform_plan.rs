//! A sealed terraform plan file (a zip the job's processes could have written), read for
//! its backend record and, as a packed provider package, for its files: errors, never a
//! panic, and never more inflated than the cap.
#![no_main]

use byoc_job_executors::terraform::planfile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = planfile::backend(data);
    if let Ok(files) = planfile::zip_files(data, 1 << 16) {
        assert!(files.iter().all(|(_, bytes)| bytes.len() <= 1 << 16));
    }
});
