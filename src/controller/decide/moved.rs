//! A connection Secret pointed at another host or database while the relay tails the
//! log. The slot the relay streamed stays where it was: it is neither lost (nothing
//! vanished from the database it lived in) nor the operator's to drop any more (the
//! Secret no longer reaches it), and it retains WAL there until someone drops it. So:
//!
//! - a slot missing in the database the Secret reaches now, when status says it lives
//!   elsewhere, is no loss: the relay starts in the new database as a new relay would
//!   (a new slot, rows committed before it published by polling first);
//! - the old slot is recorded in `status.slot.leftBehind`, with a Warning Event and
//!   `Degraded=True` (`SlotLeftBehind`) naming where it is and how to drop it, until the
//!   user, having dropped it, sets [`crate::api::LEFT_BEHIND_SLOT_DROPPED_ANNOTATION`]
//!   to its `detectedAt`.
//!
//! Where a slot lives is `host:port/database` of the Secret's URL, recorded whenever the
//! slot is seen or made ([`settle`]).

use super::{CONDITION_DEGRADED, Cond, Decision, Note};
use crate::api::{LEFT_BEHIND_SLOT_DROPPED_ANNOTATION, SlotLeftBehind, SlotStatus};
use crate::controller::database::DatabaseSeen;
use crate::controller::observe::Observed;
use crate::postgres::admin::Facts;
use crate::postgres::provision::Action;

/// The slot the relay streamed lives in another database than the one the Secret
/// reaches now: missing there, or (another database of the same server: slot names are
/// the server's) a slot of that name belonging to another database.
pub(super) fn moved(last: &SlotStatus, facts: &Facts, observed: &Observed) -> bool {
    let not_here = facts
        .slot
        .as_ref()
        .is_none_or(|s| s.database.as_deref() != Some(facts.server.database.as_str()));
    last.existed
        && not_here
        && matches!((&last.location, &observed.location), (Some(was), Some(now)) if was != now)
}

/// Finishes `decision` for slot `slot` of relay `namespace/name`: where the slot lives,
/// and what was left behind elsewhere.
pub(super) fn settle(
    decision: &mut Decision,
    (namespace, name, slot): (&str, &str, &str),
    last_slot: Option<&SlotStatus>,
    observed: &Observed,
) {
    let facts = match &observed.database {
        DatabaseSeen::Seen(facts) => Some(facts.as_ref()),
        _ => None,
    };
    let last = last_slot.filter(|s| s.name == slot);
    let creates = decision
        .provision
        .iter()
        .any(|a| matches!(a, Action::CreateSlot { .. }));
    let Some(status) = decision.slot.as_mut().filter(|s| s.name == slot) else {
        return;
    };
    status.location = if facts.is_some_and(|f| f.slot.is_some()) || creates {
        observed.location.clone()
    } else {
        last.and_then(|l| l.location.clone())
    };
    let earlier = last.and_then(|l| l.left_behind.clone());
    status.left_behind = match (earlier, last, facts) {
        (Some(earlier), _, _)
            if observed.left_behind_dropped.as_deref() == Some(earlier.detected_at.as_str()) =>
        {
            decision.events.push(Note::normal(
                "LeftBehindSlotDropped",
                format!(
                    "replication slot {} in {} is no longer reported: annotation {LEFT_BEHIND_SLOT_DROPPED_ANNOTATION} says it was dropped there",
                    earlier.slot, earlier.location
                ),
            ));
            None
        }
        // Found now (a slot already recorded there is not found again each pass).
        (earlier, Some(last), Some(facts))
            if moved(last, facts, observed)
                && earlier.as_ref().map(|e| &e.location) != last.location.as_ref() =>
        {
            let left = SlotLeftBehind {
                slot: last.name.clone(),
                location: last.location.clone().unwrap_or_default(),
                detected_at: observed.now.to_string(),
            };
            decision.events.push(Note::warning(
                "SlotLeftBehind",
                message(&left, namespace, name, observed),
            ));
            Some(left)
        }
        (earlier, _, _) => earlier,
    };
    let Some(left) = status.left_behind.clone() else {
        return;
    };
    let text = message(&left, namespace, name, observed);
    if let Some(degraded) = decision
        .conditions
        .iter_mut()
        .find(|c| c.type_ == CONDITION_DEGRADED && !c.status)
    {
        *degraded = Cond::yes(CONDITION_DEGRADED, "SlotLeftBehind", text);
    }
}

fn message(left: &SlotLeftBehind, namespace: &str, name: &str, observed: &Observed) -> String {
    format!(
        "replication slot {slot} was streamed in {was}, which the connection Secret no longer reaches (it leads to {now}): the operator cannot drop it, and it retains WAL on that server until it is dropped. Drop it there (SELECT pg_drop_replication_slot('{slot}'), and its publication if nothing else uses it), then run kubectl annotate outboxrelay {name} -n {namespace} {LEFT_BEHIND_SLOT_DROPPED_ANNOTATION}={at}",
        slot = left.slot,
        was = left.location,
        now = observed.location.as_deref().unwrap_or("another database"),
        at = left.detected_at
    )
}

#[cfg(test)]
mod tests;
