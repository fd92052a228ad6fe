//! How far the standbys named in `synchronizedStandbySlots` have flushed the primary's
//! WAL: the `restart_lsn` of each one's physical replication slot, which the primary
//! moves to the flush position the standby reports. A commit at or before the least of
//! them survives a promotion of any of them.

use pgwire_replication::Lsn;
use tokio_postgres::Client;

use super::{PgError, db};

/// What one look at the standby slots found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standbys {
    /// Every named slot exists; the least position any of them has flushed (`None`
    /// while one of them has never been streamed).
    Flushed(Option<Lsn>),
    /// These named slots are not physical slots on this server.
    Missing(Vec<String>),
}

/// Looks at the physical slots `slots` now, with the primary's flushed WAL position.
pub async fn standbys(client: &Client, slots: &[String]) -> Result<Standbys, PgError> {
    let rows = client
        .query(
            "SELECT slot_name::text, restart_lsn::text FROM pg_replication_slots \
              WHERE slot_type = 'physical' AND slot_name = ANY($1)",
            &[&slots],
        )
        .await
        .map_err(db("reading the standby slots"))?;
    let mut least: Option<Option<Lsn>> = None;
    let mut found = Vec::with_capacity(rows.len());
    for row in rows {
        let name: String = row.get(0);
        let position: Option<String> = row.get(1);
        let position = position
            .map(|text| {
                Lsn::parse(&text)
                    .map_err(|e| PgError::Replication(format!("slot {name}: {text:?}: {e}")))
            })
            .transpose()?;
        least = Some(match (least, position) {
            (None, p) => p,
            (Some(Some(a)), Some(b)) => Some(a.min(b)),
            (Some(_), _) => None,
        });
        found.push(name);
    }
    let missing: Vec<String> = slots
        .iter()
        .filter(|s| !found.contains(s))
        .cloned()
        .collect();
    Ok(if missing.is_empty() {
        Standbys::Flushed(least.flatten())
    } else {
        Standbys::Missing(missing)
    })
}

/// The primary's WAL flushed to disk now: any commit already sent on a stream ends at
/// or before it.
pub async fn flushed_now(client: &Client) -> Result<Lsn, PgError> {
    wal_position(
        client,
        "pg_current_wal_flush_lsn",
        "reading the flushed WAL position",
    )
    .await
}

/// The primary's WAL inserted now: every transaction already visible to a snapshot
/// committed at or before it (its commit record is inserted before it becomes visible,
/// flushed or not).
pub async fn inserted_now(client: &Client) -> Result<Lsn, PgError> {
    wal_position(
        client,
        "pg_current_wal_insert_lsn",
        "reading the inserted WAL position",
    )
    .await
}

async fn wal_position(client: &Client, function: &str, what: &'static str) -> Result<Lsn, PgError> {
    let text: String = client
        .query_one(&format!("SELECT {function}()::text"), &[])
        .await
        .map_err(db(what))?
        .get(0);
    Lsn::parse(&text).map_err(|e| PgError::Replication(format!("WAL position {text:?}: {e}")))
}
