//! The slot statistics task: reads the slot's state for the slot metrics and, when the
//! relay deletes what it publishes (so the table holds exactly the unpublished rows),
//! the table's backlog for the backlog metrics, for the life of the relay.

use std::sync::Arc;

use tokio::sync::watch;
use tokio_postgres::Client;

use super::STATS_EVERY;
use crate::postgres::{self, replication as repl};
use crate::relay::http::Health;
use crate::relay::metrics::{WAL_STATUSES, WalStatusLabels};

/// Reads the slot's statistics every [`STATS_EVERY`] on its own connection, for the
/// slot metrics; runs for the life of the relay, also while the stream is down (then
/// the slot shows as inactive, which is what the alert is for).
pub(super) async fn slot_stats_loop(
    url: String,
    env: String,
    tls: crate::postgres::tls::PgTls,
    slot: String,
    backlog: Option<crate::postgres::admin::Plan>,
    health: Arc<Health>,
    mut stop: watch::Receiver<bool>,
) {
    let m = &health.metrics;
    let mut client: Option<Client> = None;
    loop {
        if client.as_ref().is_none_or(Client::is_closed) {
            client = postgres::connect(&url, &env, &tls).await.ok();
        }
        if let Some(c) = &client {
            match repl::slot_stats(c, &slot).await {
                Ok(Some(stats)) => {
                    m.slot_retained_wal.set(stats.retained_wal_bytes);
                    m.slot_active.set(i64::from(stats.active));
                    for status in WAL_STATUSES {
                        m.slot_wal_status
                            .get_or_create(&WalStatusLabels { status })
                            .set(i64::from(stats.wal_status == status));
                    }
                }
                Ok(None) => {
                    m.slot_active.set(0);
                }
                Err(err) => {
                    tracing::debug!(error = %err, "reading slot statistics failed");
                    client = None;
                }
            }
        }
        if let (Some(c), Some(plan)) = (&client, &backlog) {
            match crate::postgres::admin::backlog(c, plan).await {
                Ok(Some(b)) => {
                    m.backlog_rows.set(b.rows);
                    m.oldest_unpublished_age
                        .set(b.oldest_age_seconds.unwrap_or(0.0).max(0.0));
                }
                Ok(None) => {}
                Err(err) => {
                    tracing::debug!(error = %err, "measuring the backlog failed");
                    client = None;
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(STATS_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
