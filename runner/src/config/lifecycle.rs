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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> (LifecycleConfig, Vec<String>) {
        let mut problems = Vec::new();
        let table: toml::Table = text.parse().unwrap_or_default();
        (LifecycleConfig::parse(table, &mut problems), problems)
    }

    #[test]
    fn off_by_default_and_the_group_and_hook_go_together() {
        let (c, problems) = parse("");
        assert!(!c.watch && problems.is_empty());
        assert_eq!(
            (c.poll, c.margin, c.hook_timeout),
            (Duration::from_secs(5), Duration::from_secs(15), Duration::from_secs(300))
        );
        let (_, problems) = parse("watch = true\nautoscaling_group = \"g\"");
        assert!(problems.iter().any(|p| p.contains("both or neither")), "{problems:?}");
        let (_, problems) = parse("autoscaling_group = \"g\\n\"\nlifecycle_hook = \"h\"");
        assert!(problems.iter().any(|p| p.contains("lifecycle.autoscaling_group")), "{problems:?}");
        let (c, problems) =
            parse("watch = true\nautoscaling_group = \"g\"\nlifecycle_hook = \"h\"\nmargin_secs = 5");
        assert!(problems.is_empty() && c.watch && c.margin == Duration::from_secs(5), "{problems:?}");
    }
}
