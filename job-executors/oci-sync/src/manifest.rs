//! The parts of OCI / Docker v2 manifests a copy walks: descriptors of children,
//! config and layers, and the referrers index.

use serde::Deserialize;

use crate::client::{DOCKER_LIST, DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST};
use crate::reference::Digest;

/// A manifest or index this copier cannot walk: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidManifest(pub String);

impl From<crate::reference::InvalidReference> for InvalidManifest {
    fn from(e: crate::reference::InvalidReference) -> Self {
        InvalidManifest(e.0)
    }
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(rename = "artifactType", default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Debug, Deserialize)]
struct Doc {
    #[serde(rename = "schemaVersion")]
    schema_version: u32,
    #[serde(rename = "mediaType", default)]
    media_type: Option<String>,
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
    manifests: Option<Vec<Descriptor>>,
}

#[derive(Debug)]
pub enum Parsed {
    /// An index / manifest list: child manifests.
    Index(Vec<(Digest, Descriptor)>),
    /// An image or artifact manifest: its blobs (config first).
    Image(Vec<(Digest, u64)>),
}

impl Parsed {
    pub fn parse(bytes: &[u8], header_type: &str) -> Result<Parsed, InvalidManifest> {
        let doc: Doc =
            serde_json::from_slice(bytes).map_err(|e| InvalidManifest(format!("not a manifest: {e}")))?;
        if doc.schema_version != 2 {
            return Err(InvalidManifest(format!(
                "schemaVersion {} is not supported (Docker schema 1 manifests are deprecated)",
                doc.schema_version
            )));
        }
        let media_type = doc.media_type.as_deref().filter(|m| !m.is_empty()).unwrap_or(header_type);
        let digest = |d: &Descriptor| Digest::parse(&d.digest);
        match (media_type, doc.manifests, doc.config) {
            (OCI_INDEX | DOCKER_LIST, Some(children), _)
            | ("" | "application/json", Some(children), None) => {
                let out = children
                    .into_iter()
                    .map(|d| Ok((digest(&d)?, d)))
                    .collect::<Result<Vec<_>, InvalidManifest>>()?;
                Ok(Parsed::Index(out))
            }
            (OCI_MANIFEST | DOCKER_MANIFEST | "" | "application/json", None, Some(config)) => {
                let mut blobs = vec![(digest(&config)?, config.size)];
                for l in &doc.layers {
                    blobs.push((digest(l)?, l.size));
                }
                Ok(Parsed::Image(blobs))
            }
            (m, _, _) => Err(InvalidManifest(format!(
                "media type {m:?} is not an image manifest or index this runner copies"
            ))),
        }
    }
}

/// The descriptors an index (a referrers answer or a fallback tag) lists.
pub fn index_entries(bytes: &[u8]) -> Result<Vec<Descriptor>, InvalidManifest> {
    #[derive(Deserialize)]
    struct Index {
        #[serde(default)]
        manifests: Vec<Descriptor>,
    }
    let i: Index =
        serde_json::from_slice(bytes).map_err(|e| InvalidManifest(format!("not an index: {e}")))?;
    Ok(i.manifests)
}

/// An OCI index listing `entries` (for the referrers tag schema).
pub fn index_of(entries: &[Descriptor]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": entries,
    }))
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";

    #[test]
    fn images_and_indexes_parse() {
        let img = format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"mediaType":"x","digest":"{D1}","size":3}},"layers":[{{"mediaType":"y","digest":"{D2}","size":5}}]}}"#
        );
        match Parsed::parse(img.as_bytes(), "").unwrap() {
            Parsed::Image(b) => assert_eq!(b.iter().map(|(_, s)| *s).collect::<Vec<_>>(), vec![3, 5]),
            other => panic!("{other:?}"),
        }
        let idx = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"{OCI_MANIFEST}","digest":"{D1}","size":9}}]}}"#
        );
        assert!(
            matches!(Parsed::parse(idx.as_bytes(), OCI_INDEX).unwrap(), Parsed::Index(c) if c.len() == 1)
        );
    }

    #[test]
    fn bad_manifests_are_refused_with_a_reason() {
        assert!(Parsed::parse(b"{", "").is_err());
        assert!(Parsed::parse(br#"{"schemaVersion":1}"#, "").unwrap_err().0.contains("schema 1"));
        let bad_digest = r#"{"schemaVersion":2,"config":{"digest":"md5:x","size":1},"layers":[]}"#;
        assert!(Parsed::parse(bad_digest.as_bytes(), OCI_MANIFEST).is_err());
        let wrong_type = format!(
            r#"{{"schemaVersion":2,"mediaType":"text/plain","config":{{"digest":"{D1}","size":1}}}}"#
        );
        assert!(Parsed::parse(wrong_type.as_bytes(), "").is_err());
    }
}
