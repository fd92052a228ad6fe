//! Reading the stream into batches of whole transactions, publishing a batch until the
//! broker acknowledged all of it, confirming its position, and handing the confirmed
//! rows to the deleter.

use std::collections::HashMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tokio_postgres::Client;

use super::deleter::{Handed, later};
use super::layout::Layout;
use super::{
    DELETE_POLL, LogTailer, MAX_BATCH_BYTES, MAX_BATCH_ROWS, PG_EPOCH_UNIX_MICROS, SHUTDOWN_GRACE,
    SessionEnd, stream_error,
};
use crate::api::OnExhausted;
use crate::broker::Clear;
use crate::broker::PublishError;
use crate::postgres::replication::{self as repl, HEARTBEAT_PREFIX, PgOutput};
use crate::postgres::{OutboxRow, PgError};
use crate::relay::Outage;
use crate::relay::RelayError;
use crate::relay::backoff::Backoff;
use crate::relay::chains::{ChainResult, chains, publish_chains};
use crate::relay::metrics::ErrorLabels;

/// How often a stream held back by the delete task says it is alive.
const DELETE_QUEUE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Transactions received but not yet published and confirmed.
#[derive(Default)]
struct Batch {
    rows: Vec<OutboxRow>,
    /// Payload bytes of `rows`.
    bytes: usize,
    /// The transactions of the batch (32-bit xids), which the delete task waits to see
    /// committed before deleting their rows.
    xids: Vec<u32>,
    /// The position to confirm once every row is acknowledged: the last commit's end
    /// LSN, or a heartbeat's LSN.
    confirm: Option<Lsn>,
    /// Unix time up to which every commit is streamed with this batch (see
    /// [`super::deleter::Handed::passed`]).
    passed: Option<f64>,
}

impl Batch {
    /// No further row or transaction joins this batch: [`MAX_BATCH_ROWS`] rows or
    /// [`MAX_BATCH_BYTES`] of payloads (16 KiB payloads made 1,000 rows a 16 MiB batch,
    /// held three times over — row, message, producer copy — and a 164 MiB relay).
    fn full(&self) -> bool {
        self.rows.len() >= MAX_BATCH_ROWS || self.bytes >= MAX_BATCH_BYTES
    }
}

impl LogTailer {
    /// Reads transactions, publishes them batch by batch and confirms each batch.
    pub(super) async fn stream(
        &mut self,
        client: &Client,
        stream: &mut ReplicationClient,
    ) -> Result<(), SessionEnd> {
        let t = self.settings.valid.table.clone();
        let mut relations: HashMap<u32, Option<Layout>> = HashMap::new();
        // The transaction being received: its commit time (Unix seconds) and xid.
        let mut open: Option<(f64, u32)> = None;
        let mut last_progress = Instant::now();
        let mut stop = self.stop.clone();
        loop {
            let mut batch = Batch::default();
            // Wait for the first event, writing heartbeats while idle.
            let first = loop {
                self.health.turned();
                let heartbeat_due = last_progress + self.lt.heartbeat;
                let unconfirmed = self.wanted() > stream.metrics().last_applied_lsn();
                tokio::select! {
                    biased;
                    _ = stop.wait_for(|s| *s) => return Ok(()),
                    event = stream.recv() => break event,
                    () = tokio::time::sleep_until(
                        heartbeat_due.min(Instant::now() + crate::relay::TURN_EVERY).into()
                    ) => {
                        if Instant::now() >= heartbeat_due {
                            repl::emit_heartbeat(client).await?;
                            last_progress = Instant::now();
                        }
                    }
                    () = tokio::time::sleep(DELETE_POLL), if unconfirmed => {
                        self.confirm(stream);
                    }
                }
            };
            let mut event = first;
            loop {
                let Some(ev) = event.map_err(stream_error)? else {
                    return Err(SessionEnd::Stream("the server ended the stream".to_owned()));
                };
                self.receive(client, ev, &t, &mut relations, &mut open, &mut batch)
                    .await?;
                // Inside a transaction, read on to its commit, publishing it in chunks
                // of MAX_BATCH_ROWS (unconfirmed until its commit) so that memory stays
                // bounded whatever its size; between transactions, take only what has
                // already arrived.
                event = if let Some((_, xid)) = open {
                    if batch.full() {
                        let chunk = std::mem::take(&mut batch);
                        self.publish(
                            client,
                            chunk.rows,
                            chunk.xids,
                            stream,
                            chunk.confirm,
                            chunk.passed,
                        )
                        .await?;
                        batch.xids.push(xid);
                    }
                    stream.recv().await
                } else if batch.full() {
                    break;
                } else {
                    match stream.recv().now_or_never() {
                        Some(next) => next,
                        None => break,
                    }
                };
            }
            if batch.confirm.is_some() {
                self.publish(
                    client,
                    batch.rows,
                    batch.xids,
                    stream,
                    batch.confirm,
                    batch.passed,
                )
                .await?;
                last_progress = Instant::now();
            }
        }
    }

    /// Applies one replication event to the open transaction and the batch.
    async fn receive(
        &mut self,
        client: &Client,
        event: ReplicationEvent,
        t: &crate::spec::Table,
        relations: &mut HashMap<u32, Option<Layout>>,
        open: &mut Option<(f64, u32)>,
        batch: &mut Batch,
    ) -> Result<(), SessionEnd> {
        match event {
            ReplicationEvent::Begin {
                commit_time_micros,
                xid,
                ..
            } => {
                batch.xids.push(xid);
                let micros = commit_time_micros.saturating_add(PG_EPOCH_UNIX_MICROS);
                // Microseconds to seconds for the lag metric; precision loss is irrelevant.
                #[allow(clippy::cast_precision_loss)]
                let secs = micros as f64 / 1e6;
                *open = Some((secs, xid));
            }
            ReplicationEvent::XLogData { data, .. } => {
                let message = repl::decode(&data)
                    .map_err(|e| SessionEnd::Stream(format!("decoding the stream: {e}")))?;
                match message {
                    PgOutput::Relation(relation) => {
                        // A partitioned outbox table under a publication without
                        // publish_via_partition_root streams each partition's rows
                        // under the partition's name: those rows are ours too.
                        let ours = Layout::names_table(&relation, &t.schema, &t.name)
                            || repl::is_partition_of(client, relation.oid, &t.schema, &t.name)
                                .await?;
                        if ours && !Layout::names_table(&relation, &t.schema, &t.name) {
                            tracing::info!(
                                partition = format!("{}.{}", relation.namespace, relation.name),
                                "streaming a partition of the outbox table"
                            );
                        }
                        let layout = Layout::of(&relation, ours, &t.schema, &t.name, &self.columns)
                            .map_err(|e| SessionEnd::Db(PgError::Schema(e.to_string())))?;
                        relations.insert(relation.oid, layout);
                    }
                    PgOutput::Insert { relation, tuple } => {
                        let layout = relations.get(&relation).ok_or_else(|| {
                            SessionEnd::Stream(format!(
                                "insert into relation {relation} before its description"
                            ))
                        })?;
                        if let Some(layout) = layout {
                            let commit = open.map_or_else(unix_now, |(secs, _)| secs);
                            let row = layout.row(tuple, commit).map_err(|e| {
                                SessionEnd::Stream(format!("an outbox insert: {e}"))
                            })?;
                            batch.bytes += row.payload_len();
                            batch.rows.push(row);
                        }
                    }
                    // Updates, deletes (our own deleteAfterPublish deletes among them),
                    // truncates, types and origins are not events.
                    PgOutput::Other(_) => {}
                }
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                if let Some((commit, _)) = *open {
                    batch.passed = later(batch.passed, Some(commit));
                }
                *open = None;
                batch.confirm = Some(end_lsn);
            }
            ReplicationEvent::Message {
                prefix,
                lsn,
                content,
                ..
            } => {
                // Non-transactional messages are decoded in WAL order between whole
                // transactions, so everything committed before the heartbeat is already
                // in this or an earlier batch: its LSN is safe to confirm with them.
                if prefix == HEARTBEAT_PREFIX && open.is_none() {
                    batch.confirm = Some(batch.confirm.map_or(lsn, |c| c.max(lsn)));
                    // Everything committed before the heartbeat was written is streamed;
                    // it carries the database's clock then (older relays wrote none).
                    let written = std::str::from_utf8(&content)
                        .ok()
                        .and_then(|t| t.trim().parse::<f64>().ok());
                    batch.passed = later(batch.passed, written);
                }
            }
            ReplicationEvent::KeepAlive { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    /// Publishes a batch until every message is acknowledged, then confirms `confirm`
    /// (`None` for a chunk of a transaction whose commit has not arrived yet and no
    /// earlier commit in the chunk: nothing new to confirm).
    async fn publish(
        &mut self,
        client: &Client,
        rows: Vec<OutboxRow>,
        xids: Vec<u32>,
        stream: &ReplicationClient,
        confirm: Option<Lsn>,
        passed: Option<f64>,
    ) -> Result<(), SessionEnd> {
        let started = Instant::now();
        // Nothing is published before every insert preceding it is known streamed, and
        // (with standby slots named) before the standbys hold its commit.
        let rows = self.gate(client, rows, confirm).await?;
        if !rows.is_empty() {
            self.wait_for_standbys(client, confirm).await?;
        }
        let per_aggregate = self.settings.valid.per_aggregate;
        let mut pending = chains(rows, per_aggregate);
        // Keeping rows, the table cannot tell what is unpublished: the backlog metrics
        // are the rows of this batch not yet acknowledged and the oldest commit among
        // them, so a relay stalled on its broker shows a growing age (and the shipped
        // alert fires). Deleting rows, the stats task measures the table instead.
        let in_flight = |pending: &[Vec<OutboxRow>], m: &crate::relay::metrics::Metrics| {
            let rows = pending.iter().map(Vec::len).sum::<usize>();
            let oldest = pending
                .iter()
                .flatten()
                .filter_map(|r| r.created_at)
                .fold(f64::INFINITY, f64::min);
            m.backlog_rows.set(i64::try_from(rows).unwrap_or(i64::MAX));
            m.oldest_unpublished_age.set(if oldest.is_finite() {
                (unix_now() - oldest).max(0.0)
            } else {
                0.0
            });
        };
        let keeps_rows = !self.lt.delete_after_publish;
        if keeps_rows {
            in_flight(&pending, &self.health.metrics);
        }
        let mut ids = Vec::new();
        let mut lags = Vec::new();
        let mut backoff = Backoff::new();
        let mut stop_seen: Option<Instant> = None;
        while !pending.is_empty() {
            self.health.turned();
            let broker = self.broker.as_ref();
            let results: Vec<ChainResult> =
                publish_chains(broker, &self.shape, std::mem::take(&mut pending), &Clear).await;
            let now_unix = unix_now();
            let mut outage = Outage::default();
            let before = ids.len();
            for result in results {
                for (id, created) in result.published {
                    ids.push(id);
                    if let Some(created) = created {
                        lags.push((now_unix - created).max(0.0));
                    }
                }
                if let Some((mut rest, err)) = result.failed {
                    if !err.is_refused() {
                        outage.add(&rest, &err);
                    }
                    if self.count_failure(&rest, &err)
                        && self.dead_letter(client, &rest[0], &err).await
                    {
                        // Out of the stream's way: the rest of its aggregate goes on.
                        rest.remove(0);
                    }
                    if !rest.is_empty() {
                        pending.push(rest);
                    }
                }
            }
            outage.report(&self.health, ids.len() - before);
            if pending.is_empty() {
                break;
            }
            if keeps_rows {
                in_flight(&pending, &self.health.metrics);
            }
            if let Some(why) = self.broker.broken() {
                return Err(SessionEnd::Fatal(RelayError::BrokerBroken(why)));
            }
            if self.stopping() {
                let since = *stop_seen.get_or_insert_with(Instant::now);
                if since.elapsed() >= SHUTDOWN_GRACE {
                    return Err(SessionEnd::Abandoned);
                }
            }
            tokio::time::sleep(backoff.step()).await;
        }
        self.health.blocked_by(None);
        // Every message of every transaction up to `confirm` is acknowledged: confirm
        // it now, or, deleting what is published, once its rows are deleted.
        if self.deleter.is_some() {
            if let Some(confirm) = confirm {
                self.handed = self.handed.max(confirm);
            }
            let handed = Handed {
                through: self.handed,
                ids: ids.clone(),
                xids,
                passed,
            };
            self.hand_to_deleter(handed).await?;
        } else if let Some(confirm) = confirm {
            self.acked = self.acked.max(confirm);
        }
        self.confirm(stream);
        let m = &self.health.metrics;
        m.published.inc_by(u64::try_from(ids.len()).unwrap_or(0));
        for lag in lags {
            m.end_to_end_lag.observe(lag);
        }
        m.batch_duration.observe(started.elapsed().as_secs_f64());
        m.last_success.set(unix_now());
        if keeps_rows {
            in_flight(&[], m);
        }
        if !self.attempts.is_empty() {
            for id in &ids {
                self.attempts.remove(id);
            }
        }
        Ok(())
    }

    /// Queues a published batch for the delete task, waiting while [`super::DELETE_QUEUE`]
    /// batches already wait (deletes failing: the stream holds back). A closed channel
    /// means the delete task is gone (shutdown): nothing more is confirmed, and the
    /// server streams those commits again.
    async fn hand_to_deleter(&mut self, handed: Handed) -> Result<(), SessionEnd> {
        let Some(deleter) = self.deleter.clone() else {
            return Ok(());
        };
        let mut said = false;
        loop {
            self.health.turned();
            match tokio::time::timeout(DELETE_QUEUE_WAIT, deleter.reserve()).await {
                Ok(Ok(permit)) => {
                    permit.send(handed);
                    if said {
                        tracing::info!("the delete task caught up; streaming on");
                    }
                    return Ok(());
                }
                Ok(Err(_)) => return Ok(()),
                Err(_) if self.stopping() => return Err(SessionEnd::Abandoned),
                Err(_) => {
                    if !said {
                        said = true;
                        tracing::warn!(
                            batches = super::DELETE_QUEUE,
                            "published batches wait for their rows to be deleted (the deletes are failing; see the delete task's warnings): publishing holds until they are"
                        );
                    }
                }
            }
        }
    }

    /// Counts a failed message; true when it is a row the broker refused that has
    /// exhausted `failure.maxAttempts` under `onExhausted: deadLetter`.
    fn count_failure(&mut self, rest: &[OutboxRow], err: &PublishError) -> bool {
        let Some(row) = rest.first() else {
            return false;
        };
        let m = &self.health.metrics;
        if err.is_refused() {
            m.publish_errors
                .get_or_create(&ErrorLabels { kind: "row" })
                .inc();
            let attempts = self.attempts.entry(row.id.clone()).or_insert(0);
            *attempts += 1;
            let attempts = *attempts;
            if attempts >= self.settings.max_attempts
                && self.settings.on_exhausted() == OnExhausted::DeadLetter
            {
                return true;
            }
            // The stream does not go past a refused row before it is published (or,
            // under `onExhausted: deadLetter`, dead-lettered): a position is confirmed
            // only once everything before it is, so the whole stream waits. Once its
            // attempts are spent, the relay says so in its readiness (and the operator
            // in the OutboxRelay's Ready): the slot retains WAL until then.
            if attempts >= self.settings.max_attempts {
                self.health.blocked_by(Some(format!(
                    "row {} was refused by the broker {} times (spec.failure.maxAttempts) and the stream waits for it (onExhausted: block), retaining WAL on the server: fix what the broker refuses (the row stays in the stream whatever happens to the table), or set spec.failure.deadLetterTable; the broker said: {}",
                    row.id,
                    self.settings.max_attempts,
                    err.message().lines().next().unwrap_or_default()
                )));
            }
            tracing::error!(
                row = %row.id,
                attempts,
                error = %err,
                "row refused by the broker; the stream waits until it is published or dead-lettered"
            );
        } else {
            // Logged once for the round (`Outage`), not once a row.
            m.publish_errors
                .get_or_create(&ErrorLabels {
                    kind: "unavailable",
                })
                .inc();
        }
        false
    }

    /// Moves a row that exhausted its attempts to the dead-letter table (from the outbox
    /// table, where it still is: rows are deleted only after their commit is
    /// published). True when it is out of the way: moved, or no longer in the table. A
    /// failed move leaves it in the stream (which waits), retried after the usual pause,
    /// and counted.
    async fn dead_letter(&mut self, client: &Client, row: &OutboxRow, err: &PublishError) -> bool {
        let m = &self.health.metrics;
        let Some(table) = &self.table else {
            return false;
        };
        match table.dead_letter(client, &row.id, &err.message()).await {
            Ok(moved) => {
                self.attempts.remove(&row.id);
                m.dead_lettered.inc();
                if moved == 0 {
                    tracing::error!(
                        row = %row.id,
                        error = %err,
                        "row exhausted its attempts but is no longer in the outbox table; skipped"
                    );
                } else {
                    tracing::error!(
                        row = %row.id,
                        error = %err,
                        dead_letter_table = %self.settings.dead_letter_table,
                        "row exhausted its attempts; moved to the dead-letter table"
                    );
                }
                true
            }
            Err(dead) => {
                m.publish_errors
                    .get_or_create(&ErrorLabels {
                        kind: "dead_letter",
                    })
                    .inc();
                tracing::error!(
                    row = %row.id,
                    error = %dead,
                    "row exhausted its attempts and cannot be dead-lettered; the stream waits until it can"
                );
                false
            }
        }
    }

    /// Through which position the delete task has deleted; with nothing to delete,
    /// everything handed (nothing is handed then).
    pub(super) fn deleted_through(&self) -> Lsn {
        self.deleted.as_ref().map_or(self.handed, |rx| *rx.borrow())
    }

    /// The position to confirm once nothing else holds it back: everything acknowledged,
    /// or, deleting what is published, everything handed to the delete task.
    pub(super) fn wanted(&self) -> Lsn {
        if self.deleted.is_some() {
            self.handed
        } else {
            self.acked
        }
    }

    /// Confirms to the server what is acknowledged (and deleted, with
    /// `deleteAfterPublish`), but never past the last position at which the publication
    /// was seen to publish the table: past a change that removed it, rows were skipped
    /// by the server, and confirming would lose them for good.
    pub(super) fn confirm(&self, stream: &ReplicationClient) {
        self.confirm_through(stream, *self.covered.borrow());
    }

    /// What is done: acknowledged, or with `deleteAfterPublish` deleted.
    fn done(&self) -> Lsn {
        if self.deleted.is_some() {
            self.deleted_through()
        } else {
            self.acked
        }
    }

    fn confirm_through(&self, stream: &ReplicationClient, covered: Lsn) -> Lsn {
        let through = self.done().min(covered);
        if through > stream.metrics().last_applied_lsn() {
            stream.update_applied_lsn(through);
        }
        through
    }

    /// At a clean stop: confirms everything done, with the publication's coverage
    /// looked at now rather than at the statistics task's last look (up to a second
    /// old: confirming only that far would make the next relay publish again what this
    /// one published since). Returns the position confirmed.
    pub(super) async fn confirm_at_stop(&self, client: &Client, stream: &ReplicationClient) -> Lsn {
        let mut covered = *self.covered.borrow();
        if self.done() > covered {
            let t = &self.settings.valid.table;
            if let Ok(now) = crate::postgres::coverage::coverage(
                client,
                &self.lt.publication,
                &t.schema,
                &t.name,
            )
            .await
                && now.covered
            {
                covered = covered.max(now.lsn);
            }
        }
        self.confirm_through(stream, covered)
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(bytes: usize) -> OutboxRow {
        OutboxRow {
            id: 1.into(),
            aggregate_type: "order".into(),
            aggregate_id: Some("a".into()),
            event_type: None,
            payload: Some(vec![b'x'; bytes].into()),
            extra: Vec::new(),
            partition: 0,
            created_at: None,
            timestamp: None,
        }
    }

    fn with(rows: usize, bytes: usize) -> Batch {
        let mut batch = Batch::default();
        for _ in 0..rows {
            batch.bytes += bytes;
            batch.rows.push(row(bytes));
        }
        batch
    }

    #[test]
    fn a_batch_is_full_at_its_row_or_byte_bound_whichever_comes_first() {
        assert!(!with(MAX_BATCH_ROWS - 1, 100).full());
        assert!(with(MAX_BATCH_ROWS, 100).full());
        // 16 KiB payloads: full long before the row bound.
        let per_row = 16 * 1024;
        assert!(!with(MAX_BATCH_BYTES / per_row - 1, per_row).full());
        assert!(with(MAX_BATCH_BYTES / per_row, per_row).full());
        // One row larger than the bound still makes a batch (progress).
        assert!(with(1, MAX_BATCH_BYTES + 1).full());
    }
}
