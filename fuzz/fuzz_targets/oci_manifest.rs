//! What a registry answers: manifests and indexes (any media type header), and the
//! references a job names, through the artifact copier's parsers.
#![no_main]

use libfuzzer_sys::fuzz_target;

const MEDIA_TYPES: [&str; 5] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "",
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else { return };
    let header = MEDIA_TYPES[selector as usize % MEDIA_TYPES.len()];
    let _ = byoc_oci_sync::manifest::Parsed::parse(bytes, header);
    if let Ok(entries) = byoc_oci_sync::manifest::index_entries(bytes) {
        let _ = byoc_oci_sync::manifest::index_of(&entries);
    }
    if let Ok(text) = std::str::from_utf8(bytes) {
        let _ = byoc_oci_sync::reference::Reference::parse(text);
    }
});
