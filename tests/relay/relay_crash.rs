//! The outbox pattern's crash test: under concurrent writers (some of which roll back
//! after writing outbox rows), relay replicas are SIGKILLed mid-batch again and again;
//! an independent consumer then finds every committed row, no rolled-back row, and
//! per-aggregate order intact. Duplicates are counted and printed.

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{RelayBroker, RelayOptions, RelayProcess};
use rand::Rng;

const KILLS: usize = 22;
const WRITERS: usize = 4;
const AGGREGATES_PER_WRITER: usize = 10;

async fn published_rows(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM public.outbox WHERE published_at IS NOT NULL",
            &[],
        )
        .await
        .map(|r| r.get(0))
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_survives_sigkill_mid_batch_under_load() {
    let started = Instant::now();
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let options = RelayOptions {
        batch_size: 20,
        interval: "20ms",
        ..RelayOptions::default()
    };
    let yaml = common::relay_config_yaml(&broker, &options);

    // Writers: each owns its aggregates, so within an aggregate id order is commit order.
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let stop = stop.clone();
        let url = db.url.clone();
        writers.push(tokio::spawn(async move {
            let mut client = common::pg_connect(&url).await.unwrap();
            let (mut committed, mut aborted) = (BTreeSet::new(), BTreeSet::new());
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let (aggregate, rows, abort) = {
                    let mut rng = rand::rng();
                    (
                        format!("w{w}-a{}", rng.random_range(0..AGGREGATES_PER_WRITER)),
                        rng.random_range(1..=3),
                        rng.random_ratio(1, 5),
                    )
                };
                let tx = client.transaction().await.unwrap();
                let mut ids = Vec::new();
                for _ in 0..rows {
                    n += 1;
                    let payload = serde_json::json!({"aggregate": aggregate, "n": n});
                    ids.push(common::insert_row(&tx, "Order", &aggregate, &payload).await);
                }
                if abort {
                    tx.rollback().await.unwrap();
                    aborted.extend(ids);
                } else {
                    tx.commit().await.unwrap();
                    committed.extend(ids);
                }
                // Pacing, not an assertion: a steady load rather than a flood.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (committed, aborted)
        }));
    }

    let mut replicas = [
        RelayProcess::start(&yaml, &db.url, &broker),
        RelayProcess::start(&yaml, &db.url, &broker),
    ];
    let mut kills = 0;
    for round in 0..KILLS {
        let victim = round % 2;
        // Kill only once the cluster is publishing again, so each kill lands while
        // batches are in flight.
        let before = published_rows(&db.client).await;
        let client = &db.client;
        common::wait_for_relays(
            "the relays to publish again",
            Duration::from_secs(30),
            &[&replicas[0], &replicas[1]],
            || async { published_rows(client).await > before + 5 },
        )
        .await;
        replicas[victim].kill();
        kills += 1;
        replicas[victim] = RelayProcess::start(&yaml, &db.url, &broker);
    }
    stop.store(true, Ordering::Relaxed);
    let (mut committed, mut aborted) = (BTreeSet::new(), BTreeSet::new());
    for writer in writers {
        let (c, a) = writer.await.unwrap();
        committed.extend(c);
        aborted.extend(a);
    }
    let client = &db.client;
    common::wait_for_relays(
        "the backlog to drain",
        Duration::from_secs(60),
        &[&replicas[0], &replicas[1]],
        || async { common::unpublished_rows(client).await == 0 },
    )
    .await;
    for replica in &mut replicas {
        let status = replica.terminate(Duration::from_secs(20));
        assert!(status.success(), "exit {status}: {}", replica.log());
    }

    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let report = common::check_delivery(&received, &committed, &aborted);
    println!(
        "crash test: {kills} SIGKILLs, {} committed rows, {} rolled-back rows, {} messages, \
         {} distinct, {} duplicates, {} missing, {} orphans, {} order violations, {:?}",
        committed.len(),
        aborted.len(),
        report.received,
        report.distinct,
        report.duplicates,
        report.missing.len(),
        report.orphans.len(),
        report.order_violations.len(),
        started.elapsed()
    );
    assert_eq!(kills, KILLS);
    assert!(
        !aborted.is_empty() && committed.len() > 500,
        "too little load"
    );
    report.assert_complete();
}
