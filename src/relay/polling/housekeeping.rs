//! A polling process's housekeeping, beside its workers: the backlog gauges and the
//! retention of published rows.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::Client;

use super::inspect_table;
use crate::postgres;
use crate::postgres::table::OutboxTable;
use crate::relay::config::Settings;
use crate::relay::http::Health;
use crate::relay::retention::{RETENTION_CHUNK, Retention};

/// How often backlog and oldest-age metrics are measured.
const STATS_EVERY: Duration = Duration::from_secs(5);

/// The backlog gauges and the retention of published rows, on a connection of their
/// own: counting a large backlog or deleting many old rows (or waiting on a lock while
/// doing so) never holds up publishing. One replica of a table deletes at a time (the
/// retention advisory lock, held by this connection's session); every replica measures.
pub(super) async fn housekeeping_loop(
    settings: Settings,
    health: Arc<Health>,
    mut stop: watch::Receiver<bool>,
) {
    let t = &settings.valid.table;
    let mut retention = Retention::new(&t.schema, &t.name, settings.retention);
    let plan = crate::postgres::admin::Plan::for_relay(&settings.valid);
    let mut session: Option<(Client, OutboxTable)> = None;
    let mut backlog_pacing = crate::postgres::admin::Pacing::new(STATS_EVERY);
    loop {
        if session.as_ref().is_none_or(|(c, _)| c.is_closed()) {
            session = housekeeping_session(&settings).await;
            retention.new_session();
        }
        if let Some((client, table)) = session.as_ref() {
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
            let kept = retention
                .run_if_due(client, &stop, || {
                    table.delete_published_before(client, settings.retention, RETENTION_CHUNK)
                })
                .await;
            if let Err(err) = kept {
                tracing::warn!(error = %err, "deleting old published rows failed; retrying later");
                session = None;
            }
        }
        // Awake for whichever is due first (the backlog paces itself).
        let pause = STATS_EVERY
            .min(retention.until_due())
            .max(Duration::from_millis(100));
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
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
