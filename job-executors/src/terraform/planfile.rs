//! What a sealed plan file says about where its state goes. Apply takes the backend from
//! the plan file, not from the module: a process of the job alive while terraform wrote
//! the plan could have rewritten it to name another backend, path or workspace, which
//! `show -json` never prints. The runner reads the plan's backend record itself (the
//! zip's `tfplan` entry, terraform's `planproto.Plan.backend`) and holds it to the
//! backend it configured. Every length in the file is the job's: each is checked
//! against what is left, and what is inflated is capped.

use std::io::Read as _;

/// Largest `tfplan` entry the runner inflates (a plan with a very large state is
/// refused rather than read without bound).
const MAX_TFPLAN_BYTES: u64 = 256 << 20;
/// Largest zip central directory the runner reads.
const MAX_DIRECTORY_BYTES: usize = 16 << 20;

/// The backend a plan file names: its type, configuration (decoded, nulls dropped) and
/// workspace.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanBackend {
    pub kind: String,
    pub config: serde_json::Value,
    pub workspace: String,
}

/// The plan file's backend record.
pub fn backend(plan_zip: &[u8]) -> Result<PlanBackend, String> {
    let tfplan =
        zip_entry(plan_zip, "tfplan", MAX_TFPLAN_BYTES)?.ok_or("the plan file has no tfplan entry")?;
    let record = proto_fields(&tfplan)?
        .into_iter()
        .filter(|(field, _)| *field == 13)
        .map(|(_, v)| v)
        .next_back()
        .ok_or("the plan names no backend")?;
    let mut backend =
        PlanBackend { kind: String::new(), config: serde_json::Value::Null, workspace: String::new() };
    for (field, value) in proto_fields(record)? {
        match field {
            1 => backend.kind = String::from_utf8(value.to_vec()).map_err(|_| "backend type is not UTF-8")?,
            2 => {
                let msgpack = proto_fields(value)?
                    .into_iter()
                    .filter(|(f, _)| *f == 1)
                    .map(|(_, v)| v)
                    .next_back()
                    .unwrap_or_default();
                let mut at = 0;
                backend.config = without_nulls(msgpack_value(msgpack, &mut at, 0)?);
            }
            3 => {
                backend.workspace = String::from_utf8(value.to_vec()).map_err(|_| "workspace is not UTF-8")?
            }
            _ => {}
        }
    }
    Ok(backend)
}

/// The bytes of the zip entry `name` (stored or deflated), at most `max` of them.
pub fn zip_entry(zip: &[u8], name: &str, max: u64) -> Result<Option<Vec<u8>>, String> {
    for entry in zip_entries(zip)? {
        if entry.name == name.as_bytes() {
            return entry_bytes(zip, &entry, max).map(Some);
        }
    }
    Ok(None)
}

/// Every regular file of the zip (directories left out), by name: the contents of a
/// provider package (`terraform providers mirror`'s packed layout).
pub fn zip_files(zip: &[u8], max_each: u64) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut out = Vec::new();
    for entry in zip_entries(zip)? {
        if entry.name.ends_with(b"/") {
            continue;
        }
        let name = String::from_utf8(entry.name.clone()).map_err(|_| "a zip entry's name is not UTF-8")?;
        out.push((name, entry_bytes(zip, &entry, max_each)?));
    }
    Ok(out)
}

struct Entry {
    name: Vec<u8>,
    method: u16,
    compressed: u64,
    size: u64,
    local_offset: u64,
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, String> {
    b.get(at..at + 2).map(|s| u16::from_le_bytes([s[0], s[1]])).ok_or_else(|| "zip: truncated".into())
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or_else(|| "zip: truncated".into())
}

/// The central directory's entries (the end record found from the end, as zip readers do).
fn zip_entries(zip: &[u8]) -> Result<Vec<Entry>, String> {
    const END: u32 = 0x0605_4b50;
    const CENTRAL: u32 = 0x0201_4b50;
    let lowest = zip.len().saturating_sub(22 + 0xffff);
    let end = (lowest..=zip.len().saturating_sub(22))
        .rev()
        .find(|&i| u32_at(zip, i).is_ok_and(|s| s == END))
        .ok_or("not a zip file (no end of central directory)")?;
    let count = u16_at(zip, end + 10)? as usize;
    let dir_size = u32_at(zip, end + 12)? as usize;
    let dir_offset = u32_at(zip, end + 16)? as usize;
    if dir_size > MAX_DIRECTORY_BYTES || dir_offset.checked_add(dir_size).is_none_or(|e| e > end) {
        return Err("zip: the central directory lies outside the file".into());
    }
    let mut entries = Vec::with_capacity(count.min(4096));
    let mut at = dir_offset;
    for _ in 0..count {
        if u32_at(zip, at)? != CENTRAL {
            return Err("zip: a central directory entry is malformed".into());
        }
        let name_len = u16_at(zip, at + 28)? as usize;
        let extra_len = u16_at(zip, at + 30)? as usize;
        let comment_len = u16_at(zip, at + 32)? as usize;
        let name = zip.get(at + 46..at + 46 + name_len).ok_or("zip: truncated name")?.to_vec();
        entries.push(Entry {
            name,
            method: u16_at(zip, at + 10)?,
            compressed: u64::from(u32_at(zip, at + 20)?),
            size: u64::from(u32_at(zip, at + 24)?),
            local_offset: u64::from(u32_at(zip, at + 42)?),
        });
        at += 46 + name_len + extra_len + comment_len;
    }
    Ok(entries)
}

fn entry_bytes(zip: &[u8], entry: &Entry, max: u64) -> Result<Vec<u8>, String> {
    const LOCAL: u32 = 0x0403_4b50;
    let at = usize::try_from(entry.local_offset).map_err(|_| "zip: offset too large")?;
    if u32_at(zip, at)? != LOCAL {
        return Err("zip: a local header is malformed".into());
    }
    let start = at + 30 + u16_at(zip, at + 26)? as usize + u16_at(zip, at + 28)? as usize;
    let len = usize::try_from(entry.compressed).map_err(|_| "zip: entry too large")?;
    let data = start
        .checked_add(len)
        .and_then(|e| zip.get(start..e))
        .ok_or("zip: an entry lies outside the file")?;
    if entry.size > max {
        return Err(format!("zip: an entry of {} bytes is larger than {max}", entry.size));
    }
    let mut out = Vec::new();
    match entry.method {
        0 => out.extend_from_slice(data),
        8 => {
            flate2::read::DeflateDecoder::new(data)
                .take(max + 1)
                .read_to_end(&mut out)
                .map_err(|e| format!("zip: inflating: {e}"))?;
        }
        m => return Err(format!("zip: compression method {m} is not read")),
    }
    if out.len() as u64 > max || out.len() as u64 != entry.size {
        return Err("zip: an entry's size is not what the directory says".into());
    }
    Ok(out)
}

fn varint(b: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at).ok_or("protobuf: truncated varint")?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Ok(v);
        }
    }
    Err("protobuf: varint too long".into())
}

/// A message's length-delimited fields, in order (other wire types skipped).
fn proto_fields(b: &[u8]) -> Result<Vec<(u64, &[u8])>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let key = varint(b, &mut at)?;
        match key & 7 {
            0 => {
                varint(b, &mut at)?;
            }
            1 => at = at.checked_add(8).filter(|&e| e <= b.len()).ok_or("protobuf: truncated")?,
            5 => at = at.checked_add(4).filter(|&e| e <= b.len()).ok_or("protobuf: truncated")?,
            2 => {
                let len = usize::try_from(varint(b, &mut at)?).map_err(|_| "protobuf: length too large")?;
                let end = at.checked_add(len).filter(|&e| e <= b.len()).ok_or("protobuf: truncated field")?;
                out.push((key >> 3, &b[at..end]));
                at = end;
            }
            w => return Err(format!("protobuf: wire type {w} is not read")),
        }
    }
    Ok(out)
}

/// One msgpack value as JSON (what a backend's configuration holds: maps with string
/// keys, strings, booleans, numbers, arrays, nil); nesting capped.
fn msgpack_value(b: &[u8], at: &mut usize, depth: usize) -> Result<serde_json::Value, String> {
    use serde_json::Value;
    if depth > 32 {
        return Err("msgpack: nested too deep".into());
    }
    let take = |at: &mut usize, n: usize| -> Result<&[u8], String> {
        let s = at.checked_add(n).and_then(|e| b.get(*at..e)).ok_or("msgpack: truncated")?;
        *at += n;
        Ok(s)
    };
    let be = |s: &[u8]| s.iter().fold(0u64, |acc, x| (acc << 8) | u64::from(*x));
    let tag = take(at, 1)?[0];
    let text = |at: &mut usize, n: usize| -> Result<Value, String> {
        Ok(Value::String(String::from_utf8_lossy(take(at, n)?).into_owned()))
    };
    let items = |at: &mut usize, n: usize| -> Result<Value, String> {
        (0..n).map(|_| msgpack_value(b, at, depth + 1)).collect::<Result<Vec<_>, _>>().map(Value::Array)
    };
    let map = |at: &mut usize, n: usize| -> Result<Value, String> {
        let mut m = serde_json::Map::new();
        for _ in 0..n {
            let k = match msgpack_value(b, at, depth + 1)? {
                Value::String(s) => s,
                other => other.to_string(),
            };
            m.insert(k, msgpack_value(b, at, depth + 1)?);
        }
        Ok(Value::Object(m))
    };
    Ok(match tag {
        0x00..=0x7f => Value::from(tag),
        0x80..=0x8f => map(at, usize::from(tag & 0x0f))?,
        0x90..=0x9f => items(at, usize::from(tag & 0x0f))?,
        0xa0..=0xbf => text(at, usize::from(tag & 0x1f))?,
        0xc0 => Value::Null,
        0xc2 => Value::Bool(false),
        0xc3 => Value::Bool(true),
        0xcc..=0xcf => {
            let n = 1usize << (tag - 0xcc);
            Value::from(be(take(at, n)?))
        }
        0xd0..=0xd3 => {
            let n = 1usize << (tag - 0xd0);
            let raw = be(take(at, n)?);
            let shift = 64 - 8 * n as u32;
            Value::from(((raw << shift) as i64) >> shift)
        }
        0xca => Value::from(f64::from(f32::from_bits(be(take(at, 4)?) as u32))),
        0xcb => Value::from(f64::from_bits(be(take(at, 8)?))),
        0xd9 => {
            let n = be(take(at, 1)?) as usize;
            text(at, n)?
        }
        0xda => {
            let n = be(take(at, 2)?) as usize;
            text(at, n)?
        }
        0xdb => {
            let n = be(take(at, 4)?) as usize;
            text(at, n)?
        }
        0xdc => {
            let n = be(take(at, 2)?) as usize;
            items(at, n)?
        }
        0xdd => {
            let n = be(take(at, 4)?) as usize;
            items(at, n)?
        }
        0xde => {
            let n = be(take(at, 2)?) as usize;
            map(at, n)?
        }
        0xdf => {
            let n = be(take(at, 4)?) as usize;
            map(at, n)?
        }
        0xe0..=0xff => Value::from(i64::from(tag as i8)),
        other => return Err(format!("msgpack: type 0x{other:02x} is not a configuration value")),
    })
}

/// `v` with every null (and every object left empty by that) removed: what a
/// configuration sets.
pub fn without_nulls(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| (k, without_nulls(v)))
                .filter(|(_, v)| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(without_nulls).collect()),
        other => other,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A stored zip of `entries` (what `zip -0` writes), for the reader's tests.
    pub(crate) fn stored_zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut central = Vec::new();
        for (name, data) in entries {
            let offset = out.len() as u32;
            let crc = 0u32;
            let mut local = Vec::new();
            local.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
            local.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            local.extend_from_slice(&crc.to_le_bytes());
            local.extend_from_slice(&(data.len() as u32).to_le_bytes());
            local.extend_from_slice(&(data.len() as u32).to_le_bytes());
            local.extend_from_slice(&(name.len() as u16).to_le_bytes());
            local.extend_from_slice(&0u16.to_le_bytes());
            local.extend_from_slice(name.as_bytes());
            local.extend_from_slice(data);
            out.extend_from_slice(&local);
            central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
            central.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            central.extend_from_slice(&crc.to_le_bytes());
            central.extend_from_slice(&(data.len() as u32).to_le_bytes());
            central.extend_from_slice(&(data.len() as u32).to_le_bytes());
            central.extend_from_slice(&(name.len() as u16).to_le_bytes());
            central.extend_from_slice(&[0; 12]);
            central.extend_from_slice(&offset.to_le_bytes());
            central.extend_from_slice(name.as_bytes());
        }
        let dir_offset = out.len() as u32;
        out.extend_from_slice(&central);
        out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        out.extend_from_slice(&[0, 0, 0, 0]);
        out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
        out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
        out.extend_from_slice(&(central.len() as u32).to_le_bytes());
        out.extend_from_slice(&dir_offset.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out
    }

    /// `tfplan` with a backend record as terraform 1.11 writes one.
    fn tfplan(kind: &str, msgpack: &[u8], workspace: &str) -> Vec<u8> {
        let field = |n: u8, v: &[u8]| {
            let mut f = vec![(n << 3) | 2, v.len() as u8];
            f.extend_from_slice(v);
            f
        };
        let dynamic = field(1, msgpack);
        let mut backend = field(1, kind.as_bytes());
        backend.extend(field(2, &dynamic));
        backend.extend(field(3, workspace.as_bytes()));
        let mut plan = vec![0x08, 0x03]; // version = 3
        plan.extend(field(13, &backend));
        plan
    }

    #[test]
    fn the_backend_record_of_a_plan_is_read() {
        // {"path": "terraform.tfstate", "workspace_dir": nil}, as terraform encodes it.
        let mut config = vec![0x82, 0xa4];
        config.extend_from_slice(b"path");
        config.push(0xb1);
        config.extend_from_slice(b"terraform.tfstate");
        config.push(0xad);
        config.extend_from_slice(b"workspace_dir");
        config.push(0xc0);
        let zip = stored_zip(&[("tfstate", b"{}"), ("tfplan", &tfplan("local", &config, "default"))]);
        let b = backend(&zip).expect("read");
        assert_eq!(b.kind, "local");
        assert_eq!(b.workspace, "default");
        assert_eq!(b.config, serde_json::json!({"path": "terraform.tfstate"}));
    }

    #[test]
    fn a_malformed_plan_file_is_an_error_not_a_panic() {
        let good = stored_zip(&[("tfplan", &tfplan("local", &[0x80], "default"))]);
        for cut in 0..good.len() {
            let _ = backend(&good[..cut]);
        }
        let mut flipped = good.clone();
        for i in 0..flipped.len() {
            flipped[i] ^= 0xff;
            let _ = backend(&flipped);
            flipped[i] ^= 0xff;
        }
        assert!(backend(b"not a zip").is_err());
        assert!(backend(&stored_zip(&[("other", b"x")])).is_err());
    }
}
