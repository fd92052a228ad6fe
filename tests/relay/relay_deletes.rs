//! With `deleteAfterPublish`, deletes that keep failing hold the stream back instead of
//! queueing published batches without bound: the relay publishes at most a bounded
//! number of batches ahead of its deletes, says so, and goes on once deletes work
//! again — every row published, deleted and confirmed.
//!
//! Before: the queue to the delete task was unbounded, so a relay whose deletes failed
//! kept publishing (never confirming) and grew until the OOM kill, and the restart
//! then sent everything again.
//!
//! A relay that deletes what it publishes (the back-fill relay of a switch from
//! polling with `afterPublish: mark` to log tailing, the sweep) never sends again the
//! rows the table shows marked published. Before: only `afterPublish: mark` looked at
//! the mark, so a switch republished up to a day of published rows.

use crate::common::{self, RelayBroker, RelayProcess, SlotGuard};

use std::collections::HashSet;
use std::time::Duration;

async fn topic_ids(topic: &str) -> HashSet<i64> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap()
        .iter()
        .map(|m| m.id)
        .collect()
}

async fn wal_lsn(client: &tokio_postgres::Client) -> String {
    client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_deletes_hold_publishing_back_and_nothing_is_lost_once_they_work() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let guard = SlotGuard::new(rig.pg_url(), "deletes");
    let slot = guard.slot.clone();
    common::create_replication(&db.client, &slot, &slot).await;
    // Deletes fail, inserts go on.
    db.client
        .batch_execute(
            "CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN RAISE EXCEPTION 'deletes refused by the test'; END $$;
             CREATE TRIGGER refuse_delete BEFORE DELETE ON public.outbox
               FOR EACH ROW EXECUTE FUNCTION refuse_delete();",
        )
        .await
        .unwrap();
    let relay = RelayProcess::start(
        &common::log_tailing_yaml(&broker, &slot, true),
        &db.url,
        &broker,
    );
    common::wait_slot_active(&db.client, &slot, &relay).await;
    // One transaction a batch: each row is written once the one before is published,
    // until the queue is full and the relay says it holds.
    let mut written = Vec::new();
    let holding = || relay.log().contains("publishing holds until they are");
    let published = || async {
        relay
            .metrics()
            .await
            .and_then(|m| common::metric_value(&m, "outbox_relay_published_total"))
            .unwrap_or(0.0)
    };
    while !holding() {
        assert!(
            written.len() < 200,
            "the relay never held with {} batches waiting for their deletes:\n{}",
            written.len(),
            relay.log_tail(20)
        );
        let before = published().await;
        written.push(
            common::insert_row(
                &db.client,
                "order",
                &format!("a{}", written.len() % 7),
                &serde_json::json!({"i": written.len()}),
            )
            .await,
        );
        common::wait_for_relays(
            "the row published, or the relay holding",
            Duration::from_secs(60),
            &[&relay],
            || async { holding() || published().await > before },
        )
        .await;
    }
    let held = topic_ids(&topic).await;
    // More rows, sent to the relay by the server: none goes out while deletes fail.
    let more_from = written.len();
    for i in 0..30 {
        written.push(
            common::insert_row(&db.client, "order", "late", &serde_json::json!({"late": i})).await,
        );
    }
    let written_to = wal_lsn(&db.client).await;
    common::wait_for_relays(
        "the walsender to send the later rows",
        Duration::from_secs(60),
        &[&relay],
        || async {
            db.client
                .query_one(
                    "SELECT coalesce(bool_or(r.sent_lsn >= $1::text::pg_lsn), false) \
                     FROM pg_stat_replication r \
                     JOIN pg_replication_slots s ON s.active_pid = r.pid \
                     WHERE s.slot_name = $2",
                    &[&written_to, &slot],
                )
                .await
                .is_ok_and(|r| r.get::<_, bool>(0))
        },
    )
    .await;
    let still = topic_ids(&topic).await;
    assert_eq!(
        still.len(),
        held.len(),
        "the relay published on while its deletes failed"
    );
    assert!(
        written[more_from..].iter().all(|id| !still.contains(id)),
        "a later row was published while the deletes failed"
    );
    // One row a batch: the queue's 64, the one the delete task is on, and the one the
    // stream holds.
    assert!(
        held.len() <= 66,
        "{} rows went out ahead of their deletes",
        held.len()
    );
    println!(
        "deletes failing: publishing held after {} of {} rows; none of the 30 later rows went out",
        held.len(),
        written.len()
    );

    // Deletes work again: everything is published, deleted and confirmed.
    db.client
        .batch_execute("DROP TRIGGER refuse_delete ON public.outbox")
        .await
        .unwrap();
    common::wait_for_relays(
        "every row published and deleted",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    let target = wal_lsn(&db.client).await;
    common::wait_for_relays(
        "the slot confirmed past every row",
        Duration::from_secs(60),
        &[&relay],
        || async {
            db.client
                .query_one(
                    "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots \
                     WHERE slot_name = $1",
                    &[&slot, &target],
                )
                .await
                .is_ok_and(|r| r.get::<_, bool>(0))
        },
    )
    .await;
    let all = topic_ids(&topic).await;
    assert!(
        written.iter().all(|id| all.contains(id)),
        "a row never arrived"
    );
    drop(relay);
    drop(guard);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleting_relay_never_sends_rows_marked_published_again() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    // What polling with afterPublish: mark leaves: published rows, marked, beside
    // rows not published yet.
    let mut marked = HashSet::new();
    let mut waiting = Vec::new();
    for i in 0..40 {
        let id = common::insert_row(
            &db.client,
            "order",
            &format!("a{}", i % 5),
            &serde_json::json!({"i": i}),
        )
        .await;
        if i % 2 == 0 {
            marked.insert(id);
        } else {
            waiting.push(id);
        }
    }
    let marked_ids: Vec<i64> = marked.iter().copied().collect();
    db.client
        .execute(
            "UPDATE public.outbox SET published_at = now() WHERE id = ANY($1)",
            &[&marked_ids],
        )
        .await
        .unwrap();
    // The back-fill relay's mode: polling, deleting what it publishes.
    let yaml = common::with_spec_line(
        &common::relay_config_yaml(&broker, &common::RelayOptions::default()),
        "mode",
        "{polling: {interval: 100ms, afterPublish: delete}}",
    );
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_for_relays(
        "the waiting rows published and deleted",
        Duration::from_secs(60),
        &[&relay],
        || async {
            db.client
                .query_one(
                    "SELECT count(*) FROM public.outbox WHERE published_at IS NULL",
                    &[],
                )
                .await
                .is_ok_and(|r| r.get::<_, i64>(0) == 0)
        },
    )
    .await;
    // The relay's next batches find nothing more: its backlog metric says 0 rows.
    common::wait_for_relays(
        "the relay to report an empty backlog",
        Duration::from_secs(60),
        &[&relay],
        || async {
            relay
                .metrics()
                .await
                .and_then(|m| common::metric_value(&m, "outbox_relay_backlog_rows"))
                == Some(0.0)
        },
    )
    .await;
    let got = topic_ids(&topic).await;
    let again: Vec<&i64> = marked.iter().filter(|id| got.contains(id)).collect();
    assert!(
        again.is_empty(),
        "rows marked published were sent again: {again:?}"
    );
    assert!(
        waiting.iter().all(|id| got.contains(id)),
        "a waiting row never arrived"
    );
    println!(
        "deleting relay on a marked table: {} waiting rows sent, 0 of {} marked rows sent again",
        waiting.len(),
        marked.len()
    );
    drop(relay);
}
