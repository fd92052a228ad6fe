//! Every effect of a reconcile beyond its conditions, decided here so `apply` only
//! carries them out: the Secrets to protect or release, the Events with their wording
//! and the step each waits for, the back-fill and hand-over choices, the metrics to
//! move and the status to write. An effect whose outcome matters (the SQL, the
//! hand-over snapshot) comes back as an input: [`provisioned`] and [`snapshot_taken`]
//! turn the plan into what holds after it.

use super::{Decision, FallbackWrite, Next, Note};
use crate::api::{FallbackStatus, SlotStatus};
use crate::controller::observe::Observed;
use crate::controller::status::{CONDITION_READY, Cond, find};
use crate::postgres::provision::Action;
use crate::spec::{Problems, ValidRelay};

/// The Secrets a relay's finalizer guards, decided before anything is observed: while
/// a relay tails the log (or status shows a slot), the Secrets that reach its database
/// carry the relay's finalizer, so the deletion can always connect to drop the slot.
/// They are protected before observing, because the finalizer changes the Secrets'
/// `resourceVersion`, which the pod template records (a rotated Secret rolls the pods),
/// and it must not read as a rotation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(in crate::controller) struct Guard {
    /// The Secrets to guard (none when no slot is wanted).
    pub protected: Vec<String>,
    /// The ones status recorded as guarded.
    pub recorded: Vec<String>,
    /// Protect these now, before observing (the guarded set changed).
    pub protect_now: Vec<String>,
}

/// [`Guard`] for a relay whose spec parsed as `parsed`, whose status showed
/// `last_slot`, and whose spec names `database_secrets`.
pub(in crate::controller) fn guard(
    parsed: Result<&ValidRelay, &Problems>,
    last_slot: Option<&SlotStatus>,
    database_secrets: Vec<String>,
) -> Guard {
    let wants_slot = last_slot.is_some() || parsed.is_ok_and(|v| v.mode.log_tailing().is_some());
    let protected = if wants_slot {
        database_secrets
    } else {
        Vec::new()
    };
    let recorded = last_slot
        .map(|s| s.protected_secrets.clone())
        .unwrap_or_default();
    let protect_now = if wants_slot && recorded != protected {
        protected.clone()
    } else {
        Vec::new()
    };
    Guard {
        protected,
        recorded,
        protect_now,
    }
}

/// Which children a pass applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::controller) enum Children {
    /// None: a check failed, or the hand-over waits.
    Keep,
    /// The relay's, as its spec builds them.
    Relay,
    /// The back-fill relay's ([`ValidRelay::backfill`]): a polling relay that publishes
    /// what a new slot cannot stream, before log tailing takes over.
    Backfill,
}

/// A pass's effects, in the order `apply` carries them out.
#[derive(Clone, Debug, PartialEq)]
pub(in crate::controller) struct Effects {
    /// Secrets that lost the relay's finalizer (removed by hand): given it back.
    pub restore: Vec<String>,
    /// The SQL to run first (log tailing's publication and slot).
    pub provision: Vec<Action>,
    /// Events once the SQL ran.
    pub provisioned: Vec<Note>,
    /// The SQL drops the slot past the WAL budget: once it ran, the fall back's status
    /// says so.
    pub marks_slot_dropped: bool,
    /// Take the hand-over snapshot once the SQL ran; the Event to record with it.
    pub snapshot: Option<Option<Note>>,
    /// A switch between log tailing and the fall back to polling: the mode counted.
    pub switched: Option<&'static str>,
    /// Which children to apply, and whether their rollout stops every old pod first.
    pub children: Children,
    /// See [`Decision::exclusive_rollout`].
    pub exclusive_rollout: bool,
    /// Events before the children are applied.
    pub notes: Vec<Note>,
    /// Events once the children were applied.
    pub applied: Vec<Note>,
    /// Whether the slot is lost (the metric).
    pub slot_lost: bool,
    /// The conditions status shows.
    pub conditions: Vec<Cond>,
    /// The slot status.
    pub slot: Option<SlotStatus>,
    /// The fall back as status shows it after the pass.
    pub fallback: Option<FallbackStatus>,
    /// Secrets no longer guarded, released once status is written.
    pub release: Vec<String>,
    /// When to look again.
    pub next: Next,
    /// The `/scale` subresource's view: relay pods now, and their selector.
    pub scale: Option<(i32, String)>,
}

/// What a pass saw besides the decision: the relay's Secrets guard, the fall back as
/// last recorded, and whether its children are the polling relay's.
pub(in crate::controller) struct Seen<'a> {
    pub parsed: Result<&'a ValidRelay, &'a Problems>,
    pub last_slot: Option<&'a SlotStatus>,
    pub recorded_fallback: Option<&'a FallbackStatus>,
    pub observed: Option<&'a Observed>,
    pub guard: &'a Guard,
}

/// The plan of a pass whose decision is `decision`.
pub(in crate::controller) fn plan(decision: Decision, seen: &Seen<'_>) -> Effects {
    let Decision {
        conditions,
        provision,
        apply_children,
        mut slot,
        take_snapshot,
        backfill,
        fallback,
        exclusive_rollout,
        events,
        next,
    } = decision;
    let runs_polling = seen.observed.is_some_and(|o| o.children.runs_polling);
    let tails = seen.parsed.is_ok_and(|v| v.mode.log_tailing().is_some());
    let budget = seen
        .parsed
        .is_ok_and(|v| v.mode.log_tailing().is_some_and(|l| l.budget.is_some()));
    let mut provisioned = Vec::new();
    let marks_slot_dropped = matches!(fallback, FallbackWrite::Set(_))
        && provision
            .iter()
            .any(|a| matches!(a, Action::DropSlotOverBudget { .. }));
    if let FallbackWrite::Set(f) = &fallback
        && marks_slot_dropped
    {
        let name = slot.as_ref().map(|s| s.name.clone()).unwrap_or_default();
        provisioned.push(Note::normal(
            "SlotDroppedOverBudget",
            format!(
                "no pod tails the log any more: dropped replication slot {name}, which retained {} bytes of WAL, past spec.mode.logTailing.maxRetainedWal; the relay polls until it returns to log tailing",
                f.retained_wal_bytes
            ),
        ));
    }
    for action in &provision {
        if let Action::DropOwned {
            slot, publication, ..
        } = action
        {
            provisioned.push(Note::normal(
                "SlotDropped",
                format!(
                    "the relay polls now and no pod tails the log: dropped replication slot {slot} and publication {publication} (those the operator created)"
                ),
            ));
        }
    }
    let snapshot = take_snapshot.then(|| {
        slot.as_ref().filter(|_| runs_polling).map(|s| {
            Note::normal(
                "SwitchingToLogTailing",
                format!(
                    "replication slot {} exists; the polling relay keeps running until every row committed before it is published, then log tailing takes over",
                    s.name
                ),
            )
        })
    });
    // The fall back to polling past the WAL budget, and the return: an Event each and
    // the switch counted.
    let was_falling_back = seen.recorded_fallback.is_some();
    let mut notes = Vec::new();
    let switched = match &fallback {
        FallbackWrite::Set(f) if !was_falling_back => {
            notes.push(Note::warning(
                "FellBackToPolling",
                format!(
                    "the replication slot retained {} bytes of WAL, past spec.mode.logTailing.maxRetainedWal: a polling relay replaces the log-tailing one, and the slot is dropped once no pod tails the log",
                    f.retained_wal_bytes
                ),
            ));
            Some("polling")
        }
        FallbackWrite::Clear if was_falling_back && tails => {
            let why = if budget {
                "the backlog is drained"
            } else {
                "spec.mode.logTailing.maxRetainedWal was removed"
            };
            notes.push(Note::normal(
                "ReturningToLogTailing",
                format!("{why}: the replication slot is created again while the polling relay runs, and log tailing takes over once every row committed before it is published"),
            ));
            Some("logTailing")
        }
        _ => None,
    };
    let falling_back = matches!(fallback, FallbackWrite::Set(_));
    let fills =
        backfill && seen.observed.is_some() && seen.parsed.is_ok_and(|v| v.backfill().is_some());
    if fills && !falling_back {
        notes.push(Note::normal(
            "BackfillingBeforeLogTailing",
            "rows committed before the replication slot was created are in the table: a polling relay publishes them first, then log tailing takes over".to_owned(),
        ));
    }
    notes.extend(events);
    let children = match (apply_children, fills) {
        (false, _) => Children::Keep,
        (true, true) => Children::Backfill,
        (true, false) => Children::Relay,
    };
    let mut applied = Vec::new();
    if apply_children
        && seen.observed.is_some()
        && runs_polling
        && seen
            .last_slot
            .is_some_and(|s| s.handover_snapshot.is_some())
    {
        applied.push(Note::normal(
            "LogTailingStarted",
            "every row committed before the slot was created is published: the log-tailing relay replaces the polling relay".to_owned(),
        ));
    }
    let guard = seen.guard;
    // Secrets that lost the finalizer (removed by hand) get it back; Secrets guarded
    // before but no longer needed (a switch to polling, a Secret no longer named) are
    // released.
    let finalized: Vec<String> = seen
        .observed
        .map(|o| o.secrets.finalized.clone())
        .unwrap_or_default();
    let restore = if seen.observed.is_some() {
        guard
            .protected
            .iter()
            .filter(|n| !finalized.contains(n))
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    let mut release: Vec<String> = guard
        .recorded
        .iter()
        .chain(finalized.iter())
        .filter(|n| !guard.protected.contains(n))
        .cloned()
        .collect();
    release.sort();
    release.dedup();
    if let Some(slot) = slot.as_mut() {
        slot.protected_secrets = guard.protected.clone();
    }
    let slot_lost = slot.as_ref().is_some_and(|s| s.lost.is_some());
    let fallback = match fallback {
        FallbackWrite::Keep => seen.recorded_fallback.cloned(),
        FallbackWrite::Set(f) => Some(f),
        FallbackWrite::Clear => None,
    };
    Effects {
        restore,
        provision,
        provisioned,
        marks_slot_dropped,
        snapshot,
        switched,
        children,
        exclusive_rollout,
        notes,
        applied,
        slot_lost,
        conditions,
        slot,
        fallback,
        release,
        next,
        scale: seen.parsed.ok().map(|valid| {
            let running = seen
                .observed
                .and_then(|o| o.children.deployment.as_ref())
                .and_then(|d| d.status.as_ref())
                .and_then(|s| s.replicas)
                .unwrap_or(0);
            (running, crate::resources::pod_selector(valid))
        }),
    }
}

/// The plan once its SQL ran without fault: a slot dropped past the WAL budget is
/// marked so in the fall back's status. (When the SQL failed, the pass plans again
/// from [`super::provisioning_failed`]'s decision.)
pub(in crate::controller) fn provisioned(mut plan: Effects) -> Effects {
    if plan.marks_slot_dropped
        && let Some(f) = plan.fallback.as_mut()
    {
        f.slot_dropped = true;
    }
    plan
}

/// The plan once the hand-over snapshot was read: recorded in the slot status, or,
/// when it failed, not recorded (the next pass takes it again) and its Event left out.
pub(in crate::controller) fn snapshot_taken(
    mut plan: Effects,
    snapshot: Option<String>,
) -> Effects {
    match snapshot {
        Some(snapshot) => {
            if let Some(slot) = plan.slot.as_mut() {
                slot.handover_snapshot = Some(snapshot);
            }
        }
        None => plan.snapshot = None,
    }
    plan
}

/// An Event for a change of the `Ready` condition's status or reason. Not for a new
/// relay whose pods are starting (no `Ready` before, now `RelayUnavailable`): that is
/// where every relay begins, and an Event for each is a write apiece when many are
/// created at once.
pub(in crate::controller) fn ready_transition(
    current: Option<&crate::api::OutboxRelayStatus>,
    conditions: &[Cond],
) -> Option<Note> {
    let new = conditions.iter().find(|c| c.type_ == CONDITION_READY)?;
    let status = if new.status { "True" } else { "False" };
    let old = find(current, CONDITION_READY);
    let unchanged = old.is_some_and(|old| old.status == status && old.reason == new.reason);
    if unchanged || (old.is_none() && new.reason == "RelayUnavailable") {
        return None;
    }
    let message = new.message.clone();
    Some(
        if new.status
            || matches!(
                new.reason,
                "RelayUnavailable" | "ScaledToZero" | "Suspended"
            )
        {
            Note::normal(new.reason, message)
        } else {
            Note::warning(new.reason, message)
        },
    )
}

#[cfg(test)]
#[path = "effects/tests.rs"]
mod tests;
