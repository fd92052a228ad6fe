//! The decide step as a table: observation in, decision out, no client.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentStatus};

use super::*;
use crate::api::OutboxRelay;
use crate::controller::observe::{ChildrenSeen, SecretsSeen};
use crate::controller::status::CONDITION_BROKER_READY;
use crate::postgres::admin::{Facts, PublicationFacts, ServerFacts, SlotFacts, TableFacts};
use crate::spec::parse;

pub(super) fn relay(mode: &str, replicas: i32) -> OutboxRelay {
    serde_yaml::from_str(&format!(
        "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {{name: orders, namespace: shop, uid: u1}}
spec:
  database: {{postgres: {{connectionSecretRef: {{name: db}}}}}}
  mode: {{{mode}: {{}}}}
  broker: {{nats: {{url: \"nats://n:4222\"}}}}
  replicas: {replicas}
"
    ))
    .unwrap()
}

pub(super) fn owner() -> Owner {
    Owner {
        namespace: "shop".into(),
        name: "orders".into(),
        uid: "u1".into(),
    }
}

pub(super) fn secrets_ok() -> SecretsSeen {
    SecretsSeen {
        database: Cond::yes(CONDITION_DATABASE_READY, "SecretFound", ""),
        broker: Cond::yes(CONDITION_BROKER_READY, "SecretsFound", ""),
        problems: Vec::new(),
        versions: Vec::new(),
        finalized: Vec::new(),
    }
}

pub(super) fn facts(
    wal_level: &str,
    publication: Option<Option<String>>,
    slot: bool,
) -> DatabaseSeen {
    let columns = [
        "id",
        "aggregatetype",
        "aggregateid",
        "type",
        "payload",
        "created_at",
        "published_at",
    ]
    .map(str::to_owned)
    .to_vec();
    DatabaseSeen::Seen(Box::new(Facts {
        server: ServerFacts {
            wal_level: wal_level.into(),
            max_replication_slots: 10,
            slots_in_use: 1,
            max_wal_senders: 10,
            replication: true,
            superuser: false,
            user: "app".into(),
            database: "shop".into(),
            can_create: true,
            version_num: 150_000,
            synchronized_standby_slots: String::new(),
            physical_slots: Vec::new(),
        },
        table: TableFacts {
            exists: true,
            columns,
            timestamp_type: None,
            id_column: Some(("bigint".into(), true)),
            order_column: None,
            owned: true,
            missing_privileges: Vec::new(),
        },
        slot: slot.then(|| SlotFacts {
            database: Some("shop".into()),
            plugin: Some("pgoutput".into()),
            slot_type: "logical".into(),
            failover: None,
            retained_wal_bytes: None,
            active: false,
        }),
        publication: publication.map(|comment| PublicationFacts {
            publishes_insert: true,
            has_table: true,
            comment,
            identity: "16391/732;16394/730".into(),
        }),
        unpublished_before_slot: None,
        other_markers: Vec::new(),
        backlog: None,
        archive: None,
    }))
}

pub(super) fn observed(secrets: SecretsSeen, database: DatabaseSeen, available: i32) -> Observed {
    Observed {
        secrets,
        database,
        claim: Claim::Free,
        children: ChildrenSeen {
            deployment: (available >= 0).then(|| Deployment {
                status: Some(DeploymentStatus {
                    available_replicas: Some(available),
                    ..DeploymentStatus::default()
                }),
                ..Deployment::default()
            }),
            ..ChildrenSeen::default()
        },
        monitoring: false,
        fallback: None,
        now: "2026-12-05T10:00:00Z".parse().unwrap(),
        recreate_lost_slot: None,
        cluster: None,
        strimzi: None,
        location: None,
        left_behind_dropped: None,
        connection: None,
    }
}

pub(super) fn slot_status(name: &str) -> SlotStatus {
    SlotStatus {
        name: name.into(),
        publication: Some(name.into()),
        ..SlotStatus::default()
    }
}

/// The status of a slot the decision saw exist.
/// The slot status of an existing slot first seen with the test publication.
fn existing(name: &str) -> SlotStatus {
    SlotStatus {
        existed: true,
        coverage_baseline: Some("16391/732;16394/730".into()),
        ..slot_status(name)
    }
}

pub(super) fn ready(d: &Decision) -> (&str, &str) {
    let c = d
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_READY)
        .unwrap();
    (if c.status { "True" } else { "False" }, c.reason)
}

pub(super) fn run(r: &OutboxRelay, last: Option<&SlotStatus>, o: Option<&Observed>) -> Decision {
    let parsed = parse(r);
    decide(parsed.as_ref(), &owner(), last, o)
}

/// The marker a publication carries once the operator created it and the slot.
pub(super) fn our_marker() -> String {
    crate::postgres::admin::Marker {
        owner: owner(),
        slot: "outbox_shop_orders".into(),
        publication: Origin::Created,
        slot_origin: Origin::Created,
    }
    .to_comment()
}

#[test]
fn create_provisions_publication_then_slot_before_any_child() {
    let o = observed(secrets_ok(), facts("logical", None, false), -1);
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert!(
        matches!(d.provision[0], Action::CreatePublication { .. }),
        "{d:?}"
    );
    assert!(matches!(d.provision[1], Action::CreateSlot { .. }), "{d:?}");
    // Before any child, the snapshot that tells rows before the slot from later ones.
    assert!(!d.apply_children && d.take_snapshot);
    assert_eq!(d.next, Next::Soon);
    // Nothing committed before the slot is left: the relay is applied.
    let last = SlotStatus {
        handover_snapshot: Some("100:100:".into()),
        ..slot_status("outbox_shop_orders")
    };
    let mut database = facts("logical", Some(Some(our_marker())), true);
    if let DatabaseSeen::Seen(f) = &mut database {
        f.unpublished_before_slot = Some(0);
    }
    let o = observed(secrets_ok(), database, -1);
    let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
    assert!(d.provision.is_empty() && d.apply_children, "{d:?}");
    assert_eq!(d.slot, Some(existing("outbox_shop_orders")));
    assert_eq!(ready(&d), ("False", "RelayUnavailable"));
    assert_eq!(d.next, Next::Refresh);
}

#[test]
fn update_with_everything_in_place_runs_no_sql_and_reports_ready() {
    let o = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), true),
        1,
    );
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert!(d.provision.is_empty(), "{:?}", d.provision);
    assert!(d.apply_children);
    assert_eq!(ready(&d), ("True", "RelayAvailable"));
}

fn ready_message(d: &Decision) -> &str {
    &d.conditions
        .iter()
        .find(|c| c.type_ == CONDITION_READY)
        .unwrap()
        .message
}

#[test]
fn ready_says_why_relay_pods_are_down_when_their_kubelet_does() {
    use crate::controller::pods::PodTrouble;
    let trouble = PodTrouble::OomKilled {
        pod: "r-1".into(),
        limit: Some("64Mi".into()),
    };
    let mut o = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), true),
        0,
    );
    o.children.pod_trouble = Some(trouble.clone());
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert_eq!(ready(&d), ("False", "RelayOOMKilled"));
    let message = ready_message(&d);
    assert!(
        message.starts_with("0 of 1 relay pods available; pod r-1"),
        "{message}"
    );
    // Some pods up: Ready, and the message tells of the others.
    let mut some = o.clone();
    some.children.deployment = observed(secrets_ok(), DatabaseSeen::NotLooked, 1)
        .children
        .deployment;
    let d = run(&relay("logTailing", 2), None, Some(&some));
    assert_eq!(ready(&d), ("True", "RelayAvailable"));
    let message = ready_message(&d);
    assert!(
        message.contains("killed for memory at its limit of 64Mi"),
        "{message}"
    );
}

#[test]
fn wal_level_replica_creates_nothing() {
    let o = observed(secrets_ok(), facts("replica", None, false), -1);
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert!(d.provision.is_empty() && !d.apply_children);
    let slot = d
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_SLOT_READY)
        .unwrap();
    assert!(
        !slot.status && slot.message.contains("wal_level"),
        "{slot:?}"
    );
}

#[test]
fn an_invalid_spec_changes_nothing_and_keeps_the_slot_shown() {
    let mut r = relay("logTailing", 1);
    r.spec.ordering.partitions = 0;
    let last = slot_status("outbox_shop_orders");
    let d = run(&r, Some(&last), None);
    assert_eq!(ready(&d), ("False", "InvalidSpec"));
    assert!(d.provision.is_empty() && !d.apply_children);
    assert_eq!(d.slot, Some(last));
    assert_eq!(d.next, Next::AwaitChange);
}

#[test]
fn a_missing_secret_waits_and_keeps_the_slot() {
    let mut secrets = secrets_ok();
    secrets.database = Cond::no(
        CONDITION_DATABASE_READY,
        "SecretNotFound",
        "Secret db not found",
    );
    let o = observed(secrets, DatabaseSeen::NotLooked, 1);
    let last = slot_status("outbox_shop_orders");
    let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
    assert_eq!(ready(&d), ("False", "SecretNotFound"));
    assert!(!d.apply_children);
    assert_eq!(d.slot, Some(last));
    assert_eq!(d.next, Next::SecretRetry);
}

#[test]
fn an_unusable_secret_value_is_an_invalid_spec_retried_soon() {
    let mut secrets = secrets_ok();
    secrets.problems.push(Problem {
        field: "spec.database.postgres.connectionSecretRef".into(),
        message: "Secret db has no key uri".into(),
        fix: "add it".into(),
    });
    let o = observed(secrets, DatabaseSeen::NotLooked, 1);
    let d = run(&relay("polling", 2), None, Some(&o));
    assert_eq!(ready(&d), ("False", "InvalidSpec"));
    assert_eq!(d.next, Next::SecretRetry);
}

#[test]
fn an_unreachable_database_leaves_the_running_relay_alone() {
    let unreachable = DatabaseSeen::Unusable {
        reason: "ConnectionFailed",
        message: "cannot connect".into(),
    };
    let o = observed(secrets_ok(), unreachable, 1);
    let last = slot_status("outbox_shop_orders");
    let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
    assert_eq!(ready(&d), ("False", "ConnectionFailed"));
    assert!(!d.apply_children && d.provision.is_empty());
    assert_eq!(d.slot, Some(last), "the slot stays shown for the finalizer");
}

#[test]
fn polling_needs_no_sql_and_reports_its_pods() {
    let o = observed(secrets_ok(), facts("replica", None, false), 2);
    let d = run(&relay("polling", 2), None, Some(&o));
    assert!(d.provision.is_empty() && d.apply_children);
    assert_eq!(ready(&d), ("True", "RelayAvailable"));
    assert_eq!(d.slot, None);
}

#[test]
fn a_switch_to_polling_keeps_the_old_slot_until_no_pod_tails_then_drops_it() {
    // Rolling out: a log-tailing pod may still stream the slot; keep it (and show it,
    // so deleting the relay meanwhile still drops it).
    let mut o = observed(secrets_ok(), facts("logical", None, false), 2);
    let last = slot_status("outbox_shop_orders");
    let d = run(&relay("polling", 2), Some(&last), Some(&o));
    assert!(d.apply_children);
    assert!(d.provision.is_empty());
    assert_eq!(d.slot, Some(last.clone()));
    // Rolled out: every pod polls. Drop what the operator made, nothing else.
    o.children.rolled_out = true;
    let d = run(&relay("polling", 2), Some(&last), Some(&o));
    assert!(d.apply_children);
    assert_eq!(d.slot, None);
    assert_eq!(
        d.provision,
        vec![Action::DropOwned {
            slot: "outbox_shop_orders".into(),
            publication: "outbox_shop_orders".into(),
            owner: owner(),
        }]
    );
    // A polling relay that never tailed has nothing to drop.
    let d = run(&relay("polling", 2), None, Some(&o));
    assert!(d.provision.is_empty());
}

#[test]
fn a_switch_to_log_tailing_keeps_polling_until_what_the_slot_misses_is_published() {
    let mut database = facts("logical", None, false);
    let mut o = observed(secrets_ok(), database.clone(), 2);
    o.children.runs_polling = true;
    // The slot is created first, the polling pods stay, and a snapshot is asked for.
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert!(matches!(d.provision[1], Action::CreateSlot { .. }), "{d:?}");
    assert!(!d.apply_children && d.take_snapshot);
    assert_eq!(ready(&d), ("False", "SwitchingToLogTailing"));
    assert_eq!(d.next, Next::Soon);
    // Rows committed before the slot are waiting: keep the snapshot, keep polling.
    let last = SlotStatus {
        handover_snapshot: Some("100:110:".into()),
        ..slot_status("outbox_shop_orders")
    };
    if let DatabaseSeen::Seen(f) = &mut database {
        f.unpublished_before_slot = Some(7);
    }
    o.database = database.clone();
    let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
    assert!(!d.apply_children && !d.take_snapshot);
    assert_eq!(d.slot, Some(last.clone()));
    let message = &d.conditions[0].message;
    assert!(
        message.contains("7 rows committed before slot"),
        "{message}"
    );
    // Not countable right now: still waiting.
    if let DatabaseSeen::Seen(f) = &mut database {
        f.unpublished_before_slot = None;
    }
    o.database = database.clone();
    assert!(!run(&relay("logTailing", 1), Some(&last), Some(&o)).apply_children);
    // All published: the log-tailing Deployment is applied and the snapshot forgotten.
    if let DatabaseSeen::Seen(f) = &mut database {
        f.unpublished_before_slot = Some(0);
    }
    o.database = database;
    let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
    assert!(d.apply_children && !d.take_snapshot);
    assert_eq!(d.slot, Some(slot_status("outbox_shop_orders")));
    // Log tailing already running (the slot exists, no polling pods): nothing to do.
    o.children.runs_polling = false;
    o.database = facts("logical", None, true);
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert!(d.apply_children && !d.take_snapshot && !d.backfill);
}

#[test]
fn a_new_slot_back_fills_the_rows_committed_before_it_with_polling_first() {
    // A new relay (or a slot dropped by hand): no slot, no polling pods.
    let mut o = observed(secrets_ok(), facts("logical", None, false), 1);
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert!(matches!(d.provision[1], Action::CreateSlot { .. }), "{d:?}");
    assert!(!d.apply_children && d.take_snapshot && !d.backfill, "{d:?}");
    // From here the slot exists (marked by then; the plan needs no more SQL).
    let mut database = facts("logical", Some(Some(our_marker())), true);
    assert_eq!(ready(&d), ("False", "BackfillingBeforeLogTailing"));
    assert_eq!(d.next, Next::Soon);
    // The table holds rows committed before the slot: the back-fill relay runs.
    let last = SlotStatus {
        handover_snapshot: Some("100:110:".into()),
        ..slot_status("outbox_shop_orders")
    };
    if let DatabaseSeen::Seen(f) = &mut database {
        f.unpublished_before_slot = Some(3);
    }
    o.database = database.clone();
    let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
    assert!(d.apply_children && d.backfill && !d.take_snapshot, "{d:?}");
    assert_eq!(
        d.slot,
        Some(SlotStatus {
            existed: true,
            ..last.clone()
        })
    );
    assert!(d.conditions[0].message.contains("3 rows committed before"));
    // Its pods poll now: the handover waits for them as for a switch from polling.
    o.children.runs_polling = true;
    let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
    assert!(!d.apply_children && !d.backfill);
    assert_eq!(ready(&d), ("False", "SwitchingToLogTailing"));
    // Nothing before the slot (an empty table, or drained): log tailing at once.
    o.children.runs_polling = false;
    if let DatabaseSeen::Seen(f) = &mut database {
        f.unpublished_before_slot = Some(0);
    }
    o.database = database;
    let d = run(&relay("logTailing", 1), Some(&last), Some(&o));
    assert!(d.apply_children && !d.backfill);
    assert_eq!(d.slot, Some(existing("outbox_shop_orders")));
    // The slot exists but no relay ever ran and no snapshot was recorded (taking it
    // failed): a late snapshot, then the same path.
    let o = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), true),
        -1,
    );
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert!(d.take_snapshot && !d.apply_children, "{d:?}");
    // Without deleteAfterPublish the table is no backlog: nothing to back-fill.
    let mut keep = relay("logTailing", 1);
    keep.spec
        .mode
        .log_tailing
        .as_mut()
        .unwrap()
        .delete_after_publish = false;
    let o = observed(secrets_ok(), facts("logical", None, false), 1);
    let d = run(&keep, None, Some(&o));
    assert!(d.apply_children && !d.take_snapshot && !d.backfill);
}

#[test]
fn a_slot_of_another_relay_is_refused_while_it_lives_and_taken_over_after() {
    // The publication was made for another relay (the old name of a renamed one, with
    // the same slotName).
    let old = crate::postgres::admin::Marker {
        owner: Owner {
            name: "old-orders".into(),
            ..owner()
        },
        slot: "outbox_shop_orders".into(),
        publication: Origin::Created,
        slot_origin: Origin::Created,
    };
    let mut o = observed(
        secrets_ok(),
        facts("logical", Some(Some(old.to_comment())), true),
        1,
    );
    // It still exists: nothing is written, the condition names it.
    o.claim = Claim::Held("OutboxRelay shop/old-orders, which exists".into());
    let d = run(&relay("logTailing", 1), None, Some(&o));
    assert_eq!(ready(&d), ("False", "SlotClaimed"));
    assert!(d.provision.is_empty() && !d.apply_children, "{d:?}");
    let slot = d
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_SLOT_READY)
        .unwrap();
    assert!(slot.message.contains("shop/old-orders"), "{}", slot.message);
    // Gone or being deleted: this relay succeeds it, and inherits "created", so
    // deleting this one drops the slot (before, it was recorded as adopted and leaked).
    o.claim = Claim::Released;
    let d = run(&relay("logTailing", 1), None, Some(&o));
    let Action::MarkPublication { sql, .. } = &d.provision[0] else {
        panic!("{d:?}");
    };
    assert!(sql.contains("\"publication\":\"created\""), "{sql}");
    assert!(sql.contains("\"slotOrigin\":\"created\""), "{sql}");
    assert!(d.apply_children);
}

#[test]
fn scaled_to_zero_is_not_ready_on_purpose() {
    let o = observed(secrets_ok(), facts("logical", None, false), 0);
    let d = run(&relay("polling", 0), None, Some(&o));
    assert_eq!(ready(&d), ("False", "ScaledToZero"));
    assert!(d.apply_children);
}

#[test]
fn failed_provisioning_applies_nothing_and_says_why() {
    let o = observed(secrets_ok(), facts("logical", None, false), -1);
    let d = run(&relay("logTailing", 1), None, Some(&o));
    let failed = provisioning_failed(d, None, "permission denied");
    assert_eq!(ready(&failed), ("False", "SlotCreationFailed"));
    assert!(!failed.apply_children && failed.provision.is_empty());
    assert_eq!(failed.slot, None);
}

#[test]
fn delete_drops_the_slot_status_shows_or_the_one_the_spec_names() {
    use crate::controller::decide::deletion::cleanup_target;
    // Log tailing without status yet: the spec's names.
    let fresh = relay("logTailing", 1);
    assert_eq!(
        cleanup_target(&fresh).map(|t| t.slot),
        Some("outbox_shop_orders".to_owned())
    );
    // Polling that once tailed: the slot status still shows.
    let mut switched = relay("polling", 2);
    switched.status = Some(crate::api::OutboxRelayStatus {
        slot: Some(slot_status("outbox_shop_orders")),
        ..Default::default()
    });
    assert_eq!(
        cleanup_target(&switched).map(|t| t.publication),
        Some("outbox_shop_orders".to_owned())
    );
    // Polling that never tailed, and a spec that never parsed: nothing to drop.
    assert!(cleanup_target(&relay("polling", 2)).is_none());
    let mut invalid = relay("polling", 2);
    invalid.spec.ordering.partitions = 0;
    assert!(cleanup_target(&invalid).is_none());
}

mod budget;
mod failover;
mod suspend;
