//! The polling relay's SQL beside the outbox table's: the partition expression rows are
//! hashed with, the advisory locks by which replicas share a table's partitions (member,
//! partition, layout and retention locks), and the lock session's keepalives.
//!
//! # Partitions
//!
//! A row belongs to partition
//!
//! ```sql
//! ((hashtextextended(coalesce("aggregateid"::text, ''), 0) & 9223372036854775807) % N)
//! ```
//!
//! `hashtextextended` is PostgreSQL's own stable 64-bit text hash (used by hash
//! partitioning, stable across releases and platforms). The mask clears the sign bit
//! instead of `abs()`, which would overflow on `i64::MIN`; `coalesce` keeps rows with a
//! NULL aggregate id publishable (they all land in one partition). The filter uses an
//! index only when the index expression is written exactly like this, so users create
//! (see [`partition_index_ddl`] and `examples/schema.sql`):
//!
//! ```sql
//! CREATE INDEX outbox_unpublished_by_partition ON public.outbox
//!   (((hashtextextended(coalesce("aggregateid"::text, ''), 0) & 9223372036854775807) % 4), "id")
//!   WHERE "published_at" IS NULL;
//! ```

use tokio_postgres::Client;

use super::{PgError, db, keep_open_while_publishing, quote};

/// The partition expression for `aggregate_id` with `partitions` partitions (see the
/// module documentation for why it is written this way).
pub fn partition_expr(aggregate_id: &str, partitions: i32) -> String {
    format!(
        "((hashtextextended(coalesce({}::text, ''), 0) & 9223372036854775807) % {partitions})",
        quote(aggregate_id)
    )
}

/// The index users create so each partition's oldest unpublished rows are found by an
/// index scan, in the form the planner matches against the relay's filter.
pub fn partition_index_ddl(
    schema: &str,
    table: &str,
    aggregate_id: &str,
    id: &str,
    published_at: &str,
    partitions: i32,
) -> String {
    format!(
        "CREATE INDEX IF NOT EXISTS {} ON {}.{} ({}, {}) WHERE {} IS NULL",
        quote(&format!("{table}_unpublished_p{partitions}")),
        quote(schema),
        quote(table),
        partition_expr(aggregate_id, partitions),
        quote(id),
        quote(published_at)
    )
}

/// Server-side TCP keepalive of a relay's lock session: idle, interval (seconds) and
/// count. A client that vanished is dropped (and its advisory locks released) after
/// about 25 s instead of the system default of hours; the relay's fence is shorter.
pub const SERVER_KEEPALIVES: (u32, u32, u32) = (10, 5, 3);

/// Applies [`SERVER_KEEPALIVES`] to a polling relay's lock session, and
/// [`keep_open_while_publishing`].
pub async fn tighten_server_keepalives(client: &Client) -> Result<(), PgError> {
    let (idle, interval, count) = SERVER_KEEPALIVES;
    client
        .batch_execute(&format!(
            "SET tcp_keepalives_idle = {idle}; SET tcp_keepalives_interval = {interval}; \
             SET tcp_keepalives_count = {count}"
        ))
        .await
        .map_err(db("setting the session's TCP keepalives"))?;
    keep_open_while_publishing(client).await
}

/// Advisory-lock key space of one outbox table. Keys are two int4s: the table's
/// `class` (a stable hash of `schema.table`) and a number below.
///
/// Partition locks use their partition number (0..1024); member locks, which let the
/// replicas count each other, use [`MEMBER_BASE`]+slot; the retention lock uses
/// [`RETENTION_KEY`]; layout locks [`LAYOUT_BASE`]+partitions.
pub const MEMBER_BASE: i32 = 1_000_000;
/// Upper bound on replicas sharing one table.
pub const MAX_MEMBERS: i32 = 1024;
/// Lock held by the one process that runs retention.
pub const RETENTION_KEY: i32 = 2_000_000;
/// Layout locks: every perAggregate relay holds `LAYOUT_BASE + ordering.partitions`
/// in shared mode, so relays with different partition counts (old and new pods while
/// `ordering.partitions` changes) can see each other; see [`leading_layout`].
pub const LAYOUT_BASE: i32 = 3_000_000;

/// Holds this session's layout lock (shared: relays of one layout never block each
/// other).
pub async fn hold_layout(client: &Client, class: i32, partitions: i32) -> Result<(), PgError> {
    client
        .query_one(
            "SELECT pg_advisory_lock_shared($1, $2)",
            &[&class, &(LAYOUT_BASE + partitions)],
        )
        .await
        .map_err(db("taking the layout lock"))?;
    Ok(())
}

/// The partition count whose relays may publish on this table now: of the layouts
/// held by live sessions, the one held longest (the earliest session start among its
/// holders). Relays of any other layout wait until it is gone, so one aggregate's rows
/// are never published under two partition counts at once. `None` when no layout lock
/// is visible.
pub async fn leading_layout(client: &Client, class: i32) -> Result<Option<i32>, PgError> {
    let row = client
        .query_opt(
            "SELECT l.objid::int8 - $2::int8 \
             FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND l.classid::int8 = $1::int8 \
               AND l.objid::int8 >= $2::int8 AND l.objid::int8 <= $2::int8 + 1024 \
             GROUP BY 1 ORDER BY min(a.backend_start) NULLS LAST, 1 LIMIT 1",
            &[&i64::from(class), &i64::from(LAYOUT_BASE)],
        )
        .await
        .map_err(db("looking up the relays' partition counts"))?;
    Ok(row.and_then(|r| i32::try_from(r.get::<_, i64>(0)).ok()))
}

/// How many of `partitions` partitions of the table of lock class `class` a live relay
/// session holds now (polling with per-aggregate order: each partition is a session
/// advisory lock of its owner, released with its session).
pub async fn owned_partitions(
    client: &Client,
    class: i32,
    partitions: i32,
) -> Result<i32, PgError> {
    let row = client
        .query_one(
            "SELECT count(DISTINCT objid) FROM pg_locks \
             WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND classid::int8 = $1::int8 AND objid::int8 >= 0 AND objid::int8 < $2::int8",
            &[&i64::from(class), &i64::from(partitions)],
        )
        .await
        .map_err(db("counting the partitions relays hold"))?;
    Ok(i32::try_from(row.get::<_, i64>(0)).unwrap_or(i32::MAX))
}

/// A stable lock class for `schema.table` (FNV-1a; positive so it reads back from
/// `pg_locks.classid` unchanged).
pub fn lock_class(schema: &str, table: &str) -> i32 {
    let hash = format!("outbox-relay:{schema}.{table}")
        .bytes()
        .fold(0x811c_9dc5_u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
    i32::try_from(hash & 0x7fff_ffff).unwrap_or(0)
}

/// Takes a session advisory lock without waiting; true when this session now holds it.
pub async fn try_lock(client: &Client, class: i32, key: i32) -> Result<bool, PgError> {
    let row = client
        .query_one("SELECT pg_try_advisory_lock($1, $2)", &[&class, &key])
        .await
        .map_err(db("taking an advisory lock"))?;
    Ok(row.get(0))
}

/// Releases a session advisory lock this session holds.
pub async fn unlock(client: &Client, class: i32, key: i32) -> Result<(), PgError> {
    client
        .query_one("SELECT pg_advisory_unlock($1, $2)", &[&class, &key])
        .await
        .map_err(db("releasing an advisory lock"))?;
    Ok(())
}

/// Releases every advisory lock of this session (clean shutdown).
pub async fn unlock_all(client: &Client) -> Result<(), PgError> {
    client
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .map_err(db("releasing advisory locks"))
}

/// The member slots currently held (by live sessions) for this table, sorted.
pub async fn live_members(client: &Client, class: i32) -> Result<Vec<i32>, PgError> {
    let rows = client
        .query(
            "SELECT objid::int8 FROM pg_locks \
             WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND classid::int8 = $1::int8 AND objid::int8 >= $2::int8 AND objid::int8 < $3::int8 \
             ORDER BY 1",
            &[
                &i64::from(class),
                &i64::from(MEMBER_BASE),
                &i64::from(MEMBER_BASE + MAX_MEMBERS),
            ],
        )
        .await
        .map_err(db("listing relay members"))?;
    Ok(rows
        .iter()
        .filter_map(|r| i32::try_from(r.get::<_, i64>(0)).ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_expression_matches_the_documented_index() {
        let ddl = partition_index_ddl("public", "outbox", "aggregateid", "id", "published_at", 4);
        assert!(ddl.contains(&partition_expr("aggregateid", 4)), "{ddl}");
        assert!(ddl.contains("WHERE \"published_at\" IS NULL"), "{ddl}");
    }

    #[test]
    fn lock_classes_are_stable_positive_and_per_table() {
        let a = lock_class("public", "outbox");
        assert_eq!(a, lock_class("public", "outbox"));
        assert!(a >= 0);
        assert_ne!(a, lock_class("public", "outbox2"));
    }
}
