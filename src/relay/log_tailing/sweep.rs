//! The reconciliation sweep of a log-tailing relay (`logTailing.sweep`): with
//! `deleteAfterPublish`, a row still in the table long after its insert is one the log
//! tail missed (the publication no longer published the table for a while, the slot
//! was recreated). Now and then this task publishes such rows from the table, as a
//! polling relay would, deletes them, and counts them: each one found is a warning, a
//! metric and, through the `OutboxRelaySweepFoundRows` alert, a page.
//!
//! Rows count as missed only when inserted `olderThan` before the newest commit the tail
//! has streamed, published and deleted (or a heartbeat it has seen come back), and only
//! when their transaction had ended before a [`Horizon`] the tail has passed (deleted
//! through): a tail catching up on a backlog, or stalled by a broker outage, has not
//! missed the rows it has not reached, a long transaction that commits while the tail
//! lags is not missed however old its `createdAt` (the transaction's start), and a
//! standby replica sweeps nothing.
//!
//! A row the tail is about to publish anyway may be published twice (at least once,
//! deduplicated by id downstream); a missed row reaches consumers after later rows of
//! its aggregate, which the tail already sent: the best order left for it.

use std::collections::VecDeque;
use std::sync::Arc;

use pgwire_replication::Lsn;
use tokio::sync::watch;
use tokio_postgres::Client;

use super::standby::Holder;
use crate::api::AfterPublish;
use crate::broker::{Broker, Shape};
use crate::postgres::horizon::{Horizon, horizon};
use crate::postgres::table::{Columns, OutboxTable};
use crate::postgres::{self, PgError};
use crate::relay::chains::{Fence, chains, publish_chains};
use crate::relay::config::Settings;
use crate::relay::http::Health;
use crate::spec::Sweep;

/// Rows per sweep transaction.
const SWEEP_BATCH: i64 = 500;

/// What the sweep needs.
pub(super) struct SweepTarget {
    pub settings: Settings,
    pub sweep: Sweep,
    pub broker: Arc<dyn Broker>,
    pub shape: Shape,
    pub health: Arc<Health>,
    pub stop: watch::Receiver<bool>,
    /// Unix time up to which the tail has streamed and deleted everything (0 until
    /// this process streams the slot).
    pub passed: watch::Receiver<f64>,
    /// The WAL position through which the tail has streamed and deleted everything.
    pub deleted: watch::Receiver<Lsn>,
    /// `synchronizedStandbySlots`: what is swept goes out only once they hold it.
    pub standby_slots: Vec<String>,
}

/// Sweeps every `sweep.interval` until shutdown.
pub(super) async fn sweep_loop(target: SweepTarget) {
    let mut session: Option<(Client, OutboxTable)> = None;
    // Horizons read at earlier sweeps, oldest first: the newest one the tail has passed
    // says which transactions it has surely streamed.
    let mut horizons: VecDeque<Horizon> = VecDeque::new();
    loop {
        crate::relay::nap(&target.stop, &target.health, target.sweep.interval).await;
        if *target.stop.borrow() {
            return;
        }
        // Only rows inserted `olderThan` before what the tail has passed count: a tail
        // that is behind (catching up, or stalled on its broker) has not missed what it
        // has not reached yet, and a standby replica, which streams nothing, sweeps
        // nothing.
        let passed = *target.passed.borrow();
        let streaming = target
            .health
            .ready
            .load(std::sync::atomic::Ordering::Relaxed);
        if passed <= 0.0 || !streaming {
            continue;
        }
        let cutoff = passed - target.sweep.older_than.as_secs_f64();
        if session.is_none() {
            match open(&target.settings).await {
                Ok(s) => session = Some(s),
                Err(err) => {
                    tracing::warn!(error = %err, "sweep: cannot reach the database; trying again at the next sweep");
                    continue;
                }
            }
        }
        let Some((client, table)) = session.as_mut() else {
            continue;
        };
        match horizon(client).await {
            Ok(now) => horizons.push_back(now),
            Err(err) => {
                tracing::warn!(error = %err, "sweep failed; trying again at the next sweep");
                session = None;
                continue;
            }
        }
        let deleted = *target.deleted.borrow();
        let Some(passed_horizon) = horizons.iter().rev().find(|h| h.lsn <= deleted).copied() else {
            continue;
        };
        horizons.retain(|h| h.lsn > passed_horizon.lsn);
        let swept = sweep_once(client, table, &target, cutoff, passed_horizon.xid).await;
        if swept.is_ok() {
            target.health.metrics.sweeps.inc();
        }
        match swept {
            Ok(0) => {}
            Ok(found) => {
                target
                    .health
                    .metrics
                    .sweep_found
                    .inc_by(u64::try_from(found).unwrap_or(0));
                tracing::warn!(
                    found,
                    older_than = ?target.sweep.older_than,
                    "sweep: published rows the log tail had missed (still in the table long after their insert): was the publication altered or the slot recreated?"
                );
            }
            Err(err) => {
                tracing::warn!(error = %err, "sweep failed; trying again at the next sweep");
                session = None;
            }
        }
    }
}

async fn open(settings: &Settings) -> Result<(Client, OutboxTable), PgError> {
    let client =
        postgres::connect(&settings.database_url, &settings.url_env, &settings.pg_tls).await?;
    postgres::keep_open_while_publishing(&client).await?;
    let t = &settings.valid.table;
    let table = OutboxTable::inspect(
        &client,
        t,
        &settings.dead_letter_table,
        Columns::of(t),
        AfterPublish::Delete,
        settings.valid.partitions,
    )
    .await?;
    Ok((client, table))
}

/// Publishes and deletes every stale row, batch by batch; returns how many. Stops at
/// the first batch with a failure (its rows stay for the next sweep, or for the tail).
async fn sweep_once(
    client: &mut Client,
    table: &OutboxTable,
    target: &SweepTarget,
    cutoff: f64,
    xid: u32,
) -> Result<usize, PgError> {
    let mut found = 0;
    loop {
        let tx = client.transaction().await.map_err(|source| PgError::Db {
            what: "starting a sweep",
            source,
        })?;
        let rows = table.select_stale(&tx, cutoff, xid, SWEEP_BATCH).await?;
        let selected = rows.len();
        if rows.is_empty() {
            tx.commit().await.map_err(|source| PgError::Db {
                what: "ending a sweep",
                source,
            })?;
            return Ok(found);
        }
        // Read from the table, not the stream: out only once the standbys hold them.
        let holder = Holder {
            slots: &target.standby_slots,
            health: &target.health,
            stop: &target.stop,
        };
        if !holder.hold_read_rows(tx.client()).await? {
            return Ok(found);
        }
        let results = publish_chains(
            target.broker.as_ref(),
            &target.shape,
            chains(rows, target.settings.valid.per_aggregate),
            &Fence {
                until: None,
                session: Some(tx.client()),
            },
        )
        .await;
        let mut ids = Vec::with_capacity(selected);
        let mut failed = false;
        for result in results {
            ids.extend(result.published.into_iter().map(|(id, _)| id));
            if let Some((rest, err)) = result.failed {
                failed = true;
                tracing::warn!(id = rest.first().map(|r| r.id.to_string()), error = %err, "sweep: a missed row could not be published; it stays for the next sweep");
            }
        }
        table.finish_published(&tx, &ids).await?;
        tx.commit().await.map_err(|source| PgError::Db {
            what: "committing a sweep",
            source,
        })?;
        found += ids.len();
        target
            .health
            .metrics
            .published
            .inc_by(u64::try_from(ids.len()).unwrap_or(0));
        if failed || i64::try_from(selected).unwrap_or(0) < SWEEP_BATCH {
            return Ok(found);
        }
    }
}
