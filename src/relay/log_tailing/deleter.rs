//! The delete task of `deleteAfterPublish`: deletes the published rows it is handed,
//! in chunks, on a connection of its own, off the path from stream to broker, and
//! reports through which commit everything is deleted. Only that position is
//! confirmed to the server, so a crash can never confirm a commit whose rows are still
//! in the table: the server streams it again, the rows are published again (a
//! duplicate, as at-least-once allows) and deleted then.
//!
//! A logical walsender can send a commit before the committing session has made it
//! visible to others (PostgreSQL writes and flushes the commit record, then leaves the
//! proc array). A DELETE in that moment finds nothing, and the commit would then be
//! confirmed with its rows left in the table for good. So the task first waits until
//! every transaction it was handed is visible in a fresh snapshot.

use std::time::{Duration, Instant};

use pgwire_replication::Lsn;
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;

use super::DELETE_CHUNK;
use crate::postgres::RowId;
use crate::postgres::removal::Removal;
use crate::postgres::snapshot::all_visible;
use crate::postgres::table::IdKind;
use crate::postgres::{self, replication as repl};
use crate::relay::backoff::Backoff;

/// Where the deleter deletes.
pub(super) struct DeleteTarget {
    pub(super) url: String,
    pub(super) env: String,
    pub(super) tls: crate::postgres::tls::PgTls,
    pub(super) schema: String,
    pub(super) table: String,
    pub(super) id_column: String,
    /// Where published rows are moved instead (`spec.table.archive`).
    pub(super) archive: Option<crate::spec::Archive>,
    /// The archive's time-of-move column (`table.columns.publishedAt`).
    pub(super) moved_at: String,
}

/// One published batch for the delete task.
pub(super) struct Handed {
    /// The commit position that covers the batch.
    pub(super) through: Lsn,
    /// The published row ids.
    pub(super) ids: Vec<RowId>,
    /// The batch's transactions (32-bit xids, as the stream gives them).
    pub(super) xids: Vec<u32>,
    /// Unix time up to which every commit has been streamed with this batch (its last
    /// commit's time, or when a heartbeat came back): once the batch's rows are
    /// deleted, a row inserted before it and still in the table was missed.
    pub(super) passed: Option<f64>,
}

/// The later of two optional times.
pub(super) fn later(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// How long the task waits for handed transactions to become visible before it
/// deletes anyway (a wait this long means something else is wrong; it is logged).
const VISIBLE_WAIT: Duration = Duration::from_secs(30);

/// Waits until every transaction of `xids` is visible to a new snapshot.
async fn wait_visible(client: &Client, xids: &[u32]) -> Result<(), crate::postgres::PgError> {
    if xids.is_empty() {
        return Ok(());
    }
    let started = Instant::now();
    loop {
        let snapshot = repl::current_snapshot(client).await?;
        if all_visible(&snapshot, xids) != Some(false) {
            return Ok(());
        }
        if started.elapsed() > VISIBLE_WAIT {
            tracing::error!(
                snapshot,
                "published transactions still not visible after {VISIBLE_WAIT:?}; deleting anyway"
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// How the target's rows leave the table (deleted, or moved to the archive), resolved
/// from the catalogue once, not once per delete: integer ids need no lookup of the id
/// column's type; a uuid or text id's is read.
async fn removal<'a>(
    client: &Client,
    target: &DeleteTarget,
    known: &'a mut Option<Removal>,
    ids: &[RowId],
) -> Result<&'a Removal, crate::postgres::PgError> {
    let resolved = match known.take() {
        Some(resolved) => resolved,
        None => {
            let kind = if ids.iter().all(|id| id.as_int().is_some()) {
                IdKind::Int
            } else {
                repl::id_kind_of(client, &target.schema, &target.table, &target.id_column).await?
            };
            Removal::resolve(
                client,
                (&target.schema, &target.table),
                &target.id_column,
                kind,
                target.archive.as_ref(),
                &target.moved_at,
            )
            .await?
        }
    };
    Ok(known.insert(resolved))
}

/// Deletes the ids it is handed (each batch with the commit position that covers it),
/// in chunks, on its own connection; reconnects with backoff when the database is
/// away. After each hand-over is deleted, `deleted` says through which position. Ends
/// when the channel closes and everything handed over is deleted, or, once shutdown
/// began, after a few failed attempts.
pub(super) async fn delete_loop(
    target: DeleteTarget,
    mut ids_rx: mpsc::Receiver<Handed>,
    deleted: watch::Sender<Lsn>,
    passed_tx: watch::Sender<f64>,
    stop: watch::Receiver<bool>,
) {
    let mut client: Option<Client> = None;
    let mut resolved: Option<Removal> = None;
    let mut backoff = Backoff::new();
    while let Some(first) = ids_rx.recv().await {
        let Handed {
            mut through,
            mut ids,
            mut xids,
            mut passed,
        } = first;
        // Whatever else is already queued goes out with it.
        while let Ok(more) = ids_rx.try_recv() {
            through = through.max(more.through);
            ids.extend(more.ids);
            xids.extend(more.xids);
            passed = later(passed, more.passed);
        }
        let mut visible = ids.is_empty();
        for chunk in ids.chunks(DELETE_CHUNK) {
            let mut failures = 0u32;
            loop {
                let result = match &client {
                    Some(c) if !c.is_closed() => {
                        let waited = if visible {
                            Ok(())
                        } else {
                            wait_visible(c, &xids).await
                        };
                        match waited {
                            Ok(()) => {
                                visible = true;
                                match removal(c, &target, &mut resolved, chunk).await {
                                    Ok(removal) => removal.remove(c, chunk).await.map(|_| ()),
                                    Err(err) => Err(err),
                                }
                            }
                            Err(err) => Err(err),
                        }
                    }
                    _ => match postgres::connect(&target.url, &target.env, &target.tls).await {
                        Ok(c) => {
                            client = Some(c);
                            continue;
                        }
                        Err(err) => Err(err),
                    },
                };
                match result {
                    Ok(()) => {
                        backoff.reset();
                        break;
                    }
                    Err(err) => {
                        failures += 1;
                        if *stop.borrow() && failures >= 3 {
                            tracing::warn!(error = %err, rows = ids.len(), "shutting down with published rows not deleted; their commits stay unconfirmed and are streamed again");
                            return;
                        }
                        tracing::warn!(error = %err, "taking published rows out of the table failed; retrying");
                        // Read again on the next connection: the table or the
                        // archive may have changed (a column added to both).
                        client = None;
                        resolved = None;
                        tokio::time::sleep(backoff.step()).await;
                    }
                }
            }
        }
        deleted.send_replace(through);
        if let Some(passed) = passed {
            passed_tx.send_if_modified(|p| {
                let newer = passed > *p;
                if newer {
                    *p = passed;
                }
                newer
            });
        }
    }
}
