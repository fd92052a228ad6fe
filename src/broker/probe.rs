//! What `outbox-operator check` asks a broker: can the relay's client connect with the
//! relay's settings, and does the destination exist? Read-only: nothing is created
//! (Kafka's metadata request is made with topic auto-creation off).
//!
//! Credentials that reach a relay pod as mounted files (Kafka CA, NATS credentials) are
//! read from local paths named by environment variables here; values from Secrets
//! (RabbitMQ URI, Kafka SASL) from the same variables the relay reads.

use std::time::Duration;

use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use rdkafka::producer::{BaseProducer, Producer};

use super::AGGREGATE_TYPE_PLACEHOLDER;
use crate::spec::ValidRelay;
use crate::spec::config::{BrokerSettings, KafkaSettings, NatsSettings, RabbitMqSettings};

pub use crate::spec::secrets::{ENV_KAFKA_CA_FILE, ENV_NATS_CREDENTIALS_FILE};

/// How long each connection attempt may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Short name: `broker`, `topic`, `stream`, `exchange`.
    pub name: &'static str,
    /// Passed.
    pub ok: bool,
    /// What was found, or what to fix.
    pub message: String,
}

impl Probe {
    fn ok(name: &'static str, message: impl Into<String>) -> Self {
        Self {
            name,
            ok: true,
            message: message.into(),
        }
    }

    fn fail(name: &'static str, message: impl Into<String>) -> Self {
        Self {
            name,
            ok: false,
            message: message.into(),
        }
    }
}

/// Checks the broker of a parsed relay, with its Secret values read from this
/// process's environment as the catalogue names them.
pub async fn probe(valid: &ValidRelay) -> Vec<Probe> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    match BrokerSettings::read(valid, &env) {
        Err(err) => vec![Probe::fail(
            "broker",
            format!("{err} (outside a pod, set these variables to the values the relay would get)"),
        )],
        Ok(BrokerSettings::Kafka(k)) => kafka(&k).await,
        Ok(BrokerSettings::Nats(n)) => nats(&n).await,
        Ok(BrokerSettings::RabbitMq(r)) => rabbitmq(&r).await,
    }
}

/// Where a template has `{aggregateType}`, the destination cannot be checked as one.
fn templated(template: &str) -> bool {
    template.contains(AGGREGATE_TYPE_PLACEHOLDER)
}

async fn kafka(k: &KafkaSettings) -> Vec<Probe> {
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

async fn nats(n: &NatsSettings) -> Vec<Probe> {
    let mut options = async_nats::ConnectOptions::new().connection_timeout(TIMEOUT);
    if let Some(path) = &n.credentials_file {
        options = match options.credentials_file(path).await {
            Ok(o) => o,
            Err(err) => {
                return vec![Probe::fail(
                    "broker",
                    format!("cannot read credentials file {path}: {err}"),
                )];
            }
        };
    }
    let client = match tokio::time::timeout(TIMEOUT * 2, options.connect(n.url.as_str())).await {
        Ok(Ok(c)) => c,
        Ok(Err(err)) => {
            return vec![Probe::fail(
                "broker",
                format!("cannot connect to NATS at {}: {err}", n.url),
            )];
        }
        Err(_) => {
            return vec![Probe::fail(
                "broker",
                format!("NATS at {} did not answer within {:?}", n.url, TIMEOUT * 2),
            )];
        }
    };
    let mut probes = vec![Probe::ok("broker", format!("NATS at {} answers", n.url))];
    let mut jetstream = async_nats::jetstream::new(client);
    jetstream.set_timeout(TIMEOUT);
    // A templated subject: any stream capturing some aggregate type's subject.
    let subject = n.subject.replace(AGGREGATE_TYPE_PLACEHOLDER, "*");
    probes.push(match jetstream.stream_by_subject(subject.clone()).await {
        Ok(stream) => Probe::ok(
            "stream",
            format!("JetStream stream {stream} captures subject {subject}"),
        ),
        Err(err) => Probe::fail(
            "stream",
            format!(
                "no JetStream stream captures subject {subject} ({err}): create one whose subjects cover it, with a duplicate window (the relay never creates streams)"
            ),
        ),
    });
    probes
}

async fn rabbitmq(r: &RabbitMqSettings) -> Vec<Probe> {
    let url = &r.url;
    let connected = tokio::time::timeout(
        TIMEOUT,
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await;
    // lapin's errors do not contain the URI.
    let connection = match connected {
        Ok(Ok(c)) => c,
        Ok(Err(err)) => {
            return vec![Probe::fail(
                "broker",
                format!(
                    "cannot connect to RabbitMQ with the URI in {}: {err}",
                    r.url_source
                ),
            )];
        }
        Err(_) => {
            return vec![Probe::fail(
                "broker",
                format!("RabbitMQ did not answer within {TIMEOUT:?}"),
            )];
        }
    };
    let mut probes = vec![Probe::ok(
        "broker",
        "RabbitMQ answers and accepts the login",
    )];
    let checked = async {
        let channel = connection.create_channel().await?;
        // Passive: only asks whether it exists; the server closes the channel if not.
        channel
            .exchange_declare(
                r.exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
    }
    .await;
    probes.push(match checked {
        Ok(()) => Probe::ok("exchange", format!("exchange {} exists", r.exchange)),
        Err(err) => Probe::fail(
            "exchange",
            format!(
                "exchange {} cannot be used ({err}): declare it and bind a queue for routing key {} (the relay never declares exchanges)",
                r.exchange, r.routing_key
            ),
        ),
    });
    let _ = connection.close(200, "check done".into()).await;
    probes
}
