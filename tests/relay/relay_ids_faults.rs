//! Random (`gen_random_uuid()`) outbox ids under faults: the promise of relay_ids.rs —
//! every row arrives under its id's text, nothing else arrives, payloads are the stored
//! ones, each aggregate's first deliveries keep insertion order — holds when the relay
//! is SIGKILLed again and again under a steady writer (polling and log tailing), and
//! when log tailing back-fills the rows a publication change left in the table.
//!
//! Random uuids say nothing about insertion order, so a relay that fell back on the id
//! to order a batch, a restart's backlog or a back-fill would break per-aggregate order;
//! one that lost its place across a crash would lose rows or send unknown ids.
//!
//! The table, the writer (transactions of five rows over five aggregates, each row with
//! its aggregate's next `seq`), the Kafka reader and the checker are relay_ids.rs's.

use crate::common;
use crate::relay_archive;
use crate::relay_ids::{self, IdKind, Mode, Sink, Written};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{RelayBroker, RelayProcess, SlotGuard};
use rand::Rng;

/// SIGKILLs per crash test.
const KILLS: usize = 5;

/// A fresh database with relay_ids.rs's uuid table, and a fresh 3-partition topic.
async fn uuid_table_and_topic() -> (common::TestDatabase, RelayBroker, String) {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    relay_ids::create_table(&db.client, IdKind::Uuid).await;
    let topic = common::fresh_topic(3).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    (db, broker, topic)
}

/// `yaml` for the table relay_ids.rs makes (Debezium's columns, no header columns).
fn debezium_table(yaml: &str) -> String {
    common::with_spec_line(yaml, "table", "{schema: public, name: outbox}")
}

async fn rows_left(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM public.outbox", &[])
        .await
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

/// Waits until every row is published and deleted.
async fn wait_table_empty(client: &tokio_postgres::Client, relay: &RelayProcess, within: Duration) {
    common::wait_for_relays(
        "every row published and deleted",
        within,
        &[relay],
        || async { rows_left(client).await == 0 },
    )
    .await;
}

/// Reads the whole topic back and checks every delivery against `written`: nothing
/// lost, nothing unknown, payloads and keys as stored, per-aggregate first deliveries
/// in `seq` order. Returns the number of duplicates (allowed).
async fn read_and_check(topic: &str, written: &Written, label: &str, started: Instant) -> usize {
    let deliveries = relay_ids::drain(&Sink::Kafka(topic.to_owned()), written.order.len()).await;
    let report = relay_ids::check(&deliveries, written);
    println!(
        "{label}: {} rows written, {} messages, {} duplicates, {} missing, {} orphans, \
         {} order violations, {} mismatches, {:?}",
        written.order.len(),
        report.received,
        report.duplicates,
        report.missing.len(),
        report.orphans.len(),
        report.order_violations.len(),
        report.mismatches.len(),
        started.elapsed()
    );
    assert!(
        report.orphans.is_empty(),
        "message ids of no row (the ids written look like {:?}): {:?}",
        &written.order[..3.min(written.order.len())],
        report.orphans
    );
    assert!(
        report.missing.is_empty(),
        "{} rows lost, first {:?}",
        report.missing.len(),
        &report.missing[..report.missing.len().min(10)]
    );
    assert!(
        report.mismatches.is_empty(),
        "messages that disagree with their row: {:?}",
        report.mismatches
    );
    assert!(
        report.order_violations.is_empty(),
        "per-aggregate order of first deliveries broken: {:?}",
        report.order_violations
    );
    report.duplicates
}

/// A writer task: one transaction of relay_ids.rs's writer after another, paced, until
/// `stop`; returns what it committed.
fn start_writer(url: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Written> {
    tokio::spawn(async move {
        let mut client = common::pg_connect(&url)
            .await
            .unwrap_or_else(|err| panic!("writer: connecting failed: {err}"));
        let mut written = Written::default();
        while !stop.load(Ordering::Relaxed) {
            relay_ids::write(&mut client, IdKind::Uuid, 1, &mut written).await;
            // Pacing, not an assertion: a steady load rather than a flood.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        written
    })
}

/// Messages `relay` (this process) published so far.
async fn published_by(relay: &RelayProcess) -> f64 {
    relay
        .metric("outbox_relay_published_total")
        .await
        .unwrap_or(0.0)
}

/// `slot`'s `confirmed_flush_lsn` as bytes from 0/0 (0 when unknown).
async fn confirmed_flush(client: &tokio_postgres::Client, slot: &str) -> i64 {
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
        .unwrap_or(0)
}

/// A writer commits uuid rows continuously while a relay in `mode` is SIGKILLed
/// [`KILLS`] times, each time once the running process has published a random 5–40
/// messages (tailing: and confirmed past where the slot stood) and a random 0–40 ms
/// later, and restarted on the same config; then the writer stops, the table drains,
/// and every delivery is checked. With `archive`, published rows move to an archive
/// (relay_archive.rs): no row is ever in both tables, and in the end every row written
/// is archived exactly once.
async fn crash_scenario(mode: Mode, archive: bool) {
    let started = Instant::now();
    let (db, broker, topic) = uuid_table_and_topic().await;
    let (yaml, guard) = relay_ids::relay_yaml(&db, &broker, mode, "20ms", "idkill").await;
    let client = &db.client;
    let yaml = if archive {
        relay_archive::create_archive(client).await;
        relay_archive::archiving(&yaml)
    } else {
        yaml
    };

    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    if let Some(guard) = &guard {
        common::wait_slot_active(client, &guard.slot, &relay).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = start_writer(db.url.clone(), stop.clone());
    let watch_stop = Arc::new(AtomicBool::new(false));
    let watching =
        archive.then(|| relay_archive::watch_both_tables(db.url.clone(), watch_stop.clone()));
    let mut kills = 0;
    for _ in 0..KILLS {
        // Kill only once this process publishes (and, tailing, has confirmed something
        // new, as relay_log_tailing.rs's crash test does), so that every kill lands amid
        // its batches and every restart is shown to have resumed; the random threshold
        // and delay spread the kills over select/publish/delete/confirm.
        let (threshold, pause) = {
            let mut rng = rand::rng();
            (rng.random_range(5..=40), rng.random_range(0..40))
        };
        let slot = guard.as_ref().map(|g| g.slot.as_str());
        let before = match slot {
            Some(slot) => confirmed_flush(client, slot).await,
            None => 0,
        };
        common::wait_for_relays(
            "the running relay to publish (and confirm)",
            Duration::from_secs(60),
            &[&relay],
            || async {
                published_by(&relay).await >= f64::from(threshold)
                    && match slot {
                        Some(slot) => confirmed_flush(client, slot).await > before,
                        None => true,
                    }
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(pause)).await;
        relay.kill();
        kills += 1;
        relay = RelayProcess::start(&yaml, &db.url, &broker);
    }
    // The last relay has started (and handles SIGTERM) before the end is looked for:
    // the killed one may have left nothing for it to publish.
    relay.http_addr().await;
    stop.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap_or_else(|err| panic!("writer: {err}"));
    wait_table_empty(client, &relay, Duration::from_secs(120)).await;
    watch_stop.store(true, Ordering::Relaxed);
    let status = relay.terminate(Duration::from_secs(20));
    assert!(
        status.success(),
        "relay exit {status}; log:\n{}",
        relay.log()
    );

    assert_eq!(kills, KILLS);
    assert!(
        written.order.len() >= 200,
        "too little load: {} rows",
        written.order.len()
    );
    read_and_check(
        &topic,
        &written,
        &format!("uuid ids, {mode:?}, {kills} SIGKILLs, archive {archive}"),
        started,
    )
    .await;
    if let Some(watching) = watching {
        let both = watching
            .await
            .unwrap_or_else(|err| panic!("watcher: {err}"));
        assert_eq!(
            both, 0,
            "rows seen in the outbox table and the archive at once"
        );
        relay_archive::check_archived_once(client, &written).await;
    }
    drop(guard);
    db.drop_database().await;
}

/// Polling a uuid table, SIGKILLed 5 times mid-publishing under a steady writer: no row
/// lost, no unknown id, each aggregate's first deliveries in insertion order (the
/// batch select follows `created_at`, then the id, across every restart's backlog);
/// duplicates counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_polled_survive_sigkills_without_loss_or_reordering() {
    crash_scenario(Mode::Polling, false).await;
}

/// Tailing a uuid table's log, SIGKILLed 5 times mid-stream under a steady writer: each
/// restart resumes from the slot without losing a row, sends every uuid as its text,
/// and keeps each aggregate's first deliveries in commit order; duplicates counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_tailed_survive_sigkills_without_loss_or_reordering() {
    crash_scenario(Mode::LogTailing, false).await;
}

/// The polling crash run with `afterPublish: archive`: each batch's rows move to the
/// archive in the transaction that published them, so a relay killed mid-batch leaves
/// every row in exactly one table (watched throughout), and every row written ends up
/// archived exactly once, besides every delivery check above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_polled_and_archived_survive_sigkills_in_exactly_one_table() {
    crash_scenario(Mode::Polling, true).await;
}

/// The log-tailing crash run with an archive: the delete task moves the published rows;
/// a commit streamed again after a kill finds its rows archived already and archives
/// nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_tailed_and_archived_survive_sigkills_in_exactly_one_table() {
    crash_scenario(Mode::LogTailing, true).await;
}

/// Aggregates whose rows left in the table are in another order by id than by
/// `created_at`: where a back-fill ordered by id would reorder them.
async fn aggregates_out_of_id_order(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM (
                SELECT array_agg(id ORDER BY created_at, id) AS by_time,
                       array_agg(id ORDER BY id) AS by_id
                FROM public.outbox GROUP BY aggregateid) a
             WHERE by_time <> by_id",
            &[],
        )
        .await
        .map(|r| r.get(0))
        .unwrap_or_else(|err| panic!("comparing orders: {err}"))
}

async fn alter(client: &tokio_postgres::Client, slot: &str, change: &str) {
    client
        .batch_execute(&format!(
            "ALTER PUBLICATION {slot} {change} TABLE public.outbox"
        ))
        .await
        .unwrap_or_else(|err| panic!("ALTER PUBLICATION {change}: {err}"));
}

/// relay_publication.rs's `a_publication_change_while_no_relay_runs_is_back_filled_when_one_starts`
/// on a uuid table: a log-tailing relay (deleteAfterPublish, with the operator's
/// coverage baseline) publishes 100 rows and stops; the table is dropped from the
/// publication, 50 rows written, added back, 50 more written — rows whose random ids
/// sort otherwise than their `created_at` within some aggregate (checked). A new relay
/// compares with the baseline, publishes every row left in the table oldest first, and
/// streams on: all 200 rows arrive under their uuid's text, nothing unknown, each
/// aggregate's first deliveries in insertion order, and the back-fill counts at least
/// the 50 rows of the window. A relay that skipped the window never empties the table;
/// one that back-filled in id order reorders an aggregate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_left_by_a_publication_change_while_no_relay_runs_are_back_filled_in_order() {
    let started = Instant::now();
    let rig = common::Rig::load();
    let (mut db, broker, topic) = uuid_table_and_topic().await;
    let guard = SlotGuard::new(rig.pg_url(), "idgap");
    let slot = guard.slot.clone();
    common::create_replication(&db.client, &slot, &slot).await;
    let yaml = debezium_table(&common::log_tailing_yaml(&broker, &slot, true));
    // What published the table when the slot was made, as the operator records it.
    let baseline = common::publication_identity(&db.client, &slot).await;
    let start = |yaml: &str| {
        RelayProcess::start_with_files(
            yaml,
            &db.url,
            &broker,
            &[],
            &[("coverage-baseline", &baseline)],
        )
    };

    let mut written = Written::default();
    let mut relay = start(&yaml);
    common::wait_slot_active(&db.client, &slot, &relay).await;
    relay_ids::write(&mut db.client, IdKind::Uuid, 20, &mut written).await;
    wait_table_empty(&db.client, &relay, Duration::from_secs(60)).await;
    let status = relay.terminate(Duration::from_secs(30));
    assert!(
        status.success(),
        "relay exit {status}; log:\n{}",
        relay.log()
    );

    alter(&db.client, &slot, "DROP").await;
    let before_window = written.order.len();
    relay_ids::write(&mut db.client, IdKind::Uuid, 10, &mut written).await;
    let window = written.order.len() - before_window;
    alter(&db.client, &slot, "ADD").await;
    relay_ids::write(&mut db.client, IdKind::Uuid, 10, &mut written).await;
    assert_ne!(
        common::publication_identity(&db.client, &slot).await,
        baseline,
        "the DROP and ADD did not change what publishes the table"
    );
    let reordered = aggregates_out_of_id_order(&db.client).await;
    assert!(
        reordered > 0,
        "the ids left happen to follow created_at in every aggregate"
    );

    let relay = start(&yaml);
    wait_table_empty(&db.client, &relay, Duration::from_secs(60)).await;
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
                .is_some_and(|n| n >= window as f64)
        },
    )
    .await;
    let back_filled = relay
        .metric("outbox_relay_publication_gap_back_filled_total")
        .await
        .unwrap_or_default();
    read_and_check(
        &topic,
        &written,
        &format!(
            "uuid ids, publication change while no relay ran: {window} rows in the window, \
             {back_filled} back-filled, {reordered} aggregates in another order by id"
        ),
        started,
    )
    .await;
    drop(relay);
    drop(guard);
    db.drop_database().await;
}
