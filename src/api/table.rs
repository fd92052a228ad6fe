//! `spec.table`: the outbox table and its columns.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::*;

/// The outbox table. The column defaults are Debezium's, so existing outbox tables work
/// unchanged.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TableSpec {
    /// Schema of the table.
    #[serde(default = "default_schema")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub schema: String,
    /// Name of the table.
    #[serde(default = "default_table")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub name: String,
    /// Which column holds which message field.
    #[serde(default)]
    pub columns: ColumnsSpec,
    /// Extra columns copied into message headers under the column's name, for example
    /// `traceparent`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(regex(pattern = IDENTIFIER_PATTERN)))]
    #[x_kube(validation = Rule::new("self.all(h, !(h in ['id', 'type', 'aggregateType']))").message("spec.table.headers may not name id, type or aggregateType: the relay sets those headers itself"))]
    pub headers: Vec<String>,
    /// Debezium's `table.fields.additional.placement`, one entry per
    /// `column:placement[:alias]`: more columns placed as headers (under another name
    /// than the column's, unlike `headers`), as fields of a JSON envelope around the
    /// payload, or as the Kafka partition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new("self.filter(f, f.placement == 'partition').size() <= 1").message("spec.table.additionalFields: at most one column sets the partition"))]
    pub additional_fields: Vec<AdditionalField>,
    /// Where published rows go instead of being deleted: moved, in the transaction
    /// that would have deleted them, to this table, which has the outbox table's
    /// columns plus `columns.publishedAt` (set to the time of the move). Used by
    /// polling with `afterPublish: archive` (left out there: `<table>_archive` in the
    /// table's schema) and, when present, by log tailing with `deleteAfterPublish`
    /// (its back-fill, sweep and WAL-budget polling included).
    /// `retention.publishedRows` trims it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive: Option<ArchiveSpec>,
}

/// The archive table of `spec.table.archive`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ArchiveSpec {
    /// Schema of the archive table; the outbox table's when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub schema: Option<String>,
    /// Name of the archive table; the outbox table's name followed by `_archive` when
    /// left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub name: Option<String>,
}

/// A column placed in the message (one item of Debezium's
/// `table.fields.additional.placement`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.placement != 'partition' || !has(self.as)").message("spec.table.additionalFields: a partition placement takes no alias (`as`)"))]
pub struct AdditionalField {
    /// The column.
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub column: String,
    /// Where the value goes.
    pub placement: Placement,
    /// The header or envelope field name; the column's name when left out.
    #[serde(default, rename = "as", skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = FIELD_NAME_PATTERN))]
    pub alias: Option<String>,
}

/// Where an additional column goes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Placement {
    /// A message header (text form; a NULL value sends no header).
    Header,
    /// A field of the JSON envelope the value becomes: `{"payload": …, "<as>": …}`,
    /// numbers and booleans as JSON numbers and booleans, other types as strings of
    /// their text form, NULL as `null`.
    Envelope,
    /// The Kafka partition (an integer column; NULL leaves it to the partitioner).
    Partition,
}

/// Names of headers and envelope fields.
pub const FIELD_NAME_PATTERN: &str = "^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$";

impl Default for TableSpec {
    fn default() -> Self {
        Self {
            schema: default_schema(),
            name: default_table(),
            columns: ColumnsSpec::default(),
            headers: Vec::new(),
            additional_fields: Vec::new(),
            archive: None,
        }
    }
}

fn default_schema() -> String {
    "public".to_owned()
}
fn default_table() -> String {
    "outbox".to_owned()
}

/// Column names of the outbox table.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ColumnsSpec {
    /// Debezium's `table.field.event.id`: the row id, unique and NOT NULL, of type
    /// `bigint`, `integer`, `smallint`, `uuid`, `text` or `varchar`; its text (a uuid as
    /// PostgreSQL prints it) is the message id (the `id` header, `Nats-Msg-Id`, AMQP
    /// `message_id`, the CloudEvents `id`). Polling sends an integer id's rows in id
    /// order, any other id's by `createdAt`, then id.
    #[serde(default = "col_id")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub id: String,
    /// Debezium's `route.by.field`: the aggregate type, `{aggregateType}` in topic,
    /// subject and routing-key templates.
    #[serde(default = "col_aggregate_type")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub aggregate_type: String,
    /// Debezium's `table.field.event.key`: the aggregate id, the message key, and what
    /// per-aggregate order is kept for.
    #[serde(default = "col_aggregate_id")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub aggregate_id: String,
    /// Debezium's `table.field.event.type`: the event type, sent as the `type` header
    /// (and the CloudEvents `type`).
    #[serde(default = "col_type")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub r#type: String,
    /// Debezium's `table.field.event.payload`: the payload (`jsonb`, `json`, `text` or
    /// `bytea`), sent as stored.
    #[serde(default = "col_payload")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub payload: String,
    /// Insertion time, used for the oldest-unpublished age and end-to-end lag.
    #[serde(default = "col_created_at")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub created_at: String,
    /// Publication time, set by polling with `afterPublish: mark`, and the archive
    /// table's column for the time a row was archived.
    #[serde(default = "col_published_at")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub published_at: String,
    /// Debezium's `table.field.event.timestamp`: a `timestamptz` or `timestamp`
    /// (read as UTC) column whose value becomes the record's timestamp (Kafka's record
    /// timestamp, RabbitMQ's `timestamp` property). Left out, the record carries the
    /// row's commit time in log tailing and its `createdAt` column in polling (the
    /// time of publishing when the table has none). A NULL value falls back the same
    /// way. Kafka's time-based retention goes by this time: records whose time is older
    /// than the topic's `retention.ms` (old events, a long backlog) are deleted soon
    /// after they are written, unless the topic has `message.timestamp.type=LogAppendTime`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub timestamp: Option<String>,
    /// The column polling reads the oldest unpublished rows by, the id breaking ties:
    /// one that grows in the order rows are inserted, NOT NULL, an integer (a
    /// `bigserial` or identity column) or a timestamp (`DEFAULT clock_timestamp()`).
    /// Left out: the id when it is an integer, else `createdAt`. For a uuid or text id
    /// on a table without `createdAt` (Debezium's own), or an integer id that does not
    /// follow insertion (ids made by the application).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub order: Option<String>,
}

impl Default for ColumnsSpec {
    fn default() -> Self {
        Self {
            id: col_id(),
            aggregate_type: col_aggregate_type(),
            aggregate_id: col_aggregate_id(),
            r#type: col_type(),
            payload: col_payload(),
            created_at: col_created_at(),
            published_at: col_published_at(),
            timestamp: None,
            order: None,
        }
    }
}

fn col_id() -> String {
    "id".to_owned()
}
fn col_aggregate_type() -> String {
    "aggregatetype".to_owned()
}
fn col_aggregate_id() -> String {
    "aggregateid".to_owned()
}
fn col_type() -> String {
    "type".to_owned()
}
fn col_payload() -> String {
    "payload".to_owned()
}
fn col_created_at() -> String {
    "created_at".to_owned()
}
fn col_published_at() -> String {
    "published_at".to_owned()
}
