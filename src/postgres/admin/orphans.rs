//! Finding the publications (and slots) the operator marked, so the ones whose
//! OutboxRelay is gone can be reported.

use tokio_postgres::Client;

use super::{MARKER_PREFIX, Marker};
use crate::postgres::{PgError, db};

/// A publication (and maybe slot) the operator marked, as found in one database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marked {
    /// The publication.
    pub publication: String,
    /// Its marker.
    pub marker: Marker,
    /// The slot still exists.
    pub slot_exists: bool,
}

/// Every publication in the connected database carrying the operator's marker.
pub async fn list_marked(client: &Client) -> Result<Vec<Marked>, PgError> {
    let rows = client
        .query(
            "SELECT p.pubname::text, obj_description(p.oid, 'pg_publication') FROM pg_publication p \
             WHERE obj_description(p.oid, 'pg_publication') LIKE $1",
            &[&format!("{MARKER_PREFIX}%")],
        )
        .await
        .map_err(db("listing the operator's publications"))?;
    let mut out = Vec::new();
    for row in rows {
        let publication: String = row.get(0);
        let comment: Option<String> = row.get(1);
        let Some(marker) = comment.as_deref().and_then(Marker::from_comment) else {
            continue;
        };
        let slot_exists = client
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                &[&marker.slot],
            )
            .await
            .map_err(db("looking up a replication slot"))?
            .is_some();
        out.push(Marked {
            publication,
            marker,
            slot_exists,
        });
    }
    Ok(out)
}
