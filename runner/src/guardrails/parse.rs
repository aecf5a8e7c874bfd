//! Parsing `[guardrails]`: every entry checked on its own and every problem reported
//! at once (`config validate`), into the model of the parent module.

use jiff::Timestamp;
use jiff::civil::{DateTime, Time};
use jiff::tz::TimeZone;
use serde::Deserialize;

use super::*;
use crate::clock::BadText;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWindow {
    name: String,
    time_zone: Option<String>,
    #[serde(default)]
    weekly: Vec<String>,
    #[serde(default)]
    once: Vec<String>,
}

const SELECTOR_KEYS: &[&str] = &["roles", "operations", "components", "kinds", "effects"];

#[derive(Deserialize)]
struct RawRule {
    name: String,
    windows: Vec<String>,
    #[serde(flatten)]
    scope: JobSelector,
    outside: Option<String>,
    on_close: Option<String>,
}

#[derive(Deserialize)]
struct RawApprovalRule {
    name: String,
    #[serde(flatten)]
    scope: JobSelector,
    /// `30m`, `1h`, `2d`.
    expires: Option<String>,
    /// `job` (default) or `plan`.
    on: Option<String>,
    /// `always` (default) or `warn`; `on = "plan"` only.
    when: Option<String>,
    #[serde(default)]
    policies: Vec<String>,
}

/// Parse `[guardrails]`. Every problem is pushed to `problems`, each entry checked on
/// its own so one bad window does not hide the next.
pub fn parse(mut table: toml::Table, problems: &mut Vec<String>) -> Guardrails {
    let mut g = Guardrails::default();
    let windows = table.remove("window");
    let rules = table.remove("window_rule");
    let approvals = table.remove("approval_rule");
    for key in table.keys() {
        problems.push(format!("guardrails.{key}: unknown setting (expected [[guardrails.window]], [[guardrails.window_rule]] or [[guardrails.approval_rule]])"));
    }
    for (i, raw) in
        entries::<RawWindow>(windows, "guardrails.window", &["name", "time_zone", "weekly", "once"], problems)
            .into_iter()
            .enumerate()
    {
        let at = format!("guardrails.window[{i}] ({:?})", raw.name);
        if let Some(w) = parse_window(raw, &at, problems) {
            if g.windows.contains_key(&w.name) {
                problems.push(format!("{at}: a window named {:?} is already defined", w.name));
            } else {
                g.windows.insert(w.name.clone(), w);
            }
        }
    }
    for (i, raw) in entries::<RawRule>(
        rules,
        "guardrails.window_rule",
        &[SELECTOR_KEYS, &["name", "windows", "outside", "on_close"]].concat(),
        problems,
    )
    .into_iter()
    .enumerate()
    {
        let at = format!("guardrails.window_rule[{i}] ({:?})", raw.name);
        if let Some(r) = parse_rule(raw, &at, &g.windows, problems) {
            if g.rules.iter().any(|o| o.name == r.name) {
                problems.push(format!("{at}: a rule named {:?} is already defined", r.name));
            }
            for other in g.rules.iter().filter(|o| o.scope.overlaps(&r.scope)) {
                problems.push(format!(
                    "{at}: overlaps rule {:?}: a job could match both (give them disjoint roles, operations, components, kinds or effects)",
                    other.name
                ));
            }
            g.rules.push(r);
        }
    }
    for (i, raw) in entries::<RawApprovalRule>(
        approvals,
        "guardrails.approval_rule",
        &[SELECTOR_KEYS, &["name", "expires", "on", "when", "policies"]].concat(),
        problems,
    )
    .into_iter()
    .enumerate()
    {
        let at = format!("guardrails.approval_rule[{i}] ({:?})", raw.name);
        if let Some(rule) = parse_approval_rule(raw, &at, &g.approval_rules, problems) {
            g.approval_rules.push(rule);
        }
    }
    g
}

/// One `[[guardrails.approval_rule]]`: when it asks (before the job, or on its plan and
/// which warnings), how long an approval waits, not overlapping `existing` rules.
fn parse_approval_rule(
    raw: RawApprovalRule,
    at: &str,
    existing: &[ApprovalRule],
    problems: &mut Vec<String>,
) -> Option<ApprovalRule> {
    let before = problems.len();
    check_selector(&raw.scope, at, problems);
    let expires_secs = match raw.expires.as_deref().map(crate::clock::parse_duration) {
        None => APPROVAL_EXPIRES_SECS,
        Some(Ok(secs)) => secs,
        Some(Err(e)) => {
            problems.push(format!("{at}: expires {e}"));
            APPROVAL_EXPIRES_SECS
        }
    };
    let on = match raw.on.as_deref() {
        None | Some("job") => ApprovalPoint::Job,
        Some("plan") => ApprovalPoint::Plan,
        Some(o) => {
            problems.push(format!("{at}: on = {o:?}: expected \"job\" or \"plan\""));
            ApprovalPoint::Job
        }
    };
    let when_warn = match raw.when.as_deref() {
        None | Some("always") => false,
        Some("warn") => true,
        Some(w) => {
            problems.push(format!("{at}: when = {w:?}: expected \"always\" or \"warn\""));
            false
        }
    };
    if on == ApprovalPoint::Job && (when_warn || !raw.policies.is_empty()) {
        problems.push(format!(
            "{at}: when and policies need on = \"plan\" (a job is approved before any plan exists)"
        ));
    }
    if on == ApprovalPoint::Plan
        && raw.scope.kinds.iter().any(|k| !["terraform", "helm", "kubernetes"].contains(&k.as_str()))
    {
        problems.push(format!(
            "{at}: on = \"plan\" applies to what policy decides: terraform, helm and kubernetes jobs (kinds)"
        ));
    }
    if existing.iter().any(|o| o.name == raw.name) {
        problems.push(format!("{at}: an approval rule named {:?} is already defined", raw.name));
    }
    for other in existing.iter().filter(|o| o.on == on && o.scope.overlaps(&raw.scope)) {
        problems.push(format!(
            "{at}: overlaps approval rule {:?}: a job could match both (give them disjoint roles, operations, components, kinds or effects)",
            other.name
        ));
    }
    (problems.len() == before).then_some(ApprovalRule {
        name: raw.name,
        scope: raw.scope,
        expires_secs,
        on,
        when_warn,
        policies: raw.policies,
    })
}

/// Operations and kinds must be ones the runner knows; no value twice.
fn check_selector(scope: &JobSelector, at: &str, problems: &mut Vec<String>) {
    for op in &scope.operations {
        let known = op.split_once('.').is_some_and(|(e, o)| byoc_protocol::known_operation(e, o));
        if !known {
            let all: Vec<String> = byoc_protocol::OPERATIONS
                .iter()
                .flat_map(|(e, ops)| ops.iter().map(move |o| format!("{e}.{o}")))
                .collect();
            problems.push(format!("{at}: operation {op:?} is not one of {}", all.join(", ")));
        }
    }
    for kind in scope.kinds.iter().filter(|k| byoc_protocol::JobKind::parse(k).is_none()) {
        let all: Vec<&str> = byoc_protocol::JobKind::ALL.iter().map(|k| k.as_str()).collect();
        problems.push(format!("{at}: kind {kind:?} is not one of {}", all.join(", ")));
    }
    for effect in scope.effects.iter().filter(|e| byoc_protocol::Effect::parse(e).is_none()) {
        let all: Vec<&str> = byoc_protocol::Effect::ALL.iter().map(|e| e.as_str()).collect();
        problems.push(format!("{at}: effect {effect:?} is not one of {}", all.join(", ")));
    }
    let unique = |v: &[String]| v.iter().collect::<BTreeSet<_>>().len() == v.len();
    if !unique(&scope.roles)
        || !unique(&scope.components)
        || !unique(&scope.operations)
        || !unique(&scope.kinds)
        || !unique(&scope.effects)
    {
        problems.push(format!("{at}: a value is listed twice"));
    }
}

/// Each `[[what]]` table as a `T`; keys outside `allowed` are reported (serde's
/// `deny_unknown_fields` does not see through the flattened `JobSelector`).
fn entries<T: serde::de::DeserializeOwned>(
    v: Option<toml::Value>,
    what: &str,
    allowed: &[&str],
    problems: &mut Vec<String>,
) -> Vec<T> {
    let items = match v {
        None => return Vec::new(),
        Some(toml::Value::Array(items)) => items,
        Some(_) => {
            problems.push(format!("{what}: must be an array of tables ([[{what}]])"));
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        let unknown: Vec<&String> = match item.as_table() {
            Some(t) => t.keys().filter(|k| !allowed.contains(&k.as_str())).collect(),
            None => Vec::new(),
        };
        if !unknown.is_empty() {
            for k in unknown {
                problems.push(format!(
                    "{what}[{i}]: unknown field `{k}` (expected one of {})",
                    allowed.join(", ")
                ));
            }
            continue;
        }
        match item.try_into::<T>() {
            Ok(t) => out.push(t),
            Err(e) => problems.push(format!("{what}[{i}]: {}", e.to_string().trim())),
        }
    }
    out
}

fn parse_window(raw: RawWindow, at: &str, problems: &mut Vec<String>) -> Option<Window> {
    let before = problems.len();
    let tz_name = raw.time_zone.unwrap_or_else(|| "UTC".into());
    let tz = match tz_db().get(&tz_name) {
        Ok(tz) => Some(tz),
        Err(_) => {
            problems.push(format!(
                "{at}: time_zone {tz_name:?} is not a known IANA time zone (e.g. Europe/Berlin, UTC)"
            ));
            None
        }
    };
    if raw.name.trim().is_empty() {
        problems.push(format!("{at}: name must not be empty"));
    }
    if raw.weekly.is_empty() && raw.once.is_empty() {
        problems.push(format!(
            "{at}: needs weekly = [\"sat 02:00-06:00\", …] or once = [\"2026-12-01T22:00Z/4h\", …]"
        ));
    }
    let weekly: Vec<Weekly> = raw
        .weekly
        .iter()
        .filter_map(|s| parse_weekly(s).map_err(|e| problems.push(format!("{at}: weekly {s:?}: {e}"))).ok())
        .collect();
    let once: Vec<(Timestamp, Timestamp)> = match &tz {
        Some(tz) => raw
            .once
            .iter()
            .filter_map(|s| {
                parse_once(s, tz).map_err(|e| problems.push(format!("{at}: once {s:?}: {e}"))).ok()
            })
            .collect(),
        None => Vec::new(),
    };
    let tz = tz.filter(|_| problems.len() == before)?;
    Some(Window { name: raw.name, time_zone: tz_name, tz, weekly, once })
}

fn parse_rule(
    raw: RawRule,
    at: &str,
    windows: &BTreeMap<String, Window>,
    problems: &mut Vec<String>,
) -> Option<WindowRule> {
    let before = problems.len();
    if raw.windows.is_empty() {
        problems.push(format!("{at}: windows must name at least one [[guardrails.window]]"));
    }
    for w in raw.windows.iter().filter(|w| !windows.contains_key(*w)) {
        problems.push(format!("{at}: window {w:?} is not defined (or was refused above)"));
    }
    check_selector(&raw.scope, at, problems);
    let outside = match raw.outside.as_deref() {
        None | Some("wait") => Outside::Wait,
        Some("refuse") => Outside::Refuse,
        Some(o) => {
            problems.push(format!("{at}: outside = {o:?}: expected \"wait\" or \"refuse\""));
            Outside::Wait
        }
    };
    let on_close = match raw.on_close.as_deref() {
        None | Some("continue") => OnClose::Continue,
        Some("cancel") => OnClose::Cancel,
        Some(o) => {
            problems.push(format!("{at}: on_close = {o:?}: expected \"continue\" or \"cancel\""));
            OnClose::Continue
        }
    };
    (problems.len() == before).then_some(WindowRule {
        name: raw.name,
        windows: raw.windows,
        scope: raw.scope,
        outside,
        on_close,
    })
}

const DAYS: [(&str, &str); 7] = [
    ("mon", "monday"),
    ("tue", "tuesday"),
    ("wed", "wednesday"),
    ("thu", "thursday"),
    ("fri", "friday"),
    ("sat", "saturday"),
    ("sun", "sunday"),
];

fn day(s: &str) -> Result<usize, BadText> {
    let s = s.to_ascii_lowercase();
    DAYS.iter()
        .position(|(short, long)| s == *short || s == *long)
        .ok_or_else(|| BadText::new(&s, "not a day (mon … sun)"))
}

/// `sat 02:00-06:00`, `mon-fri 22:00-02:00`, `sat,sun 00:00-24:00`, `daily 03:00-04:00`.
fn parse_weekly(s: &str) -> Result<Weekly, BadText> {
    let (days_s, times) = s
        .trim()
        .split_once(char::is_whitespace)
        .ok_or_else(|| BadText::new(s, "expected DAYS HH:MM-HH:MM (e.g. \"sat 02:00-06:00\")"))?;
    let mut days = [false; 7];
    if days_s.eq_ignore_ascii_case("daily") {
        days = [true; 7];
    } else {
        for part in days_s.split(',') {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (day(a)?, day(b)?);
                    // `fri-mon` wraps through the weekend.
                    let mut d = a;
                    loop {
                        days[d] = true;
                        if d == b {
                            break;
                        }
                        d = (d + 1) % 7;
                    }
                }
                None => days[day(part)?] = true,
            }
        }
    }
    let (start_s, end_s) =
        times.trim().split_once('-').ok_or_else(|| BadText::new(times, "expected HH:MM-HH:MM"))?;
    let start = clock_time(start_s)?;
    let (end, next_midnight) =
        if end_s.trim() == "24:00" { (Time::midnight(), true) } else { (clock_time(end_s)?, false) };
    if !next_midnight && end == start {
        return Err(BadText::new(times, "start and end are the same time (use 00:00-24:00 for a whole day)"));
    }
    Ok(Weekly { days, start, end, ends_next_day: next_midnight || end < start })
}

fn clock_time(s: &str) -> Result<Time, BadText> {
    let s = s.trim();
    let not_hh_mm = || BadText::new(s, "not HH:MM");
    let (h, m) = s.split_once(':').ok_or_else(not_hh_mm)?;
    let (h, m): (i8, i8) = (h.parse().map_err(|_| not_hh_mm())?, m.parse().map_err(|_| not_hh_mm())?);
    Time::new(h, m, 0, 0).map_err(|_| BadText::new(s, "not a time of day"))
}

/// `2026-12-01T22:00Z/4h`, `2026-12-01T22:00+01:00/2026-12-02T02:00+01:00`, or a local
/// time in the window's zone: `2026-12-01T22:00/90m`.
fn parse_once(s: &str, tz: &TimeZone) -> Result<(Timestamp, Timestamp), BadText> {
    let (start_s, rest) =
        s.trim().split_once('/').ok_or_else(|| BadText::new(s, "expected START/DURATION or START/END"))?;
    let start = instant(start_s, tz)?;
    let end = match crate::clock::parse_duration(rest) {
        Ok(secs) => start
            .checked_add(jiff::SignedDuration::from_secs(secs as i64))
            .map_err(|e| BadText::new(s, e.to_string()))?,
        Err(_) if rest.contains('T') => instant(rest, tz)?,
        Err(e) => return Err(e),
    };
    if end <= start {
        return Err(BadText::new(s, "ends before it starts"));
    }
    if end.as_second() - start.as_second() > MAX_ONCE_SECS {
        return Err(BadText::new(s, "longer than 31 days"));
    }
    Ok((start, end))
}

fn instant(s: &str, tz: &TimeZone) -> Result<Timestamp, BadText> {
    let s = s.trim();
    if let Ok(t) = s.parse::<Timestamp>() {
        return Ok(t);
    }
    let dt: DateTime = s.parse().map_err(|_| BadText::new(s, "not a date and time (2026-12-01T22:00Z)"))?;
    tz.to_ambiguous_zoned(dt).compatible().map(|z| z.timestamp()).map_err(|e| BadText::new(s, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::super::tests::guardrails;

    #[test]
    fn every_problem_is_reported_at_once() {
        let problems = guardrails(
            r#"
            [[window]]
            name = "a"
            time_zone = "Mars/Olympus"
            weekly = ["sat 02:00-06:00"]
            [[window]]
            name = "b"
            weekly = ["caturday 02:00-06:00", "sun 25:00-26:00", "mon 03:00-03:00"]
            once = ["2026-12-01T22:00Z/0s", "yesterday/4h"]
            [[window]]
            name = "c"
            [[window]]
            name = "d"
            weekly = ["daily 01:00-02:00"]
            [[window]]
            name = "d"
            weekly = ["daily 01:00-02:00"]
            [[window_rule]]
            name = "r1"
            windows = ["d", "nope"]
            operations = ["component.explode"]
            kinds = ["bash"]
            outside = "ignore"
            [[window_rule]]
            name = "r2"
            windows = ["d"]
            roles = ["maintenance"]
            [[window_rule]]
            name = "r3"
            windows = ["d"]
            operations = ["component.deploy"]
            [[window_rule]]
            name = "r4"
            windows = ["d"]
            extra = 1
            "#,
        )
        .expect_err("invalid");
        let all = problems.join("\n");
        for needle in [
            "\"Mars/Olympus\" is not a known IANA time zone",
            "\"caturday\": not a day",
            "\"sun 25:00-26:00\"",
            "start and end are the same time",
            "/0s",
            "\"yesterday\": not a date",
            "(\"c\"): needs weekly",
            "a window named \"d\" is already defined",
            "window \"nope\" is not defined",
            "operation \"component.explode\" is not one of",
            "kind \"bash\" is not one of",
            "outside = \"ignore\"",
            "overlaps rule \"r2\"",
            "unknown field `extra`",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
    }
}
