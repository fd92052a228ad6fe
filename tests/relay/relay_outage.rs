//! Outages: a broker (Kafka, NATS) or PostgreSQL is stopped for 10 s and started again
//! while writers keep committing and one relay process runs throughout. The relay must
//! recover by itself (same process, no restart) and an independent consumer must then
//! see every committed row in per-aggregate order. Duplicates are counted and printed.
//!
//! Each test uses a private instance of the server it stops (tests/common/private.rs),
//! so the shared rig is never disturbed.

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::private::{PrivateKafka, PrivateNats, PrivatePostgres};
use common::{RelayBroker, RelayOptions, RelayProcess};
use rand::Rng;

/// How long the server stays down.
const OUTAGE: Duration = Duration::from_secs(10);
const WRITERS: usize = 3;

/// A server a test can stop and start again.
trait Outage {
    fn stop(&mut self);
    fn start(&mut self);
}

impl Outage for PrivateKafka {
    fn stop(&mut self) {
        PrivateKafka::stop(self)
    }
    fn start(&mut self) {
        PrivateKafka::start(self)
    }
}

impl Outage for PrivateNats {
    fn stop(&mut self) {
        PrivateNats::stop(self)
    }
    fn start(&mut self) {
        PrivateNats::start(self)
    }
}

impl Outage for PrivatePostgres {
    fn stop(&mut self) {
        PrivatePostgres::stop(self)
    }
    fn start(&mut self) {
        PrivatePostgres::start(self)
    }
}

/// One number from the database on a fresh connection (`None` while it is down).
async fn query_count(url: &str, sql: &str) -> Option<i64> {
    let client = common::pg_connect(url).await.ok()?;
    client.query_one(sql, &[]).await.ok().map(|r| r.get(0))
}

async fn published(url: &str) -> i64 {
    query_count(
        url,
        "SELECT count(*) FROM public.outbox WHERE published_at IS NOT NULL",
    )
    .await
    .unwrap_or(-1)
}

/// Writers that commit 1–3 rows per transaction for aggregates of their own (so commit
/// order is id order per aggregate), and reconnect and retry whenever the database
/// fails. Returns the stop flag, the commit counter and the tasks.
fn start_writers(
    url: &str,
) -> (
    Arc<AtomicBool>,
    Arc<AtomicU64>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let stop = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    let tasks = (0..WRITERS)
        .map(|w| {
            let (stop, commits, url) = (stop.clone(), commits.clone(), url.to_owned());
            tokio::spawn(async move {
                let mut client = None;
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if client.is_none() {
                        client = common::pg_connect(&url).await.ok();
                    }
                    let Some(c) = client.as_mut() else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    let (aggregate, rows) = {
                        let mut rng = rand::rng();
                        (
                            format!("w{w}-a{}", rng.random_range(0..8)),
                            rng.random_range(1..=3),
                        )
                    };
                    let written = async {
                        let tx = c.transaction().await?;
                        for _ in 0..rows {
                            n += 1;
                            let payload = serde_json::json!({"aggregate": aggregate, "n": n});
                            tx.execute(
                                "INSERT INTO public.outbox \
                                 (aggregatetype, aggregateid, type, payload, traceparent) \
                                 VALUES ('Order', $1, 'Happened', ($2::text)::jsonb, 't')",
                                &[&aggregate, &payload.to_string()],
                            )
                            .await?;
                        }
                        tx.commit().await
                    }
                    .await;
                    match written {
                        Ok(()) => {
                            commits.fetch_add(1, Ordering::Relaxed);
                        }
                        // The database is down or restarting: retry on a new connection.
                        // A commit whose answer was lost may have happened; the check
                        // below reads the committed rows from the table itself.
                        Err(_) => client = None,
                    }
                    // Pacing, not an assertion: a steady load rather than a flood.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        })
        .collect();
    (stop, commits, tasks)
}

/// Runs the whole scenario and returns what the relay must have published: the ids in
/// the table (every committed row, mark mode keeps them).
async fn run_through_outage(
    db_url: &str,
    broker: &RelayBroker,
    server: &mut dyn Outage,
) -> BTreeSet<i64> {
    let started = Instant::now();
    let (stop, commits, writers) = start_writers(db_url);
    let yaml = common::relay_config_yaml(broker, &RelayOptions::default());
    let mut relay = RelayProcess::start(&yaml, db_url, broker);
    common::wait_for_relays(
        "the relay to publish before the outage",
        Duration::from_secs(60),
        &[&relay],
        || async { published(db_url).await > 20 },
    )
    .await;

    tokio::task::block_in_place(|| server.stop());
    let commits_at_stop = commits.load(Ordering::Relaxed);
    // The outage itself (scenario timing, not an assertion).
    tokio::time::sleep(OUTAGE).await;
    assert!(
        relay.is_running(),
        "relay died in the outage:\n{}",
        relay.log()
    );
    tokio::task::block_in_place(|| server.start());
    let restarted_at = Instant::now();

    let before = published(db_url).await;
    common::wait_for_relays(
        "the relay to publish again after the restart",
        Duration::from_secs(60),
        &[&relay],
        || async { published(db_url).await > before + 50 },
    )
    .await;
    let recovered_in = restarted_at.elapsed();
    let commits_before_end = commits.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.unwrap();
    }
    assert!(
        commits_before_end > commits_at_stop,
        "writers did not go on committing"
    );
    common::wait_for_relays(
        "the backlog to drain",
        Duration::from_secs(90),
        &[&relay],
        || async {
            query_count(
                db_url,
                "SELECT count(*) FROM public.outbox WHERE published_at IS NULL",
            )
            .await
                == Some(0)
        },
    )
    .await;
    assert!(
        relay.is_running(),
        "the relay had to exit to recover:\n{}",
        relay.log()
    );
    let status = relay.terminate(Duration::from_secs(20));
    assert!(status.success(), "exit {status}:\n{}", relay.log());

    let client = common::pg_connect(db_url).await.unwrap();
    let committed: BTreeSet<i64> = client
        .query("SELECT id FROM public.outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    println!(
        "outage scenario: {} committed rows, publishing resumed {:?} after the restart, total {:?}",
        committed.len(),
        recovered_in,
        started.elapsed()
    );
    committed
}

fn assert_complete(what: &str, received: &[common::Received], committed: &BTreeSet<i64>) {
    let report = common::check_delivery(received, committed, &BTreeSet::new());
    println!(
        "{what}: {} committed, {} messages, {} distinct, {} duplicates, {} missing, \
         {} orphans, {} order violations",
        committed.len(),
        report.received,
        report.distinct,
        report.duplicates,
        report.missing.len(),
        report.orphans.len(),
        report.order_violations.len()
    );
    report.assert_complete();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_stopped_for_10s_loses_nothing_and_the_relay_recovers_by_itself() {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let mut kafka = tokio::task::block_in_place(PrivateKafka::start_new);
    let topic = format!("test-{}", common::unique_suffix());
    common::create_topic(&kafka.bootstrap(), &topic, 3, &[]).await;
    let broker = RelayBroker::Kafka {
        bootstrap: kafka.bootstrap(),
        topic: topic.clone(),
    };
    let committed = run_through_outage(&db.url, &broker, &mut kafka).await;
    let bootstrap = kafka.bootstrap();
    let received =
        tokio::task::spawn_blocking(move || common::consume_kafka_from(&bootstrap, &topic))
            .await
            .unwrap();
    assert_complete("kafka outage", &received, &committed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_stopped_for_10s_loses_nothing_and_the_relay_recovers_by_itself() {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let mut nats = tokio::task::block_in_place(PrivateNats::start_new);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let stream = common::stream_on(client).await;
    let broker = RelayBroker::Nats {
        url: nats.url(),
        subject: format!("{}.{{aggregateType}}", stream.subject_prefix),
    };
    let committed = run_through_outage(&db.url, &broker, &mut nats).await;
    // The test's own client reconnected to the restarted server by itself.
    let received = common::consume_nats(&stream).await;
    assert_complete("nats outage", &received, &committed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_loses_nothing_and_the_relay_recovers_by_itself() {
    let mut pg = tokio::task::block_in_place(PrivatePostgres::start_new);
    let url = pg.url();
    let client = common::pg_connect(&url).await.unwrap();
    common::create_outbox_table(&client, 4).await;
    drop(client);
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let committed = run_through_outage(&url, &broker, &mut pg).await;
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    assert_complete("postgres restart", &received, &committed);
}

/// A broker that accepts the connection and never answers (RabbitMQ still booting
/// accepts TCP before it speaks AMQP): the relay gives up the attempt after its connect
/// timeout and tries again, instead of waiting on it for good with every publisher
/// behind it (seen in the fault matrix: a relay silent for two minutes after a RabbitMQ
/// restart). Through a proxy that holds every byte, then forwards again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_that_accepts_but_never_answers_stalls_no_relay() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let queue = common::fresh_queue().await;
    let exchange = common::fresh_exchange_for(&queue).await;
    let proxy = common::proxy::TcpProxy::start(common::host_port(rig.amqp_url())).await;
    proxy.hold();
    let url = rig
        .amqp_url()
        .replace(common::host_port(rig.amqp_url()), &proxy.addr.to_string());
    let broker = RelayBroker::Amqp {
        url,
        exchange,
        routing_key: "outbox.{aggregateType}".to_owned(),
    };
    let options = RelayOptions {
        partitions: 1,
        ..RelayOptions::default()
    };
    let relay = RelayProcess::start(
        &common::relay_config_yaml(&broker, &options),
        &db.url,
        &broker,
    );
    let mut ids = BTreeSet::new();
    for i in 0..20 {
        let aggregate = format!("agg-{}", i % 4);
        ids.insert(
            common::insert_row(
                &db.client,
                "order",
                &aggregate,
                &serde_json::json!({"aggregate": aggregate, "i": i}),
            )
            .await,
        );
    }
    // The first attempt hangs in the handshake; the timeout ends it and says so.
    common::wait_for_relays(
        "the relay to give up a connection attempt nobody answers",
        Duration::from_secs(60),
        &[&relay],
        || async { relay.log().contains("while connecting") },
    )
    .await;
    // The attempt held now is closed (a broker that finally resets it), and new ones
    // go through.
    proxy.cut();
    proxy.heal();
    common::wait_for_relays(
        "every row published once the broker answers",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    drop(relay);
    let received = common::consume_amqp(&queue).await;
    assert_complete("rabbitmq that never answered", &received, &ids);
}
