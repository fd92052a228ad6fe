//! What the relay reports over HTTP (served by [`crate::http`]): its metrics, and ready
//! while it has a working PostgreSQL session.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::metrics::Metrics;

/// How long the work loop may go without turning before `/healthz` fails. Every wait
/// in the loop is bounded well below this (poll interval, heartbeat interval, publish
/// timeouts, TCP keepalive and user timeouts on PostgreSQL connections), so a loop this
/// late is stuck, and a restart is the cure. An outage does not count: retrying turns
/// the loop.
pub const STUCK_AFTER_SECONDS: u64 = 120;

fn now_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Shared state the relay's HTTP server reports.
pub struct Health {
    /// Metrics to expose.
    pub metrics: Metrics,
    /// True while the relay has a working database session.
    pub ready: AtomicBool,
    /// Log tailing: the publication no longer publishes the outbox table, so nothing
    /// past that point is confirmed (and the relay is not ready).
    pub uncovered: AtomicBool,
    /// Log tailing keeping rows: what publishes the outbox table changed, and the relay
    /// holds until the change is accepted.
    pub gap_held: AtomicBool,
    /// Log tailing with `synchronizedStandbySlots`: the next commits have waited long
    /// for the standbys to flush them.
    pub standby_held: AtomicBool,
    /// When each work loop last turned (Unix seconds): one, or one per polling
    /// worker, so a worker stuck beside a turning one still fails liveness (its
    /// session would hold its partitions unpublished for good).
    turns: Vec<AtomicU64>,
}

impl Health {
    /// New state of a relay with one work loop: not ready, the loop counted as turning
    /// now.
    pub fn new(metrics: Metrics) -> Self {
        Self::with_loops(metrics, 1)
    }

    /// New state of a relay with `loops` work loops (at least one).
    pub fn with_loops(metrics: Metrics, loops: usize) -> Self {
        let now = now_seconds();
        Self {
            metrics,
            ready: AtomicBool::new(false),
            uncovered: AtomicBool::new(false),
            gap_held: AtomicBool::new(false),
            standby_held: AtomicBool::new(false),
            turns: (0..loops.max(1)).map(|_| AtomicU64::new(now)).collect(),
        }
    }

    /// The (first) work loop turned.
    pub fn turned(&self) {
        self.turned_by(0);
    }

    /// Work loop `index` turned.
    pub fn turned_by(&self, index: usize) {
        if let Some(turn) = self.turns.get(index) {
            turn.store(now_seconds(), Ordering::Relaxed);
        }
    }

    /// The loop that turned longest ago: its index and when (Unix seconds).
    fn stalest(&self) -> (usize, u64) {
        self.turns
            .iter()
            .map(|t| t.load(Ordering::Relaxed))
            .enumerate()
            .min_by_key(|(_, at)| *at)
            .unwrap_or((0, now_seconds()))
    }
}

impl crate::http::Probe for Health {
    fn metrics(&self) -> String {
        self.metrics.encode()
    }

    fn liveness(&self) -> Result<(), String> {
        let (index, at) = self.stalest();
        let idle = now_seconds().saturating_sub(at);
        if idle > STUCK_AFTER_SECONDS {
            let which = if self.turns.len() > 1 {
                format!("polling worker {index}'s loop")
            } else {
                "the relay's loop".to_owned()
            };
            Err(format!(
                "{which} has not turned for {idle}s (limit {STUCK_AFTER_SECONDS}s): stuck"
            ))
        } else {
            Ok(())
        }
    }

    fn readiness(&self) -> Result<(), &'static str> {
        if self.uncovered.load(Ordering::Relaxed) {
            Err("the publication no longer publishes the outbox table")
        } else if self.gap_held.load(Ordering::Relaxed) {
            Err(
                "what publishes the outbox table changed and inserts may have been skipped: holding until the change is accepted (see the log)",
            )
        } else if self.standby_held.load(Ordering::Relaxed) {
            Err(
                "waiting for the standby slots (synchronizedStandbySlots) to flush the next commits (see the log)",
            )
        } else if self.ready.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err("not connected to PostgreSQL")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::Probe;

    #[test]
    fn liveness_fails_only_when_the_loop_stopped_turning() {
        let health = Health::new(Metrics::new("ns", "relay", false));
        assert!(health.liveness().is_ok());
        health.turns[0].store(now_seconds() - STUCK_AFTER_SECONDS - 5, Ordering::Relaxed);
        let why = health.liveness().unwrap_err();
        assert!(why.contains("stuck"), "{why}");
        health.turned();
        assert!(health.liveness().is_ok());
        // Not ready is not dead: readiness and liveness are separate.
        assert!(health.readiness().is_err());
    }

    #[test]
    fn a_stuck_worker_fails_liveness_while_another_turns() {
        let health = Health::with_loops(Metrics::new("ns", "relay", false), 2);
        health.turns[1].store(now_seconds() - STUCK_AFTER_SECONDS - 5, Ordering::Relaxed);
        health.turned_by(0);
        let why = health.liveness().unwrap_err();
        assert!(why.contains("worker 1") && why.contains("stuck"), "{why}");
        health.turned_by(1);
        assert!(health.liveness().is_ok());
    }
}
