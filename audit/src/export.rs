//! The exported copy of an audit log: the object layout every sink that stores files
//! (an S3 bucket, a directory) writes, and its reassembly into an audit directory that
//! [`crate::verify::verify_dir`] checks.
//!
//! Under one runner's prefix:
//!
//! ```text
//! runner.pub                                     the runner's Ed25519 key (base64)
//! runner.vkey                                    the same as a signed-note verifier key
//! control-plane.pub                              the control plane's keys, one a line
//! records/<from>-<to>.jsonl                      records from..to-1, the log's exact lines
//! checkpoints/<from>-<to>.jsonl                  checkpoints.jsonl lines from..to-1
//! cosigned/<from>-<to>.jsonl                     cosigned.jsonl lines from..to-1
//! ```
//!
//! Numbers are zero-padded to 20 digits so names sort in order. An object is never
//! changed once written: the exporter writes records, then the checkpoints that cover
//! them, then cosignatures, and moves its cursor only after all three are stored. After
//! a crash between the two the same lines are written again, possibly in a larger
//! object; overlapping objects must agree byte for byte, and the reader takes each line
//! once.

use std::collections::BTreeMap;
use std::path::Path;

use crate::log::{CHECKPOINTS, CONTROL_PLANE_PUB, COSIGNED, LOG, RUNNER_PUB};

/// The signed-note verifier key (`name+hash+base64(0x01 || key)`), for third parties.
pub const RUNNER_VKEY: &str = "runner.vkey";
pub const RECORDS_DIR: &str = "records";
pub const CHECKPOINTS_DIR: &str = "checkpoints";
pub const COSIGNED_DIR: &str = "cosigned";

/// The three line streams an exported copy holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stream {
    Records,
    Checkpoints,
    Cosigned,
}

impl Stream {
    pub fn dir(self) -> &'static str {
        match self {
            Stream::Records => RECORDS_DIR,
            Stream::Checkpoints => CHECKPOINTS_DIR,
            Stream::Cosigned => COSIGNED_DIR,
        }
    }

    /// The file of the audit directory the stream is a copy of.
    pub fn file(self) -> &'static str {
        match self {
            Stream::Records => LOG,
            Stream::Checkpoints => CHECKPOINTS,
            Stream::Cosigned => COSIGNED,
        }
    }

    fn what(self) -> &'static str {
        match self {
            Stream::Records => "records",
            Stream::Checkpoints => "checkpoints",
            Stream::Cosigned => "cosigned checkpoints",
        }
    }
}

/// The name (relative to the runner's prefix) of the object holding lines `from..to`.
pub fn object_name(stream: Stream, from: u64, to: u64) -> String {
    format!("{}/{from:020}-{to:020}.jsonl", stream.dir())
}

/// The stream and line range an object name stands for; `None` for other names.
pub fn parse_object_name(name: &str) -> Option<(Stream, u64, u64)> {
    let (dir, file) = name.split_once('/')?;
    let stream =
        [Stream::Records, Stream::Checkpoints, Stream::Cosigned].into_iter().find(|s| s.dir() == dir)?;
    let (from, to) = file.strip_suffix(".jsonl")?.split_once('-')?;
    let digits = |s: &str| s.len() == 20 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(from) || !digits(to) {
        return None;
    }
    let (from, to) = (from.parse().ok()?, to.parse().ok()?);
    (from < to).then_some((stream, from, to))
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ExportError {
    #[error("{what} {from}..{to} are missing: no exported object holds them")]
    Gap { what: &'static str, from: u64, to: u64 },
    #[error("{object}: {reason}")]
    Object { object: String, reason: String },
    #[error("{first} and {second} disagree about line {line} of the {what}")]
    Disagree { what: &'static str, first: String, second: String, line: u64 },
    #[error("the copy has no {0}")]
    Missing(&'static str),
    #[error("writing the reassembled log to {path}: {reason}")]
    Io { path: String, reason: String },
}

/// What reassembly found.
#[derive(Debug, Default)]
pub struct Assembled {
    /// For each stream, the objects in order with the first line each contributed.
    pub sources: BTreeMap<Stream, Vec<(u64, String)>>,
    /// Objects under the prefix that are not part of the layout (ignored).
    pub ignored: Vec<String>,
}

impl Assembled {
    /// The object a record (line `seq` of the log) was read from.
    pub fn object_of(&self, stream: Stream, line: u64) -> Option<&str> {
        self.sources.get(&stream)?.iter().rev().find(|(first, _)| *first <= line).map(|(_, o)| o.as_str())
    }
}

/// Rebuild an audit directory in `out` from the objects under one runner's prefix
/// (names relative to it). Every line is checked to be where its object's name puts it;
/// a range no object holds is a gap, two objects saying different things about a line
/// are a conflict.
pub fn assemble(objects: &BTreeMap<String, Vec<u8>>, out: &Path) -> Result<Assembled, ExportError> {
    let mut assembled = Assembled::default();
    let mut ranges: BTreeMap<Stream, Vec<(u64, u64, &str)>> = BTreeMap::new();
    for name in objects.keys() {
        match parse_object_name(name) {
            Some((stream, from, to)) => ranges.entry(stream).or_default().push((from, to, name)),
            None if [RUNNER_PUB, CONTROL_PLANE_PUB, RUNNER_VKEY].contains(&name.as_str()) => {}
            None => assembled.ignored.push(name.clone()),
        }
    }
    let runner_pub = objects.get(RUNNER_PUB).ok_or(ExportError::Missing(RUNNER_PUB))?;
    let cp_pub = objects.get(CONTROL_PLANE_PUB).map(Vec::as_slice).unwrap_or_default();
    write(out, RUNNER_PUB, runner_pub)?;
    write(out, CONTROL_PLANE_PUB, cp_pub)?;
    for stream in [Stream::Records, Stream::Checkpoints, Stream::Cosigned] {
        let mut list = ranges.remove(&stream).unwrap_or_default();
        if stream == Stream::Records && list.is_empty() {
            return Err(ExportError::Missing("records"));
        }
        // By first line, the larger object first where two start at the same line.
        list.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut text: Vec<u8> = Vec::new();
        // The line each byte range of `text` holds, to compare overlaps.
        let mut line_starts: Vec<usize> = Vec::new();
        let mut owner: Vec<&str> = Vec::new();
        let mut sources = Vec::new();
        for (from, to, name) in list {
            let lines = split_lines(&objects[name])
                .map_err(|reason| ExportError::Object { object: name.to_string(), reason })?;
            if lines.len() as u64 != to - from {
                return Err(ExportError::Object {
                    object: name.to_string(),
                    reason: format!("holds {} lines, its name says {}", lines.len(), to - from),
                });
            }
            let have = line_starts.len() as u64;
            if from > have {
                return Err(ExportError::Gap { what: stream.what(), from: have, to: from });
            }
            for (i, line) in lines.iter().enumerate() {
                let n = from + i as u64;
                if n < have {
                    let start = line_starts[n as usize];
                    let end = line_starts.get(n as usize + 1).copied().unwrap_or(text.len());
                    if &text[start..end] != *line {
                        return Err(ExportError::Disagree {
                            what: stream.what(),
                            first: owner[n as usize].to_string(),
                            second: name.to_string(),
                            line: n,
                        });
                    }
                    continue;
                }
                // The first line this object adds.
                if sources.last().is_none_or(|(_, o): &(u64, String)| o != name) {
                    sources.push((n, name.to_string()));
                }
                line_starts.push(text.len());
                owner.push(name);
                text.extend_from_slice(line);
            }
            if stream == Stream::Records {
                check_sequence(&lines, from, name)?;
            }
        }
        write(out, stream.file(), &text)?;
        assembled.sources.insert(stream, sources);
    }
    Ok(assembled)
}

/// Whole lines, each with its newline; an object not ending in one is damaged.
fn split_lines(bytes: &[u8]) -> Result<Vec<&[u8]>, String> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    if bytes.last() != Some(&b'\n') {
        return Err("does not end with a whole line".into());
    }
    Ok(bytes.split_inclusive(|b| *b == b'\n').collect())
}

/// Each record line carries the sequence its object's name puts it at (a record moved
/// between objects is caught here, with the object named; the verifier checks the rest).
fn check_sequence(lines: &[&[u8]], from: u64, name: &str) -> Result<(), ExportError> {
    #[derive(serde::Deserialize)]
    struct Seq {
        seq: u64,
    }
    for (i, line) in lines.iter().enumerate() {
        let want = from + i as u64;
        match serde_json::from_slice::<Seq>(line) {
            Ok(Seq { seq }) if seq == want => {}
            Ok(Seq { seq }) => {
                return Err(ExportError::Object {
                    object: name.to_string(),
                    reason: format!("line {} carries record {seq}, its name puts record {want} there", i + 1),
                });
            }
            Err(e) => {
                return Err(ExportError::Object {
                    object: name.to_string(),
                    reason: format!("line {} (record {want}) is not a record: {e}", i + 1),
                });
            }
        }
    }
    Ok(())
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), ExportError> {
    let path = dir.join(name);
    std::fs::write(&path, bytes)
        .map_err(|e| ExportError::Io { path: path.display().to_string(), reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::{AuditWriter, Record};

    /// An audit dir of `n` records in commits of three, exported in objects of `step`
    /// records (with the checkpoints each covers).
    fn exported(n: usize, step: u64) -> BTreeMap<String, Vec<u8>> {
        let dir = tempfile::tempdir().unwrap();
        let key = byoc_protocol::generate_signing_key();
        let (mut w, _) = AuditWriter::open(dir.path(), key, "rn-1", "inst-1", &[]).unwrap();
        for i in 0..n {
            w.append(Record { event: format!("e{i}"), ..Default::default() }).unwrap();
        }
        let mut objects = BTreeMap::new();
        for (stream, chunk) in
            [(Stream::Records, step), (Stream::Checkpoints, step), (Stream::Cosigned, step)]
        {
            let text = std::fs::read(dir.path().join(stream.file())).unwrap_or_default();
            let lines: Vec<&[u8]> = text.split_inclusive(|b| *b == b'\n').collect();
            for (i, part) in lines.chunks(chunk as usize).enumerate() {
                let from = i as u64 * chunk;
                objects.insert(object_name(stream, from, from + part.len() as u64), part.concat());
            }
        }
        for name in [RUNNER_PUB, CONTROL_PLANE_PUB] {
            objects.insert(name.to_string(), std::fs::read(dir.path().join(name)).unwrap());
        }
        objects
    }

    #[test]
    fn names_sort_in_order_and_parse_back() {
        let n = object_name(Stream::Records, 9, 10);
        assert_eq!(n, "records/00000000000000000009-00000000000000000010.jsonl");
        assert!(n < object_name(Stream::Records, 10, 11));
        assert_eq!(parse_object_name(&n), Some((Stream::Records, 9, 10)));
        for bad in [
            "records/9-10.jsonl",
            "records/00000000000000000010-00000000000000000010.jsonl",
            "other/00000000000000000009-00000000000000000010.jsonl",
            "records/00000000000000000009-00000000000000000010.json",
        ] {
            assert_eq!(parse_object_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_whole_copy_reassembles_into_the_original_files() {
        let objects = exported(10, 4);
        let out = tempfile::tempdir().unwrap();
        let a = assemble(&objects, out.path()).unwrap();
        let log = std::fs::read_to_string(out.path().join(LOG)).unwrap();
        assert_eq!(log.lines().count(), 10);
        assert_eq!(a.object_of(Stream::Records, 5), Some(object_name(Stream::Records, 4, 8).as_str()));
        assert!(a.ignored.is_empty());
    }

    #[test]
    fn overlapping_objects_that_agree_are_read_once_and_disagreeing_ones_are_named() {
        let mut objects = exported(10, 4);
        // A retried export wrote 4..10 again in one object beside 4..8 and 8..10.
        let whole: Vec<u8> = [4u64, 8]
            .iter()
            .flat_map(|f| objects[&object_name(Stream::Records, *f, (*f + 4).min(10))].clone())
            .collect();
        objects.insert(object_name(Stream::Records, 4, 10), whole.clone());
        let out = tempfile::tempdir().unwrap();
        assemble(&objects, out.path()).unwrap();
        assert_eq!(std::fs::read_to_string(out.path().join(LOG)).unwrap().lines().count(), 10);

        let altered = String::from_utf8(whole).unwrap().replacen("e5", "e6", 1);
        objects.insert(object_name(Stream::Records, 4, 10), altered.into_bytes());
        let err = assemble(&objects, out.path()).unwrap_err();
        assert!(matches!(err, ExportError::Disagree { line: 5, .. }), "{err}");
    }

    #[test]
    fn a_removed_object_is_a_gap_and_a_moved_record_is_named() {
        let mut objects = exported(10, 4);
        objects.remove(&object_name(Stream::Records, 4, 8));
        let out = tempfile::tempdir().unwrap();
        assert_eq!(
            assemble(&objects, out.path()).unwrap_err(),
            ExportError::Gap { what: "records", from: 4, to: 8 }
        );

        let mut objects = exported(10, 4);
        let first = object_name(Stream::Records, 0, 4);
        let text = String::from_utf8(objects[&first].clone()).unwrap();
        let mut lines: Vec<&str> = text.split_inclusive('\n').collect();
        lines.swap(1, 2);
        objects.insert(first.clone(), lines.concat().into_bytes());
        let err = assemble(&objects, out.path()).unwrap_err();
        assert!(
            matches!(&err, ExportError::Object { object, reason } if *object == first && reason.contains("line 2 carries record 2")),
            "{err}"
        );

        let mut objects = exported(10, 4);
        objects.insert(
            object_name(Stream::Records, 8, 11),
            objects[&object_name(Stream::Records, 8, 10)].clone(),
        );
        assert!(matches!(assemble(&objects, out.path()).unwrap_err(), ExportError::Object { .. }));

        let mut objects = exported(3, 4);
        objects.remove(RUNNER_PUB);
        assert_eq!(assemble(&objects, out.path()).unwrap_err(), ExportError::Missing(RUNNER_PUB));
    }
}
