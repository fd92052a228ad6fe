//! Brokers behind one trait: how an outbox row becomes a message (a pure, tested
//! function, in `message`) and how each broker publishes it and confirms it.

pub mod amqp;
pub mod amqp_read;
pub mod kafka;
mod message;
pub mod nats;
pub mod nats_read;
pub mod probe;
pub mod tls;

use std::sync::Arc;

use futures::future::BoxFuture;

pub use crate::rules::{AGGREGATE_TYPE_PLACEHOLDER, BrokerKind, check_destination, check_template};
pub use message::{
    CLOUDEVENTS_JSON, CloudEvents, ColumnValue, Message, OutboxRow, Placed, RowId, Shape, ValueKind,
};

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

    /// `audit`'s read of one destination: the `id` header of every message it received
    /// at or after `since`, in the order a consumer of one aggregate sees them (per
    /// Kafka partition, per stream). RabbitMQ hands a queue's messages to one consumer
    /// and takes them away: its destination is a stream queue bound as an audit tap
    /// ([`amqp_read`]).
    pub async fn delivered_ids(
        &self,
        destination: &str,
        since: std::time::SystemTime,
    ) -> Result<Vec<String>, ReadError> {
        match self {
            BrokerSettings::Kafka(k) => {
                let since_ms = since
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
                let (k, topic) = (k.clone(), destination.to_owned());
                tokio::task::spawn_blocking(move || kafka::read::ids_since(&k, &topic, since_ms))
                    .await
                    .map_err(|e| ReadError::failed("Kafka", "the read stopped", e))?
            }
            BrokerSettings::Nats(n) => nats_read::ids_since(n, destination, since).await,
            BrokerSettings::RabbitMq(r) => amqp_read::ids_since(r, destination, since).await,
        }
    }
}

/// Why `audit` could not read what a destination received.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The broker refused or failed a request.
    #[error("{broker}: {what}: {message}")]
    Failed {
        /// `Kafka` or `NATS`.
        broker: &'static str,
        /// What was asked.
        what: String,
        /// The client's error.
        message: String,
    },
    /// Nothing holds the destination.
    #[error("{broker}: {destination} does not exist")]
    Missing {
        /// `Kafka` or `NATS`.
        broker: &'static str,
        /// The topic or subject.
        destination: String,
    },
    /// RabbitMQ gives each message of a queue to one consumer and removes it: the audit
    /// reads a stream queue bound as a tap, and none was named.
    #[error(
        "RabbitMQ: a queue gives each message to one consumer and removes it, so the audit reads a stream queue bound to exchange {exchange} as a tap: declare one (x-queue-type: stream, x-max-age as long as the windows you audit), bind it for every routing key the relay uses, and name it with --rabbitmq-stream"
    )]
    NotReadable {
        /// The relay's exchange.
        exchange: String,
    },
}

impl ReadError {
    pub(crate) fn failed(
        broker: &'static str,
        what: impl Into<String>,
        error: impl std::fmt::Display,
    ) -> Self {
        ReadError::Failed {
            broker,
            what: what.into(),
            message: error.to_string(),
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
