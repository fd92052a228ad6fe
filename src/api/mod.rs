//! The `OutboxRelay` custom resource (`outbox.dev/v1alpha1`): spec, status, defaults and
//! the validation the API server enforces through the generated schema.
//!
//! Validation lives in the schema (patterns, ranges, enums, CEL rules) so that the API
//! server rejects a bad object before the controller ever sees it. The few checks that a
//! schema cannot express (a duration that parses but is zero, say) live in
//! [`OutboxRelaySpec::validate`], which the controller and `render` both call.

mod broker;
mod database;
mod duration;
mod kafka_ref;
mod mode;
mod pod;
mod quantity;
mod replay;
mod secret_ref;
mod status;
mod table;

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use broker::{
    AmqpAuthMechanism, Broker, BrokerSpec, KafkaSpec, NatsSpec, RabbitMqSpec, SaslMechanism,
    SaslSpec, TlsSpec,
};
pub use database::*;
pub use duration::{DurationError, duration_arg, parse_duration, time_arg};
pub use kafka_ref::{KafkaConnection, KafkaRef, KafkaUserAuthentication};
pub use mode::*;
pub use pod::{ImagePullPolicy, RelayPodSpec};
pub use quantity::{QuantityError, parse_bytes};
pub use replay::{OutboxReplay, OutboxReplaySpec, OutboxReplayStatus, ReplayEvents, ReplaySource};
pub use secret_ref::{
    CaSecretRef, CertSecretRef, KeySecretRef, PasswordSecretRef, SecretKeyRef, UsernameSecretRef,
};
pub use status::{
    AuditStatus, FallbackStatus, OutboxRelayStatus, PartitionsStatus, SlotLeftBehind, SlotLoss,
    SlotStatus,
};
pub use table::*;

/// The API group of every outbox-operator resource.
pub const GROUP: &str = "outbox.dev";

/// The annotation that lets a relay without `deleteAfterPublish` go on after its
/// replication slot was lost: set to `status.slot.lost.detectedAt`, it makes the operator
/// create a new slot, which streams only what commits after it. A value of an earlier
/// loss does not match a later one, so an annotation left behind never accepts a loss
/// nobody looked at.
pub const RECREATE_LOST_SLOT_ANNOTATION: &str = "outbox.dev/recreate-lost-slot";

/// The annotation that clears `status.slot.leftBehind` once the slot left in the database
/// the Secret no longer reaches is dropped there: set to its `detectedAt`.
pub const LEFT_BEHIND_SLOT_DROPPED_ANNOTATION: &str = "outbox.dev/left-behind-slot-dropped";

/// The annotation that lets a log-tailing relay without `deleteAfterPublish` go on after
/// what publishes its table changed (inserts in between may not have been streamed):
/// the identities the relay logged, comma-separated. It reaches the relay's settings,
/// so setting it rolls the relay's pods.
pub const ACCEPT_PUBLICATION_CHANGE_ANNOTATION: &str = "outbox.dev/accept-publication-change";

pub use crate::rules::{DURATION_PATTERN, IDENTIFIER_PATTERN, SLOT_NAME_PATTERN};

/// One OutboxRelay: publishes the committed rows of one outbox table to one broker.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "outbox.dev",
    version = "v1alpha1",
    kind = "OutboxRelay",
    doc = "An OutboxRelay publishes every committed row of one transactional-outbox table in PostgreSQL to one broker (Kafka, NATS JetStream or RabbitMQ), at least once, with the row id as the message id and per-aggregate order when asked for. The operator runs the relay, creates and drops its replication slot and publication (log tailing), and reports in status.",
    plural = "outboxrelays",
    shortname = "obr",
    category = "outbox",
    namespaced,
    status = "OutboxRelayStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    validation = Rule::new("self.metadata.name.size() <= 50 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must be a DNS label of at most 50 characters starting with a letter: it names the relay's Deployment and Service"),
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".status.mode"}"#,
    printcolumn = r#"{"name":"Broker","type":"string","jsonPath":".status.broker"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","priority":1,"jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Backlog","type":"integer","jsonPath":".status.backlogRows"}"#,
    printcolumn = r#"{"name":"Oldest","type":"string","jsonPath":".status.oldestUnpublishedAge"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.mode.polling) && has(self.retention) && has(self.retention.publishedRows) && has(self.mode.polling.interval) && (!has(self.mode.polling.afterPublish) || self.mode.polling.afterPublish == 'mark')) || duration(self.retention.publishedRows) >= duration(self.mode.polling.interval)").message("spec.retention.publishedRows is shorter than the poll interval (keep published rows at least one poll interval)"))]
#[x_kube(validation = Rule::new("!(has(self.failure) && has(self.failure.onExhausted) && self.failure.onExhausted == 'deadLetter' && !has(self.failure.deadLetterTable)) || !has(self.table) || !has(self.table.name) || size(self.table.name) <= 51").message("spec.failure.deadLetterTable: the default <table>_dead_letter is longer than 63 characters: set spec.failure.deadLetterTable"))]
#[x_kube(validation = Rule::new("!(has(self.failure) && has(self.failure.deadLetterTable) && has(self.failure.onExhausted) && self.failure.onExhausted == 'deadLetter') || self.failure.deadLetterTable != (has(self.table) && has(self.table.name) ? self.table.name : 'outbox')").message("spec.failure.deadLetterTable is the outbox table itself: name another table for exhausted rows"))]
#[x_kube(validation = Rule::new("!has(self.mode.logTailing) || self.replicas <= 1 || self.replicas == oldSelf.replicas").message("spec.replicas: a log-tailing relay runs one pod (its replication slot streams to one consumer): scale it to 0 or 1 (or set spec.suspend); only polling relays scale out"))]
#[x_kube(validation = Rule::new("!has(self.table) || !has(self.table.additionalFields) || !self.table.additionalFields.exists(f, f.placement == 'partition') || has(self.broker.kafka)").message("spec.table.additionalFields: only Kafka has partitions; place the column as a header"))]
pub struct OutboxRelaySpec {
    /// The database that holds the outbox table.
    pub database: DatabaseSpec,
    /// The outbox table and how its columns map to message fields.
    #[serde(default)]
    pub table: TableSpec,
    /// How committed rows are found: exactly one of `polling` or `logTailing`.
    pub mode: ModeSpec,
    /// Where messages go: exactly one of `kafka`, `nats` or `rabbitmq`.
    pub broker: BrokerSpec,
    /// Per-aggregate ordering and how rows are spread over partitions.
    #[serde(default)]
    pub ordering: OrderingSpec,
    /// Number of relay pods; the `/scale` subresource sets it (`kubectl scale`, an
    /// autoscaler on the backlog metric). A log-tailing relay runs one pod (a
    /// replication slot streams to one consumer): a count above one is read as one,
    /// and changing the count to more than one is refused.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 64))]
    pub replicas: i32,
    /// Stops publishing without dropping anything: no relay pod runs, and the
    /// replication slot and publication stay. The slot keeps its confirmed position
    /// and retains WAL meanwhile, watched as always (`status.slot.retainedWalBytes`,
    /// `Degraded` past `spec.alerting.slotRetainedWal`, the
    /// `OutboxRelaySlotRetainedWalHigh` alert from the operator's own metric, and
    /// `maxRetainedWal` still applying). Set back to `false`, publishing resumes from
    /// where it stopped. `Ready` is `False` with reason `Suspended` meanwhile.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspend: bool,
    /// How long published rows are kept: marked rows in the outbox table, archived
    /// rows in the archive.
    #[serde(default)]
    pub retention: RetentionSpec,
    /// What happens to a row that cannot be published.
    #[serde(default)]
    pub failure: FailureSpec,
    /// Prometheus alerting rules rendered for this relay.
    #[serde(default)]
    pub alerting: AlertingSpec,
    /// How the cluster's Prometheus picks up this relay's ServiceMonitor and
    /// PrometheusRule.
    #[serde(default, skip_serializing_if = "MonitoringSpec::is_empty")]
    pub monitoring: MonitoringSpec,
    /// Overrides for the relay pods.
    #[serde(default, skip_serializing_if = "RelayPodSpec::is_empty")]
    pub relay: RelayPodSpec,
    /// How a row becomes a message, beyond the column mapping: the options of
    /// Debezium's outbox event router that are not column names.
    #[serde(default, skip_serializing_if = "MessageSpec::is_default")]
    pub message: MessageSpec,
    /// OpenTelemetry traces of publishing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<TracingSpec>,
}

/// OpenTelemetry traces: a span per published message, sent over OTLP.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TracingSpec {
    /// The collector's OTLP/HTTP base URL (`http://otel-collector.observability:4318`;
    /// plain HTTP): spans go to `<otlpEndpoint>/v1/traces` as OTLP JSON. Each span (kind producer,
    /// named `send <destination>`) lasts from sending to the broker's acknowledgement
    /// (an aggregate's later events of a batch, sent together, end together) and is a
    /// child of the message's `traceparent` header (a column placed as that
    /// header, with `tracestate`), so a trace continues from the request that wrote the
    /// row to the consumer.
    #[schemars(length(min = 1, max = 512))]
    pub otlp_endpoint: String,
    /// The spans' `service.name`.
    #[serde(default = "default_service_name")]
    #[schemars(length(min = 1, max = 255))]
    pub service_name: String,
}

fn default_service_name() -> String {
    "outbox-relay".to_owned()
}

/// How a row becomes a message.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MessageSpec {
    /// Debezium's `route.tombstone.on.empty.payload`. A row whose payload is NULL is
    /// always sent to Kafka as a tombstone (a record with a null value, which deletes
    /// its key from a compacted topic), as the router sends it; with this set, a
    /// payload that is empty or only whitespace is sent as a tombstone too. NATS and
    /// RabbitMQ have no tombstones: there such a row is a message with an empty body.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tombstone_on_empty_payload: bool,
    /// Debezium's `table.expand.json.payload`, for the envelope
    /// (`table.additionalFields` with `placement: envelope`): the payload is embedded
    /// as JSON, as stored, instead of as a string holding it. A payload that does not
    /// start with `{` or `[` or is not JSON stays a string, as the router keeps it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expand_json_payload: bool,
    /// Send each row as a CloudEvents 1.0 event: `id` the row id, `source` the relay,
    /// `type` the event type column (a row without one is refused), `subject` the
    /// aggregate id, `time` the record timestamp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_events: Option<CloudEventsSpec>,
}

/// CloudEvents 1.0 on the wire.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CloudEventsSpec {
    /// `binary`: the payload as the body, attributes as headers (`ce_` for Kafka,
    /// `ce-` for NATS, `cloudEvents_` for RabbitMQ, per the protocol bindings);
    /// `structured`: the body is the event in JSON (`application/cloudevents+json`).
    #[serde(default)]
    pub mode: CloudEventsMode,
    /// The `source` attribute, a URI reference naming where events come from; default
    /// `/outboxrelays/<namespace>/<name>`. With the row id it identifies an event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub source: Option<String>,
    /// The `datacontenttype` attribute: the payload's media type.
    #[serde(default = "default_data_content_type")]
    #[schemars(length(min = 1, max = 255))]
    pub data_content_type: String,
}

fn default_data_content_type() -> String {
    "application/json".to_owned()
}

/// The CloudEvents content mode.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum CloudEventsMode {
    /// Attributes in headers, the payload as the body.
    #[default]
    Binary,
    /// The whole event as a JSON body.
    Structured,
}

impl MessageSpec {
    /// Whether every field has its default (the field is then left out when written).
    pub fn is_default(&self) -> bool {
        self == &Self::default()
    }
}

/// `true`, for fields that default to on.
fn default_true() -> bool {
    true
}

fn default_replicas() -> i32 {
    2
}

/// Ordering of messages.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OrderingSpec {
    /// `perAggregate` keeps each aggregate's events in commit order; `none` publishes
    /// rows as they come.
    #[serde(default)]
    pub mode: OrderingMode,
    /// Rows map to partition `hash(aggregateId) mod partitions`; each partition is
    /// published by one relay process at a time, so partitions bound the parallelism.
    #[serde(default = "default_partitions")]
    #[schemars(range(min = 1, max = 1024))]
    pub partitions: i32,
}

impl Default for OrderingSpec {
    fn default() -> Self {
        Self {
            mode: OrderingMode::default(),
            partitions: default_partitions(),
        }
    }
}

fn default_partitions() -> i32 {
    4
}

/// Ordering modes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum OrderingMode {
    /// Each aggregate's events in commit order.
    #[default]
    PerAggregate,
    /// No order promised.
    None,
}

/// Retention of published rows.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RetentionSpec {
    /// Published rows older than this are deleted: marked rows (polling with
    /// `afterPublish: mark`) from the outbox table, archived rows from the archive
    /// table (`spec.table.archive`), by the time they were marked or archived.
    #[serde(default = "default_retention")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.retention.publishedRows must be at least 1s"))]
    pub published_rows: String,
}

impl Default for RetentionSpec {
    fn default() -> Self {
        Self {
            published_rows: default_retention(),
        }
    }
}

fn default_retention() -> String {
    "24h".to_owned()
}

/// Handling of rows that cannot be published.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FailureSpec {
    /// Attempts before a row counts as exhausted.
    #[serde(default = "default_max_attempts")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_attempts: i32,
    /// `block` stops the row's partition (order kept); `deadLetter` moves the row to
    /// the dead-letter table and goes on.
    #[serde(default)]
    pub on_exhausted: OnExhausted,
    /// Dead-letter table (same schema); default `<table>_dead_letter`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub dead_letter_table: Option<String>,
}

impl Default for FailureSpec {
    fn default() -> Self {
        Self {
            max_attempts: default_max_attempts(),
            on_exhausted: OnExhausted::default(),
            dead_letter_table: None,
        }
    }
}

fn default_max_attempts() -> i32 {
    10
}

/// What happens to an exhausted row.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum OnExhausted {
    /// Stop the partition until the row can be published.
    #[default]
    Block,
    /// Move the row to the dead-letter table.
    DeadLetter,
}

/// Labels of the relay's Prometheus-operator objects.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MonitoringSpec {
    /// Labels on the relay's ServiceMonitor and PrometheusRule, over those the operator
    /// gives every relay (its `--monitoring-label`, the chart's `monitoring.labels`):
    /// the ones your Prometheus's `serviceMonitorSelector` and `ruleSelector` match.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16))]
    pub labels: std::collections::BTreeMap<String, String>,
}

impl MonitoringSpec {
    fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// Thresholds of the rendered alerting rules.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AlertingSpec {
    /// Render a PrometheusRule for this relay.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Alert when the oldest unpublished row is older than this.
    #[serde(default = "default_oldest_age")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.alerting.oldestUnpublishedAge must be at least 1s"))]
    pub oldest_unpublished_age: String,
    /// Alert when more rows than this wait to be published.
    #[serde(default = "default_backlog_rows")]
    #[schemars(range(min = 1))]
    pub backlog_rows: i64,
    /// Alert when the replication slot retains more WAL than this (log tailing), as a
    /// Kubernetes quantity (`512Mi`, `1Gi`).
    #[serde(default = "default_slot_wal")]
    #[schemars(length(max = 32), regex(pattern = "^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$"))]
    #[x_kube(validation = Rule::new("!self.matches('^0+[A-Za-z]*$')").message("spec.alerting.slotRetainedWal must be positive"))]
    pub slot_retained_wal: String,
}

impl Default for AlertingSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            oldest_unpublished_age: default_oldest_age(),
            backlog_rows: default_backlog_rows(),
            slot_retained_wal: default_slot_wal(),
        }
    }
}

fn default_oldest_age() -> String {
    "5m".to_owned()
}
fn default_backlog_rows() -> i64 {
    10_000
}
fn default_slot_wal() -> String {
    "1Gi".to_owned()
}
