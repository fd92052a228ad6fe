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

fn budgeted(max: &str, return_after: &str) -> OutboxRelay {
    let mut r = relay("logTailing", 1);
    let lt = r.spec.mode.log_tailing.as_mut().unwrap();
    lt.max_retained_wal = Some(max.into());
    lt.return_after = Some(return_after.into());
    r
}

fn with_slot(database: &mut DatabaseSeen, retained: Option<i64>) {
    if let DatabaseSeen::Seen(f) = database {
        f.slot = retained.map(|r| SlotFacts {
            database: Some("shop".into()),
            plugin: Some("pgoutput".into()),
            slot_type: "logical".into(),
            failover: None,
            retained_wal_bytes: Some(r),
            active: false,
        });
    }
}

fn cond<'a>(d: &'a Decision, type_: &str) -> (&'a str, &'a str) {
    let c = d
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} in {d:?}"));
    (if c.status { "True" } else { "False" }, c.reason)
}

#[test]
fn past_its_wal_budget_a_relay_polls_drops_its_slot_and_returns_once_drained() {
    let r = budgeted("8Mi", "1m");
    let last = slot_status("outbox_shop_orders");
    let mut database = facts("logical", Some(Some(our_marker())), true);
    // Within the budget: log tailing as usual, the condition says what would happen.
    with_slot(&mut database, Some(8 << 20));
    let mut o = observed(secrets_ok(), database.clone(), 1);
    let d = run(&r, Some(&last), Some(&o));
    assert!(
        d.apply_children && !d.backfill && d.provision.is_empty(),
        "{d:?}"
    );
    assert_eq!(d.fallback, FallbackWrite::Clear);
    assert_eq!(
        cond(&d, CONDITION_POLLING_FALLBACK),
        ("False", "WithinBudget")
    );

    // Past it: the polling relay is applied; the slot stays while a log-tailing pod
    // may still stream it.
    with_slot(&mut database, Some((8 << 20) + 1));
    o.database = database.clone();
    let d = run(&r, Some(&last), Some(&o));
    let FallbackWrite::Set(fb) = &d.fallback else {
        panic!("{d:?}")
    };
    assert_eq!(fb.since, "2026-12-05T10:00:00Z");
    assert_eq!(fb.retained_wal_bytes, (8 << 20) + 1);
    assert!(!fb.slot_dropped);
    assert!(
        d.apply_children && d.backfill && d.provision.is_empty(),
        "{d:?}"
    );
    assert_eq!(
        cond(&d, CONDITION_POLLING_FALLBACK),
        ("True", "WalBudgetExceeded")
    );
    assert_eq!(cond(&d, CONDITION_DEGRADED), ("True", "FellBackToPolling"));
    assert_eq!(
        cond(&d, CONDITION_SLOT_READY),
        ("False", "DroppingOverBudget")
    );
    assert_eq!(ready(&d), ("True", "RelayAvailable"));
    assert_eq!(d.next, Next::Soon);
    assert_eq!(
        d.slot,
        Some(last.clone()),
        "the names stay for the finalizer"
    );

    // Recorded; the polling pods run but the rollout is not complete: still no drop.
    o.fallback = Some(fb.clone());
    o.children.runs_polling = true;
    let d = run(&r, Some(&last), Some(&o));
    assert!(d.provision.is_empty(), "{d:?}");
    assert_eq!(d.fallback, FallbackWrite::Set(fb.clone()), "since is kept");
    // The rollout is complete, but a terminating log-tailing pod still streams the
    // slot: not yet.
    o.children.settled = true;
    let mut streamed = database.clone();
    if let DatabaseSeen::Seen(f) = &mut streamed {
        f.slot.as_mut().unwrap().active = true;
    }
    let mut s = o.clone();
    s.database = streamed;
    let d = run(&r, Some(&last), Some(&s));
    assert!(d.provision.is_empty(), "{d:?}");
    // Every pod polls and nothing streams: the slot is dropped (only it; the
    // publication stays).
    let d = run(&r, Some(&last), Some(&o));
    assert_eq!(
        d.provision,
        vec![Action::DropSlotOverBudget {
            slot: "outbox_shop_orders".into(),
            publication: "outbox_shop_orders".into(),
            owner: owner(),
        }]
    );

    // Slot gone, but returnAfter has not passed: keep polling, create nothing.
    with_slot(&mut database, None);
    if let DatabaseSeen::Seen(f) = &mut database {
        f.backlog = Some(crate::postgres::admin::BacklogFacts {
            rows: 3,
            oldest_age_seconds: Some(1),
        });
    }
    o.database = database.clone();
    let dropped = FallbackStatus {
        slot_dropped: true,
        ..fb.clone()
    };
    o.fallback = Some(dropped.clone());
    o.now = "2026-12-05T10:00:59Z".parse().unwrap();
    let d = run(&r, Some(&last), Some(&o));
    assert!(d.provision.is_empty() && d.backfill, "{d:?}");
    assert_eq!(d.fallback, FallbackWrite::Set(dropped.clone()));
    assert_eq!(
        cond(&d, CONDITION_SLOT_READY),
        ("False", "DroppedOverBudget")
    );
    assert_eq!(d.next, Next::Refresh);

    // Time has passed, but rows older than the drained age wait (the broker is down).
    o.now = "2026-12-05T10:05:00Z".parse().unwrap();
    if let DatabaseSeen::Seen(f) = &mut database {
        f.backlog = Some(crate::postgres::admin::BacklogFacts {
            rows: 20_000,
            oldest_age_seconds: Some(DRAINED_AGE_SECONDS + 1),
        });
    }
    o.database = database.clone();
    assert!(matches!(
        run(&r, Some(&last), Some(&o)).fallback,
        FallbackWrite::Set(_)
    ));
    // A short outage: the rows are young, but some were committed before the fall
    // back (6 s old, fell back 5 s ago): the stuck relay's rows still wait.
    let quick = budgeted("8Mi", "1s");
    let mut q = o.clone();
    q.now = "2026-12-05T10:00:05Z".parse().unwrap();
    if let DatabaseSeen::Seen(f) = &mut q.database {
        f.backlog = Some(crate::postgres::admin::BacklogFacts {
            rows: 20,
            oldest_age_seconds: Some(6),
        });
    }
    assert!(matches!(
        run(&quick, Some(&last), Some(&q)).fallback,
        FallbackWrite::Set(_)
    ));
    // Only rows from after it wait: the broker takes events again.
    if let DatabaseSeen::Seen(f) = &mut q.database {
        f.backlog = Some(crate::postgres::admin::BacklogFacts {
            rows: 2_000,
            oldest_age_seconds: Some(4),
        });
    }
    assert_eq!(
        run(&quick, Some(&last), Some(&q)).fallback,
        FallbackWrite::Clear
    );
    // Not measured: no return either.
    if let DatabaseSeen::Seen(f) = &mut database {
        f.backlog = None;
    }
    o.database = database.clone();
    assert!(matches!(
        run(&r, Some(&last), Some(&o)).fallback,
        FallbackWrite::Set(_)
    ));

    // Drained: the return is the switch from polling, slot first, polling pods kept.
    if let DatabaseSeen::Seen(f) = &mut database {
        f.backlog = Some(crate::postgres::admin::BacklogFacts {
            rows: 40,
            oldest_age_seconds: Some(DRAINED_AGE_SECONDS),
        });
    }
    o.database = database;
    let d = run(&r, Some(&last), Some(&o));
    assert_eq!(d.fallback, FallbackWrite::Clear);
    assert!(
        matches!(d.provision.last(), Some(Action::CreateSlot { .. })),
        "{d:?}"
    );
    assert!(!d.apply_children && d.take_snapshot);
    assert_eq!(ready(&d), ("False", "SwitchingToLogTailing"));
}

#[test]
fn the_budget_is_not_checked_without_a_reading_and_a_missing_budget_returns_at_once() {
    // No reading of the slot (a standby, a slot without WAL reserved): no fall back.
    let r = budgeted("1Mi", "1m");
    let database = facts("logical", Some(Some(our_marker())), true);
    let o = observed(secrets_ok(), database, 1);
    let d = run(&r, Some(&slot_status("outbox_shop_orders")), Some(&o));
    assert_eq!(d.fallback, FallbackWrite::Clear);
    // Falling back, and the budget removed from the spec: back to log tailing now.
    let mut o = observed(
        secrets_ok(),
        facts("logical", Some(Some(our_marker())), false),
        1,
    );
    o.children.runs_polling = true;
    o.fallback = Some(FallbackStatus {
        since: "2026-12-05T09:59:00Z".into(),
        retained_wal_bytes: 1 << 21,
        slot_dropped: true,
    });
    let d = run(
        &relay("logTailing", 1),
        Some(&slot_status("outbox_shop_orders")),
        Some(&o),
    );
    assert_eq!(d.fallback, FallbackWrite::Clear);
    assert!(d.take_snapshot, "{d:?}");
    // An unreachable database keeps what status recorded.
    let mut o = observed(
        secrets_ok(),
        DatabaseSeen::Unusable {
            reason: "ConnectionFailed",
            message: "refused".into(),
        },
        1,
    );
    o.fallback = Some(FallbackStatus::default());
    assert_eq!(run(&r, None, Some(&o)).fallback, FallbackWrite::Keep);
}

#[test]
fn bytes_read_as_people_write_them() {
    assert_eq!(bytes_for_people(512), "512 B");
    assert_eq!(bytes_for_people(8 << 20), "8.0 MiB");
    assert_eq!(bytes_for_people(3 << 29), "1.5 GiB");
}

#[test]
fn a_cloudnativepg_cluster_is_checked_before_its_secrets_and_for_slot_sync() {
    let mut r = relay("logTailing", 1);
    r.spec.database.postgres = None;
    r.spec.database.database_ref = Some(crate::api::DatabaseRef {
        kind: crate::api::DatabaseRefKind::Cluster,
        name: "pg".into(),
        secret_name: None,
        user_secret_name: None,
        database: None,
        ca_secret_name: None,
    });
    // Missing: said before anything else, even though its Secrets are missing too.
    let mut missing_secret = secrets_ok();
    missing_secret.database = Cond::no(CONDITION_DATABASE_READY, "SecretNotFound", "pg-app");
    let mut o = observed(missing_secret, DatabaseSeen::NotLooked, -1);
    o.cluster = Some(crate::cnpg::ClusterSeen::Missing);
    let d = run(&r, None, Some(&o));
    assert_eq!(ready(&d), ("False", "ClusterNotFound"));
    assert!(!d.apply_children && d.provision.is_empty());
    // Found, on PostgreSQL 18, without logical slot sync: failover is not protected.
    let mut database = facts("logical", Some(Some(our_marker())), true);
    if let DatabaseSeen::Seen(f) = &mut database {
        f.server.version_num = 180_000;
    }
    let mut o = observed(secrets_ok(), database, 1);
    let cluster = |sync: bool| crate::cnpg::ClusterSeen::Found {
        facts: crate::cnpg::ClusterFacts {
            app_secret: "pg-app".into(),
            ca_secret: "pg-ca".into(),
            synchronizes_logical_slots: sync,
            instances: 3,
            ..crate::cnpg::ClusterFacts::default()
        },
        rw_service: true,
    };
    o.cluster = Some(cluster(false));
    let d = run(&r, Some(&slot_status("outbox_shop_orders")), Some(&o));
    assert_eq!(ready(&d), ("True", "RelayAvailable"));
    assert_eq!(
        cond(&d, CONDITION_FAILOVER_READY),
        ("False", "ClusterSlotSyncOff")
    );
    // With it, the primary's own settings decide as for any server.
    o.cluster = Some(cluster(true));
    let d = run(&r, Some(&slot_status("outbox_shop_orders")), Some(&o));
    assert_ne!(cond(&d, CONDITION_FAILOVER_READY).1, "ClusterSlotSyncOff");
}

#[test]
fn a_budget_on_someone_elses_publication_does_not_apply_and_marks_first() {
    let r = budgeted("1Mi", "1m");
    // A publication with a comment of its own: never the operator's to drop.
    let mut database = facts("logical", Some(Some("owned by the DBA".into())), true);
    with_slot(&mut database, Some(2 << 20));
    let o = observed(secrets_ok(), database, 1);
    let d = run(&r, Some(&slot_status("outbox_shop_orders")), Some(&o));
    assert_eq!(d.fallback, FallbackWrite::Clear, "{d:?}");
    assert_eq!(
        cond(&d, CONDITION_POLLING_FALLBACK),
        ("False", "BudgetNotApplicable")
    );
    // Over budget on its first pass with an unmarked publication: the marker is
    // written before the slot is dropped (the drop checks it).
    let mut database = facts("logical", Some(None), true);
    with_slot(&mut database, Some(2 << 20));
    let mut o = observed(secrets_ok(), database, 1);
    o.children.runs_polling = true;
    o.children.settled = true;
    let d = run(&r, None, Some(&o));
    assert!(matches!(d.fallback, FallbackWrite::Set(_)), "{d:?}");
    assert!(
        matches!(d.provision.first(), Some(Action::MarkPublication { .. })),
        "{:?}",
        d.provision
    );
    assert!(matches!(
        d.provision.last(),
        Some(Action::DropSlotOverBudget { .. })
    ));
}
