//! The polling publisher: `workers` batch loops per process, each on a database session
//! of its own that holds its partition locks and runs its batches, with retries, pauses
//! for failing rows and retention.
//!
//! # Workers
//!
//! A batch is strictly sequential (select, publish and wait for acknowledgements, mark
//! or delete, commit), so one loop leaves the database idle while the broker works and
//! the other way round: a single loop kept two cores 56% busy. Each worker is a member
//! of its own (its own session, its own member slot and share of the partitions, as a
//! replica is), so one worker's select and commit overlap another's publishing and
//! order needs no new rule: a partition still has one owner at a time. The workers of
//! a process share its broker client, its failure counts and pauses, and the 2 MiB
//! bound on payloads in flight ([`MAX_BATCH_BYTES`]).
//!
//! # Why the batches run on the lock session
//!
//! Partition locks are session advisory locks. Running each batch transaction on that
//! same connection means a lost connection ends the locks and the open transaction at
//! the same instant: no other process can take a partition over while this one still
//! holds its rows in an open transaction (with SKIP LOCKED it would skip them and
//! publish later rows of the same aggregates first). Locks are released only between
//! batches, after the commit.
//!
//! # Fencing
//!
//! A relay cut off from its database (a partitioned network, a dead router) may not
//! learn of it for a while, and the server, once its keepalive gives up, releases the
//! relay's partition locks to the other replicas. Two rules keep an aggregate's events
//! from coming from two relays at once: the server gives up on a silent client after
//! about 25 s (this session's `tcp_keepalives_*`), and a batch is published only within
//! `FENCE` (15 s) of the round trip that selected it; what is left goes back
//! unpublished, as after an outage, and the next batch needs a fresh round trip.
//!
//! A session the server or a pooler ends on purpose (`pg_terminate_backend`, a
//! pooler's `KILL`, a restart) releases the locks at once, well inside the fence, so
//! the fence also asks whether the session is still open: its connection task sees the
//! server's goodbye and the close as they arrive, and no message goes out after that
//! (`chains::Fence`). The server's idle timeouts, which a role or database may set, are
//! turned off on the session (`postgres::keep_open_while_publishing`): the batch's
//! transaction is idle while the broker confirms, by design.
//!
//! # Order inside a batch
//!
//! Rows of one aggregate form a chain: its first row goes out with the batch, and once
//! it is acknowledged the rest follows (`relay::chains`). To NATS and RabbitMQ each
//! next row waits for the acknowledgement of the one before, since they could let a
//! later message through after an earlier one failed. To Kafka the rest goes out at
//! once: its idempotent producer keeps a partition in send order, and the relay never
//! lets it write a message behind one it gave up (see `broker::kafka`). Either way a
//! chain stops at its first failure and nothing after it is written ahead of its retry.
//! All chains of a batch are in flight at once, so a batch costs one or two round
//! trips to Kafka, and to the others as many as its longest chain has rows.
//! In `ordering.mode: none` every row is its own chain.
//!
//! # Attempts
//!
//! Failed attempts are counted in memory per process, only for failures that are the
//! row's fault (the broker refused the message); outages are retried without counting.
//! Trade-off: a restart or a takeover starts the count again, so a bad row may be tried
//! up to `maxAttempts` times per process lifetime before it is blocked or dead-lettered;
//! in exchange the outbox table needs no extra column and no extra write per failure.
//!
//! # Submodules
//!
//! This module starts a process's workers and its housekeeping; below it: a worker's
//! sessions, partition ownership and batches (`worker`), what the workers of a process
//! share, failed rows among it (`shared`), when the next poll is due and how many rows
//! it selects (`pacing`), and the backlog gauges and retention (`housekeeping`).

mod housekeeping;
mod pacing;
mod shared;
mod worker;

use std::sync::Arc;

use tokio::sync::watch;
use tokio_postgres::Client;
use tracing::Instrument;

use super::MAX_BATCH_BYTES;
use super::RelayError;
use super::config::Settings;
use super::http::Health;
use crate::api::AfterPublish;
use crate::broker::{Broker, Shape};
use crate::postgres::PgError;
use crate::postgres::polling;
use crate::postgres::table::{Columns, OutboxTable};
use housekeeping::housekeeping_loop;
use shared::Shared;
use worker::Worker;

/// The polling publisher of one process: its workers and its housekeeping.
pub(super) struct Publisher {
    settings: Settings,
    broker: Arc<dyn Broker>,
    shape: Shape,
    health: Arc<Health>,
    stop: watch::Receiver<bool>,
}

impl Publisher {
    pub(super) fn new(
        settings: Settings,
        broker: Arc<dyn Broker>,
        shape: Shape,
        health: Arc<Health>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        Self {
            settings,
            broker,
            shape,
            health,
            stop,
        }
    }

    /// Runs the workers and the housekeeping until shutdown, or until a worker cannot
    /// go on (the others are then dropped, which rolls their batches back).
    pub(super) async fn run(self) -> Result<(), RelayError> {
        let class = polling::lock_class(
            &self.settings.valid.table.schema,
            &self.settings.valid.table.name,
        );
        let housekeeping = tokio::spawn(housekeeping_loop(
            self.settings.clone(),
            self.health.clone(),
            self.stop.clone(),
        ));
        let count = self.settings.workers.max(1);
        let shared = Arc::new(Shared::new(count));
        let budget = MAX_BATCH_BYTES / count;
        let mut workers = tokio::task::JoinSet::new();
        for index in 0..count {
            let worker = Worker {
                index,
                settings: self.settings.clone(),
                broker: self.broker.clone(),
                shape: self.shape.clone(),
                health: self.health.clone(),
                stop: self.stop.clone(),
                class,
                shared: shared.clone(),
                layout_warned: None,
                budget,
                limit: self.settings.batch_size,
            };
            let span = tracing::info_span!("worker", worker = index);
            workers.spawn(async move { worker.publish_loop().await }.instrument(span));
        }
        let mut result = Ok(());
        while let Some(joined) = workers.join_next().await {
            let ended = joined.unwrap_or_else(|err| {
                // The join error names the task (an id that changes every run): on a
                // line of its own, after the one the pod's status repeats.
                Err(RelayError::Worker(format!(
                    "a polling worker stopped unexpectedly\n{err}"
                )))
            });
            if ended.is_err() {
                result = ended;
                break;
            }
        }
        workers.shutdown().await;
        housekeeping.abort();
        result
    }
}

/// The outbox table as the polling relay of `settings` reads it: its columns checked
/// and its queries built (the publishing session and housekeeping share this).
async fn inspect_table(client: &Client, settings: &Settings) -> Result<OutboxTable, PgError> {
    let valid = &settings.valid;
    let t = &valid.table;
    let columns = Columns::of(t);
    let after_publish = match &valid.mode {
        crate::spec::ValidMode::Polling(p) => p.after_publish,
        crate::spec::ValidMode::LogTailing(_) => AfterPublish::Delete,
    };
    let table = OutboxTable::inspect(
        client,
        t,
        &settings.dead_letter_table,
        columns,
        after_publish,
        valid.partitions,
    )
    .await?;
    if !table.ordered_by_insertion() {
        return Err(PgError::Schema(format!(
            "{}.{}: the id is not an integer, so the poller orders rows by \
             table.columns.createdAt ({}), which the table lacks: add it \
             (ALTER TABLE … ADD COLUMN {} timestamptz NOT NULL DEFAULT clock_timestamp()), \
             or name a column that grows with insertion in table.columns.order",
            t.schema, t.name, t.columns.created_at, t.columns.created_at
        )));
    }
    Ok(table)
}
