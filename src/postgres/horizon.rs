//! Which transactions have surely ended: the xmin of a snapshot (every transaction
//! with a lower id has committed or rolled back), read together with the WAL position
//! after it. A log-tailing relay that has streamed past that position has streamed the
//! commit of every such transaction, so an outbox row inserted by one of them and
//! still in the table (with `deleteAfterPublish`) was missed by the tail: what the
//! reconciliation sweep publishes. Its insert time (`createdAt`, the transaction's
//! start) cannot tell that: a long transaction committing while the tail lags is old
//! by it, yet not missed.

use pgwire_replication::Lsn;
use tokio_postgres::Client;

use super::{PgError, db};

/// Transactions below `xid` (32-bit, as rows' `xmin` holds it) had ended when the WAL
/// was at `lsn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Horizon {
    /// The snapshot's xmin, modulo 2^32.
    pub xid: u32,
    /// The WAL position read after the snapshot: every commit of those transactions
    /// is before it.
    pub lsn: Lsn,
}

/// Reads a horizon now: the snapshot first, then (in a statement of its own) the WAL
/// position.
pub async fn horizon(client: &Client) -> Result<Horizon, PgError> {
    let xmin: String = client
        .query_one("SELECT pg_snapshot_xmin(pg_current_snapshot())::text", &[])
        .await
        .map_err(db("reading the oldest running transaction"))?
        .get(0);
    let lsn: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .map_err(db("reading the WAL position"))?
        .get(0);
    let full: u64 = xmin
        .parse()
        .map_err(|_| PgError::Replication(format!("snapshot xmin {xmin:?}")))?;
    Ok(Horizon {
        // The low 32 bits are the xid rows carry; the epoch above them is not.
        xid: u32::try_from(full & 0xFFFF_FFFF).unwrap_or(0),
        lsn: Lsn::parse(&lsn)
            .map_err(|e| PgError::Replication(format!("WAL position {lsn:?}: {e}")))?,
    })
}
