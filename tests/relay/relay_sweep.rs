//! The reconciliation sweep of a log-tailing relay: rows the tail cannot see (the
//! publication stopped publishing the table while they were written, while no relay
//! process ran to see the change) are found in the table once older than
//! `sweep.olderThan`, published, deleted and counted.

use crate::common::{self, RelayBroker, RelayProcess, SlotGuard};

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

async fn insert(client: &tokio_postgres::Client, n: usize, tag: &str) -> Vec<i64> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id: i64 = client
            .query_one(
                "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
                 VALUES ('order', $1, 'Happened', jsonb_build_object('tag', $2::text)) RETURNING id",
                &[&format!("agg-{i}"), &tag],
            )
            .await
            .unwrap()
            .get(0);
        ids.push(id);
    }
    ids
}

/// A log-tailing relay with a sweep every second for rows `older_than`, on a fresh
/// database and topic, streaming.
struct Sweeping {
    db: common::TestDatabase,
    guard: SlotGuard,
    topic: String,
    broker: RelayBroker,
    yaml: String,
    relay: RelayProcess,
}

async fn sweeping(name: &str, older_than: &str) -> Sweeping {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let guard = SlotGuard::new(rig.pg_url(), name);
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let yaml = common::with_spec_line(
        &common::log_tailing_yaml(&broker, &guard.slot, true),
        "mode",
        &format!(
            "{{logTailing: {{slotName: {0}, publicationName: {0}, heartbeatInterval: 1s, \
             deleteAfterPublish: true, sweep: {{interval: 1s, olderThan: {older_than}}}}}}}",
            guard.slot
        ),
    );
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    Sweeping {
        db,
        guard,
        topic,
        broker,
        yaml,
        relay,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_hidden_from_the_tail_are_found_published_and_counted() {
    let Sweeping {
        db,
        guard,
        topic,
        broker,
        yaml,
        mut relay,
    } = sweeping("sweep", "3s").await;
    let mut expected = insert(&db.client, 5, "seen").await;
    // Rows written while the publication does not publish the table never reach the
    // slot's stream. A running relay sees the change before it publishes anything
    // newer (tests/relay/relay_publication.rs); one that is not running cannot.
    relay.terminate(Duration::from_secs(30));
    db.client
        .batch_execute(&format!(
            "ALTER PUBLICATION {} DROP TABLE public.outbox",
            guard.slot
        ))
        .await
        .unwrap();
    let hidden = insert(&db.client, 7, "hidden").await;
    db.client
        .batch_execute(&format!(
            "ALTER PUBLICATION {} ADD TABLE public.outbox",
            guard.slot
        ))
        .await
        .unwrap();
    expected.extend(&hidden);
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    expected.extend(insert(&db.client, 3, "after").await);

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left: i64 = db
            .client
            .query_one("SELECT count(*) FROM public.outbox", &[])
            .await
            .unwrap()
            .get(0);
        let found = relay
            .metrics()
            .await
            .and_then(|m| common::metric_value(&m, "outbox_relay_sweep_found_total"))
            .unwrap_or(0.0);
        if left == 0 && found >= hidden.len() as f64 {
            assert_eq!(
                found,
                hidden.len() as f64,
                "the sweep counts only missed rows"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after 60 s: {left} rows left, the sweep found {found}\n{}",
            relay.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let topic_for_consumer = topic.clone();
    let received: BTreeSet<i64> =
        tokio::task::spawn_blocking(move || common::consume_kafka(&topic_for_consumer))
            .await
            .unwrap()
            .iter()
            .map(|r| r.id)
            .collect();
    let expected: BTreeSet<i64> = expected.into_iter().collect();
    assert!(
        expected.is_subset(&received),
        "missing: {:?}",
        expected.difference(&received).collect::<Vec<_>>()
    );
    assert!(
        relay
            .log()
            .contains("sweep: published rows the log tail had missed"),
        "{}",
        relay.log_tail(30)
    );
    drop(relay);
    drop(guard);
    db.drop_database().await;
}

/// A long transaction that commits while the tail lags behind a large one: its row is
/// older than `olderThan` by `createdAt` (the transaction's start), yet the tail has not
/// missed it, only not reached it. The sweep leaves it to the tail: it finds nothing,
/// over sweeps that run until after the tail has passed it, and the row arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_transaction_committing_while_the_tail_lags_is_left_to_the_tail() {
    let Sweeping {
        db,
        guard,
        topic,
        relay,
        ..
    } = sweeping("sweeplag", "1s").await;
    let sweeps = || async {
        relay
            .metric("outbox_relay_sweeps_total")
            .await
            .unwrap_or(0.0)
    };
    // The long transaction starts: its row's createdAt is now.
    let mut long = common::pg_connect(&db.url).await.unwrap();
    let tx = long.transaction().await.unwrap();
    let late: i64 = tx
        .query_one(
            "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
             VALUES ('order', 'agg-late', 'Happened', '{}') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Meanwhile the tail streams newer commits (its position passes the row's
    // createdAt by more than olderThan) and sweeps run.
    let before = sweeps().await;
    common::wait_for_relays("two sweeps", Duration::from_secs(60), &[&relay], || async {
        insert(&db.client, 1, "meanwhile").await;
        sweeps().await >= before + 2.0
    })
    .await;
    // A large transaction holds the tail back, and the long one commits behind it.
    db.client
        .batch_execute(
            "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
             SELECT 'order', 'agg-bulk-' || (i % 50), 'Bulk', '{}' FROM generate_series(1, 60000) i",
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // Until the tail has passed it, sweeps go on and find nothing; then it is the tail's.
    common::wait_for_relays(
        "the tail through everything (the table empty)",
        Duration::from_secs(180),
        &[&relay],
        || async {
            db.client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .is_ok_and(|r| r.get::<_, i64>(0) == 0)
        },
    )
    .await;
    let after = sweeps().await;
    common::wait_for_relays(
        "two more sweeps",
        Duration::from_secs(60),
        &[&relay],
        || async { sweeps().await >= after + 2.0 },
    )
    .await;
    assert_eq!(
        relay.metric("outbox_relay_sweep_found_total").await,
        Some(0.0),
        "the sweep took a row the tail had not missed:\n{}",
        relay.log_tail(20)
    );
    let topic = topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let late_copies = received.iter().filter(|r| r.id == late).count();
    assert_eq!(
        late_copies, 1,
        "the long transaction's row arrived {late_copies} times"
    );
    drop(relay);
    drop(guard);
}
