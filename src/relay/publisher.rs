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
//! [`FENCE`] (15 s) of the round trip that selected it; what is left goes back
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

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio_postgres::Client;
use tracing::Instrument;

use super::MAX_BATCH_BYTES;
use super::RelayError;
use super::backoff::{Backoff, MAX_BACKOFF};
use super::chains::{ChainResult, Fence, chains, publish_chains};
use super::config::Settings;
use super::http::Health;
use super::metrics::ErrorLabels;
use super::ownership;
use crate::api::{AfterPublish, OnExhausted};
use crate::broker::{Broker, PublishError, Shape};
use crate::postgres::polling::{self, MAX_MEMBERS, MEMBER_BASE, RETENTION_KEY};
use crate::postgres::table::{Columns, OutboxTable};
use crate::postgres::{self, OutboxRow, PgError};

/// How long after its last round trip a session's partition locks count as held: no
/// message of a batch is sent later than this after the query that selected it. The
/// server releases a vanished client's locks only once its TCP keepalive gives up
/// (set per session to about 25 s, [`polling::SERVER_KEEPALIVES`]), so a relay cut off
/// from its database has stopped publishing before another replica can take its
/// partitions over, and an aggregate's events never come from two relays at once.
const FENCE: Duration = Duration::from_secs(15);
/// How often a relay waiting for another partition count to go says so.
const LAYOUT_WARN_EVERY: Duration = Duration::from_secs(30);
/// How often ownership is rebalanced (and a dead replica's partitions taken over).
const REBALANCE_EVERY: Duration = Duration::from_secs(1);
/// How often backlog and oldest-age metrics are measured.
const STATS_EVERY: Duration = Duration::from_secs(5);
/// Rows per retention delete statement: short statements, short locks.
const RETENTION_CHUNK: i64 = 1000;
/// How long a partition blocked by an exhausted row waits before the row is tried again.
const BLOCKED_RETRY: Duration = Duration::from_secs(60);
/// How long an in-flight batch may run after SIGTERM before it is rolled back.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(15);

/// A partition that waits before its failing row is tried again.
struct Pause {
    until: Instant,
    exhausted: bool,
}

/// How a session ended.
enum SessionEnd {
    /// The database failed; reconnect.
    Db(PgError),
    /// Shutdown: the in-flight batch was abandoned (rolled back with the connection).
    Abandoned,
    /// Cannot go on.
    Fatal(RelayError),
}

impl From<PgError> for SessionEnd {
    fn from(err: PgError) -> Self {
        SessionEnd::Db(err)
    }
}

/// What a batch found.
enum Outcome {
    /// A full batch: poll again at once.
    Full,
    /// Less than a full batch: poll again one interval after the round started.
    Partial,
    /// The broker is unavailable: back off.
    Unavailable,
}

/// The polling publisher of one process: its workers and its housekeeping.
pub(super) struct Publisher {
    settings: Settings,
    broker: Arc<dyn Broker>,
    shape: Shape,
    health: Arc<Health>,
    stop: watch::Receiver<bool>,
}

/// Failed rows, counted per process whichever worker meets them.
#[derive(Default)]
struct Failures {
    attempts: HashMap<i64, u32>,
    paused: HashMap<i64, Pause>,
}

/// What the workers of one process share.
struct Shared {
    failures: Mutex<Failures>,
    /// Each worker's readiness and owned partitions, for the process's figures.
    workers: Mutex<Vec<WorkerState>>,
}

#[derive(Default, Clone)]
struct WorkerState {
    ready: bool,
    owned: BTreeSet<i64>,
}

impl Shared {
    fn new(workers: usize) -> Self {
        Self {
            failures: Mutex::default(),
            workers: Mutex::new(vec![WorkerState::default(); workers]),
        }
    }

    fn failures(&self) -> MutexGuard<'_, Failures> {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Updates worker `index`'s state and the process's figures: ready once every
    /// worker is, and the partitions they own together.
    fn set(&self, index: usize, health: &Health, change: impl FnOnce(&mut WorkerState)) {
        let mut workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(state) = workers.get_mut(index) {
            change(state);
        }
        let ready = workers.iter().all(|w| w.ready);
        let owned: usize = workers.iter().map(|w| w.owned.len()).sum();
        health.ready.store(ready, Ordering::Relaxed);
        health
            .metrics
            .partitions_owned
            .set(i64::try_from(owned).unwrap_or(0));
    }

    /// Partitions blocked by an exhausted row among those the process publishes (every
    /// partition without per-aggregate order).
    fn blocked(&self, per_aggregate: bool) -> usize {
        // Lock order: `workers`, then `failures` (nothing takes them the other way).
        let workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        self.failures()
            .paused
            .iter()
            .filter(|(p, pause)| {
                pause.exhausted && (!per_aggregate || workers.iter().any(|w| w.owned.contains(p)))
            })
            .count()
    }
}

/// One batch loop of a process (see the module's notes, "Workers").
struct Worker {
    index: usize,
    settings: Settings,
    broker: Arc<dyn Broker>,
    shape: Shape,
    health: Arc<Health>,
    stop: watch::Receiver<bool>,
    class: i32,
    shared: Arc<Shared>,
    /// When waiting for another partition count was last logged.
    layout_warned: Option<Instant>,
    /// Payload bytes this worker's batch holds at most: its share of
    /// [`MAX_BATCH_BYTES`].
    budget: usize,
    /// Rows the next batch selects: `batchSize`, or fewer when rows are large (see
    /// [`next_limit`]).
    limit: i64,
}

/// When the next poll is due. A round is the polls from one nap to the next: full
/// batches poll again at once, and the interval runs from the round's first poll, so
/// a round that needed several batches does not add its own length to the interval.
/// (Counted from the round's last poll, large rows made rounds of three batches and
/// a cycle of the interval plus those batches: 16 KiB rows at 6,000/s waited
/// 144 ms at p99 with `interval: 100ms`.)
#[derive(Debug, Default)]
struct Rounds {
    /// The first poll of the current round.
    started: Option<Instant>,
}

impl Rounds {
    /// A poll starts at `at`.
    fn polled(&mut self, at: Instant) {
        self.started.get_or_insert(at);
    }

    /// The poll did not fill a batch, at `now`: the round ends, and the next starts one
    /// interval after this one started. A round longer than that still rests a tenth
    /// of the interval, so a slow database gets a breath between rounds.
    fn nap(&mut self, interval: Duration, now: Instant) -> Duration {
        let started = self.started.take().unwrap_or(now);
        interval
            .saturating_sub(now.saturating_duration_since(started))
            .max(interval / 10)
    }

    /// The round was cut short (an unavailable broker, no partition to poll): the
    /// next poll starts a new one.
    fn abandon(&mut self) {
        self.started = None;
    }
}

/// The next batch's row limit: as many rows as fit `budget` bytes at the last batch's
/// average payload size, between 1 and `batch_size`. An empty batch says nothing about
/// sizes and keeps `current`.
fn next_limit(batch_size: i64, current: i64, rows: usize, bytes: usize, budget: usize) -> i64 {
    if rows == 0 {
        return current;
    }
    let average = (bytes / rows).max(1);
    i64::try_from(budget / average)
        .unwrap_or(batch_size)
        .clamp(1, batch_size)
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
            class,
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

impl Worker {
    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// Sleeps for `pause`, waking early on shutdown.
    async fn nap(&self, pause: Duration) {
        crate::relay::nap_as(&self.stop, &self.health, self.index, pause).await;
    }

    fn per_aggregate(&self) -> bool {
        self.settings.valid.per_aggregate
    }

    /// Updates this worker's readiness and owned partitions in the process's figures.
    fn set_state(&self, change: impl FnOnce(&mut WorkerState)) {
        self.shared.set(self.index, &self.health, change);
    }

    /// Connects, runs sessions and reconnects with backoff until shutdown.
    async fn publish_loop(mut self) -> Result<(), RelayError> {
        let mut backoff = Backoff::new();
        let env = self.settings.url_env.clone();
        while !self.stopping() {
            self.health.turned_by(self.index);
            let connected =
                postgres::connect(&self.settings.database_url, &env, &self.settings.pg_tls).await;
            let mut client = match connected {
                Ok(client) => client,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot connect to PostgreSQL; retrying");
                    self.nap(backoff.step()).await;
                    continue;
                }
            };
            let ended = self.session(&mut client, &mut backoff).await;
            self.set_state(|w| *w = WorkerState::default());
            match ended {
                Ok(()) => {
                    // Locks go with the session anyway; releasing them explicitly hands
                    // the partitions over at once rather than when the socket closes.
                    if let Err(err) = polling::unlock_all(&client).await {
                        tracing::warn!(error = %err, "releasing locks at shutdown failed");
                    }
                    return Ok(());
                }
                Err(SessionEnd::Abandoned) => {
                    tracing::warn!("in-flight batch rolled back at shutdown");
                    return Ok(());
                }
                Err(SessionEnd::Fatal(err)) => return Err(err),
                Err(SessionEnd::Db(err)) => {
                    tracing::warn!(error = %err, "database session lost; reconnecting");
                    drop(client);
                    self.nap(backoff.step()).await;
                }
            }
        }
        Ok(())
    }

    /// One database session: inspect the table, join as a member, then rebalance and
    /// run batches until shutdown or an error.
    async fn session(
        &mut self,
        client: &mut Client,
        backoff: &mut Backoff,
    ) -> Result<(), SessionEnd> {
        let valid = &self.settings.valid;
        polling::tighten_server_keepalives(client).await?;
        let table = inspect_table(client, &self.settings).await?;
        if valid.failure.dead_letter_table.is_some() {
            table.ensure_dead_letter_table(client).await?;
        }
        if self.per_aggregate() {
            // Before joining: a relay of another partition count takes no member slot
            // and no partition while it waits, so the leading relays keep every
            // partition of their count.
            polling::hold_layout(client, self.class, table.partitions()).await?;
            self.set_state(|w| w.ready = true);
            while !self.leads(client, table.partitions()).await? {
                if self.stopping() {
                    return Ok(());
                }
                self.nap(REBALANCE_EVERY).await;
            }
        }
        let member = self.join(client).await?;
        self.set_state(|w| w.ready = true);
        tracing::info!(member, "connected to PostgreSQL");
        let partitions = usize::try_from(table.partitions()).unwrap_or(1);
        let mut owned = BTreeSet::new();
        let mut next_rebalance = Instant::now();
        let mut rounds = Rounds::default();
        loop {
            self.health.turned_by(self.index);
            if self.stopping() {
                return Ok(());
            }
            let now = Instant::now();
            if self.per_aggregate() && now >= next_rebalance {
                self.rebalance(client, member, partitions, &mut owned)
                    .await?;
                next_rebalance = now + REBALANCE_EVERY;
                if !self.leads(client, table.partitions()).await? {
                    // Only a session older than this one could lead now: start over,
                    // releasing every lock, and wait as a newcomer.
                    return Err(SessionEnd::Db(PgError::Replication(
                        "relays with another ordering.partitions lead on this table".to_owned(),
                    )));
                }
            }
            let candidates: BTreeSet<i64> = if self.per_aggregate() {
                owned.clone()
            } else {
                (0..i64::from(table.partitions())).collect()
            };
            let active: BTreeSet<i64> = {
                let mut failures = self.shared.failures();
                failures.paused.retain(|_, p| p.until > now);
                candidates
                    .into_iter()
                    .filter(|p| !failures.paused.contains_key(p))
                    .collect()
            };
            let blocked = self.shared.blocked(self.per_aggregate());
            self.health
                .metrics
                .partitions_blocked
                .set(i64::try_from(blocked).unwrap_or(0));
            if active.is_empty() {
                rounds.abandon();
                self.nap(self.settings.interval.min(REBALANCE_EVERY)).await;
                continue;
            }
            // After SIGTERM the in-flight batch gets SHUTDOWN_GRACE to finish; then it
            // is dropped, and dropping the connection rolls it back.
            let mut stop = self.stop.clone();
            let grace = async move {
                let _ = stop.wait_for(|s| *s).await;
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            };
            rounds.polled(Instant::now());
            let outcome = tokio::select! {
                outcome = self.batch(client, &table, &active) => outcome?,
                () = grace => return Err(SessionEnd::Abandoned),
            };
            match outcome {
                Outcome::Full => backoff.reset(),
                Outcome::Partial => {
                    backoff.reset();
                    self.nap(rounds.nap(self.settings.interval, Instant::now()))
                        .await;
                }
                Outcome::Unavailable => {
                    rounds.abandon();
                    if let Some(why) = self.broker.broken() {
                        return Err(SessionEnd::Fatal(RelayError::BrokerBroken(why)));
                    }
                    self.nap(backoff.step()).await;
                }
            }
        }
    }

    /// Whether relays of this partition count may publish now (see
    /// [`polling::leading_layout`]); says so, now and then, when not.
    async fn leads(&mut self, client: &Client, partitions: i32) -> Result<bool, PgError> {
        let lead = polling::leading_layout(client, self.class).await?;
        let leads = lead.is_none_or(|n| n == partitions);
        if !leads
            && self
                .layout_warned
                .is_none_or(|t| t.elapsed() > LAYOUT_WARN_EVERY)
        {
            self.layout_warned = Some(Instant::now());
            tracing::warn!(
                partitions,
                running = lead,
                "relays with another ordering.partitions still run on this table; waiting until they stop, so no aggregate is published under two partition counts at once"
            );
        }
        Ok(leads)
    }

    /// Takes the lowest free member slot, so replicas can count each other.
    async fn join(&self, client: &Client) -> Result<i32, SessionEnd> {
        for slot in 0..MAX_MEMBERS {
            if polling::try_lock(client, self.class, MEMBER_BASE + slot).await? {
                return Ok(slot);
            }
        }
        Err(SessionEnd::Fatal(RelayError::Broker(format!(
            "more than {MAX_MEMBERS} relay sessions (replicas × workers) share this table"
        ))))
    }

    /// Releases partitions above this process's share and takes free ones below it.
    async fn rebalance(
        &self,
        client: &Client,
        member: i32,
        partitions: usize,
        owned: &mut BTreeSet<i64>,
    ) -> Result<(), PgError> {
        let members = polling::live_members(client, self.class).await?;
        let rank = members
            .iter()
            .position(|m| *m == MEMBER_BASE + member)
            .unwrap_or(0);
        let target = ownership::target(partitions, members.len(), rank);
        while owned.len() > target {
            let Some(p) = owned.iter().next_back().copied() else {
                break;
            };
            polling::unlock(client, self.class, i32::try_from(p).unwrap_or(0)).await?;
            owned.remove(&p);
            tracing::info!(partition = p, "released partition to another replica");
        }
        if owned.len() < target {
            for p in ownership::preference(partitions, members.len(), rank) {
                if owned.len() >= target {
                    break;
                }
                if owned.contains(&p) {
                    continue;
                }
                if polling::try_lock(client, self.class, i32::try_from(p).unwrap_or(0)).await? {
                    owned.insert(p);
                    tracing::info!(partition = p, "took partition");
                }
            }
        }
        let now_owned = owned.clone();
        self.set_state(|w| w.owned = now_owned);
        Ok(())
    }

    /// One batch: select, publish every chain, handle failures, mark, commit.
    async fn batch(
        &mut self,
        client: &mut Client,
        table: &OutboxTable,
        active: &BTreeSet<i64>,
    ) -> Result<Outcome, SessionEnd> {
        let started = Instant::now();
        let tx = client.transaction().await.map_err(|source| PgError::Db {
            what: "starting a batch",
            source,
        })?;
        // The round trip that selects the batch also proves the session (and so its
        // partition locks) alive as of `asked`: the batch is published only up to
        // `asked + FENCE`.
        let asked = Instant::now();
        let limit = self.limit;
        let rows = table.select_batch(&tx, active, limit).await?;
        let bytes = rows.iter().map(OutboxRow::payload_len).sum();
        self.limit = next_limit(
            self.settings.batch_size,
            limit,
            rows.len(),
            bytes,
            self.budget,
        );
        let fence = asked + FENCE;
        let selected = rows.len();
        if rows.is_empty() {
            tx.commit().await.map_err(|source| PgError::Db {
                what: "committing an empty batch",
                source,
            })?;
            return Ok(Outcome::Partial);
        }
        let chains = chains(rows, self.per_aggregate());
        let broker = self.broker.as_ref();
        let fence = Fence {
            until: Some(fence),
            session: Some(tx.client()),
        };
        let results: Vec<ChainResult> = publish_chains(broker, &self.shape, chains, &fence).await;
        let mut ids = Vec::with_capacity(selected);
        let mut lags = Vec::new();
        let mut unavailable = false;
        let mut outage = crate::relay::Outage::default();
        let now_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        for result in results {
            for (id, created) in result.published {
                ids.push(id);
                if let Some(created) = created {
                    lags.push((now_unix - created).max(0.0));
                }
            }
            // The failed row comes first; the rest of its chain was not sent and stays
            // unpublished for the next batch.
            if let Some((rest, err)) = result.failed
                && let Some(row) = rest.first()
            {
                match self.handle_failure(&tx, table, row, &err).await {
                    Ok(true) => {
                        unavailable = true;
                        outage.add(&rest, &err);
                    }
                    Ok(false) => {}
                    Err(failed) => {
                        // What failed for no fault of its own before this is still said.
                        outage.report(&self.health, ids.len());
                        return Err(failed.into());
                    }
                }
            }
        }
        outage.report(&self.health, ids.len());
        table.finish_published(&tx, &ids).await?;
        tx.commit().await.map_err(|source| PgError::Db {
            what: "committing a batch",
            source,
        })?;
        let m = &self.health.metrics;
        m.published.inc_by(u64::try_from(ids.len()).unwrap_or(0));
        for lag in lags {
            m.end_to_end_lag.observe(lag);
        }
        m.batch_duration.observe(started.elapsed().as_secs_f64());
        if !ids.is_empty() {
            m.last_success.set(now_unix);
        }
        let mut failures = self.shared.failures();
        if !failures.attempts.is_empty() {
            for id in &ids {
                failures.attempts.remove(id);
            }
        }
        drop(failures);
        Ok(if unavailable {
            Outcome::Unavailable
        } else if i64::try_from(selected).unwrap_or(0) >= limit {
            Outcome::Full
        } else {
            Outcome::Partial
        })
    }

    /// Pauses `partition` for every worker of the process.
    fn pause(&self, partition: i64, pause: Pause) {
        self.shared.failures().paused.insert(partition, pause);
    }

    /// Counts a failed row; pauses, blocks or dead-letters it. Returns true when the
    /// failure was an outage (the whole relay backs off).
    async fn handle_failure(
        &mut self,
        tx: &tokio_postgres::Transaction<'_>,
        table: &OutboxTable,
        row: &OutboxRow,
        err: &PublishError,
    ) -> Result<bool, PgError> {
        let m = &self.health.metrics;
        if !err.is_refused() {
            m.publish_errors
                .get_or_create(&ErrorLabels {
                    kind: "unavailable",
                })
                .inc();
            // Logged once for the batch (`Outage`), not once a row.
            return Ok(true);
        }
        m.publish_errors
            .get_or_create(&ErrorLabels { kind: "row" })
            .inc();
        let attempts = {
            let mut failures = self.shared.failures();
            let attempts = failures.attempts.entry(row.id).or_insert(0);
            *attempts += 1;
            *attempts
        };
        if attempts < self.settings.max_attempts {
            let pause = Duration::from_millis(200)
                .saturating_mul(1 << attempts.min(8))
                .min(MAX_BACKOFF);
            tracing::warn!(
                row = row.id,
                partition = row.partition,
                attempts,
                error = %err,
                "row refused by the broker; retrying its partition later"
            );
            self.pause(
                row.partition,
                Pause {
                    until: Instant::now() + pause,
                    exhausted: false,
                },
            );
            return Ok(false);
        }
        match self.settings.on_exhausted() {
            OnExhausted::DeadLetter => {
                // In a savepoint: a dead-letter write that fails (the table dropped, a
                // privilege revoked) must not roll back the batch's marks, or every row
                // the batch published would be published again on each attempt.
                match table
                    .dead_letter_in_batch(tx, row.id, &err.message())
                    .await?
                {
                    Ok(_) => {
                        self.shared.failures().attempts.remove(&row.id);
                        m.dead_lettered.inc();
                        tracing::error!(
                            row = row.id,
                            partition = row.partition,
                            attempts,
                            error = %err,
                            dead_letter_table = %self.settings.dead_letter_table,
                            "row exhausted its attempts; moved to the dead-letter table"
                        );
                    }
                    Err(dead) => {
                        m.publish_errors
                            .get_or_create(&ErrorLabels {
                                kind: "dead_letter",
                            })
                            .inc();
                        tracing::error!(
                            row = row.id,
                            partition = row.partition,
                            error = %dead,
                            "row exhausted its attempts and cannot be dead-lettered; its partition is blocked until it can"
                        );
                        self.pause(
                            row.partition,
                            Pause {
                                until: Instant::now() + BLOCKED_RETRY,
                                exhausted: true,
                            },
                        );
                    }
                }
            }
            OnExhausted::Block => {
                tracing::error!(
                    row = row.id,
                    partition = row.partition,
                    attempts,
                    error = %err,
                    "row exhausted its attempts; its partition is blocked until it can be published"
                );
                self.pause(
                    row.partition,
                    Pause {
                        until: Instant::now() + BLOCKED_RETRY,
                        exhausted: true,
                    },
                );
            }
        }
        Ok(false)
    }
}

/// The backlog gauges and the retention of published rows, on a connection of their
/// own: counting a large backlog or deleting many old rows (or waiting on a lock while
/// doing so) never holds up publishing. One replica of a table deletes at a time (the
/// retention advisory lock, held by this connection's session); every replica measures.
async fn housekeeping_loop(
    settings: Settings,
    class: i32,
    health: Arc<Health>,
    mut stop: watch::Receiver<bool>,
) {
    let retention_every =
        (settings.retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let plan = crate::postgres::admin::Plan::for_relay(&settings.valid);
    let mut session: Option<(Client, OutboxTable, bool)> = None;
    let mut next_retention = Instant::now() + retention_every;
    let mut backlog_pacing = crate::postgres::admin::Pacing::new(STATS_EVERY);
    loop {
        if session.as_ref().is_none_or(|(c, _, _)| c.is_closed()) {
            session = housekeeping_session(&settings)
                .await
                .map(|(c, t)| (c, t, false));
        }
        if let Some((client, table, holds_retention)) = session.as_mut() {
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
            if Instant::now() >= next_retention {
                next_retention = Instant::now() + retention_every;
                let kept = retention(client, table, class, holds_retention, &settings, &stop).await;
                if let Err(err) = kept {
                    tracing::warn!(error = %err, "deleting old published rows failed; retrying later");
                    session = None;
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(STATS_EVERY) => {}
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
    OutboxTable::inspect(
        client,
        &t.schema,
        &t.name,
        &settings.dead_letter_table,
        columns,
        after_publish,
        valid.partitions,
    )
    .await
}

/// Deletes published rows older than the retention, in chunks, while this session
/// holds the table's retention lock.
async fn retention(
    client: &Client,
    table: &OutboxTable,
    class: i32,
    holds: &mut bool,
    settings: &Settings,
    stop: &watch::Receiver<bool>,
) -> Result<(), PgError> {
    if !*holds {
        *holds = polling::try_lock(client, class, RETENTION_KEY).await?;
    }
    if !*holds {
        return Ok(());
    }
    loop {
        let deleted = table
            .delete_published_before(client, settings.retention, RETENTION_CHUNK)
            .await?;
        if deleted > 0 {
            tracing::debug!(deleted, "deleted old published rows");
        }
        if deleted < u64::try_from(RETENTION_CHUNK).unwrap_or(0) || *stop.borrow() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_interval_runs_from_a_rounds_first_poll() {
        let interval = 100 * MS;
        let t0 = Instant::now();
        let mut rounds = Rounds::default();
        // Three full batches of 25 ms, then one that is not full at 75 ms: the next
        // round starts 100 ms after the first poll, not 100 ms after the last.
        for poll in 0..4 {
            rounds.polled(t0 + poll * 25 * MS);
        }
        assert_eq!(rounds.nap(interval, t0 + 80 * MS), 20 * MS);
        // The next round counts from its own first poll.
        rounds.polled(t0 + 100 * MS);
        assert_eq!(rounds.nap(interval, t0 + 110 * MS), 90 * MS);
    }

    #[test]
    fn a_round_longer_than_the_interval_still_rests_a_tenth_of_it() {
        let t0 = Instant::now();
        let mut rounds = Rounds::default();
        rounds.polled(t0);
        rounds.polled(t0 + 150 * MS);
        assert_eq!(rounds.nap(100 * MS, t0 + 180 * MS), 10 * MS);
    }

    #[test]
    fn a_round_cut_short_does_not_shorten_the_next() {
        let t0 = Instant::now();
        let mut rounds = Rounds::default();
        rounds.polled(t0);
        // The broker was unavailable: back-off, then a new round at 5 s.
        rounds.abandon();
        rounds.polled(t0 + 5000 * MS);
        assert_eq!(rounds.nap(100 * MS, t0 + 5020 * MS), 80 * MS);
    }

    #[test]
    fn a_process_is_ready_once_every_worker_is_and_owns_what_they_own_together() {
        let health = Health::new(super::super::metrics::Metrics::new("ns", "relay", false));
        let shared = Shared::new(2);
        shared.set(0, &health, |w| {
            w.ready = true;
            w.owned = BTreeSet::from([0, 1]);
        });
        assert!(!health.ready.load(Ordering::Relaxed), "one of two workers");
        assert_eq!(health.metrics.partitions_owned.get(), 2);
        shared.set(1, &health, |w| {
            w.ready = true;
            w.owned = BTreeSet::from([2, 3]);
        });
        assert!(health.ready.load(Ordering::Relaxed));
        assert_eq!(health.metrics.partitions_owned.get(), 4);
        // A worker's session ends: not ready, its partitions gone.
        shared.set(1, &health, |w| *w = WorkerState::default());
        assert!(!health.ready.load(Ordering::Relaxed));
        assert_eq!(health.metrics.partitions_owned.get(), 2);
    }

    #[test]
    fn a_blocked_partition_counts_once_for_the_process() {
        let health = Health::new(super::super::metrics::Metrics::new("ns", "relay", false));
        let shared = Shared::new(2);
        shared.set(0, &health, |w| w.owned = BTreeSet::from([0, 1]));
        shared.set(1, &health, |w| w.owned = BTreeSet::from([2, 3]));
        let later = Instant::now() + Duration::from_secs(60);
        let mut failures = shared.failures();
        for (partition, exhausted) in [(1, true), (2, false), (3, true), (7, true)] {
            failures.paused.insert(
                partition,
                Pause {
                    until: later,
                    exhausted,
                },
            );
        }
        drop(failures);
        // Owned by a worker and exhausted: 1 and 3 (7 went to another process).
        assert_eq!(shared.blocked(true), 2);
        // Without per-aggregate order every worker polls every partition: each blocked
        // partition once, not once per worker.
        assert_eq!(shared.blocked(false), 3);
    }

    #[test]
    fn large_rows_make_smaller_batches_within_batch_size() {
        // 1 KiB rows: 2 MiB holds 2,048, so batchSize (500) stands.
        assert_eq!(next_limit(500, 500, 500, 500 * 1024, MAX_BATCH_BYTES), 500);
        // 16 KiB rows: 128 fit.
        assert_eq!(
            next_limit(500, 500, 500, 500 * 16 * 1024, MAX_BATCH_BYTES),
            128
        );
        // Small again: back to batchSize at once.
        assert_eq!(next_limit(500, 128, 128, 128 * 100, MAX_BATCH_BYTES), 500);
        // A row larger than the bound: one at a time, never zero.
        assert_eq!(
            next_limit(500, 500, 2, 2 * 4 * 1024 * 1024, MAX_BATCH_BYTES),
            1
        );
        // An empty batch keeps the limit.
        assert_eq!(next_limit(500, 128, 0, 0, MAX_BATCH_BYTES), 128);
        // Two workers share the bound: 16 KiB rows, 64 each.
        assert_eq!(
            next_limit(500, 500, 500, 500 * 16 * 1024, MAX_BATCH_BYTES / 2),
            64
        );
    }
}
