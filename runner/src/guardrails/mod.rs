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

mod parse;
pub use parse::parse;

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
pub struct JobSelector {
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
    /// What the job does, as the runner derives it from kind and spec (`read`,
    /// `change`, `destroy`, `copy`, `run`): a fact, where operations and components
    /// are labels the vendor chose.
    #[serde(default)]
    pub effects: Vec<String>,
}

/// A rule that holds matching jobs until a local admin approves them
/// (`byoc-runner approve JOB`); unanswered requests expire.
#[derive(Debug, Clone)]
pub struct ApprovalRule {
    pub name: String,
    pub scope: JobSelector,
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
    pub scope: JobSelector,
    pub outside: Outside,
    pub on_close: OnClose,
}

/// What a rule is matched against.
#[derive(Debug, Clone, Copy)]
pub struct JobAttributes<'a> {
    /// The role's name and its lifecycle type (`maintenance`, `break_glass`, …): a
    /// rule's `roles` matches either.
    pub role: Option<&'a str>,
    pub role_type: Option<&'a str>,
    /// `entity.operation`, e.g. `component.deploy`.
    pub operation: &'a str,
    pub component: Option<&'a str>,
    pub kind: &'a str,
    /// The runner's own account of what the job does (`byoc_protocol::Effect`).
    pub effect: &'a str,
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

impl JobSelector {
    fn matches(&self, job: &JobAttributes) -> bool {
        let any =
            |set: &[String], v: Option<&str>| set.is_empty() || v.is_some_and(|v| set.iter().any(|s| s == v));
        (any(&self.roles, job.role) || any(&self.roles, job.role_type))
            && any(&self.operations, Some(job.operation))
            && any(&self.components, job.component)
            && any(&self.kinds, Some(job.kind))
            && any(&self.effects, Some(job.effect))
    }

    /// Whether some job could match both rules: every scope is open on one side or
    /// shares a value.
    fn overlaps(&self, other: &JobSelector) -> bool {
        let meet =
            |a: &[String], b: &[String]| a.is_empty() || b.is_empty() || a.iter().any(|x| b.contains(x));
        meet(&self.roles, &other.roles)
            && meet(&self.operations, &other.operations)
            && meet(&self.components, &other.components)
            && meet(&self.kinds, &other.kinds)
            && meet(&self.effects, &other.effects)
    }
}

impl Guardrails {
    /// No rule of any kind: every job goes straight on.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.approval_rules.is_empty()
    }

    pub fn rule_for(&self, job: &JobAttributes) -> Option<&WindowRule> {
        self.rules.iter().find(|r| r.scope.matches(job))
    }

    /// The approval rule that holds `job` before it runs, if any.
    pub fn approval_for(&self, job: &JobAttributes) -> Option<&ApprovalRule> {
        self.approval_rules.iter().find(|r| r.on == ApprovalPoint::Job && r.scope.matches(job))
    }

    /// The approval rule asked between `job`'s plan decision and apply, if any.
    pub fn plan_approval_for(&self, job: &JobAttributes) -> Option<&ApprovalRule> {
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
    pub fn check(&self, job: &JobAttributes, now: i64) -> WindowCheck {
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

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn guardrails(text: &str) -> Result<Guardrails, Vec<String>> {
        let table: toml::Table = text.parse().expect("toml");
        let mut problems = Vec::new();
        let g = parse(table, &mut problems);
        if problems.is_empty() { Ok(g) } else { Err(problems) }
    }

    fn at(s: &str) -> i64 {
        s.parse::<Timestamp>().expect("timestamp").as_second()
    }

    fn deploy(role: &str) -> JobAttributes<'_> {
        JobAttributes {
            role: Some(role),
            role_type: None,
            operation: "component.deploy",
            component: Some("db"),
            kind: "terraform",
            effect: "change",
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

    /// A rule on the effect the runner derived holds a job whatever its labels say (a
    /// component the rule does not name, another role), and only jobs with that effect.
    #[test]
    fn a_rule_on_the_effect_binds_whatever_the_labels_say() {
        let g = guardrails(
            r#"
            [[window]]
            name = "weekend"
            time_zone = "UTC"
            weekly = ["sat 02:00-06:00"]

            [[window_rule]]
            name = "destructive"
            windows = ["weekend"]
            effects = ["change", "destroy"]
            "#,
        )
        .expect("valid");
        let now = at("2026-11-26T12:00:00Z");
        let relabelled =
            JobAttributes { component: Some("not-db"), operation: "sandbox.provision", ..deploy("other") };
        assert!(matches!(g.check(&relabelled, now), WindowCheck::Closed { .. }), "held by its effect");
        let reading = JobAttributes { effect: "read", ..deploy("maintenance") };
        assert_eq!(g.check(&reading, now), WindowCheck::Unbound);
        let bad = guardrails(
            "[[window]]\nname = \"w\"\ntime_zone = \"UTC\"\nweekly = [\"sat 02:00-06:00\"]\n[[window_rule]]\nname = \"r\"\nwindows = [\"w\"]\neffects = [\"delete\"]\n",
        );
        assert!(
            bad.err()
                .unwrap_or_default()
                .iter()
                .any(|p| p.contains("effect \"delete\" is not one of read, change, destroy, copy, run"))
        );
    }

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
        let action = JobAttributes { operation: "action.trigger", ..deploy("maintenance") };
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
        let other = JobAttributes { component: Some("web"), ..deploy("maintenance") };
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
            passes: vec![],
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
        let db = JobAttributes { component: Some("db"), ..deploy("maintenance") };
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
}
