//! A polling process's housekeeping, beside its workers: the backlog gauges and the
//! retention of published rows.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_postgres::Client;

use super::inspect_table;
use crate::postgres::polling::{self, RETENTION_KEY};
use crate::postgres::table::OutboxTable;
use crate::postgres::{self, PgError};
use crate::relay::config::Settings;
use crate::relay::http::Health;

/// How often backlog and oldest-age metrics are measured.
const STATS_EVERY: Duration = Duration::from_secs(5);
/// Rows per retention delete statement: short statements, short locks.
const RETENTION_CHUNK: i64 = 1000;

/// The backlog gauges and the retention of published rows, on a connection of their
/// own: counting a large backlog or deleting many old rows (or waiting on a lock while
/// doing so) never holds up publishing. One replica of a table deletes at a time (the
/// retention advisory lock, held by this connection's session); every replica measures.
pub(super) async fn housekeeping_loop(
    settings: Settings,
    class: i32,
    health: Arc<Health>,
    mut stop: watch::Receiver<bool>,
) {
    let retention_every =
        (settings.retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let plan = crate::postgres::admin::Plan::for_relay(&settings.valid);
    let mut session: Option<(Client, OutboxTable, bool)> = None;
    let mut next_retention = Instant::now() + retention_every;
    let mut backlog_pacing = crate::postgres::admin::Pacing::new(STATS_EVERY);
    loop {
        if session.as_ref().is_none_or(|(c, _, _)| c.is_closed()) {
            session = housekeeping_session(&settings)
                .await
                .map(|(c, t)| (c, t, false));
        }
        if let Some((client, table, holds_retention)) = session.as_mut() {
            match backlog_pacing
                .run(crate::postgres::admin::backlog(client, &plan))
                .await
            {
                Some(Ok(Some(b))) => health.metrics.set_backlog(&b),
                Some(Ok(None)) | None => {}
                Some(Err(err)) => {
                    tracing::debug!(error = %err, "measuring the backlog failed");
                }
            }
            if Instant::now() >= next_retention {
                next_retention = Instant::now() + retention_every;
                let kept = retention(client, table, class, holds_retention, &settings, &stop).await;
                if let Err(err) = kept {
                    tracing::warn!(error = %err, "deleting old published rows failed; retrying later");
                    session = None;
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(STATS_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// A connection for [`housekeeping_loop`] and the table as it sees it.
async fn housekeeping_session(settings: &Settings) -> Option<(Client, OutboxTable)> {
    let client = postgres::connect(&settings.database_url, &settings.url_env, &settings.pg_tls)
        .await
        .ok()?;
    let table = inspect_table(&client, settings).await.ok()?;
    Some((client, table))
}

/// Deletes published rows older than the retention, in chunks, while this session
/// holds the table's retention lock.
async fn retention(
    client: &Client,
    table: &OutboxTable,
    class: i32,
    holds: &mut bool,
    settings: &Settings,
    stop: &watch::Receiver<bool>,
) -> Result<(), PgError> {
    if !*holds {
        *holds = polling::try_lock(client, class, RETENTION_KEY).await?;
    }
    if !*holds {
        return Ok(());
    }
    loop {
        let deleted = table
            .delete_published_before(client, settings.retention, RETENTION_CHUNK)
            .await?;
        if deleted > 0 {
            tracing::debug!(deleted, "deleted old published rows");
        }
        if deleted < u64::try_from(RETENTION_CHUNK).unwrap_or(0) || *stop.borrow() {
            return Ok(());
        }
    }
}
