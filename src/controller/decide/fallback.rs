//! The fall back to polling past the WAL budget, and the return to log tailing.

use super::*;

/// A log-tailing relay whose slot passed its WAL budget, while it polls: the back-fill
/// relay (polling the same table, which with `deleteAfterPublish` holds exactly the rows
/// not yet published) replaces the log-tailing one, and once no pod tails the log any
/// more the slot is dropped, so it retains nothing. The publication and its marker stay
/// (the slot name stays claimed, and the finalizer still finds what to drop).
#[allow(clippy::too_many_arguments)]
pub(super) fn fall_back(
    valid: &ValidRelay,
    lt: &admin::SlotPlan,
    owner: &Owner,
    facts: &admin::Facts,
    observed: &Observed,
    mut fallback: FallbackStatus,
    budget: &WalBudget,
    mut provision: Vec<Action>,
    last_slot: Option<&SlotStatus>,
    conds: [&Cond; 2],
) -> Decision {
    let children = &observed.children;
    // Only once every pod polls and no walsender streams the slot any more: a
    // log-tailing pod still terminating (its grace period, a broker it waits on) must
    // not be cut mid-stream and retry against a slot that is gone.
    let streamed = facts.slot.as_ref().is_some_and(|s| s.active);
    let polling_only = children.runs_polling && children.settled && !streamed;
    let slot_exists = facts.slot.is_some();
    fallback.slot_dropped = !slot_exists;
    if slot_exists && polling_only {
        provision.push(Action::DropSlotOverBudget {
            slot: lt.slot.clone(),
            publication: lt.publication.clone(),
            owner: owner.clone(),
        });
    }
    let retained = bytes_for_people(u64::try_from(fallback.retained_wal_bytes).unwrap_or(0));
    let max = bytes_for_people(budget.max_retained_wal);
    let (slot_reason, slot_message) = match (slot_exists, polling_only) {
        (false, _) => (
            "DroppedOverBudget",
            format!(
                "replication slot {} was dropped after it retained {retained} of WAL (budget {max}); it is created again when the relay returns to log tailing",
                lt.slot
            ),
        ),
        (true, true) => (
            "DroppingOverBudget",
            format!(
                "replication slot {} retained {retained} of WAL (budget {max}); no pod tails the log any more, so it is dropped now",
                lt.slot
            ),
        ),
        (true, false) => (
            "DroppingOverBudget",
            format!(
                "replication slot {} retained {retained} of WAL (budget {max}); it is dropped once the polling relay has replaced the log-tailing one and no pod streams the slot any more",
                lt.slot
            ),
        ),
    };
    let return_after = humantime::format_duration(budget.return_after);
    let message = format!(
        "replication slot {} retained {retained} of WAL at {}, above spec.mode.logTailing.maxRetainedWal ({max}): the relay polls the table instead, with per-aggregate order, and returns to log tailing once the rows committed before the fall back are published, none older than {DRAINED_AGE_SECONDS}s waits, and at least {return_after} have passed",
        lt.slot, fallback.since
    );
    let conditions = vec![
        availability(valid, observed),
        Cond::yes(CONDITION_DEGRADED, "FellBackToPolling", message.clone()),
        conds[0].clone(),
        conds[1].clone(),
        monitoring_cond(valid, observed),
        Cond::no(CONDITION_SLOT_READY, slot_reason, slot_message),
        Cond::yes(CONDITION_POLLING_FALLBACK, "WalBudgetExceeded", message),
    ];
    let slot = last_slot.cloned().unwrap_or_else(|| SlotStatus {
        name: lt.slot.clone(),
        publication: Some(lt.publication.clone()),
        ..SlotStatus::default()
    });
    Decision {
        conditions,
        provision,
        apply_children: true,
        // Keep the names for the finalizer (the publication stays); no handover is
        // under way.
        slot: Some(SlotStatus {
            handover_snapshot: None,
            // The operator drops this slot itself: its absence is no loss.
            existed: false,
            lost: None,
            ..slot
        }),
        take_snapshot: false,
        backfill: true,
        exclusive_rollout: exclusive_rollout(observed),
        events: Vec::new(),
        next: if slot_exists {
            Next::Soon
        } else {
            Next::Refresh
        },
        fallback: FallbackWrite::Set(fallback),
    }
}

/// Whether a relay that fell back to polling may return to log tailing: its slot is
/// gone (the fall back completed), `returnAfter` has passed since, and the backlog is
/// drained: no row committed before the fall back waits any more (the polling relay
/// published what the stuck one left, so the broker takes events again) and none older
/// than [`DRAINED_AGE_SECONDS`] (polling keeps up); where the table has no `createdAt`
/// column, no row at all. The return is
/// the switch from polling to log tailing: the slot is created while the polling relay
/// runs, and log tailing starts once every row committed before it is published.
pub(super) fn return_due(
    fallback: &FallbackStatus,
    budget: &WalBudget,
    facts: &admin::Facts,
    observed: &Observed,
) -> bool {
    let since = fallback.since.parse::<k8s_openapi::jiff::Timestamp>().ok();
    let waited = since.is_some_and(|since| {
        observed
            .now
            .duration_since(since)
            .try_into()
            .is_ok_and(|d: std::time::Duration| d >= budget.return_after)
    });
    // The rows the stuck relay left (committed before the fall back) are published, so
    // the broker takes events again; and polling keeps up (nothing old waits).
    let fell_back_for = since.and_then(|since| {
        observed
            .now
            .duration_since(since)
            .try_into()
            .ok()
            .map(|d: std::time::Duration| d.as_secs())
    });
    let drained = facts.backlog.is_some_and(|b| match b.oldest_age_seconds {
        Some(age) => {
            age <= DRAINED_AGE_SECONDS && fell_back_for.is_some_and(|for_secs| age < for_secs)
        }
        None => b.rows == 0,
    });
    fallback.slot_dropped && facts.slot.is_none() && waited && drained
}

/// What published the table when this slot was first seen with its publication: kept
/// for the slot's life, so that a relay that starts after a DROP and ADD of the table
/// (or a recreated publication) sees the change it did not witness.
pub(super) fn coverage_baseline(
    slot: &str,
    last_slot: Option<&SlotStatus>,
    facts: &admin::Facts,
) -> Option<String> {
    facts.slot.as_ref()?;
    last_slot
        .filter(|s| s.name == slot)
        .and_then(|s| s.coverage_baseline.clone())
        .or_else(|| {
            facts
                .publication
                .as_ref()
                .filter(|p| p.has_table && !p.identity.is_empty())
                .map(|p| p.identity.clone())
        })
}

/// Bytes for messages: `512 B`, `8.0 MiB`, `1.5 GiB`.
pub(super) fn bytes_for_people(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}
