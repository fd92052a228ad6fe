//! Dropping what the operator created for an OutboxRelay on delete (terminating a
//! walsender that still streams the slot), and telling a database that is gone (nothing
//! left to drop) from one that is only unreachable.

use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::marker_lock::{current_comment, with_marker_lock};
use super::{Marker, Origin, Owner, comment_sql};
use crate::postgres::{PgError, db, quote};

/// What [`drop_owned`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dropped {
    /// The slot was dropped.
    pub slot: bool,
    /// A walsender still streaming it was terminated first.
    pub terminated_walsender: bool,
    /// The publication was dropped.
    pub publication: bool,
    /// What was kept because the operator did not create it (names).
    pub kept: Vec<String>,
}

/// Drops what the marker says the operator created for `owner`: the slot (terminating
/// a walsender that still streams it) and the publication; removes the marker from an
/// adopted publication. Objects without this owner's marker are left alone (a relay that
/// took the slot over has rewritten it). Idempotent: what is already gone counts as
/// dropped. Holds the publication's marker lock throughout.
pub async fn drop_owned(
    client: &Client,
    slot: &str,
    publication: &str,
    owner: &Owner,
) -> Result<Dropped, PgError> {
    with_marker_lock(client, publication, async |client| {
        drop_owned_locked(client, slot, publication, owner).await
    })
    .await
}

async fn drop_owned_locked(
    client: &Client,
    slot: &str,
    publication: &str,
    owner: &Owner,
) -> Result<Dropped, PgError> {
    let mut out = Dropped::default();
    let comment = current_comment(client, publication).await?;
    let marker = comment
        .as_ref()
        .and_then(|c| c.as_deref())
        .and_then(Marker::from_comment)
        .filter(|m| m.owner == *owner && m.slot == slot);
    let Some(marker) = marker else {
        // No marker of ours: nothing here is ours to drop.
        if comment.is_some() {
            out.kept.push(format!("publication {publication}"));
        }
        let slot_exists = client
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(db("looking up the replication slot"))?
            .is_some();
        if slot_exists {
            out.kept.push(format!("replication slot {slot}"));
        }
        return Ok(out);
    };
    if marker.slot_origin == Origin::Created {
        let (dropped, terminated) = drop_slot(client, slot).await?;
        out.slot = dropped;
        out.terminated_walsender = terminated;
    } else {
        out.kept.push(format!("replication slot {slot}"));
    }
    if marker.publication == Origin::Created {
        client
            .batch_execute(&format!(
                "DROP PUBLICATION IF EXISTS {}",
                quote(publication)
            ))
            .await
            .map_err(db("dropping the publication"))?;
        out.publication = true;
    } else {
        client
            .batch_execute(&comment_sql(publication, None))
            .await
            .map_err(db("removing the operator's mark from the publication"))?;
        out.kept.push(format!("publication {publication}"));
    }
    Ok(out)
}

/// Drops the slot of a relay that fell back to polling (its WAL budget was passed),
/// whoever created it, provided the publication's marker still names `owner` and this
/// slot; the publication and its marker stay, so the slot name stays claimed and the
/// return to log tailing creates the slot again (then recorded as the operator's).
/// Returns whether the slot is gone; `false` when the marker is not `owner`'s (nothing
/// was dropped). Holds the publication's marker lock.
pub async fn drop_slot_over_budget(
    client: &Client,
    slot: &str,
    publication: &str,
    owner: &Owner,
) -> Result<bool, PgError> {
    with_marker_lock(client, publication, async |client| {
        let comment = current_comment(client, publication).await?;
        let ours = comment
            .as_ref()
            .and_then(|c| c.as_deref())
            .and_then(Marker::from_comment)
            .is_some_and(|m| m.owner == *owner && m.slot == slot);
        if !ours {
            return Ok(false);
        }
        let (dropped, _) = drop_slot(client, slot).await?;
        Ok(dropped)
    })
    .await
}

/// Drops a slot, terminating its walsender first when one is active. Returns (dropped,
/// terminated a walsender). A slot already gone counts as dropped.
async fn drop_slot(client: &Client, slot: &str) -> Result<(bool, bool), PgError> {
    let mut terminated = false;
    for _ in 0..50 {
        let row = client
            .query_opt(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(db("looking up the replication slot"))?;
        let Some(row) = row else {
            return Ok((true, terminated));
        };
        let pid: Option<i32> = row.get(0);
        if let Some(pid) = pid {
            client
                .query_one("SELECT pg_terminate_backend($1)", &[&pid])
                .await
                .map_err(db("terminating the walsender of the slot"))?;
            terminated = true;
            // The walsender releases the slot as it exits.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        }
        match client
            .query_one("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
        {
            Ok(_) => return Ok((true, terminated)),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_OBJECT) => {
                return Ok((true, terminated));
            }
            // Became active between the look-up and the drop: go round again.
            Err(e) if e.code() == Some(&SqlState::OBJECT_IN_USE) => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(source) => {
                return Err(PgError::Db {
                    what: "dropping the replication slot",
                    source,
                });
            }
        }
    }
    Err(PgError::Replication(format!(
        "replication slot {slot} stays in use: a consumer reconnects as soon as its walsender is terminated"
    )))
}

/// Whether a connection error means the database no longer exists, which counts as
/// cleaned up: there is nothing left to drop. Only the server saying so counts (SQLSTATE
/// 3D000, invalid_catalog_name): a host that does not resolve, refuses or times out is
/// an outage — DNS fails during incidents too — and is retried, never read as gone.
pub fn database_is_gone(err: &PgError) -> bool {
    let PgError::Db { source, .. } = err else {
        return false;
    };
    source.code() == Some(&SqlState::INVALID_CATALOG_NAME)
}

/// Rewrites the marker from `from` to `to` (keeping who made what), so that `to` owns
/// the slot and publication from now on: the finalizer of a renamed relay hands them
/// to the relay that claims the same slot instead of dropping them, and the slot keeps
/// its position. Returns false (and changes nothing) when the marker is not `from`'s
/// for this slot. Holds the publication's marker lock.
pub async fn hand_over(
    client: &Client,
    slot: &str,
    publication: &str,
    from: &Owner,
    to: &Owner,
) -> Result<bool, PgError> {
    with_marker_lock(client, publication, async |client| {
        let comment = current_comment(client, publication).await?;
        let Some(marker) = comment
            .flatten()
            .as_deref()
            .and_then(Marker::from_comment)
            .filter(|m| m.owner == *from && m.slot == slot)
        else {
            return Ok(false);
        };
        let handed = Marker {
            owner: to.clone(),
            ..marker
        };
        client
            .batch_execute(&comment_sql(publication, Some(&handed.to_comment())))
            .await
            .map_err(db("handing the publication's marker over"))?;
        Ok(true)
    })
    .await
}
