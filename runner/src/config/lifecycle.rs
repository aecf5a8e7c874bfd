//! `[lifecycle]`: the instance's own end — a Spot interruption notice or an Auto Scaling
//! termination — read from the metadata service, on which the runner hands over.

use std::time::Duration;

use super::fields::Fields;

#[derive(Debug, Clone, Default)]
pub struct LifecycleConfig {
    /// Watch the metadata service (on EC2; the install stack sets it).
    pub watch: bool,
    pub poll: Duration,
    /// Running jobs are stopped this long before the instance goes, so that the stop
    /// and the hand-over finish in time.
    pub margin: Duration,
    /// The Auto Scaling group and its termination lifecycle hook, to complete the hook
    /// once drained (both or neither).
    pub autoscaling_group: Option<String>,
    pub lifecycle_hook: Option<String>,
    /// How long an Auto Scaling termination waits for the hook (its heartbeat timeout).
    pub hook_timeout: Duration,
}

impl LifecycleConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("lifecycle", table, problems);
        let watch = f.get("watch").unwrap_or(false);
        let poll = f.secs("poll_secs", 5, 1..=60);
        let margin = f.secs("margin_secs", 15, 0..=600);
        let autoscaling_group: Option<String> = f.get("autoscaling_group");
        let lifecycle_hook: Option<String> = f.get("lifecycle_hook");
        let hook_timeout = f.secs("hook_timeout_secs", 300, 30..=7200);
        let problems = f.finish();
        if autoscaling_group.is_some() != lifecycle_hook.is_some() {
            problems.push(
                "lifecycle.autoscaling_group and lifecycle.lifecycle_hook: give both or neither".into(),
            );
        }
        // Auto Scaling's own name rules (no control characters, 1-255).
        for (name, v) in [("autoscaling_group", &autoscaling_group), ("lifecycle_hook", &lifecycle_hook)] {
            if let Some(v) = v
                && (v.is_empty() || v.len() > 255 || v.chars().any(char::is_control))
            {
                problems.push(format!("lifecycle.{name}: {v:?} is not a name (1-255 characters)"));
            }
        }
        LifecycleConfig { watch, poll, margin, autoscaling_group, lifecycle_hook, hook_timeout }
    }
}
