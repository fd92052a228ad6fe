//! A lost slot as a table: never created again in silence; back-filled alone with
//! `deleteAfterPublish`, held for the user's choice without it.

use super::super::tests::{facts, observed, our_marker, ready, relay, run, secrets_ok};
use super::super::*;
use super::{RECOVERY_AWAITING_CHOICE, RECOVERY_BACKFILL};
use crate::api::{OutboxRelay, SlotLoss};

const SLOT: &str = "outbox_shop_orders";
const DETECTED: &str = "2026-12-05T10:00:00Z";

/// A slot status showing the slot streamed up to `0/5000`.
fn streamed() -> SlotStatus {
    SlotStatus {
        name: SLOT.into(),
        publication: Some(SLOT.into()),
        confirmed_flush_lsn: Some("0/5000".into()),
        existed: true,
        ..SlotStatus::default()
    }
}

/// The publication is there with our marker, the slot is not; the tailing Deployment
/// runs (one pod available).
fn slot_gone() -> Observed {
    observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), false),
        1,
    )
}

fn keeping_rows() -> OutboxRelay {
    let mut r = relay("logTailing", 1);
    r.spec
        .mode
        .log_tailing
        .as_mut()
        .unwrap()
        .delete_after_publish = false;
    r
}

fn creates_slot(d: &Decision) -> bool {
    d.provision
        .iter()
        .any(|a| matches!(a, Action::CreateSlot { .. }))
}

fn cond<'a>(d: &'a Decision, type_: &str) -> &'a Cond {
    d.conditions.iter().find(|c| c.type_ == type_).unwrap()
}

#[test]
fn a_lost_slot_without_delete_after_publish_waits_for_the_choice_naming_the_window() {
    let o = slot_gone();
    let d = run(&keeping_rows(), Some(&streamed()), Some(&o));
    assert!(!creates_slot(&d), "{d:?}");
    assert!(!d.apply_children && !d.backfill, "{d:?}");
    assert_eq!(ready(&d), ("False", "SlotLost"));
    assert!(cond(&d, CONDITION_DEGRADED).status);
    assert_eq!(cond(&d, CONDITION_SLOT_READY).reason, "SlotLost");
    let message = &cond(&d, CONDITION_READY).message;
    assert!(message.contains("after position 0/5000"), "{message}");
    assert!(
        message.contains(&format!(
            "kubectl annotate outboxrelay orders -n shop outbox.dev/recreate-lost-slot={DETECTED}"
        )),
        "{message}"
    );
    let lost = d.slot.as_ref().and_then(|s| s.lost.clone());
    assert_eq!(
        lost,
        Some(SlotLoss {
            confirmed_flush_lsn: Some("0/5000".into()),
            detected_at: DETECTED.into(),
            recovery: RECOVERY_AWAITING_CHOICE.into(),
        })
    );

    // Later passes keep the loss as first recorded (its time is the choice's key).
    let mut later = o.clone();
    later.now = "2026-12-05T11:00:00Z".parse().unwrap();
    let recorded = d.slot.clone().unwrap();
    let d = run(&keeping_rows(), Some(&recorded), Some(&later));
    assert_eq!(d.slot.as_ref().and_then(|s| s.lost.clone()), lost);
    assert!(!creates_slot(&d));

    // An annotation of another loss chooses nothing.
    later.recreate_lost_slot = Some("2026-11-01T00:00:00Z".into());
    let d = run(&keeping_rows(), Some(&recorded), Some(&later));
    assert!(!creates_slot(&d), "{d:?}");

    // The choice for this loss: the slot is created, with a Warning naming the window,
    // and the loss leaves status.
    later.recreate_lost_slot = Some(DETECTED.into());
    let d = run(&keeping_rows(), Some(&recorded), Some(&later));
    assert!(creates_slot(&d), "{d:?}");
    assert!(d.apply_children);
    assert_eq!(d.slot.as_ref().and_then(|s| s.lost.clone()), None);
    let [note] = &d.events[..] else {
        panic!("{:?}", d.events)
    };
    assert!(note.warning && note.reason == "SlotRecreated", "{note:?}");
    assert!(note.message.contains("0/5000"), "{note:?}");
}

#[test]
fn a_lost_slot_with_delete_after_publish_is_back_filled_alone_before_a_new_slot() {
    // The tailing pods run: the back-fill relay replaces them exclusively, no slot yet.
    let mut o = slot_gone();
    let d = run(&relay("logTailing", 1), Some(&streamed()), Some(&o));
    assert!(!creates_slot(&d), "{d:?}");
    assert!(
        d.apply_children && d.backfill && d.exclusive_rollout,
        "{d:?}"
    );
    assert_eq!(ready(&d), ("False", "SlotLost"));
    assert_eq!(d.next, Next::Soon);
    let recorded = d.slot.clone().unwrap();
    assert_eq!(
        recorded.lost.as_ref().map(|l| l.recovery.as_str()),
        Some(RECOVERY_BACKFILL)
    );

    // The Deployment says polling but its rollout is not complete (a tailing pod may be
    // left): still no slot, and the rollout stays exclusive (switched back to
    // RollingUpdate mid-way, polling pods would start beside the tailing ones).
    o.children.runs_polling = true;
    let d = run(&relay("logTailing", 1), Some(&recorded), Some(&o));
    assert!(!creates_slot(&d) && d.backfill, "{d:?}");
    assert!(d.exclusive_rollout, "{d:?}");

    // Only polling pods: the slot is created and the handover from polling begins
    // (snapshot, polling keeps running until the rows before the slot are out).
    o.children.settled = true;
    let d = run(&relay("logTailing", 1), Some(&recorded), Some(&o));
    assert!(creates_slot(&d) && d.take_snapshot, "{d:?}");
    assert!(!d.apply_children, "the polling relay keeps running: {d:?}");
    assert_eq!(ready(&d), ("False", "SwitchingToLogTailing"));
    assert_eq!(d.slot.as_ref().and_then(|s| s.lost.clone()), None);
    assert!(
        d.events
            .iter()
            .any(|n| !n.warning && n.reason == "SlotRecreated"),
        "{:?}",
        d.events
    );
}

#[test]
fn a_slot_never_seen_or_dropped_by_the_operator_is_no_loss() {
    // Never seen (a new relay): created at once.
    let o = slot_gone();
    let new = SlotStatus {
        existed: false,
        confirmed_flush_lsn: None,
        ..streamed()
    };
    let d = run(&keeping_rows(), Some(&new), Some(&o));
    assert!(creates_slot(&d), "{d:?}");
    // Another slot name than the one that existed (spec.mode.logTailing.slotName
    // changed): the new one is created.
    let other = SlotStatus {
        name: "before_rename".into(),
        ..streamed()
    };
    let d = run(&keeping_rows(), Some(&other), Some(&o));
    assert!(creates_slot(&d), "{d:?}");
    // While a relay polls past its WAL budget the operator dropped the slot itself.
    let mut fell_back = slot_gone();
    fell_back.fallback = Some(crate::api::FallbackStatus {
        since: DETECTED.into(),
        retained_wal_bytes: 1,
        slot_dropped: true,
    });
    let d = run(&relay("logTailing", 1), Some(&streamed()), Some(&fell_back));
    assert_ne!(ready(&d).1, "SlotLost", "{d:?}");
    // The slot there again: it is no longer lost, and status says it existed.
    let back = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), true),
        1,
    );
    let lost = SlotStatus {
        lost: Some(SlotLoss {
            confirmed_flush_lsn: None,
            detected_at: DETECTED.into(),
            recovery: RECOVERY_AWAITING_CHOICE.into(),
        }),
        existed: false,
        ..streamed()
    };
    let d = run(&keeping_rows(), Some(&lost), Some(&back));
    assert_eq!(ready(&d), ("True", "RelayAvailable"));
    let slot = d.slot.unwrap();
    assert!(slot.existed && slot.lost.is_none(), "{slot:?}");
}

#[test]
fn a_rollout_replacing_tailing_pods_is_exclusive() {
    // Tailing pods run: whatever replaces them waits until they are gone.
    let o = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), true),
        1,
    );
    assert!(run(&relay("logTailing", 1), None, Some(&o)).exclusive_rollout);
    assert!(run(&relay("polling", 1), None, Some(&o)).exclusive_rollout);
    // Polling pods replaced by polling pods overlap (advisory locks keep them apart),
    // once the rollout that made them polling is complete.
    let mut polling = o.clone();
    polling.children.runs_polling = true;
    assert!(run(&relay("polling", 1), None, Some(&polling)).exclusive_rollout);
    polling.children.settled = true;
    assert!(!run(&relay("polling", 1), None, Some(&polling)).exclusive_rollout);
    // No Deployment yet: nothing to replace.
    let fresh = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), true),
        -1,
    );
    assert!(!run(&relay("polling", 1), None, Some(&fresh)).exclusive_rollout);
}
