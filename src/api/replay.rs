//! The `OutboxReplay` custom resource (`outbox.dev/v1alpha1`): one run that publishes a
//! window of a relay's already published events again, or sends its dead letters back
//! through it. The operator runs it once, as a Job shaped like the relay's own pods, and
//! reports progress and the verdict in status. Its spec cannot change: another window is
//! another OutboxReplay.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::rules::DURATION_PATTERN;

/// One replay of a relay's events.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "outbox.dev",
    version = "v1alpha1",
    kind = "OutboxReplay",
    doc = "An OutboxReplay publishes a window of one OutboxRelay's already published events again (by created-at time, ids, aggregate ids, event types), with their original ids and the header outbox-replay: <name>, at a rate limit; or, with source DeadLetters, moves the relay's dead-lettered rows back so it publishes them again. It runs once, in a Job shaped like the relay's pods, and reports in status.",
    plural = "outboxreplays",
    shortname = "obrp",
    category = "outbox",
    namespaced,
    status = "OutboxReplayStatus",
    validation = Rule::new("self.metadata.name.size() <= 63 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must be a DNS label: it names the replay's Job and is sent as the outbox-replay header"),
    printcolumn = r#"{"name":"Relay","type":"string","jsonPath":".spec.relayName"}"#,
    printcolumn = r#"{"name":"Source","type":"string","jsonPath":".spec.source"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Selected","type":"integer","jsonPath":".status.events.selected"}"#,
    printcolumn = r#"{"name":"Done","type":"integer","jsonPath":".status.events.done"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self == oldSelf").message("an OutboxReplay runs once and its spec cannot change: create another OutboxReplay for another window"))]
#[x_kube(validation = Rule::new("self.source != 'Published' || has(self.from) || has(self.to) || (has(self.ids) && size(self.ids) > 0) || (has(self.aggregateIds) && size(self.aggregateIds) > 0) || (has(self.types) && size(self.types) > 0)").message("name the events to replay: from (and to), ids, aggregateIds or types"))]
#[x_kube(validation = Rule::new("self.source != 'DeadLetters' || (!has(self.from) && !has(self.to) && (!has(self.aggregateIds) || size(self.aggregateIds) == 0) && (!has(self.types) || size(self.types) == 0))").message("source DeadLetters takes ids only (none: every dead-lettered row)"))]
pub struct OutboxReplaySpec {
    /// The OutboxRelay of this namespace whose events to send again.
    #[schemars(length(min = 1, max = 63))]
    pub relay_name: String,
    /// `Published`: events the relay already published, read from what its table keeps
    /// of them (rows marked published, the rows a log-tailing relay keeps, or the archive
    /// table), published again by the replay itself. `DeadLetters`: the relay's
    /// dead-lettered rows, moved back into the outbox table with their ids, so the relay
    /// publishes them again.
    #[serde(default)]
    pub source: ReplaySource,
    /// Events created at or after this time (RFC 3339, e.g. `2026-12-07T10:00:00Z`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 40), extend("format" = "date-time"))]
    pub from: Option<String>,
    /// Events created at or before this time (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 40), extend("format" = "date-time"))]
    pub to: Option<String>,
    /// These ids only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10000))]
    pub ids: Vec<String>,
    /// Events of these aggregate ids only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10000))]
    pub aggregate_ids: Vec<String>,
    /// Events of these types only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1000))]
    pub types: Vec<String>,
    /// Events published per second at most (`Published`).
    #[serde(default = "default_rate")]
    #[schemars(range(min = 1, max = 100000))]
    pub rate: i32,
    /// Events replayed at most: a larger window fails the replay rather than cut it.
    #[serde(default = "default_limit")]
    #[schemars(range(min = 1, max = 10000000))]
    pub limit: i64,
    /// How long the run may take before Kubernetes stops it.
    #[serde(default = "default_timeout")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub timeout: String,
}

/// Where an OutboxReplay's events come from.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReplaySource {
    /// Events the relay already published.
    #[default]
    Published,
    /// The relay's dead-lettered rows, sent back through the relay.
    DeadLetters,
}

fn default_rate() -> i32 {
    100
}
fn default_limit() -> i64 {
    100_000
}
fn default_timeout() -> String {
    "1h".to_owned()
}

/// What the operator observed of the run.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OutboxReplayStatus {
    /// `Pending` (waiting for the relay or its pods' settings), `Running`, `Succeeded`
    /// or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// `Finished`: whether the run ended, how, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The Job that runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// When its pod started and when it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// How many events the window held and how many were replayed (`Published`), or
    /// moved back for the relay to publish (`DeadLetters`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<ReplayEvents>,
    /// The run's report, as it left it (at most 4 KiB; the Job's log has it whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<String>,
}

/// Events of a replay.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ReplayEvents {
    /// In the window.
    pub selected: i64,
    /// Replayed, or moved back.
    pub done: i64,
}
