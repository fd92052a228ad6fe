//! `spec.suspend`: no pod, nothing dropped, the slot and its WAL budget still watched.

use super::*;
use crate::resources::{BuildOptions, build};
use crate::spec::config::RelayConfig;

fn suspended(r: &OutboxRelay) -> OutboxRelay {
    let mut r = r.clone();
    r.spec.suspend = true;
    r
}

#[test]
fn a_suspended_log_tailing_relay_keeps_its_slot_runs_no_pod_and_says_why() {
    let last = slot_status("outbox_shop_orders");
    let o = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), true),
        0,
    );
    let r = suspended(&relay("logTailing", 1));
    let d = run(&r, Some(&last), Some(&o));
    // Nothing dropped or created; the children applied, the slot kept in status.
    assert!(d.provision.is_empty(), "{:?}", d.provision);
    assert!(d.apply_children);
    assert_eq!(d.slot, Some(existing("outbox_shop_orders")));
    assert_eq!(ready(&d), ("False", "Suspended"));
    let message = &d
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_READY)
        .unwrap()
        .message;
    assert!(message.contains("outbox_shop_orders"), "{message}");
    // Ready's change is a Normal Event: suspending is someone's decision.
    let note = ready_transition(None, &d.conditions).unwrap();
    assert!(!note.warning, "{note:?}");

    // The Deployment runs no pod, and the relay's config is the running one's, so
    // resuming starts the same relay where the slot's position stands.
    let valid = parse(&r).unwrap();
    let running = parse(&relay("logTailing", 1)).unwrap();
    let desired = build(&valid, &BuildOptions::default()).unwrap();
    assert_eq!(desired.deployment.spec.unwrap().replicas, Some(0));
    assert_eq!(
        RelayConfig::for_relay(&valid),
        RelayConfig::for_relay(&running)
    );
    // Resumed: the pods come back.
    let resumed = build(&running, &BuildOptions::default()).unwrap();
    assert_eq!(resumed.deployment.spec.unwrap().replicas, Some(1));
}

#[test]
fn a_suspended_polling_relay_runs_no_pod_whatever_its_replicas() {
    let o = observed(secrets_ok(), facts("logical", None, false), 0);
    let r = suspended(&relay("polling", 3));
    let d = run(&r, None, Some(&o));
    assert!(d.apply_children && d.provision.is_empty(), "{d:?}");
    assert_eq!(ready(&d), ("False", "Suspended"));
    let valid = parse(&r).unwrap();
    assert_eq!(valid.effective_replicas(), 0);
    // No PodDisruptionBudget for pods that do not run.
    let desired = build(&valid, &BuildOptions::default()).unwrap();
    assert!(desired.pod_disruption_budget.is_none());
}

#[test]
fn suspended_or_not_the_slot_is_watched_alike() {
    // Retained WAL past the alert threshold: Degraded either way.
    let mut database = facts("logical", Some(Some(our_marker())), true);
    if let DatabaseSeen::Seen(f) = &mut database {
        f.slot = Some(SlotFacts {
            database: Some("shop".into()),
            plugin: Some("pgoutput".into()),
            slot_type: "logical".into(),
            failover: None,
            retained_wal_bytes: Some(2 << 30),
            active: false,
        });
    }
    let last = SlotStatus {
        retained_wal_bytes: Some(2 << 30),
        ..slot_status("outbox_shop_orders")
    };
    let o = observed(secrets_ok(), database, 0);
    let running = relay("logTailing", 1);
    let a = run(&running, Some(&last), Some(&o));
    let b = run(&suspended(&running), Some(&last), Some(&o));
    let but_ready = |d: &Decision| -> Vec<Cond> {
        d.conditions
            .iter()
            .filter(|c| c.type_ != CONDITION_READY)
            .cloned()
            .collect()
    };
    assert_eq!(but_ready(&a), but_ready(&b));
    assert_eq!(a.provision, b.provision);
    assert_eq!(a.fallback, b.fallback);
    assert!(
        b.conditions
            .iter()
            .any(|c| c.type_ == CONDITION_DEGRADED && c.status && c.reason == "SlotRetainingWal"),
        "{b:?}"
    );
}
