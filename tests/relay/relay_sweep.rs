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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_hidden_from_the_tail_are_found_published_and_counted() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let guard = SlotGuard::new(rig.pg_url(), "sweep");
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
             deleteAfterPublish: true, sweep: {{interval: 1s, olderThan: 3s}}}}}}",
            guard.slot
        ),
    );
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_slot_active(&db.client, &guard.slot, &relay).await;
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
