//! The slot statistics task: reads the slot's state for the slot metrics and, when the
//! relay deletes what it publishes (so the table holds exactly the unpublished rows),
//! the table's backlog for the backlog metrics, for the life of the relay; with an
//! archive, it also deletes archived rows past the retention. The backlog
//! count is paced by what it costs (see [`crate::postgres::admin::Pacing`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use pgwire_replication::Lsn;
use tokio::sync::watch;
use tokio_postgres::Client;

use super::{COVERAGE_EVERY, STATS_EVERY};
use crate::postgres::coverage::coverage;
use crate::postgres::{self, removal, replication as repl};
use crate::relay::http::Health;
use crate::relay::metrics::{WAL_STATUSES, WalStatusLabels};
use crate::relay::retention::{RETENTION_CHUNK, Retention};

/// Where the statistics task looks.
pub(super) struct StatsTarget {
    pub(super) url: String,
    pub(super) env: String,
    pub(super) tls: crate::postgres::tls::PgTls,
    pub(super) slot: String,
    pub(super) publication: String,
    pub(super) schema: String,
    pub(super) table: String,
    /// With `deleteAfterPublish`: the plan whose backlog the table shows.
    pub(super) backlog: Option<crate::postgres::admin::Plan>,
    /// With an archive: it, its time-of-move column, and how long archived rows stay.
    pub(super) archive: Option<(crate::spec::Archive, String, std::time::Duration)>,
}

/// Reads the slot's statistics every [`STATS_EVERY`] on its own connection, for the
/// slot metrics; runs for the life of the relay, also while the stream is down (then
/// the slot shows as inactive, which is what the alert is for). Also checks that the
/// publication still publishes the table and reports through `covered` the WAL position
/// up to which it did: the relay confirms nothing past it.
pub(super) async fn slot_stats_loop(
    target: StatsTarget,
    covered: Option<watch::Sender<Lsn>>,
    health: Arc<Health>,
    mut stop: watch::Receiver<bool>,
) {
    let m = &health.metrics;
    let StatsTarget {
        url,
        env,
        tls,
        slot,
        publication,
        schema,
        table,
        backlog,
        archive,
    } = target;
    let mut retention = archive
        .as_ref()
        .map(|(_, _, keep)| Retention::new(&schema, &table, *keep));
    let mut client: Option<Client> = None;
    let mut last_stats: Option<Instant> = None;
    let mut backlog_pacing = crate::postgres::admin::Pacing::new(STATS_EVERY);
    loop {
        if client.as_ref().is_none_or(Client::is_closed) {
            client = postgres::connect(&url, &env, &tls).await.ok();
            if let Some(retention) = retention.as_mut() {
                retention.new_session();
            }
        }
        if let (Some(c), Some(covered)) = (&client, &covered) {
            match coverage(c, &publication, &schema, &table)
                .await
                .map(|c| (c.lsn, c.covered))
            {
                Ok((lsn, true)) => {
                    if health.uncovered.swap(false, Ordering::Relaxed) {
                        tracing::warn!(
                            publication,
                            "the publication publishes the outbox table again; confirming from here on (rows inserted while it did not were not streamed: they are still in the table)"
                        );
                    }
                    covered.send_replace(lsn);
                }
                Ok((lsn, false)) => {
                    if !health.uncovered.swap(true, Ordering::Relaxed) {
                        tracing::error!(
                            publication,
                            table = format!("{schema}.{table}"),
                            wal = %lsn,
                            "the publication no longer publishes inserts into the outbox table: nothing past this position is confirmed, so the slot keeps the WAL; add the table back (ALTER PUBLICATION ... ADD TABLE) or let the operator re-create the publication"
                        );
                    }
                }
                Err(err) => {
                    tracing::debug!(error = %err, "checking the publication failed");
                    client = None;
                }
            }
        }
        let stats_due = last_stats.is_none_or(|at| at.elapsed() >= STATS_EVERY);
        if stats_due {
            last_stats = Some(Instant::now());
        }
        if let Some(c) = client.as_ref().filter(|_| stats_due) {
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
        let measured = match (&client, &backlog) {
            (Some(c), Some(plan)) => {
                backlog_pacing
                    .run(crate::postgres::admin::backlog(c, plan))
                    .await
            }
            _ => None,
        };
        match measured {
            Some(Ok(Some(b))) => m.set_backlog(&b),
            Some(Ok(None)) | None => {}
            Some(Err(err)) => {
                tracing::debug!(error = %err, "measuring the backlog failed");
                client = None;
            }
        }
        if let (Some(c), Some(retention), Some((archive, moved_at, keep))) =
            (&client, retention.as_mut(), &archive)
        {
            let trimmed = retention
                .run_if_due(c, &stop, || {
                    removal::trim(c, archive, moved_at, *keep, RETENTION_CHUNK)
                })
                .await;
            if let Err(err) = trimmed {
                tracing::warn!(error = %err, "deleting old archived rows failed; retrying later");
                client = None;
            }
        }
        tokio::select! {
            () = tokio::time::sleep(COVERAGE_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
