//! The handover from polling to log tailing. A new slot streams only what commits after
//! it was created; rows committed before and not yet published by the polling relay
//! would never be sent. So the operator creates the slot while the polling relay still
//! runs, takes a snapshot right after (every transaction committed before the slot is
//! visible in it), and starts log tailing only once no unpublished row of a transaction
//! visible in that snapshot is left. Rows committed after the slot was created and
//! already published by polling are streamed again: duplicates, never a loss.

use std::collections::HashMap;

use tokio_postgres::Client;

use super::Plan;
use super::backlog::{optional_columns, unpublished_filter};
use crate::postgres::snapshot::Snapshot;
use crate::postgres::{PgError, db, replication};

/// The snapshot to hand over at, taken right after the slot exists.
pub async fn handover_snapshot(client: &Client) -> Result<String, PgError> {
    replication::current_snapshot(client).await
}

/// How many unpublished rows were committed by transactions visible in `snapshot`
/// (rows the slot does not stream). Reads the inserting transaction (`xmin`) of each
/// unpublished row, grouped; an outbox row is written once, so its `xmin` is the
/// transaction that committed it.
pub async fn unpublished_before(
    client: &Client,
    plan: &Plan,
    snapshot: &str,
) -> Result<i64, PgError> {
    let snapshot = Snapshot::parse(snapshot).ok_or_else(|| {
        PgError::Replication(format!("{snapshot:?} is not a PostgreSQL snapshot"))
    })?;
    let (_, has_marker, _) = optional_columns(client, plan).await?;
    let sql = format!(
        "SELECT xmin::text, count(*) FROM {} {} GROUP BY 1",
        plan.qualified(),
        unpublished_filter(plan, has_marker)
    );
    let rows = client
        .query(&sql, &[])
        .await
        .map_err(db("counting the rows committed before the slot"))?;
    let by_xid: HashMap<u32, i64> = rows
        .iter()
        .filter_map(|r| Some((r.get::<_, String>(0).parse().ok()?, r.get(1))))
        .collect();
    // Read after the rows: every xid they carry is below it.
    let now = replication::current_snapshot(client).await?;
    let now_xmax = Snapshot::xmax_of(&now)
        .ok_or_else(|| PgError::Replication(format!("{now:?} is not a PostgreSQL snapshot")))?;
    Ok(by_xid
        .iter()
        .filter(|(xid, _)| snapshot.committed_before(**xid, now_xmax))
        .map(|(_, n)| n)
        .sum())
}
