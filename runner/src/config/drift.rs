//! `[drift]`: the drift checks the runner starts itself (docs/DRIFT.md). Each schedule
//! names a component the runner has deployed (a terraform workspace, a kubernetes
//! component) and how often to check it.

use serde::Deserialize;

use super::fields::Fields;

/// Schedules may not come round more often than this.
const MIN_EVERY_SECS: u64 = 60;

#[derive(Debug, Clone, Default)]
pub struct DriftConfig {
    /// A role for the runner's own checks, asked as a runtime override (honoured only
    /// if the app's role config lets the customer name one); by default the role the
    /// app's operation matrix gives `component.drift` (maintenance).
    pub role: Option<String>,
    pub schedules: Vec<DriftSchedule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSchedule {
    name: String,
    kind: Option<String>,
    every: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriftSchedule {
    /// The terraform workspace or kubernetes component.
    pub name: String,
    /// `terraform` or `kubernetes`; needed only when both have the name.
    pub kind: Option<String>,
    pub every_secs: u64,
}

pub const DRIFT_KINDS: &[&str] = &["terraform", "kubernetes", "helm"];

impl DriftConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("drift", table, problems);
        let role: Option<String> = f.get("role");
        let raw: Vec<RawSchedule> = f.get("schedule").unwrap_or_default();
        let problems = f.finish();
        if role.as_deref().is_some_and(|r| r.trim().is_empty()) {
            problems.push("drift.role: must not be empty".into());
        }
        let mut schedules: Vec<DriftSchedule> = Vec::new();
        for (i, s) in raw.into_iter().enumerate() {
            let at = format!("drift.schedule[{i}] ({:?})", s.name);
            if !byoc_job_executors::terraform::valid_name(&s.name) {
                problems.push(format!("{at}: name is a workspace or component name (1-64 of [a-z0-9_-])"));
            }
            if let Some(k) = s.kind.as_deref().filter(|k| !DRIFT_KINDS.contains(k)) {
                problems.push(format!("{at}: kind {k:?} is not one of {}", DRIFT_KINDS.join(", ")));
            }
            let every_secs = match crate::clock::parse_duration(&s.every) {
                Ok(secs) if secs >= MIN_EVERY_SECS => secs,
                Ok(_) => {
                    problems.push(format!("{at}: every = {:?}: at least 1m", s.every));
                    continue;
                }
                Err(e) => {
                    problems.push(format!("{at}: every {e}"));
                    continue;
                }
            };
            let schedule = DriftSchedule { name: s.name, kind: s.kind, every_secs };
            if schedules.iter().any(|o| o.name == schedule.name && o.kind == schedule.kind) {
                problems.push(format!("{at}: {:?} is scheduled twice", schedule.name));
                continue;
            }
            schedules.push(schedule);
        }
        DriftConfig { role, schedules }
    }
}
