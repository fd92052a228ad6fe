//! Where a log-tailing relay's slot lives, for its finalizer: the finalizer connects
//! through the Secret as it is now, which may lead elsewhere than the database the slot
//! was made in (see `decide/moved.rs`, which records `status.slot.location` and
//! `leftBehind`). Pure.

use crate::api::OutboxRelay;

/// The finalizer's decision before it connects: `Some(why)` when the slot status records
/// lives in another database than the one the Secret reaches (`here`), so dropping
/// "the slot" there would drop nothing and leave it behind; a database that does not
/// exist there says nothing about the slot either.
pub(super) fn drop_elsewhere(
    relay: &OutboxRelay,
    slot: &str,
    here: &str,
    abandon: &str,
) -> Option<String> {
    let was = relay
        .status
        .as_ref()
        .and_then(|s| s.slot.as_ref())
        .filter(|s| s.name == slot)
        .and_then(|s| s.location.as_deref())
        .filter(|was| *was != here)?;
    Some(format!(
        "replication slot {slot} lives in {was}, which the connection Secret no longer reaches (it leads to {here}): point the Secret back so that the operator drops it, or drop it there by hand and annotate the OutboxRelay {abandon}=true"
    ))
}

/// What the finalizer adds once it dropped what it could: the slot left behind in
/// another database, which it cannot drop.
pub(super) fn still_left_behind(relay: &OutboxRelay) -> Option<String> {
    let left = relay
        .status
        .as_ref()
        .and_then(|s| s.slot.as_ref())
        .and_then(|s| s.left_behind.as_ref())?;
    Some(format!(
        "replication slot {} in {}, left behind when the connection Secret was pointed elsewhere, is not dropped: drop it there (SELECT pg_drop_replication_slot('{}')), it retains WAL until then",
        left.slot, left.location, left.slot
    ))
}
