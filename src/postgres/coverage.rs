//! Whether the publication publishes the outbox table, and since when, exactly.
//!
//! The server decodes each insert with the publication as it was at that point of the
//! WAL: inserts made while the table was out of it are never streamed, and a replay
//! does not bring them back. Sampling "does it publish the table now?" misses a DROP
//! and ADD between two samples. The catalog rows do not: re-adding the table writes a
//! new `pg_publication_rel` row (a new oid), `ALTER PUBLICATION … SET (…)` rewrites the
//! `pg_publication` row (a new `xmin`), and a dropped and recreated publication has a
//! new oid. So the relay keeps the [`Coverage::identity`] it last saw, and a different
//! one means that inserts between the two looks may not have been streamed, however
//! short the change. (Adding or dropping *other* tables changes none of these.)
//!
//! A change made while no relay ran is not in the catalog's history (the slot's
//! `catalog_xmin` does not date the catalog rows, as any transaction open on the server
//! holds it back past changes made long before the slot): so the operator records the
//! identity when it first sees the slot (`status.slot.coverageBaseline`), and a relay's
//! first look compares with that.

use pgwire_replication::Lsn;
use tokio_postgres::Client;

use super::{PgError, db};

/// What one look at the publication found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coverage {
    /// The WAL position read before the catalog: everything written before it was
    /// decoded with the catalog as read (a change committed before the position is
    /// visible to the later read).
    pub lsn: Lsn,
    /// The publication publishes inserts into the table (or into its partition root).
    pub covered: bool,
    /// The catalog rows that make it so: the publication's oid and `xmin`, and each
    /// `pg_publication_rel` / `pg_publication_namespace` row naming the table, one of
    /// its ancestors or its schema, by oid and `xmin`. Empty without the publication.
    pub identity: String,
}

/// Whether publication `$1` publishes `$2.$3` ([`PUBLICATION_COVERS_TABLE`]), and the
/// catalog rows that make it so, as `oid/xmin`, in one statement (PostgreSQL 15 adds
/// publications of whole schemas).
///
/// [`PUBLICATION_COVERS_TABLE`]: super::replication::PUBLICATION_COVERS_TABLE
fn members_sql(schemas: bool) -> String {
    let schema_rows = if schemas {
        " UNION ALL SELECT n.oid, n.xmin FROM pg_publication_namespace n, p, t \
           JOIN pg_class c ON c.oid = t.rel \
          WHERE n.pnpubid = p.oid AND n.pnnspid = c.relnamespace"
    } else {
        ""
    };
    format!(
        "WITH p AS (SELECT oid, xmin FROM pg_publication WHERE pubname = $1), \
              t AS (SELECT to_regclass(format('%I.%I', $2::text, $3::text)) AS rel), \
              m AS (SELECT r.oid, r.xmin FROM pg_publication_rel r, p, t \
                     WHERE r.prpubid = p.oid \
                       AND (r.prrelid = t.rel \
                            OR r.prrelid IN (SELECT relid FROM pg_partition_ancestors(t.rel))){schema_rows}) \
         SELECT {covers}, \
                coalesce((SELECT oid::text || '/' || xmin::text FROM p), '') \
                  || coalesce((SELECT ';' || string_agg(oid::text || '/' || xmin::text, ',' ORDER BY oid) FROM m), '')",
        covers = super::replication::PUBLICATION_COVERS_TABLE
    )
}

/// Looks at the publication's coverage of `schema.table` now.
pub async fn coverage(
    client: &Client,
    publication: &str,
    schema: &str,
    table: &str,
) -> Result<Coverage, PgError> {
    let row = client
        .query_one(
            "SELECT pg_current_wal_lsn()::text, current_setting('server_version_num')::int",
            &[],
        )
        .await
        .map_err(db("reading the WAL position"))?;
    let lsn: String = row.get(0);
    let version: i32 = row.get(1);
    let lsn =
        Lsn::parse(&lsn).map_err(|e| PgError::Replication(format!("WAL position {lsn:?}: {e}")))?;
    // After the position, in a statement of its own: a change committed before it is
    // visible here.
    let (covered, identity) = members(client, version, publication, schema, table).await?;
    Ok(Coverage {
        lsn,
        covered,
        identity,
    })
}

/// Whether publication `publication` publishes the table, and its [`Coverage::identity`],
/// on a server of `version` (`server_version_num`); needs no WAL position, so a
/// standby answers too.
pub async fn members(
    client: &Client,
    version: i32,
    publication: &str,
    schema: &str,
    table: &str,
) -> Result<(bool, String), PgError> {
    let row = client
        .query_one(
            &members_sql(version >= 150_000),
            &[&publication, &schema, &table],
        )
        .await
        .map_err(db("checking what publishes the outbox table"))?;
    Ok((row.get(0), row.get(1)))
}
