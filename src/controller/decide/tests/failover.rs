//! The failover condition, the coverage baseline and failover slots.

use super::*;

#[test]
fn the_failover_condition_follows_the_server_and_the_slot() {
    let last = SlotStatus {
        handover_snapshot: Some("100:100:".into()),
        ..slot_status("outbox_shop_orders")
    };
    let decide_with = |version: i32, failover: Option<bool>, standbys: &str| {
        let mut database = facts("logical", Some(Some(our_marker())), true);
        if let DatabaseSeen::Seen(f) = &mut database {
            f.unpublished_before_slot = Some(0);
            f.server.version_num = version;
            f.server.synchronized_standby_slots = standbys.into();
            f.server.physical_slots = vec![("standby_1".into(), true), ("standby_2".into(), false)];
            if let Some(slot) = &mut f.slot {
                slot.failover = failover;
            }
        }
        let o = observed(secrets_ok(), database, 1);
        let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
        let c = d
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_FAILOVER_READY)
            .unwrap_or_else(|| panic!("no FailoverReady: {d:?}"))
            .clone();
        (c.status, c.reason, c.message)
    };
    let (status, reason, message) = decide_with(150_012, None, "");
    assert!(!status && reason == "FailoverSlotsUnsupported", "{message}");
    assert!(message.contains("PostgreSQL 15"), "{message}");
    let (status, reason, _) = decide_with(180_006, Some(false), "standby_1");
    assert!(!status && reason == "SlotWithoutFailover");
    let (status, reason, message) = decide_with(180_006, Some(true), "");
    assert!(!status && reason == "StandbySyncNotConfigured", "{message}");
    let (status, reason, message) = decide_with(180_006, Some(true), "standby_1");
    assert!(status && reason == "FailoverSlot", "{message}");
    assert!(message.contains("standby_1"), "{message}");
    let (status, reason, message) = decide_with(180_006, Some(true), "standby_1, standby_2");
    assert!(!status && reason == "StandbyNotStreaming", "{message}");
    assert!(
        message.contains("standby_2") && !message.contains("standby_1"),
        "{message}"
    );
    // Unquoted names are folded to lower case, as PostgreSQL reads them.
    let (status, _, message) = decide_with(180_006, Some(true), "STANDBY_1");
    assert!(status, "{message}");
    let (_, reason, _) = decide_with(180_006, Some(true), "\"Standby_1\"");
    assert_eq!(reason, "StandbySlotMissing");
    let (status, reason, message) = decide_with(180_006, Some(true), "standby_1,\"gone\"");
    assert!(!status && reason == "StandbySlotMissing", "{message}");
    assert!(message.contains("gone"), "{message}");
    // A polling relay has no slot and no such condition.
    let o = observed(secrets_ok(), facts("logical", None, false), 1);
    let d = run(&relay("polling", 1), None, Some(&o));
    assert!(
        d.conditions
            .iter()
            .all(|c| c.type_ != CONDITION_FAILOVER_READY)
    );
}

#[test]
fn the_coverage_baseline_is_recorded_once_per_slot_and_kept_through_publication_changes() {
    let run_with = |last: Option<&SlotStatus>, identity: &str, slot: bool| {
        let mut database = facts("logical", Some(Some(our_marker())), slot);
        if let DatabaseSeen::Seen(f) = &mut database {
            f.unpublished_before_slot = Some(0);
            if let Some(p) = &mut f.publication {
                p.identity = identity.into();
            }
        }
        let o = observed(secrets_ok(), database, 1);
        run(&relay("logTailing", 1), last, Some(&o))
            .slot
            .and_then(|s| s.coverage_baseline)
    };
    // First seen: what publishes the table now.
    let first = run_with(None, "1/2;3/4", true);
    assert_eq!(first.as_deref(), Some("1/2;3/4"));
    // A DROP and ADD later: the baseline stays, so a relay starting now sees the change.
    let last = SlotStatus {
        coverage_baseline: first,
        ..existing("outbox_shop_orders")
    };
    assert_eq!(
        run_with(Some(&last), "1/2;5/6", true).as_deref(),
        Some("1/2;3/4")
    );
    // The slot gone: no baseline until a new slot is seen with its publication.
    assert_eq!(run_with(Some(&last), "1/2;5/6", false), None);
}

#[test]
fn before_17_the_failover_condition_follows_the_standby_slots_the_relay_waits_for() {
    let last = SlotStatus {
        handover_snapshot: Some("100:100:".into()),
        ..slot_status("outbox_shop_orders")
    };
    let decide_with = |version: i32, standbys: &[&str], delete_after_publish: bool| {
        let mut database = facts("logical", Some(Some(our_marker())), true);
        if let DatabaseSeen::Seen(f) = &mut database {
            f.unpublished_before_slot = Some(0);
            f.server.version_num = version;
            f.server.physical_slots = vec![("standby_1".into(), true), ("standby_2".into(), false)];
        }
        let mut r = relay("logTailing", 1);
        let lt = r.spec.mode.log_tailing.as_mut().unwrap();
        lt.synchronized_standby_slots = standbys.iter().map(|s| (*s).to_owned()).collect();
        lt.delete_after_publish = delete_after_publish;
        let o = observed(secrets_ok(), database, 1);
        let d = run(&r, Some(&last), Some(&o));
        let c = d
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_FAILOVER_READY)
            .unwrap_or_else(|| panic!("no FailoverReady: {d:?}"))
            .clone();
        (c.status, c.reason, c.message)
    };
    // Nothing named: phantoms possible, and the message says what protects.
    let (status, reason, message) = decide_with(160_004, &[], true);
    assert!(!status && reason == "FailoverSlotsUnsupported", "{message}");
    assert!(message.contains("synchronizedStandbySlots"), "{message}");
    let (_, _, message) = decide_with(150_012, &[], false);
    assert!(message.contains("deleteAfterPublish"), "{message}");
    // Named, streaming, deleting: guarded.
    let (status, reason, message) = decide_with(150_012, &["standby_1"], true);
    assert!(status && reason == "StandbyGuarded", "{message}");
    assert!(message.contains("standby_1"), "{message}");
    // Keeping rows: no phantom, but the window of a lost slot cannot be back-filled.
    let (status, reason, _) = decide_with(150_012, &["standby_1"], false);
    assert!(!status && reason == "FailoverLosesWindow");
    // A named slot missing or idle: the relay waits, and the condition says so.
    let (status, reason, message) = decide_with(150_012, &["standby_1", "gone"], true);
    assert!(!status && reason == "StandbySlotMissing", "{message}");
    assert!(message.contains("gone") && message.contains("synchronizedStandbySlots"));
    let (status, reason, message) = decide_with(160_004, &["standby_2"], true);
    assert!(!status && reason == "StandbyNotStreaming", "{message}");
    // On 17+ the relay's own wait is checked too.
    let (_, reason, _) = decide_with(180_006, &["gone"], true);
    assert_eq!(reason, "StandbySlotMissing");
}

#[test]
fn slots_are_created_as_failover_slots_where_the_server_has_them() {
    for (version, failover) in [(150_012, false), (170_000, true), (180_006, true)] {
        let mut database = facts("logical", None, false);
        if let DatabaseSeen::Seen(f) = &mut database {
            f.server.version_num = version;
        }
        let o = observed(secrets_ok(), database, -1);
        let d = run(&relay("logTailing", 1), None, Some(&o));
        assert!(
            d.provision
                .iter()
                .any(|a| matches!(a, Action::CreateSlot { failover: f, .. } if *f == failover)),
            "{version}: {d:?}"
        );
    }
}
