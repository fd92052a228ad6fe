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
    /// When the work loop last turned (Unix seconds).
    pub last_turn: AtomicU64,
}

impl Health {
    /// New state: not ready, the loop counted as turning now.
    pub fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            ready: AtomicBool::new(false),
            uncovered: AtomicBool::new(false),
            last_turn: AtomicU64::new(now_seconds()),
        }
    }

    /// The work loop turned.
    pub fn turned(&self) {
        self.last_turn.store(now_seconds(), Ordering::Relaxed);
    }
}

impl crate::http::Probe for Health {
    fn metrics(&self) -> String {
        self.metrics.encode()
    }

    fn liveness(&self) -> Result<(), String> {
        let idle = now_seconds().saturating_sub(self.last_turn.load(Ordering::Relaxed));
        if idle > STUCK_AFTER_SECONDS {
            Err(format!(
                "the relay's loop has not turned for {idle}s (limit {STUCK_AFTER_SECONDS}s): stuck"
            ))
        } else {
            Ok(())
        }
    }

    fn readiness(&self) -> Result<(), &'static str> {
        if self.uncovered.load(Ordering::Relaxed) {
            Err("the publication no longer publishes the outbox table")
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
        health
            .last_turn
            .store(now_seconds() - STUCK_AFTER_SECONDS - 5, Ordering::Relaxed);
        let why = health.liveness().unwrap_err();
        assert!(why.contains("stuck"), "{why}");
        health.turned();
        assert!(health.liveness().is_ok());
        // Not ready is not dead: readiness and liveness are separate.
        assert!(health.readiness().is_err());
    }
}
