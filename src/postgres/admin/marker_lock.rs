//! One writer of a publication's marker at a time. The finalizer of a relay being
//! deleted (read the marker, drop what it owns) and a relay taking over its slot
//! (rewrite the marker to itself) must not interleave: either the finalizer drops first
//! and the successor creates fresh objects, or the successor marks first and the
//! finalizer finds nothing of its own. A session advisory lock keyed on the publication
//! name (the one-`bigint` form, a key space apart from the relays' two-`int` partition
//! locks) serialises them; pooled sessions are reset with `DISCARD ALL`, which releases
//! it too should an unlock be missed.

use tokio_postgres::Client;

use crate::postgres::{PgError, db};

const KEY_SQL: &str = "hashtextextended('outbox.dev/publication/' || $1, 0)";

/// Runs `body` holding the marker lock of `publication`; releases it whatever `body`
/// returned.
pub async fn with_marker_lock<T, F>(
    client: &Client,
    publication: &str,
    body: F,
) -> Result<T, PgError>
where
    F: AsyncFnOnce(&Client) -> Result<T, PgError>,
{
    client
        .query_one(
            &format!("SELECT pg_advisory_lock({KEY_SQL})"),
            &[&publication],
        )
        .await
        .map_err(db("waiting for the publication's marker lock"))?;
    let result = body(client).await;
    let unlocked = client
        .query_one(
            &format!("SELECT pg_advisory_unlock({KEY_SQL})"),
            &[&publication],
        )
        .await
        .map_err(db("releasing the publication's marker lock"));
    let value = result?;
    unlocked?;
    Ok(value)
}

/// The publication's comment as it is now (`None`: no publication; `Some(None)`: no
/// comment).
pub async fn current_comment(
    client: &Client,
    publication: &str,
) -> Result<Option<Option<String>>, PgError> {
    Ok(client
        .query_opt(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(db("looking up the publication"))?
        .map(|r| r.get(0)))
}
