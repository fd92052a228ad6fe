//! Brokers behind one trait: how an outbox row becomes a message (a pure, tested
//! function) and how each broker publishes it and confirms it.

pub mod amqp;
pub mod kafka;
pub mod nats;
pub mod probe;
pub mod tls;

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::api::Placement;

pub use crate::rules::{AGGREGATE_TYPE_PLACEHOLDER, BrokerKind, check_destination, check_template};

/// One outbox row as the relay publishes it.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    /// Row id: the message id.
    pub id: i64,
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

/// How a chain's next message goes out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Step {
    /// Where its predecessor was written.
    pub after: Delivered,
    /// Many chains of its batch are still sending, so other chains' next messages go
    /// out at about the same time: batching them pays (see
    /// [`crate::relay::chains::CROWD`]).
    pub crowded: bool,
}

/// Where an acknowledged message was written, as far as the next message of its chain
/// needs to know.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delivered {
    /// The Kafka partition the partitioner chose for the message's key: the next
    /// message of its chain goes there too, unless it names a partition itself.
    /// `None` when the message named its own partition (a `partition` placement), and
    /// for brokers without partitions.
    pub partition: Option<i32>,
}

/// Why a publish failed, and what that means for the row: only a refusal counts
/// toward `failure.maxAttempts` (and so can block or dead-letter the row); an outage
/// and a message held back are retried without counting, so a broker outage never
/// dead-letters or blocks rows.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PublishError {
    /// The broker refused this message (too large, invalid name, no route): the row
    /// cannot be published as it is. What happened, without credentials.
    #[error("{0}")]
    Refused(String),
    /// The broker is unavailable (timeouts, lost connections): try again later. What
    /// happened, without credentials.
    #[error("{0}")]
    Outage(String),
    /// The relay did not send the message, for the reason held (behind a failed
    /// message of its aggregate, past the fence, or the lock session ended): it goes
    /// with the next try. Says nothing of the broker.
    #[error("not sent: {0}")]
    HeldBack(String),
}

impl PublishError {
    /// The broker refused the row's message; it cannot be published as it is.
    pub fn refused(message: impl Into<String>) -> Self {
        Self::Refused(message.into())
    }

    /// The broker is unavailable; try again later.
    pub fn outage(message: impl Into<String>) -> Self {
        Self::Outage(message.into())
    }

    /// The relay did not send the message, `why`; it goes with the next try.
    pub fn held_back(why: &str) -> Self {
        Self::HeldBack(why.to_owned())
    }

    /// Whether the broker refused this message: retrying it counts against
    /// `failure.maxAttempts`.
    pub fn is_refused(&self) -> bool {
        matches!(self, Self::Refused(_))
    }

    /// Whether the relay held the message back itself (an outage whose text says
    /// nothing of the broker's reason).
    pub fn is_held_back(&self) -> bool {
        matches!(self, Self::HeldBack(_))
    }

    /// What happened, as [`Display`](std::fmt::Display) prints it (held back:
    /// `not sent: <why>`).
    pub fn message(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Self::Refused(message) | Self::Outage(message) => message.as_str().into(),
            Self::HeldBack(_) => self.to_string().into(),
        }
    }
}

/// A broker's settings with Secret values resolved: the one enum that names every
/// broker. Each variant's module holds that broker's spec rules, Secret references,
/// settings, probe and publisher; adding a broker adds a module, a variant here and
/// one in `crate::spec::ValidBroker` (plus its spec type in `crate::api`).
#[derive(Clone)]
pub enum BrokerSettings {
    /// Kafka.
    Kafka(kafka::KafkaSettings),
    /// NATS JetStream.
    Nats(nats::NatsSettings),
    /// RabbitMQ.
    RabbitMq(amqp::RabbitMqSettings),
}

impl BrokerSettings {
    /// Which broker rules apply.
    pub fn kind(&self) -> BrokerKind {
        match self {
            BrokerSettings::Kafka(_) => BrokerKind::Kafka,
            BrokerSettings::Nats(_) => BrokerKind::Nats,
            BrokerSettings::RabbitMq(_) => BrokerKind::Amqp,
        }
    }

    /// The destination template (topic, subject or routing key).
    pub fn template(&self) -> &str {
        match self {
            BrokerSettings::Kafka(k) => &k.topic,
            BrokerSettings::Nats(n) => &n.subject,
            BrokerSettings::RabbitMq(r) => &r.routing_key,
        }
    }

    /// A publisher with these settings (Kafka and RabbitMQ return before they are
    /// connected, NATS connects in the background when the server is down).
    pub async fn connect(&self) -> Result<Arc<dyn Broker>, PublishError> {
        Ok(match self {
            BrokerSettings::Kafka(k) => Arc::new(kafka::KafkaBroker::new(k)?),
            BrokerSettings::Nats(n) => Arc::new(nats::NatsBroker::new(n).await?),
            BrokerSettings::RabbitMq(r) => Arc::new(amqp::AmqpBroker::new(r.clone())),
        })
    }

    /// `check`'s questions to the broker, one line each.
    pub async fn probe(&self) -> Vec<probe::Probe> {
        match self {
            BrokerSettings::Kafka(k) => kafka::probe(k).await,
            BrokerSettings::Nats(n) => nats::probe(n).await,
            BrokerSettings::RabbitMq(r) => amqp::probe(r).await,
        }
    }
}

/// Whether messages may still go out, asked before each one is sent. The polling
/// relay's batch may send only while the database session holding its partition locks
/// is open and was last heard within its fence (`relay::chains::Fence`); log tailing
/// sends under [`Clear`].
pub trait Clearance: Sync {
    /// `Err` (held back, saying why) once no more messages may be sent.
    fn check(&self) -> Result<(), PublishError>;
}

/// Always clear to send.
pub struct Clear;

impl Clearance for Clear {
    fn check(&self) -> Result<(), PublishError> {
        Ok(())
    }
}

/// A broker the relay publishes to. `publish` returns once the broker has
/// acknowledged the message durably (Kafka acks=all, JetStream PubAck, AMQP confirm).
pub trait Broker: Send + Sync {
    /// Publishes one message and waits for its acknowledgement.
    fn publish<'a>(
        &'a self,
        message: &'a Message,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>>;

    /// Publishes the next message of a chain, whose predecessor was just acknowledged
    /// as `step.after`, and waits for its acknowledgement. It must land where its
    /// predecessor did (Kafka: the same partition). Unless `step.crowded`, it travels
    /// alone, so a broker client that waits to batch messages (Kafka's `linger.ms`)
    /// should send it at once: the wait would be paid once per event of a busy
    /// aggregate.
    fn publish_next<'a>(
        &'a self,
        message: &'a Message,
        step: Step,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>> {
        let _ = step;
        self.publish(message)
    }

    /// Publishes the rest of a chain, whose first message was acknowledged as `after`,
    /// and waits for the acknowledgements: every message where its predecessor landed,
    /// in order. Returns one outcome per message it sent, in order, ending with the
    /// first failure; the messages after a failure were not sent, and none of them is
    /// ever written ahead of the failed one, so publishing the rest again from the
    /// failure keeps the aggregate's order. `crowded` as in [`Step`].
    ///
    /// By default each message waits for its predecessor's acknowledgement (a round
    /// trip per event), and `clearance` is asked before each one goes out. A broker
    /// whose client keeps a partition in send order and writes no message after one it
    /// gave up on sends them all at once instead (Kafka, see its module's notes): the
    /// caller asked `clearance` just before.
    fn publish_rest<'a>(
        &'a self,
        messages: &'a [Message],
        after: Delivered,
        crowded: bool,
        clearance: &'a dyn Clearance,
    ) -> BoxFuture<'a, Vec<Result<Delivered, PublishError>>> {
        Box::pin(async move {
            let mut outcomes = Vec::with_capacity(messages.len());
            let mut after = after;
            for message in messages {
                if let Err(err) = clearance.check() {
                    outcomes.push(Err(err));
                    break;
                }
                let sent = self.publish_next(message, Step { after, crowded }).await;
                let failed = sent.is_err();
                if let Ok(delivered) = &sent {
                    after = *delivered;
                }
                outcomes.push(sent);
                if failed {
                    break;
                }
            }
            outcomes
        })
    }

    /// Why the client can never publish again, when it cannot: the process must
    /// restart, and its exit says this.
    fn broken(&self) -> Option<String> {
        None
    }
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
    pub placed: Vec<crate::spec::Placed>,
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

    /// The shape a parsed relay asks for.
    pub fn of(valid: &crate::spec::ValidRelay) -> Self {
        Self {
            placed: valid.table.placed(),
            tombstone_on_empty_payload: valid.tombstone_on_empty_payload,
            expand_json_payload: valid.expand_json_payload,
            cloud_events: valid.cloud_events.clone(),
            ..Self::new(valid.broker.kind(), valid.broker.template())
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
mod tests {
    use super::*;

    fn row() -> OutboxRow {
        OutboxRow {
            id: 42,
            aggregate_type: "Order".into(),
            aggregate_id: Some("o-1".into()),
            event_type: Some("OrderCreated".into()),
            payload: Some(bytes::Bytes::from_static(br#"{"a":1}"#)),
            extra: vec![ColumnValue::new(
                "traceparent",
                "00-abc-01".into(),
                ValueKind::Text,
            )],
            partition: 1,
            created_at: None,
            timestamp: None,
        }
    }

    /// A shape placing `traceparent` as a header, as `table.headers: [traceparent]`.
    fn traced(kind: BrokerKind, template: &str) -> Shape {
        Shape {
            placed: vec![crate::spec::Placed {
                column: "traceparent".into(),
                placement: Placement::Header,
                name: "traceparent".into(),
            }],
            ..Shape::new(kind, template)
        }
    }

    #[test]
    fn a_row_becomes_a_message_with_id_key_and_headers() {
        let m = traced(BrokerKind::Kafka, "outbox.event.{aggregateType}")
            .build(&row())
            .unwrap();
        assert_eq!(m.destination, "outbox.event.Order");
        assert_eq!(m.key.as_deref(), Some("o-1"));
        assert_eq!(m.id, "42");
        assert_eq!(m.payload.as_deref(), Some(&br#"{"a":1}"#[..]));
        assert_eq!(m.timestamp_ms, None);
        assert_eq!(
            m.headers,
            vec![
                ("id".into(), "42".into()),
                ("type".into(), "OrderCreated".into()),
                ("aggregateType".into(), "Order".into()),
                ("traceparent".into(), "00-abc-01".into()),
            ]
        );
    }

    #[test]
    fn names_the_broker_refuses_are_row_faults() {
        let mut r = row();
        r.aggregate_type = "has space".into();
        let err = Shape::new(BrokerKind::Kafka, "{aggregateType}")
            .build(&r)
            .unwrap_err();
        assert!(
            err.is_refused() && err.message().contains("row 42"),
            "{err}"
        );
        let err = Shape::new(BrokerKind::Nats, "outbox.{aggregateType}")
            .build(&r)
            .unwrap_err();
        assert!(err.is_refused(), "{err}");
        r.aggregate_type = String::new();
        assert!(
            Shape::new(BrokerKind::Nats, "outbox.{aggregateType}")
                .build(&r)
                .is_err()
        );
        assert!(
            Shape::new(BrokerKind::Amqp, "{aggregateType}")
                .build(&r)
                .is_ok()
        );
        r.aggregate_type = "x".repeat(300);
        assert!(
            Shape::new(BrokerKind::Amqp, "{aggregateType}")
                .build(&r)
                .is_err()
        );
    }

    #[test]
    fn nats_headers_cannot_break_lines() {
        let mut r = row();
        r.extra = vec![ColumnValue::new(
            "traceparent",
            "a\r\nb".into(),
            ValueKind::Text,
        )];
        assert!(
            traced(BrokerKind::Nats, "o.{aggregateType}")
                .build(&r)
                .is_err()
        );
        assert!(
            traced(BrokerKind::Kafka, "o.{aggregateType}")
                .build(&r)
                .is_ok()
        );
        // A column not placed as a header is not checked.
        assert!(
            Shape::new(BrokerKind::Nats, "o.{aggregateType}")
                .build(&r)
                .is_ok()
        );
    }
}

#[cfg(test)]
mod shape_tests {
    use super::*;

    fn row(payload: Option<&'static [u8]>) -> OutboxRow {
        OutboxRow {
            id: 7,
            aggregate_type: "Order".into(),
            aggregate_id: Some("o-1".into()),
            event_type: None,
            payload: payload.map(bytes::Bytes::from_static),
            extra: Vec::new(),
            partition: 0,
            created_at: Some(1_700_000_000.123_9),
            timestamp: None,
        }
    }

    #[test]
    fn a_null_payload_is_a_tombstone_and_a_blank_one_only_when_asked() {
        let plain = Shape::new(BrokerKind::Kafka, "t");
        let asked = Shape {
            tombstone_on_empty_payload: true,
            ..plain.clone()
        };
        assert_eq!(plain.build(&row(None)).unwrap().payload, None);
        assert_eq!(asked.build(&row(None)).unwrap().payload, None);
        for blank in [&b""[..], b"  ", b"\n\t "] {
            assert_eq!(
                plain.build(&row(Some(blank))).unwrap().payload.as_deref(),
                Some(blank),
                "{blank:?} is sent as stored by default"
            );
            assert_eq!(asked.build(&row(Some(blank))).unwrap().payload, None);
        }
        assert_eq!(
            asked.build(&row(Some(b" {} "))).unwrap().payload.as_deref(),
            Some(&b" {} "[..])
        );
    }

    #[test]
    fn the_timestamp_is_the_event_time_else_the_created_or_commit_time() {
        let shape = Shape::new(BrokerKind::Kafka, "t");
        let mut r = row(Some(b"{}"));
        assert_eq!(
            shape.build(&r).unwrap().timestamp_ms,
            Some(1_700_000_000_123)
        );
        r.timestamp = Some(1_600_000_000.5);
        assert_eq!(
            shape.build(&r).unwrap().timestamp_ms,
            Some(1_600_000_000_500)
        );
        // Kafka has no time before 1970: falls back like NULL.
        r.timestamp = Some(-0.0005);
        assert_eq!(
            shape.build(&r).unwrap().timestamp_ms,
            Some(1_700_000_000_123)
        );
        r.created_at = Some(-1.0);
        assert_eq!(shape.build(&r).unwrap().timestamp_ms, None);
        // Year 10000 and later: no RFC 3339 form, falls back like NULL.
        r.timestamp = Some(253_402_300_800.0);
        r.created_at = Some(253_402_300_799.5);
        assert_eq!(
            shape.build(&r).unwrap().timestamp_ms,
            Some(253_402_300_799_500)
        );
        r.created_at = Some(1e15);
        assert_eq!(shape.build(&r).unwrap().timestamp_ms, None);
        r.timestamp = None;
        r.created_at = None;
        assert_eq!(shape.build(&r).unwrap().timestamp_ms, None);
    }

    fn placed(column: &str, placement: Placement, name: &str) -> crate::spec::Placed {
        crate::spec::Placed {
            column: column.into(),
            placement,
            name: name.into(),
        }
    }

    fn with_extra(payload: Option<&'static [u8]>) -> OutboxRow {
        OutboxRow {
            extra: vec![
                ColumnValue::new("event_type", "OrderCreated".into(), ValueKind::Text),
                ColumnValue::new("version", "3".into(), ValueKind::Number),
                ColumnValue::new("urgent", "t".into(), ValueKind::Boolean),
                ColumnValue::new("ratio", "NaN".into(), ValueKind::Number),
                ColumnValue::new("quote", "say \"hi\"\n".into(), ValueKind::Text),
                ColumnValue::new("part", "2".into(), ValueKind::Number),
            ],
            ..row(payload)
        }
    }

    #[test]
    fn placed_columns_go_to_headers_under_their_alias() {
        let shape = Shape {
            placed: vec![
                placed("event_type", Placement::Header, "eventType"),
                placed("urgent", Placement::Header, "urgent"),
                placed("missing", Placement::Header, "absent"),
            ],
            ..Shape::new(BrokerKind::Kafka, "t")
        };
        let m = shape.build(&with_extra(Some(b"{}"))).unwrap();
        assert_eq!(
            &m.headers[1..],
            &[
                ("aggregateType".to_owned(), "Order".to_owned()),
                ("eventType".to_owned(), "OrderCreated".to_owned()),
                // Booleans read the same in both modes (`t` from the stream).
                ("urgent".to_owned(), "true".to_owned()),
            ]
        );
        assert_eq!(m.payload.as_deref(), Some(&b"{}"[..]));
    }

    #[test]
    fn envelope_fields_wrap_the_payload_as_the_router_does() {
        let mut shape = Shape {
            placed: vec![
                placed("event_type", Placement::Envelope, "type"),
                placed("version", Placement::Envelope, "version"),
                placed("urgent", Placement::Envelope, "urgent"),
                placed("ratio", Placement::Envelope, "ratio"),
                placed("quote", Placement::Envelope, "quote"),
                placed("missing", Placement::Envelope, "gone"),
            ],
            ..Shape::new(BrokerKind::Kafka, "t")
        };
        let value = |shape: &Shape, payload| {
            let m = shape.build(&with_extra(payload)).unwrap();
            m.payload.map(|p| String::from_utf8(p.to_vec()).unwrap())
        };
        let fields = r#""type":"OrderCreated","version":3,"urgent":true,"ratio":"NaN","quote":"say \"hi\"\n","gone":null}"#;
        assert_eq!(
            value(&shape, Some(br#"{"a": 1}"#)).unwrap(),
            format!(r#"{{"payload":"{{\"a\": 1}}",{fields}"#)
        );
        // A NULL payload is a null field, not a tombstone.
        assert_eq!(
            value(&shape, None).unwrap(),
            format!(r#"{{"payload":null,{fields}"#)
        );
        shape.expand_json_payload = true;
        assert_eq!(
            value(&shape, Some(br#"{"a": 1}"#)).unwrap(),
            format!(r#"{{"payload":{{"a": 1}},{fields}"#)
        );
        // Not JSON, or not starting with `{` or `[`: stays a string.
        assert_eq!(
            value(&shape, Some(b"{oops")).unwrap(),
            format!(r#"{{"payload":"{{oops",{fields}"#)
        );
        assert_eq!(
            value(&shape, Some(b" {}")).unwrap(),
            format!(r#"{{"payload":" {{}}",{fields}"#)
        );
        for v in [value(&shape, Some(br#"{"a": 1}"#)), value(&shape, None)] {
            let parsed: serde_json::Value = serde_json::from_str(&v.unwrap()).unwrap();
            assert_eq!(parsed["version"], 3);
        }
        // With the option, an empty payload is a tombstone even with an envelope.
        shape.tombstone_on_empty_payload = true;
        assert_eq!(value(&shape, None), None);
        assert_eq!(value(&shape, Some(b" ")), None);
    }

    #[test]
    fn a_partition_column_chooses_the_kafka_partition() {
        let shape = Shape {
            placed: vec![placed("part", Placement::Partition, "part")],
            ..Shape::new(BrokerKind::Kafka, "t")
        };
        assert_eq!(shape.build(&with_extra(None)).unwrap().partition, Some(2));
        assert_eq!(shape.build(&row(None)).unwrap().partition, None);
        let mut r = with_extra(None);
        r.extra[5].text = "-1".into();
        let err = shape.build(&r).unwrap_err();
        assert!(
            err.is_refused() && err.message().contains("partition column part"),
            "{err}"
        );
    }

    fn cloud(mode: crate::api::CloudEventsMode, kind: BrokerKind) -> Shape {
        Shape {
            cloud_events: Some(CloudEvents {
                mode,
                source: "/outboxrelays/shop/orders".into(),
                data_content_type: "application/json".into(),
            }),
            ..Shape::new(kind, "t")
        }
    }

    fn typed(payload: Option<&'static [u8]>) -> OutboxRow {
        OutboxRow {
            event_type: Some("OrderCreated".into()),
            ..row(payload)
        }
    }

    #[test]
    fn binary_cloud_events_use_each_bindings_header_names() {
        use crate::api::CloudEventsMode::Binary;
        for (kind, prefix) in [
            (BrokerKind::Kafka, "ce_"),
            (BrokerKind::Nats, "ce-"),
            (BrokerKind::Amqp, "cloudEvents_"),
        ] {
            let m = cloud(Binary, kind).build(&typed(Some(b"{}"))).unwrap();
            let header = |n: &str| {
                m.headers
                    .iter()
                    .find(|(k, _)| *k == format!("{prefix}{n}"))
                    .map(|(_, v)| v.as_str())
            };
            assert_eq!(header("specversion"), Some("1.0"));
            assert_eq!(header("id"), Some("7"));
            assert_eq!(header("source"), Some("/outboxrelays/shop/orders"));
            assert_eq!(header("type"), Some("OrderCreated"));
            assert_eq!(header("subject"), Some("o-1"));
            assert_eq!(header("time"), Some("2023-11-14T22:13:20.123Z"));
            assert_eq!(m.content_type.as_deref(), Some("application/json"));
            // Kafka and NATS carry the media type as a header; AMQP as its property.
            let content_header = m.headers.iter().any(|(k, _)| k == "content-type");
            assert_eq!(content_header, kind != BrokerKind::Amqp, "{kind:?}");
            assert_eq!(m.payload.as_deref(), Some(&b"{}"[..]));
        }
    }

    #[test]
    fn structured_cloud_events_embed_json_data_and_encode_the_rest() {
        use crate::api::CloudEventsMode::Structured;
        let shape = cloud(Structured, BrokerKind::Kafka);
        let event = |payload| {
            let m = shape.build(&typed(payload)).unwrap();
            assert_eq!(m.content_type.as_deref(), Some(CLOUDEVENTS_JSON));
            let body = m.payload.unwrap();
            serde_json::from_slice::<serde_json::Value>(&body).unwrap()
        };
        let e = event(Some(br#"{"a": [1, 2]}"#));
        assert_eq!(e["specversion"], "1.0");
        assert_eq!(e["id"], "7");
        assert_eq!(e["type"], "OrderCreated");
        assert_eq!(e["datacontenttype"], "application/json");
        assert_eq!(e["data"], serde_json::json!({"a": [1, 2]}));
        assert_eq!(event(Some(b"not json"))["data"], "not json");
        assert_eq!(event(Some(&[0xff, 0x00]))["data_base64"], "/wA=");
        let none = event(None);
        assert!(none.get("data").is_none() && none.get("data_base64").is_none());
    }

    #[test]
    fn an_event_without_a_type_is_a_refused_row() {
        let shape = cloud(crate::api::CloudEventsMode::Binary, BrokerKind::Nats);
        let err = shape.build(&row(Some(b"{}"))).unwrap_err();
        assert!(
            err.is_refused() && err.message().contains("needs a type"),
            "{err}"
        );
    }
}
