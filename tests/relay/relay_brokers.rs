//! The relay's behaviour suite, run against each real broker: committed rows arrive
//! once with id, key and headers, in per-aggregate order; rolled-back rows never do;
//! SIGTERM stops the relay cleanly with exit 0.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{RelayBroker, RelayOptions, RelayProcess};

/// Writes rows for several aggregates plus a rolled-back transaction, runs the relay
/// until the table is drained, stops it with SIGTERM, and returns (committed, aborted).
async fn publish_through_relay(
    db: &mut common::TestDatabase,
    broker: &RelayBroker,
) -> (BTreeSet<i64>, BTreeSet<i64>) {
    common::create_outbox_table(&db.client, 4).await;
    let mut committed = BTreeSet::new();
    for i in 0..40 {
        let aggregate = format!("agg-{}", i % 6);
        let payload = serde_json::json!({"aggregate": aggregate, "seq": i});
        committed.insert(common::insert_row(&db.client, "Order", &aggregate, &payload).await);
    }
    let mut aborted = BTreeSet::new();
    let tx = db.client.transaction().await.unwrap();
    for _ in 0..2 {
        let payload = serde_json::json!({"aggregate": "agg-aborted"});
        aborted.insert(common::insert_row(&tx, "Order", "agg-aborted", &payload).await);
    }
    tx.rollback().await.unwrap();

    let yaml = common::relay_config_yaml(broker, &RelayOptions::default());
    let mut relay = RelayProcess::start(&yaml, &db.url, broker);
    let client = &db.client;
    common::wait_for_relays(
        "every row marked published",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(client).await == 0 },
    )
    .await;
    let status = relay.terminate(Duration::from_secs(20));
    assert!(
        status.success(),
        "relay exit {status}; log:\n{}",
        relay.log()
    );
    (committed, aborted)
}

fn assert_delivered(
    received: &[common::Received],
    committed: &BTreeSet<i64>,
    aborted: &BTreeSet<i64>,
) {
    let report = common::check_delivery(received, committed, aborted);
    println!("delivery: {report:?}");
    report.assert_complete();
    for message in received {
        assert_eq!(
            message.headers.get("type").map(String::as_str),
            Some("Happened")
        );
        assert_eq!(
            message.headers.get("aggregateType").map(String::as_str),
            Some("Order")
        );
        assert_eq!(
            message.headers.get("traceparent").map(String::as_str),
            Some("00-trace-01")
        );
        assert_eq!(common::aggregate_of(&message.payload), message.aggregate);
    }
}

#[tokio::test]
async fn kafka_relay_delivers_committed_rows_in_aggregate_order() {
    let rig = common::Rig::load();
    let mut db = common::fresh_database().await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let (committed, aborted) = publish_through_relay(&mut db, &broker).await;
    let received = common::consume_kafka(&topic);
    assert_delivered(&received, &committed, &aborted);
    for message in &received {
        assert_eq!(message.headers.get("id"), Some(&message.id.to_string()));
    }
    // An independent client sees the same: key, id header, payload.
    let output = common::run_tool(
        rig.kcat(),
        &[
            "-C",
            "-b",
            rig.kafka_bootstrap(),
            "-t",
            &topic,
            "-o",
            "beginning",
            "-e",
            "-q",
            "-f",
            "%k|%h|%s\n",
        ],
    );
    assert!(
        output.status.success(),
        "{}",
        common::describe_output(&output)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), received.len(), "{text}");
    for line in lines {
        let key = line.split('|').next().unwrap_or_default();
        assert!(key.starts_with("agg-"), "{line}");
        assert!(
            line.contains("id=") && line.contains("type=Happened"),
            "{line}"
        );
    }
}

#[tokio::test]
async fn nats_relay_delivers_committed_rows_in_aggregate_order() {
    let rig = common::Rig::load();
    let mut db = common::fresh_database().await;
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.{{aggregateType}}", stream.subject_prefix),
    };
    let (committed, aborted) = publish_through_relay(&mut db, &broker).await;
    let received = common::consume_nats(&stream).await;
    assert_delivered(&received, &committed, &aborted);
}

#[tokio::test]
async fn rabbitmq_relay_delivers_committed_rows_in_aggregate_order() {
    let rig = common::Rig::load();
    let mut db = common::fresh_database().await;
    let queue = common::fresh_queue().await;
    let exchange = common::fresh_exchange_for(&queue).await;
    let broker = RelayBroker::Amqp {
        url: rig.amqp_url().to_owned(),
        exchange,
        routing_key: "outbox.{aggregateType}".to_owned(),
    };
    let (committed, aborted) = publish_through_relay(&mut db, &broker).await;
    let received = common::consume_amqp(&queue).await;
    assert_delivered(&received, &committed, &aborted);
}

/// Two relays (two databases, so the same row ids) feed one JetStream stream: every
/// event of both arrives. The `Nats-Msg-Id` is scoped by relay; with the bare row id
/// JetStream dropped the second relay's rows as duplicates of the first's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_sharing_a_stream_do_not_drop_each_others_events() {
    let rig = common::Rig::load();
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let mut relays = Vec::new();
    let mut dbs = Vec::new();
    for name in ["orders-a", "orders-b"] {
        let db = common::fresh_database().await;
        common::create_outbox_table(&db.client, 4).await;
        for i in 0..10 {
            let aggregate = format!("{name}-{}", i % 3);
            let payload = serde_json::json!({"aggregate": aggregate, "seq": i});
            common::insert_row(&db.client, "Order", &aggregate, &payload).await;
        }
        let yaml = common::relay_config_yaml(&broker, &RelayOptions::default()).replace(
            "relay: {namespace: test, name: relay}",
            &format!("relay: {{namespace: test, name: {name}}}"),
        );
        relays.push(RelayProcess::start(&yaml, &db.url, &broker));
        dbs.push(db);
    }
    for db in &dbs {
        let client = &db.client;
        common::wait_for_relays(
            "both relays to publish their rows",
            Duration::from_secs(60),
            &relays.iter().collect::<Vec<_>>(),
            || async { common::unpublished_rows(client).await == 0 },
        )
        .await;
    }
    let received = common::consume_nats(&stream).await;
    for name in ["orders-a", "orders-b"] {
        let ids: BTreeSet<i64> = received
            .iter()
            .filter(|r| r.aggregate.starts_with(name))
            .map(|r| r.id)
            .collect();
        assert_eq!(ids.len(), 10, "{name}: {ids:?} of 10 events arrived");
    }
    drop(relays);
    for db in dbs {
        db.drop_database().await;
    }
}
