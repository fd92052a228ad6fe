//! The publication gate: before a batch is published, the relay looks at what publishes
//! the outbox table ([`crate::postgres::coverage`]). When that changed since its last
//! look (a DROP and ADD of the table, however quick; `ALTER PUBLICATION … SET`; a
//! recreated publication), inserts in between may never have been streamed, and the batch would carry newer
//! events of their aggregates:
//!
//! - with `deleteAfterPublish` the table holds every row not yet published, so the
//!   relay publishes every row left in it, oldest first, per aggregate in order, and
//!   deletes them, before the batch; rows of the batch (and those the stream will
//!   still deliver) that it published are skipped when they stream, until the stream
//!   passes the position read after the back-fill, and transactions committed before
//!   it began are not sent again at all (each of their rows was back-filled, or
//!   published before: a replay after a restart would otherwise put old events after
//!   the newer ones the back-fill sent);
//! - keeping rows, the rows of the window cannot be told apart from the published
//!   ones: the relay publishes nothing further, confirms nothing, reports not ready
//!   and names the window, until the change is accepted in its settings
//!   (`coverageAccepted`, one identity each).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pgwire_replication::Lsn;
use tokio_postgres::Client;

use super::standby::Holder;
use super::{LogTailer, SessionEnd};
use crate::api::AfterPublish;
use crate::postgres::coverage::{Coverage, coverage};
use crate::postgres::table::{Columns, OutboxTable};
use crate::postgres::{self, OutboxRow, PgError, RowId};
use crate::relay::backoff::Backoff;
use crate::relay::chains::{Fence, chains, publish_chains};

/// Rows per back-fill transaction.
const FILL_BATCH: i64 = 500;
/// How often a relay holding at a gap looks again (an accepted change, a restart).
const HOLD_LOOK_EVERY: Duration = Duration::from_secs(5);

/// What the gate knows between batches.
#[derive(Default)]
pub(super) struct Gate {
    /// The coverage identity last seen, and the WAL position read with it.
    seen: Option<(String, Lsn)>,
    /// Ids the back-fill published, skipped when they stream …
    skip: HashSet<RowId>,
    /// … until the stream passes this position.
    skip_until: Lsn,
    /// The WAL position read before the last back-fill began: a streamed transaction
    /// that ends at or before it committed before the back-fill's first read, so each
    /// of its rows was either still in the table (back-filled) or already deleted
    /// (published earlier, by this relay or the one before it). Sending those again
    /// would put old events after the newer ones the back-fill just sent.
    replayed_until: Lsn,
}

impl Gate {
    /// A gate whose first look compares with `baseline` (`None`: takes what it sees).
    pub(super) fn from_baseline(baseline: Option<String>) -> Self {
        Self {
            seen: baseline.map(|identity| (identity, Lsn(0))),
            ..Self::default()
        }
    }
}

impl LogTailer {
    /// Lets `rows` (ending at `confirm`) through once the publication is known to have
    /// streamed every insert before them; drops the ones a back-fill published.
    pub(super) async fn gate(
        &mut self,
        client: &Client,
        rows: Vec<OutboxRow>,
        confirm: Option<Lsn>,
    ) -> Result<Vec<OutboxRow>, SessionEnd> {
        let mut held = false;
        loop {
            let t = &self.settings.valid.table;
            let cov = coverage(client, &self.lt.publication, &t.schema, &t.name).await?;
            // A process's first look compares with the operator's baseline (what
            // published the table when the slot was first seen); without one it takes
            // what it sees (the slot's `catalog_xmin` cannot tell, as a transaction open
            // elsewhere on the server holds it back past changes made before the slot).
            let changed = self
                .gate
                .seen
                .as_ref()
                .is_some_and(|(identity, _)| *identity != cov.identity);
            // Out of the publication now: what streamed so far was decoded while it was
            // in (the statistics task holds confirmation back); the change shows as a
            // new identity once it is back.
            if !cov.covered || !changed {
                if cov.covered {
                    self.gate.seen = Some((cov.identity, cov.lsn));
                }
                if held {
                    self.health.gap_held.store(false, Ordering::Relaxed);
                }
                return Ok(self.not_back_filled(rows, confirm));
            }
            let since = match &self.gate.seen {
                Some((_, lsn)) if lsn.0 > 0 => lsn.to_string(),
                Some(_) => "the slot's start (the operator's baseline)".to_owned(),
                None => String::new(),
            };
            if self.lt.delete_after_publish {
                tracing::warn!(
                    publication = %self.lt.publication,
                    since,
                    until = %cov.lsn,
                    "what publishes the outbox table changed: inserts in between may not have been streamed; publishing every row left in the table first"
                );
                let (published, after) = self.back_fill().await?;
                self.health
                    .metrics
                    .gap_back_filled
                    .inc_by(u64::try_from(published.len()).unwrap_or(0));
                tracing::warn!(
                    rows = published.len(),
                    "published and deleted the rows left in the table; streaming on"
                );
                self.gate.skip.extend(published);
                self.gate.skip_until = self.gate.skip_until.max(after);
                self.gate.replayed_until = self.gate.replayed_until.max(cov.lsn);
                self.gate.seen = Some((cov.identity, cov.lsn));
                return Ok(self.not_back_filled(rows, confirm));
            }
            if self.settings.coverage_accepted.contains(&cov.identity) {
                tracing::warn!(
                    publication = %self.lt.publication,
                    identity = %cov.identity,
                    "the publication change is accepted in the settings (coverageAccepted): streaming on; inserts made while the table was not published stay unpublished"
                );
                self.health.gap_held.store(false, Ordering::Relaxed);
                self.gate.seen = Some((cov.identity, cov.lsn));
                return Ok(rows);
            }
            if !held {
                held = true;
                self.health.gap_held.store(true, Ordering::Relaxed);
                self.health.metrics.gap_held.inc();
                tracing::error!(
                    publication = %self.lt.publication,
                    since,
                    until = %cov.lsn,
                    identity = %cov.identity,
                    "what publishes the outbox table changed (a DROP and ADD of the table, ALTER PUBLICATION … SET, a recreated publication): inserts in between may not have been streamed, and the rows are kept, so they cannot be told from published ones. Nothing more is published or confirmed: publish the rows inserted in that window, then accept the change (annotation outbox.dev/accept-publication-change set to the identity logged here)"
                );
            }
            self.nap(HOLD_LOOK_EVERY).await;
            if self.stopping() {
                return Err(SessionEnd::Abandoned);
            }
        }
    }

    /// `rows` without those a back-fill published; forgets them once the stream passed
    /// the back-fill.
    fn not_back_filled(&mut self, rows: Vec<OutboxRow>, confirm: Option<Lsn>) -> Vec<OutboxRow> {
        if confirm.is_some_and(|c| c <= self.gate.replayed_until) {
            return Vec::new();
        }
        if self.gate.skip.is_empty() {
            return rows;
        }
        let rows = rows
            .into_iter()
            .filter(|r| !self.gate.skip.contains(&r.id))
            .collect();
        if confirm.is_some_and(|c| c >= self.gate.skip_until) {
            self.gate.skip = HashSet::new();
        }
        rows
    }

    /// Publishes every row left in the table, oldest first, and deletes it, on a
    /// connection of its own; retries until all are out. Returns their ids and the WAL
    /// position read after the last one: any of them streams before it.
    async fn back_fill(&mut self) -> Result<(HashSet<RowId>, Lsn), SessionEnd> {
        // What was published and handed to the delete task is deleted first, so that
        // the back-fill does not publish it again.
        let drain = std::time::Instant::now() + super::DELETER_DRAIN;
        while self.deleted_through() < self.handed && std::time::Instant::now() < drain {
            tokio::time::sleep(super::DELETE_POLL).await;
        }
        let mut published = HashSet::new();
        let mut backoff = Backoff::new();
        loop {
            match self.back_fill_once(&mut published).await {
                Ok(Some(after)) => return Ok((published, after)),
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(error = %err, "publishing the rows left in the table failed; retrying");
                }
            }
            if self.stopping() {
                return Err(SessionEnd::Abandoned);
            }
            self.nap(backoff.step()).await;
        }
    }

    /// One pass over the table; `Some(position)` once no row is left, `None` when a row
    /// could not be published (it stays, with the rest of its aggregate, for the next
    /// pass).
    async fn back_fill_once(&self, published: &mut HashSet<RowId>) -> Result<Option<Lsn>, PgError> {
        let s = &self.settings;
        let t = &s.valid.table;
        let mut client = postgres::connect(&s.database_url, &s.url_env, &s.pg_tls).await?;
        postgres::keep_open_while_publishing(&client).await?;
        let table = OutboxTable::inspect(
            &client,
            t,
            &s.dead_letter_table,
            Columns::of(t),
            AfterPublish::Delete,
            s.valid.partitions,
        )
        .await?;
        let mut after: Option<RowId> = None;
        loop {
            let tx = client.transaction().await.map_err(|source| PgError::Db {
                what: "starting a back-fill",
                source,
            })?;
            let rows = table.select_after(&tx, after.as_ref(), FILL_BATCH).await?;
            let Some(last) = rows.last().map(|r| r.id.clone()) else {
                tx.commit().await.map_err(|source| PgError::Db {
                    what: "ending a back-fill",
                    source,
                })?;
                let cov: Coverage =
                    coverage(&client, &self.lt.publication, &t.schema, &t.name).await?;
                return Ok(Some(cov.lsn));
            };
            // Read from the table, not the stream: out only once the standbys hold them.
            let holder = Holder {
                slots: &self.lt.standby_slots,
                health: &self.health,
                stop: &self.stop,
            };
            if !holder.hold_read_rows(tx.client()).await? {
                return Ok(None);
            }
            let results = publish_chains(
                self.broker.as_ref(),
                &self.shape,
                chains(rows, s.valid.per_aggregate),
                &Fence {
                    until: None,
                    session: Some(tx.client()),
                },
            )
            .await;
            let mut ids = Vec::new();
            let mut failed = None;
            for result in results {
                ids.extend(result.published.into_iter().map(|(id, _)| id));
                if let Some((_, err)) = result.failed {
                    failed = Some(err);
                }
            }
            table.finish_published(&tx, &ids).await?;
            tx.commit().await.map_err(|source| PgError::Db {
                what: "committing a back-fill",
                source,
            })?;
            self.health
                .metrics
                .published
                .inc_by(u64::try_from(ids.len()).unwrap_or(0));
            published.extend(ids);
            if let Some(err) = failed {
                tracing::warn!(error = %err, "a row left in the table could not be published; retrying");
                return Ok(None);
            }
            after = Some(last);
        }
    }
}
