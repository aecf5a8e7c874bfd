//! The forms a secret may take in output, as regex syntax: each character literal or
//! escaped (percent, JSON/JavaScript, `\x`), and base64/base64url fragments at each
//! byte alignment (see the parent module's doc).

use std::fmt::Write as _;

use base64::Engine as _;

/// Encoded fragments shorter than this are not masked (too likely to occur by chance).
const MIN_FRAGMENT_LEN: usize = 6;

/// The base64 and base64url characters fixed by `secret` at each byte alignment.
pub(super) fn base64_fragments(secret: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for engine in
        [base64::engine::general_purpose::STANDARD_NO_PAD, base64::engine::general_purpose::URL_SAFE_NO_PAD]
    {
        for align in 0..3usize {
            let mut padded = vec![0u8; align];
            padded.extend_from_slice(secret);
            let enc = engine.encode(&padded);
            // Leading characters mix in the alignment bytes; trailing ones mix in
            // whatever follows the secret. Keep only characters fixed by the secret.
            let skip = [0, 2, 3][align];
            let total = padded.len();
            let stable_end = total / 3 * 4 + [0, 1, 2][total % 3];
            if stable_end > skip && stable_end - skip >= MIN_FRAGMENT_LEN {
                out.push(enc.as_bytes()[skip..stable_end].to_vec());
            }
        }
    }
    out
}

/// The usual whole-string forms of `secret` (itself, base64 fragments, JSON string
/// content, percent- and form-encoding): what tests look for to prove nothing leaked.
/// Masking itself matches far more (any mixture of literal and escaped characters).
pub fn patterns_for(secret: &[u8]) -> Vec<Vec<u8>> {
    let mut out = vec![secret.to_vec()];
    out.extend(base64_fragments(secret));
    if let Ok(text) = std::str::from_utf8(secret) {
        let json = serde_json::to_string(text).unwrap_or_default();
        out.push(json.as_bytes()[1..json.len() - 1].to_vec());
        out.push(percent_encode(secret, false));
        out.push(percent_encode(secret, true));
    }
    out.sort();
    out.dedup();
    out
}

pub(super) fn percent_encode(bytes: &[u8], form: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() * 3);
    for &b in bytes {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(b),
            b' ' if form => out.push(b'+'),
            _ => out.extend_from_slice(format!("%{b:02X}").as_bytes()),
        }
    }
    out
}

/// Regex syntax for one byte, matched literally.
fn lit(re: &mut String, b: u8) {
    let _ = write!(re, "\\x{b:02x}");
}

pub(super) fn lits(re: &mut String, bytes: &[u8]) {
    for &b in bytes {
        lit(re, b);
    }
}

/// Two hex digits of `v`, letters in either case, after `prefix`.
fn hex_escape(re: &mut String, prefix: &[u8], v: u32, digits: u32) {
    lits(re, prefix);
    for shift in (0..digits).rev() {
        let nibble = (v >> (shift * 4)) & 0xf;
        let c = char::from_digit(nibble, 16).unwrap_or('0');
        if c.is_ascii_digit() {
            lit(re, c as u8);
        } else {
            let _ = write!(re, "[\\x{:02x}\\x{:02x}]", c as u8, c.to_ascii_uppercase() as u8);
        }
    }
}

/// One byte of a secret: percent-escaped, `\x`-escaped or literal. Returns the
/// longest form's length.
fn byte_forms(re: &mut String, b: u8) -> usize {
    re.push_str("(?:");
    hex_escape(re, b"%", b.into(), 2);
    re.push('|');
    hex_escape(re, b"\\x", b.into(), 2);
    re.push('|');
    lit(re, b);
    re.push(')');
    4
}

/// JSON's and JavaScript's short escape for `c`, if it has one.
pub(super) fn short_escape(c: char) -> Option<&'static [u8]> {
    Some(match c {
        '"' => b"\\\"",
        '\\' => b"\\\\",
        '/' => b"\\/",
        '\'' => b"\\'",
        '\u{8}' => b"\\b",
        '\u{c}' => b"\\f",
        '\n' => b"\\n",
        '\r' => b"\\r",
        '\t' => b"\\t",
        _ => return None,
    })
}

/// One character of a secret in every form it may take. Escapes come before the
/// literal so that, where both match (`%25` against `%`), the longer one is masked.
fn char_forms(re: &mut String, c: char) -> usize {
    let mut utf8 = [0u8; 4];
    let bytes = c.encode_utf8(&mut utf8).as_bytes();
    re.push_str("(?:");
    // \u escapes (JSON, JavaScript), a surrogate pair beyond the BMP.
    let mut units = [0u16; 2];
    let units = c.encode_utf16(&mut units);
    for u in units.iter() {
        hex_escape(re, b"\\u", (*u).into(), 4);
    }
    let mut longest = 6 * units.len();
    if let Some(e) = short_escape(c) {
        re.push('|');
        lits(re, e);
    }
    if c == ' ' {
        re.push('|');
        lit(re, b'+');
    }
    // Byte by byte, each percent-escaped, \x-escaped or literal.
    re.push('|');
    let mut bytes_len = 0;
    for &b in bytes {
        bytes_len += byte_forms(re, b);
    }
    longest = longest.max(bytes_len);
    re.push(')');
    longest
}

/// The regex of every form of `secret`, and the longest match it can have.
pub(super) fn secret_forms(secret: &[u8]) -> (String, usize) {
    let mut re = String::new();
    let mut longest = 0;
    match std::str::from_utf8(secret) {
        Ok(text) => {
            for c in text.chars() {
                longest += char_forms(&mut re, c);
            }
        }
        Err(_) => {
            for &b in secret {
                longest += byte_forms(&mut re, b);
            }
        }
    }
    (re, longest)
}
