//! A replication slot lost under a log-tailing relay: it existed, the relay streamed it,
//! and now it is gone — a standby without it was promoted (PostgreSQL 16 and older have
//! no failover slots; on 17+ one that had not synchronised it yet), or it was dropped by
//! hand. A slot created now would stream only later commits, so the commits between the
//! old slot's last confirmed position and the new slot would reach no broker, and no
//! one would know. So a lost slot is never replaced in silence:
//!
//! - with `deleteAfterPublish`, the table holds exactly the rows not yet published. The
//!   log-tailing pods are replaced by the back-fill relay (polling the table) with a
//!   `Recreate` rollout, so the two never publish side by side; only once no pod tails
//!   the log is a new slot created, and the switch from polling to log tailing hands
//!   over as it always does (the polling relay runs until every row committed before
//!   the new slot is published);
//! - without it, nothing tells the rows of the window apart from the published ones:
//!   the relay stays stopped with `SlotLost`, naming the window, until the user sets
//!   [`crate::api::RECREATE_LOST_SLOT_ANNOTATION`] to the loss's `detectedAt`.

use super::{
    CONDITION_DEGRADED, CONDITION_READY, CONDITION_SLOT_READY, Cond, Decision, FallbackWrite, Next,
    Note,
};
use crate::api::{SlotLoss, SlotStatus};
use crate::controller::observe::Observed;
use crate::postgres::admin::{Facts, SlotPlan};
use crate::postgres::provision::Action;
use crate::spec::ValidRelay;

/// `status.slot.lost.recovery` with `deleteAfterPublish`.
pub(crate) const RECOVERY_BACKFILL: &str = "backfill";
/// `status.slot.lost.recovery` without it.
pub(crate) const RECOVERY_AWAITING_CHOICE: &str = "awaitingChoice";

/// What a lost slot means for this pass.
#[derive(Debug)]
pub(super) enum LostSlot {
    /// The slot is there, or was never seen (a new relay, one returning from its WAL
    /// budget's fall back): create it as usual.
    NotLost,
    /// Hold: the decision for this pass, creating no slot.
    Hold(Box<Decision>),
    /// Create the slot now (the back-fill relay runs alone, or the user chose to go
    /// on), with this Event.
    Replace(Note),
}

/// Decides about a slot that may be lost: `planned` is what provisioning would do
/// (its slot creation is held back while the relay holds), `conds` the database and
/// broker conditions.
pub(super) fn slot_lost(
    valid: &ValidRelay,
    lt: &SlotPlan,
    planned: &[Action],
    last_slot: Option<&SlotStatus>,
    facts: &Facts,
    observed: &Observed,
    conds: [&Cond; 2],
) -> LostSlot {
    let Some(last) = last_slot.filter(|s| s.name == lt.slot) else {
        return LostSlot::NotLost;
    };
    // The operator drops the slot itself past the WAL budget: that is no loss; nor is a
    // slot that lives in a database the Secret no longer reaches (`moved`).
    if facts.slot.is_some()
        || observed.fallback.is_some()
        || !(last.existed || last.lost.is_some())
        || super::moved::moved(last, facts, observed)
    {
        return LostSlot::NotLost;
    }
    let backfill = valid.backfill().is_some();
    let loss = last.lost.clone().unwrap_or_else(|| SlotLoss {
        confirmed_flush_lsn: last.confirmed_flush_lsn.clone(),
        detected_at: observed.now.to_string(),
        recovery: if backfill {
            RECOVERY_BACKFILL
        } else {
            RECOVERY_AWAITING_CHOICE
        }
        .to_owned(),
    });
    let after = match &loss.confirmed_flush_lsn {
        Some(lsn) => format!("commits after position {lsn} (the last it was seen to confirm)"),
        None => {
            "commits after the last position it confirmed (not sampled before the loss)".to_owned()
        }
    };
    let gone = format!(
        "replication slot {} is gone (found missing at {}): the relay had streamed it, so a standby without it was promoted or it was dropped by hand, and {after} are in no slot",
        lt.slot, loss.detected_at
    );
    let children = &observed.children;
    let polling_alone = children.runs_polling && children.settled;
    if backfill && polling_alone {
        return LostSlot::Replace(Note::normal(
            "SlotRecreated",
            format!(
                "{gone}; the polling relay runs alone and publishes them from the table: replication slot {} is created again, and log tailing takes over once every row committed before it is published",
                lt.slot
            ),
        ));
    }
    if !backfill && observed.recreate_lost_slot.as_deref() == Some(loss.detected_at.as_str()) {
        return LostSlot::Replace(Note::warning(
            "SlotRecreated",
            format!(
                "{gone}; annotation {} chose to go on: replication slot {} is created again and streams only what commits after it, so rows of those commits that were not published stay unpublished",
                crate::api::RECREATE_LOST_SLOT_ANNOTATION,
                lt.slot
            ),
        ));
    }
    let message = if backfill {
        format!(
            "{gone}; with deleteAfterPublish the table holds every row not yet published: a polling relay replaces the log-tailing pods (never beside them) and publishes them, then a new slot is created and log tailing resumes"
        )
    } else {
        format!(
            "{gone}; their rows are in the table but cannot be told apart from the published ones, so the relay does not go on by itself: publish them (or accept the gap), then run kubectl annotate outboxrelay {} -n {} {}={} to create a new slot, which streams only what commits after it",
            valid.name,
            valid.namespace,
            crate::api::RECREATE_LOST_SLOT_ANNOTATION,
            loss.detected_at
        )
    };
    let mut conditions = vec![
        Cond::no(CONDITION_READY, "SlotLost", message.clone()),
        Cond::yes(CONDITION_DEGRADED, "SlotLost", message.clone()),
        conds[0].clone(),
        conds[1].clone(),
    ];
    conditions.push(Cond::no(CONDITION_SLOT_READY, "SlotLost", message));
    LostSlot::Hold(Box::new(Decision {
        conditions,
        // The publication's marker may be written, never the slot created.
        provision: planned
            .iter()
            .filter(|a| !matches!(a, Action::CreateSlot { .. }))
            .cloned()
            .collect(),
        apply_children: backfill,
        slot: Some(SlotStatus {
            name: lt.slot.clone(),
            publication: Some(lt.publication.clone()),
            lost: Some(loss),
            ..SlotStatus::default()
        }),
        take_snapshot: false,
        backfill,
        exclusive_rollout: super::exclusive_rollout(observed),
        fallback: FallbackWrite::Clear,
        events: Vec::new(),
        next: if backfill { Next::Soon } else { Next::Refresh },
    }))
}

#[cfg(test)]
mod tests;
