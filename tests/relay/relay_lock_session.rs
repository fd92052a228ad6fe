//! The polling relay's lock session ending under a running batch. Its partition locks
//! end with it, and another replica may take the partitions at once, so nothing more
//! may go out under them: not the rest of the batch's chains, however long its fence
//! still has to run. And the server's idle timeouts, which a role or database may set,
//! must not end the session while the broker acknowledges.
//!
//! RabbitMQ, through a proxy that holds the link while the batch is in flight: it does
//! not drop repeated message ids, so every send the relay made is seen, and it takes a
//! chain's rest one message at a time, the path where a rest is longest in flight.

use crate::common;

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use common::proxy::TcpProxy;
use common::{RelayBroker, RelayOptions, RelayProcess};

/// Aggregates of the batch held in flight: each is one chain, whose first message is
/// the only one sent before the link is released.
const AGGREGATES: usize = 4;
/// Rows per aggregate.
const PER_AGGREGATE: usize = 25;

/// A relay on one partition publishing to a fresh queue through `proxy`, on a fresh
/// database prepared by `prepare` before the relay connects; one row published through
/// the proxy, so the broker connection is up.
async fn relay_through(
    proxy: &TcpProxy,
    prepare: &str,
) -> (
    common::TestDatabase,
    common::TestQueue,
    RelayProcess,
    BTreeSet<i64>,
) {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 1).await;
    if !prepare.is_empty() {
        db.client
            .batch_execute(&prepare.replace("{db}", &db.name))
            .await
            .unwrap();
    }
    let queue = common::fresh_queue().await;
    let exchange = common::fresh_exchange_for(&queue).await;
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
        batch_size: 1000,
        ..RelayOptions::default()
    };
    let relay = RelayProcess::start(
        &common::relay_config_yaml(&broker, &options),
        &db.url,
        &broker,
    );
    let first = common::insert_row(
        &db.client,
        "order",
        "warm-up",
        &serde_json::json!({"warm": true}),
    )
    .await;
    common::wait_for_relays(
        "the relay to publish a first row",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    (db, queue, relay, BTreeSet::from([first]))
}

/// Commits [`AGGREGATES`] × [`PER_AGGREGATE`] rows in one transaction, so one batch
/// selects them all; their ids.
async fn commit_batch(db: &common::TestDatabase) -> Vec<i64> {
    db.client.batch_execute("BEGIN").await.unwrap();
    let mut ids = Vec::new();
    for i in 0..AGGREGATES * PER_AGGREGATE {
        let aggregate = format!("agg-{}", i % AGGREGATES);
        let payload = serde_json::json!({"aggregate": aggregate, "i": i});
        ids.push(common::insert_row(&db.client, "order", &aggregate, &payload).await);
    }
    db.client.batch_execute("COMMIT").await.unwrap();
    ids
}

/// The relay's lock session (the one holding advisory locks) when it has a batch open:
/// idle in a transaction that locked rows. Its pid.
async fn batch_in_flight(db: &common::TestDatabase) -> Option<i32> {
    db.client
        .query_opt(
            "SELECT a.pid FROM pg_stat_activity a
             WHERE a.datname = current_database() AND a.state = 'idle in transaction'
               AND a.backend_xid IS NOT NULL
               AND a.pid IN (SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory')",
            &[],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// The pid of the session holding the relay's advisory locks.
async fn lock_session(db: &common::TestDatabase) -> Option<i32> {
    db.client
        .query_opt(
            "SELECT DISTINCT l.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid)
             WHERE l.locktype = 'advisory' AND a.datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// How many times each id reached the queue.
fn sends(received: &[common::Received]) -> HashMap<i64, usize> {
    let mut counts = HashMap::new();
    for message in received {
        *counts.entry(message.id).or_insert(0) += 1;
    }
    counts
}

/// The batch of [`commit_batch`] goes out while the link is held; once the relay's
/// transaction is open, `interrupt` runs; then the link is released. Returns every
/// message the queue got, checked for completeness and order, once all is published.
async fn hold_a_batch<F, Fut>(
    prepare: &str,
    wait_held: Duration,
    interrupt: F,
) -> (Vec<common::Received>, i32, Option<i32>)
where
    F: FnOnce(i32) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let rig = common::Rig::load();
    let proxy = TcpProxy::start(common::host_port(rig.amqp_url())).await;
    let (db, queue, relay, mut committed) = relay_through(&proxy, prepare).await;
    proxy.hold();
    committed.extend(commit_batch(&db).await);
    let pid = common::wait_for_some(
        "the relay to select the batch and send its first messages",
        Duration::from_secs(30),
        || batch_in_flight(&db),
    )
    .await;
    interrupt(pid).await;
    tokio::time::sleep(wait_held).await;
    proxy.heal();
    common::wait_for_relays(
        "every row published once the link is back",
        Duration::from_secs(90),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    let after = lock_session(&db).await;
    drop(relay);
    let received = common::consume_amqp(&queue).await;
    let report = common::check_delivery(&received, &committed, &BTreeSet::new());
    println!(
        "{} committed, {} messages, {} duplicates",
        committed.len(),
        report.received,
        report.duplicates
    );
    report.assert_complete();
    (received, pid, after)
}

/// `pg_terminate_backend` ends the lock session while the batch's first messages wait
/// for their confirms (an operator's kill, a failover tool, a pooler's `KILL` end it
/// the same way). The relay sends nothing more of that batch: its chains stop where
/// they are, and the batch goes again, whole and in order, on a new session. Only the
/// messages already sent when the session ended (one per chain) reach the queue twice;
/// before, every chain's rest followed for up to the 15 s fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_lock_session_sends_nothing_more_of_its_batch() {
    let (received, _, _) = hold_a_batch("", Duration::from_millis(500), |pid| async move {
        let admin = common::pg_admin().await;
        let ended: bool = admin
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert!(ended, "the lock session {pid} should have been terminated");
    })
    .await;
    let twice: Vec<i64> = sends(&received)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(id, _)| id)
        .collect();
    assert!(
        twice.len() <= AGGREGATES,
        "only the {AGGREGATES} chains' first messages were sent before the session ended, \
         yet {} rows reached the queue more than once: {twice:?}",
        twice.len()
    );
}

/// A database (or role) with `idle_in_transaction_session_timeout` shorter than the
/// broker takes to confirm: the relay's own sessions turn it off, so the lock session
/// outlives the wait, keeps its partition, and every row is sent exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_in_transaction_timeout_does_not_end_the_lock_session_under_a_batch() {
    let prepare = "ALTER DATABASE \"{db}\" SET idle_in_transaction_session_timeout = '300ms'";
    // Held well past the timeout.
    let (received, pid, after) = hold_a_batch(prepare, Duration::from_secs(3), |_| async {}).await;
    assert_eq!(
        after,
        Some(pid),
        "the lock session should be the one that selected the batch"
    );
    let twice: Vec<i64> = sends(&received)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(id, _)| id)
        .collect();
    assert!(twice.is_empty(), "rows sent more than once: {twice:?}");
}
