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
    setup_with_slot(db, None).await
}

/// [`setup`], with a log-tailing slot (and publication) of that name created before the
/// rows are written.
async fn setup_with_slot(db: &common::TestDatabase, slot: Option<&str>) -> (RelayBroker, Rows) {
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
    if let Some(slot) = slot {
        common::create_replication(&db.client, slot, slot).await;
    }
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

/// The dead-letter table's rows: (id, reason), by id.
async fn dead_letters(client: &tokio_postgres::Client) -> Vec<(i64, String)> {
    client
        .query(
            "SELECT id, dead_letter_reason FROM public.outbox_dead_letter ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Every row of `rows` other than the two bad ones reached the Order topic: the
/// followers after their dead-lettered predecessors, and the good rows.
async fn assert_the_rest_delivered(what: &str, rows: &Rows) {
    let topic = rows.order_topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let expected: BTreeSet<i64> = rows.good.iter().chain(&rows.followers).copied().collect();
    let report = common::check_delivery(&received, &expected, &BTreeSet::new());
    println!("{what}: {report:?}");
    assert!(report.missing.is_empty(), "lost: {:?}", report.missing);
    assert!(report.orphans.is_empty(), "orphans: {:?}", report.orphans);
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
    // Each bad row is named in the log line that blocks its partition (its id as text,
    // as every id is logged whatever the id column's type).
    let log = relay.log();
    for id in [rows.oversized, rows.bad_topic] {
        assert!(
            log.lines().any(|l| l.contains("its partition is blocked")
                && l.contains(&format!("\"row\":\"{id}\","))),
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
    let dead = dead_letters(client).await;
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
    assert_the_rest_delivered("dead-letter delivery", &rows).await;
}

/// Log tailing dead-letters too: a row the broker refuses moves to the dead-letter table
/// after `maxAttempts`, the rest of its aggregate and every other row are published,
/// and the stream confirms past it (the table drains, deleteAfterPublish). Before,
/// `deadLetter` was refused with log tailing and a refused row held its aggregate
/// forever.
#[tokio::test]
async fn log_tailing_dead_letters_refused_rows_and_streams_on() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    let guard = common::SlotGuard::new(rig.pg_url(), "dlq");
    let (broker, rows) = setup_with_slot(&db, Some(&guard.slot)).await;
    let yaml = common::with_spec_line(
        &common::relay_config_yaml(&broker, &options("deadLetter")),
        "mode",
        &common::log_tailing_mode(&guard.slot, true),
    );
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    let client = &db.client;
    common::wait_for_relays(
        "the outbox drained (bad rows dead-lettered, the rest published and deleted)",
        Duration::from_secs(90),
        &[&relay],
        || async {
            client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .is_ok_and(|r| r.get::<_, i64>(0) == 0)
        },
    )
    .await;
    let dead: Vec<i64> = dead_letters(client)
        .await
        .iter()
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(dead, vec![rows.oversized, rows.bad_topic]);
    assert_eq!(
        relay.metric("outbox_relay_dead_lettered_total").await,
        Some(2.0)
    );
    assert_the_rest_delivered("log tailing dead-letter delivery", &rows).await;
    drop(relay);
    drop(guard);
}

/// Under `onExhausted: block` a refused row holds the log-tailing stream once its
/// attempts are spent: the relay says so in its readiness (the operator shows it as
/// `Ready=False`), with the row and the broker's reason, instead of looking healthy
/// while the slot retains WAL.
#[tokio::test]
async fn log_tailing_blocked_by_an_exhausted_row_is_not_ready_and_says_which() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    let guard = common::SlotGuard::new(rig.pg_url(), "blocked");
    let (broker, rows) = setup_with_slot(&db, Some(&guard.slot)).await;
    let yaml = common::with_spec_line(
        &common::relay_config_yaml(&broker, &options("block")),
        "mode",
        &common::log_tailing_mode(&guard.slot, true),
    );
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    let readyz = || async {
        let response = reqwest::Client::new()
            .get(format!("http://{}/readyz", relay.http_addr().await))
            .send()
            .await
            .ok()?;
        (response.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE).then_some(())?;
        response.text().await.ok()
    };
    let why = common::wait_for_some_or(
        "the relay not ready for the row it waits for",
        Duration::from_secs(90),
        || relay.log_tail(30),
        || async { readyz().await.filter(|t| t.contains("onExhausted: block")) },
    )
    .await;
    // Either refused row may spend its attempts first (their chains run side by side).
    assert!(
        [rows.oversized, rows.bad_topic]
            .iter()
            .any(|id| why.contains(&format!("row {id} was refused by the broker 3 times"))),
        "{why}"
    );
    // The refused rows and their aggregates' next ones wait in the table.
    for id in [
        rows.oversized,
        rows.bad_topic,
        rows.followers[0],
        rows.followers[1],
    ] {
        let left: i64 = db
            .client
            .query_one("SELECT count(*) FROM public.outbox WHERE id = $1", &[&id])
            .await
            .unwrap()
            .get(0);
        assert_eq!(left, 1, "row {id} left the table");
    }
    drop(relay);
    drop(guard);
}

/// A dead-letter table that refuses the row (here a CHECK no row passes; in life a
/// dropped table or a revoked privilege) blocks the row's partition with an error
/// counted as `kind="dead_letter"`, while rows written meanwhile in other partitions
/// are published exactly once. Before, the failed move rolled back the whole batch, so
/// every row the batch had just published was published again on each attempt.
#[tokio::test]
async fn a_failing_dead_letter_table_blocks_its_row_without_republishing_the_batch() {
    let db = common::fresh_database().await;
    let (broker, rows) = setup(&db).await;
    let c = &db.client;
    c.batch_execute(
        "CREATE TABLE public.outbox_dead_letter (LIKE public.outbox,
            dead_letter_reason text NOT NULL CHECK (dead_letter_reason = 'never'),
            dead_lettered_at timestamptz NOT NULL DEFAULT now())",
    )
    .await
    .unwrap();
    let relay = RelayProcess::start(
        &common::relay_config_yaml(&broker, &options("deadLetter")),
        &db.url,
        &broker,
    );
    // Rows keep arriving in the good partitions while the bad rows exhaust their
    // attempts, so batches that publish good rows also try the failing move.
    let (bad_partition_a, bad_partition_b) = (
        partition_of(c, &aggregate_of_row(c, rows.oversized).await).await,
        partition_of(c, &aggregate_of_row(c, rows.bad_topic).await).await,
    );
    let bad: BTreeSet<i64> = [bad_partition_a, bad_partition_b].into();
    let mut written = rows.good.clone();
    let mut n = 0;
    let until = std::time::Instant::now() + Duration::from_secs(8);
    while std::time::Instant::now() < until {
        let (agg, _) = aggregate_outside(c, &format!("late{n}"), &bad).await;
        written.push(
            common::insert_row(c, "Order", &agg, &serde_json::json!({"aggregate": agg})).await,
        );
        n += 1;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    common::wait_for_relays(
        "every good row published and the failing move counted",
        Duration::from_secs(60),
        &[&relay],
        || async {
            let mut all = true;
            for id in &written {
                all &= is_published(c, *id).await == Some(true);
            }
            let text = relay.metrics().await.unwrap_or_default();
            all && text.lines().any(|l| {
                l.starts_with("outbox_relay_publish_errors_total{")
                    && l.contains("kind=\"dead_letter\"")
            })
        },
    )
    .await;
    for id in [rows.oversized, rows.bad_topic] {
        assert_eq!(is_published(c, id).await, Some(false), "row {id} stays");
    }
    let topic = rows.order_topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let expected: BTreeSet<i64> = written.iter().copied().collect();
    let report = common::check_delivery(&received, &expected, &BTreeSet::new());
    println!(
        "failing dead-letter table: {} good rows written, {report:?}",
        written.len()
    );
    assert!(report.missing.is_empty(), "lost: {:?}", report.missing);
    assert_eq!(
        report.duplicates, 0,
        "rows published again after the failed move rolled their batch back"
    );
}

async fn aggregate_of_row(client: &tokio_postgres::Client, id: i64) -> String {
    client
        .query_one(
            "SELECT aggregateid FROM public.outbox WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0)
}

/// `outbox_relay_publish_errors_total` of one `kind` in a relay's metrics text.
fn publish_errors(metrics: &str, kind: &str) -> f64 {
    let label = format!("kind=\"{kind}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("outbox_relay_publish_errors_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Where a message goes is the broker's configuration, as a missing Kafka topic is: a
/// row whose destination does not exist waits as an outage, retried without counting
/// and never dead-lettered however often it fails, while the other rows are published;
/// once the destination exists it goes through. (Before, NATS's "no stream captures the
/// subject" and RabbitMQ's unroutable return counted as the row's fault, so a stream or
/// binding missing for one aggregate type dead-lettered every row of it.)
///
/// Phase one, shared by the brokers: one row of aggregate type `ghost` (no destination)
/// and 20 of type `captured`, published by a polling relay with `deadLetter` after 3
/// attempts; returns once the 20 are out and the ghost failed 7 times as an outage, with
/// the relay, the ghost's id and the ids expected in the end.
async fn missing_destination_waits(
    db: &common::TestDatabase,
    broker: &RelayBroker,
    captured: &str,
    ghost: &str,
    why: &str,
) -> (RelayProcess, i64, BTreeSet<i64>) {
    let c = &db.client;
    let ghost_agg = "ghost-1";
    let ghost_id = common::insert_row(
        c,
        ghost,
        ghost_agg,
        &serde_json::json!({"aggregate": ghost_agg}),
    )
    .await;
    let mut expected = BTreeSet::from([ghost_id]);
    for i in 0..20 {
        let agg = format!("agg-{i}");
        expected.insert(
            common::insert_row(c, captured, &agg, &serde_json::json!({"aggregate": agg})).await,
        );
    }
    let relay = RelayProcess::start(
        &common::relay_config_yaml(broker, &options("deadLetter")),
        &db.url,
        broker,
    );
    // More than twice as many failures as maxAttempts would have allowed the row.
    common::wait_for_relays(
        "the other rows published and the ghost row retried 7 times as an outage",
        Duration::from_secs(90),
        &[&relay],
        || async {
            common::unpublished_rows(c).await == 1
                && relay
                    .metrics()
                    .await
                    .is_some_and(|m| publish_errors(&m, "unavailable") >= 7.0)
        },
    )
    .await;
    let metrics = relay.metrics().await.unwrap_or_default();
    assert_eq!(
        publish_errors(&metrics, "row"),
        0.0,
        "counted as the row's fault"
    );
    let dead = dead_letters(c).await;
    assert!(dead.is_empty(), "dead-lettered: {dead:?}");
    assert!(
        relay.log().contains(why),
        "the relay never said {why:?}: {}",
        relay.log_tail(20)
    );
    (relay, ghost_id, expected)
}

/// Phase two: once the destination exists, the ghost row goes out and nothing was lost.
async fn then_it_goes_through(
    db: &common::TestDatabase,
    relay: &RelayProcess,
    expected: &BTreeSet<i64>,
    received: impl std::future::Future<Output = Vec<common::Received>>,
) {
    common::wait_for_relays(
        "the ghost row published once its destination exists",
        Duration::from_secs(60),
        &[relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    assert!(dead_letters(&db.client).await.is_empty());
    let report = common::check_delivery(&received.await, expected, &BTreeSet::new());
    assert!(report.missing.is_empty(), "lost: {:?}", report.missing);
}

#[tokio::test]
async fn a_nats_subject_no_stream_captures_waits_until_a_stream_does() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, PARTITIONS).await;
    let stream = common::fresh_stream().await;
    // The stream captures test.<suffix>.> ; the subject is test.<aggregate type>.events,
    // so aggregate type <suffix> is captured and ghost_<suffix> is not.
    let captured = stream
        .subject_prefix
        .strip_prefix("test.")
        .unwrap_or_else(|| panic!("stream prefix {}", stream.subject_prefix))
        .to_owned();
    let ghost = format!("ghost_{captured}");
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: "test.{aggregateType}.events".to_owned(),
    };
    let (relay, _, expected) = missing_destination_waits(
        &db,
        &broker,
        &captured,
        &ghost,
        "no JetStream stream captures subject",
    )
    .await;
    let mut config = stream
        .jetstream
        .get_stream(&stream.name)
        .await
        .unwrap_or_else(|err| panic!("NATS get_stream: {err}"))
        .info()
        .await
        .unwrap_or_else(|err| panic!("NATS stream info: {err}"))
        .config
        .clone();
    config.subjects.push(format!("test.{ghost}.events"));
    stream
        .jetstream
        .update_stream(config)
        .await
        .unwrap_or_else(|err| panic!("NATS update_stream: {err}"));
    then_it_goes_through(&db, &relay, &expected, common::consume_nats(&stream)).await;
    db.drop_database().await;
}

#[tokio::test]
async fn a_rabbitmq_routing_key_no_queue_is_bound_to_waits_until_one_is() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, PARTITIONS).await;
    let queue = common::fresh_queue().await;
    let captured = format!("kept_{}", common::unique_suffix());
    let ghost = format!("ghost_{}", common::unique_suffix());
    let exchange = format!("test-x-{}", common::unique_suffix());
    common::bind_queue(&queue, &exchange, &format!("outbox.{captured}")).await;
    let broker = RelayBroker::Amqp {
        url: rig.amqp_url().to_owned(),
        exchange: exchange.clone(),
        routing_key: "outbox.{aggregateType}".to_owned(),
    };
    let (relay, _, expected) =
        missing_destination_waits(&db, &broker, &captured, &ghost, "to no queue").await;
    common::bind_queue(&queue, &exchange, &format!("outbox.{ghost}")).await;
    then_it_goes_through(&db, &relay, &expected, common::consume_amqp(&queue)).await;
    db.drop_database().await;
}
