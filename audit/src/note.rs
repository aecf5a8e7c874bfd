//! Checkpoints in the C2SP tlog-checkpoint format, signed as C2SP signed notes.
//!
//! ```text
//! byoc-runner/inst-1/rn-1      ← origin
//! 42                           ← tree size
//! <base64 root hash>
//! t=1795000000                 ← extension line: when it was signed (idle-gap checks)
//!
//! — byoc-runner/inst-1/rn-1 <base64(key hash[4] || Ed25519 signature)>
//! — byoc-control-plane <…>     ← the control plane's cosignature, once acknowledged
//! ```
//!
//! Key hash: the first 4 bytes of SHA-256(name || "\n" || 0x01 || public key), 0x01
//! being the Ed25519 algorithm byte of the signed-note spec. The runner's key is named
//! as the checkpoint's origin (C2SP: a log's key name should match its origin; logs
//! written before were signed as `byoc-runner/<runner>`, which verifiers still accept).
//! Extension lines are optional: a checkpoint without `t=` (or with others) is read.

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
    /// Unix seconds when signed (the `t=` extension line; absent in checkpoints that
    /// carry none).
    pub time: Option<u64>,
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
        let t = self.time.map(|t| format!("t={t}\n")).unwrap_or_default();
        format!("{}\n{}\n{}\n{t}", self.origin, self.size, B64.encode(self.root))
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
        // Extension lines (C2SP): optional, each non-empty; `t=` is ours.
        let mut time = None;
        for line in lines {
            if line.is_empty() {
                return Err(bad("empty extension line"));
            }
            if let Some(t) = line.strip_prefix("t=") {
                time = Some(t.parse().map_err(|_| bad("bad t= line"))?);
            }
        }
        Ok(Checkpoint { origin, size, root, time })
    }
}

/// The signed-note verifier key a third party needs (Go's `golang.org/x/mod/sumdb/note`
/// format): `name+hash+base64(0x01 || public key)`.
pub fn verifier_key(name: &str, key: &VerifyingKey) -> String {
    let mut alg_key = vec![0x01];
    alg_key.extend_from_slice(key.as_bytes());
    format!("{name}+{}+{}", hex::encode(key_hash(name, key)), B64.encode(alg_key))
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
    fn checkpoints_with_other_or_no_extension_lines_are_read() {
        let key = byoc_protocol::generate_signing_key();
        let name = "byoc-runner/i/r";
        let root = B64.encode([3u8; 32]);
        for (body, time) in
            [(format!("{name}\n5\n{root}\n"), None), (format!("{name}\n5\n{root}\nx=other\nt=9\n"), Some(9))]
        {
            let note = format!("{body}\n{}", sign_line(&body, name, &key));
            let cp = open(&note, &[(name, &key.verifying_key())]).unwrap();
            assert_eq!((cp.size, cp.time), (5, time));
        }
        let empty_ext = format!("{name}\n5\n{root}\n\nt=9\n");
        assert!(Checkpoint::parse_body(&empty_ext).is_err());
        let vkey = verifier_key(name, &key.verifying_key());
        assert!(vkey.starts_with(&format!("{name}+{}+", hex::encode(key_hash(name, &key.verifying_key())))));
    }

    #[test]
    fn sign_cosign_open_and_tamper() {
        let runner = byoc_protocol::generate_signing_key();
        let cp_key = byoc_protocol::generate_signing_key();
        let cp = Checkpoint { origin: "byoc-runner/i/r".into(), size: 7, root: [9; 32], time: Some(100) };
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
