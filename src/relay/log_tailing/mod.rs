//! The log-tailing publisher (`mode: logTailing`): streams the outbox table's inserts
//! from a `pgoutput` logical replication slot, publishes them in commit order and
//! confirms a commit to PostgreSQL only once the broker acknowledged all of it.
//!
//! # Confirm after acknowledgement
//!
//! The replication client reports to the server exactly the position handed to
//! `update_applied_lsn` (as write, flush and apply LSN), and nothing before the first
//! call, so the slot's `confirmed_flush_lsn` never passes a commit whose messages are
//! not all acknowledged. A crash anywhere before that makes the server stream the
//! unconfirmed transactions again on reconnect: at-least-once, duplicates possible,
//! nothing lost.
//!
//! # Order
//!
//! Transactions arrive in commit order. Whole transactions are collected into a batch
//! (the ones already received, up to [`MAX_BATCH_ROWS`] rows or [`MAX_BATCH_BYTES`] of
//! payloads), the batch's rows form
//! one chain per aggregate in commit order, chains run concurrently, and each chain
//! publishes one message at a time, waiting for its acknowledgement. A failed message
//! is retried, with the rest of its chain behind it, until it goes through; only then
//! is the batch's last commit confirmed and the next batch read. So per-aggregate
//! order holds across transactions and across restarts.
//!
//! # Bounded memory
//!
//! A transaction larger than a batch (a backfill of millions of rows) is published in
//! chunks of a batch's size as it streams in, each acknowledged before the
//! next is read; its commit is confirmed only once its last chunk is acknowledged. A
//! crash in between streams the whole transaction again (duplicates, nothing lost).
//! The replication client buffers a bounded number of messages and PostgreSQL spills
//! large transactions to disk before sending them, so the relay's memory does not
//! depend on transaction size.
//!
//! # Heartbeats
//!
//! A slot only advances when its consumer confirms a position. When no commit was
//! processed for `heartbeatInterval`, the relay writes a non-transactional logical
//! message (`pg_logical_emit_message(false, 'outbox-heartbeat', <the database's clock>)`) on its normal
//! connection; it arrives on the stream right away and its LSN is confirmed like a
//! commit, so an idle database (or one busy only with other tables) does not make the
//! slot retain WAL without bound.
//!
//! # deleteAfterPublish
//!
//! Published row ids are deleted (by id, in chunks) before their commit is confirmed:
//! a batch acknowledged by the broker goes to the delete task, and only the position
//! the task reports deleted is confirmed to the server. So the table always holds
//! every row whose commit is unconfirmed, and a crash anywhere leaves nothing behind
//! for good: the server streams the unconfirmed commits again, their rows are published
//! again (duplicates, as at-least-once allows) and deleted. The task runs on a
//! connection of its own, so a `DELETE` never holds up the path from stream to broker
//! (inline, it added 50–60 ms to the p99 latency at 5,000 events/s); confirmation
//! trails the broker's acknowledgement by the delete. The deletes go through the slot
//! as well and are ignored there.
//!
//! # Slot and publication
//!
//! The controller owns the publication and the slot: it creates them once its checks
//! pass and drops them through its finalizer, after the relay has stopped. The relay
//! only checks they exist; when they do not, it reports not ready and retries with
//! backoff, so a relay still running during a delete cannot re-create a dropped slot.
//!
//! The server decodes each change with the publication as it was at that point of the
//! WAL: inserts made while the table is out of the publication are never streamed. So
//! the statistics task checks every [`COVERAGE_EVERY`] that the publication still
//! publishes the table (reading the WAL position first), and nothing past the last
//! position seen covered is ever confirmed: a publication altered under the relay makes
//! it stop confirming, log an error and report not ready, instead of confirming past
//! rows it never saw. A change between two such looks (a DROP and ADD of the table) is
//! caught exactly by the publication gate (`gap`) before each batch: with
//! `deleteAfterPublish` the rows left in the table are published first; keeping rows,
//! the relay holds until the change is accepted. A partitioned outbox table is streamed under its own name
//! (`publish_via_partition_root`, as the operator creates publications) or, under a
//! publication without it, under each partition's name; a relation the stream names
//! is asked about once (`pg_partition_root`), and a partition's rows are the table's.
//!
//! # Submodules
//!
//! This module holds the relay loop (sessions, reconnects, the tasks beside the stream)
//! and what its parts share; below it: where the outbox columns sit in the stream
//! (`layout`), reading transactions into batches, publishing and confirming them
//! (`batch`), the delete task (`deleter`) and the slot statistics task (`stats`).

mod batch;
mod deleter;
mod gap;
mod layout;
mod standby;
mod stats;
mod sweep;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pgwire_replication::{Lsn, ReplicationClient};
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;

use super::RelayError;
use super::backoff::Backoff;
use super::config::Settings;
use super::http::Health;
use crate::api::AfterPublish;
use crate::broker::{Broker, Shape};
use crate::postgres::replication as repl;
use crate::postgres::table::{Columns, OutboxTable};
use crate::postgres::{self, PgError, RowId, admin};
use crate::spec::LogTailing as LogTailingSettings;
use deleter::{DeleteTarget, delete_loop};
use stats::{StatsTarget, slot_stats_loop};

/// How often a newly confirmed position is sent to the server (standby status update).
/// Short, because a crash re-publishes whatever was acknowledged but not yet reported.
const CONFIRM_EVERY: Duration = Duration::from_secs(1);
/// A batch stops taking further (already received) transactions at this many rows.
const MAX_BATCH_ROWS: usize = 1000;
/// … or at this many payload bytes, whichever comes first.
use crate::relay::MAX_BATCH_BYTES;
/// How often the slot's statistics are read.
const STATS_EVERY: Duration = Duration::from_secs(3);
/// How often the publication is checked to still publish the table (what may be
/// confirmed trails the acknowledgements by up to this).
const COVERAGE_EVERY: Duration = Duration::from_secs(1);
/// How long the replication connection may take to start streaming.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an unfinished batch may keep retrying after SIGTERM before it is abandoned
/// (unconfirmed, so it is streamed again by the next relay).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(15);
/// Ids per delete statement: short statements, short locks.
const DELETE_CHUNK: usize = 1000;
/// How often an idle stream looks whether the delete task has deleted more, to
/// confirm it.
const DELETE_POLL: Duration = Duration::from_millis(50);
/// Published batches that may wait for the delete task: past them the stream waits, so
/// deletes that keep failing hold publishing back instead of growing memory (and the
/// duplicates a restart would send) without bound.
const DELETE_QUEUE: usize = 64;
/// How long shutdown waits for the deleter to finish the deletes it was handed.
const DELETER_DRAIN: Duration = Duration::from_secs(10);
/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// How a session ended.
enum SessionEnd {
    /// The normal connection failed; reconnect.
    Db(PgError),
    /// The replication stream failed or ended; reconnect.
    Stream(String),
    /// Shutdown while a batch could not be published: it stays unconfirmed.
    Abandoned,
    /// Cannot go on.
    Fatal(RelayError),
}

impl From<PgError> for SessionEnd {
    fn from(err: PgError) -> Self {
        SessionEnd::Db(err)
    }
}

fn stream_error(err: pgwire_replication::PgWireError) -> SessionEnd {
    SessionEnd::Stream(err.to_string())
}

/// The log-tailing publisher of one process.
pub(super) struct LogTailer {
    settings: Settings,
    lt: LogTailingSettings,
    broker: Arc<dyn Broker>,
    shape: Shape,
    health: Arc<Health>,
    stop: watch::Receiver<bool>,
    columns: Columns,
    /// Published ids go here with the commit position covering them, to the delete
    /// task (with `deleteAfterPublish`).
    deleter: Option<mpsc::Sender<deleter::Handed>>,
    /// Through which position the delete task has deleted (what may be confirmed).
    deleted: Option<watch::Receiver<Lsn>>,
    /// The last position handed to the delete task.
    handed: Lsn,
    /// The last commit (or heartbeat) position whose rows are all acknowledged (without
    /// `deleteAfterPublish`).
    acked: Lsn,
    /// The last WAL position at which the publication was seen to publish the table
    /// (from the statistics task): confirmation never goes past it.
    covered: watch::Receiver<Lsn>,
    covered_tx: Option<watch::Sender<Lsn>>,
    /// Failed attempts per row id, against `failure.maxAttempts`.
    attempts: HashMap<RowId, u32>,
    /// The outbox table as the session inspected it (for dead-lettering).
    table: Option<OutboxTable>,
    /// The publication gate's memory (`gap`).
    gate: gap::Gate,
    /// The least position the standby slots were seen to have flushed (`standby`).
    standby_flushed: Lsn,
}

impl LogTailer {
    pub(super) fn new(
        settings: Settings,
        lt: LogTailingSettings,
        broker: Arc<dyn Broker>,
        shape: Shape,
        health: Arc<Health>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        let columns = Columns {
            // The commit time stands in for it.
            created_at: None,
            ..Columns::of(&settings.valid.table)
        };
        let (covered_tx, covered) = watch::channel(Lsn(0));
        let baseline = settings.coverage_baseline.clone();
        Self {
            settings,
            lt,
            broker,
            shape,
            health,
            stop,
            columns,
            deleter: None,
            deleted: None,
            handed: Lsn(0),
            acked: Lsn(0),
            covered,
            covered_tx: Some(covered_tx),
            attempts: HashMap::new(),
            table: None,
            gate: gap::Gate::from_baseline(baseline),
            standby_flushed: Lsn(0),
        }
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// Sleeps for `pause`, waking early on shutdown.
    async fn nap(&self, pause: Duration) {
        crate::relay::nap(&self.stop, &self.health, pause).await;
    }

    async fn connect(&self) -> Result<Client, PgError> {
        postgres::connect(
            &self.settings.database_url,
            &self.settings.url_env,
            &self.settings.pg_tls,
        )
        .await
    }

    /// Runs sessions and reconnects with backoff until shutdown.
    pub(super) async fn run(mut self) -> Result<(), RelayError> {
        let stats = tokio::spawn(slot_stats_loop(
            StatsTarget {
                url: self.settings.database_url.clone(),
                env: self.settings.url_env.clone(),
                tls: self.settings.pg_tls.clone(),
                slot: self.lt.slot.clone(),
                publication: self.lt.publication.clone(),
                schema: self.settings.valid.table.schema.clone(),
                table: self.settings.valid.table.name.clone(),
                backlog: self
                    .lt
                    .delete_after_publish
                    .then(|| admin::Plan::for_relay(&self.settings.valid)),
                archive: self.settings.valid.table.archive.clone().map(|a| {
                    (
                        a,
                        self.columns.published_at.clone(),
                        self.settings.retention,
                    )
                }),
            },
            self.covered_tx.take(),
            self.health.clone(),
            self.stop.clone(),
        ));
        // Unix time up to which the tail has streamed and deleted everything: the
        // sweep's cutoff (0: this process has not streamed anything, a standby).
        let (passed_tx, passed_rx) = watch::channel(0.0_f64);
        let deleter = self.lt.delete_after_publish.then(|| {
            let (tx, rx) = mpsc::channel(DELETE_QUEUE);
            let (deleted_tx, deleted_rx) = watch::channel(Lsn(0));
            self.deleter = Some(tx);
            self.deleted = Some(deleted_rx);
            let t = &self.settings.valid.table;
            tokio::spawn(delete_loop(
                DeleteTarget {
                    url: self.settings.database_url.clone(),
                    env: self.settings.url_env.clone(),
                    tls: self.settings.pg_tls.clone(),
                    schema: t.schema.clone(),
                    table: t.name.clone(),
                    id_column: self.columns.id.clone(),
                    archive: t.archive.clone(),
                    moved_at: self.columns.published_at.clone(),
                },
                rx,
                deleted_tx,
                passed_tx,
                self.stop.clone(),
            ))
        });
        let deleted_rx = self.deleted.clone();
        let sweeper = self.lt.sweep.zip(deleted_rx).map(|(sweep, deleted)| {
            tokio::spawn(sweep::sweep_loop(sweep::SweepTarget {
                settings: self.settings.clone(),
                sweep,
                broker: self.broker.clone(),
                shape: self.shape.clone(),
                health: self.health.clone(),
                stop: self.stop.clone(),
                passed: passed_rx.clone(),
                deleted,
                standby_slots: self.lt.standby_slots.clone(),
            }))
        });
        let mut backoff = Backoff::new();
        let result = loop {
            self.health.turned();
            if self.stopping() {
                break Ok(());
            }
            let ended = self.session(&mut backoff).await;
            self.health.ready.store(false, Ordering::Relaxed);
            match ended {
                Ok(()) => break Ok(()),
                Err(SessionEnd::Abandoned) => {
                    tracing::warn!(
                        "shutdown with an unpublished batch: it stays unconfirmed and is streamed again"
                    );
                    break Ok(());
                }
                Err(SessionEnd::Fatal(err)) => break Err(err),
                Err(SessionEnd::Db(err)) => {
                    tracing::warn!(error = %err, "database session lost; reconnecting");
                }
                Err(SessionEnd::Stream(err)) => {
                    tracing::warn!(error = %err, "replication stream lost; reconnecting");
                }
            }
            self.nap(backoff.step()).await;
        };
        stats.abort();
        if let Some(task) = sweeper {
            // A sweep in flight rolls back; its rows stay for the tail or the next relay.
            task.abort();
        }
        // Closing the channel lets the deleter finish what it was handed, and stop.
        self.deleter = None;
        if let Some(task) = deleter
            && tokio::time::timeout(DELETER_DRAIN, task).await.is_err()
        {
            tracing::warn!(
                "published rows not deleted within {DELETER_DRAIN:?} of shutdown; they stay in the table (already published)"
            );
        }
        result
    }

    /// One session: a normal connection (table check, slot and publication present, heartbeats,
    /// deletes) and a replication connection streaming from the slot's confirmed
    /// position.
    async fn session(&mut self, backoff: &mut Backoff) -> Result<(), SessionEnd> {
        let client = self.connect().await?;
        let t = &self.settings.valid.table;
        // Fails with one line naming a missing table or column.
        let table = OutboxTable::inspect(
            &client,
            t,
            &self.settings.dead_letter_table,
            self.columns.clone(),
            AfterPublish::Delete,
            1,
        )
        .await?;
        if self.settings.on_exhausted() == crate::api::OnExhausted::DeadLetter {
            table.ensure_dead_letter_table(&client).await?;
        }
        self.table = Some(table);
        // The operator creates slot and publication once its checks pass (and drops them
        // when the OutboxRelay goes); the relay never does, so a relay still running
        // after a delete cannot bring a dropped slot back.
        let (slot, publication) =
            admin::replication_objects_exist(&client, &self.lt.slot, &self.lt.publication).await?;
        if !slot || !publication {
            let missing = match (slot, publication) {
                (false, false) => format!(
                    "replication slot {} and publication {} do not exist",
                    self.lt.slot, self.lt.publication
                ),
                (false, true) => format!(
                    "replication slot {} does not exist in this database",
                    self.lt.slot
                ),
                _ => format!("publication {} does not exist", self.lt.publication),
            };
            return Err(SessionEnd::Db(PgError::Replication(format!(
                "{missing}; the operator creates them once its database checks pass (see the OutboxRelay's SlotReady condition)"
            ))));
        }
        let mut config = repl::replication_config(
            &self.settings.database_url,
            &self.settings.url_env,
            crate::postgres::tls::replication_tls(
                self.settings.pg_tls.mode,
                self.settings.pg_ca_file.as_deref(),
                self.settings
                    .pg_client_files
                    .as_ref()
                    .map(|(cert, key)| (cert.as_str(), key.as_str())),
            ),
            &self.lt.slot,
            &self.lt.publication,
            CONFIRM_EVERY,
        )?;
        // A URL naming several hosts: stream from the one the session reached (the
        // primary), not the first written.
        if let Ok(parsed) = postgres::client_config(
            &self.settings.database_url,
            &self.settings.url_env,
            &self.settings.pg_tls,
            "outbox-relay",
        ) && let Some((host, port)) = postgres::hosts::connected_host(&client, &parsed).await
        {
            config.host = host;
            config.port = port;
        }
        crate::postgres::tls::verify_by_address(&mut config.tls, &config.host);
        let mut stream = ReplicationClient::connect(config)
            .await
            .map_err(stream_error)?;
        match tokio::time::timeout(START_TIMEOUT, stream.wait_started()).await {
            Ok(started) => started.map_err(stream_error)?,
            Err(_) => {
                return Err(SessionEnd::Stream(format!(
                    "START_REPLICATION not accepted within {START_TIMEOUT:?}"
                )));
            }
        }
        self.health.ready.store(true, Ordering::Relaxed);
        backoff.reset();
        tracing::info!(slot = %self.lt.slot, publication = %self.lt.publication, "streaming the replication slot");
        let result = self.stream(&client, &mut stream).await;
        if result.is_ok() {
            // Clean shutdown: let the delete task catch up, confirm what it deleted, and
            // wait until the client sent that before the stream closes.
            let deadline = Instant::now() + DELETER_DRAIN;
            while self.deleted_through() < self.handed && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // The client sends a raised position once CONFIRM_EVERY has passed since its
            // last status update; stopping the stream before that would drop it (the
            // next relay would publish again what this one published since).
            let through = self.confirm_at_stop(&client, &stream).await;
            let sent = Instant::now() + CONFIRM_EVERY * 2 + Duration::from_millis(500);
            while stream.metrics().last_applied_lsn() < through && Instant::now() < sent {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), stream.shutdown()).await;
        }
        result
    }
}
