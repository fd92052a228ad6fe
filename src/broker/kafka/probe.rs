//! `check`'s questions to Kafka: does it answer with the relay's settings, does it
//! grant an idempotent producer id, and does the topic exist.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::producer::{BaseProducer, Producer};

use super::producer::Context;
use super::settings::{KafkaSettings, client_config};
use crate::broker::probe::{Probe, TIMEOUT, templated};

/// How often the probe's client reports its statistics (the idempotent producer's state).
const STATS_EVERY_MS: &str = "100";

/// Whether the cluster grants the probe's idempotent producer an id, as it must the
/// relay's: only to a principal allowed IDEMPOTENT_WRITE on the cluster or WRITE on a
/// topic. Refused, it is a fatal error for every producer the relay makes, so the relay
/// would crash-loop (`tests/relay/relay_fatal.rs`); the probe says so first. Waits,
/// polling the client, until its statistics show the id assigned or a fatal error
/// stops it, at most [`TIMEOUT`].
fn producer_id(producer: &BaseProducer<Context>, idempotence: &Mutex<Option<String>>) -> Probe {
    let until = std::time::Instant::now() + TIMEOUT;
    loop {
        producer.poll(Duration::from_millis(50));
        if let Some((code, _)) = producer.client().fatal_error() {
            return Probe::fail(
                "producer id",
                format!(
                    "Kafka refuses these credentials an idempotent producer ({code}): \
                     every send would fail for good; grant the user IDEMPOTENT_WRITE on \
                     the cluster, or (Kafka 2.8 and later) WRITE on the topic"
                ),
            );
        }
        let state = idempotence.lock().map(|s| s.clone()).unwrap_or_default();
        if state.as_deref() == Some("Assigned") {
            return Probe::ok("producer id", "Kafka grants an idempotent producer id");
        }
        if std::time::Instant::now() >= until {
            return Probe::fail(
                "producer id",
                format!(
                    "Kafka granted no idempotent producer id within {TIMEOUT:?} (state: {})",
                    state.as_deref().unwrap_or("unknown")
                ),
            );
        }
    }
}

/// `check`'s questions to Kafka: does it answer with these settings, does it grant an
/// idempotent producer id, and does the topic exist (metadata request with topic
/// auto-creation off)?
pub async fn probe(k: &KafkaSettings) -> Vec<Probe> {
    let mut client = client_config(k);
    client
        .set("allow.auto.create.topics", "false")
        .set("statistics.interval.ms", STATS_EVERY_MS);
    let idempotence: Arc<Mutex<Option<String>>> = Arc::default();
    let context = Context {
        idempotence: Some(idempotence.clone()),
        ..Context::default()
    };
    let last_error = context.last_error.clone();
    let producer: BaseProducer<Context> = match client.create_with_context(context) {
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
        let result = producer.client().fetch_metadata(wanted.as_deref(), TIMEOUT);
        // A BaseProducer serves its error callbacks only when polled, one event per
        // poll: serve every one waiting (the connection's error need not be first).
        for _ in 0..64 {
            producer.poll(Duration::ZERO);
        }
        let result = result.map_err(|err| (err, last_error.get()))?;
        Ok((result, producer_id(&producer, &idempotence)))
    })
    .await;
    let (metadata, producer_id) = match metadata {
        Ok(Ok(found)) => found,
        Ok(Err((err, cause))) => {
            let cause = cause.map(|c| format!(" ({c})")).unwrap_or_default();
            return vec![Probe::fail(
                "broker",
                format!(
                    "cannot reach Kafka at {} within {TIMEOUT:?}: {err}{cause}; check bootstrapServers, the network, TLS and SASL",
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
    let mut probes = vec![
        Probe::ok(
            "broker",
            format!(
                "Kafka at {} answers ({} broker(s))",
                k.bootstrap_servers,
                metadata.brokers().len()
            ),
        ),
        producer_id,
    ];
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
