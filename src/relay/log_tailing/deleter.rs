//! The delete task of `deleteAfterPublish`: deletes the confirmed rows it is handed,
//! in chunks, on a connection of its own, off the path from stream to broker.

use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;

use super::DELETE_CHUNK;
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
}

/// Deletes the ids it is handed, in chunks, on its own connection; reconnects with
/// backoff when the database is away. Ends when the channel closes and everything
/// handed over is deleted, or, once shutdown began, after a few failed attempts.
pub(super) async fn delete_loop(
    target: DeleteTarget,
    mut ids_rx: mpsc::UnboundedReceiver<Vec<i64>>,
    stop: watch::Receiver<bool>,
) {
    let mut client: Option<Client> = None;
    let mut backoff = Backoff::new();
    while let Some(mut ids) = ids_rx.recv().await {
        // Whatever else is already queued goes out with it.
        while let Ok(more) = ids_rx.try_recv() {
            ids.extend(more);
        }
        for chunk in ids.chunks(DELETE_CHUNK) {
            let mut failures = 0u32;
            loop {
                let result = match &client {
                    Some(c) if !c.is_closed() => repl::delete_rows(
                        c,
                        &target.schema,
                        &target.table,
                        &target.id_column,
                        chunk,
                    )
                    .await
                    .map(|_| ()),
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
                            tracing::warn!(error = %err, rows = ids.len(), "shutting down with published rows not deleted; they stay in the table");
                            return;
                        }
                        tracing::warn!(error = %err, "deleting published rows failed; retrying");
                        client = None;
                        tokio::time::sleep(backoff.step()).await;
                    }
                }
            }
        }
    }
}
