//! Observability objects of a relay: the metrics Service, the ServiceMonitor that makes
//! Prometheus scrape it, and the PrometheusRule with its alerts.
//!
//! ServiceMonitor and PrometheusRule are the Prometheus operator's CRDs, which this crate
//! has no Rust types for; they are built as JSON (`DynamicObject`).

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use kube::api::DynamicObject;
use serde_json::{Value, json};

use super::workload::METRICS_PORT_NAME;
use super::{MONITORING_API_VERSION, child_meta, labels, namespace, relay_object_name};
use crate::api::{Mode, OutboxRelay, parse_bytes, parse_duration};
use crate::relay::config::HTTP_PORT;

/// Kind and plural of the Prometheus operator's scrape config.
pub const SERVICE_MONITOR_KIND: &str = "ServiceMonitor";
/// See [`SERVICE_MONITOR_KIND`].
pub const SERVICE_MONITOR_PLURAL: &str = "servicemonitors";
/// Kind and plural of the Prometheus operator's rule object.
pub const PROMETHEUS_RULE_KIND: &str = "PrometheusRule";
/// See [`PROMETHEUS_RULE_KIND`].
pub const PROMETHEUS_RULE_PLURAL: &str = "prometheusrules";

/// The relay's metrics, as the relay exports them (DESIGN §4).
const METRIC_BACKLOG: &str = "outbox_relay_backlog_rows";
const METRIC_OLDEST_AGE: &str = "outbox_relay_oldest_unpublished_age_seconds";
const METRIC_SLOT_WAL: &str = "outbox_relay_slot_retained_wal_bytes";

/// The Service in front of the relay pods' metrics port.
pub fn service(relay: &OutboxRelay) -> Service {
    Service {
        metadata: child_meta(relay, relay_object_name(relay), "metrics"),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            selector: Some(super::selector_labels(relay)),
            ports: Some(vec![ServicePort {
                name: Some(METRICS_PORT_NAME.to_owned()),
                port: i32::from(HTTP_PORT),
                target_port: Some(IntOrString::String(METRICS_PORT_NAME.to_owned())),
                protocol: Some("TCP".to_owned()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

fn dynamic(relay: &OutboxRelay, kind: &str, component: &str, spec: Value) -> DynamicObject {
    DynamicObject {
        types: Some(kube::api::TypeMeta {
            api_version: MONITORING_API_VERSION.to_owned(),
            kind: kind.to_owned(),
        }),
        metadata: child_meta(relay, relay_object_name(relay), component),
        data: json!({ "spec": spec }),
    }
}

/// Scrapes the metrics Service every 30 s.
pub fn service_monitor(relay: &OutboxRelay) -> DynamicObject {
    dynamic(
        relay,
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

/// The basic alerts, from `spec.alerting`'s thresholds; `None` when alerting is off.
pub fn prometheus_rule(relay: &OutboxRelay) -> Option<DynamicObject> {
    let alerting = &relay.spec.alerting;
    if !alerting.enabled {
        return None;
    }
    let ns = namespace(relay);
    let name = relay.name_any();
    // Prometheus operator scrapes add `namespace` and `service` labels to every series.
    let selector = format!(r#"namespace="{ns}",service="{}""#, relay_object_name(relay));
    let who = format!("OutboxRelay {ns}/{name}");
    // The spec validates both before anything is built; the fallbacks keep this pure
    // function total for a caller that skipped validation.
    let oldest_seconds =
        parse_duration(&alerting.oldest_unpublished_age).map_or(300, |d| d.as_secs().max(1));
    let mut rules = vec![
        json!({
            "alert": "OutboxRelayDown",
            "expr": format!(r#"absent(up{{{selector}}} == 1)"#),
            "for": "5m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": format!("{who} has no relay pod up"),
                "description": format!("No relay pod of {who} has been scraped successfully for 5 minutes: nothing is being published."),
            },
        }),
        json!({
            "alert": "OutboxRelayOldestUnpublishedTooOld",
            "expr": format!("max({METRIC_OLDEST_AGE}{{{selector}}}) > {oldest_seconds}"),
            "for": "2m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": format!("{who} is falling behind"),
                "description": format!("The oldest unpublished outbox row of {who} is {{{{ $value | humanizeDuration }}}} old, above the threshold of {}.", alerting.oldest_unpublished_age),
            },
        }),
        json!({
            "alert": "OutboxRelayBacklogHigh",
            "expr": format!("max({METRIC_BACKLOG}{{{selector}}}) > {}", alerting.backlog_rows),
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": format!("{who} has a large backlog"),
                "description": format!("{{{{ $value }}}} outbox rows of {who} wait to be published, above the threshold of {}.", alerting.backlog_rows),
            },
        }),
    ];
    if matches!(relay.spec.mode.get(), Some(Mode::LogTailing(_))) {
        let bytes = parse_bytes(&alerting.slot_retained_wal).unwrap_or(1 << 30);
        rules.push(json!({
            "alert": "OutboxRelaySlotRetainedWalHigh",
            "expr": format!("max({METRIC_SLOT_WAL}{{{selector}}}) > {bytes}"),
            "for": "5m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": format!("The replication slot of {who} retains too much WAL"),
                "description": format!("The slot of {who} keeps {{{{ $value | humanize1024 }}}}B of WAL on the database server, above {}; the server's disk fills if it keeps growing.", alerting.slot_retained_wal),
            },
        }));
    }
    Some(dynamic(
        relay,
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
