//! Reads the preflight facts (server and role, the outbox table, an existing slot and
//! publication) that [`evaluate`](super::evaluate) judges. Read-only.

use tokio_postgres::Client;

use super::{Facts, Plan, PublicationFacts, ServerFacts, SlotFacts, TableFacts};
use crate::postgres::{PgError, db};

/// Reads what the checks need (read-only).
pub async fn gather(client: &Client, plan: &Plan) -> Result<Facts, PgError> {
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), \
                    current_setting('max_replication_slots')::int4, \
                    (SELECT count(*) FROM pg_replication_slots)::int4, \
                    current_setting('max_wal_senders')::int4, \
                    r.rolreplication, r.rolsuper, current_user::text, current_database()::text, \
                    has_database_privilege(current_database(), 'CREATE'), \
                    current_setting('server_version_num')::int4, \
                    coalesce(current_setting('synchronized_standby_slots', true), '') \
             FROM pg_roles r WHERE r.rolname = current_user",
            &[],
        )
        .await
        .map_err(db("reading server settings"))?;
    let server = ServerFacts {
        wal_level: row.get(0),
        max_replication_slots: row.get(1),
        slots_in_use: row.get(2),
        max_wal_senders: row.get(3),
        replication: row.get(4),
        superuser: row.get(5),
        user: row.get(6),
        database: row.get(7),
        can_create: row.get(8),
        version_num: row.get(9),
        synchronized_standby_slots: row.get(10),
        physical_slots: client
            .query(
                "SELECT slot_name::text, active FROM pg_replication_slots WHERE slot_type = 'physical'",
                &[],
            )
            .await
            .map_err(db("listing physical replication slots"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect(),
    };
    let table_row = client
        .query_opt(
            "SELECT c.oid, pg_has_role(c.relowner, 'USAGE') FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p') \
               AND has_schema_privilege(n.oid, 'USAGE')",
            &[&plan.schema, &plan.table],
        )
        .await
        .map_err(db("looking up the outbox table"))?;
    let table = match table_row {
        None => TableFacts {
            exists: false,
            columns: Vec::new(),
            timestamp_type: None,
            id_column: None,
            order_column: None,
            owned: false,
            missing_privileges: Vec::new(),
        },
        Some(row) => {
            let oid: u32 = row.get(0);
            let columns = client
                .query(
                    "SELECT attname::text FROM pg_attribute \
                     WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                    &[&oid],
                )
                .await
                .map_err(db("reading the outbox table's columns"))?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let timestamp_type = match plan
                .columns
                .iter()
                .find(|(field, _)| field == "table.columns.timestamp")
            {
                Some((_, column)) => client
                    .query_opt(
                        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                         WHERE attrelid = $1 AND attname = $2 AND attnum > 0 AND NOT attisdropped",
                        &[&oid, column],
                    )
                    .await
                    .map_err(db("reading the timestamp column's type"))?
                    .map(|r| r.get(0)),
                None => None,
            };
            let id_column = typed_column(client, oid, plan, "table.columns.id").await?;
            let order_column = typed_column(client, oid, plan, "table.columns.order").await?;
            let mut missing_privileges = Vec::new();
            for (privilege, why) in &plan.privileges {
                let has: bool = client
                    .query_one(
                        "SELECT has_table_privilege($1::oid, $2::text)",
                        &[&oid, privilege],
                    )
                    .await
                    .map_err(db("checking table privileges"))?
                    .get(0);
                if !has {
                    missing_privileges.push((*privilege, *why));
                }
            }
            TableFacts {
                exists: true,
                columns,
                timestamp_type,
                id_column,
                order_column,
                owned: row.get(1),
                missing_privileges,
            }
        }
    };
    let (mut slot, mut publication, mut other_markers) = (None, None, Vec::new());
    if let Some(lt) = &plan.log_tailing {
        slot = client
            .query_opt(
                // `failover` exists from PostgreSQL 17 on: read through jsonb, NULL before.
                "SELECT database::text, plugin::text, slot_type::text, \
                        (to_jsonb(s) ->> 'failover')::bool, \
                        CASE WHEN pg_is_in_recovery() THEN NULL \
                             ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 END, \
                        active \
                 FROM pg_replication_slots s WHERE slot_name = $1",
                &[&lt.slot],
            )
            .await
            .map_err(db("looking up the replication slot"))?
            .map(|r| SlotFacts {
                database: r.get(0),
                plugin: r.get(1),
                slot_type: r.get(2),
                failover: r.get(3),
                retained_wal_bytes: r.get(4),
                active: r.get(5),
            });
        publication = read_publication(client, &lt.publication, plan, server.version_num).await?;
        other_markers = super::list_marked(client)
            .await?
            .into_iter()
            .filter(|m| m.publication != lt.publication && m.marker.slot == lt.slot)
            .map(|m| m.marker)
            .collect();
    }
    let archive = match &plan.archive {
        Some(archive) if table.exists => {
            Some(super::archive::gather(client, archive, (&plan.schema, &plan.table)).await?)
        }
        _ => None,
    };
    Ok(Facts {
        server,
        table,
        slot,
        publication,
        unpublished_before_slot: None,
        other_markers,
        backlog: None,
        archive,
    })
}

/// The type (as `format_type` spells it) and NOT NULL of the column the plan names for
/// spec field `field`; `None` when the plan names none or the table lacks it.
async fn typed_column(
    client: &Client,
    oid: u32,
    plan: &Plan,
    field: &str,
) -> Result<Option<(String, bool)>, PgError> {
    let Some((_, column)) = plan.columns.iter().find(|(f, _)| f == field) else {
        return Ok(None);
    };
    Ok(client
        .query_opt(
            "SELECT format_type(atttypid, atttypmod), attnotnull FROM pg_attribute \
             WHERE attrelid = $1 AND attname = $2 AND attnum > 0 AND NOT attisdropped",
            &[&oid, column],
        )
        .await
        .map_err(db("reading a column's type"))?
        .map(|r| (r.get(0), r.get(1))))
}

async fn read_publication(
    client: &Client,
    publication: &str,
    plan: &Plan,
    version: i32,
) -> Result<Option<PublicationFacts>, PgError> {
    let found = client
        .query_opt(
            &format!(
                "SELECT p.pubinsert, {}, obj_description(p.oid, 'pg_publication') \
                 FROM pg_publication p WHERE p.pubname = $1",
                crate::postgres::replication::PUBLICATION_COVERS_TABLE
            ),
            &[&publication, &plan.schema, &plan.table],
        )
        .await
        .map_err(db("looking up the publication"))?
        .map(|r| PublicationFacts {
            publishes_insert: r.get(0),
            has_table: r.get(1),
            comment: r.get(2),
            identity: String::new(),
        });
    let Some(mut found) = found else {
        return Ok(None);
    };
    found.identity =
        crate::postgres::coverage::members(client, version, publication, &plan.schema, &plan.table)
            .await?
            .1;
    Ok(Some(found))
}
