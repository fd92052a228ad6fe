//! Log tailing never skips rows and confirms past them: a partitioned outbox table is
//! streamed whether or not its publication publishes via the partition root, and a
//! publication altered under a running relay stops confirmation (and readiness) at the
//! point the table left it, instead of letting heartbeats confirm past rows the server
//! never streamed.
//!
//! Before: the relay knew the table only by name, so a partition's rows (streamed under
//! the partition's name) were dropped and their commits confirmed; and nothing watched
//! the publication, so rows inserted while the table was out of it were skipped for
//! good with the slot confirmed past them.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_altered_under_the_relay_stops_confirmation_where_the_table_left() {
    let rig = common::Rig::load();
    let mut db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let guard = SlotGuard::new(rig.pg_url(), "alter");
    let slot = guard.slot.clone();
    common::create_replication(&db.client, &slot, &slot).await;
    let relay = RelayProcess::start(
        &common::log_tailing_yaml(&broker, &slot, true),
        &db.url,
        &broker,
    );
    common::wait_slot_active(&db.client, &slot, &relay).await;
    let mut written = write(&mut db.client, 30).await;
    wait_table_empty(&db.client, &relay).await;

    // The table leaves the publication; rows written now are never streamed.
    db.client
        .batch_execute(&format!(
            "ALTER PUBLICATION {slot} DROP TABLE public.outbox"
        ))
        .await
        .unwrap_or_else(|err| panic!("ALTER PUBLICATION: {err}"));
    let dropped_at = wal_lsn(&db.client, "pg_current_wal_lsn()").await;
    let skipped = write(&mut db.client, 10).await;
    let confirmed_sql =
        format!("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'");
    // Heartbeats (every second) and the deletes' own WAL go on; for as long as this
    // pause, none of it may be confirmed past the change.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let confirmed = wal_lsn(&db.client, &confirmed_sql).await;
    assert!(
        confirmed < dropped_at,
        "the slot was confirmed ({confirmed}) past the point the table left the publication \
         ({dropped_at}): the {} rows written since are lost for good",
        skipped.len()
    );
    assert!(
        relay
            .log()
            .contains("no longer publishes inserts into the outbox table"),
        "the relay did not report the table missing from the publication:\n{}",
        relay.log_tail(20)
    );
    let readyz = reqwest::Client::new()
        .get(format!("http://{}/readyz", relay.http_addr().await))
        .send()
        .await
        .unwrap_or_else(|err| panic!("GET /readyz: {err}"));
    let ready_status = readyz.status();
    let ready_body = readyz.text().await.unwrap_or_default();
    println!(
        "publication altered at WAL {dropped_at}: confirmed_flush_lsn {confirmed} after 6 s of \
         heartbeats; /readyz {ready_status}: {}",
        ready_body.trim()
    );
    assert!(
        confirmed < dropped_at,
        "the slot was confirmed ({confirmed}) past the point the table left the publication \
         ({dropped_at}): the {} rows written since are lost for good",
        skipped.len()
    );
    assert_eq!(
        ready_status,
        reqwest::StatusCode::SERVICE_UNAVAILABLE,
        "{ready_body}"
    );
    assert!(ready_body.contains("no longer publishes"), "{ready_body}");

    // Back in the publication: later rows stream and confirmation resumes; the rows
    // written meanwhile were never streamed and are still in the table.
    db.client
        .batch_execute(&format!("ALTER PUBLICATION {slot} ADD TABLE public.outbox"))
        .await
        .unwrap_or_else(|err| panic!("ALTER PUBLICATION: {err}"));
    let later = write(&mut db.client, 10).await;
    let target = wal_lsn(&db.client, "pg_current_wal_lsn()").await;
    common::wait_for_relays(
        "confirmation to resume past the re-added table's rows",
        Duration::from_secs(60),
        &[&relay],
        || async { wal_lsn(&db.client, &confirmed_sql).await >= target },
    )
    .await;
    let left = count(&db.client, "SELECT count(*) FROM public.outbox").await;
    assert_eq!(
        left,
        i64::try_from(skipped.len()).unwrap(),
        "the rows written while the table was out of the publication stay in the table"
    );
    written.extend(later);
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    assert_delivered(&received, &written);
    drop(relay);
    drop(guard);
}
