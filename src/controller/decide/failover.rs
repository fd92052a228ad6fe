//! `FailoverReady`: whether a promoted standby lets the relay go on with nothing lost
//! and no phantom event (one for a commit the standby never received).
//!
//! - PostgreSQL 17+: the slot is a failover slot that the standbys synchronise, and the
//!   primary sends a change to the relay only once the standby slots named in
//!   `synchronized_standby_slots` have it. Only the primary is visible from here: the
//!   standbys' side (`sync_replication_slots`, `hot_standby_feedback`) is named in the
//!   message, not checked.
//! - PostgreSQL 15 and 16 have no failover slots: a promoted standby lacks the slot
//!   (the operator reports it lost). The relay itself holds each commit back until the
//!   physical slots named in `spec.mode.logTailing.synchronizedStandbySlots` have it,
//!   so nothing sent is a phantom; with `deleteAfterPublish` the table holds every
//!   unpublished row, which the operator back-fills before it creates a new slot.

use super::{CONDITION_FAILOVER_READY, Cond};
use crate::postgres::admin::{self, ServerFacts};

/// The condition for slot `lt` of a relay naming `spec_standbys`, from what the primary
/// shows (and the CloudNativePG cluster's own settings, when it is one).
pub(super) fn failover_cond(
    lt: &admin::SlotPlan,
    spec_standbys: &[String],
    facts: &admin::Facts,
    cluster: Option<(&crate::api::DatabaseRef, &crate::cnpg::ClusterFacts)>,
) -> Cond {
    let server = &facts.server;
    if server.has_failover_slots()
        && let Some((reason, gap)) = cluster.and_then(|(r, f)| crate::cnpg::failover_gap(r, f))
    {
        // The standbys are the cluster's: its own settings say whether they keep the
        // slot, whatever the primary shows.
        return Cond::no(CONDITION_FAILOVER_READY, reason, gap);
    }
    if let Some(cond) = standbys_cond(
        server,
        spec_standbys,
        "spec.mode.logTailing.synchronizedStandbySlots",
        "the relay publishes nothing until they do",
    ) {
        return cond;
    }
    if !server.has_failover_slots() {
        return before_17(lt, spec_standbys, server.major());
    }
    if facts.slot.as_ref().and_then(|s| s.failover) == Some(false) {
        return Cond::no(
            CONDITION_FAILOVER_READY,
            "SlotWithoutFailover",
            format!(
                "replication slot {0} was created without failover (by an older operator or by someone else), so standbys do not keep it: run ALTER_REPLICATION_SLOT {0} (FAILOVER true) on a replication connection while no relay streams it",
                lt.slot
            ),
        );
    }
    let named = server.standby_slots();
    if let Some(cond) = standbys_cond(
        server,
        &named,
        "synchronized_standby_slots",
        "logical decoding waits for them, so the relay receives nothing",
    ) {
        return cond;
    }
    if named.is_empty() {
        return Cond::no(
            CONDITION_FAILOVER_READY,
            "StandbySyncNotConfigured",
            format!(
                "replication slot {} is a failover slot, but synchronized_standby_slots is empty on the primary, so a promoted standby may lack the slot's latest position: set it to the standbys' physical slots, and on each standby sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name and a dbname in primary_conninfo",
                lt.slot
            ),
        );
    }
    Cond::yes(
        CONDITION_FAILOVER_READY,
        "FailoverSlot",
        format!(
            "replication slot {} is a failover slot; the primary sends changes only once standby slot(s) {} have them (each standby must run with sync_replication_slots = on and hot_standby_feedback = on)",
            lt.slot,
            named.join(", ")
        ),
    )
}

/// PostgreSQL 15 and 16: no failover slot, so what protects a failover is the relay's
/// own wait for the standbys and the back-fill of a lost slot.
fn before_17(lt: &admin::SlotPlan, spec_standbys: &[String], major: i32) -> Cond {
    if spec_standbys.is_empty() {
        return Cond::no(
            CONDITION_FAILOVER_READY,
            "FailoverSlotsUnsupported",
            format!(
                "PostgreSQL {major} has no failover slots (17 and later): a promoted standby lacks replication slot {}, and the relay may have sent events for commits the standby never received (phantoms). Name the standbys' physical slots in spec.mode.logTailing.synchronizedStandbySlots{}",
                lt.slot,
                if lt.delete_after_publish {
                    ""
                } else {
                    ", and set deleteAfterPublish so that the rows of the lost slot's window are back-filled"
                }
            ),
        );
    }
    let standbys = spec_standbys.join(", ");
    if !lt.delete_after_publish {
        return Cond::no(
            CONDITION_FAILOVER_READY,
            "FailoverLosesWindow",
            format!(
                "PostgreSQL {major} has no failover slots: the relay publishes only what standby slot(s) {standbys} flushed, so no event is a phantom, but a promoted standby lacks replication slot {}, and keeping rows the commits between its last confirmed position and a new slot can only be reported (SlotLost), not back-filled: set deleteAfterPublish",
                lt.slot
            ),
        );
    }
    Cond::yes(
        CONDITION_FAILOVER_READY,
        "StandbyGuarded",
        format!(
            "PostgreSQL {major} has no failover slots: the relay publishes only what standby slot(s) {standbys} flushed, so a promoted standby has every commit sent; it lacks replication slot {}, which the operator reports (SlotLost) and replaces once every row left in the table is published. After a promotion, name the new primary's standby slots",
            lt.slot
        ),
    )
}

/// `Some` when a standby slot in `named` (from `setting`) is missing or has no standby
/// streaming it; `waits` says what that holds back.
fn standbys_cond(
    server: &ServerFacts,
    named: &[String],
    setting: &str,
    waits: &str,
) -> Option<Cond> {
    let missing: Vec<&str> = named
        .iter()
        .filter(|n| !server.physical_slots.iter().any(|(s, _)| s == *n))
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        return Some(Cond::no(
            CONDITION_FAILOVER_READY,
            "StandbySlotMissing",
            format!(
                "{setting} names {}, which is no physical slot on this server: {waits} (after a promotion, name the new primary's standby slots)",
                missing.join(", ")
            ),
        ));
    }
    let idle: Vec<&str> = named
        .iter()
        .filter(|n| {
            server
                .physical_slots
                .iter()
                .any(|(s, active)| s == *n && !active)
        })
        .map(String::as_str)
        .collect();
    (!idle.is_empty()).then(|| {
        Cond::no(
            CONDITION_FAILOVER_READY,
            "StandbyNotStreaming",
            format!(
                "standby slot(s) {} named in {setting} have no standby streaming: {waits} until they catch up",
                idle.join(", ")
            ),
        )
    })
}
