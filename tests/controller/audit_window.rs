//! `outbox-operator audit -f relay.yaml` against the rig's PostgreSQL, Kafka, NATS and
//! RabbitMQ (a stream queue bound as a tap):
//! after a real relay published a window, the audit passes (exit 0) and counts every
//! delivery; a row marked published that never reached the broker is reported missing,
//! and a row first delivered after a later row of its aggregate is reported out of
//! order, each under its aggregate, with exit 1.

use crate::common;

use std::process::Output;
use std::time::Duration;

use common::{RelayBroker, RelayOptions, RelayProcess};
use serde_json::json;

fn audit(manifest: &serde_json::Value, database_url: &str) -> Output {
    crate::cli::run_with_manifest(
        &["audit", "--since", "10m", "--until", "0s"],
        manifest,
        database_url,
    )
}

/// The audit of a RabbitMQ relay: its URL in the variable the relay reads, and the
/// stream bound as a tap (none: the audit must refuse to guess).
fn audit_amqp(manifest: &serde_json::Value, database_url: &str, tap: Option<&str>) -> Output {
    let mut args = vec!["audit", "--since", "10m", "--until", "0s"];
    if let Some(tap) = tap {
        args.extend(["--rabbitmq-stream", tap]);
    }
    crate::cli::run_with_manifest_and_env(
        &args,
        manifest,
        database_url,
        &[("OUTBOX_RABBITMQ_URL", common::Rig::load().amqp_url())],
    )
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn assert_exit(output: &Output, code: i32) {
    assert_eq!(
        output.status.code(),
        Some(code),
        "{}",
        common::describe_output(output)
    );
}

/// Rows marked published without being sent: what a relay that lost them would leave.
async fn forge_published(client: &tokio_postgres::Client, aggregate: &str, n: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = common::insert_row(client, "order", aggregate, &json!({"forged": i})).await;
        client
            .execute(
                "UPDATE public.outbox SET published_at = now() WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap();
        ids.push(id);
    }
    ids
}

/// A relay publishes 40 rows of 4 aggregates and the audit passes; returns the relay's
/// manifest, for the forgeries that follow.
async fn window(db: &common::TestDatabase, broker: &RelayBroker) -> serde_json::Value {
    window_audited(db, broker, audit).await
}

async fn window_audited(
    db: &common::TestDatabase,
    broker: &RelayBroker,
    audit: impl Fn(&serde_json::Value, &str) -> Output,
) -> serde_json::Value {
    common::create_outbox_table(&db.client, 4).await;
    for i in 0..40 {
        let aggregate = format!("agg-{}", i % 4);
        common::insert_row(&db.client, "order", &aggregate, &json!({"i": i})).await;
    }
    let yaml = common::relay_config_yaml(broker, &RelayOptions::default());
    let relay = RelayProcess::start(&yaml, &db.url, broker);
    common::wait_for_relays(
        "the relay publishing the window",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    drop(relay);
    let manifest = crate::cli::manifest_of(&yaml);
    let output = audit(&manifest, &db.url);
    assert_exit(&output, 0);
    let text = stdout(&output);
    assert!(
        text.contains("40 rows marked published in the window; 40 deliveries")
            && text.contains("ok    missing       0 of 40")
            && text.contains("ok    order"),
        "{text}"
    );
    manifest
}

/// The audit's verdict once row `missing` was marked published without being sent and
/// `reordered.1` was delivered before `reordered.0`, both of the same aggregate.
fn assert_caught(output: &Output, missing: i64, reordered: (i64, i64)) {
    assert_exit(output, 1);
    let text = stdout(output);
    assert!(
        text.contains("FAIL  missing       1 of 43")
            && text.contains(&format!("aggregate lost: {missing}")),
        "{text}"
    );
    assert!(
        text.contains("FAIL  order         1 rows")
            && text.contains(&format!(
                "aggregate swapped: {} after {}",
                reordered.0, reordered.1
            )),
        "{text}"
    );
    println!("{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_proves_a_kafka_window_and_names_what_is_lost_or_reordered() {
    let db = common::fresh_database().await;
    let topic = common::fresh_topic(4).await;
    let bootstrap = common::Rig::load().kafka_bootstrap().to_owned();
    let broker = RelayBroker::Kafka {
        bootstrap: bootstrap.clone(),
        topic: topic.clone(),
    };
    let manifest = window(&db, &broker).await;
    let lost = forge_published(&db.client, "lost", 1).await;
    let swapped = forge_published(&db.client, "swapped", 2).await;
    // The later one first, then the earlier: one partition, as an aggregate's records are.
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    for id in [swapped[1], swapped[0]] {
        let id_text = id.to_string();
        let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
            key: "id",
            value: Some(id_text.as_str()),
        });
        producer
            .send(
                rdkafka::producer::FutureRecord::to(&topic)
                    .key("swapped")
                    .partition(0)
                    .payload("{}")
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("producing: {e}"));
    }
    assert_caught(
        &audit(&manifest, &db.url),
        lost[0],
        (swapped[0], swapped[1]),
    );
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_proves_a_jetstream_window_and_names_what_is_lost_or_reordered() {
    let db = common::fresh_database().await;
    let stream = common::fresh_stream().await;
    let subject = format!("{}.events", stream.subject_prefix);
    let broker = RelayBroker::Nats {
        url: common::Rig::load().nats_url().to_owned(),
        subject: subject.clone(),
    };
    let manifest = window(&db, &broker).await;
    let lost = forge_published(&db.client, "lost", 1).await;
    let swapped = forge_published(&db.client, "swapped", 2).await;
    for id in [swapped[1], swapped[0]] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("id", id.to_string().as_str());
        stream
            .jetstream
            .publish_with_headers(subject.clone(), headers, "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    assert_caught(
        &audit(&manifest, &db.url),
        lost[0],
        (swapped[0], swapped[1]),
    );
    let _ = stream.jetstream.delete_stream(&stream.name).await;
    db.drop_database().await;
}

/// RabbitMQ: a queue gives each message to one consumer, so the audit reads a stream
/// queue bound to the relay's exchange as a tap, from the window's start, without
/// taking anything from it. Without a tap named it refuses, naming the exchange; named
/// the application's classic queue, it refuses to read it and takes nothing from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_reads_a_rabbitmq_stream_tap_and_names_what_is_lost_or_reordered() {
    use lapin::options::{BasicPublishOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};

    let db = common::fresh_database().await;
    let queue = common::fresh_queue().await;
    let exchange = common::fresh_exchange_for(&queue).await;
    let tap = format!("{}-audit-tap", queue.name);
    let mut stream = FieldTable::default();
    stream.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("stream".into()),
    );
    stream.insert("x-max-age".into(), AMQPValue::LongString("1h".into()));
    queue
        .channel
        .queue_declare(
            tap.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            stream,
        )
        .await
        .unwrap();
    queue
        .channel
        .queue_bind(
            tap.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let broker = RelayBroker::Amqp {
        url: common::Rig::load().amqp_url().to_owned(),
        exchange: exchange.clone(),
        routing_key: "orders".to_owned(),
    };
    let tap_name = tap.clone();
    let manifest = window_audited(&db, &broker, move |manifest, url| {
        audit_amqp(manifest, url, Some(&tap_name))
    })
    .await;

    // No tap named: refused, saying what to bind where.
    let refused = audit_amqp(&manifest, &db.url, None);
    assert_exit(&refused, 2);
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(
        why.contains("--rabbitmq-stream") && why.contains(&exchange),
        "{why}"
    );
    // The application's classic queue: refused, and not a message taken from it.
    let waiting = |name: String| {
        let channel = queue.channel.clone();
        async move {
            channel
                .queue_declare(
                    name.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap()
                .message_count()
        }
    };
    let before = waiting(queue.name.clone()).await;
    assert_eq!(before, 40);
    let classic = audit_amqp(&manifest, &db.url, Some(&queue.name));
    assert_exit(&classic, 2);
    assert!(
        String::from_utf8_lossy(&classic.stderr).contains("not a stream queue"),
        "{}",
        common::describe_output(&classic)
    );
    assert_eq!(waiting(queue.name.clone()).await, before);

    // A row lost, and a pair of one aggregate delivered in the wrong order.
    let lost = forge_published(&db.client, "lost", 1).await;
    let swapped = forge_published(&db.client, "swapped", 2).await;
    for id in [swapped[1], swapped[0]] {
        queue
            .channel
            .basic_publish(
                exchange.as_str().into(),
                "orders".into(),
                BasicPublishOptions::default(),
                b"{}",
                lapin::BasicProperties::default().with_message_id(id.to_string().into()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    assert_caught(
        &audit_amqp(&manifest, &db.url, Some(&tap)),
        lost[0],
        (swapped[0], swapped[1]),
    );
    db.drop_database().await;
}
