//! Kafka publisher: an idempotent rdkafka `FutureProducer` with `acks=all`.

use std::time::Duration;

use futures::future::BoxFuture;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, FutureProducer, FutureRecord, Producer};

use super::probe::{Probe, TIMEOUT, templated};
use super::{Broker, Message, PublishError};
use crate::api::{KafkaSpec, SaslMechanism};
use crate::rules::{
    BrokerKind, Problems, check_secret_ref, check_template_into, is_fixed_kafka_property,
};
use crate::secrets::{
    Content, Delivery, ENV_KAFKA_CA_FILE, ENV_KAFKA_SASL_PASSWORD, ENV_KAFKA_SASL_USERNAME,
    KAFKA_CA_PATH, SecretSlot, SecretUse,
};

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

// ---------------------------------------------------------------------------------------
// The spec's rules, Secrets and settings of a Kafka relay, and `check`'s probe.

/// Every problem of a Kafka spec.
pub fn check(k: &KafkaSpec, p: &mut Problems) {
    if k.bootstrap_servers.trim().is_empty() {
        p.push(
            "spec.broker.kafka.bootstrapServers",
            "is empty",
            "name at least one host:port",
        );
    }
    check_template_into(p, BrokerKind::Kafka, "spec.broker.kafka.topic", &k.topic);
    for key in k.properties.keys() {
        if is_fixed_kafka_property(key) {
            p.push(
                format!("spec.broker.kafka.properties.{key}"),
                "is fixed by the relay (delivery guarantees) or set through tls and sasl",
                "remove it; acks=all and idempotence are always on",
            );
        }
    }
    if let Some(sasl) = &k.sasl {
        check_secret_ref(
            p,
            "spec.broker.kafka.sasl.usernameSecretRef",
            &sasl.username_secret_ref.name,
            &sasl.username_secret_ref.key,
        );
        check_secret_ref(
            p,
            "spec.broker.kafka.sasl.passwordSecretRef",
            &sasl.password_secret_ref.name,
            &sasl.password_secret_ref.key,
        );
    }
    if let Some(ca) = k.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
        check_secret_ref(p, "spec.broker.kafka.tls.caSecretRef", &ca.name, &ca.key);
    }
}

/// The Secret references of a Kafka spec: SASL credentials as variables, the CA as a
/// mounted file.
pub fn secrets(k: &KafkaSpec) -> Vec<SecretSlot> {
    let slot = |field, reference: &crate::api::SecretKeyRef, delivery| SecretSlot {
        field,
        purpose: SecretUse::Broker,
        reference: reference.clone(),
        delivery,
        content: Content::Text,
    };
    let mut all = Vec::new();
    if let Some(sasl) = &k.sasl {
        all.push(slot(
            "spec.broker.kafka.sasl.usernameSecretRef",
            &sasl.username_secret_ref,
            Delivery::Env(ENV_KAFKA_SASL_USERNAME),
        ));
        all.push(slot(
            "spec.broker.kafka.sasl.passwordSecretRef",
            &sasl.password_secret_ref,
            Delivery::Env(ENV_KAFKA_SASL_PASSWORD),
        ));
    }
    if let Some(ca) = k.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
        all.push(slot(
            "spec.broker.kafka.tls.caSecretRef",
            ca,
            Delivery::File {
                path: KAFKA_CA_PATH,
                local_env: ENV_KAFKA_CA_FILE,
            },
        ));
    }
    all
}

/// Kafka producer settings with credentials resolved. No `Debug`: it holds secrets.
#[derive(Clone)]
pub struct KafkaSettings {
    /// `host:port` list.
    pub bootstrap_servers: String,
    /// Topic template.
    pub topic: String,
    /// TLS on (with the system roots when no CA file is given).
    pub tls: bool,
    /// CA certificate file.
    pub ca_file: Option<String>,
    /// SASL mechanism, user name and password.
    pub sasl: Option<(SaslMechanism, String, String)>,
    /// Extra librdkafka producer settings.
    pub properties: std::collections::BTreeMap<String, String>,
}

/// The settings of a Kafka spec, with Secret values (`value`, by field) and mounted
/// files (`file`, by field) resolved.
pub fn settings(
    k: &KafkaSpec,
    value: &dyn Fn(&str) -> String,
    file: &dyn Fn(&str) -> Option<String>,
) -> KafkaSettings {
    KafkaSettings {
        bootstrap_servers: k.bootstrap_servers.clone(),
        topic: k.topic.clone(),
        tls: k.tls.is_some(),
        ca_file: file("spec.broker.kafka.tls.caSecretRef"),
        sasl: k.sasl.as_ref().map(|s| {
            (
                s.mechanism,
                value("spec.broker.kafka.sasl.usernameSecretRef"),
                value("spec.broker.kafka.sasl.passwordSecretRef"),
            )
        }),
        properties: k.properties.clone(),
    }
}

/// `check`'s questions to Kafka: does it answer with these settings, and does the topic
/// exist (metadata request with topic auto-creation off)?
pub async fn probe(k: &KafkaSettings) -> Vec<Probe> {
    let mut client = super::kafka::client_config(k);
    client.set("allow.auto.create.topics", "false");
    let producer: BaseProducer = match client.create() {
        Ok(p) => p,
        Err(err) => {
            return vec![Probe::fail(
                "broker",
                format!("cannot create a Kafka client with these settings: {err}"),
            )];
        }
    };
    let topic = (!templated(&k.topic)).then(|| k.topic.clone());
    let wanted = topic.clone();
    let metadata = tokio::task::spawn_blocking(move || {
        producer.client().fetch_metadata(wanted.as_deref(), TIMEOUT)
    })
    .await;
    let metadata = match metadata {
        Ok(Ok(m)) => m,
        Ok(Err(err)) => {
            return vec![Probe::fail(
                "broker",
                format!(
                    "cannot reach Kafka at {} within {TIMEOUT:?}: {err}; check bootstrapServers, the network, TLS and SASL",
                    k.bootstrap_servers
                ),
            )];
        }
        Err(err) => {
            return vec![Probe::fail(
                "broker",
                format!("metadata request failed: {err}"),
            )];
        }
    };
    let mut probes = vec![Probe::ok(
        "broker",
        format!(
            "Kafka at {} answers ({} broker(s))",
            k.bootstrap_servers,
            metadata.brokers().len()
        ),
    )];
    match topic {
        Some(name) => {
            let found = metadata
                .topics()
                .iter()
                .find(|t| t.name() == name)
                .filter(|t| t.error().is_none() && !t.partitions().is_empty());
            probes.push(match found {
                Some(t) => Probe::ok(
                    "topic",
                    format!(
                        "topic {name} exists with {} partition(s)",
                        t.partitions().len()
                    ),
                ),
                None => Probe::fail(
                    "topic",
                    format!(
                        "topic {name} does not exist: create it (the relay never creates topics)"
                    ),
                ),
            });
        }
        None => probes.push(Probe::ok(
            "topic",
            format!(
                "topics follow the template {}: one per aggregate type, not checked here",
                k.topic
            ),
        )),
    }
    probes
}
