//! Starting the runner's own drift checks (`crate::drift::local`): the `[drift]`
//! schedules that are due and the checks `byoc-runner drift run` asked for, looked at
//! before every poll. Each is admitted like a delivery (pause, disk, role, policies)
//! and runs in a slot of its group; one that cannot start now is skipped with a reason,
//! audited (`drift_skipped`), and a schedule tries again within ten minutes.

use std::collections::BTreeMap;

use byoc_protocol::JobEnvelope;

use super::*;
use crate::drift::local;
use crate::guardrails::WindowCheck;

/// A skipped schedule is tried again this soon (or at its period, if shorter).
const RETRY_SKIPPED_MS: u64 = 600_000;

#[derive(Default)]
pub(super) struct LocalDrift {
    /// When each schedule was last tried, by (name, kind).
    last_tried: BTreeMap<(String, Option<String>), u64>,
}

/// Why a check did not start.
struct Skip {
    reason: &'static str,
    detail: String,
}

impl LocalDrift {
    pub(super) fn start_due(&mut self, rt: &Rt, slots: &Arc<Slots>, tasks: &mut JoinSet<()>) {
        let requests = local::take_requests(&rt.state_dir);
        for r in requests {
            let trigger = format!("requested by {}", r.by);
            match self.start(rt, slots, tasks, &r.name, r.kind.as_deref(), &trigger) {
                Ok(()) => {}
                // Its group is busy: asked again at the next look.
                Err(None) => {
                    if let Err(e) = local::request(&rt.state_dir, &r) {
                        tracing::error!(error = %e, name = %r.name, "Could not keep a drift check request for later: {e}.");
                    }
                }
                Err(Some(skip)) => audit_skip(rt, &r.name, &trigger, skip),
            }
        }
        if rt.config.drift.schedules.is_empty() {
            return;
        }
        let now_ms = rt.clock.now_ms();
        let records = crate::drift::list(&rt.state_dir);
        let due: Vec<crate::config::DriftSchedule> =
            local::due(&rt.config.drift.schedules, &records, &self.last_tried, now_ms)
                .into_iter()
                .cloned()
                .collect();
        for s in due {
            let trigger = format!("schedule every {}s", s.every_secs);
            let key = (s.name.clone(), s.kind.clone());
            match self.start(rt, slots, tasks, &s.name, s.kind.as_deref(), &trigger) {
                Ok(()) => {
                    self.last_tried.insert(key, now_ms);
                }
                Err(None) => {}
                Err(Some(skip)) => {
                    let period_ms = s.every_secs * 1000;
                    let retry_in = RETRY_SKIPPED_MS.min(period_ms);
                    self.last_tried.insert(key, now_ms.saturating_sub(period_ms) + retry_in);
                    audit_skip(rt, &s.name, &trigger, skip);
                }
            }
        }
    }

    /// `Err(None)`: not now (its group has no free slot, or a check of it runs).
    fn start(
        &mut self,
        rt: &Rt,
        slots: &Arc<Slots>,
        tasks: &mut JoinSet<()>,
        name: &str,
        kind: Option<&str>,
        trigger: &str,
    ) -> Result<(), Option<Skip>> {
        let target = local::find(&rt.state_dir, name, kind)
            .map_err(|e| Some(Skip { reason: "drift_target_unknown", detail: e.to_string() }))?;
        let prefix = format!("{}drift-{}-{}-", byoc_protocol::LOCAL_JOB_PREFIX, target.kind, target.name);
        // One check of a component at a time: its task holds it in hand until it ends.
        if slots.in_hand.any_starting_with(&prefix)
            || !slots.free_groups().iter().any(|g| g == byoc_protocol::job_group(&target.kind))
        {
            return Err(None);
        }
        let mut payload = local::payload(
            &target,
            &rt.runner_id,
            &rt.install_id,
            rt.clock.unix_now(),
            rt.config.drift.role.as_deref(),
        );
        // The runner proposes the role the app's chain gives a drift check (which may
        // be a read-only role of its own), not the deploy's.
        payload.requested_role = crate::roles::chain::own_proposal(&payload, &rt.roles.install)
            .map_err(|e| Some(Skip { reason: e.reason.code(), detail: e.detail }))?;
        let payload_sha256 = byoc_protocol::sha256_hex(&serde_json::to_vec(&payload).unwrap_or_default());
        // No envelope: nothing of a local check is ever kept to be verified again (it is
        // never held, below).
        let polled = PolledJob {
            delivery_id: payload.job_id.clone(),
            envelope: JobEnvelope {
                payload: String::new(),
                signature: String::new(),
                key_id: "local".into(),
            },
            received_at: std::time::Instant::now(),
        };
        let pause = rt.check_customer_controls();
        let disk = rt.config.disk.check(&rt.state_dir);
        let readiness = pipeline::readiness(rt);
        let verifier = pipeline::verifier(rt, &readiness, pause.as_ref(), disk.low.as_deref());
        let job = rt
            .journal
            .with_index(|index| {
                verifier.admit(payload, payload_sha256, polled, index, pipeline::Origin::Local)
            })
            .map_err(|r| Some(Skip { reason: r.reason.code(), detail: r.detail }))?;
        // The customer's guardrails hold a delivery; a local check is not held (there is
        // no vendor's envelope to keep): outside its window, or under an approval rule,
        // it waits for the next time instead.
        if let WindowCheck::Closed { rule, next, .. } = pipeline::window::check(rt, &job) {
            let opens = next.map(|(w, at)| format!("; {w:?} opens next at {}", crate::clock::rfc3339(at)));
            return Err(Some(Skip {
                reason: "outside_window",
                detail: format!("outside the windows of rule {rule:?}{}", opens.unwrap_or_default()),
            }));
        }
        if let Some(rule) = pipeline::approval::approval_rule(rt, &job) {
            return Err(Some(Skip {
                reason: "approval_required",
                detail: format!(
                    "approval rule {:?} names it, and the runner's own checks are not held for approval",
                    rule.name
                ),
            }));
        }
        let Some(in_hand) = slots.in_hand.mark(&job.payload.job_id) else { return Err(None) };
        if let Err(e) = pipeline::record_received(rt, &job) {
            tracing::error!(error = %e, "Could not journal a drift check; not running it: {e}.");
            return Err(None);
        }
        let mut record = crate::audit_records::note(
            "drift_check_started",
            format!("{} {} ({trigger}), from deploy {}", target.kind, target.name, target.from_job),
        );
        record.job = Some(job.payload.job_id.clone());
        rt.audit_or_log(record, "a drift check's start");
        tracing::info!(job_id = %job.payload.job_id, name, trigger, "Starting a drift check.");
        start_job(rt, slots, tasks, job, in_hand);
        Ok(())
    }
}

fn audit_skip(rt: &Rt, name: &str, trigger: &str, skip: Skip) {
    tracing::warn!(name, trigger, reason = skip.reason, detail = %skip.detail, "Drift check not started.");
    let record = crate::audit_records::drift_skipped(name, trigger, skip.reason, &skip.detail);
    rt.audit_or_log(record, "a skipped drift check");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

    const SCHEDULE: &str = "[drift]\n[[drift.schedule]]\nname = \"network\"\nevery = \"1h\"\n";

    fn slots() -> Arc<Slots> {
        Arc::new(Slots {
            limits: BTreeMap::from([("deploys".to_string(), 1), ("actions".to_string(), 1)]),
            running: std::sync::Mutex::default(),
            changed: tokio::sync::Notify::new(),
            in_hand: pipeline::JobsInHand::default(),
        })
    }

    fn deployed(f: &testing::Fakes) {
        let mut p = testing::payload("deploy-1");
        (p.kind, p.entity, p.operation) = ("terraform".into(), "component".into(), "deploy".into());
        p.spec = serde_json::json!({"mode": "apply", "workspace": "network", "files": {"main.tf": ""}});
        let exec = byoc_job_executors::build(&p.kind, &p.spec).expect("builds");
        assert!(local::remember(&f.rt.state_dir, &p, exec.as_ref(), 1).expect("kept"));
    }

    fn local_jobs(f: &testing::Fakes) -> usize {
        f.rt.journal.with_index(|i| {
            i.jobs.keys().filter(|id| id.starts_with("local-drift-terraform-network-")).count()
        })
    }

    fn audited(f: &testing::Fakes, event: &str) -> Vec<byoc_audit::log::Record> {
        f.audit
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|r| r.event == event)
            .cloned()
            .collect()
    }

    /// One look of the poll loop, and whatever it started run to its end.
    async fn look(f: &testing::Fakes, d: &mut LocalDrift, slots: &Arc<Slots>) {
        let mut tasks = JoinSet::new();
        d.start_due(&f.rt, slots, &mut tasks);
        while tasks.join_next().await.is_some() {}
    }

    #[tokio::test]
    async fn a_schedule_runs_by_the_injected_clock_and_a_pause_stops_it() {
        let f = testing::runtime_with(SCHEDULE).await;
        let (slots, mut d) = (slots(), LocalDrift::default());
        // Nothing deployed yet: skipped, said why.
        look(&f, &mut d, &slots).await;
        assert_eq!(local_jobs(&f), 0);
        let skipped = audited(&f, "drift_skipped");
        assert_eq!(skipped[0].reason.as_deref(), Some("drift_target_unknown"), "{skipped:?}");

        deployed(&f);
        // Tried again within ten minutes of the skip, not before.
        f.clock.advance_secs(300);
        look(&f, &mut d, &slots).await;
        assert_eq!(local_jobs(&f), 0);
        f.clock.advance_secs(300);
        look(&f, &mut d, &slots).await;
        assert_eq!(local_jobs(&f), 1, "{:?}", testing::journaled(&f));
        let started = audited(&f, "drift_check_started");
        assert!(started[0].detail.as_deref().unwrap_or("").contains("schedule every 3600s"), "{started:?}");
        assert!(started[0].detail.as_deref().unwrap_or("").contains("from deploy deploy-1"), "{started:?}");
        // Its control-plane calls never reach the control plane.
        assert!(!f.cp.calls().iter().any(|c| c.contains("local-")), "{:?}", f.cp.calls());

        // Not again within the hour; then again.
        f.clock.advance_secs(1800);
        look(&f, &mut d, &slots).await;
        assert_eq!(local_jobs(&f), 1);
        // Paused when it is due: skipped, audited, nothing journaled.
        crate::roles::pause::pause(&f.rt.state_dir, Some("freeze".into()), "alice".into()).expect("pause");
        f.clock.advance_secs(1800);
        look(&f, &mut d, &slots).await;
        assert_eq!(local_jobs(&f), 1);
        let skipped = audited(&f, "drift_skipped");
        assert_eq!(skipped.last().and_then(|r| r.reason.as_deref()), Some("paused"), "{skipped:?}");
        // Resumed: within ten minutes.
        crate::roles::pause::resume(&f.rt.state_dir).expect("resume");
        f.clock.advance_secs(600);
        look(&f, &mut d, &slots).await;
        assert_eq!(local_jobs(&f), 2);
    }
}
