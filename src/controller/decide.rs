//! The decide step of a reconcile: pure functions from the parsed spec and what was
//! observed to everything the pass does. `decide` gives the conditions, the SQL to run,
//! whether to apply the children, the slot status and when to look again; `effects`
//! turns that into every effect in the order `apply` carries it out (Secrets, Events
//! with their wording, the back-fill and hand-over, metrics, status), and takes back
//! what the SQL and the hand-over snapshot returned; `deletion` decides the finalizer
//! step by step. No client, no clock: tested as tables.

use super::database::DatabaseSeen;
use super::observe::{Claim, Observed};
use super::status::{
    CONDITION_DATABASE_READY, CONDITION_DEGRADED, CONDITION_FAILOVER_READY,
    CONDITION_MONITORING_READY, CONDITION_POLLING_FALLBACK, CONDITION_READY, CONDITION_SLOT_READY,
    Cond,
};
use crate::api::{FallbackStatus, SlotStatus};
use crate::postgres::admin::{self, Origin, Owner, Plan, Scope};
use crate::postgres::provision::{self, Action};
use crate::resources::MONITORING_API_VERSION;
use crate::spec::{Problem, Problems, ValidRelay, WalBudget};

use available::{availability, monitoring_cond};
pub(super) use effects::{
    Children, Effects, Seen, guard, plan, provisioned, ready_transition, snapshot_taken,
};
use fallback::{bytes_for_people, coverage_baseline, fall_back, return_due};
use handover::{backfill_first, handover_pending};

/// A relay that fell back to polling returns to log tailing only once no row older than
/// this waits (and none committed before the fall back).
pub(super) const DRAINED_AGE_SECONDS: u64 = 10;

/// When to reconcile again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// Only when the resource or a child changes (the spec must change).
    AwaitChange,
    /// Soon: Secrets are not watched.
    SecretRetry,
    /// After the status interval: the database is checked again.
    Refresh,
    /// In a moment: a handover from polling to log tailing is waiting on the database.
    Soon,
}

/// What becomes of `status.fallback`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum FallbackWrite {
    /// As it was (the decision did not get as far as looking at it).
    Keep,
    /// Recorded: the relay polls because its slot passed the WAL budget.
    Set(FallbackStatus),
    /// Removed: the relay tails the log (or returns to it), or polls by its spec.
    Clear,
}

/// What one reconcile should make true.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Decision {
    /// The conditions status shows.
    pub conditions: Vec<Cond>,
    /// SQL to run before any child is applied (log tailing's publication and slot).
    pub provision: Vec<Action>,
    /// Apply the children (all checks passed).
    pub apply_children: bool,
    /// The slot and publication status names (`None`: none).
    pub slot: Option<SlotStatus>,
    /// Take the handover snapshot once the provisioning ran (a switch from polling to
    /// log tailing has just created the slot) and record it in the slot status.
    pub take_snapshot: bool,
    /// The children to apply are the back-fill relay's ([`ValidRelay::backfill`]): a
    /// new slot streams only later commits, and rows committed before it are published
    /// by polling first.
    pub backfill: bool,
    /// The fall back to polling in status: what to record.
    pub fallback: FallbackWrite,
    /// The children's rollout must stop every old pod before a new one starts: the pods
    /// it replaces tail the log, and a polling relay started beside them would publish
    /// the same aggregates side by side (a log-tailing Deployment always rolls out so).
    pub exclusive_rollout: bool,
    /// Events to record, beyond the one for a change of `Ready`.
    pub events: Vec<Note>,
    /// When to look again.
    pub next: Next,
}

/// An Event a decision records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Note {
    /// `Warning` rather than `Normal`.
    pub warning: bool,
    /// The Event's reason.
    pub reason: &'static str,
    /// Its message.
    pub message: String,
}

impl Note {
    pub(super) fn normal(reason: &'static str, message: String) -> Self {
        Self {
            warning: false,
            reason,
            message,
        }
    }

    pub(super) fn warning(reason: &'static str, message: String) -> Self {
        Self {
            warning: true,
            reason,
            message,
        }
    }
}

/// Whether whatever replaces the relay's pods must wait until they are gone
/// ([`Decision::exclusive_rollout`]): they tail the log, or a rollout is still under way
/// (the Deployment may already say polling while log-tailing pods of the rollout that
/// began with `Recreate` still run: switched back to `RollingUpdate` mid-way, the
/// controller would start polling pods beside them).
pub(super) fn exclusive_rollout(observed: &Observed) -> bool {
    let children = &observed.children;
    children.deployment.is_some() && (!children.runs_polling || !children.settled)
}

/// Decides for a relay: `parsed` is the spec's parse, `owner` who the database objects
/// are marked for, `last_slot` the slot status showed so far, `observed` what the
/// observe step read (`None` when the spec did not parse and nothing was read).
pub(super) fn decide(
    parsed: Result<&ValidRelay, &Problems>,
    owner: &Owner,
    last_slot: Option<&SlotStatus>,
    observed: Option<&Observed>,
) -> Decision {
    let mut decision = decide_pass(parsed, owner, last_slot, observed);
    if let Ok(valid) = parsed {
        wal::settle(&mut decision, valid, last_slot);
    }
    if let (Ok(valid), Some(observed)) = (parsed, observed)
        && let Some(lt) = valid.mode.log_tailing()
    {
        moved::settle(
            &mut decision,
            (&valid.namespace, &valid.name, &lt.slot),
            last_slot,
            observed,
        );
    }
    decision
}

/// [`decide`] before where the slot lives and what was left behind are settled.
fn decide_pass(
    parsed: Result<&ValidRelay, &Problems>,
    owner: &Owner,
    last_slot: Option<&SlotStatus>,
    observed: Option<&Observed>,
) -> Decision {
    let valid = match (parsed, observed) {
        (Ok(valid), Some(observed)) => (valid, observed),
        (Err(problems), _) => return invalid(&problems.0, last_slot.cloned(), Next::AwaitChange),
        (Ok(_), None) => {
            return not_ready(
                "NotObserved",
                "the relay has not been looked at yet".to_owned(),
                Vec::new(),
                last_slot.cloned(),
                Next::Refresh,
            );
        }
    };
    let (valid, observed) = valid;
    let tailing = valid.mode.log_tailing().is_some();
    // While the database cannot be looked at, status keeps the slot as last seen: the
    // finalizer reads it, and a slot does not vanish because its Secret did. After a
    // switch to polling it stays too, so deleting the relay still drops it.
    let kept_slot = last_slot.cloned();
    if let Some(decision) = referenced::unusable(valid, observed, kept_slot.as_ref()) {
        return decision;
    }
    let secrets = &observed.secrets;
    if !secrets.problems.is_empty() {
        return invalid(&secrets.problems, kept_slot, Next::SecretRetry);
    }
    if !(secrets.database.status && secrets.broker.status) {
        // Pods started now would crash-loop on the missing variable or volume: create
        // nothing, delete nothing (a Secret being rotated must not stop a running
        // relay), and look again soon.
        let problem = if secrets.database.status {
            &secrets.broker
        } else {
            &secrets.database
        };
        return Decision {
            conditions: vec![
                Cond::no(CONDITION_READY, problem.reason, problem.message.clone()),
                Cond::yes(CONDITION_DEGRADED, problem.reason, problem.message.clone()),
                secrets.database.clone(),
                secrets.broker.clone(),
            ],
            provision: Vec::new(),
            apply_children: false,
            slot: kept_slot,
            take_snapshot: false,
            backfill: false,
            fallback: FallbackWrite::Keep,
            exclusive_rollout: false,
            events: Vec::new(),
            next: Next::SecretRetry,
        };
    }
    let facts = match &observed.database {
        DatabaseSeen::Seen(facts) => facts,
        DatabaseSeen::Unusable { reason, message } => {
            let mut conds = vec![
                Cond::no(CONDITION_DATABASE_READY, reason, message.clone()),
                secrets.broker.clone(),
            ];
            if tailing {
                conds.push(Cond::no(
                    CONDITION_SLOT_READY,
                    "DatabaseNotReady",
                    format!("not checked: {message}"),
                ));
            }
            return not_ready(reason, message.clone(), conds, kept_slot, Next::Refresh);
        }
        DatabaseSeen::NotLooked => {
            return not_ready(
                "NotChecked",
                "the database was not looked at".to_owned(),
                vec![secrets.broker.clone()],
                kept_slot,
                Next::Refresh,
            );
        }
    };

    // The database checks, then (log tailing) the slot checks: nothing is created and
    // no child applied until both pass. A Deployment that already runs is left alone.
    let plan = Plan::for_relay(valid);
    let checks = admin::evaluate(&plan, facts);
    let database = admin::first_failure(&checks, Scope::Database).map_or_else(
        || {
            let summary = checks
                .iter()
                .filter(|c| c.scope == Scope::Database)
                .map(|c| c.message.as_str())
                .collect::<Vec<_>>()
                .join("; ");
            Cond::yes(CONDITION_DATABASE_READY, "ChecksPassed", summary)
        },
        |c| super::database::cond_of(CONDITION_DATABASE_READY, c),
    );
    if !database.status {
        let mut conds = vec![database.clone(), secrets.broker.clone()];
        if tailing {
            conds.push(Cond::no(
                CONDITION_SLOT_READY,
                "DatabaseNotReady",
                "the slot and publication are created once DatabaseReady is True",
            ));
        }
        return not_ready(
            database.reason,
            database.message,
            conds,
            kept_slot,
            Next::Refresh,
        );
    }
    let mut slot_cond = None;
    let mut failover = None;
    // Log tailing with a budget on a publication of someone else's (no marker).
    let mut foreign_publication = false;
    let slot;
    let mut actions = Vec::new();
    // Events of the slot's own (a lost slot created again).
    let mut events = Vec::new();
    if let Some(lt) = &plan.log_tailing {
        if let Some(failed) = admin::first_failure(&checks, Scope::Slot) {
            let cond = super::database::cond_of(CONDITION_SLOT_READY, failed);
            let conds = vec![database.clone(), secrets.broker.clone(), cond.clone()];
            return not_ready(cond.reason, cond.message, conds, kept_slot, Next::Refresh);
        }
        if let Claim::Held(holder) = &observed.claim {
            let cond = Cond::no(
                CONDITION_SLOT_READY,
                "SlotClaimed",
                format!(
                    "replication slot {} and publication {} belong to {holder}: two relays cannot stream one slot; give this relay another spec.mode.logTailing.slotName, or delete the other relay and this one takes the slot over with its position",
                    lt.slot, lt.publication
                ),
            );
            let conds = vec![database.clone(), secrets.broker.clone(), cond.clone()];
            return not_ready(cond.reason, cond.message, conds, kept_slot, Next::Refresh);
        }
        let successor = observed.claim == Claim::Released;
        let conds = [&database, &secrets.broker];
        match lost::slot_lost(
            valid,
            lt,
            &provision::plan(&plan, owner, facts, successor).actions,
            last_slot,
            facts,
            observed,
            conds,
        ) {
            lost::LostSlot::NotLost => {}
            lost::LostSlot::Hold(decision) => return *decision,
            lost::LostSlot::Replace(note) => events.push(note),
        }
        let budget = valid
            .mode
            .log_tailing()
            .and_then(|l| l.budget)
            .filter(|_| valid.backfill().is_some());
        if let Some(budget) = budget {
            let planned = provision::plan(&plan, owner, facts, successor);
            // A publication that carries someone else's comment never gets the
            // operator's marker, and without it the slot is not the operator's to drop:
            // the budget cannot apply (said in PollingFallback below).
            foreign_publication = planned.outcome.publication.is_none();
            let retained = facts.slot.as_ref().and_then(|s| s.retained_wal_bytes);
            let fallback = match &observed.fallback {
                // The slot was dropped and exists again: the return began (its status
                // write did not land); the path below carries on with the handover.
                Some(fb) if fb.slot_dropped && facts.slot.is_some() => None,
                // Falling back: polling until the return is due; then the path below
                // creates the slot and hands over as for a switch from polling.
                Some(fb) if !return_due(fb, &budget, facts, observed) => Some(fb.clone()),
                Some(_) => None,
                None if foreign_publication => None,
                None => retained
                    .filter(|r| u64::try_from(*r).unwrap_or(0) > budget.max_retained_wal)
                    .map(|r| FallbackStatus {
                        since: observed.now.to_string(),
                        retained_wal_bytes: r,
                        slot_dropped: false,
                    }),
            };
            if let Some(fb) = fallback {
                // The marker first (a relay over budget on its first pass has not
                // written it yet), never the slot.
                let marking: Vec<Action> = planned
                    .actions
                    .into_iter()
                    .filter(|a| !matches!(a, Action::CreateSlot { .. }))
                    .collect();
                return fall_back(
                    valid,
                    lt,
                    owner,
                    facts,
                    observed,
                    fb,
                    &budget,
                    marking,
                    last_slot,
                    [&database, &secrets.broker],
                );
            }
        }
        let planned = provision::plan(&plan, owner, facts, successor);
        let describe = |o: Option<Origin>| match o {
            Some(Origin::Created) => "created by the operator, dropped with the OutboxRelay",
            Some(Origin::Adopted) => "existed before, kept when the OutboxRelay is deleted",
            None => "carries another comment, kept when the OutboxRelay is deleted",
        };
        slot_cond = Some(Cond::yes(
            CONDITION_SLOT_READY,
            "SlotReady",
            format!(
                "replication slot {} ({}) and publication {} ({}) exist",
                lt.slot,
                describe(planned.outcome.slot),
                lt.publication,
                describe(planned.outcome.publication),
            ),
        ));
        let standby_slots = valid
            .mode
            .log_tailing()
            .map_or(&[][..], |l| l.standby_slots.as_slice());
        failover = Some(failover::failover_cond(
            lt,
            standby_slots,
            facts,
            cluster_facts(valid, observed),
        ));
        slot = Some(SlotStatus {
            name: lt.slot.clone(),
            publication: Some(lt.publication.clone()),
            existed: facts.slot.is_some(),
            coverage_baseline: coverage_baseline(&lt.slot, last_slot, facts),
            ..SlotStatus::default()
        });
        actions = planned.actions;
        if observed.children.runs_polling
            && let Some(waiting) = handover_pending(lt, last_slot, facts)
        {
            // Polling pods still run: they keep publishing until nothing the slot
            // cannot stream is left, and only then does the log-tailing relay replace
            // them.
            let snapshot = last_slot.and_then(|s| s.handover_snapshot.clone());
            let take_snapshot = snapshot.is_none();
            let mut conditions = vec![
                Cond::no(CONDITION_READY, "SwitchingToLogTailing", waiting.clone()),
                Cond::no(CONDITION_DEGRADED, "SwitchingToLogTailing", waiting),
                database,
                secrets.broker.clone(),
            ];
            conditions.extend(slot_cond);
            conditions.extend(failover);
            return Decision {
                conditions,
                provision: actions,
                apply_children: false,
                slot: slot.map(|s| SlotStatus {
                    handover_snapshot: snapshot,
                    ..s
                }),
                take_snapshot,
                backfill: false,
                fallback: FallbackWrite::Clear,
                exclusive_rollout: false,
                events,
                next: Next::Soon,
            };
        }
        if let Some(mut decision) = backfill_first(
            lt,
            valid,
            &actions,
            last_slot,
            facts,
            observed,
            [&database, &secrets.broker],
            slot_cond.as_ref(),
        ) {
            decision.events = events;
            return decision;
        }
    } else if let Some(kept) = kept_slot.as_ref().filter(|_| observed.children.rolled_out) {
        // Switched to polling, and no pod tails the log any more: the slot would only
        // retain WAL. Rows it had not streamed are in the table, where polling finds
        // them.
        actions = vec![Action::DropOwned {
            publication: kept
                .publication
                .clone()
                .unwrap_or_else(|| kept.name.clone()),
            slot: kept.name.clone(),
            owner: owner.clone(),
        }];
        slot = None;
    } else {
        slot = kept_slot;
    }

    let ready = availability(valid, observed);
    let monitoring = monitoring_cond(valid, observed);
    let mut conditions = vec![
        ready,
        Cond::no(
            CONDITION_DEGRADED,
            "AsExpected",
            "the relay runs as specified",
        ),
        database,
        secrets.broker.clone(),
        monitoring,
    ];
    conditions.extend(slot_cond);
    conditions.extend(failover);
    if let Some(budget) = valid.mode.log_tailing().and_then(|l| l.budget)
        && foreign_publication
    {
        conditions.push(Cond::no(
            CONDITION_POLLING_FALLBACK,
            "BudgetNotApplicable",
            format!(
                "the publication carries a comment that is not the operator's, so the slot is not the operator's to drop: spec.mode.logTailing.maxRetainedWal ({}) does not apply (give the relay a publicationName of its own)",
                bytes_for_people(budget.max_retained_wal)
            ),
        ));
    } else if let Some(budget) = valid.mode.log_tailing().and_then(|l| l.budget) {
        conditions.push(Cond::no(
            CONDITION_POLLING_FALLBACK,
            "WithinBudget",
            format!(
                "the relay tails the log; if its slot retains more than {} of WAL (spec.mode.logTailing.maxRetainedWal), it polls the table instead and the slot is dropped",
                bytes_for_people(budget.max_retained_wal)
            ),
        ));
    }
    Decision {
        conditions,
        provision: actions,
        apply_children: true,
        slot,
        take_snapshot: false,
        backfill: false,
        fallback: FallbackWrite::Clear,
        exclusive_rollout: exclusive_rollout(observed),
        events,
        next: Next::Refresh,
    }
}

/// The CloudNativePG cluster behind the relay, when `databaseRef` names one that was
/// found.
fn cluster_facts<'a>(
    valid: &'a ValidRelay,
    observed: &'a Observed,
) -> Option<(&'a crate::api::DatabaseRef, &'a crate::cnpg::ClusterFacts)> {
    match (valid.database_ref(), observed.cluster.as_ref()) {
        (Some(r), Some(crate::cnpg::ClusterSeen::Found { facts, .. })) => Some((r, facts)),
        _ => None,
    }
}

/// The decision after the planned SQL failed: nothing else is applied, and status says
/// why; the slot is shown as before.
pub(super) fn provisioning_failed(
    decision: Decision,
    last_slot: Option<&SlotStatus>,
    error: &str,
) -> Decision {
    let message =
        format!("creating or dropping the replication slot or publication failed: {error}");
    let fallback = decision.fallback.clone();
    let mut conditions: Vec<Cond> = decision
        .conditions
        .into_iter()
        .filter(|c| ![CONDITION_READY, CONDITION_DEGRADED, CONDITION_SLOT_READY].contains(&c.type_))
        .collect();
    conditions.insert(
        0,
        Cond::no(CONDITION_READY, "SlotCreationFailed", message.clone()),
    );
    conditions.insert(
        1,
        Cond::yes(CONDITION_DEGRADED, "SlotCreationFailed", message.clone()),
    );
    conditions.push(Cond::no(
        CONDITION_SLOT_READY,
        "SlotCreationFailed",
        message,
    ));
    Decision {
        conditions,
        provision: Vec::new(),
        apply_children: false,
        slot: last_slot.cloned(),
        take_snapshot: false,
        backfill: false,
        fallback,
        exclusive_rollout: false,
        events: Vec::new(),
        next: Next::Refresh,
    }
}

/// `Ready=False, reason=InvalidSpec` listing every problem; nothing is changed.
fn invalid(problems: &[Problem], slot: Option<SlotStatus>, next: Next) -> Decision {
    let list = problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    let message = format!(
        "{} problem{} in the spec; nothing was created or changed: {list}",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    Decision {
        conditions: vec![
            Cond::no(CONDITION_READY, "InvalidSpec", message.clone()),
            Cond::yes(CONDITION_DEGRADED, "InvalidSpec", message),
        ],
        provision: Vec::new(),
        apply_children: false,
        slot,
        take_snapshot: false,
        backfill: false,
        fallback: FallbackWrite::Keep,
        exclusive_rollout: false,
        events: Vec::new(),
        next,
    }
}

/// Ready=False and Degraded=True for `reason`, plus `conds`; nothing is changed.
fn not_ready(
    reason: &'static str,
    message: String,
    conds: Vec<Cond>,
    slot: Option<SlotStatus>,
    next: Next,
) -> Decision {
    let mut conditions = vec![
        Cond::no(CONDITION_READY, reason, message.clone()),
        Cond::yes(CONDITION_DEGRADED, reason, message),
    ];
    conditions.extend(conds);
    Decision {
        conditions,
        provision: Vec::new(),
        apply_children: false,
        slot,
        take_snapshot: false,
        backfill: false,
        fallback: FallbackWrite::Keep,
        exclusive_rollout: false,
        events: Vec::new(),
        next,
    }
}

pub mod audit;
mod available;
pub(super) mod deletion;
mod effects;
mod failover;
mod fallback;
mod handover;
mod lost;
mod moved;
mod referenced;
pub mod replay;
#[cfg(test)]
mod tests;
mod wal;
