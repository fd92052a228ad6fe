//! Log tailing never skips rows and confirms past them: a partitioned outbox table is
//! streamed whether or not its publication publishes via the partition root, and a
//! publication altered under a running relay — the table dropped from it and added
//! again, a second later or at once — never loses the rows inserted in between: with
//! `deleteAfterPublish` they are published from the table before anything newer, in
//! per-aggregate order; keeping rows, the relay stops, confirms nothing and says so,
//! until the change is accepted.
//!
//! Before: the relay knew the table only by name, so a partition's rows (streamed under
//! the partition's name) were dropped and their commits confirmed; nothing watched the
//! publication, so rows inserted while the table was out of it were skipped for good;
//! and then a sample once a second, which a DROP and ADD in between never showed.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Received, RelayBroker, RelayProcess, SlotGuard};

/// `public.outbox` as tests/common makes it, but hash-partitioned by id over three
/// partitions whose columns are in another order than the parent's.
async fn create_partitioned_outbox(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "CREATE TABLE public.outbox (
                id bigserial,
                aggregatetype text NOT NULL,
                aggregateid text NOT NULL,
                type text NOT NULL,
                payload jsonb,
                traceparent text,
                created_at timestamptz NOT NULL DEFAULT now(),
                published_at timestamptz,
                PRIMARY KEY (id)) PARTITION BY HASH (id);
             CREATE TABLE public.outbox_p0 PARTITION OF public.outbox
                FOR VALUES WITH (MODULUS 3, REMAINDER 0);
             CREATE TABLE public.outbox_p1 PARTITION OF public.outbox
                FOR VALUES WITH (MODULUS 3, REMAINDER 1);
             CREATE TABLE public.outbox_p2 (
                published_at timestamptz, created_at timestamptz NOT NULL DEFAULT now(),
                traceparent text, payload jsonb, type text NOT NULL,
                aggregateid text NOT NULL, aggregatetype text NOT NULL,
                id bigint NOT NULL DEFAULT nextval('public.outbox_id_seq'));
             ALTER TABLE public.outbox ATTACH PARTITION public.outbox_p2
                FOR VALUES WITH (MODULUS 3, REMAINDER 2);",
        )
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: creating the partitioned table failed: {err}"));
}

/// Writes `transactions` transactions of 1–4 rows over ten aggregates; returns the
/// committed ids with their aggregate, in commit order.
async fn write(client: &mut tokio_postgres::Client, transactions: usize) -> Vec<(i64, String)> {
    let mut written = Vec::new();
    for t in 0..transactions {
        let tx = client
            .transaction()
            .await
            .unwrap_or_else(|err| panic!("BEGIN: {err}"));
        for r in 0..=(t % 4) {
            let aggregate = format!("agg-{}", (t + r) % 10);
            let payload = serde_json::json!({"aggregate": aggregate, "t": t, "r": r});
            let id = common::insert_row(&tx, "order", &aggregate, &payload).await;
            written.push((id, aggregate));
        }
        tx.commit()
            .await
            .unwrap_or_else(|err| panic!("COMMIT: {err}"));
    }
    written
}

/// Every written id arrived, and each aggregate's ids arrived in commit order (first
/// deliveries).
fn assert_delivered(received: &[Received], written: &[(i64, String)]) {
    let mut first: HashMap<i64, usize> = HashMap::new();
    for (i, m) in received.iter().enumerate() {
        first.entry(m.id).or_insert(i);
    }
    let missing: Vec<i64> = written
        .iter()
        .map(|(id, _)| *id)
        .filter(|id| !first.contains_key(id))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} rows never arrived, first {:?}",
        missing.len(),
        written.len(),
        &missing[..missing.len().min(10)]
    );
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (id, aggregate) in written {
        let at = first[id];
        if let Some(before) = last.insert(aggregate.as_str(), at) {
            assert!(
                before < at,
                "row {id} of {aggregate} arrived before an earlier row"
            );
        }
    }
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client
        .query_one(sql, &[])
        .await
        .map(|r| r.get(0))
        .unwrap_or_else(|err| panic!("{sql}: {err}"))
}

async fn wait_table_empty(client: &tokio_postgres::Client, relay: &RelayProcess) {
    common::wait_for_relays(
        "every row published and deleted",
        Duration::from_secs(60),
        &[relay],
        || async { count(client, "SELECT count(*) FROM public.outbox").await == 0 },
    )
    .await;
}

async fn partitioned_scenario(via_root: bool) {
    let rig = common::Rig::load();
    let mut db = common::fresh_database().await;
    create_partitioned_outbox(&db.client).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let guard = SlotGuard::new(rig.pg_url(), "part");
    if via_root {
        // As the operator creates them.
        common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    } else {
        // By hand, as a DBA might have: partitions stream under their own names.
        // (Two statements: a slot cannot be created in a transaction that wrote.)
        for sql in [
            format!(
                "CREATE PUBLICATION {} FOR TABLE public.outbox WITH (publish = 'insert')",
                guard.slot
            ),
            format!(
                "SELECT pg_create_logical_replication_slot('{}', 'pgoutput')",
                guard.slot
            ),
        ] {
            db.client
                .batch_execute(&sql)
                .await
                .unwrap_or_else(|err| panic!("{sql}: {err:?}"));
        }
    }
    let relay = RelayProcess::start(
        &common::log_tailing_yaml(&broker, &guard.slot, true),
        &db.url,
        &broker,
    );
    common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    let written = write(&mut db.client, 120).await;
    let mut per_partition = Vec::new();
    for p in ["outbox_p0", "outbox_p1", "outbox_p2"] {
        per_partition.push(count(&db.client, &format!("SELECT count(*) FROM public.{p}")).await);
    }
    wait_table_empty(&db.client, &relay).await;
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    println!(
        "partitioned table (publish_via_partition_root {via_root}): {} rows written \
         (per partition before publishing: {per_partition:?}), {} messages received",
        written.len(),
        received.len()
    );
    assert_delivered(&received, &written);
    drop(relay);
    drop(guard);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_table_is_streamed_via_its_root() {
    partitioned_scenario(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_table_is_streamed_from_its_partitions() {
    partitioned_scenario(false).await;
}

/// A WAL position (`sql` yields a `pg_lsn`) as bytes from 0/0.
async fn wal_lsn(client: &tokio_postgres::Client, sql: &str) -> i64 {
    count(client, &format!("SELECT (({sql}) - '0/0'::pg_lsn)::bigint")).await
}

/// The relay's current `confirmed_flush_lsn` of `slot`, as bytes from 0/0.
fn confirmed_sql(slot: &str) -> String {
    format!("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'")
}

/// A relay tailing `public.outbox` to a fresh topic, its slot and publication made.
struct Tailing {
    db: common::TestDatabase,
    topic: String,
    slot: String,
    relay: RelayProcess,
    yaml: String,
    broker: RelayBroker,
    /// What published the table when the slot was made, as the operator records it.
    baseline: String,
    _guard: SlotGuard,
}

impl Tailing {
    /// A relay on the same config, with the operator's coverage baseline beside it.
    fn start_relay(&self, yaml: &str) -> RelayProcess {
        RelayProcess::start_with_files(
            yaml,
            &self.db.url,
            &self.broker,
            &[],
            &[("coverage-baseline", &self.baseline)],
        )
    }
}

async fn tailing(name: &str, delete_after_publish: bool) -> Tailing {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let guard = SlotGuard::new(rig.pg_url(), name);
    let slot = guard.slot.clone();
    common::create_replication(&db.client, &slot, &slot).await;
    let yaml = common::log_tailing_yaml(&broker, &slot, delete_after_publish);
    let baseline = common::publication_identity(&db.client, &slot).await;
    let relay = RelayProcess::start_with_files(
        &yaml,
        &db.url,
        &broker,
        &[],
        &[("coverage-baseline", &baseline)],
    );
    common::wait_slot_active(&db.client, &slot, &relay).await;
    Tailing {
        db,
        topic,
        slot,
        relay,
        yaml,
        broker,
        baseline,
        _guard: guard,
    }
}

async fn alter(client: &tokio_postgres::Client, slot: &str, change: &str) {
    client
        .batch_execute(&format!(
            "ALTER PUBLICATION {slot} {change} TABLE public.outbox"
        ))
        .await
        .unwrap_or_else(|err| panic!("ALTER PUBLICATION {change}: {err}"));
}

/// Every row arrived, in per-aggregate order, and every redelivery in a replayed window.
fn check_all(received: &[Received], written: &[(i64, String)]) -> common::DeliveryReport {
    assert_delivered(received, written);
    let committed = written.iter().map(|(id, _)| *id).collect();
    let report = common::check_delivery(received, &committed, &Default::default());
    assert!(
        report.missing.is_empty() && report.order_violations.is_empty(),
        "{report:?}"
    );
    assert!(
        report.stale_redeliveries.is_empty(),
        "{:?}",
        report.stale_redeliveries
    );
    report
}

/// The table dropped from the publication and added again `gap` later, with rows
/// written in between and after; deleteAfterPublish.
async fn dropped_and_added(name: &str, gap: Duration) {
    let mut t = tailing(name, true).await;
    let mut written = write(&mut t.db.client, 30).await;
    wait_table_empty(&t.db.client, &t.relay).await;

    alter(&t.db.client, &t.slot, "DROP").await;
    let dropped_at = wal_lsn(&t.db.client, "pg_current_wal_lsn()").await;
    let skipped = write(&mut t.db.client, 10).await;
    tokio::time::sleep(gap).await;
    if gap >= Duration::from_secs(3) {
        // Out of the publication for seconds: heartbeats go on, none of it confirmed.
        let confirmed = wal_lsn(&t.db.client, &confirmed_sql(&t.slot)).await;
        assert!(
            confirmed < dropped_at,
            "the slot was confirmed ({confirmed}) past the point the table left the publication ({dropped_at})"
        );
        let readyz = reqwest::Client::new()
            .get(format!("http://{}/readyz", t.relay.http_addr().await))
            .send()
            .await
            .unwrap_or_else(|err| panic!("GET /readyz: {err}"));
        assert_eq!(readyz.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            readyz
                .text()
                .await
                .unwrap_or_default()
                .contains("no longer publishes")
        );
    }
    alter(&t.db.client, &t.slot, "ADD").await;
    let later = write(&mut t.db.client, 10).await;
    wait_table_empty(&t.db.client, &t.relay).await;
    let target = wal_lsn(&t.db.client, "pg_current_wal_lsn()").await;
    common::wait_for_relays(
        "confirmation past the re-added table's rows",
        Duration::from_secs(60),
        &[&t.relay],
        || async { wal_lsn(&t.db.client, &confirmed_sql(&t.slot)).await >= target },
    )
    .await;
    assert!(
        t.relay
            .log()
            .contains("publishing every row left in the table first"),
        "the relay did not say it back-filled:\n{}",
        t.relay.log_tail(20)
    );
    written.extend(skipped.iter().cloned());
    written.extend(later);
    let topic = t.topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let report = check_all(&received, &written);
    println!(
        "table out of the publication for {gap:?}: {} rows ({} written meanwhile), 0 lost, 0 reordered, {} duplicates",
        written.len(),
        skipped.len(),
        report.duplicates
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_dropped_from_the_publication_and_added_at_once_loses_nothing() {
    dropped_and_added("dropadd", Duration::from_millis(100)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_out_of_the_publication_for_seconds_loses_nothing_and_confirms_nothing_meanwhile() {
    dropped_and_added("alter", Duration::from_secs(5)).await;
}

/// The change happens while no relay runs (a rollout, a crash loop): the relay that
/// starts compares with the operator's baseline, sees it, and publishes the rows left
/// in the table first. Without the baseline its first look would take the changed
/// publication as given and the rows of the window would never arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_change_while_no_relay_runs_is_back_filled_when_one_starts() {
    let mut t = tailing("downgap", true).await;
    let mut written = write(&mut t.db.client, 20).await;
    wait_table_empty(&t.db.client, &t.relay).await;
    t.relay.terminate(Duration::from_secs(30));

    alter(&t.db.client, &t.slot, "DROP").await;
    let skipped = write(&mut t.db.client, 10).await;
    alter(&t.db.client, &t.slot, "ADD").await;
    let later = write(&mut t.db.client, 10).await;
    assert_ne!(
        common::publication_identity(&t.db.client, &t.slot).await,
        t.baseline
    );

    let relay = t.start_relay(&t.yaml);
    wait_table_empty(&t.db.client, &relay).await;
    written.extend(skipped);
    written.extend(later);
    let topic = t.topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    check_all(&received, &written);
    // Counted once the back-fill is done, which may be a moment after its last delete
    // emptied the table.
    common::wait_for_relays(
        "the back-fill to count the rows of the window",
        Duration::from_secs(30),
        &[&relay],
        || async {
            relay
                .metric("outbox_relay_publication_gap_back_filled_total")
                .await
                .is_some_and(|n| n >= 10.0)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeping_rows_a_publication_change_stops_the_relay_until_it_is_accepted() {
    let mut t = tailing("keepgap", false).await;
    let mut written = write(&mut t.db.client, 20).await;
    let topic = t.topic.clone();
    let first: Vec<i64> = written.iter().map(|(id, _)| *id).collect();
    common::wait_for_relays(
        "the first rows on the topic",
        Duration::from_secs(60),
        &[&t.relay],
        || {
            let topic = topic.clone();
            let first = first.clone();
            async move {
                let got = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                    .await
                    .unwrap_or_default();
                first.iter().all(|id| got.iter().any(|m| m.id == *id))
            }
        },
    )
    .await;

    alter(&t.db.client, &t.slot, "DROP").await;
    let skipped = write(&mut t.db.client, 10).await;
    alter(&t.db.client, &t.slot, "ADD").await;
    let later = write(&mut t.db.client, 10).await;
    let held_at = wal_lsn(&t.db.client, "pg_current_wal_lsn()").await;
    // The relay decides when the first later row reaches its gate: it says so, and
    // from then on nothing is published or confirmed.
    common::wait_for_relays(
        "the relay to hold at the publication change",
        Duration::from_secs(60),
        &[&t.relay],
        || async {
            t.relay
                .log()
                .contains("Nothing more is published or confirmed")
        },
    )
    .await;
    // Not ready, saying why. (Right after the ADD, readiness may still say the table is
    // not published, until the coverage sampler looks again.)
    let addr = t.relay.http_addr().await;
    common::wait_for_relays(
        "/readyz to answer 503 and say the relay holds",
        Duration::from_secs(30),
        &[&t.relay],
        || async {
            let Ok(readyz) = reqwest::Client::new()
                .get(format!("http://{addr}/readyz"))
                .send()
                .await
            else {
                return false;
            };
            readyz.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE
                && readyz.text().await.unwrap_or_default().contains("holding")
        },
    )
    .await;
    let topic = t.topic.clone();
    let got = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let ids: std::collections::HashSet<i64> = got.iter().map(|m| m.id).collect();
    assert!(
        later.iter().all(|(id, _)| !ids.contains(id)),
        "rows written after the change were published past the gap"
    );
    let confirmed = wal_lsn(&t.db.client, &confirmed_sql(&t.slot)).await;
    assert!(confirmed < held_at, "confirmed past the hold");

    // Accepted (the identity the relay logged, in its settings): later rows go on; the
    // rows of the window are the ones that never arrive.
    let identity = t
        .relay
        .log()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v["fields"]["identity"].as_str().map(str::to_owned))
        .expect("the hold names the change's identity");
    // A restart does not release the hold: the new process compares with the
    // operator's baseline, not with what it first sees.
    t.relay.terminate(Duration::from_secs(30));
    let restarted = t.start_relay(&t.yaml);
    common::wait_for_relays(
        "the restarted relay to hold at the same change",
        Duration::from_secs(60),
        &[&restarted],
        || async {
            restarted
                .log()
                .contains("Nothing more is published or confirmed")
        },
    )
    .await;
    let topic = t.topic.clone();
    let got = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    assert!(
        later.iter().all(|(id, _)| !got.iter().any(|m| m.id == *id)),
        "a restarted relay published past the gap"
    );
    drop(restarted);
    let yaml = format!(
        "{}\ncoverageAccepted: [\"{identity}\"]\n",
        t.yaml.trim_end()
    );
    let relay = t.start_relay(&yaml);
    let later_ids: Vec<i64> = later.iter().map(|(id, _)| *id).collect();
    let topic = t.topic.clone();
    common::wait_for_relays(
        "the rows written after the change on the topic",
        Duration::from_secs(60),
        &[&relay],
        || {
            let topic = topic.clone();
            let later_ids = later_ids.clone();
            async move {
                let got = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                    .await
                    .unwrap_or_default();
                later_ids.iter().all(|id| got.iter().any(|m| m.id == *id))
            }
        },
    )
    .await;
    let topic = t.topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let skipped_ids: std::collections::HashSet<i64> = skipped.iter().map(|(id, _)| *id).collect();
    assert!(
        received.iter().all(|m| !skipped_ids.contains(&m.id)),
        "a row of the window arrived: the window is not what the relay reported"
    );
    written.extend(later);
    check_all(&received, &written);
    println!(
        "keeping rows, table dropped and added at once: held until accepted; {} rows of the window not published, {} others all arrived in order",
        skipped.len(),
        written.len()
    );
    drop(relay);
}
