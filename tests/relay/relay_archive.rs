//! `afterPublish: archive` (polling) and `spec.table.archive` (log tailing with
//! `deleteAfterPublish`): published rows move from the outbox table to the archive in
//! the statement that takes them out, with the time of the move.
//!
//! The crash runs (relay_ids_faults.rs) archive a uuid table under SIGKILLs and use the
//! helpers here: an archive without a key (so a row archived twice would show as two
//! rows, not as a refused insert), a watch for a row in both tables at once, and the
//! final check that every row written is archived exactly once. The tests here show the
//! retention: rows archived longer ago than `retention.publishedRows` are deleted from
//! the archive, younger ones stay.

use crate::common;
use crate::relay_ids::{self, IdKind, Mode, Written};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use common::{RelayBroker, RelayProcess};

/// Creates `public.outbox_archive`: the outbox table's columns and `published_at`, no
/// key and no default for the time (the relay sets it).
pub(crate) async fn create_archive(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "CREATE TABLE public.outbox_archive (LIKE public.outbox, published_at timestamptz NOT NULL)",
        )
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: creating the archive failed: {err}"));
}

/// `yaml` (relay_ids.rs's relay on `public.outbox`) archiving into `outbox_archive`:
/// polling with `afterPublish: archive`, log tailing with the archive named.
pub(crate) fn archiving(yaml: &str) -> String {
    common::with_spec_line(
        &yaml.replace("afterPublish: delete", "afterPublish: archive"),
        "table",
        "{schema: public, name: outbox, archive: {}}",
    )
}

/// Watches, until `stop`, for rows that are in the outbox table and the archive at once
/// (one statement, so one snapshot); the largest number seen.
pub(crate) fn watch_both_tables(
    url: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let client = common::pg_connect(&url)
            .await
            .unwrap_or_else(|err| panic!("watcher: connecting failed: {err}"));
        let most = AtomicI64::new(0);
        while !stop.load(Ordering::Relaxed) {
            let both: i64 = client
                .query_one(
                    "SELECT count(*) FROM public.outbox o JOIN public.outbox_archive a USING (id)",
                    &[],
                )
                .await
                .unwrap_or_else(|err| panic!("watcher: {err}"))
                .get(0);
            most.fetch_max(both, Ordering::Relaxed);
            // Pacing of the watch, not a wait for an outcome.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        most.load(Ordering::Relaxed)
    })
}

/// Every row written is in the archive exactly once, with its payload and a time of the
/// move, and nothing else is; the outbox table is empty.
pub(crate) async fn check_archived_once(client: &tokio_postgres::Client, written: &Written) {
    let left: i64 = client
        .query_one("SELECT count(*) FROM public.outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "rows left in the outbox table");
    let rows = client
        .query(
            "SELECT id::text, payload::text, published_at IS NOT NULL AND published_at >= created_at \
             FROM public.outbox_archive",
            &[],
        )
        .await
        .unwrap();
    let mut copies: HashMap<String, usize> = HashMap::new();
    for row in &rows {
        let id: String = row.get(0);
        let payload: Option<String> = row.get(1);
        assert!(
            row.get::<_, bool>(2),
            "row {id}: no or an early time of the move"
        );
        let Some(stored) = written.payload_of(&id) else {
            panic!("archived row {id} was never written");
        };
        let json = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap();
        assert_eq!(
            payload.as_deref().map(json),
            Some(json(stored)),
            "row {id}: archived payload"
        );
        *copies.entry(id).or_default() += 1;
    }
    let twice: Vec<&String> = copies
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| id)
        .collect();
    assert!(twice.is_empty(), "rows archived more than once: {twice:?}");
    let lost: Vec<&String> = written
        .order
        .iter()
        .filter(|id| !copies.contains_key(*id))
        .collect();
    assert!(
        lost.is_empty(),
        "{} rows written are in neither table, first {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
}

/// Rows in the archive, by whether they were archived in the past hour or in the
/// future (`(recent, future, all)`).
async fn archive_ages(client: &tokio_postgres::Client) -> (i64, i64, i64) {
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE published_at BETWEEN now() - interval '1 hour' AND now()), \
                    count(*) FILTER (WHERE published_at > now()), count(*) \
             FROM public.outbox_archive",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// A relay in `mode` archives 50 uuid rows with `retention.publishedRows: 10s`; the
/// archive already holds a row moved two days ago and one stamped an hour ahead. The
/// old row goes at the first retention pass (a quarter of the retention in); the relay's
/// rows are all archived and then go once 10 s have passed; the row ahead stays:
/// retention goes by the time of the move, never deletes a younger row, and runs in
/// both modes.
async fn retention_trims_the_archive(mode: Mode) {
    let rig = common::Rig::load();
    let mut db = common::fresh_database().await;
    relay_ids::create_table(&db.client, IdKind::Uuid).await;
    create_archive(&db.client).await;
    db.client
        .batch_execute(
            "INSERT INTO public.outbox_archive (id, aggregatetype, aggregateid, type, payload, created_at, published_at) VALUES
               (gen_random_uuid(), 'Order', 'old', 'Happened', '{}', now() - interval '3 days', now() - interval '2 days'),
               (gen_random_uuid(), 'Order', 'ahead', 'Happened', '{}', now(), now() + interval '1 hour')",
        )
        .await
        .unwrap();
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let (yaml, guard) = relay_ids::relay_yaml(&db, &broker, mode, "50ms", "archret").await;
    let yaml = common::with_spec_line(&archiving(&yaml), "retention", "{publishedRows: 10s}");
    assert!(yaml.contains("publishedRows: 10s"), "{yaml}");
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    if let Some(guard) = &guard {
        common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    }
    let mut written = Written::default();
    relay_ids::write(&mut db.client, IdKind::Uuid, 10, &mut written).await;
    let client = &db.client;
    // Every row leaves the outbox table; each is archived (the archive counts them even
    // if the first retention pass already ran: they are younger than 10 s then).
    common::wait_for_relays(
        "every row moved to the archive, and the two-day-old row trimmed",
        Duration::from_secs(60),
        &[&relay],
        || async {
            let left: i64 = client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .unwrap()
                .get(0);
            let (recent, future, all) = archive_ages(client).await;
            left == 0 && future == 1 && all == recent + future
        },
    )
    .await;
    let (recent, _, _) = archive_ages(client).await;
    assert!(
        recent > 0,
        "{mode:?}: the relay's rows were trimmed before they were seen; relay log:\n{}",
        relay.log_tail(30)
    );
    // Then the relay's rows, once older than the retention; the row ahead stays.
    common::wait_for_relays(
        "the archived rows trimmed once 10 s old",
        Duration::from_secs(60),
        &[&relay],
        || async { archive_ages(client).await == (0, 1, 1) },
    )
    .await;
    let deliveries = relay_ids::drain(&relay_ids::Sink::Nats(stream), written.order.len()).await;
    let report = relay_ids::check(&deliveries, &written);
    assert!(
        report.missing.is_empty() && report.orphans.is_empty(),
        "{mode:?}: {} missing, {} orphans",
        report.missing.len(),
        report.orphans.len()
    );
    drop(relay);
    drop(guard);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_retention_trims_the_archive_by_the_time_of_the_move() {
    retention_trims_the_archive(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_retention_trims_the_archive_by_the_time_of_the_move() {
    retention_trims_the_archive(Mode::LogTailing).await;
}

/// A table polled with `afterPublish: mark` until now, switched to `archive`: the rows
/// marked before are published already, so they are neither sent again nor archived,
/// and retention still deletes them from the outbox table once past it (before, only
/// `mark` ran that retention, and a switch left marked rows in the table for good);
/// the rows not yet published are sent and archived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_mark_to_archive_archives_new_rows_and_retention_clears_the_marked_ones() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    let client = &db.client;
    common::create_outbox_table(client, 4).await;
    let marked = common::commit_rows(client, "marked", 20).await;
    client
        .execute(
            "UPDATE public.outbox SET published_at = now() - interval '2 days' WHERE id = ANY($1)",
            &[&marked],
        )
        .await
        .unwrap();
    let waiting = common::commit_rows(client, "new", 30).await;
    // The table has `published_at` already: the archive's comes with LIKE.
    client
        .batch_execute("CREATE TABLE public.outbox_archive (LIKE public.outbox)")
        .await
        .unwrap();
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let yaml = common::relay_config_yaml(
        &broker,
        &common::RelayOptions {
            retention: "10s",
            ..common::RelayOptions::default()
        },
    )
    .replace("afterPublish: mark", "afterPublish: archive");
    let yaml = common::with_spec_line(
        &yaml,
        "table",
        "{schema: public, name: outbox, headers: [traceparent], archive: {}}",
    );
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    common::wait_for_relays(
        "the new rows archived and the marked ones deleted",
        Duration::from_secs(60),
        &[&relay],
        || async {
            let row = client
                .query_one(
                    "SELECT (SELECT count(*) FROM public.outbox), \
                            (SELECT count(*) FROM public.outbox_archive)",
                    &[],
                )
                .await
                .unwrap();
            (row.get::<_, i64>(0), row.get::<_, i64>(1)) == (0, 30)
        },
    )
    .await;
    let archived: Vec<i64> = client
        .query("SELECT id FROM public.outbox_archive ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(archived, waiting, "the archive holds the new rows only");
    // The rows left the table after their broker acknowledgements: all are in the stream.
    let mut sent: Vec<i64> = common::consume_nats(&stream)
        .await
        .iter()
        .map(|m| m.id)
        .collect();
    sent.sort_unstable();
    sent.dedup();
    assert_eq!(sent, waiting, "only the new rows are published");
    drop(relay);
    db.drop_database().await;
}
