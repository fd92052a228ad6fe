//! Partition ownership across relay processes: two processes split the partitions
//! evenly; when one is SIGKILLed the other takes every partition over within seconds
//! and delivery goes on without loss.

use crate::common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{RelayBroker, RelayOptions, RelayProcess};

async fn insert_wave(db: &common::TestDatabase, wave: &str, rows: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    for i in 0..rows {
        let aggregate = format!("{wave}-{}", i % 25);
        let payload = serde_json::json!({"aggregate": aggregate, "i": i});
        ids.push(common::insert_row(&db.client, "Order", &aggregate, &payload).await);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_shared_evenly_and_taken_over_after_sigkill() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    let options = RelayOptions {
        partitions: 8,
        ..RelayOptions::default()
    };
    common::create_outbox_table(&db.client, options.partitions).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let yaml = common::relay_config_yaml(&broker, &options);
    let mut committed: BTreeSet<i64> = insert_wave(&db, "before", 100).await.into_iter().collect();
    let mut a = RelayProcess::start(&yaml, &db.url, &broker);
    let b = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_for_relays(
        "each relay to own 4 of 8 partitions",
        Duration::from_secs(30),
        &[&a, &b],
        || async {
            a.metric("outbox_relay_partitions_owned").await == Some(4.0)
                && b.metric("outbox_relay_partitions_owned").await == Some(4.0)
        },
    )
    .await;

    a.kill();
    let killed_at = Instant::now();
    committed.extend(insert_wave(&db, "after", 100).await);
    common::wait_for_relays(
        "the survivor to own all 8 partitions",
        Duration::from_secs(15),
        &[&b],
        || async { b.metric("outbox_relay_partitions_owned").await == Some(8.0) },
    )
    .await;
    let takeover = killed_at.elapsed();
    let client = &db.client;
    common::wait_for_relays(
        "the survivor to publish every row",
        Duration::from_secs(60),
        &[&b],
        || async { common::unpublished_rows(client).await == 0 },
    )
    .await;
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let report = common::check_delivery(&received, &committed, &BTreeSet::new());
    println!(
        "takeover: all partitions owned {takeover:?} after SIGKILL; {} rows, {} messages, {} duplicates",
        committed.len(),
        report.received,
        report.duplicates
    );
    assert!(report.missing.is_empty(), "lost: {:?}", report.missing);
    assert!(report.orphans.is_empty(), "orphans: {:?}", report.orphans);
    assert!(
        report.order_violations.is_empty(),
        "{:?}",
        report.order_violations
    );
}
