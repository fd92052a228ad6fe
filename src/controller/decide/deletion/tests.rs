//! The finalizer as a table: what it has seen in, its next step out.

use super::*;
use crate::api::SlotLeftBehind;

/// A log-tailing relay's finalizer with slot `s` in status (made in `db:5432/shop`),
/// its pods gone, connected to `db:5432/shop`, no successor.
fn connected() -> Seen {
    Seen {
        target: Some(SlotPlan {
            slot: "s".into(),
            publication: "p".into(),
            delete_after_publish: false,
        }),
        slot: Some(SlotStatus {
            location: Some("db:5432/shop".into()),
            protected_secrets: vec!["db".into(), "ca".into()],
            ..super::super::tests::slot_status("s")
        }),
        secrets: vec!["db".into(), "ca".into(), "db".into()],
        secret_name: "Secret db key url".into(),
        running: Some(Running {
            deployment: false,
            pods: 0,
        }),
        reach: Some(Reach::Read {
            here: "db:5432/shop".into(),
            connected: Ok(()),
        }),
        ..Seen::default()
    }
}

fn reach(connected: Result<(), Unreachable>) -> Option<Reach> {
    Some(Reach::Read {
        here: "db:5432/shop".into(),
        connected,
    })
}

/// The reason (and whether a Warning) of a finished step, or the message of a retry.
fn outcome(step: Step) -> (String, String) {
    match step {
        Step::Done(Some(note), _) => (
            format!("{}{}", if note.warning { "!" } else { "" }, note.reason),
            note.message,
        ),
        Step::Done(None, _) => ("done".into(), String::new()),
        Step::Retry(message) => ("retry".into(), message),
        Step::Wait(message) => ("wait".into(), message),
        other => (format!("{other:?}"), String::new()),
    }
}

fn dropped(slot: bool, publication: bool) -> Dropped {
    Dropped {
        slot,
        terminated_walsender: false,
        publication,
        kept: Vec::new(),
    }
}

#[test]
fn the_finalizer_looks_only_as_far_as_it_must() {
    let owner = |name: &str| Owner {
        namespace: "shop".into(),
        name: name.into(),
        uid: "u2".into(),
    };
    type Case = (&'static str, fn(&mut Seen), &'static str, &'static str);
    let cases: Vec<Case> = vec![
        (
            "polling: nothing to look after",
            |s| s.target = None,
            "done",
            "",
        ),
        (
            "pods not looked at",
            |s| s.running = None,
            "Look(Running)",
            "",
        ),
        (
            "the relay still runs",
            |s| {
                s.running = Some(Running {
                    deployment: true,
                    pods: 2,
                })
            },
            "StopRelay",
            "",
        ),
        (
            "its pods are stopping",
            |s| {
                s.running = Some(Running {
                    deployment: false,
                    pods: 2,
                })
            },
            "wait",
            "waiting for 2 relay pod(s) to stop",
        ),
        (
            "abandoned: no connection needed",
            |s| {
                s.abandon = true;
                s.reach = None;
            },
            "!SlotAbandoned",
            "left behind as annotation outbox.dev/abandon-slot asks",
        ),
        (
            "a Cluster not looked at",
            |s| {
                s.cluster = Some("pg".into());
                s.reach = None;
            },
            "Look(Cluster)",
            "",
        ),
        (
            "the Cluster is gone",
            |s| {
                s.cluster = Some("pg".into());
                s.cluster_gone = Some(true);
            },
            "DatabaseGone",
            "CloudNativePG Cluster pg is gone",
        ),
        (
            "the Cluster is there: connect",
            |s| {
                s.cluster = Some("pg".into());
                s.cluster_gone = Some(false);
                s.reach = None;
            },
            "Look(Reach)",
            "",
        ),
        (
            "the Secret is gone, no slot ever shown",
            |s| {
                s.slot = None;
                s.reach = Some(Reach::SecretMissing);
            },
            "Deleted",
            "Secret db key url is gone and status shows no replication slot",
        ),
        (
            "the Secret is gone, the slot is shown",
            |s| s.reach = Some(Reach::SecretMissing),
            "retry",
            "restore the Secret, or annotate the OutboxRelay outbox.dev/abandon-slot=true",
        ),
        (
            "the Secret leads elsewhere",
            |s| {
                s.reach = Some(Reach::Read {
                    here: "other:5432/shop".into(),
                    connected: Err(Unreachable::Gone("3D000".into())),
                })
            },
            "retry",
            "lives in db:5432/shop, which the connection Secret no longer reaches",
        ),
        (
            "the database is gone",
            |s| s.reach = reach(Err(Unreachable::Gone("3D000".into()))),
            "DatabaseGone",
            "the database is gone (3D000)",
        ),
        (
            "no usable URL, no slot ever shown",
            |s| {
                s.slot = None;
                s.reach = reach(Err(Unreachable::BadUrl("bad".into())));
            },
            "Deleted",
            "holds no usable URL and status shows no replication slot",
        ),
        (
            "no usable URL, the slot is shown",
            |s| s.reach = reach(Err(Unreachable::BadUrl("bad".into()))),
            "retry",
            "cannot connect to drop replication slot s: bad",
        ),
        (
            "unreachable",
            |s| s.reach = reach(Err(Unreachable::Failed("timed out".into()))),
            "retry",
            "cannot connect to drop replication slot s: timed out",
        ),
        ("connected: who takes over?", |_| {}, "Look(Successor)", ""),
        (
            "no successor: drop",
            |s| s.successor = Some(None),
            "Drop",
            "",
        ),
        (
            "dropped both",
            |s| {
                s.successor = Some(None);
                s.dropped = Some(Ok(dropped(true, true)));
            },
            "SlotDropped",
            "dropped replication slot s; dropped publication p",
        ),
        (
            "dropped, one left behind elsewhere",
            |s| {
                s.successor = Some(None);
                s.dropped = Some(Ok(dropped(true, true)));
                if let Some(slot) = s.slot.as_mut() {
                    slot.left_behind = Some(SlotLeftBehind {
                        slot: "s".into(),
                        location: "old:5432/shop".into(),
                        detected_at: "2026-12-07T00:00:00Z".into(),
                    });
                }
            },
            "!SlotDropped",
            "replication slot s in old:5432/shop, left behind",
        ),
        (
            "nothing left to drop",
            |s| {
                s.successor = Some(None);
                s.dropped = Some(Ok(dropped(false, false)));
            },
            "Deleted",
            "no replication slot or publication of this relay was left to drop",
        ),
        (
            "the drop failed",
            |s| {
                s.successor = Some(None);
                s.dropped = Some(Err("lock timeout".into()));
            },
            "retry",
            "dropping replication slot s failed: lock timeout",
        ),
        (
            "handed over",
            |s| {
                s.successor = Some(Some(Owner {
                    namespace: "shop".into(),
                    name: "orders-v2".into(),
                    uid: "u2".into(),
                }));
                s.handed_over = Some(Ok(true));
            },
            "SlotHandedOver",
            "handed over to OutboxRelay shop/orders-v2",
        ),
        (
            "not ours to hand over: drop",
            |s| {
                s.successor = Some(Some(Owner {
                    namespace: "shop".into(),
                    name: "orders-v2".into(),
                    uid: "u2".into(),
                }));
                s.handed_over = Some(Ok(false));
            },
            "Drop",
            "",
        ),
        (
            "the hand-over failed",
            |s| {
                s.successor = Some(Some(Owner {
                    namespace: "shop".into(),
                    name: "orders-v2".into(),
                    uid: "u2".into(),
                }));
                s.handed_over = Some(Err("marker changed".into()));
            },
            "retry",
            "handing replication slot s over to OutboxRelay shop/orders-v2 failed: marker changed",
        ),
    ];
    for (name, change, reason, words) in cases {
        let mut seen = connected();
        change(&mut seen);
        let (got, message) = outcome(next(&seen));
        assert_eq!(got, reason, "{name}: {message}");
        assert!(message.contains(words), "{name}: {message}");
    }
    // A successor found: handed over, to it.
    let mut seen = connected();
    seen.successor = Some(Some(owner("orders-v2")));
    assert_eq!(next(&seen), Step::HandOver(owner("orders-v2")));
}

#[test]
fn a_finished_finalizer_releases_every_secret_of_the_relay_once() {
    let mut seen = connected();
    seen.successor = Some(None);
    seen.dropped = Some(Ok(Dropped {
        slot: true,
        terminated_walsender: true,
        publication: false,
        kept: vec!["publication p".into()],
    }));
    let Step::Done(Some(note), secrets) = next(&seen) else {
        panic!("done");
    };
    assert_eq!(secrets, vec!["ca".to_owned(), "db".to_owned()]);
    assert_eq!(
        note.message,
        "dropped replication slot s (terminated the walsender still streaming it); kept publication p (not created by the operator)"
    );
    // Nothing to look after: released all the same.
    seen.target = None;
    assert_eq!(
        next(&seen),
        Step::Done(None, vec!["ca".to_owned(), "db".to_owned()])
    );
}
