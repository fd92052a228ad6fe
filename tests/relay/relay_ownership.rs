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

/// A fresh database with an outbox table of `options.partitions`, a fresh topic of 3
/// partitions, the Kafka broker for it and a relay config of `options` for both.
async fn kafka_setup(
    options: &RelayOptions,
) -> (common::TestDatabase, String, RelayBroker, String) {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, options.partitions).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let yaml = common::relay_config_yaml(&broker, options);
    (db, topic, broker, yaml)
}

/// Reads `topic` and checks it against `committed`: nothing lost, nothing that was not
/// committed, each aggregate in order. The report, for the figures.
async fn assert_delivered(topic: String, committed: &BTreeSet<i64>) -> common::DeliveryReport {
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let report = common::check_delivery(&received, committed, &BTreeSet::new());
    report.assert_complete();
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_shared_evenly_and_taken_over_after_sigkill() {
    // Two workers each: four sessions of two partitions, a process's figure four.
    let options = RelayOptions {
        partitions: 8,
        workers: 2,
        ..RelayOptions::default()
    };
    let (db, topic, broker, yaml) = kafka_setup(&options).await;
    let mut committed: BTreeSet<i64> = insert_wave(&db, "before", 100).await.into_iter().collect();
    let mut a = RelayProcess::start(&yaml, &db.url, &broker);
    let b = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_for_relays(
        "each relay to own 4 of 8 partitions, 2 in each worker's session",
        Duration::from_secs(30),
        &[&a, &b],
        || async {
            a.metric("outbox_relay_partitions_owned").await == Some(4.0)
                && b.metric("outbox_relay_partitions_owned").await == Some(4.0)
                && partitions_per_session(&db).await == vec![2, 2, 2, 2]
        },
    )
    .await;

    a.kill();
    let killed_at = Instant::now();
    committed.extend(insert_wave(&db, "after", 100).await);
    common::wait_for_relays(
        "the survivor to own all 8 partitions, 4 in each worker's session",
        Duration::from_secs(15),
        &[&b],
        || async {
            b.metric("outbox_relay_partitions_owned").await == Some(8.0)
                && partitions_per_session(&db).await == vec![4, 4]
        },
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
    let report = assert_delivered(topic, &committed).await;
    println!(
        "takeover: all partitions owned {takeover:?} after SIGKILL; {} rows, {} messages, {} duplicates",
        committed.len(),
        report.received,
        report.duplicates
    );
}

/// Changing `ordering.partitions` runs old and new relays side by side for a while (a
/// rolling update). They would own different partition sets over the same rows and
/// publish one aggregate's events concurrently, out of order. Now the relays of the
/// partition count that ran first publish, and the others wait until they are gone.
/// Before, the second relay published at once (its partitions 4..7 were free).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_with_another_partition_count_wait_for_the_old_ones() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let yaml_for = |partitions: i32| {
        common::relay_config_yaml(
            &broker,
            &RelayOptions {
                partitions,
                ..RelayOptions::default()
            },
        )
    };
    let mut old = RelayProcess::start(&yaml_for(4), &db.url, &broker);
    common::wait_for_relays(
        "the old relay to own its partitions",
        Duration::from_secs(30),
        &[&old],
        || async { old.metric("outbox_relay_partitions_owned").await == Some(4.0) },
    )
    .await;
    let new = RelayProcess::start(&yaml_for(8), &db.url, &broker);
    let ready_url = format!("http://{}/readyz", new.http_addr().await);
    common::wait_for_relays(
        "the new relay to connect",
        Duration::from_secs(30),
        &[&new],
        || async {
            reqwest::get(&ready_url)
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await;
    // A rebalance (every second) has run since.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut committed: BTreeSet<i64> = insert_wave(&db, "side-by-side", 200)
        .await
        .into_iter()
        .collect();
    common::wait_for_relays(
        "the old relay to publish every row",
        Duration::from_secs(30),
        &[&old, &new],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    let new_published = new.metric("outbox_relay_published_total").await;
    println!("while both ran: the new relay published {new_published:?} rows");
    assert_eq!(
        new_published,
        Some(0.0),
        "the relay with 8 partitions published while the one with 4 still ran"
    );
    assert_eq!(
        old.metric("outbox_relay_partitions_owned").await,
        Some(4.0),
        "the old relay gave partitions to the waiting one"
    );
    assert!(
        new.log().contains("another ordering.partitions still run"),
        "the waiting relay does not say why:\n{}",
        new.log_tail(20)
    );
    // The old one goes: the new one takes over.
    let status = old.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", old.log_tail(20));
    committed.extend(insert_wave(&db, "after", 100).await);
    common::wait_for_relays(
        "the new relay to publish once the old one is gone",
        Duration::from_secs(30),
        &[&new],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    assert!(new.metric("outbox_relay_published_total").await > Some(0.0));
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let report = common::check_delivery(&received, &committed, &BTreeSet::new());
    println!("partition count change: {report:?}");
    assert!(report.missing.is_empty(), "lost {:?}", report.missing);
    assert!(
        report.order_violations.is_empty(),
        "{:?}",
        report.order_violations
    );
}

/// Partition-lock holders in the test database: per session, how many partitions (keys
/// below the member range) it holds, smallest first.
async fn partitions_per_session(db: &common::TestDatabase) -> Vec<i64> {
    db.client
        .query(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND objsubid = 2 AND objid::int8 < 1024 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             GROUP BY pid ORDER BY 1",
            &[],
        )
        .await
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default()
}

/// A relay process's workers (`mode.polling.workers`) each run batches on a session of
/// their own that owns a share of the partitions, as replicas do: one process with
/// three workers over six partitions holds them in three sessions of two, reports all
/// six as its own, publishes every row once in each aggregate's order, and releases
/// every lock when it stops. With `workers: 1` (the single loop of earlier releases)
/// all six sit in one session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relays_workers_split_its_partitions_between_their_sessions() {
    let options = RelayOptions {
        partitions: 6,
        workers: 3,
        batch_size: 20,
        ..RelayOptions::default()
    };
    let (db, topic, broker, yaml) = kafka_setup(&options).await;
    let mut committed: BTreeSet<i64> = insert_wave(&db, "before", 300).await.into_iter().collect();
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_for_relays(
        "the relay's three workers to own two partitions each",
        Duration::from_secs(30),
        &[&relay],
        || async {
            relay.metric("outbox_relay_partitions_owned").await == Some(6.0)
                && partitions_per_session(&db).await == vec![2, 2, 2]
        },
    )
    .await;
    // Rows written while every worker publishes.
    committed.extend(insert_wave(&db, "during", 300).await);
    common::wait_for_relays(
        "the workers to publish every row",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    assert_eq!(
        relay.metric("outbox_relay_published_total").await,
        Some(600.0),
        "{}",
        relay.log_tail(20)
    );
    let status = relay.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", relay.log_tail(20));
    assert_eq!(
        partitions_per_session(&db).await,
        Vec::<i64>::new(),
        "partition locks left after the relay stopped"
    );
    let report = assert_delivered(topic, &committed).await;
    println!("three workers: {report:?}");
    assert_eq!(report.duplicates, 0, "a row published twice");

    // One worker: the single loop, all six partitions in one session.
    let single = common::relay_config_yaml(
        &broker,
        &RelayOptions {
            workers: 1,
            ..options
        },
    );
    let one = RelayProcess::start(&single, &db.url, &broker);
    common::wait_for_relays(
        "the single worker to own all six partitions",
        Duration::from_secs(30),
        &[&one],
        || async { partitions_per_session(&db).await == vec![6] },
    )
    .await;
}
