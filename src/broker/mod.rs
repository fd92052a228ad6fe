//! Brokers behind one trait: how an outbox row becomes a message (a pure, tested
//! function) and how each broker publishes it and confirms it.

pub mod amqp;
pub mod kafka;
pub mod nats;
pub mod probe;
pub mod tls;

use std::sync::Arc;

use futures::future::BoxFuture;

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
    /// Payload bytes as stored (text forms as UTF-8); shared, not copied, by the
    /// message built from the row.
    pub payload: bytes::Bytes,
    /// Configured header columns that are not NULL.
    pub headers: Vec<(String, String)>,
    /// The row's partition.
    pub partition: i64,
    /// Insertion time as Unix seconds, when the table has a created-at column.
    pub created_at: Option<f64>,
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
    /// Payload bytes as stored (the row's, shared).
    pub payload: bytes::Bytes,
}

/// Why a publish failed, and whether the row itself is at fault.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    /// `true` when the broker refused this message (too large, invalid name, no route):
    /// retrying it counts against `failure.maxAttempts`. `false` for outages
    /// (timeouts, lost connections), which are retried without counting, so a broker
    /// outage never dead-letters or blocks rows.
    pub row_fault: bool,
    /// What happened, without credentials.
    pub message: String,
}

impl PublishError {
    /// The row cannot be published as it is.
    pub fn row(message: impl Into<String>) -> Self {
        Self {
            row_fault: true,
            message: message.into(),
        }
    }
    /// The broker is unavailable; try again later.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            row_fault: false,
            message: message.into(),
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

    /// A publisher with these settings (Kafka and RabbitMQ connect lazily, NATS in the
    /// background when the server is down).
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

/// A broker the relay publishes to. `publish` returns once the broker has
/// acknowledged the message durably (Kafka acks=all, JetStream PubAck, AMQP confirm).
pub trait Broker: Send + Sync {
    /// Publishes one message and waits for its acknowledgement.
    fn publish<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<(), PublishError>>;

    /// True when the client can never publish again and the process must restart.
    fn is_broken(&self) -> bool {
        false
    }
}

/// Builds the message for `row`: destination from `template`, key = aggregate id,
/// message id = row id, headers `id`, `type`, `aggregateType` plus header columns.
/// Names and headers the broker would refuse are reported as row faults here, before
/// anything is sent.
pub fn build_message(
    kind: BrokerKind,
    template: &str,
    row: &OutboxRow,
) -> Result<Message, PublishError> {
    let destination = template.replace(AGGREGATE_TYPE_PLACEHOLDER, &row.aggregate_type);
    check_destination(kind, &destination).map_err(|why| {
        PublishError::row(format!(
            "row {}: destination `{destination}` (from aggregate type `{}`) {why}",
            row.id, row.aggregate_type
        ))
    })?;
    let id = row.id.to_string();
    let mut headers = vec![("id".to_owned(), id.clone())];
    if let Some(t) = &row.event_type {
        headers.push(("type".to_owned(), t.clone()));
    }
    headers.push(("aggregateType".to_owned(), row.aggregate_type.clone()));
    headers.extend(row.headers.iter().cloned());
    if kind == BrokerKind::Nats {
        // NATS headers are text lines: a line break would end the header block.
        if let Some((name, _)) = headers.iter().find(|(_, v)| v.contains(['\r', '\n'])) {
            return Err(PublishError::row(format!(
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
        payload: row.payload.clone(),
    })
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
            payload: bytes::Bytes::from_static(br#"{"a":1}"#),
            headers: vec![("traceparent".into(), "00-abc-01".into())],
            partition: 1,
            created_at: None,
        }
    }

    #[test]
    fn a_row_becomes_a_message_with_id_key_and_headers() {
        let m = build_message(BrokerKind::Kafka, "outbox.event.{aggregateType}", &row()).unwrap();
        assert_eq!(m.destination, "outbox.event.Order");
        assert_eq!(m.key.as_deref(), Some("o-1"));
        assert_eq!(m.id, "42");
        assert_eq!(&m.payload[..], br#"{"a":1}"#);
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
        let err = build_message(BrokerKind::Kafka, "{aggregateType}", &r).unwrap_err();
        assert!(err.row_fault && err.message.contains("row 42"), "{err}");
        let err = build_message(BrokerKind::Nats, "outbox.{aggregateType}", &r).unwrap_err();
        assert!(err.row_fault, "{err}");
        r.aggregate_type = String::new();
        assert!(build_message(BrokerKind::Nats, "outbox.{aggregateType}", &r).is_err());
        assert!(build_message(BrokerKind::Amqp, "{aggregateType}", &r).is_ok());
        r.aggregate_type = "x".repeat(300);
        assert!(build_message(BrokerKind::Amqp, "{aggregateType}", &r).is_err());
    }

    #[test]
    fn nats_headers_cannot_break_lines() {
        let mut r = row();
        r.headers = vec![("traceparent".into(), "a\r\nb".into())];
        assert!(build_message(BrokerKind::Nats, "o.{aggregateType}", &r).is_err());
        assert!(build_message(BrokerKind::Kafka, "o.{aggregateType}", &r).is_ok());
    }
}
