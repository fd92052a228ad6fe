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
/// How long every round of publishing must have failed for the broker's reasons
/// before the relay reports not ready (a broker restart or a leader election passes
/// well within it).
pub const BROKER_DOWN_AFTER: std::time::Duration = std::time::Duration::from_secs(30);
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
    /// Since when (Unix seconds) every round of publishing has failed for the broker's
    /// reasons (unreachable, refusing the client); 0 while it takes messages.
    broker_down_since: AtomicU64,
    /// The broker's reason, from the first failure of the latest round.
    broker_reason: std::sync::Mutex<String>,
    /// Log tailing: a row that exhausted its attempts holds the stream (`onExhausted:
    /// block`), and why.
    blocked: std::sync::Mutex<Option<String>>,
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
            broker_down_since: AtomicU64::new(0),
            broker_reason: std::sync::Mutex::new(String::new()),
            blocked: std::sync::Mutex::new(None),
            turns: (0..loops.max(1)).map(|_| AtomicU64::new(now)).collect(),
        }
    }

    /// A round of publishing failed, for the broker's reason `why`, and published
    /// nothing.
    pub fn broker_failed(&self, why: &str) {
        let now = now_seconds();
        if self
            .broker_down_since
            .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            #[allow(clippy::cast_precision_loss)]
            self.metrics.broker_down_since.set(now as f64);
        }
        let steady = steady_reason(why);
        let mut reason = self
            .broker_reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *reason = steady;
    }

    /// The broker took a message.
    pub fn broker_took(&self) {
        if self.broker_down_since.swap(0, Ordering::Relaxed) != 0 {
            self.metrics.broker_down_since.set(0.0);
        }
    }

    /// The stream waits for a row that exhausted its attempts (`why`), or (`None`) no
    /// longer does.
    pub fn blocked_by(&self, why: Option<String>) {
        *self
            .blocked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = why;
    }

    /// The broker's reason, once every round has failed for [`BROKER_DOWN_AFTER`].
    fn broker_down(&self) -> Option<String> {
        let since = self.broker_down_since.load(Ordering::Relaxed);
        (since != 0 && now_seconds().saturating_sub(since) >= BROKER_DOWN_AFTER.as_secs()).then(
            || {
                self.broker_reason
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone()
            },
        )
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

/// The first line of a broker's reason without the client's counters and times
/// (librdkafka's `(after 3ms in state CONNECT, 4 identical error(s) suppressed)`): it
/// goes into a condition, which must not change with every retry.
fn steady_reason(why: &str) -> String {
    let mut line = why.lines().next().unwrap_or_default().to_owned();
    while let Some(start) = line.find(" (after ") {
        // The matching parenthesis: librdkafka's text nests one ("error(s)").
        let mut depth = 0_usize;
        let end = line[start + 1..].char_indices().find_map(|(i, c)| {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(start + 1 + i)
        });
        let Some(end) = end else {
            break;
        };
        line.replace_range(start..=end, "");
    }
    line
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

    fn readiness(&self) -> Result<(), String> {
        let why = if self.uncovered.load(Ordering::Relaxed) {
            "the publication no longer publishes the outbox table"
        } else if self.gap_held.load(Ordering::Relaxed) {
            "what publishes the outbox table changed and inserts may have been skipped: holding until the change is accepted (see the log)"
        } else if self.standby_held.load(Ordering::Relaxed) {
            "waiting for the standby slots (synchronizedStandbySlots) to flush the next commits (see the log)"
        } else if let Some(why) = self
            .blocked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
        {
            return Err(why);
        } else if let Some(reason) = self.broker_down() {
            return Err(format!("{}{reason}", crate::http::BROKER_DOWN_PREFIX));
        } else if self.ready.load(Ordering::Relaxed) {
            return Ok(());
        } else {
            "not connected to PostgreSQL"
        };
        Err(why.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::Probe;

    #[test]
    fn the_broker_reason_is_kept_steady_and_readiness_waits_before_failing() {
        assert_eq!(
            steady_reason(
                "Kafka: message timed out (last client error: b:9092/bootstrap: Failed to resolve 'b:9092': Name or service not known (after 2ms in state CONNECT, 3 identical error(s) suppressed))\nmore"
            ),
            "Kafka: message timed out (last client error: b:9092/bootstrap: Failed to resolve 'b:9092': Name or service not known)"
        );
        let health = Health::new(Metrics::new("n", "r", false));
        health.ready.store(true, Ordering::Relaxed);
        health.broker_failed("RabbitMQ: NOT_FOUND - no exchange 'x'");
        // Within BROKER_DOWN_AFTER: still ready.
        assert_eq!(health.readiness(), Ok(()));
        health.broker_down_since.store(1, Ordering::Relaxed);
        let why = health.readiness().unwrap_err();
        assert!(
            why.starts_with(crate::http::BROKER_DOWN_PREFIX) && why.contains("NOT_FOUND"),
            "{why}"
        );
        health.broker_took();
        assert_eq!(health.readiness(), Ok(()));
    }

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
