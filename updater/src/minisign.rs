//! Minisign signatures (the release key user-data pins), verified as `minisign -V`
//! does: the key id must match, the signature is Ed25519 over the file (`Ed`) or over
//! its BLAKE2b-512 (`ED`, minisign's default), and the trusted comment is covered by
//! the global signature. Format: https://jedisct1.github.io/minisign/

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use blake2::Digest as _;
use ed25519_dalek::{Signature, Verifier as _, VerifyingKey};

/// A minisign public key: its 8-byte id and the Ed25519 key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    pub key_id: [u8; 8],
    pub key: VerifyingKey,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MinisignError {
    #[error("not a minisign public key: {0}")]
    PublicKey(&'static str),
    #[error("not a minisign signature: {0}")]
    Malformed(&'static str),
    #[error("signed by key {found}, not the pinned release key {pinned}")]
    OtherKey { found: String, pinned: String },
    #[error("the signature does not verify with the pinned release key")]
    Invalid,
}

impl PublicKey {
    /// The key line (`RW…`: base64 of `Ed`, key id, key), or a whole `.pub` file.
    pub fn parse(text: &str) -> Result<PublicKey, MinisignError> {
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with("untrusted comment:"))
            .ok_or(MinisignError::PublicKey("empty"))?;
        let raw = B64.decode(line).map_err(|_| MinisignError::PublicKey("not base64"))?;
        if raw.len() != 42 || &raw[..2] != b"Ed" {
            return Err(MinisignError::PublicKey("expected 42 bytes starting with \"Ed\""));
        }
        let key: [u8; 32] = raw[10..].try_into().map_err(|_| MinisignError::PublicKey("length"))?;
        Ok(PublicKey {
            key_id: raw[2..10].try_into().map_err(|_| MinisignError::PublicKey("length"))?,
            key: VerifyingKey::from_bytes(&key)
                .map_err(|_| MinisignError::PublicKey("not an Ed25519 key"))?,
        })
    }

    /// The key line (`RW…`), as a `.pub` file's second line.
    pub fn line(&self) -> String {
        let mut raw = b"Ed".to_vec();
        raw.extend_from_slice(&self.key_id);
        raw.extend_from_slice(self.key.as_bytes());
        B64.encode(raw)
    }

    /// As minisign prints key ids: the 8 bytes little-endian, upper-case hex.
    pub fn id(&self) -> String {
        key_id_hex(&self.key_id)
    }
}

fn key_id_hex(id: &[u8; 8]) -> String {
    format!("{:016X}", u64::from_le_bytes(*id))
}

/// What a verified signature says beside the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub trusted_comment: String,
}

/// Verify `signature` (a `.minisig` file's text) over `message` with `key`.
pub fn verify(key: &PublicKey, message: &[u8], signature: &str) -> Result<Verified, MinisignError> {
    let mut lines = signature.lines();
    let _untrusted = lines.next().ok_or(MinisignError::Malformed("empty"))?;
    let sig_line = lines.next().ok_or(MinisignError::Malformed("no signature line"))?;
    let trusted = lines
        .next()
        .and_then(|l| l.strip_prefix("trusted comment: "))
        .ok_or(MinisignError::Malformed("no trusted comment"))?;
    let global = lines.next().ok_or(MinisignError::Malformed("no global signature"))?;
    let raw = B64.decode(sig_line.trim()).map_err(|_| MinisignError::Malformed("signature not base64"))?;
    if raw.len() != 74 {
        return Err(MinisignError::Malformed("signature is not 74 bytes"));
    }
    let (alg, id, sig) = (&raw[..2], &raw[2..10], &raw[10..]);
    let id: [u8; 8] = id.try_into().map_err(|_| MinisignError::Malformed("key id"))?;
    if id != key.key_id {
        return Err(MinisignError::OtherKey { found: key_id_hex(&id), pinned: key.id() });
    }
    let sig = Signature::from_slice(sig).map_err(|_| MinisignError::Malformed("signature"))?;
    let signed = match alg {
        b"ED" => blake2::Blake2b512::digest(message).to_vec(),
        b"Ed" => message.to_vec(),
        _ => return Err(MinisignError::Malformed("unknown signature algorithm")),
    };
    key.key.verify(&signed, &sig).map_err(|_| MinisignError::Invalid)?;
    let global =
        B64.decode(global.trim()).map_err(|_| MinisignError::Malformed("global signature not base64"))?;
    let global = Signature::from_slice(&global).map_err(|_| MinisignError::Malformed("global signature"))?;
    let mut covered = sig.to_bytes().to_vec();
    covered.extend_from_slice(trusted.as_bytes());
    key.key.verify(&covered, &global).map_err(|_| MinisignError::Invalid)?;
    Ok(Verified { trusted_comment: trusted.to_string() })
}

/// Sign as `minisign -S` does (prehashed), for tests and the reference control plane's
/// release tooling. Returns the key line and the `.minisig` text.
pub fn sign(
    secret: &ed25519_dalek::SigningKey,
    key_id: [u8; 8],
    message: &[u8],
    trusted_comment: &str,
) -> (String, String) {
    use ed25519_dalek::Signer as _;
    let mut public = b"Ed".to_vec();
    public.extend_from_slice(&key_id);
    public.extend_from_slice(secret.verifying_key().as_bytes());
    let sig = secret.sign(&blake2::Blake2b512::digest(message));
    let mut line = b"ED".to_vec();
    line.extend_from_slice(&key_id);
    line.extend_from_slice(&sig.to_bytes());
    let mut covered = sig.to_bytes().to_vec();
    covered.extend_from_slice(trusted_comment.as_bytes());
    let global = secret.sign(&covered);
    (
        B64.encode(public),
        format!(
            "untrusted comment: signature from byoc-runner release key\n{}\ntrusted comment: {trusted_comment}\n{}\n",
            B64.encode(line),
            B64.encode(global.to_bytes())
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    // Made by minisign 0.11 (`minisign -G -W`, `minisign -S -m msg -t "byoc test"`), so
    // the format is checked against the real tool, not only against `sign`.
    const CLI_PUB: &str = include_str!("testdata/cli.pub");
    const CLI_SIG: &str = include_str!("testdata/cli.msg.minisig");
    const CLI_MSG: &[u8] = include_bytes!("testdata/cli.msg");

    #[test]
    fn a_signature_made_by_the_minisign_tool_verifies() {
        let key = PublicKey::parse(CLI_PUB).unwrap();
        assert_eq!(key.line(), CLI_PUB.lines().nth(1).unwrap());
        let v = verify(&key, CLI_MSG, CLI_SIG).unwrap();
        assert_eq!(v.trusted_comment, "byoc test");
        let mut changed = CLI_MSG.to_vec();
        changed[0] ^= 1;
        assert_eq!(verify(&key, &changed, CLI_SIG), Err(MinisignError::Invalid));
        // The trusted comment is signed too.
        let edited = CLI_SIG.replace("trusted comment: byoc test", "trusted comment: byoc tesT");
        assert_eq!(verify(&key, CLI_MSG, &edited), Err(MinisignError::Invalid));
    }

    #[test]
    fn another_keys_signature_is_named_as_such() {
        let other = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let (_, sig) = sign(&other, [1; 8], CLI_MSG, "x");
        let key = PublicKey::parse(CLI_PUB).unwrap();
        assert!(matches!(verify(&key, CLI_MSG, &sig), Err(MinisignError::OtherKey { .. })));
        // The same key id but another key: the signature itself fails.
        let (_, sig) = sign(&other, key.key_id, CLI_MSG, "x");
        assert_eq!(verify(&key, CLI_MSG, &sig), Err(MinisignError::Invalid));
    }

    #[test]
    fn what_sign_makes_verifies_and_garbage_is_refused() {
        let secret = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
        let (public, sig) = sign(&secret, [2; 8], b"hello", "c");
        let key = PublicKey::parse(&public).unwrap();
        assert!(verify(&key, b"hello", &sig).is_ok());
        for bad in ["", "x\n", "x\n!!\n", "x\nRWQ=\ntrusted comment: c\nAA==\n"] {
            assert!(matches!(verify(&key, b"hello", bad), Err(MinisignError::Malformed(_))), "{bad:?}");
        }
        assert!(PublicKey::parse("RWQ=").is_err());
        assert!(PublicKey::parse("").is_err());
    }
}
