//! Status figures apart from reconcile: a task, run only while this replica holds the
//! Lease, that samples every relay's backlog, oldest unpublished age and slot lag on its
//! own timer and patches status only when a figure changed. Reconcile never waits on
//! it, and it writes under a field manager of its own, so the two never remove each
//! other's fields. It also runs the orphaned-slot scan, at most once per database per
//! six intervals.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Api, Resource, ResourceExt};
use serde_json::{Map, Value, json};
use tracing::debug;

use super::Context;
use super::connection;
use super::database;
use super::status::{CONDITION_DATABASE_READY, find};
use crate::api::{OutboxRelay, OutboxRelayStatus};
use crate::postgres::admin::{self, Backlog, Pacing, Plan, human_age};
use crate::postgres::replication::SlotStats;

/// The field manager of the figures in status.
pub const FIGURES_MANAGER: &str = "outbox-operator-figures";
/// Relays sampled at the same time (each holds a pooled connection while it runs).
const CONCURRENCY: usize = 8;

/// The backlog counts of status, per relay (by uid): when each is next due and what the
/// last one found. A count is repeated no sooner than twenty times what it took
/// ([`Pacing`]), and status keeps the last figure in between: counting a large table
/// (a relay far behind, or many dead rows) every interval would keep a database backend
/// busy for each such relay.
#[derive(Default)]
pub(crate) struct BacklogCounts(
    std::sync::Mutex<std::collections::HashMap<String, (Pacing, Counted)>>,
);

/// What one count found: the backlog and the rows in the dead-letter table.
type Counted = (Option<Backlog>, Option<i64>);

impl BacklogCounts {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, (Pacing, Counted)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The relay's backlog and dead letters: counted now when due, else the last
    /// count.
    async fn measure(
        &self,
        uid: &str,
        every: Duration,
        client: &tokio_postgres::Client,
        plan: &Plan,
    ) -> Counted {
        let started = std::time::Instant::now();
        if let Some((pacing, last)) = self.lock().get(uid)
            && !pacing.due(started)
        {
            return *last;
        }
        let counted = (
            database::measure_backlog(client, plan).await,
            database::count_dead_letters(client, plan).await,
        );
        let mut counts = self.lock();
        let (pacing, last) = counts
            .entry(uid.to_owned())
            .or_insert_with(|| (Pacing::new(every), (None, None)));
        pacing.measured(started, started.elapsed());
        *last = counted;
        counted
    }

    /// Forgets relays no longer in the cache.
    fn retain(&self, uids: &std::collections::HashSet<String>) {
        self.lock().retain(|uid, _| uids.contains(uid));
    }
}

/// Samples every relay in `store` each status interval until dropped (the caller aborts
/// it when the controller stops, e.g. on losing the Lease). A pass starts relays no
/// faster than the recheck budget allows (`--max-rechecks-per-second`), so with more
/// relays than one interval holds at that rate each is sampled less often, as it is
/// rechecked: the database's and the API server's load stay flat as relays are added,
/// and a thousand new relays are not sampled, and their figures written, all at once
/// while they are being reconciled. Only relays with figures to sample take a place in
/// a pass, each read afresh from the cache when its turn comes.
pub(super) async fn run(ctx: Arc<Context>, store: Store<OutboxRelay>) {
    let mut tick = tokio::time::interval(ctx.status_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let store = &store;
    loop {
        tick.tick().await;
        if !*ctx.leader.borrow() {
            continue;
        }
        let relays = store.state();
        let uids: std::collections::HashSet<String> =
            relays.iter().filter_map(|r| r.uid()).collect();
        ctx.backlog_counts.retain(&uids);
        ctx.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|uid, _| uids.contains(uid));
        // Only relays with figures to sample take a place in the pass.
        let due: Vec<Arc<OutboxRelay>> = relays
            .into_iter()
            .filter(|relay| sampled_now(relay) && with_connection(relay, &ctx, |_| ()).is_some())
            .collect();
        let pace = pace(ctx.rechecks_per_second, due.len(), ctx.status_interval);
        let started = tokio::time::Instant::now();
        futures::stream::iter(due.into_iter().enumerate())
            .for_each_concurrent(CONCURRENCY, |(index, relay)| {
                let ctx = ctx.clone();
                async move {
                    let Some(at) = started.checked_add(start_offset(index, pace)) else {
                        return;
                    };
                    tokio::time::sleep_until(at).await;
                    // The relay as it is now: a pass may have run for minutes.
                    let Some(relay) = store
                        .get(&kube::runtime::reflector::ObjectRef::from_obj(&*relay))
                        .filter(|now| now.uid() == relay.uid())
                    else {
                        return;
                    };
                    let sampled =
                        tokio::time::timeout(Duration::from_secs(30), sample(&relay, &ctx)).await;
                    if sampled.is_err() {
                        debug!(relay = %relay.name_any(), "sampling status figures timed out");
                    }
                }
            })
            .await;
    }
}

/// The time between two relays' samples within a pass of `relays`: one over the
/// recheck budget (none without a budget), but short enough that the pass ends within
/// the longest time between two rechecks (an hour, or the status interval if longer).
fn pace(rechecks_per_second: f64, relays: usize, status_interval: Duration) -> Duration {
    if rechecks_per_second <= 0.0 || relays == 0 {
        return Duration::ZERO;
    }
    let by_budget = Duration::try_from_secs_f64(1.0 / rechecks_per_second).unwrap_or(Duration::MAX);
    let longest_pass = super::triggers::LONGEST_RECHECK.max(status_interval);
    by_budget.min(longest_pass.div_f64(relays as f64))
}

/// When, from a pass's start, its `index`th relay is sampled; a pass of more relays
/// than fit one interval at this pace runs on past it, and the next starts after it.
fn start_offset(index: usize, pace: Duration) -> Duration {
    pace.saturating_mul(u32::try_from(index).unwrap_or(u32::MAX))
}

/// The figures of one relay, as status shows them.
#[derive(Clone, Debug, Default, PartialEq)]
struct Figures {
    backlog: Option<Backlog>,
    dead_letters: Option<i64>,
    /// Polling with per-aggregate order: the partitions, and how many a relay holds.
    partitions: Option<(i32, i32)>,
    slot: Option<SlotStats>,
}

/// Whether a relay has figures to sample: not being deleted, and its database checks
/// passed (the others' status says why there is nothing to measure).
fn sampled_now(relay: &OutboxRelay) -> bool {
    relay.meta().deletion_timestamp.is_none()
        && find(relay.status.as_ref(), CONDITION_DATABASE_READY).is_some_and(|c| c.status == "True")
}

/// The connection the relay's last reconcile read from its Secrets, if that reconcile
/// saw the relay's current generation: none yet (not reconciled by this process, its
/// spec changed since, or its Secrets do not give a usable one), nothing to measure.
fn connection(relay: &OutboxRelay, ctx: &Context) -> Option<connection::Conn> {
    with_connection(relay, ctx, connection::Conn::clone)
}

/// `look` applied to the connection [`connection`] would return, without cloning it.
fn with_connection<T>(
    relay: &OutboxRelay,
    ctx: &Context,
    look: impl FnOnce(&connection::Conn) -> T,
) -> Option<T> {
    let uid = relay.uid()?;
    ctx.connections
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&uid)
        .filter(|(generation, _)| *generation == relay.metadata.generation)
        .map(|(_, conn)| look(conn))
}

async fn sample(relay: &OutboxRelay, ctx: &Context) {
    if !sampled_now(relay) {
        return;
    }
    let Ok(valid) = crate::spec::parse(relay) else {
        return;
    };
    let Some(conn) = connection(relay, ctx) else {
        return;
    };
    let client = match ctx.pools.get(relay, &conn).await {
        Ok(client) => client,
        Err(err) => {
            debug!(relay = %relay.name_any(), error = %err, "cannot connect to sample status figures");
            return;
        }
    };
    let plan = Plan::for_relay(&valid);
    let (backlog, dead_letters) = ctx
        .backlog_counts
        .measure(
            &relay.uid().unwrap_or_default(),
            ctx.status_interval,
            &client,
            &plan,
        )
        .await;
    let slot_name = relay
        .status
        .as_ref()
        .and_then(|s| s.slot.as_ref())
        .map(|s| s.name.clone())
        .filter(|n| !n.is_empty());
    let slot = match slot_name {
        Some(name) => match admin::slot_state(&client, &name).await {
            Ok(Some(stats)) => Some(stats),
            // Gone, or not readable now: the position last confirmed stays in status,
            // where a lost slot's window starts (the decide step reads it).
            Ok(None) | Err(_) => last_position(relay.status.as_ref()),
        },
        None => None,
    };
    ctx.metrics.set_slot_retained_wal(
        &relay.namespace().unwrap_or_default(),
        &relay.name_any(),
        slot.as_ref().map(|s| s.retained_wal_bytes),
    );
    database::scan_orphans(relay, ctx, &client, &conn.url).await;
    let partitions = match (&valid.mode, valid.per_aggregate) {
        (crate::spec::ValidMode::Polling(_), true) => {
            let class =
                crate::postgres::polling::lock_class(&valid.table.schema, &valid.table.name);
            crate::postgres::polling::owned_partitions(&client, class, valid.partitions)
                .await
                .ok()
                .map(|owned| (valid.partitions, owned))
        }
        _ => None,
    };
    let figures = Figures {
        backlog,
        dead_letters,
        partitions,
        slot,
    };
    let patch = status_patch(&figures);
    if patch == current_patch(relay.status.as_ref()) {
        return;
    }
    let api: Api<OutboxRelay> =
        Api::namespaced(ctx.client.clone(), &relay.namespace().unwrap_or_default());
    let body = json!({
        "apiVersion": OutboxRelay::api_version(&()),
        "kind": OutboxRelay::kind(&()),
        "status": patch,
    });
    ctx.metrics.wrote();
    if let Err(err) = api
        .patch_status(
            &relay.name_any(),
            &PatchParams::apply(FIGURES_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        debug!(relay = %relay.name_any(), error = %err, "writing status figures failed");
    }
}

/// The slot figures of a slot that is not there: the position it was last seen to
/// confirm, inactive and retaining nothing.
fn last_position(status: Option<&OutboxRelayStatus>) -> Option<SlotStats> {
    let lsn = status?.slot.as_ref()?.confirmed_flush_lsn.clone()?;
    Some(SlotStats {
        active: false,
        wal_status: String::new(),
        retained_wal_bytes: 0,
        confirmed_flush_lsn: Some(lsn),
    })
}

/// The status fields this task owns, from the figures. No waiting row: age 0. Rows
/// waiting without a created-at column: unknown (left out). Tenths of a second: finer
/// figures would only make writes. A figure it cannot tell is left out, so server-side
/// apply removes what it said before.
fn status_patch(figures: &Figures) -> Value {
    let mut status = Map::new();
    if let Some(b) = figures.backlog {
        status.insert("backlogRows".into(), json!(b.rows));
        let age = if b.rows == 0 {
            Some(0.0)
        } else {
            b.oldest_age_seconds.map(|a| (a * 10.0).round() / 10.0)
        };
        if let Some(age) = age {
            status.insert("oldestUnpublishedAgeSeconds".into(), json!(age));
            status.insert("oldestUnpublishedAge".into(), json!(human_age(age)));
        }
    }
    if let Some(rows) = figures.dead_letters {
        status.insert("deadLetterRows".into(), json!(rows));
    }
    if let Some((desired, owned)) = figures.partitions {
        status.insert(
            "partitions".into(),
            json!({"desired": desired, "owned": owned}),
        );
    }
    if let Some(s) = &figures.slot {
        let mut slot = Map::new();
        if let Some(lsn) = &s.confirmed_flush_lsn {
            slot.insert("confirmedFlushLsn".into(), json!(lsn));
        }
        slot.insert("retainedWalBytes".into(), json!(s.retained_wal_bytes));
        if !s.wal_status.is_empty() {
            slot.insert("walStatus".into(), json!(s.wal_status));
        }
        slot.insert("active".into(), json!(s.active));
        status.insert("slot".into(), Value::Object(slot));
    }
    Value::Object(status)
}

/// The same fields as status shows them now, for comparison.
fn current_patch(status: Option<&OutboxRelayStatus>) -> Value {
    let Some(status) = status else {
        return Value::Object(Map::new());
    };
    let mut out = Map::new();
    if let Some(rows) = status.backlog_rows {
        out.insert("backlogRows".into(), json!(rows));
    }
    if let Some(age) = status.oldest_unpublished_age_seconds {
        out.insert("oldestUnpublishedAgeSeconds".into(), json!(age));
    }
    if let Some(age) = &status.oldest_unpublished_age {
        out.insert("oldestUnpublishedAge".into(), json!(age));
    }
    if let Some(rows) = status.dead_letter_rows {
        out.insert("deadLetterRows".into(), json!(rows));
    }
    if let Some(p) = &status.partitions {
        out.insert(
            "partitions".into(),
            json!({"desired": p.desired, "owned": p.owned}),
        );
    }
    if let Some(s) = &status.slot {
        let mut slot = Map::new();
        if let Some(lsn) = &s.confirmed_flush_lsn {
            slot.insert("confirmedFlushLsn".into(), json!(lsn));
        }
        if let Some(bytes) = s.retained_wal_bytes {
            slot.insert("retainedWalBytes".into(), json!(bytes));
        }
        if let Some(w) = &s.wal_status {
            slot.insert("walStatus".into(), json!(w));
        }
        if let Some(a) = s.active {
            slot.insert("active".into(), json!(a));
        }
        if !slot.is_empty() {
            out.insert("slot".into(), Value::Object(slot));
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::SlotStatus;

    #[test]
    fn a_pass_starts_relays_within_the_recheck_budget() {
        let interval = Duration::from_secs(10);
        // 20 a second: 1,000 relays take 50 s, each sampled every 50 s.
        let pace = pace(20.0, 1000, interval);
        assert_eq!(pace, Duration::from_millis(50));
        assert_eq!(start_offset(0, pace), Duration::ZERO);
        assert_eq!(start_offset(999, pace), Duration::from_millis(49_950));
        // No budget, or nothing to sample: every relay at once (as many as CONCURRENCY
        // allows).
        assert_eq!(super::pace(0.0, 1000, interval), Duration::ZERO);
        assert_eq!(super::pace(20.0, 0, interval), Duration::ZERO);
        // However small the budget, a pass ends within an hour, as rechecks come.
        assert_eq!(
            super::pace(0.001, 1000, interval),
            Duration::from_millis(3600)
        );
        assert_eq!(
            super::pace(f64::MIN_POSITIVE, 1, interval),
            Duration::from_secs(3600)
        );
        // ... or within the status interval, when that is longer.
        assert_eq!(
            super::pace(0.001, 10, Duration::from_secs(7200)),
            Duration::from_secs(720)
        );
    }

    #[test]
    fn figures_round_trip_so_an_unchanged_sample_writes_nothing() {
        let figures = Figures {
            backlog: Some(Backlog {
                rows: 12,
                oldest_age_seconds: Some(4.04),
            }),
            dead_letters: Some(3),
            partitions: Some((4, 3)),
            slot: Some(SlotStats {
                active: true,
                confirmed_flush_lsn: Some("0/1A2B3C".into()),
                retained_wal_bytes: 8192,
                wal_status: "reserved".into(),
            }),
        };
        let patch = status_patch(&figures);
        let status = OutboxRelayStatus {
            backlog_rows: Some(12),
            oldest_unpublished_age_seconds: Some(4.0),
            oldest_unpublished_age: Some("4s".into()),
            dead_letter_rows: Some(3),
            partitions: Some(crate::api::PartitionsStatus {
                desired: 4,
                owned: 3,
            }),
            slot: Some(SlotStatus {
                name: "s".into(),
                publication: Some("s".into()),
                confirmed_flush_lsn: Some("0/1A2B3C".into()),
                retained_wal_bytes: Some(8192),
                wal_status: Some("reserved".into()),
                active: Some(true),
                protected_secrets: Vec::new(),
                handover_snapshot: None,
                existed: true,
                lost: None,
                coverage_baseline: None,
                location: None,
                left_behind: None,
            }),
            ..OutboxRelayStatus::default()
        };
        assert_eq!(patch, current_patch(Some(&status)));
        // The slot gone: its last confirmed position stays, inactive, retaining nothing.
        let kept = last_position(Some(&status)).unwrap();
        assert_eq!(kept.confirmed_flush_lsn.as_deref(), Some("0/1A2B3C"));
        assert!(!kept.active && kept.retained_wal_bytes == 0);
        assert!(last_position(Some(&OutboxRelayStatus::default())).is_none());
        let more = Figures {
            backlog: Some(Backlog {
                rows: 13,
                oldest_age_seconds: Some(4.04),
            }),
            ..figures.clone()
        };
        assert_ne!(status_patch(&more), current_patch(Some(&status)));
        let redriven = Figures {
            dead_letters: Some(0),
            ..figures
        };
        assert_eq!(status_patch(&redriven)["deadLetterRows"], 0);
        assert_ne!(status_patch(&redriven), current_patch(Some(&status)));
    }

    #[test]
    fn an_empty_backlog_is_age_zero_and_no_created_at_is_no_age() {
        let empty = status_patch(&Figures {
            backlog: Some(Backlog {
                rows: 0,
                oldest_age_seconds: None,
            }),
            dead_letters: None,
            partitions: None,
            slot: None,
        });
        assert_eq!(empty["oldestUnpublishedAge"], "0s");
        let unknown = status_patch(&Figures {
            backlog: Some(Backlog {
                rows: 5,
                oldest_age_seconds: None,
            }),
            dead_letters: None,
            partitions: None,
            slot: None,
        });
        assert!(unknown.get("oldestUnpublishedAge").is_none());
    }
}
