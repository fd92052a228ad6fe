//! Publishing only what the standbys hold (`synchronizedStandbySlots`): on PostgreSQL
//! 15 and 16 a walsender streams every commit flushed on the primary, including ones no
//! standby has received yet; after a promotion those commits never happened, and an
//! event sent for one is a phantom. So, with standby slots named, the relay publishes a
//! batch only once each named physical slot's `restart_lsn` (the position its standby
//! flushed) has passed the batch's last commit. A named slot that is missing or not yet
//! streamed holds publishing back, as PostgreSQL 17's `synchronized_standby_slots`
//! does: after a failover the new primary's standbys must be named.
//!
//! Rows read from the table rather than the stream (the publication gate's back-fill,
//! the sweep) wait the same way, for the WAL position inserted when they were read:
//! their commits are at or before it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pgwire_replication::Lsn;
use tokio::sync::watch;
use tokio_postgres::Client;

use super::{LogTailer, SessionEnd};
use crate::postgres::PgError;
use crate::postgres::standby::{Standbys, flushed_now, inserted_now, standbys};
use crate::relay::http::Health;

/// Longest pause between two looks at the standby slots while waiting.
const LOOK_AT_MOST_EVERY: Duration = Duration::from_millis(200);
/// Waiting longer than this is reported: a log line and a relay that is not ready.
const REPORT_AFTER: Duration = Duration::from_secs(10);

impl LogTailer {
    /// Waits until every standby slot has flushed past `confirm`, the batch's last
    /// commit (`None`: a chunk of a transaction whose commit has not arrived; its
    /// commit is at or before what the primary has flushed now).
    pub(super) async fn wait_for_standbys(
        &mut self,
        client: &Client,
        confirm: Option<Lsn>,
    ) -> Result<(), SessionEnd> {
        if self.lt.standby_slots.is_empty() {
            return Ok(());
        }
        let target = match confirm {
            Some(lsn) => lsn,
            None => flushed_now(client).await?,
        };
        let held = Holder {
            slots: &self.lt.standby_slots,
            health: &self.health,
            stop: &self.stop,
        };
        match held
            .until_flushed(client, target, &mut self.standby_flushed)
            .await?
        {
            true => Ok(()),
            false => Err(SessionEnd::Abandoned),
        }
    }
}

/// What waiting for the standbys needs: their slots, the health it reports to, and
/// the shutdown it gives way to.
pub(super) struct Holder<'a> {
    pub slots: &'a [String],
    pub health: &'a Health,
    pub stop: &'a watch::Receiver<bool>,
}

impl Holder<'_> {
    /// Waits until the standbys hold every row a transaction of `client` has just read
    /// from the table (the back-fill's, the sweep's): `false` when the relay is
    /// shutting down first.
    pub(super) async fn hold_read_rows(&self, client: &Client) -> Result<bool, PgError> {
        if self.slots.is_empty() {
            return Ok(true);
        }
        let target = inserted_now(client).await?;
        self.until_flushed(client, target, &mut Lsn(0)).await
    }

    /// Waits until every standby slot has flushed past `target`; `known` is the least
    /// position seen flushed at an earlier look (moved on here). `false` when the relay
    /// is shutting down first.
    pub(super) async fn until_flushed(
        &self,
        client: &Client,
        target: Lsn,
        known: &mut Lsn,
    ) -> Result<bool, PgError> {
        if self.slots.is_empty() || *known >= target {
            return Ok(true);
        }
        let started = Instant::now();
        let mut pause = Duration::from_millis(2);
        let mut reported = false;
        loop {
            let (flushed, why) = match standbys(client, self.slots).await? {
                Standbys::Flushed(Some(lsn)) => (lsn, String::new()),
                Standbys::Flushed(None) => (
                    Lsn(0),
                    "one of them has never been streamed by its standby".to_owned(),
                ),
                Standbys::Missing(names) => (
                    Lsn(0),
                    format!(
                        "no physical slot named {} on this server (after a failover, name the new primary's standby slots)",
                        names.join(", ")
                    ),
                ),
            };
            *known = (*known).max(flushed);
            let behind = target.0.saturating_sub(known.0);
            self.health
                .metrics
                .standby_wait
                .set(i64::try_from(behind).unwrap_or(i64::MAX));
            if behind == 0 {
                if reported {
                    self.health.standby_held.store(false, Ordering::Relaxed);
                    tracing::info!(
                        slots = %self.slots.join(","),
                        waited_seconds = started.elapsed().as_secs(),
                        "the standbys hold the batch; publishing on"
                    );
                }
                return Ok(true);
            }
            if !reported && started.elapsed() >= REPORT_AFTER {
                reported = true;
                self.health.standby_held.store(true, Ordering::Relaxed);
                tracing::warn!(
                    slots = %self.slots.join(","),
                    commit = %target,
                    flushed = %known,
                    why,
                    "waiting for the standbys to flush the next commits before publishing them (synchronizedStandbySlots)"
                );
            }
            self.health.turned();
            crate::relay::nap(self.stop, self.health, pause).await;
            if *self.stop.borrow() {
                return Ok(false);
            }
            pause = (pause * 2).min(LOOK_AT_MOST_EVERY);
        }
    }
}
