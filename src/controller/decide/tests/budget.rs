//! The WAL budget, its fall back and return, and CloudNativePG clusters.

use super::*;

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
