//! Kafka publisher: an idempotent rdkafka `FutureProducer` with `acks=all`.

use std::time::Duration;

use futures::future::BoxFuture;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::{Broker, Message, PublishError};
use crate::spec::config::KafkaSettings;

/// Publishes to Kafka. The producer reconnects by itself after an outage.
pub struct KafkaBroker {
    producer: FutureProducer,
}

impl KafkaBroker {
    /// Builds the producer (this does not connect yet: librdkafka connects lazily).
    pub fn new(config: &KafkaSettings) -> Result<Self, PublishError> {
        let producer = client_config(config).create().map_err(|err| {
            PublishError::transient(format!("cannot create the Kafka producer: {err}"))
        })?;
        Ok(Self { producer })
    }
}

/// The producer settings the relay uses: the user's `properties` first, then what
/// correctness needs, then TLS and SASL. `check` connects with the same.
pub(super) fn client_config(config: &KafkaSettings) -> ClientConfig {
    let mut client = ClientConfig::new();
    // Defaults a user may tune through `properties`.
    client
        .set("message.timeout.ms", "20000")
        .set("socket.connection.setup.timeout.ms", "5000")
        .set("linger.ms", "1");
    for (key, value) in &config.properties {
        client.set(key, value);
    }
    // Fixed, after the user's properties: idempotence keeps each Kafka partition in
    // send order without duplicates from internal retries (it requires
    // max.in.flight <= 5), and acks=all means "acknowledged" survives a broker loss.
    client
        .set("bootstrap.servers", &config.bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5");
    let protocol = match (config.tls, config.sasl.is_some()) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    client.set("security.protocol", protocol);
    if let Some(ca) = &config.ca_file {
        client.set("ssl.ca.location", ca);
    }
    if let Some((mechanism, user, password)) = &config.sasl {
        let mechanism = serde_json::to_value(mechanism)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        client
            .set("sasl.mechanism", mechanism)
            .set("sasl.username", user)
            .set("sasl.password", password);
    }
    client
}

/// Errors that say this message will never be accepted as it is.
fn is_row_fault(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidMessage
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::TopicAuthorizationFailed
    )
}

fn classify(err: &KafkaError, producer: &FutureProducer) -> PublishError {
    let text = format!("Kafka: {err}");
    if let Some((code, reason)) = producer.client().fatal_error() {
        // A fatal idempotence error poisons the producer; the relay sees `is_broken`,
        // exits and is restarted with a new one. Nothing was marked, so nothing is lost.
        return PublishError::transient(format!("Kafka producer fatal error {code:?}: {reason}"));
    }
    match err.rdkafka_error_code() {
        Some(code) if is_row_fault(code) => PublishError::row(text),
        _ => PublishError::transient(text),
    }
}

impl Broker for KafkaBroker {
    fn publish<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
            for (key, value) in &message.headers {
                headers = headers.insert(Header {
                    key,
                    value: Some(value.as_bytes()),
                });
            }
            let mut record = FutureRecord::to(&message.destination)
                .payload(&message.payload)
                .headers(headers);
            if let Some(key) = &message.key {
                record = record.key(key.as_str());
            }
            // Waiting for queue space is bounded; the delivery itself is bounded by
            // message.timeout.ms.
            match self.producer.send(record, Duration::from_secs(10)).await {
                Ok(_) => Ok(()),
                Err((err, _)) => Err(classify(&err, &self.producer)),
            }
        })
    }

    fn is_broken(&self) -> bool {
        self.producer.client().fatal_error().is_some()
    }
}
