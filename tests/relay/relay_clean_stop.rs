//! A relay stopped the way Kubernetes stops a pod (SIGTERM, then waiting for it to
//! exit) replays nothing: under a steady application writer, relays are stopped and
//! started again and again while they publish; an independent consumer then reads every
//! committed event exactly once, in per-aggregate order, and no rolled-back one. (A
//! SIGKILL may replay what was in flight: `relay_crash` and the fault matrix count that.)

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::app_writer::{AppWriter, WriterOptions};
use common::{RelayBroker, RelayOptions, RelayProcess, SlotGuard};

const STOPS: usize = 10;
/// Events committed between two stops; each stop lands halfway through them.
const STEP: usize = 300;
const WAIT: Duration = Duration::from_secs(60);

/// Stops and restarts the relay of `yaml` `STOPS` times under the writer, then checks
/// every delivery the topic received.
async fn stopped_and_started(
    db: &common::TestDatabase,
    yaml: &str,
    broker: &RelayBroker,
    topic: &str,
) {
    let writer = AppWriter::start(
        &db.url,
        WriterOptions {
            aggregates: 40,
            writers: 2,
            pause: Duration::from_millis(5),
            ..WriterOptions::default()
        },
    )
    .await;
    let mut relay = RelayProcess::start(yaml, &db.url, broker);
    let mut allowed = 0;
    for _ in 0..STOPS {
        allowed += STEP;
        writer.allow(allowed);
        writer.wait_committed(allowed - STEP / 2, WAIT).await;
        let status = relay.terminate(Duration::from_secs(20));
        assert!(status.success(), "exit {status}: {}", relay.log());
        relay = RelayProcess::start(yaml, &db.url, broker);
    }
    allowed += STEP;
    writer.allow(allowed);
    writer.wait_committed(allowed, WAIT).await;
    let ledger = writer.finish().await;
    let read = || {
        let topic = topic.to_owned();
        async move {
            tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                .await
                .unwrap()
        }
    };
    common::wait_for_relays(
        "every committed event delivered",
        WAIT,
        &[&relay],
        || async {
            let seen: BTreeSet<i64> = read().await.iter().map(|r| r.id).collect();
            ledger.committed.is_subset(&seen)
        },
    )
    .await;
    let status = relay.terminate(Duration::from_secs(20));
    assert!(status.success(), "exit {status}: {}", relay.log());
    let received = read().await;
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    println!(
        "clean stops: {STOPS} SIGTERMs under load, {} committed events ({} rolled back), {} deliveries, {} duplicates, {} missing",
        ledger.committed.len(),
        ledger.aborted.len(),
        report.received,
        report.duplicates,
        report.missing.len()
    );
    report.assert_ordered_without_orphans();
    assert!(report.missing.is_empty(), "missing: {:?}", report.missing);
    assert_eq!(
        report.duplicates, 0,
        "a relay stopped cleanly replayed events"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_tailing_relay_stopped_cleanly_under_load_replays_nothing() {
    log_tailing(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_tailing_relay_deleting_what_it_publishes_stopped_cleanly_replays_nothing() {
    log_tailing(true).await;
}

async fn log_tailing(delete_after_publish: bool) {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let guard = SlotGuard::new(&db.url, "clean");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let yaml = common::log_tailing_yaml(&broker, &guard.slot, delete_after_publish);
    stopped_and_started(&db, &yaml, &broker, &topic).await;
    drop(guard);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_relay_stopped_cleanly_under_load_replays_nothing() {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let yaml = common::relay_config_yaml(&broker, &RelayOptions::default());
    stopped_and_started(&db, &yaml, &broker, &topic).await;
    db.drop_database().await;
}
