//! Rows the broker can never accept — a message bigger than the topic's
//! `max.message.bytes`, an aggregate type that makes an invalid Kafka topic — under
//! both failure policies: `block` stops only the row's partition after `maxAttempts`
//! (shown by `outbox_relay_partitions_blocked`) and keeps the row and its successors
//! in the table; `deadLetter` moves the row to the dead-letter table and the partition
//! goes on. Other partitions publish throughout, and nothing is lost.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{RelayBroker, RelayOptions, RelayProcess};

const PARTITIONS: i32 = 4;

/// The relay partition of `aggregate_id` (the expression of src/postgres).
async fn partition_of(client: &tokio_postgres::Client, aggregate_id: &str) -> i64 {
    client
        .query_one(
            &format!(
                "SELECT ((hashtextextended(coalesce($1::text, ''), 0) & 9223372036854775807) % {PARTITIONS})"
            ),
            &[&aggregate_id],
        )
        .await
        .unwrap()
        .get(0)
}

/// The first `prefix-<n>` whose partition is not in `taken`.
async fn aggregate_outside(
    client: &tokio_postgres::Client,
    prefix: &str,
    taken: &BTreeSet<i64>,
) -> (String, i64) {
    for n in 0.. {
        let id = format!("{prefix}-{n}");
        let p = partition_of(client, &id).await;
        if !taken.contains(&p) {
            return (id, p);
        }
    }
    unreachable!()
}

async fn is_published(client: &tokio_postgres::Client, id: i64) -> Option<bool> {
    client
        .query_opt(
            "SELECT published_at IS NOT NULL FROM public.outbox WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// The rows of one scenario.
struct Rows {
    /// Too big for the `Big` topic.
    oversized: i64,
    /// Aggregate type `Bad Type`: not a Kafka topic name.
    bad_topic: i64,
    /// Later rows of the two bad rows' aggregates.
    followers: Vec<i64>,
    /// Rows of aggregates in the other partitions.
    good: Vec<i64>,
    /// Topic the good rows and followers go to.
    order_topic: String,
}

/// Topics `<prefix>.Order` and `<prefix>.Big` (max.message.bytes 1024), the outbox
/// table, two bad rows in two partitions, a follower each, and good rows elsewhere.
async fn setup(db: &common::TestDatabase) -> (RelayBroker, Rows) {
    let rig = common::Rig::load();
    let prefix = format!("test-{}", common::unique_suffix());
    let order_topic = format!("{prefix}.Order");
    common::create_topic(rig.kafka_bootstrap(), &order_topic, 2, &[]).await;
    common::create_topic(
        rig.kafka_bootstrap(),
        &format!("{prefix}.Big"),
        1,
        &[("max.message.bytes", "1024")],
    )
    .await;
    common::create_outbox_table(&db.client, PARTITIONS).await;
    let c = &db.client;
    let (big_agg, p1) = aggregate_outside(c, "big", &BTreeSet::new()).await;
    let (bad_agg, p2) = aggregate_outside(c, "badname", &[p1].into()).await;
    let bad_partitions: BTreeSet<i64> = [p1, p2].into();
    let huge = "x".repeat(4096);
    let oversized = common::insert_row(
        c,
        "Big",
        &big_agg,
        &serde_json::json!({"aggregate": big_agg, "pad": huge}),
    )
    .await;
    let bad_topic = common::insert_row(
        c,
        "Bad Type",
        &bad_agg,
        &serde_json::json!({"aggregate": bad_agg}),
    )
    .await;
    let mut followers = Vec::new();
    for agg in [&big_agg, &bad_agg] {
        followers.push(
            common::insert_row(c, "Order", agg, &serde_json::json!({"aggregate": agg})).await,
        );
    }
    let mut good = Vec::new();
    let mut good_aggregates = Vec::new();
    for n in 0..30 {
        let (agg, _) = aggregate_outside(c, &format!("good{n}"), &bad_partitions).await;
        good_aggregates.push(agg);
    }
    for (i, agg) in good_aggregates.iter().enumerate() {
        let payload = serde_json::json!({"aggregate": agg, "i": i});
        good.push(common::insert_row(c, "Order", agg, &payload).await);
    }
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: format!("{prefix}.{{aggregateType}}"),
    };
    (
        broker,
        Rows {
            oversized,
            bad_topic,
            followers,
            good,
            order_topic,
        },
    )
}

fn options(on_exhausted: &'static str) -> RelayOptions {
    RelayOptions {
        partitions: PARTITIONS,
        max_attempts: 3,
        on_exhausted,
        ..RelayOptions::default()
    }
}

#[tokio::test]
async fn exhausted_rows_block_only_their_partition_and_stay_in_the_table() {
    let db = common::fresh_database().await;
    let (broker, rows) = setup(&db).await;
    let relay = RelayProcess::start(
        &common::relay_config_yaml(&broker, &options("block")),
        &db.url,
        &broker,
    );
    let client = &db.client;
    common::wait_for_relays(
        "two partitions blocked and every good row published",
        Duration::from_secs(60),
        &[&relay],
        || async {
            let mut all_good = true;
            for id in &rows.good {
                all_good &= is_published(client, *id).await == Some(true);
            }
            all_good && relay.metric("outbox_relay_partitions_blocked").await == Some(2.0)
        },
    )
    .await;
    for id in [rows.oversized, rows.bad_topic]
        .iter()
        .chain(&rows.followers)
    {
        assert_eq!(
            is_published(client, *id).await,
            Some(false),
            "row {id} must stay unpublished behind the blocked row"
        );
    }
    let text = relay.metrics().await.unwrap_or_default();
    assert!(
        text.lines()
            .any(|l| l.starts_with("outbox_relay_publish_errors_total{")
                && l.contains("kind=\"row\"")),
        "{text}"
    );
    // Each bad row is named in the log line that blocks its partition.
    let log = relay.log();
    for id in [rows.oversized, rows.bad_topic] {
        assert!(
            log.lines()
                .any(|l| l.contains("its partition is blocked")
                    && l.contains(&format!("\"row\":{id},"))),
            "no blocking line for row {id}:\n{log}"
        );
    }
}

#[tokio::test]
async fn exhausted_rows_are_dead_lettered_and_their_partition_goes_on() {
    let db = common::fresh_database().await;
    let (broker, rows) = setup(&db).await;
    let relay = RelayProcess::start(
        &common::relay_config_yaml(&broker, &options("deadLetter")),
        &db.url,
        &broker,
    );
    let client = &db.client;
    common::wait_for_relays(
        "the outbox drained (bad rows dead-lettered, the rest published)",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(client).await == 0 },
    )
    .await;
    let dead: Vec<(i64, String)> = client
        .query(
            "SELECT id, dead_letter_reason FROM public.outbox_dead_letter ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let dead_ids: Vec<i64> = dead.iter().map(|(id, _)| *id).collect();
    assert_eq!(dead_ids, vec![rows.oversized, rows.bad_topic], "{dead:?}");
    assert!(dead.iter().all(|(_, why)| !why.is_empty()), "{dead:?}");
    for id in [rows.oversized, rows.bad_topic] {
        assert_eq!(
            is_published(client, id).await,
            None,
            "row {id} still in outbox"
        );
    }
    assert_eq!(
        relay.metric("outbox_relay_dead_lettered_total").await,
        Some(2.0)
    );
    assert_eq!(
        relay.metric("outbox_relay_partitions_blocked").await,
        Some(0.0)
    );
    // Every other row reached the broker: the followers after their dead-lettered
    // predecessors, and the good rows.
    let topic = rows.order_topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let expected: BTreeSet<i64> = rows.good.iter().chain(&rows.followers).copied().collect();
    let report = common::check_delivery(&received, &expected, &BTreeSet::new());
    println!("dead-letter delivery: {report:?}");
    assert!(report.missing.is_empty(), "lost: {:?}", report.missing);
    assert!(report.orphans.is_empty(), "orphans: {:?}", report.orphans);
}
