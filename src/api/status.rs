//! What the operator observed: `status`, written by the controller (conditions, mode,
//! broker, slot names) and by its figures task (backlog, oldest age, slot lag).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Observed state, written by the controller only.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OutboxRelayStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `DatabaseReady`, `BrokerReady`, `SlotReady`, `Degraded`, with reasons and
    /// messages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// `polling` or `logTailing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// `kafka`, `nats` or `rabbitmq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker: Option<String>,
    /// Rows waiting to be published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog_rows: Option<i64>,
    /// Age of the oldest unpublished row, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_unpublished_age_seconds: Option<f64>,
    /// Age of the oldest unpublished row, for people (`0s`, `4m12s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_unpublished_age: Option<String>,
    /// Rows in the dead-letter table (`spec.failure.deadLetterTable`), counted up to
    /// 100,000; absent while the table does not exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_rows: Option<i64>,
    /// The replication slot (log tailing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<SlotStatus>,
    /// Polling with per-aggregate order: the partitions and how many a live relay
    /// process holds; fewer owned than desired means some aggregates' events wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<PartitionsStatus>,
    /// While a log-tailing relay polls because its slot passed
    /// `spec.mode.logTailing.maxRetainedWal`: since when and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<FallbackStatus>,
    /// Relay pods running now (the `/scale` subresource's current count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// The label selector of the relay's pods (`/scale`, for an autoscaler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The verdict of the last audit run in the cluster (`kubectl outbox audit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_audit: Option<AuditStatus>,
}

/// An audit's verdict, as its Job's pod left it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AuditStatus {
    /// The Job that ran it.
    pub job: String,
    /// When it ended (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// `Passed` (every row delivered, each aggregate in order), `Failed` (rows missing
    /// or out of order) or `Error` (it could not tell: `message` says why).
    pub verdict: String,
    /// Its window: rows published, deliveries read, rows missing, rows out of order,
    /// deliveries after a row's first.
    #[serde(default)]
    pub rows: i64,
    #[serde(default)]
    pub deliveries: i64,
    #[serde(default)]
    pub missing: i64,
    #[serde(default)]
    pub out_of_order: i64,
    #[serde(default)]
    pub redeliveries: i64,
    /// The report's last line.
    #[serde(default)]
    pub message: String,
}

/// A log-tailing relay's fall back to polling (its WAL budget was passed).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FallbackStatus {
    /// When the operator switched the relay to polling (RFC 3339).
    pub since: String,
    /// WAL the slot retained then, bytes.
    pub retained_wal_bytes: i64,
    /// Whether the slot was dropped yet (it is, once no pod tails the log any more).
    #[serde(default)]
    pub slot_dropped: bool,
}

/// The replication slot and publication the operator created.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SlotStatus {
    /// Slot name.
    #[serde(default)]
    pub name: String,
    /// Publication name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publication: Option<String>,
    /// Position up to which the relay confirmed delivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed_flush_lsn: Option<String>,
    /// WAL the slot keeps on the database server's disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retained_wal_bytes: Option<i64>,
    /// PostgreSQL's `wal_status` (`reserved`, `extended`, `unreserved`, `lost`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wal_status: Option<String>,
    /// Whether a relay is streaming from the slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<bool>,
    /// The Secrets that reach the slot's database, which carry the finalizer
    /// `outbox.dev/slot-of-<relay>` until the slot is dropped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub protected_secrets: Vec<String>,
    /// While a relay switches from polling to log tailing: the snapshot taken right after
    /// the slot was created. The polling relay keeps running until every row committed
    /// by a transaction visible in it is published (the slot streams only what commits
    /// later); then the log-tailing relay replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_snapshot: Option<String>,
    /// The operator has seen the slot exist since it last made or adopted it: a slot
    /// that then vanishes (a promotion to a standby without it, a drop by hand) was
    /// lost, not never made, and is not created again in silence.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub existed: bool,
    /// The slot vanished under the relay: what was lost, and how the relay goes on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<SlotLoss>,
    /// What published the outbox table when the operator first saw this slot and its
    /// publication (the catalog rows, as `oid/xmin`): a relay that starts and finds
    /// another one knows that inserts in between may not have been streamed, and holds
    /// (keeping rows) or back-fills (deleting) as it does for a change while it runs.
    /// Cleared when the slot goes; a new slot records its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage_baseline: Option<String>,
    /// Where the slot lives: `host:port/database` of the connection Secret's URL when
    /// the slot was made or last seen (no credentials).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// A slot the relay streamed in a database its Secret no longer reaches (the Secret
    /// was pointed at another host or database): the operator cannot drop it, and it
    /// retains WAL there until someone does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub left_behind: Option<SlotLeftBehind>,
}

/// A replication slot left in a database the relay's Secret no longer reaches.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SlotLeftBehind {
    /// The slot's name.
    pub slot: String,
    /// Where it lives (`host:port/database`).
    pub location: String,
    /// When the operator found the Secret pointing elsewhere (RFC 3339). Annotating the
    /// OutboxRelay with `outbox.dev/left-behind-slot-dropped` set to this value, once the
    /// slot is dropped there, clears the record.
    pub detected_at: String,
}

/// A replication slot that vanished after the relay had streamed it. Commits after its
/// last confirmed position and before a new slot exist are in no slot: with
/// `deleteAfterPublish` they are still in the table and a polling relay publishes them
/// before log tailing resumes; without it the relay waits for the choice to go on.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SlotLoss {
    /// The last position the relay was seen to have confirmed (`status.slot.confirmedFlushLsn`
    /// before the loss): the window of commits never streamed starts after it. Absent
    /// when the slot was lost before its position was sampled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed_flush_lsn: Option<String>,
    /// When the operator found the slot missing (RFC 3339). Annotating the OutboxRelay
    /// with `outbox.dev/recreate-lost-slot` set to this value creates a new slot, which
    /// streams only later commits (relays without `deleteAfterPublish`).
    pub detected_at: String,
    /// `backfill` (the table holds every unpublished row: a polling relay publishes them
    /// alone, then a new slot is created and log tailing resumes) or `awaitingChoice`.
    pub recovery: String,
}

/// How many partitions exist and how many are owned by a live relay.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PartitionsStatus {
    /// Partitions the spec asks for.
    pub desired: i32,
    /// Partitions currently held by a relay process.
    pub owned: i32,
}
