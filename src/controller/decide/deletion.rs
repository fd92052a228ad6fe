//! The finalizer's decisions, one step at a time: what it has seen goes in, the next
//! thing to look at or to do comes out, with the Event's wording. Looking stops as soon
//! as the answer is known (an abandoned slot needs no connection), so each observation
//! is one more input: `apply::deletion` looks, acts and asks again until a step ends
//! the pass. No client, no clock.

use super::Note;
use crate::api::{OutboxRelay, SlotStatus};
use crate::postgres::admin::{Dropped, Owner, Plan, SlotPlan};

/// The annotation that lets a relay go while its slot cannot be dropped (the database
/// host is gone for good): the slot and publication are left behind with a Warning.
pub const ABANDON_SLOT_ANNOTATION: &str = "outbox.dev/abandon-slot";

/// The relay's pods, as the finalizer saw them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::controller) struct Running {
    /// Its Deployment exists, is the relay's own and is not being deleted.
    pub deployment: bool,
    /// Pods of the relay left.
    pub pods: usize,
}

/// Why the finalizer could not connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::controller) enum Unreachable {
    /// The database does not exist (any more).
    Gone(String),
    /// The Secret holds no usable URL.
    BadUrl(String),
    /// Anything else: the host, the network, authentication.
    Failed(String),
}

/// How the finalizer reached the database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::controller) enum Reach {
    /// The Secret (or a CA or client certificate Secret it needs) is gone or empty.
    SecretMissing,
    /// The Secret leads to `here` (`host:port/database`); connected, or why not.
    Read {
        here: String,
        connected: Result<(), Unreachable>,
    },
}

/// What the finalizer has seen so far; `None`: not looked at yet.
#[derive(Clone, Debug, Default, PartialEq)]
pub(in crate::controller) struct Seen {
    /// The slot and publication to look after (see [`cleanup_target`]).
    pub target: Option<SlotPlan>,
    /// The relay carries [`ABANDON_SLOT_ANNOTATION`].
    pub abandon: bool,
    /// The slot as status shows it.
    pub slot: Option<SlotStatus>,
    /// The relay's Secrets to release once done (those the spec names and those status
    /// records as guarded).
    pub secrets: Vec<String>,
    /// Where the connection URL comes from, for messages (`Secret x key y`).
    pub secret_name: String,
    /// The CloudNativePG Cluster the relay names.
    pub cluster: Option<String>,
    pub running: Option<Running>,
    /// Whether that Cluster is gone or being deleted.
    pub cluster_gone: Option<bool>,
    pub reach: Option<Reach>,
    /// The relay that takes the slot over (a rename keeping `slotName`), if any.
    pub successor: Option<Option<Owner>>,
    /// The hand-over's outcome: whether the marker was this relay's to hand over.
    pub handed_over: Option<Result<bool, String>>,
    /// The drop's outcome.
    pub dropped: Option<Result<Dropped, String>>,
}

/// What to look at next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::controller) enum Look {
    Running,
    Cluster,
    Reach,
    Successor,
}

/// The finalizer's next step.
#[derive(Clone, Debug, PartialEq)]
pub(in crate::controller) enum Step {
    /// Look at this, then ask again.
    Look(Look),
    /// Delete the relay's Deployment: no walsender may take the slot again.
    StopRelay,
    /// Not yet: the relay's pods are stopping (no Event; looked at again soon).
    Wait(String),
    /// Hand the slot and publication over to this relay.
    HandOver(Owner),
    /// Drop what the operator created.
    Drop,
    /// Cannot be done now: a Warning saying how to fix it, and retry.
    Retry(String),
    /// Done in PostgreSQL (the Event, if anything was there to do): release these
    /// Secrets and let the relay go.
    Done(Option<Note>, Vec<String>),
}

/// What status and spec say the finalizer looks after, before it looks at anything.
pub(in crate::controller) fn seen(relay: &OutboxRelay, database_secrets: Vec<String>) -> Seen {
    use kube::ResourceExt;
    let slot = relay.status.as_ref().and_then(|s| s.slot.clone());
    let mut secrets = database_secrets;
    secrets.extend(
        slot.as_ref()
            .map(|s| s.protected_secrets.clone())
            .unwrap_or_default(),
    );
    let r = relay.spec.database.postgres().connection_secret_ref;
    Seen {
        target: cleanup_target(relay),
        abandon: relay
            .annotations()
            .get(ABANDON_SLOT_ANNOTATION)
            .is_some_and(|v| v == "true"),
        slot,
        secrets,
        secret_name: format!("Secret {} key {}", r.name, r.key),
        cluster: relay
            .spec
            .database
            .database_ref
            .as_ref()
            .map(|c| c.name.clone()),
        ..Seen::default()
    }
}

/// The slot and publication the finalizer has to look after: the ones status last
/// showed (what was created, whatever the spec says now), else the ones a log-tailing
/// spec names. `None` when neither says there is any (polling, or a spec that never
/// parsed, for which nothing was ever created). Never blocks on an invalid spec.
pub(in crate::controller) fn cleanup_target(relay: &OutboxRelay) -> Option<SlotPlan> {
    if let Some(slot) = relay.status.as_ref().and_then(|s| s.slot.as_ref()) {
        return Some(SlotPlan {
            slot: slot.name.clone(),
            publication: slot
                .publication
                .clone()
                .unwrap_or_else(|| slot.name.clone()),
            delete_after_publish: false,
        });
    }
    let valid = crate::spec::parse(relay).ok()?;
    Plan::for_relay(&valid).log_tailing
}

/// The finalizer's next step after what it has `seen`. For log tailing the relay is
/// stopped first (its Deployment deleted, then waiting until its pods are gone), so
/// that no walsender streams the slot; then the slot and publication the operator
/// created are handed over to a relay that claims them, or dropped. A database that no
/// longer exists counts as cleaned. Anything else that stops the drop (the Secret
/// missing, the host unreachable) is retried with a Warning that says how to fix it;
/// nothing is left behind silently (`outbox.dev/abandon-slot: "true"` lets the relay
/// go without the drop).
pub(in crate::controller) fn next(seen: &Seen) -> Step {
    let Some(t) = &seen.target else {
        return done(seen, None);
    };
    match seen.running {
        None => return Step::Look(Look::Running),
        Some(r) if r.deployment => return Step::StopRelay,
        Some(r) if r.pods > 0 => {
            return Step::Wait(format!(
                "waiting for {} relay pod(s) to stop before dropping the replication slot",
                r.pods
            ));
        }
        Some(_) => {}
    }
    if seen.abandon {
        return done(
            seen,
            Some(Note::warning(
                "SlotAbandoned",
                format!(
                    "replication slot {} and publication {} are left behind as annotation {} asks; they retain WAL on the database server until dropped by hand (docs/runbooks.md, OutboxOrphanedReplicationSlots)",
                    t.slot, t.publication, ABANDON_SLOT_ANNOTATION
                ),
            )),
        );
    }
    // A CloudNativePG cluster deleted with the relay (a namespace going away) takes its
    // databases, and with them the slot: waiting for it would hold the namespace.
    if let Some(cluster) = &seen.cluster {
        match seen.cluster_gone {
            None => return Step::Look(Look::Cluster),
            Some(true) => {
                return done(
                    seen,
                    Some(Note::normal(
                        "DatabaseGone",
                        format!(
                            "CloudNativePG Cluster {cluster} is gone or being deleted; replication slot {} and publication {} go with its databases",
                            t.slot, t.publication
                        ),
                    )),
                );
            }
            Some(false) => {}
        }
    }
    // Status never showed a slot: the checks never passed, nothing was created.
    let never_created = seen.slot.is_none();
    match &seen.reach {
        None => return Step::Look(Look::Reach),
        Some(Reach::SecretMissing) if never_created => {
            return done(
                seen,
                Some(Note::normal(
                    "Deleted",
                    format!(
                        "{} is gone and status shows no replication slot: nothing to drop",
                        seen.secret_name
                    ),
                )),
            );
        }
        Some(Reach::SecretMissing) => {
            return Step::Retry(format!(
                "{} (or a CA or client certificate Secret it needs) is gone, so replication slot {} and publication {} cannot be dropped: restore the Secret, or annotate the OutboxRelay {ABANDON_SLOT_ANNOTATION}=true to leave them behind (they retain WAL until dropped by hand)",
                seen.secret_name, t.slot, t.publication
            ));
        }
        Some(Reach::Read { here, connected }) => {
            if let Some(why) = drop_elsewhere(seen.slot.as_ref(), &t.slot, here) {
                return Step::Retry(why);
            }
            match connected {
                Ok(()) => {}
                Err(Unreachable::Gone(err)) => {
                    return done(
                        seen,
                        Some(Note::normal(
                            "DatabaseGone",
                            format!(
                                "the database is gone ({err}); replication slot {} and publication {} went with it",
                                t.slot, t.publication
                            ),
                        )),
                    );
                }
                // The Secret never held a URL the operator could connect with, and
                // status never showed a slot: nothing was created, so nothing blocks
                // the delete.
                Err(Unreachable::BadUrl(_)) if never_created => {
                    return done(
                        seen,
                        Some(Note::normal(
                            "Deleted",
                            format!(
                                "{} holds no usable URL and status shows no replication slot: nothing to drop",
                                seen.secret_name
                            ),
                        )),
                    );
                }
                Err(Unreachable::BadUrl(err) | Unreachable::Failed(err)) => {
                    return Step::Retry(format!(
                        "cannot connect to drop replication slot {}: {err}; retrying (if the database is gone for good, annotate the OutboxRelay {ABANDON_SLOT_ANNOTATION}=true)",
                        t.slot
                    ));
                }
            }
        }
    }
    match &seen.successor {
        None => return Step::Look(Look::Successor),
        Some(Some(next)) => match &seen.handed_over {
            None => return Step::HandOver(next.clone()),
            Some(Ok(true)) => {
                return done(
                    seen,
                    Some(Note::normal(
                        "SlotHandedOver",
                        format!(
                            "replication slot {} and publication {} handed over to OutboxRelay {}/{}, which claims them: they keep their position and are dropped with that relay",
                            t.slot, t.publication, next.namespace, next.name
                        ),
                    )),
                );
            }
            // Not this relay's any more: nothing to drop either.
            Some(Ok(false)) => {}
            Some(Err(err)) => {
                return Step::Retry(format!(
                    "handing replication slot {} over to OutboxRelay {}/{} failed: {err}",
                    t.slot, next.namespace, next.name
                ));
            }
        },
        Some(None) => {}
    }
    match &seen.dropped {
        None => Step::Drop,
        Some(Err(err)) => Step::Retry(format!(
            "dropping replication slot {} failed: {err}",
            t.slot
        )),
        Some(Ok(d)) => done(seen, Some(dropped(seen, t, d))),
    }
}

/// The Event of a drop that ran: what went, what was kept, and a slot left behind in
/// another database, which the finalizer cannot drop.
fn dropped(seen: &Seen, t: &SlotPlan, d: &Dropped) -> Note {
    let mut parts = Vec::new();
    if d.slot {
        parts.push(format!(
            "dropped replication slot {}{}",
            t.slot,
            if d.terminated_walsender {
                " (terminated the walsender still streaming it)"
            } else {
                ""
            }
        ));
    }
    if d.publication {
        parts.push(format!("dropped publication {}", t.publication));
    }
    if !d.kept.is_empty() {
        parts.push(format!(
            "kept {} (not created by the operator)",
            d.kept.join(" and ")
        ));
    }
    if parts.is_empty() {
        return Note::normal(
            "Deleted",
            "no replication slot or publication of this relay was left to drop".to_owned(),
        );
    }
    match still_left_behind(seen.slot.as_ref()) {
        Some(left) => {
            parts.push(left);
            Note::warning("SlotDropped", parts.join("; "))
        }
        None => Note::normal("SlotDropped", parts.join("; ")),
    }
}

/// Done: the Event, and every Secret of the relay released.
fn done(seen: &Seen, note: Option<Note>) -> Step {
    let mut secrets = seen.secrets.clone();
    secrets.sort();
    secrets.dedup();
    Step::Done(note, secrets)
}

/// `Some(why)` when the slot status records lives in another database than the one the
/// Secret reaches (`here`), so dropping "the slot" there would drop nothing and leave it
/// behind; a database that does not exist there says nothing about the slot either.
fn drop_elsewhere(slot_status: Option<&SlotStatus>, slot: &str, here: &str) -> Option<String> {
    let was = slot_status
        .filter(|s| s.name == slot)
        .and_then(|s| s.location.as_deref())
        .filter(|was| *was != here)?;
    Some(format!(
        "replication slot {slot} lives in {was}, which the connection Secret no longer reaches (it leads to {here}): point the Secret back so that the operator drops it, or drop it there by hand and annotate the OutboxRelay {ABANDON_SLOT_ANNOTATION}=true"
    ))
}

/// The slot left behind in another database when the Secret was repointed, which the
/// finalizer cannot drop.
fn still_left_behind(slot_status: Option<&SlotStatus>) -> Option<String> {
    let left = slot_status.and_then(|s| s.left_behind.as_ref())?;
    Some(format!(
        "replication slot {} in {}, left behind when the connection Secret was pointed elsewhere, is not dropped: drop it there (SELECT pg_drop_replication_slot('{}')), it retains WAL until then",
        left.slot, left.location, left.slot
    ))
}

#[cfg(test)]
#[path = "deletion/tests.rs"]
mod tests;
