//! What the workers of one polling process share: failed rows, counted per process
//! whichever worker meets them and paused, blocked or dead-lettered (see
//! `relay::polling`, "Attempts"), and each worker's readiness and partitions, which
//! make the process's figures.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::api::OnExhausted;
use crate::broker::PublishError;
use crate::postgres::table::OutboxTable;
use crate::postgres::{OutboxRow, PgError, RowId};
use crate::relay::backoff::MAX_BACKOFF;
use crate::relay::config::Settings;
use crate::relay::http::Health;
use crate::relay::metrics::ErrorLabels;

/// How long a partition blocked by an exhausted row waits before the row is tried again.
const BLOCKED_RETRY: Duration = Duration::from_secs(60);

/// A partition that waits before its failing row is tried again.
pub(super) struct Pause {
    pub(super) until: Instant,
    pub(super) exhausted: bool,
}

/// Failed rows, counted per process whichever worker meets them.
#[derive(Default)]
pub(super) struct Failures {
    pub(super) attempts: HashMap<RowId, u32>,
    pub(super) paused: HashMap<i64, Pause>,
}

/// What the workers of one process share.
pub(super) struct Shared {
    failures: Mutex<Failures>,
    /// Each worker's readiness and owned partitions, for the process's figures.
    workers: Mutex<Vec<WorkerState>>,
}

#[derive(Default, Clone)]
pub(super) struct WorkerState {
    pub(super) ready: bool,
    pub(super) owned: BTreeSet<i64>,
}

impl Shared {
    pub(super) fn new(workers: usize) -> Self {
        Self {
            failures: Mutex::default(),
            workers: Mutex::new(vec![WorkerState::default(); workers]),
        }
    }

    pub(super) fn failures(&self) -> MutexGuard<'_, Failures> {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Updates worker `index`'s state and the process's figures: ready once every
    /// worker is, and the partitions they own together.
    pub(super) fn set(&self, index: usize, health: &Health, change: impl FnOnce(&mut WorkerState)) {
        let mut workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(state) = workers.get_mut(index) {
            change(state);
        }
        let ready = workers.iter().all(|w| w.ready);
        let owned: usize = workers.iter().map(|w| w.owned.len()).sum();
        health.ready.store(ready, Ordering::Relaxed);
        health
            .metrics
            .partitions_owned
            .set(i64::try_from(owned).unwrap_or(0));
    }

    /// Partitions blocked by an exhausted row among those the process publishes (every
    /// partition without per-aggregate order).
    pub(super) fn blocked(&self, per_aggregate: bool) -> usize {
        // Lock order: `workers`, then `failures` (nothing takes them the other way).
        let workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        self.failures()
            .paused
            .iter()
            .filter(|(p, pause)| {
                pause.exhausted && (!per_aggregate || workers.iter().any(|w| w.owned.contains(p)))
            })
            .count()
    }

    /// Pauses `partition` for every worker of the process.
    fn pause(&self, partition: i64, pause: Pause) {
        self.failures().paused.insert(partition, pause);
    }

    /// Counts a failed row; pauses, blocks or dead-letters it. Returns true when the
    /// failure was an outage (the whole relay backs off).
    pub(super) async fn handle_failure(
        &self,
        settings: &Settings,
        health: &Health,
        tx: &tokio_postgres::Transaction<'_>,
        table: &OutboxTable,
        row: &OutboxRow,
        err: &PublishError,
    ) -> Result<bool, PgError> {
        let m = &health.metrics;
        if !err.is_refused() {
            m.publish_errors
                .get_or_create(&ErrorLabels {
                    kind: "unavailable",
                })
                .inc();
            // Logged once for the batch (`Outage`), not once a row.
            return Ok(true);
        }
        m.publish_errors
            .get_or_create(&ErrorLabels { kind: "row" })
            .inc();
        let attempts = {
            let mut failures = self.failures();
            let attempts = failures.attempts.entry(row.id.clone()).or_insert(0);
            *attempts += 1;
            *attempts
        };
        if attempts < settings.max_attempts {
            let pause = Duration::from_millis(200)
                .saturating_mul(1 << attempts.min(8))
                .min(MAX_BACKOFF);
            tracing::warn!(
                row = %row.id,
                partition = row.partition,
                attempts,
                error = %err,
                "row refused by the broker; retrying its partition later"
            );
            self.pause(
                row.partition,
                Pause {
                    until: Instant::now() + pause,
                    exhausted: false,
                },
            );
            return Ok(false);
        }
        match settings.on_exhausted() {
            OnExhausted::DeadLetter => {
                // In a savepoint: a dead-letter write that fails (the table dropped, a
                // privilege revoked) must not roll back the batch's marks, or every row
                // the batch published would be published again on each attempt.
                match table
                    .dead_letter_in_batch(tx, &row.id, &err.message())
                    .await?
                {
                    Ok(_) => {
                        self.failures().attempts.remove(&row.id);
                        m.dead_lettered.inc();
                        tracing::error!(
                            row = %row.id,
                            partition = row.partition,
                            attempts,
                            error = %err,
                            dead_letter_table = %settings.dead_letter_table,
                            "row exhausted its attempts; moved to the dead-letter table"
                        );
                    }
                    Err(dead) => {
                        m.publish_errors
                            .get_or_create(&ErrorLabels {
                                kind: "dead_letter",
                            })
                            .inc();
                        tracing::error!(
                            row = %row.id,
                            partition = row.partition,
                            error = %dead,
                            "row exhausted its attempts and cannot be dead-lettered; its partition is blocked until it can"
                        );
                        self.pause(
                            row.partition,
                            Pause {
                                until: Instant::now() + BLOCKED_RETRY,
                                exhausted: true,
                            },
                        );
                    }
                }
            }
            OnExhausted::Block => {
                tracing::error!(
                    row = %row.id,
                    partition = row.partition,
                    attempts,
                    error = %err,
                    "row exhausted its attempts; its partition is blocked until it can be published"
                );
                self.pause(
                    row.partition,
                    Pause {
                        until: Instant::now() + BLOCKED_RETRY,
                        exhausted: true,
                    },
                );
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_ready_once_every_worker_is_and_owns_what_they_own_together() {
        let health = Health::new(crate::relay::metrics::Metrics::new("ns", "relay", false));
        let shared = Shared::new(2);
        shared.set(0, &health, |w| {
            w.ready = true;
            w.owned = BTreeSet::from([0, 1]);
        });
        assert!(!health.ready.load(Ordering::Relaxed), "one of two workers");
        assert_eq!(health.metrics.partitions_owned.get(), 2);
        shared.set(1, &health, |w| {
            w.ready = true;
            w.owned = BTreeSet::from([2, 3]);
        });
        assert!(health.ready.load(Ordering::Relaxed));
        assert_eq!(health.metrics.partitions_owned.get(), 4);
        // A worker's session ends: not ready, its partitions gone.
        shared.set(1, &health, |w| *w = WorkerState::default());
        assert!(!health.ready.load(Ordering::Relaxed));
        assert_eq!(health.metrics.partitions_owned.get(), 2);
    }

    #[test]
    fn a_blocked_partition_counts_once_for_the_process() {
        let health = Health::new(crate::relay::metrics::Metrics::new("ns", "relay", false));
        let shared = Shared::new(2);
        shared.set(0, &health, |w| w.owned = BTreeSet::from([0, 1]));
        shared.set(1, &health, |w| w.owned = BTreeSet::from([2, 3]));
        let later = Instant::now() + Duration::from_secs(60);
        let mut failures = shared.failures();
        for (partition, exhausted) in [(1, true), (2, false), (3, true), (7, true)] {
            failures.paused.insert(
                partition,
                Pause {
                    until: later,
                    exhausted,
                },
            );
        }
        drop(failures);
        // Owned by a worker and exhausted: 1 and 3 (7 went to another process).
        assert_eq!(shared.blocked(true), 2);
        // Without per-aggregate order every worker polls every partition: each blocked
        // partition once, not once per worker.
        assert_eq!(shared.blocked(false), 3);
    }
}
