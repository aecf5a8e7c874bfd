//! Secret masking for job output, applied before a byte reaches the spool.
//!
//! Each secret is masked as itself and in the encodings tools commonly print it in:
//! base64 (standard and URL-safe, at all three byte alignments, so it is caught inside
//! a longer base64 blob too), JSON string escaping and URL (percent and form) encoding.
//! The stream is masked across read boundaries: the last `longest pattern − 1` bytes
//! are held back until more output (or the end) shows whether they start a secret.

use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine as _;

use crate::OutputSink;

/// What a masked secret is replaced with.
pub const MASK: &[u8] = b"***";
/// Shorter secrets cannot be masked without also masking ordinary output.
pub const MIN_SECRET_LEN: usize = 4;
/// Encoded fragments shorter than this are not masked (too likely to occur by chance).
const MIN_FRAGMENT_LEN: usize = 6;

#[derive(Debug, thiserror::Error)]
pub enum MaskError {
    #[error("a secret value is shorter than {MIN_SECRET_LEN} bytes and cannot be masked reliably")]
    TooShort,
}

/// Every byte string that reveals `secret` (the secret and its encoded forms).
pub fn patterns_for(secret: &[u8]) -> Vec<Vec<u8>> {
    let mut out = vec![secret.to_vec()];
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

fn percent_encode(bytes: &[u8], form: bool) -> Vec<u8> {
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

#[derive(Clone)]
pub struct Masker {
    matcher: Option<AhoCorasick>,
    hold_back: usize,
    patterns: std::sync::Arc<Vec<Vec<u8>>>,
    /// Bytes some pattern starts with: only a tail starting with one can be held.
    first_bytes: std::sync::Arc<[bool; 256]>,
}

impl Masker {
    pub fn new<S: AsRef<[u8]>>(secrets: &[S]) -> Result<Masker, MaskError> {
        let mut patterns = Vec::new();
        for s in secrets {
            let s = s.as_ref();
            if s.len() < MIN_SECRET_LEN {
                return Err(MaskError::TooShort);
            }
            patterns.extend(patterns_for(s));
        }
        if patterns.is_empty() {
            return Ok(Masker::none());
        }
        let longest = patterns.iter().map(Vec::len).max().unwrap_or(1);
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .expect("literal patterns always build");
        let mut first_bytes = [false; 256];
        for p in &patterns {
            first_bytes[p[0] as usize] = true;
        }
        Ok(Masker {
            matcher: Some(matcher),
            hold_back: longest - 1,
            patterns: std::sync::Arc::new(patterns),
            first_bytes: std::sync::Arc::new(first_bytes),
        })
    }

    pub fn none() -> Masker {
        Masker {
            matcher: None,
            hold_back: 0,
            patterns: Default::default(),
            first_bytes: std::sync::Arc::new([false; 256]),
        }
    }

    /// Where the tail that might still become a secret starts: the earliest position
    /// (within the last `hold_back` bytes) from which the rest is a proper prefix of a
    /// pattern. Holding back only that keeps ordinary output flowing (a line without
    /// any secret's beginning is passed on at once, even when secrets are long).
    fn undecided_from(&self, data: &[u8]) -> usize {
        let start = data.len().saturating_sub(self.hold_back);
        (start..data.len())
            .find(|&p| {
                self.first_bytes[data[p] as usize] && {
                    let tail = &data[p..];
                    self.patterns.iter().any(|pat| pat.len() > tail.len() && pat.starts_with(tail))
                }
            })
            .unwrap_or(data.len())
    }

    /// Mask a complete string (errors, outputs).
    pub fn mask_str(&self, s: &str) -> String {
        match &self.matcher {
            None => s.to_string(),
            Some(m) => m.replace_all(s, &vec!["***"; m.patterns_len()]),
        }
    }

    /// Mask `data` (pending bytes + new bytes). With `last`, everything is emitted;
    /// otherwise the tail that might begin a secret is returned as the new pending.
    fn process(&self, data: &[u8], last: bool, out: &mut Vec<u8>) -> usize {
        let Some(m) = &self.matcher else {
            out.extend_from_slice(data);
            return data.len();
        };
        let limit = if last { data.len() } else { self.undecided_from(data) };
        let mut pos = 0;
        for found in m.find_iter(data) {
            if found.start() >= limit {
                break;
            }
            out.extend_from_slice(&data[pos..found.start()]);
            out.extend_from_slice(MASK);
            pos = found.end();
        }
        let emit_to = limit.max(pos);
        out.extend_from_slice(&data[pos..emit_to]);
        emit_to
    }
}

/// Secrets that become known while a job runs (a refreshed role session's keys). A
/// secret is added here *before* it is handed to the job, so every byte the job could
/// print after learning it is masked.
#[derive(Clone, Default)]
pub struct SecretFeed {
    inner: std::sync::Arc<std::sync::Mutex<(u64, Vec<Vec<u8>>)>>,
}

impl SecretFeed {
    pub fn add(&self, secret: impl Into<Vec<u8>>) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += 1;
        g.1.push(secret.into());
    }

    fn generation(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    pub fn secrets(&self) -> Vec<Vec<u8>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).1.clone()
    }
}

/// An output sink that masks secrets before passing bytes on.
pub struct MaskingSink<'a> {
    masker: Masker,
    inner: &'a mut dyn OutputSink,
    pending: Vec<u8>,
    /// Secrets fixed at start, plus the feed of ones learned later and the feed
    /// generation the masker was last built for.
    feed: Option<(Vec<Vec<u8>>, SecretFeed, u64)>,
}

impl<'a> MaskingSink<'a> {
    pub fn new(masker: Masker, inner: &'a mut dyn OutputSink) -> Self {
        MaskingSink { masker, inner, pending: Vec::new(), feed: None }
    }

    /// A sink whose masker grows with `feed`.
    pub fn with_feed(
        base: Vec<Vec<u8>>,
        feed: SecretFeed,
        inner: &'a mut dyn OutputSink,
    ) -> Result<Self, MaskError> {
        let mut all = base.clone();
        all.extend(feed.secrets());
        let generation = feed.generation();
        Ok(MaskingSink {
            masker: Masker::new(&all)?,
            inner,
            pending: Vec::new(),
            feed: Some((base, feed, generation)),
        })
    }

    /// The masker as of now (every secret so far), for errors and outputs.
    pub fn current_masker(&mut self) -> Masker {
        self.refresh();
        self.masker.clone()
    }

    fn refresh(&mut self) {
        if let Some((base, feed, seen)) = &mut self.feed {
            let generation = feed.generation();
            if generation != *seen {
                let mut all = base.clone();
                all.extend(feed.secrets());
                // Fed secrets are credentials, never short; a too-short one is skipped
                // rather than unmasking everything.
                let usable: Vec<Vec<u8>> = all.into_iter().filter(|s| s.len() >= MIN_SECRET_LEN).collect();
                if let Ok(m) = Masker::new(&usable) {
                    self.masker = m;
                }
                *seen = generation;
            }
        }
    }

    /// Emit what was held back. Call once, when the output has ended.
    pub fn flush_end(&mut self) -> std::io::Result<()> {
        self.refresh();
        let data = std::mem::take(&mut self.pending);
        let mut out = Vec::with_capacity(data.len());
        self.masker.process(&data, true, &mut out);
        if out.is_empty() { Ok(()) } else { self.inner.write(&out) }
    }
}

impl OutputSink for MaskingSink<'_> {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        self.refresh();
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len());
        let consumed = self.masker.process(&self.pending, false, &mut out);
        self.pending.drain(..consumed);
        if out.is_empty() { Ok(()) } else { self.inner.write(&out) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng as _, SeedableRng as _};

    fn all_encodings(secret: &str) -> Vec<String> {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE};
        vec![
            secret.to_string(),
            STANDARD.encode(secret),
            URL_SAFE.encode(secret),
            serde_json::to_string(secret).unwrap(),
            String::from_utf8(percent_encode(secret.as_bytes(), false)).unwrap(),
            String::from_utf8(percent_encode(secret.as_bytes(), true)).unwrap(),
            // Inside a longer base64 blob at each alignment.
            STANDARD.encode(format!("x{secret}y")),
            STANDARD.encode(format!("xy{secret}z")),
            STANDARD.encode(format!("{{\"password\":\"{secret}\"}}")),
        ]
    }

    fn mask_in_chunks(masker: &Masker, input: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut sink = MaskingSink::new(masker.clone(), &mut out);
            let mut last = 0;
            for &c in cuts {
                sink.write(&input[last..c]).unwrap();
                last = c;
            }
            sink.write(&input[last..]).unwrap();
            sink.flush_end().unwrap();
        }
        out
    }

    /// The revealing part of each encoding (what must never survive).
    fn tell_tales(secret: &str) -> Vec<Vec<u8>> {
        patterns_for(secret.as_bytes())
    }

    #[test]
    fn masks_every_encoding_whatever_the_read_boundaries() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let secrets = ["hunter2-s3cr3t", "p@ss w/rd&x=1\"q\\", "AKIAIOSFODNN7EXAMPLE", "ümlaut-päss"];
        let masker = Masker::new(&secrets).unwrap();
        for round in 0..300 {
            let mut input = Vec::new();
            for _ in 0..rng.random_range(1..8) {
                let filler: String =
                    (0..rng.random_range(0..40)).map(|_| rng.random_range(b' '..=b'~') as char).collect();
                input.extend_from_slice(filler.as_bytes());
                let secret = secrets[rng.random_range(0..secrets.len())];
                let enc = all_encodings(secret);
                input.extend_from_slice(enc[rng.random_range(0..enc.len())].as_bytes());
            }
            let mut cuts: Vec<usize> =
                (0..rng.random_range(0..10)).map(|_| rng.random_range(0..=input.len())).collect();
            cuts.sort_unstable();
            let out = mask_in_chunks(&masker, &input, &cuts);
            let whole = mask_in_chunks(&masker, &input, &[]);
            assert_eq!(out, whole, "round {round}: chunking changed the result");
            for s in secrets {
                for t in tell_tales(s) {
                    assert!(
                        !out.windows(t.len()).any(|w| w == t.as_slice()),
                        "round {round}: {:?} survived in {:?}",
                        String::from_utf8_lossy(&t),
                        String::from_utf8_lossy(&out)
                    );
                }
            }
        }
    }

    #[test]
    fn each_encoding_on_its_own_is_masked() {
        let secrets = ["hunter2-s3cr3t", "p@ss w/rd&x=1\"q\\", "AKIAIOSFODNN7EXAMPLE"];
        let masker = Masker::new(&secrets).unwrap();
        for s in secrets {
            for enc in all_encodings(s) {
                let out = masker.mask_str(&enc);
                assert_ne!(out, enc, "{enc:?} (of {s:?}) passed unmasked");
                assert!(out.contains("***"));
            }
        }
    }

    #[test]
    fn output_without_secrets_passes_unchanged_byte_for_byte() {
        let masker = Masker::new(&["topsecret-value"]).unwrap();
        let input: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let out = mask_in_chunks(&masker, &input, &[1, 17, 4096, 9999]);
        assert_eq!(out, input);
    }

    #[test]
    fn split_secret_is_masked() {
        let masker = Masker::new(&["split-me-secret"]).unwrap();
        let input = b"before split-me-secret after";
        for cut in 0..input.len() {
            let out = mask_in_chunks(&masker, input, &[cut]);
            assert_eq!(out, b"before *** after", "cut at {cut}");
        }
    }

    struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl OutputSink for Shared {
        fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
            self.0.lock().unwrap().extend_from_slice(chunk);
            Ok(())
        }
    }

    #[test]
    fn output_is_held_back_only_while_it_could_begin_a_secret() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut inner = Shared(seen.clone());
        let secret = "a-long-session-token-".repeat(40);
        let mut sink = MaskingSink::new(Masker::new(&[secret.as_str()]).unwrap(), &mut inner);
        // Nothing here can start a secret: passed on at once despite an 840-byte secret.
        sink.write(b"waiting\n").unwrap();
        assert_eq!(seen.lock().unwrap().as_slice(), b"waiting\n");
        // A tail that may begin the secret waits for more output.
        sink.write(b"value: a-long-sess").unwrap();
        assert_eq!(seen.lock().unwrap().as_slice(), b"waiting\nvalue: ");
        sink.write(&secret.as_bytes()["a-long-sess".len()..]).unwrap();
        sink.write(b" done\n").unwrap();
        sink.flush_end().unwrap();
        assert_eq!(String::from_utf8_lossy(&seen.lock().unwrap()), "waiting\nvalue: *** done\n");
    }

    #[test]
    fn secrets_fed_while_running_are_masked_from_then_on() {
        let mut out = Vec::new();
        let feed = SecretFeed::default();
        let mut sink =
            MaskingSink::with_feed(vec![b"fixed-secret".to_vec()], feed.clone(), &mut out).unwrap();
        sink.write(b"before: fixed-secret late-secret-1 ").unwrap();
        feed.add(b"late-secret-2".to_vec());
        sink.write(b"after: late-secret-2 ").unwrap();
        let b64 = base64::engine::general_purpose::STANDARD.encode(b"late-secret-2");
        sink.write(format!("{b64} end").as_bytes()).unwrap();
        let m = sink.current_masker();
        sink.flush_end().unwrap();
        let text = String::from_utf8(out).unwrap();
        // The base64 form's last characters mix in what follows the secret: not masked.
        assert_eq!(text, "before: *** late-secret-1 after: *** ***g== end");
        assert_eq!(m.mask_str("x late-secret-2 fixed-secret"), "x *** ***");
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(matches!(Masker::new(&["abc"]), Err(MaskError::TooShort)));
        assert_eq!(Masker::new::<&str>(&[]).unwrap().mask_str("x"), "x");
        assert_eq!(Masker::new(&["abcd1234"]).unwrap().mask_str("k=abcd1234"), "k=***");
    }
}
