//! The log-tailing relay (`mode: logTailing`) against the real rig: delivery in commit
//! order per aggregate (Kafka and NATS), the pattern's crash test (SIGKILL mid-stream,
//! again and again, under concurrent load with rollbacks), and heartbeats that keep an
//! idle slot advancing.
//!
//! Writers take a per-aggregate counter row lock inside each transaction, so the
//! counter (`seq` in the payload) numbers each aggregate's rows in commit order, which
//! is what the relay must preserve; ids come from a sequence and need not follow it.
//!
//! Every slot a test creates is dropped by [`SlotGuard`], also when the test fails:
//! a leaked slot retains the shared cluster's WAL.

use crate::common;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Pg, Received, RelayBroker, RelayProcess, SlotGuard};
use rand::Rng;

/// The outbox table plus what writers need besides: the per-aggregate commit-order
/// counters and a table that is not published.
async fn create_tables(client: &tokio_postgres::Client) {
    common::create_outbox_table(client, 4).await;
    client
        .batch_execute(
            "CREATE TABLE public.counters (aggregate text PRIMARY KEY, n bigint NOT NULL);
             CREATE TABLE public.other_events (id bigserial PRIMARY KEY, aggregateid text,
                payload jsonb);",
        )
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: creating test tables failed: {err}"));
}

/// What writers did: committed rows (id → aggregate, seq) and rolled-back ids.
#[derive(Default)]
struct Written {
    committed: HashMap<i64, (String, i64)>,
    aborted: BTreeSet<i64>,
    updates: u64,
    deletes: u64,
    other_rows: u64,
}

/// One writer transaction: maybe an update and a delete of existing outbox rows and a
/// row in another table, then 1–3 outbox rows of one aggregate numbered under its
/// counter lock; one in five rolls back.
async fn write_one(
    client: &mut tokio_postgres::Client,
    aggregates: usize,
    mutate: bool,
    written: &mut Written,
) -> Result<(), tokio_postgres::Error> {
    let (aggregate, rows, abort, update, delete, other) = {
        let mut rng = rand::rng();
        (
            format!("a{}", rng.random_range(0..aggregates)),
            rng.random_range(1..=3),
            rng.random_ratio(1, 5),
            mutate && rng.random_ratio(1, 8),
            mutate && rng.random_ratio(1, 10),
            rng.random_ratio(1, 5),
        )
    };
    let tx = client.transaction().await?;
    let mut ids = Vec::new();
    let result: Result<(), tokio_postgres::Error> = async {
        if update {
            tx.execute(
                "UPDATE public.outbox SET type = 'Updated' \
                 WHERE id = (SELECT max(id) FROM public.outbox)",
                &[],
            )
            .await?;
        }
        if delete {
            tx.execute(
                "DELETE FROM public.outbox WHERE id = (SELECT min(id) FROM public.outbox)",
                &[],
            )
            .await?;
        }
        if other {
            tx.execute(
                "INSERT INTO public.other_events (aggregateid, payload) VALUES ($1, '{}')",
                &[&aggregate],
            )
            .await?;
        }
        // Ids first, so they do not follow commit order; the counter lock then orders
        // this aggregate's rows by commit.
        let mut fresh = Vec::new();
        for _ in 0..rows {
            let id: i64 = tx
                .query_one("SELECT nextval('public.outbox_id_seq')", &[])
                .await?
                .get(0);
            fresh.push(id);
        }
        fresh.reverse();
        for id in fresh {
            let seq: i64 = tx
                .query_one(
                    "INSERT INTO public.counters VALUES ($1, 1) ON CONFLICT (aggregate) \
                     DO UPDATE SET n = counters.n + 1 RETURNING n",
                    &[&aggregate],
                )
                .await?
                .get(0);
            let payload = serde_json::json!({"aggregate": aggregate, "seq": seq});
            tx.execute(
                "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload, \
                 traceparent) VALUES ($1, 'Order', $2, 'Happened', ($3::text)::jsonb, 't')",
                &[&id, &aggregate, &payload.to_string()],
            )
            .await?;
            ids.push((id, seq));
        }
        Ok(())
    }
    .await;
    let failed = result.is_err();
    if abort || failed {
        let _ = tx.rollback().await;
        written.aborted.extend(ids.iter().map(|(id, _)| *id));
        return result;
    }
    match tx.commit().await {
        Ok(()) => {
            for (id, seq) in ids {
                written.committed.insert(id, (aggregate.clone(), seq));
            }
            written.updates += u64::from(update);
            written.deletes += u64::from(delete);
            written.other_rows += u64::from(other);
            Ok(())
        }
        Err(err) => Err(err),
    }
}

/// Concurrent writers on `url` until `stop`; their results once joined. `mutate`:
/// also update and delete outbox rows. Writers reconnect when the database goes away.
fn start_writers(
    url: &str,
    writers: usize,
    aggregates: usize,
    mutate: bool,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Written>> {
    (0..writers)
        .map(|_| {
            let (url, stop) = (url.to_owned(), stop.clone());
            tokio::spawn(async move {
                let mut client: Option<tokio_postgres::Client> = None;
                let mut written = Written::default();
                while !stop.load(Ordering::Relaxed) {
                    if client
                        .as_ref()
                        .is_none_or(tokio_postgres::Client::is_closed)
                    {
                        client = common::pg_connect(&url).await.ok();
                    }
                    let Some(c) = client.as_mut() else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    // Lock waits between writers can deadlock-abort, and outages fail
                    // transactions; those count as rolled back (a commit whose answer
                    // was lost counts as neither; outage tests read the table).
                    let _ = write_one(c, aggregates, mutate, &mut written).await;
                    // Pacing, not an assertion: a steady load rather than a flood.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                written
            })
        })
        .collect()
}

async fn join_writers(tasks: Vec<tokio::task::JoinHandle<Written>>) -> Written {
    let mut all = Written::default();
    for task in tasks {
        let w = task.await.unwrap();
        all.committed.extend(w.committed);
        all.aborted.extend(w.aborted);
        all.updates += w.updates;
        all.deletes += w.deletes;
        all.other_rows += w.other_rows;
    }
    all
}

/// What a consumer's messages say about the writers' rows.
#[derive(Debug, Default)]
struct Check {
    received: usize,
    distinct: usize,
    duplicates: usize,
    missing: Vec<i64>,
    orphans: Vec<i64>,
    order_violations: Vec<String>,
    not_inserts: usize,
}

/// Every committed row once or more, no other row, and per aggregate the first
/// deliveries in commit order (ascending `seq`).
fn check(received: &[Received], written: &Written) -> Check {
    let mut seen = std::collections::HashSet::new();
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    let mut c = Check {
        received: received.len(),
        ..Check::default()
    };
    for m in received {
        if m.headers.get("type").is_some_and(|t| t != "Happened") {
            c.not_inserts += 1;
        }
        if !seen.insert(m.id) {
            c.duplicates += 1;
            continue;
        }
        let Some((aggregate, seq)) = written.committed.get(&m.id) else {
            c.orphans.push(m.id);
            continue;
        };
        let last = last_seq.entry(aggregate.clone()).or_insert(0);
        if *seq <= *last {
            c.order_violations.push(format!(
                "aggregate {aggregate}: seq {seq} (row {}) after seq {last}",
                m.id
            ));
        }
        *last = (*seq).max(*last);
    }
    c.distinct = seen.len();
    c.missing = written
        .committed
        .keys()
        .filter(|id| !seen.contains(id))
        .copied()
        .collect();
    c.missing.sort_unstable();
    c
}

/// The slot's confirmed_flush_lsn as a number (`None` while it does not exist).
async fn confirmed_flush(client: &tokio_postgres::Client, slot: &str) -> Option<i64> {
    client
        .query_opt(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::int8 FROM pg_replication_slots \
             WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ok()
        .flatten()
        .and_then(|r| r.get(0))
}

async fn current_wal(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8", &[])
        .await
        .unwrap()
        .get(0)
}

async fn retained_wal(client: &tokio_postgres::Client, slot: &str) -> Option<i64> {
    client
        .query_opt(
            "SELECT (pg_current_wal_lsn() - restart_lsn)::int8 FROM pg_replication_slots \
             WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ok()
        .flatten()
        .and_then(|r| r.get(0))
}

/// Waits until the slot has confirmed everything written so far: heartbeats (1 s) make
/// it pass the current WAL position once every commit before it is published.
async fn wait_drained(
    client: &tokio_postgres::Client,
    slot: &str,
    relay: &RelayProcess,
    timeout: Duration,
) {
    let target = current_wal(client).await;
    common::wait_for_relays(
        "the slot to confirm everything written",
        timeout,
        &[relay],
        || async { confirmed_flush(client, slot).await.unwrap_or(0) >= target },
    )
    .await;
}

fn print_check(name: &str, c: &Check, w: &Written, extra: &str, started: Instant) {
    println!(
        "{name}: {} committed rows, {} rolled-back rows, {} updates, {} deletes, {} other-table \
         rows; {} messages, {} distinct, {} duplicates, {} missing, {} orphans, {} order \
         violations, {} non-insert messages{extra}, {:?}",
        w.committed.len(),
        w.aborted.len(),
        w.updates,
        w.deletes,
        w.other_rows,
        c.received,
        c.distinct,
        c.duplicates,
        c.missing.len(),
        c.orphans.len(),
        c.order_violations.len(),
        c.not_inserts,
        started.elapsed()
    );
}

fn assert_delivered(c: &Check, w: &Written) {
    assert!(
        w.committed.len() > 100 && !w.aborted.is_empty(),
        "too little load"
    );
    assert!(c.missing.is_empty(), "lost: {:?}", c.missing);
    assert!(c.orphans.is_empty(), "orphans: {:?}", c.orphans);
    assert!(c.order_violations.is_empty(), "{:?}", c.order_violations);
    assert_eq!(c.not_inserts, 0, "updates or deletes were published");
}

/// Runs writers against a relay for `load`, drains, and checks what `consume` returns.
async fn delivery_scenario(
    pg: Pg,
    broker: RelayBroker,
    consume: impl AsyncFnOnce() -> Vec<Received>,
) {
    let started = Instant::now();
    let db = pg.fresh().await;
    create_tables(&db.client).await;
    let guard = SlotGuard::new(&pg.server_url(), "lt");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let yaml = common::log_tailing_yaml(&broker, &guard.slot, true);
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    let client = &db.client;
    // Rows committed before the slot exists are not in its stream: write after it.
    common::wait_slot_active(client, &guard.slot, &relay).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writers = start_writers(&db.url, 4, 12, true, stop.clone());
    // Load for a while; a fixed duration here is pacing, not an assertion.
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, Ordering::Relaxed);
    let written = join_writers(writers).await;
    wait_drained(client, &guard.slot, &relay, Duration::from_secs(60)).await;
    // deleteAfterPublish: every row the writers left is deleted once confirmed.
    common::wait_for_relays(
        "published rows to be deleted",
        Duration::from_secs(30),
        &[&relay],
        || async {
            client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .map(|r| r.get::<_, i64>(0) == 0)
                .unwrap_or(false)
        },
    )
    .await;
    let metrics = relay.metrics().await.unwrap_or_default();
    let status = relay.terminate(Duration::from_secs(20));
    assert!(status.success(), "exit {status}: {}", relay.log());
    let received = consume().await;
    let c = check(&received, &written);
    print_check(
        &format!("log tailing delivery ({pg:?})"),
        &c,
        &written,
        "",
        started,
    );
    assert_delivered(&c, &written);
    assert_eq!(c.duplicates, 0, "no crash, yet duplicates");
    assert_eq!(
        common::metric_value(&metrics, "outbox_relay_slot_active"),
        Some(1.0),
        "{metrics}"
    );
    assert!(
        metrics.contains("outbox_relay_slot_wal_status{")
            && metrics.contains("outbox_relay_slot_retained_wal_bytes"),
        "{metrics}"
    );
    drop(guard);
}

/// The relay never creates its slot or publication (the operator does, and drops them
/// on delete): without them it waits, says why, and starts streaming once they exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_relay_waits_for_its_slot_and_never_creates_it() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    create_tables(&db.client).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: common::fresh_topic(1).await,
    };
    let guard = SlotGuard::new(rig.pg_url(), "lt");
    let relay = RelayProcess::start(
        &common::log_tailing_yaml(&broker, &guard.slot, true),
        &db.url,
        &broker,
    );
    common::wait_for_relays(
        "the relay to report the missing slot",
        Duration::from_secs(60),
        &[&relay],
        || async { relay.log().contains("the operator creates them") },
    )
    .await;
    let objects: (i64, i64) = db
        .client
        .query_one(
            "SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1), \
                    (SELECT count(*) FROM pg_publication WHERE pubname = $1)",
            &[&guard.slot],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(objects, (0, 0), "the relay created replication objects");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    drop(relay);
    drop(guard);
}

async fn delivery_to_kafka(pg: Pg) {
    let rig = common::Rig::load();
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    delivery_scenario(pg, broker, async move || {
        tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_delivers_inserts_in_commit_order_to_kafka() {
    delivery_to_kafka(Pg::V15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_delivers_inserts_in_commit_order_to_kafka_on_postgresql_18() {
    delivery_to_kafka(Pg::V18).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_delivers_inserts_in_commit_order_to_nats() {
    let rig = common::Rig::load();
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    delivery_scenario(Pg::V15, broker, async move || {
        common::consume_nats(&stream).await
    })
    .await;
}

const KILLS: usize = 22;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_relay_survives_sigkill_mid_stream_under_load() {
    sigkill_scenario(Pg::V15, KILLS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_relay_survives_sigkill_mid_stream_under_load_on_postgresql_18() {
    // Fewer kills: the same code path, and CI time is shared.
    sigkill_scenario(Pg::V18, KILLS / 3).await;
}

async fn sigkill_scenario(pg: Pg, kill_count: usize) {
    let started = Instant::now();
    let rig = common::Rig::load();
    let db = pg.fresh().await;
    create_tables(&db.client).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let guard = SlotGuard::new(&pg.server_url(), "lt");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let yaml = common::log_tailing_yaml(&broker, &guard.slot, true);
    let client = &db.client;
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_slot_active(client, &guard.slot, &relay).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writers = start_writers(&db.url, 4, 16, true, stop.clone());
    let mut kills = 0;
    for _ in 0..kill_count {
        // Kill only once this relay has confirmed something new, so every kill lands
        // while it streams and publishes; a random delay spreads kills over the
        // receive/publish/confirm/delete steps.
        let before = confirmed_flush(client, &guard.slot).await.unwrap_or(0);
        common::wait_for_relays(
            "the relay to confirm new commits",
            Duration::from_secs(60),
            &[&relay],
            || async { confirmed_flush(client, &guard.slot).await.unwrap_or(0) > before },
        )
        .await;
        let pause = rand::rng().random_range(0..40);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        relay.kill();
        kills += 1;
        relay = RelayProcess::start(&yaml, &db.url, &broker);
    }
    stop.store(true, Ordering::Relaxed);
    let written = join_writers(writers).await;
    wait_drained(client, &guard.slot, &relay, Duration::from_secs(120)).await;
    let status = relay.terminate(Duration::from_secs(20));
    assert!(status.success(), "exit {status}: {}", relay.log());
    drop(guard);
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let c = check(&received, &written);
    print_check(
        &format!("log tailing crash test ({pg:?})"),
        &c,
        &written,
        &format!(", {kills} SIGKILLs"),
        started,
    );
    assert_eq!(kills, kill_count);
    assert_delivered(&c, &written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_slot_advances_through_heartbeats_and_retains_no_growing_wal() {
    idle_slot_scenario(Pg::V15).await;
}

async fn idle_slot_scenario(pg: Pg) {
    let rig = common::Rig::load();
    let db = pg.fresh().await;
    create_tables(&db.client).await;
    let topic = common::fresh_topic(1).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic,
    };
    let guard = SlotGuard::new(&pg.server_url(), "lt");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let relay = RelayProcess::start(
        &common::log_tailing_yaml(&broker, &guard.slot, true),
        &db.url,
        &broker,
    );
    let client = &db.client;
    // No outbox row is ever written. The slot must still advance, several times.
    let mut positions = Vec::new();
    for _ in 0..4 {
        let last = positions.last().copied().unwrap_or(0);
        let next = common::wait_for_some_or(
            "the idle slot's confirmed_flush_lsn to advance",
            Duration::from_secs(30),
            || relay.log_tail(40),
            || async {
                confirmed_flush(client, &guard.slot)
                    .await
                    .filter(|p| *p > last)
            },
        )
        .await;
        positions.push(next);
    }
    // WAL written by other tables of this database (not published): without
    // confirmations the slot would retain all of it.
    for _ in 0..8 {
        client
            .batch_execute(
                "INSERT INTO public.other_events (aggregateid, payload) \
                 SELECT 'x', jsonb_build_object('pad', repeat('x', 1000)) \
                 FROM generate_series(1, 4000)",
            )
            .await
            .unwrap();
    }
    let written_to = current_wal(client).await;
    let retained_after_writes = retained_wal(client, &guard.slot).await.unwrap_or(0);
    // Passing the WAL position after the writes shows the heartbeats confirmed past
    // them; PostgreSQL then moves restart_lsn on at its next running-xacts record.
    common::wait_for_relays(
        "the slot to confirm past the other table's WAL",
        Duration::from_secs(30),
        &[&relay],
        || async { confirmed_flush(client, &guard.slot).await.unwrap_or(0) >= written_to },
    )
    .await;
    let bound = 8 * 1024 * 1024;
    let retained = common::wait_for_some_or(
        "the slot's retained WAL to shrink below 8 MiB",
        Duration::from_secs(90),
        || relay.log_tail(40),
        || async {
            retained_wal(client, &guard.slot)
                .await
                .filter(|r| *r < bound)
        },
    )
    .await;
    // The relay's own gauge follows (it reads pg_replication_slots every 3 s). The
    // cluster's WAL is shared with the tests running beside this one, and the slot's
    // retained WAL (the server's WAL position minus the slot's restart_lsn) grows with
    // their writes until restart_lsn moves on at the next running-xacts record: in a
    // busy run the 3 s samples stayed above 8 MiB for 30 s after the query above had
    // caught a moment below it. The gauge must show the slot well below what it
    // retained right after this test's writes.
    let gauge_bound = (retained_after_writes / 2).max(bound) as f64;
    let metric = common::wait_for_some_or(
        "outbox_relay_slot_retained_wal_bytes to drop below half of the WAL retained after the writes",
        Duration::from_secs(60),
        || relay.log_tail(40),
        || async {
            relay
                .metric("outbox_relay_slot_retained_wal_bytes")
                .await
                .filter(|v| *v < gauge_bound)
        },
    )
    .await;
    println!(
        "heartbeat test ({pg:?}): confirmed_flush_lsn advanced {:?}; retained WAL {retained_after_writes} \
         bytes right after ~40 MB of other-table writes, then {retained} bytes; metric {metric}",
        positions
    );
    assert!(
        retained_after_writes > retained,
        "retained WAL did not shrink"
    );
    drop(relay);
    drop(guard);
}

// ---------------------------------------------------------------------------------------
// Outages: a private PostgreSQL restarted, a private NATS stopped for a while, under
// writers; one relay process throughout must recover by itself.

/// How long the server stays down.
const OUTAGE: Duration = Duration::from_secs(10);

/// `confirmed_flush_lsn` on a fresh connection (`None` while the database is down).
async fn confirmed_flush_at(url: &str, slot: &str) -> Option<i64> {
    let client = common::pg_connect(url).await.ok()?;
    confirmed_flush(&client, slot).await
}

/// The committed rows, read from the table (deleteAfterPublish is off here): writers
/// cannot know whether a commit whose answer an outage swallowed happened.
async fn committed_from_table(url: &str) -> HashMap<i64, (String, i64)> {
    let client = common::pg_connect(url).await.unwrap();
    client
        .query(
            "SELECT id, aggregateid, (payload->>'seq')::int8 FROM public.outbox",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
}

/// Writers and one relay on `db_url`; `outage` stops and starts a server in the middle.
async fn outage_scenario(
    name: &str,
    db_url: &str,
    admin_url: &str,
    broker: RelayBroker,
    outage: impl FnOnce(),
    consume: impl AsyncFnOnce() -> Vec<Received>,
) {
    let started = Instant::now();
    let guard = SlotGuard::new(admin_url, "lt");
    {
        let client = common::pg_connect(db_url).await.unwrap();
        create_tables(&client).await;
        common::create_replication(&client, &guard.slot, &guard.slot).await;
    }
    let yaml = common::log_tailing_yaml(&broker, &guard.slot, false);
    let mut relay = RelayProcess::start(&yaml, db_url, &broker);
    {
        let client = common::pg_connect(db_url).await.unwrap();
        common::wait_slot_active(&client, &guard.slot, &relay).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writers = start_writers(db_url, 3, 10, false, stop.clone());
    let before = confirmed_flush_at(db_url, &guard.slot).await.unwrap_or(0);
    common::wait_for_relays(
        "the relay to confirm commits before the outage",
        Duration::from_secs(60),
        &[&relay],
        || async { confirmed_flush_at(db_url, &guard.slot).await.unwrap_or(0) > before },
    )
    .await;
    // The outage runs on a blocking thread: stopping and starting take seconds.
    tokio::task::block_in_place(outage);
    let after = confirmed_flush_at(db_url, &guard.slot).await.unwrap_or(0);
    common::wait_for_relays(
        "the relay to confirm commits after the outage",
        Duration::from_secs(90),
        &[&relay],
        || async { confirmed_flush_at(db_url, &guard.slot).await.unwrap_or(0) > after },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut written = join_writers(writers).await;
    let target = {
        let client = common::pg_connect(db_url).await.unwrap();
        current_wal(&client).await
    };
    common::wait_for_relays(
        "the slot to confirm everything written",
        Duration::from_secs(90),
        &[&relay],
        || async { confirmed_flush_at(db_url, &guard.slot).await.unwrap_or(0) >= target },
    )
    .await;
    assert!(relay.is_running(), "the relay exited: {}", relay.log());
    let status = relay.terminate(Duration::from_secs(20));
    assert!(status.success(), "exit {status}: {}", relay.log());
    drop(guard);
    written.committed = committed_from_table(db_url).await;
    let received = consume().await;
    let c = check(&received, &written);
    print_check(name, &c, &written, &format!(", {OUTAGE:?} outage"), started);
    assert_delivered(&c, &written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_recovers_from_a_postgres_restart() {
    let rig = common::Rig::load();
    let mut pg = common::private::PrivatePostgres::start_new();
    let url = pg.url();
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    outage_scenario(
        "log tailing postgres restart",
        &url,
        &url,
        broker,
        || {
            pg.stop();
            std::thread::sleep(OUTAGE);
            pg.start();
        },
        async move || {
            tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                .await
                .unwrap()
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_recovers_from_a_nats_outage() {
    let rig = common::Rig::load();
    let mut nats = common::private::PrivateNats::start_new();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let stream = common::stream_on(client).await;
    let broker = RelayBroker::Nats {
        url: nats.url(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let db = common::fresh_database().await;
    outage_scenario(
        "log tailing NATS outage",
        &db.url,
        rig.pg_url(),
        broker,
        || {
            nats.stop();
            std::thread::sleep(OUTAGE);
            nats.start();
        },
        async move || common::consume_nats(&stream).await,
    )
    .await;
}

/// A database user who must log in with a password, md5 or SCRAM-SHA-256 (the rig's
/// pg_hba.conf asks members of `outbox_<method>_users` for one): the log-tailing relay
/// streams, publishes and deletes with it, on its query and its replication connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_logs_in_with_md5_and_scram_passwords() {
    let rig = common::Rig::load();
    for (method, encryption) in [("md5", "md5"), ("scram", "scram-sha-256")] {
        let db = common::fresh_database().await;
        create_tables(&db.client).await;
        let group = format!("outbox_{method}_users");
        let user = format!("relay_{method}_{}", common::unique_suffix());
        let password = "s3cret-Pw_1";
        db.client
            .batch_execute(&format!(
                "DO $$ BEGIN CREATE ROLE {group} NOLOGIN; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;
                 SET password_encryption = '{encryption}';
                 CREATE ROLE {user} LOGIN REPLICATION PASSWORD '{password}' IN ROLE {group};
                 GRANT SELECT, DELETE ON public.outbox TO {user};"
            ))
            .await
            .unwrap_or_else(|e| panic!("creating {user}: {e}"));
        let stored: String = db
            .client
            .query_one(
                "SELECT rolpassword FROM pg_authid WHERE rolname = $1",
                &[&user],
            )
            .await
            .unwrap()
            .get(0);
        let prefix = if method == "md5" {
            "md5"
        } else {
            "SCRAM-SHA-256$"
        };
        assert!(stored.starts_with(prefix), "{user} stored {prefix}…");
        let trusted: tokio_postgres::Config = db.url.parse().unwrap();
        let host = match &trusted.get_hosts()[0] {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            other => panic!("the rig's database is not on TCP: {other:?}"),
        };
        let at = format!(
            "{host}:{}/{}",
            trusted.get_ports()[0],
            trusted.get_dbname().unwrap()
        );
        let url = format!("postgres://{user}:{password}@{at}");
        // Without the password the server refuses: the login really needs it.
        let refused = common::pg_connect(&format!("postgres://{user}@{at}")).await;
        assert!(refused.is_err(), "{user} logged in without a password");

        let stream = common::fresh_stream().await;
        let broker = RelayBroker::Nats {
            url: rig.nats_url().to_owned(),
            subject: format!("{}.orders", stream.subject_prefix),
        };
        let guard = SlotGuard::new(rig.pg_url(), method);
        common::create_replication(&db.client, &guard.slot, &guard.slot).await;
        let relay = RelayProcess::start(
            &common::log_tailing_yaml(&broker, &guard.slot, true),
            &url,
            &broker,
        );
        for i in 0..20 {
            common::insert_row(
                &db.client,
                "order",
                &format!("a{}", i % 3),
                &serde_json::json!({"i": i}),
            )
            .await;
        }
        common::wait_for_relays(
            &format!("the {method} user's relay to publish and delete every row"),
            Duration::from_secs(60),
            &[&relay],
            || async { common::unpublished_rows(&db.client).await == 0 },
        )
        .await;
        // And confirms it: the role, no superuser, can read what publishes the table
        // (the check once failed for it with "permission denied for schema pg_toast",
        // so nothing was ever confirmed and the slot kept all WAL).
        let written: String = db
            .client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        common::wait_for_relays(
            &format!("the {method} user's relay to confirm every row"),
            Duration::from_secs(60),
            &[&relay],
            || async {
                db.client
                    .query_one(
                        "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots \
                         WHERE slot_name = $1",
                        &[&guard.slot, &written],
                    )
                    .await
                    .is_ok_and(|r| r.get::<_, bool>(0))
            },
        )
        .await;
        let backends: i64 = db
            .client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = $1",
                &[&user],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            backends >= 2,
            "{user} has {backends} sessions, expected query + walsender"
        );
        drop(relay);
        db.client
            .batch_execute(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{user}'"
            ))
            .await
            .unwrap();
        drop(guard);
        db.drop_database().await;
        let admin = common::pg_admin().await;
        let _ = admin
            .batch_execute(&format!("DROP ROLE IF EXISTS {user}"))
            .await;
    }
}

/// `deleteAfterPublish`: a relay killed after the broker acknowledged a batch but before
/// its rows were deleted leaves none of them behind. The rows' commit is confirmed only
/// once they are deleted, so the server streams it again to the next relay, which
/// publishes them again (duplicates allowed) and deletes them. (Before, the commit was
/// confirmed first and the ids waited for deletion in memory: the kill left the rows in
/// the table for good.) The test blocks the relay's DELETE with a trigger waiting on an
/// advisory lock it holds, then kills the relay and the blocked backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_before_deleting_published_rows_leaves_none_behind() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    create_tables(&db.client).await;
    let key = rand::rng().random_range(1_000_000..2_000_000i64);
    db.client
        .batch_execute(&format!(
            "CREATE FUNCTION public.hold_delete() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_advisory_xact_lock_shared({key}); RETURN OLD; END $$;
             CREATE TRIGGER hold_delete BEFORE DELETE ON public.outbox
               FOR EACH ROW EXECUTE FUNCTION public.hold_delete();"
        ))
        .await
        .unwrap();
    let holder = common::pg_connect(&db.url).await.unwrap();
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .unwrap();
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let guard = SlotGuard::new(rig.pg_url(), "delkill");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let yaml = common::log_tailing_yaml(&broker, &guard.slot, true);
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    let mut ids = BTreeSet::new();
    for i in 0..10 {
        let aggregate = format!("agg-{}", i % 3);
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
    common::wait_for_relays(
        "the broker to hold all 10 events",
        Duration::from_secs(60),
        &[&relay],
        || async {
            let got: BTreeSet<i64> = common::consume_nats(&stream)
                .await
                .iter()
                .map(|r| r.id)
                .collect();
            got.is_superset(&ids)
        },
    )
    .await;
    // Long enough for any confirmation to reach the server (sent every second).
    tokio::time::sleep(Duration::from_secs(3)).await;
    relay.kill();
    // The relay's DELETE still waits on the lock in its backend: end it too.
    db.client
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
        )
        .await
        .unwrap();
    holder
        .execute("SELECT pg_advisory_unlock($1)", &[&key])
        .await
        .unwrap();
    assert_eq!(
        db.client
            .query_one("SELECT count(*) FROM public.outbox", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        10,
        "the blocked delete deleted nothing"
    );
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_for_relays(
        "the next relay to publish the rows again and delete them",
        Duration::from_secs(60),
        &[&relay],
        || async {
            db.client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .map(|r| r.get::<_, i64>(0) == 0)
                .unwrap_or(false)
        },
    )
    .await;
    drop(relay);
    drop(guard);
    db.drop_database().await;
}

/// `deleteAfterPublish` deletes through the primary key whatever integer type the id
/// column has, and so does the move into an archive table. The statement once cast the
/// column (`id::int8 = ANY($1)`), which no index serves: on a `serial` id every chunk
/// of 1,000 deletes read the whole table. Checked on the plan PostgreSQL chooses for the
/// relay's own statements, and by running them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_rows_are_deleted_through_the_primary_key_for_every_integer_id_type() {
    use outbox_operator::postgres::removal::Removal;
    let db = common::fresh_database().await;
    for ty in ["smallint", "integer", "bigint"] {
        let table = format!("outbox_{ty}");
        db.client
            .batch_execute(&format!(
                "CREATE TABLE public.{table} (id {ty} PRIMARY KEY, payload text NOT NULL);
                 INSERT INTO public.{table} SELECT i, repeat('x', 100) FROM generate_series(1, 20000) AS i;
                 ANALYZE public.{table};
                 CREATE TABLE public.{table}_archive (LIKE public.{table}, published_at timestamptz NOT NULL);"
            ))
            .await
            .unwrap();
        let archive = outbox_operator::spec::Archive {
            schema: "public".to_owned(),
            name: format!("{table}_archive"),
        };
        for (archive, first) in [(None, 1), (Some(&archive), 2)] {
            let removal = Removal::resolve(
                &db.client,
                ("public", &table),
                "id",
                outbox_operator::postgres::table::IdKind::Int,
                archive,
                "published_at",
            )
            .await
            .unwrap_or_else(|err| panic!("{ty} id: {err}"));
            assert_eq!(removal.archives(), archive.is_some());
            let sql = removal.sql();
            // Odd ids (deleting), then even ones (moving): rows still there.
            let ids: Vec<i64> = (1..=1000).map(|i| 2 * i - 2 + first).collect();
            let plan: Vec<String> = db
                .client
                .query(&format!("EXPLAIN {sql}"), &[&ids])
                .await
                .unwrap_or_else(|err| panic!("EXPLAIN {sql}: {err}"))
                .iter()
                .map(|r| r.get(0))
                .collect();
            let plan = plan.join("\n");
            assert!(
                plan.contains(&format!("Index Scan using {table}_pkey"))
                    && !plan.contains("Seq Scan"),
                "{ty} id: {sql} does not go through the primary key:\n{plan}"
            );
            let row_ids: Vec<outbox_operator::postgres::RowId> =
                ids.iter().map(|i| (*i).into()).collect();
            let removed = removal.remove(&db.client, &row_ids).await.unwrap();
            assert_eq!(removed, 1000, "{ty} id: rows taken out by {sql}");
        }
        let archived: i64 = db
            .client
            .query_one(&format!("SELECT count(*) FROM public.{table}_archive"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(archived, 1000, "{ty} id: rows archived");
    }
}
