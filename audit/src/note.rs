//! Checkpoints in the C2SP tlog-checkpoint format, signed as C2SP signed notes.
//!
//! ```text
//! byoc-runner/inst-1/rn-1      ← origin
//! 42                           ← tree size
//! <base64 root hash>
//! t=1795000000                 ← extension line: when it was signed (idle-gap checks)
//!
//! — byoc-runner/rn-1 <base64(key hash[4] || Ed25519 signature)>
//! — byoc-control-plane <…>     ← the control plane's cosignature, once acknowledged
//! ```
//!
//! Key hash: the first 4 bytes of SHA-256(name || "\n" || 0x01 || public key), 0x01
//! being the Ed25519 algorithm byte of the signed-note spec.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use ed25519_dalek::{Signature, Signer as _, SigningKey, Verifier as _, VerifyingKey};
use sha2::{Digest as _, Sha256};

use crate::merkle::Hash;

const SIG_PREFIX: &str = "\u{2014} ";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub origin: String,
    pub size: u64,
    pub root: Hash,
    /// Unix seconds when signed.
    pub time: u64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum NoteError {
    #[error("malformed checkpoint: {0}")]
    Malformed(String),
    #[error("no valid signature by {0}")]
    NotSigned(String),
}

impl Checkpoint {
    pub fn body(&self) -> String {
        format!("{}\n{}\n{}\nt={}\n", self.origin, self.size, B64.encode(self.root), self.time)
    }

    pub fn parse_body(body: &str) -> Result<Checkpoint, NoteError> {
        let bad = |m: &str| NoteError::Malformed(m.to_string());
        let mut lines = body.strip_suffix('\n').ok_or_else(|| bad("body must end in a newline"))?.split('\n');
        let origin = lines.next().filter(|o| !o.is_empty()).ok_or_else(|| bad("no origin"))?.to_string();
        let size = lines.next().and_then(|s| s.parse().ok()).ok_or_else(|| bad("bad size"))?;
        let root: Hash = lines
            .next()
            .and_then(|r| B64.decode(r).ok())
            .and_then(|r| r.try_into().ok())
            .ok_or_else(|| bad("bad root hash"))?;
        let time = lines
            .next()
            .and_then(|t| t.strip_prefix("t="))
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| bad("missing t= line"))?;
        if lines.next().is_some() {
            return Err(bad("unexpected extra lines"));
        }
        Ok(Checkpoint { origin, size, root, time })
    }
}

pub fn key_hash(name: &str, key: &VerifyingKey) -> [u8; 4] {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update(b"\n\x01");
    h.update(key.as_bytes());
    let d = h.finalize();
    [d[0], d[1], d[2], d[3]]
}

/// One signature line for `body`.
pub fn sign_line(body: &str, name: &str, key: &SigningKey) -> String {
    let sig = key.sign(body.as_bytes());
    let mut blob = key_hash(name, &key.verifying_key()).to_vec();
    blob.extend_from_slice(&sig.to_bytes());
    format!("{SIG_PREFIX}{name} {}\n", B64.encode(blob))
}

/// A signed note: body, blank line, signature lines.
pub fn sign(cp: &Checkpoint, name: &str, key: &SigningKey) -> String {
    let body = cp.body();
    format!("{body}\n{}", sign_line(&body, name, key))
}

/// Add a signature to an existing note (the control plane's cosignature).
pub fn cosign(note: &str, name: &str, key: &SigningKey) -> Result<String, NoteError> {
    let (body, _) = split(note)?;
    Ok(format!("{note}{}", sign_line(body, name, key)))
}

fn split(note: &str) -> Result<(&str, &str), NoteError> {
    let i =
        note.find("\n\n").ok_or_else(|| NoteError::Malformed("no blank line before signatures".into()))?;
    Ok((&note[..=i], &note[i + 2..]))
}

/// Parse a note and require a valid signature by each `(name, key)`.
pub fn open(note: &str, signers: &[(&str, &VerifyingKey)]) -> Result<Checkpoint, NoteError> {
    let (body, sigs) = split(note)?;
    let cp = Checkpoint::parse_body(body)?;
    for (name, key) in signers {
        let want = key_hash(name, key);
        let ok = sigs.lines().any(|line| {
            let Some(rest) = line.strip_prefix(SIG_PREFIX) else { return false };
            let Some((n, b64)) = rest.rsplit_once(' ') else { return false };
            let Ok(blob) = B64.decode(b64) else { return false };
            if n != *name || blob.len() != 68 || blob[..4] != want {
                return false;
            }
            let Ok(sig) = Signature::from_slice(&blob[4..]) else { return false };
            key.verify(body.as_bytes(), &sig).is_ok()
        });
        if !ok {
            return Err(NoteError::NotSigned((*name).to_string()));
        }
    }
    Ok(cp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_cosign_open_and_tamper() {
        let runner = byoc_protocol::generate_signing_key();
        let cp_key = byoc_protocol::generate_signing_key();
        let cp = Checkpoint { origin: "byoc-runner/i/r".into(), size: 7, root: [9; 32], time: 100 };
        let note = sign(&cp, "byoc-runner/r", &runner);
        assert_eq!(open(&note, &[("byoc-runner/r", &runner.verifying_key())]).unwrap(), cp);
        let both = cosign(&note, "byoc-control-plane", &cp_key).unwrap();
        let signers =
            [("byoc-runner/r", &runner.verifying_key()), ("byoc-control-plane", &cp_key.verifying_key())];
        assert_eq!(open(&both, &signers).unwrap(), cp);
        assert!(open(&note, &signers).is_err(), "cosignature required");
        let tampered = both.replacen("\n7\n", "\n8\n", 1);
        assert!(open(&tampered, &signers).is_err());
        let other = byoc_protocol::generate_signing_key();
        let forged = cosign(&note, "byoc-control-plane", &other).unwrap();
        assert!(open(&forged, &signers).is_err(), "forged cosignature accepted");
    }
}
