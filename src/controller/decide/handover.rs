//! Hand-overs to log tailing: the back-fill of rows committed before a new slot, and
//! the switch from polling.

use super::*;

/// A log-tailing slot created now (a new relay, one recreated or renamed after its slot
/// was dropped, a slot dropped by hand) streams only what commits after it, while the
/// table may hold rows committed before it and never published. With
/// `deleteAfterPublish` the table is exactly the rows not published yet, so they are
/// found: the snapshot taken right after the slot was created tells them apart, and
/// while any is left the back-fill relay (polling the same table) runs instead of log
/// tailing; the handover above then hands over to log tailing once they are published.
/// `None`: nothing to back-fill (log tailing starts at once).
#[allow(clippy::too_many_arguments)]
pub(super) fn backfill_first(
    lt: &admin::SlotPlan,
    valid: &ValidRelay,
    actions: &[Action],
    last_slot: Option<&SlotStatus>,
    facts: &admin::Facts,
    observed: &Observed,
    conds: [&Cond; 2],
    slot_cond: Option<&Cond>,
) -> Option<Decision> {
    let creating = actions
        .iter()
        .any(|a| matches!(a, Action::CreateSlot { .. }));
    let snapshot = last_slot.and_then(|s| s.handover_snapshot.clone());
    // The slot exists but no relay has run yet and no snapshot was recorded (taking it
    // failed, or the operator stopped in between): a late snapshot only adds
    // duplicates. Not for a slot taken over from a relay being deleted: its position
    // carries what the old relay had not published, and its pods may still stream.
    let never_ran = observed.children.deployment.is_none() && observed.claim != Claim::Released;
    if observed.children.runs_polling
        || valid.backfill().is_none()
        || !(creating || snapshot.is_some() || never_ran)
    {
        return None;
    }
    let slot = SlotStatus {
        name: lt.slot.clone(),
        publication: Some(lt.publication.clone()),
        handover_snapshot: snapshot.clone(),
        existed: facts.slot.is_some(),
        ..SlotStatus::default()
    };
    let (message, take_snapshot, backfill) = match (&snapshot, facts.unpublished_before_slot) {
        (Some(_), Some(0)) => return None,
        (None, _) => (
            format!(
                "replication slot {} is created; rows committed before it are looked for before log tailing starts",
                lt.slot
            ),
            true,
            false,
        ),
        (Some(_), Some(rows)) => (
            format!(
                "{rows} rows committed before replication slot {} was created are not published yet (the slot streams only later commits): a polling relay publishes them first, then log tailing takes over",
                lt.slot
            ),
            false,
            true,
        ),
        (Some(_), None) => (
            format!(
                "the rows committed before replication slot {} was created could not be counted; looking again",
                lt.slot
            ),
            false,
            false,
        ),
    };
    let mut conditions = vec![
        Cond::no(
            CONDITION_READY,
            "BackfillingBeforeLogTailing",
            message.clone(),
        ),
        Cond::no(CONDITION_DEGRADED, "BackfillingBeforeLogTailing", message),
        conds[0].clone(),
        conds[1].clone(),
    ];
    conditions.extend(slot_cond.cloned());
    Some(Decision {
        conditions,
        provision: actions.to_vec(),
        apply_children: backfill,
        slot: Some(slot),
        take_snapshot,
        backfill,
        fallback: FallbackWrite::Clear,
        exclusive_rollout: exclusive_rollout(observed),
        events: Vec::new(),
        next: Next::Soon,
    })
}

/// While a switch from polling to log tailing waits: why (`None`: nothing left that
/// the slot cannot stream, so the log-tailing relay may start).
pub(super) fn handover_pending(
    lt: &admin::SlotPlan,
    last_slot: Option<&SlotStatus>,
    facts: &admin::Facts,
) -> Option<String> {
    let snapshot = last_slot.and_then(|s| s.handover_snapshot.as_ref());
    match (snapshot, facts.unpublished_before_slot) {
        (Some(_), Some(0)) => None,
        (None, _) => Some(format!(
            "switching from polling to log tailing: slot {} is created while the polling relay keeps running; log tailing starts once the rows committed before it are published",
            lt.slot
        )),
        (Some(_), Some(rows)) => Some(format!(
            "switching from polling to log tailing: {rows} rows committed before slot {} was created are not published yet; the polling relay keeps running until they are (the slot streams only later commits)",
            lt.slot
        )),
        (Some(_), None) => Some(format!(
            "switching from polling to log tailing: the rows committed before slot {} was created could not be counted; looking again",
            lt.slot
        )),
    }
}
