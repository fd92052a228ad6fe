//! The operator's own Prometheus metrics: reconciles, their errors by category, API
//! writes and whether this replica leads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SwitchLabels {
    namespace: String,
    relay: String,
    to: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RelayLabels {
    namespace: String,
    relay: String,
}

/// A relay, labelled as the relay's own metrics are, so that its alerts select both.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OwnLabels {
    relay_namespace: String,
    relay_name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CategoryLabel {
    category: &'static str,
}

/// The metrics, shared by the reconciler and the HTTP server.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ResultLabel, Counter>,
    errors: Family<CategoryLabel, Counter>,
    writes: Counter,
    leader: Gauge,
    orphaned_slots: Gauge,
    duration: Histogram,
    switches: Family<SwitchLabels, Counter>,
    slot_lost: Family<RelayLabels, Gauge>,
    slot_wal: Family<OwnLabels, Gauge>,
    // Plain copies for callers that embed the controller (tests) and want a number
    // without parsing the text format.
    reconciles_total: AtomicU64,
    writes_total: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("outbox_operator");
        let reconciles = Family::<ResultLabel, Counter>::default();
        let errors = Family::<CategoryLabel, Counter>::default();
        let writes = Counter::default();
        let leader = Gauge::default();
        let orphaned_slots = Gauge::default();
        let duration = Histogram::new(exponential_buckets(0.005, 2.0, 12));
        let switches = Family::<SwitchLabels, Counter>::default();
        let slot_lost = Family::<RelayLabels, Gauge>::default();
        let slot_wal = Family::<OwnLabels, Gauge>::default();
        registry.register(
            "slot_retained_wal_bytes",
            "WAL a log-tailing relay's replication slot retains on the database server, as the operator measures it: there whether or not a relay pod runs (suspended, scaled to zero, crash-looping), so the relay's OutboxRelaySlotRetainedWalHigh alert still fires",
            slot_wal.clone(),
        );
        registry.register(
            "slot_lost",
            "1 while a log-tailing relay's replication slot is lost (vanished after the relay streamed it: a promotion, a drop by hand) and not yet replaced; status.slot.lost says how it goes on",
            slot_lost.clone(),
        );
        registry.register(
            "wal_budget_switches",
            "Switches of log-tailing relays past their WAL budget (spec.mode.logTailing.maxRetainedWal): to=polling when one fell back, to=logTailing when it returned",
            switches.clone(),
        );
        registry.register(
            "reconciles",
            "Reconciles of OutboxRelays, by result",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles, by error category",
            errors.clone(),
        );
        registry.register(
            "api_writes",
            "Write requests (apply, delete, status) sent to the Kubernetes API",
            writes.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease",
            leader.clone(),
        );
        registry.register(
            "orphaned_slots",
            "Replication slots/publications the operator created for OutboxRelays that no longer exist (never dropped automatically)",
            orphaned_slots.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time one reconcile took",
            duration.clone(),
        );
        Self {
            registry,
            reconciles,
            errors,
            writes,
            leader,
            orphaned_slots,
            duration,
            switches,
            slot_lost,
            slot_wal,
            reconciles_total: AtomicU64::new(0),
            writes_total: AtomicU64::new(0),
        }
    }

    pub(crate) fn reconciled(&self, elapsed: Duration, error: Option<&'static str>) {
        self.duration.observe(elapsed.as_secs_f64());
        let result = if error.is_some() { "error" } else { "ok" };
        self.reconciles.get_or_create(&ResultLabel { result }).inc();
        if let Some(category) = error {
            self.errors.get_or_create(&CategoryLabel { category }).inc();
        }
        self.reconciles_total.fetch_add(1, Ordering::Relaxed);
    }

    /// A relay switched past its WAL budget: `to` is `polling` or `logTailing`.
    pub(crate) fn switched(&self, namespace: &str, relay: &str, to: &'static str) {
        self.switches
            .get_or_create(&SwitchLabels {
                namespace: namespace.to_owned(),
                relay: relay.to_owned(),
                to,
            })
            .inc();
    }

    /// Whether a relay's slot is lost now; a relay that goes is forgotten (`None`).
    pub(crate) fn set_slot_lost(&self, namespace: &str, relay: &str, lost: Option<bool>) {
        let labels = RelayLabels {
            namespace: namespace.to_owned(),
            relay: relay.to_owned(),
        };
        match lost {
            Some(lost) => {
                self.slot_lost.get_or_create(&labels).set(i64::from(lost));
            }
            None => {
                self.slot_lost.remove(&labels);
            }
        }
    }

    /// The WAL a relay's slot retains, as last measured; a relay without a slot, or
    /// that goes, is forgotten (`None`).
    pub(crate) fn set_slot_retained_wal(&self, namespace: &str, relay: &str, bytes: Option<i64>) {
        let labels = OwnLabels {
            relay_namespace: namespace.to_owned(),
            relay_name: relay.to_owned(),
        };
        match bytes {
            Some(bytes) => {
                self.slot_wal.get_or_create(&labels).set(bytes);
            }
            None => {
                self.slot_wal.remove(&labels);
            }
        }
    }

    pub(crate) fn wrote(&self) {
        self.writes.inc();
        self.writes_total.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    pub(crate) fn set_orphaned_slots(&self, count: usize) {
        self.orphaned_slots
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// Orphaned replication objects found in the last scans.
    pub fn orphaned_slots(&self) -> i64 {
        self.orphaned_slots.get()
    }

    /// Reconciles finished so far, with or without error.
    pub fn reconciles_total(&self) -> u64 {
        self.reconciles_total.load(Ordering::Relaxed)
    }

    /// Write requests sent to the Kubernetes API so far.
    pub fn writes_total(&self) -> u64 {
        self.writes_total.load(Ordering::Relaxed)
    }

    /// Whether this replica currently holds the leader Lease.
    pub fn is_leader(&self) -> bool {
        self.leader.get() == 1
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an error would only drop the scrape.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl crate::http::Probe for Metrics {
    fn metrics(&self) -> String {
        self.encode()
    }

    /// A standby replica is as ready as the leader: it takes over when the Lease frees.
    fn readiness(&self) -> Result<(), String> {
        Ok(())
    }
}
