use super::*;
use crate::api::OutboxRelayStatus;

fn status(ready: &Cond) -> OutboxRelayStatus {
    serde_json::from_value(serde_json::json!({"conditions": [{
        "type": CONDITION_READY,
        "status": if ready.status { "True" } else { "False" },
        "reason": ready.reason,
        "message": ready.message,
        "lastTransitionTime": "2026-12-04T00:00:00Z"
    }]}))
    .unwrap()
}

/// The note's kind and reason.
fn said(note: Option<Note>) -> Option<(bool, &'static str)> {
    note.map(|n| (n.warning, n.reason))
}

#[test]
fn ready_events_mark_transitions_not_the_start_of_every_relay() {
    let starting = Cond::no(
        CONDITION_READY,
        "RelayUnavailable",
        "0 of 2 relay pods available",
    );
    let up = Cond::yes(
        CONDITION_READY,
        "RelayAvailable",
        "2 of 2 relay pods available",
    );
    let invalid = Cond::no(CONDITION_READY, "InvalidSpec", "spec.table.name is empty");
    // A new relay starting: no Event; a new relay refused: a Warning.
    assert_eq!(
        ready_transition(None, std::slice::from_ref(&starting)),
        None
    );
    assert_eq!(
        said(ready_transition(None, std::slice::from_ref(&invalid))),
        Some((true, "InvalidSpec"))
    );
    // Up, and down again: both are Events; no change: none.
    assert_eq!(
        said(ready_transition(
            Some(&status(&starting)),
            std::slice::from_ref(&up)
        )),
        Some((false, "RelayAvailable"))
    );
    assert_eq!(
        said(ready_transition(
            Some(&status(&up)),
            std::slice::from_ref(&starting)
        )),
        Some((false, "RelayUnavailable"))
    );
    assert_eq!(
        ready_transition(Some(&status(&up)), std::slice::from_ref(&up)),
        None
    );
}

/// A log-tailing relay that deletes what it publishes (so it has a back-fill).
fn tailing() -> ValidRelay {
    let mut relay = super::super::tests::relay("logTailing", 1);
    relay.spec.mode = serde_yaml::from_str("{logTailing: {deleteAfterPublish: true}}").unwrap();
    crate::spec::parse(&relay).unwrap()
}

/// A decision that changes nothing.
fn nothing() -> Decision {
    Decision {
        conditions: vec![Cond::yes(CONDITION_READY, "RelayAvailable", "")],
        provision: Vec::new(),
        apply_children: true,
        slot: Some(super::super::tests::slot_status("s")),
        take_snapshot: false,
        backfill: false,
        fallback: FallbackWrite::Keep,
        exclusive_rollout: false,
        events: Vec::new(),
        next: Next::Refresh,
    }
}

fn observed() -> Observed {
    super::super::tests::observed(
        super::super::tests::secrets_ok(),
        super::super::tests::facts("logical", Some(None), true),
        1,
    )
}

/// Plans `decision` for the tailing relay.
fn planned(
    decision: Decision,
    observed: Option<&Observed>,
    last_slot: Option<&SlotStatus>,
    recorded_fallback: Option<&FallbackStatus>,
    guard: &Guard,
) -> Effects {
    let valid = tailing();
    plan(
        decision,
        &Seen {
            parsed: Ok(&valid),
            last_slot,
            recorded_fallback,
            observed,
            guard,
        },
    )
}

fn reasons(notes: &[Note]) -> Vec<&'static str> {
    notes.iter().map(|n| n.reason).collect()
}

fn names(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn secrets_are_guarded_while_a_slot_is_wanted_restored_and_released() {
    let valid = tailing();
    let polling = crate::spec::parse(&super::super::tests::relay("polling", 1)).unwrap();
    let slot = super::super::tests::slot_status("s");
    // Polling, no slot ever: nothing guarded.
    let g = guard(Ok(&polling), None, names(&["db"]));
    assert!(g.protected.is_empty() && g.protect_now.is_empty(), "{g:?}");
    // Polling, but status still shows a slot (it is dropped on delete): guarded.
    assert_eq!(
        guard(Ok(&polling), Some(&slot), names(&["db"])).protected,
        names(&["db"])
    );
    // Log tailing: guarded now, once; then only as recorded.
    let g = guard(Ok(&valid), None, names(&["db"]));
    assert_eq!(g.protect_now, names(&["db"]));
    let recorded = SlotStatus {
        protected_secrets: names(&["db"]),
        ..slot.clone()
    };
    let g = guard(Ok(&valid), Some(&recorded), names(&["db"]));
    assert!(g.protect_now.is_empty(), "{g:?}");
    // A Secret whose finalizer was removed by hand gets it back; one no longer named
    // (recorded, or still carrying the finalizer) is released after status is written.
    let g = Guard {
        protected: names(&["db"]),
        recorded: names(&["db", "old-ca"]),
        protect_now: Vec::new(),
    };
    let mut o = observed();
    o.secrets.finalized = names(&["stray"]);
    let e = planned(nothing(), Some(&o), Some(&recorded), None, &g);
    assert_eq!(e.restore, names(&["db"]));
    assert_eq!(e.release, names(&["old-ca", "stray"]));
    assert_eq!(e.slot.unwrap().protected_secrets, names(&["db"]));
    // Not observed: nothing is restored (the finalizers were not read).
    let e = planned(nothing(), None, Some(&recorded), None, &g);
    assert!(e.restore.is_empty());
}

#[test]
fn sql_events_wait_for_the_sql_and_name_what_it_dropped() {
    let g = Guard::default();
    let owner = super::super::tests::owner();
    let mut d = nothing();
    d.provision = vec![Action::DropOwned {
        slot: "s".into(),
        publication: "p".into(),
        owner: owner.clone(),
    }];
    let e = planned(d, Some(&observed()), None, None, &g);
    assert_eq!(reasons(&e.provisioned), vec!["SlotDropped"]);
    assert!(
        e.provisioned[0]
            .message
            .contains("dropped replication slot s and publication p"),
        "{:?}",
        e.provisioned
    );
    // Dropped past the WAL budget while falling back: said with the WAL it held, and
    // marked in the fall back's status once the SQL ran.
    let mut d = nothing();
    d.provision = vec![Action::DropSlotOverBudget {
        slot: "s".into(),
        publication: "p".into(),
        owner,
    }];
    d.fallback = FallbackWrite::Set(FallbackStatus {
        since: "2026-12-07T00:00:00Z".into(),
        retained_wal_bytes: 123,
        slot_dropped: false,
    });
    let recorded = FallbackStatus::default();
    let e = planned(d.clone(), Some(&observed()), None, Some(&recorded), &g);
    assert_eq!(reasons(&e.provisioned), vec!["SlotDroppedOverBudget"]);
    assert!(e.provisioned[0].message.contains("retained 123 bytes"));
    assert!(!e.fallback.as_ref().unwrap().slot_dropped);
    assert!(provisioned(e).fallback.unwrap().slot_dropped);
    // Fall back kept as it was: the drop is not marked.
    d.fallback = FallbackWrite::Keep;
    let e = provisioned(planned(d, Some(&observed()), None, Some(&recorded), &g));
    assert!(e.provisioned.is_empty() && !e.fallback.unwrap().slot_dropped);
}

#[test]
fn a_failed_sql_plans_again_from_its_decision() {
    let g = Guard {
        protected: names(&["db"]),
        ..Guard::default()
    };
    let last = super::super::tests::slot_status("old");
    let mut d = nothing();
    d.backfill = true;
    d.take_snapshot = true;
    d.events = vec![Note::normal("SlotLost", "x".into())];
    d.fallback = FallbackWrite::Set(FallbackStatus::default());
    d.provision = vec![Action::DropOwned {
        slot: "s".into(),
        publication: "p".into(),
        owner: super::super::tests::owner(),
    }];
    let failed = super::super::provisioning_failed(d, Some(&last), "permission denied");
    let e = planned(failed, Some(&observed()), Some(&last), None, &g);
    // Nothing else is applied; the switch is still said and counted; the slot shows
    // as before, still guarded.
    assert_eq!(e.children, Children::Keep);
    assert!(e.provisioned.is_empty() && e.snapshot.is_none() && e.provision.is_empty());
    assert_eq!(reasons(&e.notes), vec!["FellBackToPolling"]);
    assert_eq!(e.switched, Some("polling"));
    let slot = e.slot.unwrap();
    assert_eq!(
        (slot.name.as_str(), slot.protected_secrets),
        ("old", names(&["db"]))
    );
    assert_eq!(e.conditions[0].reason, "SlotCreationFailed");
    assert_eq!(e.next, Next::Refresh);
}

#[test]
fn the_fall_back_and_the_return_are_said_once_and_counted() {
    let g = Guard::default();
    let since = FallbackStatus {
        retained_wal_bytes: 7,
        ..FallbackStatus::default()
    };
    let with = |fallback| Decision {
        fallback,
        ..nothing()
    };
    let o = observed();
    let e = planned(
        with(FallbackWrite::Set(since.clone())),
        Some(&o),
        None,
        None,
        &g,
    );
    assert_eq!(
        (reasons(&e.notes), e.switched),
        (vec!["FellBackToPolling"], Some("polling"))
    );
    assert!(e.notes[0].warning && e.notes[0].message.contains("retained 7 bytes"));
    assert_eq!(e.fallback, Some(since.clone()));
    // Already falling back: nothing new.
    let e = planned(
        with(FallbackWrite::Set(since.clone())),
        Some(&o),
        None,
        Some(&since),
        &g,
    );
    assert!(e.notes.is_empty() && e.switched.is_none());
    // The return (this spec has no budget: the field was removed).
    let e = planned(with(FallbackWrite::Clear), Some(&o), None, Some(&since), &g);
    assert_eq!(
        (reasons(&e.notes), e.switched),
        (vec!["ReturningToLogTailing"], Some("logTailing"))
    );
    assert!(
        e.notes[0]
            .message
            .starts_with("spec.mode.logTailing.maxRetainedWal was removed")
    );
    assert_eq!(e.fallback, None);
    // Never fell back: nothing to say; kept: status keeps what it showed.
    assert!(
        planned(with(FallbackWrite::Clear), Some(&o), None, None, &g)
            .notes
            .is_empty()
    );
    assert_eq!(
        planned(with(FallbackWrite::Keep), Some(&o), None, Some(&since), &g).fallback,
        Some(since)
    );
}

#[test]
fn a_back_fill_is_announced_unless_the_relay_falls_back() {
    let g = Guard::default();
    let o = observed();
    let mut d = nothing();
    d.backfill = true;
    d.events = vec![Note::warning("SlotLost", "x".into())];
    let e = planned(d.clone(), Some(&o), None, None, &g);
    assert_eq!(e.children, Children::Backfill);
    // The back-fill's note first, then the decision's own.
    assert_eq!(
        reasons(&e.notes),
        vec!["BackfillingBeforeLogTailing", "SlotLost"]
    );
    d.fallback = FallbackWrite::Set(FallbackStatus::default());
    let recorded = FallbackStatus::default();
    let e = planned(d.clone(), Some(&o), None, Some(&recorded), &g);
    assert_eq!(
        (e.children, reasons(&e.notes)),
        (Children::Backfill, vec!["SlotLost"])
    );
    // Not observed: no back-fill children can be built.
    d.apply_children = true;
    assert_eq!(planned(d, None, None, None, &g).children, Children::Relay);
}

#[test]
fn the_hand_over_is_said_when_the_snapshot_is_taken_and_when_log_tailing_starts() {
    let g = Guard::default();
    let mut o = observed();
    o.children.runs_polling = true;
    let mut d = nothing();
    d.apply_children = false;
    d.take_snapshot = true;
    let e = planned(d.clone(), Some(&o), None, None, &g);
    let Some(Some(note)) = &e.snapshot else {
        panic!("a snapshot with its Event: {e:?}");
    };
    assert_eq!(note.reason, "SwitchingToLogTailing");
    assert_eq!(
        snapshot_taken(e.clone(), Some("100:100:".into()))
            .slot
            .unwrap()
            .handover_snapshot
            .as_deref(),
        Some("100:100:")
    );
    // A snapshot that could not be read is neither recorded nor announced.
    let failed = snapshot_taken(e, None);
    assert!(failed.snapshot.is_none() && failed.slot.unwrap().handover_snapshot.is_none());
    // Not switching from polling: the snapshot goes without an Event.
    o.children.runs_polling = false;
    assert_eq!(planned(d, Some(&o), None, None, &g).snapshot, Some(None));
    // The snapshot recorded and the log-tailing children applied over polling ones.
    o.children.runs_polling = true;
    let last = SlotStatus {
        handover_snapshot: Some("100:100:".into()),
        ..super::super::tests::slot_status("s")
    };
    let e = planned(nothing(), Some(&o), Some(&last), None, &g);
    assert_eq!(reasons(&e.applied), vec!["LogTailingStarted"]);
    let e = planned(
        Decision {
            apply_children: false,
            ..nothing()
        },
        Some(&o),
        Some(&last),
        None,
        &g,
    );
    assert!(e.applied.is_empty());
}
