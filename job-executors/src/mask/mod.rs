//! Secret masking for job output, applied before a byte reaches the spool.
//!
//! A secret is matched character by character: each character may appear literally or
//! in any of the escapes tools print text in — percent-encoding (either hex case, `+`
//! for a space), JSON/JavaScript (`\/`, `\"`, `\n`…, `\uXXXX` in either case, surrogate
//! pairs), `\xHH` — in any mixture, so `quote()` leaving `/` alone, lower-case hex and
//! `\/` are all caught without a list of whole-string encodings. Base64 and base64url
//! are matched as the characters fixed by the secret at each of the three byte
//! alignments, with or without padding (a secret inside a longer blob is caught too).
//!
//! One regex (all secrets, all forms) finds matches; the stream is masked across read
//! boundaries by holding back only the tail from which a match could still complete,
//! decided by an anchored lazy DFA of the same regex.

use std::sync::Arc;

use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::{Anchored, Input, MatchKind, meta, util::syntax};

use crate::OutputSink;

mod forms;
pub use forms::patterns_for;
use forms::{base64_fragments, lits, secret_forms};

/// What a masked secret is replaced with.
pub const MASK: &[u8] = b"***";
/// Shorter secrets cannot be masked without also masking ordinary output.
pub const MIN_SECRET_LEN: usize = 4;
#[derive(Debug, thiserror::Error)]
pub enum MaskError {
    #[error("a secret value is shorter than {MIN_SECRET_LEN} bytes and cannot be masked reliably")]
    TooShort,
    /// Never carries the regex's own error text: it would quote the secrets.
    #[error("the secrets' masking automaton could not be built ({0})")]
    Build(&'static str),
}

struct Compiled {
    /// Leftmost-first over every alternative, longest alternatives first.
    finder: meta::Regex,
    /// The same alternatives, anchored, every match kept alive: is a tail the start of
    /// a match that more output could complete?
    continues: DFA,
    /// The longest match less one: no more than this is ever held back.
    hold_back: usize,
}

#[derive(Clone)]
pub struct Masker {
    compiled: Option<Arc<Compiled>>,
}

/// Per-sink scratch for the lazy DFA.
pub struct MaskCache(Option<Cache>);

impl Masker {
    pub fn new<S: AsRef<[u8]>>(secrets: &[S]) -> Result<Masker, MaskError> {
        let mut alternatives: Vec<(usize, String)> = Vec::new();
        for s in secrets {
            let s = s.as_ref();
            if s.len() < MIN_SECRET_LEN {
                return Err(MaskError::TooShort);
            }
            let (re, longest) = secret_forms(s);
            alternatives.push((longest, re));
            for fragment in base64_fragments(s) {
                let mut re = String::new();
                lits(&mut re, &fragment);
                alternatives.push((fragment.len(), re));
            }
        }
        if alternatives.is_empty() {
            return Ok(Masker::none());
        }
        alternatives.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        alternatives.dedup();
        let longest = alternatives[0].0;
        let pattern = alternatives.iter().map(|(_, re)| format!("(?:{re})")).collect::<Vec<_>>().join("|");
        // Bytes, not text: secrets and output need not be UTF-8.
        let syntax = syntax::Config::new().unicode(false).utf8(false);
        let finder = meta::Regex::builder()
            .syntax(syntax)
            .configure(meta::Config::new().utf8_empty(false).nfa_size_limit(None))
            .build(&pattern)
            .map_err(|e| MaskError::Build(if e.size_limit().is_some() { "too large" } else { "invalid" }))?;
        let continues = DFA::builder()
            .syntax(syntax)
            .thompson(regex_automata::nfa::thompson::Config::new().utf8(false).nfa_size_limit(None))
            .configure(
                DFA::config()
                    .match_kind(MatchKind::All)
                    .starts_for_each_pattern(false)
                    .skip_cache_capacity_check(true),
            )
            .build(&pattern)
            .map_err(|_| MaskError::Build("lazy DFA"))?;
        Ok(Masker { compiled: Some(Arc::new(Compiled { finder, continues, hold_back: longest - 1 })) })
    }

    pub fn none() -> Masker {
        Masker { compiled: None }
    }

    pub fn cache(&self) -> MaskCache {
        MaskCache(self.compiled.as_ref().map(|c| c.continues.create_cache()))
    }

    /// Mask a complete string (errors, outputs).
    pub fn mask_str(&self, s: &str) -> String {
        let mut out = Vec::with_capacity(s.len());
        self.process(&mut self.cache(), s.as_bytes(), true, &mut out);
        String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    /// Mask `data` (pending bytes + new bytes). With `last`, everything is emitted;
    /// otherwise the tail that might begin a secret is left: returns how much of `data`
    /// was consumed.
    fn process(&self, cache: &mut MaskCache, data: &[u8], last: bool, out: &mut Vec<u8>) -> usize {
        let Some(c) = &self.compiled else {
            out.extend_from_slice(data);
            return data.len();
        };
        let limit = match (&mut cache.0, last) {
            (Some(cache), false) => c.undecided_from(cache, data),
            _ => data.len(),
        };
        let mut pos = 0;
        for found in c.finder.find_iter(data) {
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

impl Compiled {
    /// Where the tail that might still become a secret starts: the earliest position
    /// (within the last `hold_back` bytes) from which a match could still complete.
    /// Holding back only that keeps ordinary output flowing (a line without any
    /// secret's beginning is passed on at once, however long the secrets).
    fn undecided_from(&self, cache: &mut Cache, data: &[u8]) -> usize {
        let start = data.len().saturating_sub(self.hold_back);
        (start..data.len()).find(|&p| self.may_continue(cache, &data[p..])).unwrap_or(data.len())
    }

    fn may_continue(&self, cache: &mut Cache, tail: &[u8]) -> bool {
        let input = Input::new(tail).anchored(Anchored::Yes);
        // A DFA that cannot answer (cache exhausted) holds the tail: fail closed.
        let Ok(mut state) = self.continues.start_state_forward(cache, &input) else {
            return true;
        };
        for &b in tail {
            match self.continues.next_state(cache, state, b) {
                Ok(next) if next.is_dead() => return false,
                Ok(next) => state = next,
                Err(_) => return true,
            }
        }
        true
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
    cache: MaskCache,
    inner: &'a mut dyn OutputSink,
    pending: Vec<u8>,
    /// Secrets fixed at start, plus the feed of ones learned later and the feed
    /// generation the masker was last built for.
    feed: Option<(Vec<Vec<u8>>, SecretFeed, u64)>,
}

impl<'a> MaskingSink<'a> {
    pub fn new(masker: Masker, inner: &'a mut dyn OutputSink) -> Self {
        MaskingSink { cache: masker.cache(), masker, inner, pending: Vec::new(), feed: None }
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
        let masker = Masker::new(&all)?;
        Ok(MaskingSink {
            cache: masker.cache(),
            masker,
            inner,
            pending: Vec::new(),
            feed: Some((base, feed, generation)),
        })
    }

    /// The masker as of now (every secret so far), for errors and outputs.
    pub fn current_masker(&mut self) -> std::io::Result<Masker> {
        self.refresh()?;
        Ok(self.masker.clone())
    }

    /// Rebuild the masker if secrets were fed since. A masker that cannot be built
    /// stops the output (an error) rather than let a new secret through unmasked.
    fn refresh(&mut self) -> std::io::Result<()> {
        if let Some((base, feed, seen)) = &mut self.feed {
            let generation = feed.generation();
            if generation != *seen {
                let mut all = base.clone();
                all.extend(feed.secrets());
                // Fed secrets are credentials, never short; a too-short one is skipped
                // rather than unmasking everything.
                let usable: Vec<Vec<u8>> = all.into_iter().filter(|s| s.len() >= MIN_SECRET_LEN).collect();
                let masker = Masker::new(&usable).map_err(std::io::Error::other)?;
                self.cache = masker.cache();
                self.masker = masker;
                *seen = generation;
            }
        }
        Ok(())
    }

    /// Emit what was held back. Call once, when the output has ended.
    pub fn flush_end(&mut self) -> std::io::Result<()> {
        self.refresh()?;
        let data = std::mem::take(&mut self.pending);
        let mut out = Vec::with_capacity(data.len());
        self.masker.process(&mut self.cache, &data, true, &mut out);
        if out.is_empty() { Ok(()) } else { self.inner.write(&out) }
    }
}

impl OutputSink for MaskingSink<'_> {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        self.refresh()?;
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len());
        let consumed = self.masker.process(&mut self.cache, &self.pending, false, &mut out);
        self.pending.drain(..consumed);
        if out.is_empty() { Ok(()) } else { self.inner.write(&out) }
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;

    use super::forms::{percent_encode, short_escape};
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
        let m = sink.current_masker().unwrap();
        sink.flush_end().unwrap();
        let text = String::from_utf8(out).unwrap();
        // The base64 form's last characters mix in what follows the secret: not masked.
        assert_eq!(text, "before: *** late-secret-1 after: *** ***g== end");
        assert_eq!(m.mask_str("x late-secret-2 fixed-secret"), "x *** ***");
    }

    /// Issue 21: forms real tools print that a list of whole-string encodings missed.
    #[test]
    fn partial_and_lower_case_percent_encoding_and_json_slash_are_masked() {
        let secret = "s3cr3t-T0ken/with+chars==";
        let masker = Masker::new(&[secret]).unwrap();
        for form in [
            // Python's urllib.parse.quote, JavaScript's encodeURI: `/` left as is.
            "s3cr3t-T0ken/with%2Bchars%3D%3D",
            // Lower-case hex.
            "s3cr3t-T0ken%2fwith%2bchars%3d%3d",
            // JSON with `\/`.
            r"s3cr3t-T0ken\/with+chars==",
            // \u escapes, mixed case, in JavaScript source.
            r"s3cr3t-T0ken\u002fwith\u002Bchars\u003d=",
            // Python bytes repr.
            r"s3cr3t-T0ken\x2fwith+chars\x3d\x3d",
        ] {
            assert_eq!(masker.mask_str(&format!("url={form}&x=1")), "url=***&x=1", "{form}");
            for cut in 0..form.len() + 6 {
                let line = format!("url={form}&x=1\n");
                let out = mask_in_chunks(&masker, line.as_bytes(), &[cut.min(line.len())]);
                assert_eq!(String::from_utf8(out).unwrap(), "url=***&x=1\n", "{form} cut at {cut}");
            }
        }
    }

    /// Every character of `c` in one of the forms a tool may print it in, chosen at random.
    fn random_form(rng: &mut rand::rngs::StdRng, c: char) -> String {
        let case = |rng: &mut rand::rngs::StdRng, hex: String| {
            hex.chars()
                .map(|h| if rng.random_bool(0.5) { h.to_ascii_uppercase() } else { h })
                .collect::<String>()
        };
        let mut utf8 = [0u8; 4];
        let bytes = c.encode_utf8(&mut utf8).as_bytes().to_vec();
        match rng.random_range(0..6) {
            0 => bytes.iter().map(|b| format!("%{}", case(rng, format!("{b:02x}")))).collect(),
            1 => bytes.iter().map(|b| format!("\\x{}", case(rng, format!("{b:02x}")))).collect(),
            2 => {
                let mut units = [0u16; 2];
                c.encode_utf16(&mut units)
                    .iter()
                    .map(|u| format!("\\u{}", case(rng, format!("{u:04x}"))))
                    .collect()
            }
            3 if short_escape(c).is_some() => String::from_utf8(short_escape(c).unwrap().to_vec()).unwrap(),
            4 if c == ' ' => "+".into(),
            _ => c.to_string(),
        }
    }

    #[test]
    fn any_mixture_of_literal_and_escaped_characters_is_masked() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let alphabet: Vec<char> = (' '..='~').chain(['é', 'ß', '€', '😀']).collect();
        for round in 0..400 {
            let secrets: Vec<String> = (0..rng.random_range(1..4))
                .map(|_| {
                    (0..rng.random_range(MIN_SECRET_LEN..40))
                        .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                        .collect()
                })
                .collect();
            let masker = Masker::new(&secrets).unwrap();
            // Filler that no secret's form can begin or end with, so the expected
            // output is exact.
            let filler = |rng: &mut rand::rngs::StdRng| -> Vec<u8> {
                (0..rng.random_range(1..20))
                    .map(|_| [1u8, 2, 3, 4, 5, 6, 7, b'\n'][rng.random_range(0..8)])
                    .collect()
            };
            let (mut input, mut expected) = (Vec::new(), Vec::new());
            for _ in 0..rng.random_range(1..5) {
                let f = filler(&mut rng);
                input.extend_from_slice(&f);
                expected.extend_from_slice(&f);
                let secret = &secrets[rng.random_range(0..secrets.len())];
                let form: String = secret.chars().map(|c| random_form(&mut rng, c)).collect();
                input.extend_from_slice(form.as_bytes());
                expected.extend_from_slice(MASK);
            }
            let f = filler(&mut rng);
            input.extend_from_slice(&f);
            expected.extend_from_slice(&f);
            let mut cuts: Vec<usize> =
                (0..rng.random_range(0..6)).map(|_| rng.random_range(0..=input.len())).collect();
            cuts.sort_unstable();
            let out = mask_in_chunks(&masker, &input, &cuts);
            assert_eq!(
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&expected),
                "round {round}: secrets {secrets:?}, input {:?}",
                String::from_utf8_lossy(&input)
            );
        }
    }

    #[test]
    fn long_secrets_build_and_mask() {
        // An STS session token is about 1,000 characters; a refreshed role adds three more.
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let b64: Vec<char> = ('A'..='Z').chain('a'..='z').chain('0'..='9').chain(['+', '/']).collect();
        let token: String = (0..1100).map(|_| b64[rng.random_range(0..b64.len())]).collect();
        let mut secrets = vec![token.clone()];
        secrets.extend((0..19).map(|i| format!("secret-number-{i}-{}", "x".repeat(i * 5))));
        let masker = Masker::new(&secrets).unwrap();
        let quoted = token.replace('+', "%2B").replace('/', "%2f");
        let text = format!("token={token}\nurl=?t={quoted}&a=1\n");
        assert_eq!(masker.mask_str(&text), "token=***\nurl=?t=***&a=1\n");
        let out = mask_in_chunks(&masker, text.as_bytes(), &[10, 700, 1500, 2300]);
        assert_eq!(String::from_utf8(out).unwrap(), "token=***\nurl=?t=***&a=1\n");
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(matches!(Masker::new(&["abc"]), Err(MaskError::TooShort)));
        assert_eq!(Masker::new::<&str>(&[]).unwrap().mask_str("x"), "x");
        assert_eq!(Masker::new(&["abcd1234"]).unwrap().mask_str("k=abcd1234"), "k=***");
    }
}
