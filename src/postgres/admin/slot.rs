//! Whether a relay's slot and publication exist, and the slot's state for status.

use tokio_postgres::Client;

use crate::postgres::replication::SlotStats;
use crate::postgres::{PgError, db};

/// The slot's and publication's presence, for a relay that must not create them.
pub async fn replication_objects_exist(
    client: &Client,
    slot: &str,
    publication: &str,
) -> Result<(bool, bool), PgError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 \
                 AND database = current_database()), \
             EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $2)",
            &[&slot, &publication],
        )
        .await
        .map_err(db("looking up the slot and publication"))?;
    Ok((row.get(0), row.get(1)))
}

/// The slot's state for status, or `None` when it does not exist.
pub async fn slot_state(client: &Client, slot: &str) -> Result<Option<SlotStats>, PgError> {
    crate::postgres::replication::slot_stats(client, slot).await
}
