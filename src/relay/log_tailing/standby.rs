//! Publishing only what the standbys hold (`synchronizedStandbySlots`): on PostgreSQL
//! 15 and 16 a walsender streams every commit flushed on the primary, including ones no
//! standby has received yet; after a promotion those commits never happened, and an
//! event sent for one is a phantom. So, with standby slots named, the relay publishes a
//! batch only once each named physical slot's `restart_lsn` (the position its standby
//! flushed) has passed the batch's last commit. A named slot that is missing or not yet
//! streamed holds publishing back, as PostgreSQL 17's `synchronized_standby_slots`
//! does: after a failover the new primary's standbys must be named.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pgwire_replication::Lsn;
use tokio_postgres::Client;

use super::{LogTailer, SessionEnd};
use crate::postgres::standby::{Standbys, flushed_now, standbys};

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
        if self.standby_flushed >= target {
            return Ok(());
        }
        let started = Instant::now();
        let mut pause = Duration::from_millis(2);
        let mut reported = false;
        loop {
            let (flushed, why) = match standbys(client, &self.lt.standby_slots).await? {
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
            self.standby_flushed = self.standby_flushed.max(flushed);
            let behind = target.0.saturating_sub(self.standby_flushed.0);
            self.health
                .metrics
                .standby_wait
                .set(i64::try_from(behind).unwrap_or(i64::MAX));
            if behind == 0 {
                if reported {
                    self.health.standby_held.store(false, Ordering::Relaxed);
                    tracing::info!(
                        slots = %self.lt.standby_slots.join(","),
                        waited_seconds = started.elapsed().as_secs(),
                        "the standbys hold the batch; publishing on"
                    );
                }
                return Ok(());
            }
            if !reported && started.elapsed() >= REPORT_AFTER {
                reported = true;
                self.health.standby_held.store(true, Ordering::Relaxed);
                tracing::warn!(
                    slots = %self.lt.standby_slots.join(","),
                    commit = %target,
                    flushed = %self.standby_flushed,
                    why,
                    "waiting for the standbys to flush the next commits before publishing them (synchronizedStandbySlots)"
                );
            }
            self.health.turned();
            self.nap(pause).await;
            if self.stopping() {
                return Err(SessionEnd::Abandoned);
            }
            pause = (pause * 2).min(LOOK_AT_MOST_EVERY);
        }
    }
}
