//! The customer's maintenance windows (`[[guardrails.window]]`) and the rules that
//! bind jobs to them (`[[guardrails.window_rule]]`), from the runner's own config,
//! never from a job. Time is jiff's, with the tz database compiled into the binary, so
//! a window means the same on every VM whatever its tzdata, across DST changes and
//! midnight.
//!
//! A rule scopes jobs by role, operation (`component.deploy`), component and kind;
//! every scope it names must match (an empty scope matches anything). At most one rule
//! can match a job: rules whose scopes overlap are a config error, so what a job needs
//! is never a question of rule order. Outside its windows a matching job waits
//! (`outside = "wait"`, the default) or is refused (`outside = "refuse"`).

use std::collections::{BTreeMap, BTreeSet};

use jiff::civil::{Date, DateTime, Time};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan as _};
use serde::Deserialize;

/// The tz database compiled into the binary (not the VM's tzdata, which a minimal
/// image may lack or have out of date).
fn tz_db() -> &'static jiff::tz::TimeZoneDatabase {
    static DB: std::sync::OnceLock<jiff::tz::TimeZoneDatabase> = std::sync::OnceLock::new();
    DB.get_or_init(jiff::tz::TimeZoneDatabase::bundled)
}

/// Longest one-off window: a month.
const MAX_ONCE_SECS: i64 = 31 * 86_400;

#[derive(Debug, Clone, Default)]
pub struct Guardrails {
    pub windows: BTreeMap<String, Window>,
    pub rules: Vec<WindowRule>,
    /// `[[guardrails.approval_rule]]`: jobs that wait for a local person's approval.
    pub approval_rules: Vec<ApprovalRule>,
}

/// Which jobs a rule is about: every list it names must contain the job's value (an
/// empty list matches anything).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scope {
    /// Role names or lifecycle types (`maintenance`, `break_glass`, …).
    #[serde(default)]
    pub roles: Vec<String>,
    /// `entity.operation`.
    #[serde(default)]
    pub operations: Vec<String>,
    /// The job's entity name.
    #[serde(default)]
    pub components: Vec<String>,
    #[serde(default)]
    pub kinds: Vec<String>,
}

/// A rule that holds matching jobs until a local admin approves them
/// (`byoc-runner approve JOB`); unanswered requests expire.
#[derive(Debug, Clone)]
pub struct ApprovalRule {
    pub name: String,
    pub scope: Scope,
    /// How long a request stays open.
    pub expires_secs: u64,
    /// Before the job runs, or between its plan's decision and apply (terraform).
    pub on: ApprovalPoint,
    /// `on = "plan"`: ask only when the decision has an advisory finding.
    pub when_warn: bool,
    /// `on = "plan"`: ask only when one of these policies has a finding (by name, as
    /// the decision lists them: `builtin/public_ingress`, `customer/db.rego`, …).
    pub policies: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalPoint {
    Job,
    Plan,
}

impl ApprovalRule {
    /// Why this allowed plan needs approval (`on = "plan"` rules), or `None`.
    pub fn asks_for(&self, decision: &byoc_policy::Decision) -> Option<Vec<String>> {
        if self.on != ApprovalPoint::Plan {
            return None;
        }
        let findings = || decision.violations.iter().chain(&decision.warnings);
        if !self.when_warn && self.policies.is_empty() {
            return Some(vec![format!("rule {:?} asks for every plan", self.name)]);
        }
        let mut why: Vec<String> = Vec::new();
        if self.when_warn {
            why.extend(
                decision.warnings.iter().map(|w| format!("WARN {} [{}] {}", w.policy, w.rule, w.address)),
            );
        }
        why.extend(
            findings()
                .filter(|f| self.policies.contains(&f.policy))
                .map(|f| format!("{} [{}] {}", f.policy, f.rule, f.address)),
        );
        why.dedup();
        (!why.is_empty()).then_some(why)
    }
}

/// Default life of an approval request.
pub const APPROVAL_EXPIRES_SECS: u64 = 3600;

#[derive(Debug, Clone)]
pub struct Window {
    pub name: String,
    pub time_zone: String,
    tz: TimeZone,
    weekly: Vec<Weekly>,
    once: Vec<(Timestamp, Timestamp)>,
}

/// `sat 02:00-06:00`: on each listed local day, from start to end (the next day's end
/// when end is not after start; `24:00` is the next midnight).
#[derive(Debug, Clone)]
struct Weekly {
    /// Monday first.
    days: [bool; 7],
    start: Time,
    end: Time,
    ends_next_day: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outside {
    Wait,
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnClose {
    /// A job that started inside its window finishes, however long it takes.
    Continue,
    /// The window closing cancels the job (SIGTERM, then the kill grace).
    Cancel,
}

#[derive(Debug, Clone)]
pub struct WindowRule {
    pub name: String,
    pub windows: Vec<String>,
    pub scope: Scope,
    pub outside: Outside,
    pub on_close: OnClose,
}

/// What a rule is matched against.
#[derive(Debug, Clone, Copy)]
pub struct JobScope<'a> {
    /// The role's name and its lifecycle type (`maintenance`, `break_glass`, …): a
    /// rule's `roles` matches either.
    pub role: Option<&'a str>,
    pub role_type: Option<&'a str>,
    /// `entity.operation`, e.g. `component.deploy`.
    pub operation: &'a str,
    pub component: Option<&'a str>,
    pub kind: &'a str,
}

/// A rule's verdict on a job at an instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WindowCheck {
    /// No rule names this job.
    Unbound,
    /// Inside `window`, which closes at `closes_at` (unix seconds).
    Open { rule: String, window: String, closes_at: i64, on_close: OnClose },
    /// Outside every window of the rule; `next` is the next opening (window, unix
    /// seconds), if any is ahead.
    Closed { rule: String, outside: Outside, next: Option<(String, i64)> },
}

impl Scope {
    fn matches(&self, job: &JobScope) -> bool {
        let any =
            |set: &[String], v: Option<&str>| set.is_empty() || v.is_some_and(|v| set.iter().any(|s| s == v));
        (any(&self.roles, job.role) || any(&self.roles, job.role_type))
            && any(&self.operations, Some(job.operation))
            && any(&self.components, job.component)
            && any(&self.kinds, Some(job.kind))
    }

    /// Whether some job could match both rules: every scope is open on one side or
    /// shares a value.
    fn overlaps(&self, other: &Scope) -> bool {
        let meet =
            |a: &[String], b: &[String]| a.is_empty() || b.is_empty() || a.iter().any(|x| b.contains(x));
        meet(&self.roles, &other.roles)
            && meet(&self.operations, &other.operations)
            && meet(&self.components, &other.components)
            && meet(&self.kinds, &other.kinds)
    }
}

impl Guardrails {
    /// No rule of any kind: every job goes straight on.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.approval_rules.is_empty()
    }

    pub fn rule_for(&self, job: &JobScope) -> Option<&WindowRule> {
        self.rules.iter().find(|r| r.scope.matches(job))
    }

    /// The approval rule that holds `job` before it runs, if any.
    pub fn approval_for(&self, job: &JobScope) -> Option<&ApprovalRule> {
        self.approval_rules.iter().find(|r| r.on == ApprovalPoint::Job && r.scope.matches(job))
    }

    /// The approval rule asked between `job`'s plan decision and apply, if any.
    pub fn plan_approval_for(&self, job: &JobScope) -> Option<&ApprovalRule> {
        self.approval_rules.iter().find(|r| r.on == ApprovalPoint::Plan && r.scope.matches(job))
    }

    /// Every window open at `now`, with when it closes (unix seconds).
    pub fn open_windows(&self, now: i64) -> Vec<(&str, i64)> {
        let t = Timestamp::from_second(now).unwrap_or(Timestamp::UNIX_EPOCH);
        self.windows
            .values()
            .filter_map(|w| w.open_at(t).map(|closes| (w.name.as_str(), closes.as_second())))
            .collect()
    }

    /// The verdict for `job` at `now` (unix seconds).
    pub fn check(&self, job: &JobScope, now: i64) -> WindowCheck {
        let Some(rule) = self.rule_for(job) else { return WindowCheck::Unbound };
        let now_ts = Timestamp::from_second(now).unwrap_or(Timestamp::UNIX_EPOCH);
        let windows = rule.windows.iter().filter_map(|w| self.windows.get(w));
        let mut open: Option<(String, Timestamp)> = None;
        let mut next: Option<(String, Timestamp)> = None;
        for w in windows {
            if let Some(closes) = w.open_at(now_ts)
                && open.as_ref().is_none_or(|(_, c)| closes > *c)
            {
                open = Some((w.name.clone(), closes));
            }
            if let Some(opens) = w.next_opening(now_ts)
                && next.as_ref().is_none_or(|(_, o)| opens < *o)
            {
                next = Some((w.name.clone(), opens));
            }
        }
        match open {
            Some((window, closes)) => WindowCheck::Open {
                rule: rule.name.clone(),
                window,
                closes_at: closes.as_second(),
                on_close: rule.on_close,
            },
            None => WindowCheck::Closed {
                rule: rule.name.clone(),
                outside: rule.outside,
                next: next.map(|(w, t)| (w, t.as_second())),
            },
        }
    }
}

impl Window {
    /// Every instance (start, end) whose local start day is within `days` of `t`'s.
    fn instances(&self, t: Timestamp, days_before: i64, days_after: i64) -> Vec<(Timestamp, Timestamp)> {
        let mut out = self.once.clone();
        let today = t.to_zoned(self.tz.clone()).date();
        for offset in -days_before..=days_after {
            let Ok(day) = today.checked_add(offset.days()) else { continue };
            for w in &self.weekly {
                if !w.days[day.weekday().to_monday_zero_offset() as usize] {
                    continue;
                }
                let end_day = if w.ends_next_day { day.tomorrow().ok() } else { Some(day) };
                let (Some(start), Some(end)) =
                    (self.instant(day, w.start), end_day.and_then(|d| self.instant(d, w.end)))
                else {
                    continue;
                };
                if end > start {
                    out.push((start, end));
                }
            }
        }
        out
    }

    /// A local wall-clock time as an instant. A time the DST change skips moves forward
    /// by the gap's length (02:30 → 03:30, as RFC 5545 and Temporal do) and a repeated
    /// one is its first occurrence, so a window never vanishes on the day the clocks move.
    fn instant(&self, day: Date, time: Time) -> Option<Timestamp> {
        let dt = DateTime::from_parts(day, time);
        self.tz.to_ambiguous_zoned(dt).compatible().ok().map(|z| z.timestamp())
    }

    /// If `t` is inside an instance, when the latest such instance closes.
    pub fn open_at(&self, t: Timestamp) -> Option<Timestamp> {
        self.instances(t, 1, 0).into_iter().filter(|(s, e)| *s <= t && t < *e).map(|(_, e)| e).max()
    }

    /// The first instance start after `t`.
    pub fn next_opening(&self, t: Timestamp) -> Option<Timestamp> {
        self.instances(t, 0, 8).into_iter().map(|(s, _)| s).filter(|s| *s > t).min()
    }
}

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

const SCOPE_KEYS: &[&str] = &["roles", "operations", "components", "kinds"];

#[derive(Deserialize)]
struct RawRule {
    name: String,
    windows: Vec<String>,
    #[serde(flatten)]
    scope: Scope,
    outside: Option<String>,
    on_close: Option<String>,
}

#[derive(Deserialize)]
struct RawApprovalRule {
    name: String,
    #[serde(flatten)]
    scope: Scope,
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
        &[SCOPE_KEYS, &["name", "windows", "outside", "on_close"]].concat(),
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
                    "{at}: overlaps rule {:?}: a job could match both (give them disjoint roles, operations, components or kinds)",
                    other.name
                ));
            }
            g.rules.push(r);
        }
    }
    for (i, raw) in entries::<RawApprovalRule>(
        approvals,
        "guardrails.approval_rule",
        &[SCOPE_KEYS, &["name", "expires", "on", "when", "policies"]].concat(),
        problems,
    )
    .into_iter()
    .enumerate()
    {
        let at = format!("guardrails.approval_rule[{i}] ({:?})", raw.name);
        let before = problems.len();
        check_scope(&raw.scope, &at, problems);
        let expires_secs = match raw.expires.as_deref().map(crate::roles::allowance::parse_duration) {
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
        if g.approval_rules.iter().any(|o| o.name == raw.name) {
            problems.push(format!("{at}: an approval rule named {:?} is already defined", raw.name));
        }
        for other in g.approval_rules.iter().filter(|o| o.on == on && o.scope.overlaps(&raw.scope)) {
            problems.push(format!(
                "{at}: overlaps approval rule {:?}: a job could match both (give them disjoint roles, operations, components or kinds)",
                other.name
            ));
        }
        if problems.len() == before {
            g.approval_rules.push(ApprovalRule {
                name: raw.name,
                scope: raw.scope,
                expires_secs,
                on,
                when_warn,
                policies: raw.policies,
            });
        }
    }
    g
}

/// Operations and kinds must be ones the runner knows; no value twice.
fn check_scope(scope: &Scope, at: &str, problems: &mut Vec<String>) {
    for op in &scope.operations {
        let known = op.split_once('.').is_some_and(|(e, o)| crate::roles::model::known_operation(e, o));
        if !known {
            let all: Vec<String> = crate::roles::model::OPERATIONS
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
    let unique = |v: &[String]| v.iter().collect::<BTreeSet<_>>().len() == v.len();
    if !unique(&scope.roles)
        || !unique(&scope.components)
        || !unique(&scope.operations)
        || !unique(&scope.kinds)
    {
        problems.push(format!("{at}: a value is listed twice"));
    }
}

/// Each `[[what]]` table as a `T`; keys outside `allowed` are reported (serde's
/// `deny_unknown_fields` does not see through the flattened `Scope`).
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
    check_scope(&raw.scope, at, problems);
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

fn day(s: &str) -> Result<usize, String> {
    let s = s.to_ascii_lowercase();
    DAYS.iter()
        .position(|(short, long)| s == *short || s == *long)
        .ok_or_else(|| format!("{s:?} is not a day (mon … sun)"))
}

/// `sat 02:00-06:00`, `mon-fri 22:00-02:00`, `sat,sun 00:00-24:00`, `daily 03:00-04:00`.
fn parse_weekly(s: &str) -> Result<Weekly, String> {
    let (days_s, times) = s
        .trim()
        .split_once(char::is_whitespace)
        .ok_or("expected DAYS HH:MM-HH:MM (e.g. \"sat 02:00-06:00\")")?;
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
    let (start_s, end_s) = times.trim().split_once('-').ok_or("expected HH:MM-HH:MM")?;
    let start = clock_time(start_s)?;
    let (end, next_midnight) =
        if end_s.trim() == "24:00" { (Time::midnight(), true) } else { (clock_time(end_s)?, false) };
    if !next_midnight && end == start {
        return Err("start and end are the same time (use 00:00-24:00 for a whole day)".into());
    }
    Ok(Weekly { days, start, end, ends_next_day: next_midnight || end < start })
}

fn clock_time(s: &str) -> Result<Time, String> {
    let s = s.trim();
    let (h, m) = s.split_once(':').ok_or_else(|| format!("{s:?} is not HH:MM"))?;
    let (h, m): (i8, i8) = (
        h.parse().map_err(|_| format!("{s:?} is not HH:MM"))?,
        m.parse().map_err(|_| format!("{s:?} is not HH:MM"))?,
    );
    Time::new(h, m, 0, 0).map_err(|_| format!("{s:?} is not a time of day"))
}

/// `2026-12-01T22:00Z/4h`, `2026-12-01T22:00+01:00/2026-12-02T02:00+01:00`, or a local
/// time in the window's zone: `2026-12-01T22:00/90m`.
fn parse_once(s: &str, tz: &TimeZone) -> Result<(Timestamp, Timestamp), String> {
    let (start_s, rest) = s.trim().split_once('/').ok_or("expected START/DURATION or START/END")?;
    let start = instant(start_s, tz)?;
    let end = match crate::roles::allowance::parse_duration(rest) {
        Ok(secs) => {
            start.checked_add(jiff::SignedDuration::from_secs(secs as i64)).map_err(|e| e.to_string())?
        }
        Err(_) if rest.contains('T') => instant(rest, tz)?,
        Err(e) => return Err(e),
    };
    if end <= start {
        return Err("ends before it starts".into());
    }
    if end.as_second() - start.as_second() > MAX_ONCE_SECS {
        return Err("longer than 31 days".into());
    }
    Ok((start, end))
}

fn instant(s: &str, tz: &TimeZone) -> Result<Timestamp, String> {
    let s = s.trim();
    if let Ok(t) = s.parse::<Timestamp>() {
        return Ok(t);
    }
    let dt: DateTime = s.parse().map_err(|_| format!("{s:?} is not a date and time (2026-12-01T22:00Z)"))?;
    tz.to_ambiguous_zoned(dt).compatible().map(|z| z.timestamp()).map_err(|e| e.to_string())
}

/// RFC 3339 in UTC, for logs and reports.
pub fn rfc3339(unix: i64) -> String {
    Timestamp::from_second(unix).map(|t| t.to_string()).unwrap_or_else(|_| unix.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guardrails(text: &str) -> Result<Guardrails, Vec<String>> {
        let table: toml::Table = text.parse().expect("toml");
        let mut problems = Vec::new();
        let g = parse(table, &mut problems);
        if problems.is_empty() { Ok(g) } else { Err(problems) }
    }

    fn at(s: &str) -> i64 {
        s.parse::<Timestamp>().expect("timestamp").as_second()
    }

    fn deploy(role: &str) -> JobScope<'_> {
        JobScope {
            role: Some(role),
            role_type: None,
            operation: "component.deploy",
            component: Some("db"),
            kind: "terraform",
        }
    }

    const BERLIN: &str = r#"
        [[window]]
        name = "weekend"
        time_zone = "Europe/Berlin"
        weekly = ["sat 02:00-06:00"]

        [[window_rule]]
        name = "deploys"
        windows = ["weekend"]
        operations = ["component.deploy"]
    "#;

    #[test]
    fn a_weekly_window_opens_and_closes_on_local_time() {
        let g = guardrails(BERLIN).expect("valid");
        // 2026-11-28 is a Saturday; Berlin is UTC+1 in winter.
        match g.check(&deploy("maintenance"), at("2026-11-28T01:30:00Z")) {
            WindowCheck::Open { window, closes_at, .. } => {
                assert_eq!(window, "weekend");
                assert_eq!(closes_at, at("2026-11-28T05:00:00Z"));
            }
            other => panic!("{other:?}"),
        }
        match g.check(&deploy("maintenance"), at("2026-11-28T05:00:00Z")) {
            WindowCheck::Closed { outside: Outside::Wait, next: Some((w, opens)), .. } => {
                assert_eq!(w, "weekend");
                assert_eq!(opens, at("2026-12-05T01:00:00Z"), "a week later");
            }
            other => panic!("{other:?}"),
        }
        // Not bound: an action is not named by the rule.
        let action = JobScope { operation: "action.trigger", ..deploy("maintenance") };
        assert_eq!(g.check(&action, at("2026-11-25T12:00:00Z")), WindowCheck::Unbound);
    }

    #[test]
    fn a_window_across_a_dst_change_keeps_its_local_hours() {
        let g = guardrails(BERLIN).expect("valid");
        // 2027-03-27 (Sat, UTC+1) and 2027-04-03 (Sat, UTC+2 after the 28 March change).
        let before = g.check(&deploy("m"), at("2027-03-27T01:00:00Z"));
        assert!(
            matches!(before, WindowCheck::Open { closes_at, .. } if closes_at == at("2027-03-27T05:00:00Z"))
        );
        let after = g.check(&deploy("m"), at("2027-04-03T00:00:00Z"));
        assert!(
            matches!(after, WindowCheck::Open { closes_at, .. } if closes_at == at("2027-04-03T04:00:00Z")),
            "{after:?}"
        );
        // 01:30Z on 3 April is 03:30 local: inside; 04:30Z is 06:30 local: outside.
        assert!(matches!(g.check(&deploy("m"), at("2027-04-03T04:30:00Z")), WindowCheck::Closed { .. }));
    }

    #[test]
    fn a_window_whose_start_the_clocks_skip_still_opens() {
        // 28 March 2027, Berlin: 02:00 → 03:00. A window starting 02:30 still opens.
        let g = guardrails(
            r#"
            [[window]]
            name = "w"
            time_zone = "Europe/Berlin"
            weekly = ["sun 02:30-04:00"]
            [[window_rule]]
            name = "r"
            windows = ["w"]
            "#,
        )
        .expect("valid");
        // The skipped 02:30 moves forward by the gap's length: 03:30 CEST, 01:30Z.
        let next = g.check(&deploy("m"), at("2027-03-27T12:00:00Z"));
        assert!(
            matches!(&next, WindowCheck::Closed { next: Some((_, t)), .. } if *t == at("2027-03-28T01:30:00Z")),
            "{next:?}"
        );
        assert!(
            matches!(g.check(&deploy("m"), at("2027-03-28T01:45:00Z")), WindowCheck::Open { closes_at, .. } if closes_at == at("2027-03-28T02:00:00Z"))
        );
    }

    #[test]
    fn a_window_across_midnight_spans_two_days() {
        let g = guardrails(
            r#"
            [[window]]
            name = "nights"
            weekly = ["fri 22:00-02:00"]
            [[window_rule]]
            name = "r"
            windows = ["nights"]
            outside = "refuse"
            "#,
        )
        .expect("valid");
        // 2026-11-27 is a Friday; UTC by default.
        assert!(
            matches!(g.check(&deploy("m"), at("2026-11-27T23:00:00Z")), WindowCheck::Open { closes_at, .. } if closes_at == at("2026-11-28T02:00:00Z"))
        );
        assert!(matches!(g.check(&deploy("m"), at("2026-11-28T01:59:59Z")), WindowCheck::Open { .. }));
        match g.check(&deploy("m"), at("2026-11-28T02:00:00Z")) {
            WindowCheck::Closed { outside: Outside::Refuse, next: Some((_, t)), .. } => {
                assert_eq!(t, at("2026-12-04T22:00:00Z"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn one_off_windows_and_scopes() {
        let g = guardrails(
            r#"
            [[window]]
            name = "change-1234"
            time_zone = "America/New_York"
            once = ["2026-12-01T22:00Z/4h", "2026-12-10T20:00/90m"]
            [[window_rule]]
            name = "db"
            windows = ["change-1234"]
            roles = ["maintenance"]
            components = ["db"]
            kinds = ["terraform"]
            on_close = "cancel"
            "#,
        )
        .expect("valid");
        assert!(matches!(
            g.check(&deploy("maintenance"), at("2026-12-02T01:59:00Z")),
            WindowCheck::Open { on_close: OnClose::Cancel, closes_at, .. } if closes_at == at("2026-12-02T02:00:00Z")
        ));
        // 20:00 New York (UTC-5) is 01:00Z the next day.
        assert!(matches!(
            g.check(&deploy("maintenance"), at("2026-12-05T00:00:00Z")),
            WindowCheck::Closed { next: Some((_, t)), .. } if t == at("2026-12-11T01:00:00Z")
        ));
        assert_eq!(g.check(&deploy("provision"), at("2026-12-02T00:00:00Z")), WindowCheck::Unbound);
        let other = JobScope { component: Some("web"), ..deploy("maintenance") };
        assert_eq!(g.check(&other, at("2026-12-02T00:00:00Z")), WindowCheck::Unbound);
        // After the last one-off window there is no next opening.
        assert!(matches!(
            g.check(&deploy("maintenance"), at("2027-01-01T00:00:00Z")),
            WindowCheck::Closed { next: None, .. }
        ));
    }

    fn finding(policy: &str, advisory: bool) -> byoc_policy::Finding {
        byoc_policy::Finding {
            policy: policy.into(),
            origin: byoc_policy::Origin::Customer,
            enforcement: if advisory {
                byoc_policy::Enforcement::Advisory
            } else {
                byoc_policy::Enforcement::Mandatory
            },
            rule: "r".into(),
            address: "aws_db_instance.main".into(),
            message: "m".into(),
            convention: None,
            from_rule: String::new(),
            details: None,
        }
    }

    #[test]
    fn plan_approval_rules_ask_by_outcome() {
        let g = guardrails(
            r#"
            [[approval_rule]]
            name = "every-plan"
            kinds = ["terraform"]
            components = ["db"]
            on = "plan"
            [[approval_rule]]
            name = "warned"
            kinds = ["terraform"]
            components = ["web"]
            on = "plan"
            when = "warn"
            [[approval_rule]]
            name = "named"
            kinds = ["terraform"]
            components = ["cache"]
            on = "plan"
            policies = ["customer/db.rego"]
            [[approval_rule]]
            name = "before-running"
            components = ["db"]
            "#,
        )
        .expect("valid: rules on the job and on the plan may overlap");
        let clean = byoc_policy::Decision {
            verdict: byoc_policy::Verdict::Allow,
            input_digest: String::new(),
            policies: vec![],
            violations: vec![],
            warnings: vec![],
            errors: vec![],
            elapsed_ms: 0,
        };
        let warned =
            byoc_policy::Decision { warnings: vec![finding("customer/tags.rego", true)], ..clean.clone() };
        let named =
            byoc_policy::Decision { warnings: vec![finding("customer/db.rego", true)], ..clean.clone() };
        let rule = |name: &str| g.approval_rules.iter().find(|r| r.name == name).unwrap();
        assert!(rule("every-plan").asks_for(&clean).is_some());
        assert_eq!(rule("warned").asks_for(&clean), None);
        assert!(rule("warned").asks_for(&warned).unwrap()[0].contains("customer/tags.rego"));
        assert_eq!(rule("named").asks_for(&warned), None);
        assert!(rule("named").asks_for(&named).is_some());
        assert_eq!(rule("before-running").asks_for(&clean), None, "a job rule asks before the job runs");
        let db = JobScope { component: Some("db"), ..deploy("maintenance") };
        assert_eq!(g.plan_approval_for(&db).map(|r| r.name.as_str()), Some("every-plan"));
        assert_eq!(g.approval_for(&db).map(|r| r.name.as_str()), Some("before-running"));

        let problems = guardrails(
            "[[approval_rule]]\nname = \"x\"\nwhen = \"warn\"\n[[approval_rule]]\nname = \"y\"\non = \"plan\"\nkinds = [\"action.script\"]\n[[approval_rule]]\nname = \"z\"\non = \"later\"\n",
        )
        .expect_err("invalid");
        let all = problems.join("\n");
        for needle in
            ["when and policies need on = \"plan\"", "terraform, helm and kubernetes jobs", "on = \"later\""]
        {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
    }

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
            "\"caturday\" is not a day",
            "\"sun 25:00-26:00\"",
            "start and end are the same time",
            "/0s",
            "\"yesterday\" is not a date",
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
