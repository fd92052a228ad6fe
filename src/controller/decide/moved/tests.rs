//! A Secret pointed at another database: the slot there is no loss, the old one is
//! reported until the user says it is dropped.

use super::super::tests::{facts, observed, our_marker, ready, relay, run, secrets_ok};
use super::super::*;
use crate::api::SlotLeftBehind;

const SLOT: &str = "outbox_shop_orders";
const DETECTED: &str = "2026-12-05T10:00:00Z";
const OLD: &str = "db-a:5432/shop";
const NEW: &str = "db-b:5432/shop";

/// The slot as status showed it, streamed in the old database.
fn streamed_in_old() -> SlotStatus {
    SlotStatus {
        name: SLOT.into(),
        publication: Some(SLOT.into()),
        confirmed_flush_lsn: Some("0/5000".into()),
        existed: true,
        location: Some(OLD.into()),
        ..SlotStatus::default()
    }
}

/// The Secret leads to `location`, where the slot exists or not.
fn seen_at(location: &str, slot: bool) -> Observed {
    let mut o = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), slot),
        1,
    );
    o.location = Some(location.into());
    o
}

fn degraded(d: &Decision) -> &Cond {
    d.conditions
        .iter()
        .find(|c| c.type_ == CONDITION_DEGRADED)
        .unwrap()
}

#[test]
fn a_slot_missing_where_the_secret_now_leads_is_no_loss_and_the_old_one_is_reported() {
    let r = relay("logTailing", 1);
    let d = run(&r, Some(&streamed_in_old()), Some(&seen_at(NEW, false)));
    assert_ne!(ready(&d).1, "SlotLost", "{d:?}");
    assert!(
        d.provision
            .iter()
            .any(|a| matches!(a, Action::CreateSlot { .. })),
        "a new slot where the Secret leads: {d:?}"
    );
    let status = d.slot.clone().unwrap();
    assert_eq!(status.location.as_deref(), Some(NEW));
    assert!(status.lost.is_none());
    let left = SlotLeftBehind {
        slot: SLOT.into(),
        location: OLD.into(),
        detected_at: DETECTED.into(),
    };
    assert_eq!(status.left_behind, Some(left.clone()));
    let event = d
        .events
        .iter()
        .find(|e| e.reason == "SlotLeftBehind")
        .expect("a Warning Event");
    assert!(event.warning);
    for text in [&event.message, &degraded(&d).message] {
        assert!(
            text.contains(OLD)
                && text.contains(NEW)
                && text.contains(&format!("pg_drop_replication_slot('{SLOT}')"))
                && text.contains(&format!("outbox.dev/left-behind-slot-dropped={DETECTED}")),
            "{text}"
        );
    }
    assert!(degraded(&d).status && degraded(&d).reason == "SlotLeftBehind");

    // Next pass, the new slot made: still reported, not found again.
    let last = SlotStatus {
        existed: false,
        location: Some(NEW.into()),
        left_behind: Some(left.clone()),
        ..streamed_in_old()
    };
    let d = run(&r, Some(&last), Some(&seen_at(NEW, true)));
    assert_eq!(d.slot.clone().unwrap().left_behind, Some(left.clone()));
    assert!(d.events.iter().all(|e| e.reason != "SlotLeftBehind"));
    assert_eq!(degraded(&d).reason, "SlotLeftBehind");

    // Dropped there, the user says so: the record goes.
    let mut o = seen_at(NEW, true);
    o.left_behind_dropped = Some(DETECTED.into());
    let d = run(&r, Some(&last), Some(&o));
    assert_eq!(d.slot.clone().unwrap().left_behind, None);
    assert!(d.events.iter().any(|e| e.reason == "LeftBehindSlotDropped"));
    assert!(!degraded(&d).status);
    // An annotation of another time clears nothing.
    let mut o = seen_at(NEW, true);
    o.left_behind_dropped = Some("2000-01-01T00:00:00Z".into());
    let d = run(&r, Some(&last), Some(&o));
    assert_eq!(d.slot.unwrap().left_behind, Some(left));
}

#[test]
fn where_the_secret_still_leads_a_missing_slot_is_lost_and_an_alias_with_the_slot_is_no_move() {
    let r = relay("logTailing", 1);
    let d = run(&r, Some(&streamed_in_old()), Some(&seen_at(OLD, false)));
    assert_eq!(ready(&d), ("False", "SlotLost"));
    assert!(d.slot.unwrap().left_behind.is_none());
    // Another name for the same database: the slot is there, so nothing moved.
    let d = run(&r, Some(&streamed_in_old()), Some(&seen_at(NEW, true)));
    let status = d.slot.unwrap();
    assert_eq!(status.location.as_deref(), Some(NEW));
    assert!(status.left_behind.is_none());
    assert!(d.events.iter().all(|e| e.reason != "SlotLeftBehind"));
}

#[test]
fn another_database_of_the_same_server_keeps_the_slot_name_taken_and_reports_it() {
    // Slot names are the server's: the old slot shows, belonging to the old database.
    let mut o = seen_at(NEW, true);
    if let DatabaseSeen::Seen(f) = &mut o.database
        && let Some(slot) = &mut f.slot
    {
        slot.database = Some("old".into());
    }
    let d = run(&relay("logTailing", 1), Some(&streamed_in_old()), Some(&o));
    assert_ne!(ready(&d).1, "SlotLost");
    let left = d.slot.unwrap().left_behind.expect("recorded");
    assert_eq!(left.location, OLD);
    assert!(d.events.iter().any(|e| e.reason == "SlotLeftBehind"));
}
