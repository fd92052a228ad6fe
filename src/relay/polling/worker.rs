//! One batch loop of a polling relay (see `relay::polling`, "Workers"): its database
//! sessions, joining as a member, the partitions it owns, and its batches (select,
//! publish, handle failures, mark or delete, commit).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio_postgres::Client;

use super::inspect_table;
use super::pacing::{Rounds, next_limit};
use super::shared::{Shared, WorkerState};
use crate::broker::{Broker, Shape};
use crate::postgres::polling::{self, MAX_MEMBERS, MEMBER_BASE};
use crate::postgres::table::OutboxTable;
use crate::postgres::{self, OutboxRow, PgError};
use crate::relay::RelayError;
use crate::relay::backoff::Backoff;
use crate::relay::chains::{ChainResult, Fence, chains, publish_chains};
use crate::relay::config::Settings;
use crate::relay::http::Health;
use crate::relay::ownership;

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
/// How long an in-flight batch may run after SIGTERM before it is rolled back.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(15);

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

/// One batch loop of a process (see `relay::polling`, "Workers").
pub(super) struct Worker {
    pub(super) index: usize,
    pub(super) settings: Settings,
    pub(super) broker: Arc<dyn Broker>,
    pub(super) shape: Shape,
    pub(super) health: Arc<Health>,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) class: i32,
    pub(super) shared: Arc<Shared>,
    /// When waiting for another partition count was last logged.
    pub(super) layout_warned: Option<Instant>,
    /// Payload bytes this worker's batch holds at most: its share of
    /// [`MAX_BATCH_BYTES`](crate::relay::MAX_BATCH_BYTES).
    pub(super) budget: usize,
    /// Rows the next batch selects: `batchSize`, or fewer when rows are large (see
    /// [`next_limit`]).
    pub(super) limit: i64,
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
    pub(super) async fn publish_loop(mut self) -> Result<(), RelayError> {
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
                match self
                    .shared
                    .handle_failure(&self.settings, &self.health, &tx, table, row, &err)
                    .await
                {
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
}
