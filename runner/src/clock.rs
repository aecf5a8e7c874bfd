//! The runner's one clock. Code that decides by time (envelope expiry, lease and
//! session lifetimes) takes a `&dyn Clock` where a test must fix the time; everything
//! else reads `now_ms()`/`unix_now()`, which are the system clock.

/// A time as RFC 3339 in UTC (`2026-11-27T23:12:15Z`): the one way the runner writes a
/// time in logs, reports, the CLI and the role session's files. Out of range: the number.
pub fn rfc3339(unix_secs: i64) -> String {
    jiff::Timestamp::from_second(unix_secs).map(|t| t.to_string()).unwrap_or_else(|_| unix_secs.to_string())
}

/// `rfc3339` of a time in milliseconds (to the second).
pub fn rfc3339_ms(ms: u64) -> String {
    rfc3339((ms / 1000) as i64)
}

/// As [`rfc3339_ms`], with the milliseconds: `2026-11-27T09:00:00.040Z`.
pub fn rfc3339_millis(ms: u64) -> String {
    let whole = rfc3339_ms(ms);
    format!("{}.{:03}Z", whole.trim_end_matches('Z'), ms % 1000)
}

/// The longest duration a customer may type (an allowance, an approval's expiry, a
/// one-off window): 7 days.
pub const MAX_DURATION_SECS: u64 = 7 * 86_400;

/// Text a customer typed (a duration, a day, a time of day, a window) that does not
/// say what it must: the text and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?}: {problem}")]
pub struct BadText {
    pub text: String,
    pub problem: String,
}

impl BadText {
    pub fn new(text: &str, problem: impl Into<String>) -> BadText {
        BadText { text: text.to_string(), problem: problem.into() }
    }
}

/// `90s`, `30m`, `2h`, `1d` → seconds, within 1 s ..= [`MAX_DURATION_SECS`].
pub fn parse_duration(s: &str) -> Result<u64, BadText> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| BadText::new(s, "expected a number and a unit (90s, 30m, 2h, 1d)"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(BadText::new(s, "the unit is s, m, h or d")),
    };
    let secs = n.saturating_mul(mult);
    if secs == 0 || secs > MAX_DURATION_SECS {
        return Err(BadText::new(s, format!("between 1s and {}d", MAX_DURATION_SECS / 86_400)));
    }
    Ok(secs)
}

/// `--since`: a time (`2026-11-27T09:00:00Z`, any RFC 3339 offset, or a UTC date
/// `2026-11-27`) or how long ago (`90s`, `30m`, `2h`, `7d`) → Unix milliseconds.
pub fn parse_since(s: &str, now_ms: u64) -> Result<u64, BadText> {
    let s = s.trim();
    if let Ok(t) = s.parse::<jiff::Timestamp>() {
        return u64::try_from(t.as_millisecond()).map_err(|_| BadText::new(s, "before 1970"));
    }
    if let Ok(d) = s.parse::<jiff::civil::Date>() {
        let t = d.to_zoned(jiff::tz::TimeZone::UTC).map_err(|e| BadText::new(s, e.to_string()))?.timestamp();
        return u64::try_from(t.as_millisecond()).map_err(|_| BadText::new(s, "before 1970"));
    }
    match parse_duration(s) {
        Ok(secs) => Ok(now_ms.saturating_sub(secs * 1000)),
        Err(_) => Err(BadText::new(
            s,
            "expected a time (2026-11-27T09:00:00Z, 2026-11-27) or how long ago (90s, 30m, 2h, 7d)",
        )),
    }
}

/// Wall-clock time, injectable.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// Seconds since the Unix epoch.
    fn unix_now(&self) -> i64 {
        (self.now_ms() / 1000) as i64
    }
}

/// The system's clock (the same one the audit log stamps records with).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        byoc_audit::log::now_ms()
    }
}

/// A clock that says what a test tells it to.
#[derive(Debug, Default)]
pub struct FixedClock(pub std::sync::atomic::AtomicU64);

impl FixedClock {
    pub fn at_secs(secs: i64) -> Self {
        FixedClock(std::sync::atomic::AtomicU64::new(secs as u64 * 1000))
    }
    pub fn advance_secs(&self, secs: u64) {
        self.0.fetch_add(secs * 1000, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Clock for FixedClock {
    fn now_ms(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

pub fn now_ms() -> u64 {
    SystemClock.now_ms()
}

pub fn unix_now() -> i64 {
    SystemClock.unix_now()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_timestamps() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_ms(1_795_000_000_000), "2026-11-18T11:06:40Z");
        assert_eq!(rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_000_000), "2026-11-18T11:06:40Z");
    }

    #[test]
    fn since_takes_a_time_a_date_or_how_long_ago() {
        let now = 1_764_201_600_000; // 2025-11-27T00:00:00Z
        assert_eq!(parse_since("2025-11-26T23:00:00Z", now).unwrap(), now - 3_600_000);
        assert_eq!(parse_since("2025-11-27T01:00:00+02:00", now).unwrap(), now - 3_600_000);
        assert_eq!(parse_since("2025-11-26", now).unwrap(), now - 86_400_000);
        assert_eq!(parse_since("2h", now).unwrap(), now - 7_200_000);
        for bad in ["yesterday", "", "2h ago", "2025-13-01"] {
            assert!(parse_since(bad, now).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_have_units_and_bounds() {
        assert_eq!(parse_duration("90s"), Ok(90));
        assert_eq!(parse_duration("2h"), Ok(7200));
        assert_eq!(parse_duration("1d"), Ok(86_400));
        for bad in ["", "2", "h", "0s", "8d", "2 hours", "-1h", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn fixed_clock_advances_and_system_clock_is_recent() {
        let c = FixedClock::at_secs(1_000);
        c.advance_secs(5);
        assert_eq!(c.unix_now(), 1_005);
        // 2024-01-01: the system clock is not an epoch-zero fallback.
        assert!(unix_now() > 1_704_067_200);
    }
}
