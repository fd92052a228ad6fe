//! The relay's Prometheus metrics. Labels are bounded: the relay's namespace and name
//! (constant labels) and an error kind; never row or aggregate ids.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `kind` label of publish errors: `row` (the broker refused the message) or
/// `unavailable` (outage, timeout).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// `row` or `unavailable`.
    pub kind: &'static str,
}

/// `status` label of `outbox_relay_slot_wal_status`: PostgreSQL's `wal_status`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WalStatusLabels {
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub status: &'static str,
}

/// The values `pg_replication_slots.wal_status` takes, each exported as its own series.
pub const WAL_STATUSES: [&str; 4] = ["reserved", "extended", "unreserved", "lost"];

/// Every metric the relay exports.
pub struct Metrics {
    /// Messages acknowledged by the broker and marked or deleted.
    pub published: Counter,
    /// Failed publishes.
    pub publish_errors: Family<ErrorLabels, Counter>,
    /// Rows moved to the dead-letter table.
    pub dead_lettered: Counter,
    /// Seconds per batch (select, publish, mark, commit).
    pub batch_duration: Histogram,
    /// Seconds from a row's insertion to its acknowledgement (needs createdAt).
    pub end_to_end_lag: Histogram,
    /// Rows waiting to be published.
    pub backlog_rows: Gauge,
    /// Age of the oldest unpublished row.
    pub oldest_unpublished_age: Gauge<f64, AtomicU64>,
    /// Partitions this process owns.
    pub partitions_owned: Gauge,
    /// Owned partitions stopped by an exhausted row (`failure.onExhausted: block`).
    pub partitions_blocked: Gauge,
    /// Unix time of the last successful batch.
    pub last_success: Gauge<f64, AtomicU64>,
    /// Unix time since which every round of publishing has failed for the broker's
    /// reasons; 0 while the broker takes messages.
    pub broker_down_since: Gauge<f64, AtomicU64>,
    /// Log tailing: WAL the replication slot retains (`pg_current_wal_lsn() - restart_lsn`).
    pub slot_retained_wal: Gauge,
    /// Log tailing: 1 while a walsender streams the slot.
    pub slot_active: Gauge,
    /// Log tailing: 1 for the slot's current `wal_status`, 0 for the others.
    pub slot_wal_status: Family<WalStatusLabels, Gauge>,
    /// Log tailing: rows the reconciliation sweep found (missed by the tail) and published.
    pub sweep_found: Counter,
    /// Log tailing: sweeps that looked at the table.
    pub sweeps: Counter,
    /// Log tailing with `deleteAfterPublish`: rows published from the table because
    /// what publishes it changed (inserts in between may not have been streamed).
    pub gap_back_filled: Counter,
    /// Log tailing keeping rows: times the relay held because what publishes the table
    /// changed.
    pub gap_held: Counter,
    /// Log tailing with `synchronizedStandbySlots`: WAL bytes between what the standbys
    /// flushed and the batch waiting for them (0 when none waits).
    pub standby_wait: Gauge,
    registry: Registry,
}

impl Metrics {
    /// The backlog as the table shows it: waiting rows and the oldest one's age (0 when
    /// none, or without a created-at column).
    pub fn set_backlog(&self, backlog: &crate::postgres::admin::Backlog) {
        self.backlog_rows.set(backlog.rows);
        self.oldest_unpublished_age
            .set(backlog.oldest_age_seconds.unwrap_or(0.0).max(0.0));
    }

    /// Registers every metric, labelled with the relay's namespace and name. The slot
    /// metrics are registered only for a log-tailing relay (`log_tailing`): a polling
    /// relay has no slot, and a constant 0 would read as an inactive one.
    pub fn new(namespace: &str, name: &str, log_tailing: bool) -> Self {
        let mut registry = Registry::with_labels(
            [
                ("relay_namespace".into(), namespace.to_owned().into()),
                ("relay_name".into(), name.to_owned().into()),
            ]
            .into_iter(),
        );
        let published = Counter::default();
        let publish_errors = Family::<ErrorLabels, Counter>::default();
        // Both kinds exist from the start at 0: a family without series is left out of
        // the exposition entirely, and `rate()` over a series born at its first error
        // misses that error.
        for kind in ["row", "unavailable"] {
            drop(publish_errors.get_or_create(&ErrorLabels { kind }));
        }
        let dead_lettered = Counter::default();
        let batch_duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let end_to_end_lag = Histogram::new(exponential_buckets(0.005, 2.0, 16));
        let backlog_rows = Gauge::default();
        let oldest_unpublished_age = Gauge::<f64, AtomicU64>::default();
        let partitions_owned = Gauge::default();
        let partitions_blocked = Gauge::default();
        let last_success = Gauge::<f64, AtomicU64>::default();
        let broker_down_since = Gauge::<f64, AtomicU64>::default();
        let slot_retained_wal = Gauge::default();
        let slot_active = Gauge::default();
        let sweep_found = Counter::default();
        let sweeps = Counter::default();
        let gap_back_filled = Counter::default();
        let gap_held = Counter::default();
        let standby_wait = Gauge::default();
        let slot_wal_status = Family::<WalStatusLabels, Gauge>::default();
        for status in WAL_STATUSES {
            drop(slot_wal_status.get_or_create(&WalStatusLabels { status }));
        }
        if log_tailing {
            // These names are what the PrometheusRule's slot alerts query.
            registry.register(
                "outbox_relay_slot_retained_wal_bytes",
                "WAL retained by the replication slot (current WAL position minus restart_lsn)",
                slot_retained_wal.clone(),
            );
            registry.register(
                "outbox_relay_slot_active",
                "1 while a consumer streams the replication slot",
                slot_active.clone(),
            );
            registry.register(
                "outbox_relay_slot_wal_status",
                "1 for the replication slot's current wal_status",
                slot_wal_status.clone(),
            );
            registry.register(
                "outbox_relay_sweep_found",
                "Rows the reconciliation sweep found still in the table long after their insert (missed by the log tail) and published",
                sweep_found.clone(),
            );
            registry.register(
                "outbox_relay_sweeps",
                "Reconciliation sweeps that looked at the table (rows of transactions the log tail has surely streamed)",
                sweeps.clone(),
            );
            registry.register(
                "outbox_relay_publication_gap_back_filled",
                "Rows published from the table because what publishes it changed (a DROP and ADD of the table, ALTER PUBLICATION ... SET): inserts in between may not have been streamed",
                gap_back_filled.clone(),
            );
            registry.register(
                "outbox_relay_publication_gap_held",
                "Times the relay (keeping rows) stopped because what publishes the table changed; it holds until the change is accepted",
                gap_held.clone(),
            );
            registry.register(
                "outbox_relay_standby_wait_bytes",
                "WAL bytes between what the standby slots (synchronizedStandbySlots) flushed and the batch waiting for them; 0 when none waits",
                standby_wait.clone(),
            );
        }
        // Counters get their `_total` suffix from the library.
        registry.register(
            "outbox_relay_published",
            "Messages acknowledged by the broker and marked published",
            published.clone(),
        );
        registry.register(
            "outbox_relay_publish_errors",
            "Failed publishes, by kind (row or unavailable)",
            publish_errors.clone(),
        );
        registry.register(
            "outbox_relay_dead_lettered",
            "Rows moved to the dead-letter table",
            dead_lettered.clone(),
        );
        registry.register(
            "outbox_relay_batch_duration_seconds",
            "Duration of one batch transaction",
            batch_duration.clone(),
        );
        registry.register(
            "outbox_relay_end_to_end_lag_seconds",
            "Time from a row's insertion to the broker's acknowledgement",
            end_to_end_lag.clone(),
        );
        registry.register(
            "outbox_relay_backlog_rows",
            "Rows waiting to be published",
            backlog_rows.clone(),
        );
        registry.register(
            "outbox_relay_oldest_unpublished_age_seconds",
            "Age of the oldest unpublished row",
            oldest_unpublished_age.clone(),
        );
        registry.register(
            "outbox_relay_partitions_owned",
            "Partitions this relay process owns",
            partitions_owned.clone(),
        );
        registry.register(
            "outbox_relay_partitions_blocked",
            "Owned partitions stopped by a row that exhausted its attempts",
            partitions_blocked.clone(),
        );
        registry.register(
            "outbox_relay_last_success_timestamp_seconds",
            "Unix time of the last successful batch",
            last_success.clone(),
        );
        registry.register(
            "outbox_relay_broker_down_since_timestamp_seconds",
            "Unix time since which every round of publishing has failed for the broker's reasons (unreachable, refusing the client); 0 while it takes messages",
            broker_down_since.clone(),
        );
        Self {
            published,
            publish_errors,
            dead_lettered,
            batch_duration,
            end_to_end_lag,
            backlog_rows,
            oldest_unpublished_age,
            partitions_owned,
            partitions_blocked,
            last_success,
            broker_down_since,
            slot_retained_wal,
            slot_active,
            slot_wal_status,
            sweep_found,
            sweeps,
            gap_back_filled,
            gap_held,
            standby_wait,
            registry,
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
