//! `outbox-operator audit -f relay.yaml` against the rig's PostgreSQL, Kafka and NATS:
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
