//! Concurrency slots per job group: a job runs holding one; a job waiting at a
//! window or for an approval gives it back and takes one again to run.

use super::*;

/// Per-group running counts against the configured limits.
pub(super) struct Slots {
    pub(super) limits: BTreeMap<String, usize>,
    pub(super) running: Mutex<BTreeMap<String, usize>>,
    pub(super) changed: Notify,
    /// Jobs with a live task: a second delivery of one is dropped.
    pub(super) in_hand: JobsInHand,
}

impl Slots {
    pub(super) fn free_groups(&self) -> Vec<String> {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        self.limits
            .iter()
            .filter(|(g, limit)| running.get(*g).copied().unwrap_or(0) < **limit)
            .map(|(g, _)| g.clone())
            .collect()
    }
    pub(super) fn total(&self) -> usize {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).values().sum()
    }
    /// Take a slot if the group has room under its limit.
    pub(super) fn try_acquire(&self, group: &str) -> bool {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let limit = self.limits.get(group).copied().unwrap_or(1);
        let n = running.entry(group.to_string()).or_default();
        if *n < limit {
            *n += 1;
            true
        } else {
            false
        }
    }
    pub(super) fn acquire(&self, group: &str) {
        *self.running.lock().unwrap_or_else(|e| e.into_inner()).entry(group.to_string()).or_default() += 1;
    }
    pub(super) fn release(&self, group: &str) {
        if let Some(n) = self.running.lock().unwrap_or_else(|e| e.into_inner()).get_mut(group) {
            *n = n.saturating_sub(1);
        }
        self.changed.notify_waiters();
    }
}

/// Holds a group slot; frees it (and wakes the poll loop) when dropped or while its
/// job waits for a maintenance window.
pub(super) struct SlotGuard {
    slots: Arc<Slots>,
    group: String,
    held: bool,
}

impl SlotGuard {
    /// A slot of `group`, taken whether or not the group is under its limit: the poll
    /// loop asked only for groups with room, so a job it was given always runs.
    pub(super) fn take(slots: &Arc<Slots>, group: String) -> SlotGuard {
        slots.acquire(&group);
        SlotGuard { slots: slots.clone(), group, held: true }
    }
}

impl pipeline::gate::JobSlot for SlotGuard {
    fn release(&mut self) {
        if std::mem::take(&mut self.held) {
            self.slots.release(&self.group);
        }
    }
    fn reacquire(&mut self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            while !self.held {
                let freed = self.slots.changed.notified();
                tokio::pin!(freed);
                freed.as_mut().enable();
                if self.slots.try_acquire(&self.group) {
                    self.held = true;
                } else {
                    freed.await;
                }
            }
        })
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        pipeline::gate::JobSlot::release(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeline::gate::JobSlot as _;

    fn slots(limit: usize) -> Arc<Slots> {
        Arc::new(Slots {
            limits: BTreeMap::from([("actions".to_string(), limit), ("sync".to_string(), 1)]),
            running: Mutex::default(),
            changed: Notify::new(),
            in_hand: JobsInHand::default(),
        })
    }

    #[test]
    fn a_group_at_its_limit_is_not_free_and_frees_when_a_guard_drops() {
        let s = slots(1);
        assert_eq!(s.free_groups(), ["actions", "sync"]);
        let guard = SlotGuard::take(&s, "actions".into());
        assert_eq!(s.free_groups(), ["sync"]);
        assert!(!s.try_acquire("actions"));
        assert_eq!(s.total(), 1);
        drop(guard);
        assert_eq!(s.total(), 0);
        assert!(s.try_acquire("actions"));
    }

    #[tokio::test]
    async fn a_waiting_job_gives_its_slot_back_and_takes_one_again_when_there_is_room() {
        let s = slots(1);
        let mut waiting = SlotGuard::take(&s, "actions".into());
        waiting.release();
        waiting.release(); // twice is once
        assert_eq!(s.total(), 0);
        let other = SlotGuard::take(&s, "actions".into());
        // The group is full: reacquire waits until `other` is dropped.
        let mut reacquire = waiting.reacquire();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(reacquire.as_mut().poll(&mut cx).is_pending());
        drop(other);
        reacquire.await;
        assert_eq!(s.total(), 1);
        drop(waiting);
        assert_eq!(s.total(), 0);
    }
}
