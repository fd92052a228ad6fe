//! Observability objects of a relay: the metrics Service, the ServiceMonitor that makes
//! Prometheus scrape it, and the PrometheusRule with its alerts.
//!
//! ServiceMonitor and PrometheusRule are the Prometheus operator's CRDs, which this crate
//! has no Rust types for; they are built as JSON (`DynamicObject`). Every alert carries
//! `for:`, a `severity` label and a `runbook_url` into docs/runbooks.md.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::DynamicObject;
use serde_json::{Value, json};

use super::workload::METRICS_PORT_NAME;
use std::collections::BTreeMap;

use super::{
    BuildOptions, MONITORING_API_VERSION, child_meta, labels, namespace, relay_object_name,
};
use crate::spec::config::HTTP_PORT;
use crate::spec::{ValidMode, ValidRelay};

/// Kind and plural of the Prometheus operator's scrape config.
pub const SERVICE_MONITOR_KIND: &str = "ServiceMonitor";
/// See [`SERVICE_MONITOR_KIND`].
pub const SERVICE_MONITOR_PLURAL: &str = "servicemonitors";
/// Kind and plural of the Prometheus operator's rule object.
pub const PROMETHEUS_RULE_KIND: &str = "PrometheusRule";
/// See [`PROMETHEUS_RULE_KIND`].
pub const PROMETHEUS_RULE_PLURAL: &str = "prometheusrules";

/// The Service in front of the relay pods' metrics port. Headless: it is there for
/// scrape discovery (Prometheus reads its endpoints), nothing connects to a virtual IP,
/// so none is taken from the cluster's Service range — and creating one is the
/// costliest write of a new relay (the API server allocates the address).
pub fn service(relay: &ValidRelay) -> Service {
    Service {
        metadata: child_meta(relay, relay_object_name(relay), "metrics"),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            cluster_ip: Some("None".to_owned()),
            selector: Some(super::selector_labels(relay)),
            ports: Some(vec![ServicePort {
                name: Some(METRICS_PORT_NAME.to_owned()),
                port: i32::from(HTTP_PORT),
                target_port: Some(IntOrString::String(METRICS_PORT_NAME.to_owned())),
                protocol: Some("TCP".to_owned()),
                ..ServicePort::default()
            }]),
            // The Service carries no traffic, only scrapes: a relay that is not ready
            // (its broker takes nothing, the publication gate holds) is the one whose
            // metrics matter most, so its address is published all the same.
            publish_not_ready_addresses: Some(true),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// A Prometheus-operator object of the relay, labelled for the Prometheus that should
/// pick it up: the operator's monitoring labels, then the relay's
/// (`spec.monitoring.labels`), then the operator's own labels, which always win.
fn dynamic(
    relay: &ValidRelay,
    options: &BuildOptions,
    kind: &str,
    component: &str,
    spec: Value,
) -> DynamicObject {
    let mut metadata = child_meta(relay, relay_object_name(relay), component);
    let mut labels: BTreeMap<String, String> = options.monitoring_labels.iter().cloned().collect();
    labels.extend(relay.monitoring().labels.clone());
    labels.extend(metadata.labels.take().unwrap_or_default());
    metadata.labels = Some(labels);
    DynamicObject {
        types: Some(kube::api::TypeMeta {
            api_version: MONITORING_API_VERSION.to_owned(),
            kind: kind.to_owned(),
        }),
        metadata,
        data: json!({ "spec": spec }),
    }
}

/// Scrapes the metrics Service every 30 s.
pub fn service_monitor(relay: &ValidRelay, options: &BuildOptions) -> DynamicObject {
    dynamic(
        relay,
        options,
        SERVICE_MONITOR_KIND,
        "metrics",
        json!({
            "selector": {"matchLabels": labels(relay, "metrics")},
            "endpoints": [{
                "port": METRICS_PORT_NAME,
                "path": "/metrics",
                "interval": "30s",
            }],
        }),
    )
}

/// Where each alert's `runbook_url` points by default: docs/runbooks.md as this release
/// ships it (its tag), whose sections are headed by the alert names (GitHub's anchor for
/// `## OutboxRelayDown` is `#outboxrelaydown`). The operator's `--runbook-base-url` (the
/// chart's `monitoring.runbookBaseUrl`) points elsewhere, at a copy of your own.
pub fn default_runbook_base_url() -> String {
    format!(
        "{}/blob/v{}/docs/runbooks.md",
        env!("CARGO_PKG_REPOSITORY"),
        env!("CARGO_PKG_VERSION")
    )
}

/// The relay's metrics, as the relay exports them (docs/metrics.md).
const METRIC_BACKLOG: &str = "outbox_relay_backlog_rows";
const METRIC_OLDEST_AGE: &str = "outbox_relay_oldest_unpublished_age_seconds";
const METRIC_PUBLISH_ERRORS: &str = "outbox_relay_publish_errors_total";
const METRIC_BROKER_DOWN_SINCE: &str = "outbox_relay_broker_down_since_timestamp_seconds";
const METRIC_PARTITIONS_OWNED: &str = "outbox_relay_partitions_owned";
const METRIC_PARTITIONS_BLOCKED: &str = "outbox_relay_partitions_blocked";
/// Exported in log-tailing mode only (the log-tailing relay reads them from
/// `pg_replication_slots`).
const METRIC_SLOT_WAL: &str = "outbox_relay_slot_retained_wal_bytes";
const METRIC_SLOT_ACTIVE: &str = "outbox_relay_slot_active";
const METRIC_SWEEP_FOUND: &str = "outbox_relay_sweep_found_total";
const METRIC_SLOT_WAL_STATUS: &str = "outbox_relay_slot_wal_status";
/// The operator's measure of the same, labelled as the relay's metrics are
/// (`controller/metrics.rs`).
const METRIC_OPERATOR_SLOT_WAL: &str = "outbox_operator_slot_retained_wal_bytes";

/// How bad an alert is: `critical` pages (events are not flowing, or the database is at
/// risk), `warning` goes to a ticket queue.
#[derive(Clone, Copy)]
enum Severity {
    Critical,
    Warning,
}

impl Severity {
    fn label(self) -> &'static str {
        match self {
            Severity::Critical => "critical",
            Severity::Warning => "warning",
        }
    }
}

/// One alerting rule before it becomes JSON; `labels` and `runbook_url` are added the
/// same way to every rule by [`Alert::into_rule`].
struct Alert {
    name: &'static str,
    expr: String,
    /// How long the condition must hold: long enough to ride out a rebalance, a pod
    /// restart or one slow scrape, short enough to matter.
    for_: &'static str,
    severity: Severity,
    summary: String,
    description: String,
}

impl Alert {
    fn into_rule(self, ns: &str, name: &str, runbooks: &str) -> Value {
        json!({
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            // The expressions aggregate the relay's labels away; these constant labels
            // say which OutboxRelay an alert is about, for routing and silencing.
            "labels": {
                "severity": self.severity.label(),
                "relay_namespace": ns,
                "relay_name": name,
            },
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": runbook_url(runbooks, self.name),
            },
        })
    }
}

/// The runbook section of `alert` under `base`.
pub fn runbook_url(base: &str, alert: &str) -> String {
    format!("{base}#{}", alert.to_ascii_lowercase())
}

/// The alerts, from `spec.alerting`'s thresholds; `None` when alerting is off.
pub fn prometheus_rule(valid: &ValidRelay, options: &BuildOptions) -> Option<DynamicObject> {
    let relay = valid;
    let alerting = &valid.alerting;
    if !alerting.enabled {
        return None;
    }
    let ns = namespace(relay);
    let name = relay.name.clone();
    // Two selectors, on purpose:
    // - The relay's own metrics carry `relay_namespace`/`relay_name` (constant labels set
    //   by the relay from its config), so selecting on them works whatever the scrape
    //   config (ServiceMonitor, PodMonitor, annotations, static) and survives relabelling
    //   that renames or drops `namespace`/`service`.
    // - `up` is made by Prometheus, not the relay, so it has only target labels. The
    //   Prometheus operator sets `namespace` and `service` on every ServiceMonitor target
    //   (`job` can be overridden by `jobLabel`, these cannot), so the down alert selects
    //   on those and on the metrics Service this operator creates.
    let own = format!(r#"relay_namespace="{ns}",relay_name="{name}""#);
    let target = format!(r#"namespace="{ns}",service="{}""#, relay_object_name(relay));
    let who = format!("OutboxRelay {ns}/{name}");
    let oldest_seconds = alerting.oldest_unpublished_age.as_secs_f64();
    let mut alerts = Vec::new();
    // A relay scaled to zero on purpose has no pods to be up; alerting on it would page
    // for a decision someone already made.
    if valid.effective_replicas() > 0 {
        alerts.push(Alert {
            name: "OutboxRelayDown",
            // `== 1` inside `absent` covers both ways of being down: targets that fail
            // their scrapes (`up` is 0) and no target at all (no ready pod behind the
            // Service, or nothing scrapes it).
            expr: format!("absent(up{{{target}}} == 1)"),
            for_: "5m",
            severity: Severity::Critical,
            summary: format!("{who} has no relay pod up"),
            description: format!(
                "No relay pod of {who} has been scraped successfully for 5 minutes (target namespace=\"{ns}\", service=\"{}\"): nothing is being published and the relay's other alerts are blind.",
                relay_object_name(relay)
            ),
        });
    }
    alerts.push(Alert {
        name: "OutboxRelayOldestUnpublishedTooOld",
        // `max` over replicas: each one measures the whole table, so they agree; `max`
        // keeps one series whatever the number of pods.
        expr: format!("max({METRIC_OLDEST_AGE}{{{own}}}) > {oldest_seconds}"),
        for_: "2m",
        severity: Severity::Critical,
        summary: format!("{who} is falling behind: its oldest unpublished row is too old"),
        description: format!(
            "The oldest unpublished outbox row of {who} is {{{{ $value | humanizeDuration }}}} old, above the threshold of {} (spec.alerting.oldestUnpublishedAge): consumers are not getting events.",
            alerting.as_written.0
        ),
    });
    alerts.push(Alert {
        name: "OutboxRelayBacklogHigh",
        expr: format!("max({METRIC_BACKLOG}{{{own}}}) > {}", alerting.backlog_rows),
        for_: "5m",
        severity: Severity::Warning,
        summary: format!("{who} has a large backlog"),
        description: format!(
            "{{{{ $value }}}} outbox rows of {who} wait to be published, above the threshold of {} (spec.alerting.backlogRows).",
            alerting.backlog_rows
        ),
    });
    alerts.push(Alert {
        name: "OutboxRelayPublishErrors",
        // `kind` is bounded (row, unavailable) and tells the two runbook paths apart.
        // A 5m rate held for 10m means errors for 15 minutes, not one broker hiccup.
        expr: format!("sum by (kind) (rate({METRIC_PUBLISH_ERRORS}{{{own}}}[5m])) > 0"),
        for_: "10m",
        severity: Severity::Warning,
        summary: format!("{who} keeps failing to publish ({{{{ $labels.kind }}}} errors)"),
        description: format!(
            "{who} has failed to publish for 15 minutes: {{{{ $value | humanize }}}} {{{{ $labels.kind }}}} errors per second (row: the broker refused a message; unavailable: outage or timeout)."
        ),
    });
    alerts.push(Alert {
        name: "OutboxRelayBrokerUnavailable",
        // The gauge holds since when every round failed (0 while the broker takes
        // messages); `min` over the failing pods: the longest outage. Fires on the first
        // evaluation past 30 seconds, so within a minute of the first failure.
        expr: format!("time() - min({METRIC_BROKER_DOWN_SINCE}{{{own}}} > 0) > 30"),
        for_: "0m",
        severity: Severity::Critical,
        summary: format!("The broker takes no message from {who}"),
        description: format!(
            "Every attempt of {who} to publish has failed for {{{{ $value | humanizeDuration }}}}, for the broker's reasons (unreachable, refusing the client, topic or permission missing): nothing is published and rows wait. The OutboxRelay's Ready condition (BrokerUnavailable) names the broker's reason."
        ),
    });
    let polling = matches!(valid.mode, ValidMode::Polling(_));
    // Partition ownership exists only where relays share the table by partition: polling
    // with per-aggregate order. With `ordering.mode: none` every process takes every
    // partition and reports owning none.
    if polling && valid.per_aggregate {
        let partitions = valid.partitions;
        alerts.push(Alert {
            name: "OutboxRelayPartitionsUnowned",
            // Empty when no relay reports at all: that is OutboxRelayDown's job, and one
            // outage should not page twice.
            expr: format!("sum({METRIC_PARTITIONS_OWNED}{{{own}}}) < {partitions}"),
            for_: "5m",
            severity: Severity::Warning,
            summary: format!("{who} leaves partitions without a relay"),
            description: format!(
                "Live relay processes of {who} own {{{{ $value }}}} of its {partitions} partitions for 5 minutes: rows of the other partitions are not published."
            ),
        });
        alerts.push(Alert {
            name: "OutboxRelayPartitionsBlocked",
            expr: format!("sum({METRIC_PARTITIONS_BLOCKED}{{{own}}}) > 0"),
            for_: "5m",
            severity: Severity::Warning,
            summary: format!("{who} has partitions blocked by a failing row"),
            description: format!(
                "{{{{ $value }}}} partitions of {who} are stopped by a row that exhausted spec.failure.maxAttempts (onExhausted: block): later rows of those partitions wait until it is published or removed."
            ),
        });
    }
    if let ValidMode::LogTailing(lt) = &valid.mode
        && lt.sweep.is_some()
    {
        alerts.push(Alert {
            name: "OutboxRelaySweepFoundRows",
            // Any row the sweep finds is one the log tail missed: one is enough.
            expr: format!("sum(increase({METRIC_SWEEP_FOUND}{{{own}}}[15m])) > 0"),
            for_: "0m",
            severity: Severity::Warning,
            summary: format!("The log tail of {who} missed rows; the sweep published them"),
            description: format!(
                "The reconciliation sweep of {who} found {{{{ $value | humanize }}}} rows in the last 15 minutes that were still in the table long after their insert: the log tail missed them (publication altered, slot recreated). They are published now, after later events of their aggregates."
            ),
        });
    }
    if let ValidMode::LogTailing(_) = valid.mode {
        let bytes = alerting.slot_retained_wal_bytes;
        alerts.push(Alert {
            name: "OutboxRelaySlotRetainedWalHigh",
            // The relay's measure and the operator's: the operator's is there while no
            // relay pod runs (suspended, scaled to zero, crash-looping).
            expr: format!(
                r#"max({{__name__=~"{METRIC_SLOT_WAL}|{METRIC_OPERATOR_SLOT_WAL}",{own}}}) > {bytes}"#
            ),
            for_: "5m",
            severity: Severity::Critical,
            summary: format!("The replication slot of {who} retains too much WAL"),
            description: format!(
                "The slot of {who} keeps {{{{ $value | humanize1024 }}}}B of WAL on the database server, above {} (spec.alerting.slotRetainedWal); the server's disk fills if it keeps growing.",
                alerting.as_written.1
            ),
        });
        alerts.push(Alert {
            name: "OutboxRelaySlotInactive",
            // `max`: a standby pod sees the slot inactive while the active one uses it.
            expr: format!("max({METRIC_SLOT_ACTIVE}{{{own}}}) == 0"),
            for_: "5m",
            severity: Severity::Warning,
            summary: format!("No one consumes the replication slot of {who}"),
            description: format!(
                "The logical replication slot of {who} has had no active consumer for 5 minutes: it retains WAL and nothing is published."
            ),
        });
        alerts.push(Alert {
            name: "OutboxRelaySlotWalAtRisk",
            // PostgreSQL's `wal_status`: `unreserved` means WAL the slot needs is about
            // to be removed (max_slot_wal_keep_size), `lost` that it is gone.
            expr: format!(
                r#"max by (status) ({METRIC_SLOT_WAL_STATUS}{{{own},status=~"unreserved|lost"}}) == 1"#
            ),
            for_: "1m",
            severity: Severity::Critical,
            summary: format!("The replication slot of {who} is {{{{ $labels.status }}}}"),
            description: format!(
                "PostgreSQL reports wal_status={{{{ $labels.status }}}} for the slot of {who}: WAL it needs is about to be removed (unreserved) or already removed (lost, the slot cannot continue and events may be missed)."
            ),
        });
    }
    let rules: Vec<Value> = alerts
        .into_iter()
        .map(|a| a.into_rule(&ns, &name, &options.runbook_base_url))
        .collect();
    Some(dynamic(
        relay,
        options,
        PROMETHEUS_RULE_KIND,
        "alerting",
        json!({
            "groups": [{
                "name": format!("outbox-relay.{ns}.{name}"),
                "rules": rules,
            }],
        }),
    ))
}
