//! How an outbox row becomes a message: the row as read (from the table or the
//! replication stream), the message a broker gets, and the [`Shape`] of one relay that
//! turns the one into the other (a pure, tested function).

use crate::api::Placement;
use crate::rules::{AGGREGATE_TYPE_PLACEHOLDER, BrokerKind, check_destination};

use super::PublishError;

/// A row's id, the message id: an integer column's value, or the text of any other id
/// column (a uuid as PostgreSQL prints it, lowercase with hyphens). Ids are only ever
/// compared for equality: nothing assumes they grow with insertion or commit order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RowId {
    /// `smallint`, `integer` or `bigint`.
    Int(i64),
    /// `uuid`, `text`, `varchar`: the canonical text.
    Text(std::sync::Arc<str>),
}

impl RowId {
    /// The integer, for an integer id.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            RowId::Int(id) => Some(*id),
            RowId::Text(_) => None,
        }
    }
}

impl std::fmt::Display for RowId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RowId::Int(id) => write!(f, "{id}"),
            RowId::Text(id) => f.write_str(id),
        }
    }
}

impl From<i64> for RowId {
    fn from(id: i64) -> Self {
        RowId::Int(id)
    }
}

/// One outbox row as the relay publishes it.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    /// Row id: the message id.
    pub id: RowId,
    /// Aggregate type (empty when NULL).
    pub aggregate_type: String,
    /// Aggregate id: the message key.
    pub aggregate_id: Option<String>,
    /// Event type.
    pub event_type: Option<String>,
    /// Payload bytes as stored (text forms as UTF-8), `None` when NULL; shared, not
    /// copied, by the message built from the row.
    pub payload: Option<bytes::Bytes>,
    /// The `table.headers` and `table.additionalFields` columns that are not NULL.
    pub extra: Vec<ColumnValue>,
    /// The row's partition.
    pub partition: i64,
    /// Insertion time as Unix seconds, when the table has a created-at column (log
    /// tailing: the commit time).
    pub created_at: Option<f64>,
    /// The event's own time as Unix seconds (`table.columns.timestamp`), when
    /// configured and not NULL.
    pub timestamp: Option<f64>,
}

impl OutboxRow {
    /// Payload bytes (0 for NULL), for batch sizes.
    pub fn payload_len(&self) -> usize {
        self.payload.as_ref().map_or(0, bytes::Bytes::len)
    }

    /// The value of extra column `column`, `None` when NULL.
    pub fn extra(&self, column: &str) -> Option<&ColumnValue> {
        self.extra.iter().find(|v| v.column == column)
    }
}

/// A non-NULL value of an extra column, in its text form.
#[derive(Debug, Clone, PartialEq)]
pub struct ColumnValue {
    /// The column.
    pub column: String,
    /// The text form (booleans as `true` / `false`).
    pub text: String,
    /// How it goes into a JSON envelope.
    pub kind: ValueKind,
}

impl ColumnValue {
    /// A value of `kind` from PostgreSQL's text form (booleans come as `t`/`f` from
    /// the replication stream and `true`/`false` from a `::text` cast: both become the
    /// latter, so headers read the same in both modes).
    pub fn new(column: &str, text: String, kind: ValueKind) -> Self {
        let text = match (kind, text.as_str()) {
            (ValueKind::Boolean, "t") => "true".to_owned(),
            (ValueKind::Boolean, "f") => "false".to_owned(),
            _ => text,
        };
        Self {
            column: column.to_owned(),
            text,
            kind,
        }
    }

    /// The value as JSON: numbers and booleans as such, the rest (and numbers JSON
    /// cannot hold, `NaN`, `Infinity`) as strings.
    fn json(&self) -> String {
        let raw = match self.kind {
            ValueKind::Number => serde_json::from_str::<serde_json::Number>(&self.text).is_ok(),
            ValueKind::Boolean => matches!(self.text.as_str(), "true" | "false"),
            ValueKind::Text => false,
        };
        if raw {
            self.text.clone()
        } else {
            json_string(&self.text)
        }
    }
}

/// How a column's values go into JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// Integer and floating-point types.
    Number,
    /// `boolean`.
    Boolean,
    /// Everything else, as a string of its text form.
    Text,
}

impl ValueKind {
    /// The kind of a type as `information_schema.columns.data_type` names it.
    pub fn of_type_name(name: &str) -> Self {
        match name {
            "smallint" | "integer" | "bigint" | "real" | "double precision" => Self::Number,
            "boolean" => Self::Boolean,
            _ => Self::Text,
        }
    }

    /// The kind of a type by its OID (the replication stream's Relation message).
    pub fn of_oid(oid: u32) -> Self {
        match oid {
            // int8, int2, int4, float4, float8
            20 | 21 | 23 | 700 | 701 => Self::Number,
            16 => Self::Boolean,
            _ => Self::Text,
        }
    }
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

/// A message ready for a broker.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// Topic, subject or routing key.
    pub destination: String,
    /// Message key: the aggregate id.
    pub key: Option<String>,
    /// Message id: the outbox row id.
    pub id: String,
    /// Headers: `id`, `type`, `aggregateType` and the configured header columns.
    pub headers: Vec<(String, String)>,
    /// Payload bytes as stored (the row's, shared); `None` for a tombstone: Kafka
    /// gets a record with a null value, NATS and RabbitMQ an empty body.
    pub payload: Option<bytes::Bytes>,
    /// Record timestamp, Unix milliseconds, never before 1970 (Kafka's record
    /// timestamp, RabbitMQ's `timestamp` property); `None` leaves it to the client (the
    /// time of sending).
    pub timestamp_ms: Option<i64>,
    /// The Kafka partition a `partition` placement chose; `None` leaves it to the
    /// partitioner.
    pub partition: Option<i32>,
    /// The body's media type (CloudEvents): RabbitMQ's `content_type` property; Kafka
    /// and NATS carry it as the `content-type` header too.
    pub content_type: Option<String>,
}

/// An extra column and where it goes, its name resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    /// The column.
    pub column: String,
    /// Where.
    pub placement: crate::api::Placement,
    /// The header or envelope field name (the column's unless aliased).
    pub name: String,
}

/// How one relay turns rows into messages: the broker's rules, the destination
/// template, where extra columns go and the options of `spec.message`.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// The broker kind (its naming and header rules).
    pub kind: BrokerKind,
    /// Topic, subject or routing-key template.
    pub template: String,
    /// Extra columns and where each goes (`table.headers`, then
    /// `table.additionalFields`).
    pub placed: Vec<Placed>,
    /// `spec.message.tombstoneOnEmptyPayload`.
    pub tombstone_on_empty_payload: bool,
    /// `spec.message.expandJsonPayload`.
    pub expand_json_payload: bool,
    /// `spec.message.cloudEvents`, resolved.
    pub cloud_events: Option<CloudEvents>,
}

/// CloudEvents 1.0 settings of a relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    /// Binary or structured content mode.
    pub mode: crate::api::CloudEventsMode,
    /// The `source` attribute.
    pub source: String,
    /// The `datacontenttype` attribute.
    pub data_content_type: String,
}

/// 10000-01-01T00:00:00Z in Unix milliseconds: record timestamps stay before it.
const MAX_TIMESTAMP_MS: f64 = 253_402_300_800_000.0;

/// The media type of a structured-mode CloudEvent in JSON.
pub const CLOUDEVENTS_JSON: &str = "application/cloudevents+json; charset=UTF-8";

impl Shape {
    /// The shape with no extra columns and every `spec.message` option at its default.
    pub fn new(kind: BrokerKind, template: impl Into<String>) -> Self {
        Self {
            kind,
            template: template.into(),
            placed: Vec::new(),
            tombstone_on_empty_payload: false,
            expand_json_payload: false,
            cloud_events: None,
        }
    }

    /// Builds the message for `row`: destination from the template, key = aggregate
    /// id, message id = row id, headers `id`, `type`, `aggregateType` plus header
    /// columns; a NULL payload (or, with `tombstoneOnEmptyPayload`, a blank one) is a
    /// tombstone; the timestamp is the event's time column, else `createdAt` (log
    /// tailing: the commit time). Names and headers the broker would refuse are
    /// reported as row faults here, before anything is sent.
    pub fn build(&self, row: &OutboxRow) -> Result<Message, PublishError> {
        build_message(self, row)
    }
}

/// Whether a payload is blank as Debezium's router judges it (`toString().trim()` is
/// empty: Java's `trim` drops every character up to U+0020).
fn blank(payload: &[u8]) -> bool {
    payload.iter().all(|b| *b <= b' ')
}

fn build_message(shape: &Shape, row: &OutboxRow) -> Result<Message, PublishError> {
    let kind = shape.kind;
    let destination = shape
        .template
        .replace(AGGREGATE_TYPE_PLACEHOLDER, &row.aggregate_type);
    check_destination(kind, &destination).map_err(|why| {
        PublishError::refused(format!(
            "row {}: destination `{destination}` (from aggregate type `{}`) {why}",
            row.id, row.aggregate_type
        ))
    })?;
    let id = row.id.to_string();
    // id, type, aggregateType, the placed headers, and room for CloudEvents' attributes
    // and content type: no growth while it fills.
    let mut headers = Vec::with_capacity(
        3 + shape.placed.len() + if shape.cloud_events.is_some() { 8 } else { 0 },
    );
    headers.push(("id".to_owned(), id.clone()));
    if let Some(t) = &row.event_type {
        headers.push(("type".to_owned(), t.clone()));
    }
    headers.push(("aggregateType".to_owned(), row.aggregate_type.clone()));
    let mut envelope = Vec::new();
    let mut partition = None;
    for placed in &shape.placed {
        let value = row.extra(&placed.column);
        match placed.placement {
            Placement::Header => {
                if let Some(v) = value {
                    headers.push((placed.name.clone(), v.text.clone()));
                }
            }
            Placement::Envelope => envelope.push((&placed.name, value)),
            Placement::Partition => {
                if let Some(v) = value {
                    partition = Some(v.text.parse::<i32>().ok().filter(|p| *p >= 0).ok_or_else(
                        || {
                            PublishError::refused(format!(
                                "row {}: partition column {} holds `{}`, not a partition number",
                                row.id, placed.column, v.text
                            ))
                        },
                    )?);
                }
            }
        }
    }
    let payload = match &row.payload {
        Some(p) if shape.tombstone_on_empty_payload && blank(p) => None,
        None if shape.tombstone_on_empty_payload => None,
        // The router's envelope: the payload (NULL as null), then the placed fields.
        payload if !envelope.is_empty() => {
            let mut json = String::from("{\"payload\":");
            match payload {
                None => json.push_str("null"),
                // As the router: a payload that starts with `{` or `[` and parses.
                Some(p)
                    if shape.expand_json_payload
                        && p.first().is_some_and(|b| matches!(b, b'{' | b'['))
                        && serde_json::from_slice::<serde::de::IgnoredAny>(p).is_ok() =>
                {
                    json.push_str(std::str::from_utf8(p).unwrap_or("null"));
                }
                Some(p) => json.push_str(&json_string(&String::from_utf8_lossy(p))),
            }
            for (name, value) in envelope {
                json.push(',');
                json.push_str(&json_string(name));
                json.push(':');
                json.push_str(&value.map_or_else(|| "null".to_owned(), ColumnValue::json));
            }
            json.push('}');
            Some(bytes::Bytes::from(json))
        }
        other => other.clone(),
    };
    // Whole milliseconds, as the Kafka record and Debezium's router carry them. Kafka
    // has no timestamps before 1970 (the Java client refuses them): such an event time
    // falls back like a NULL one.
    // RFC 3339 (CloudEvents' `time`) ends at 9999-12-31: later times fall back too.
    let millis = |t: f64| {
        Some((t * 1000.0).floor())
            .filter(|ms| ms.is_finite() && *ms >= 0.0 && *ms < MAX_TIMESTAMP_MS)
    };
    let timestamp_ms = row
        .timestamp
        .and_then(millis)
        .or_else(|| row.created_at.and_then(millis))
        .map(|ms| ms as i64);
    let mut content_type = None;
    let mut payload = payload;
    if let Some(ce) = &shape.cloud_events {
        let (body, media_type) =
            cloud_event(ce, kind, row, &id, timestamp_ms, payload, &mut headers)?;
        payload = body;
        if kind != BrokerKind::Amqp {
            headers.push(("content-type".to_owned(), media_type.clone()));
        }
        content_type = Some(media_type);
    }
    if kind == BrokerKind::Nats {
        // NATS headers are text lines: a line break would end the header block.
        if let Some((name, _)) = headers.iter().find(|(_, v)| v.contains(['\r', '\n'])) {
            return Err(PublishError::refused(format!(
                "row {}: header `{name}` contains a line break, which NATS headers cannot carry",
                row.id
            )));
        }
    }
    Ok(Message {
        destination,
        key: row.aggregate_id.clone(),
        id,
        headers,
        payload,
        timestamp_ms,
        partition,
        content_type,
    })
}

/// The CloudEvent of a row: in binary mode the attributes join `headers` (with the
/// binding's prefix) and the body stays; in structured mode the body becomes the event
/// in JSON. Returns the body and its media type. A row without an event type cannot be
/// an event (`type` is required).
fn cloud_event(
    ce: &CloudEvents,
    kind: BrokerKind,
    row: &OutboxRow,
    id: &str,
    timestamp_ms: Option<i64>,
    payload: Option<bytes::Bytes>,
    headers: &mut Vec<(String, String)>,
) -> Result<(Option<bytes::Bytes>, String), PublishError> {
    let event_type = row
        .event_type
        .as_deref()
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            PublishError::refused(format!(
                "row {}: a CloudEvent needs a type, and the row's type column is NULL or empty",
                row.id
            ))
        })?;
    let time = timestamp_ms.and_then(|ms| {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).ok()?);
        Some(humantime::format_rfc3339_millis(at).to_string())
    });
    let mut attributes = vec![
        ("specversion", "1.0".to_owned()),
        ("id", id.to_owned()),
        ("source", ce.source.clone()),
        ("type", event_type.to_owned()),
    ];
    if let Some(subject) = &row.aggregate_id {
        attributes.push(("subject", subject.clone()));
    }
    if let Some(time) = time {
        attributes.push(("time", time));
    }
    match ce.mode {
        crate::api::CloudEventsMode::Binary => {
            let prefix = match kind {
                BrokerKind::Kafka => "ce_",
                BrokerKind::Nats => "ce-",
                BrokerKind::Amqp => "cloudEvents_",
            };
            for (name, value) in attributes {
                headers.push((format!("{prefix}{name}"), value));
            }
            Ok((payload, ce.data_content_type.clone()))
        }
        crate::api::CloudEventsMode::Structured => {
            let mut json = String::from("{");
            for (name, value) in &attributes {
                json.push_str(&json_string(name));
                json.push(':');
                json.push_str(&json_string(value));
                json.push(',');
            }
            json.push_str("\"datacontenttype\":");
            json.push_str(&json_string(&ce.data_content_type));
            if let Some(p) = &payload {
                let media = ce
                    .data_content_type
                    .split(';')
                    .next()
                    .unwrap_or_default()
                    .trim();
                let json_media = media == "application/json" || media.ends_with("+json");
                if json_media && serde_json::from_slice::<serde::de::IgnoredAny>(p).is_ok() {
                    json.push_str(",\"data\":");
                    json.push_str(std::str::from_utf8(p).unwrap_or("null"));
                } else if let Ok(text) = std::str::from_utf8(p) {
                    json.push_str(",\"data\":");
                    json.push_str(&json_string(text));
                } else {
                    use base64::Engine as _;
                    json.push_str(",\"data_base64\":");
                    json.push_str(&json_string(
                        &base64::engine::general_purpose::STANDARD.encode(p),
                    ));
                }
            }
            json.push('}');
            Ok((Some(bytes::Bytes::from(json)), CLOUDEVENTS_JSON.to_owned()))
        }
    }
}

#[cfg(test)]
mod tests;
