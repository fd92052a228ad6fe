//! What the controller (and `outbox-operator check`) does in PostgreSQL: the preflight
//! checks before a relay may start, creating or adopting the publication and the
//! logical replication slot, reading their state and the backlog for status, dropping
//! them on delete, and finding the ones whose OutboxRelay is gone.
//!
//! # Ownership marker
//!
//! PostgreSQL has no owner field on a replication slot, so the operator records what it
//! created in the publication's comment:
//!
//! ```text
//! outbox-operator {"namespace":"shop","name":"orders","uid":"…","slot":"x","publication":"created","slotOrigin":"created"}
//! ```
//!
//! `created` means the operator made the object and drops it on delete; `adopted` means
//! it existed before and is used but never dropped. A publication that carries someone
//! else's comment is used as is and never commented on (so nothing of it is dropped).
//! The comment is written *before* the slot is created, so a crash in between leaves a
//! marker pointing at a slot that does not exist (harmless) rather than an unmarked slot.

use serde::{Deserialize, Serialize};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::{PgError, db, quote};
use crate::api::AfterPublish;
use crate::postgres::replication::SlotStats;
use crate::spec::{ColumnNeed, ValidMode, ValidRelay};

/// Prefix of the publication comment that marks the operator's objects.
pub const MARKER_PREFIX: &str = "outbox-operator ";

/// Rows counted at most for `status.backlogRows`: a backlog this large is reported as
/// this number (the count stays cheap however large the table grows).
pub const BACKLOG_COUNT_LIMIT: i64 = 100_000;

/// How long one status query (backlog, age) may run before it is abandoned.
const STATUS_QUERY_TIMEOUT: &str = "2s";

/// Which part of the relay a check is about: its condition type in status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Connection, table, columns, privileges (`DatabaseReady`).
    Database,
    /// wal_level, replication, slots, publication (`SlotReady`).
    Slot,
}

/// One check's outcome, with a reason (PascalCase, for conditions) and a message that
/// names what to change when it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Condition the check belongs to.
    pub scope: Scope,
    /// Short name for `check` output (`wal_level`, `columns`, …).
    pub name: &'static str,
    /// Whether it passed.
    pub ok: bool,
    /// PascalCase reason.
    pub reason: &'static str,
    /// For people; on failure it says what to change.
    pub message: String,
}

impl Check {
    fn pass(scope: Scope, name: &'static str, reason: &'static str, message: String) -> Self {
        Self {
            scope,
            name,
            ok: true,
            reason,
            message,
        }
    }
    fn fail(scope: Scope, name: &'static str, reason: &'static str, message: String) -> Self {
        Self {
            scope,
            name,
            ok: false,
            reason,
            message,
        }
    }
}

/// The replication objects of a log-tailing relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotPlan {
    /// Slot name (`^[a-z0-9_]{1,63}$`).
    pub slot: String,
    /// Publication name (same rule).
    pub publication: String,
    /// Rows are deleted once published (the table holds the backlog).
    pub delete_after_publish: bool,
}

/// What a relay needs from its database, derived from the spec alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Schema of the outbox table.
    pub schema: String,
    /// The outbox table.
    pub table: String,
    /// The row id column.
    pub id: String,
    /// Required columns: (spec field, column).
    pub columns: Vec<(String, String)>,
    /// Insertion time (optional in the table; without it there is no age).
    pub created_at: String,
    /// The published-at column when polling marks rows.
    pub published_at: Option<String>,
    /// Table privileges the relay uses, with why.
    pub privileges: Vec<(&'static str, &'static str)>,
    /// Log tailing's slot and publication; `None` for polling.
    pub log_tailing: Option<SlotPlan>,
}

impl Plan {
    /// The plan for a parsed relay, from the column catalogue and the mode.
    pub fn for_relay(valid: &ValidRelay) -> Self {
        let t = &valid.table;
        let marking = matches!(
            &valid.mode,
            ValidMode::Polling(p) if p.after_publish == AfterPublish::Mark
        );
        let mut columns: Vec<(String, String)> = t
            .columns
            .catalogue()
            .into_iter()
            .filter(|(_, _, need)| match need {
                ColumnNeed::Always => true,
                ColumnNeed::Marking => marking,
                ColumnNeed::Optional => false,
            })
            .map(|(field, column, _)| {
                (
                    field.trim_start_matches("spec.").to_owned(),
                    column.to_owned(),
                )
            })
            .collect();
        let mut privileges = vec![("SELECT", "the relay reads the outbox table")];
        let mut published_at = None;
        let mut log_tailing = None;
        match &valid.mode {
            ValidMode::Polling(p) => match p.after_publish {
                AfterPublish::Mark => {
                    published_at = Some(t.columns.published_at.clone());
                    privileges.push(("UPDATE", "polling with afterPublish: mark sets it"));
                    privileges.push(("DELETE", "retention deletes old published rows"));
                }
                AfterPublish::Delete => {
                    privileges.push(("DELETE", "polling with afterPublish: delete"));
                }
            },
            ValidMode::LogTailing(l) => {
                if l.delete_after_publish {
                    privileges.push(("DELETE", "log tailing with deleteAfterPublish"));
                }
                log_tailing = Some(SlotPlan {
                    slot: l.slot.clone(),
                    publication: l.publication.clone(),
                    delete_after_publish: l.delete_after_publish,
                });
            }
        }
        for header in &t.headers {
            columns.push(("table.headers".to_owned(), header.clone()));
        }
        Self {
            schema: t.schema.clone(),
            table: t.name.clone(),
            id: t.columns.id.clone(),
            columns,
            created_at: t.columns.created_at.clone(),
            published_at,
            privileges,
            log_tailing,
        }
    }

    fn qualified(&self) -> String {
        format!("{}.{}", quote(&self.schema), quote(&self.table))
    }
}

/// Who a marker belongs to: the OutboxRelay's namespace, name and uid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// Namespace of the OutboxRelay.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid: a recreated relay of the same name is another relay.
    pub uid: String,
}

/// Whether the operator made an object or found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Origin {
    /// Made by the operator: dropped on delete.
    Created,
    /// Existed before: used, never dropped.
    Adopted,
}

/// The publication comment that records what the operator created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Marker {
    /// The OutboxRelay the objects belong to.
    #[serde(flatten)]
    pub owner: Owner,
    /// The slot's name.
    pub slot: String,
    /// Who made the publication.
    pub publication: Origin,
    /// Who made the slot.
    pub slot_origin: Origin,
}

impl Marker {
    /// The comment text.
    pub fn to_comment(&self) -> String {
        // Serializing plain strings and enums cannot fail.
        format!(
            "{MARKER_PREFIX}{}",
            serde_json::to_string(self).unwrap_or_default()
        )
    }

    /// Parses a comment; `None` when it is not the operator's.
    pub fn from_comment(comment: &str) -> Option<Self> {
        serde_json::from_str(comment.strip_prefix(MARKER_PREFIX)?).ok()
    }
}

/// A SQL string literal (`standard_conforming_strings` is on, so only quotes need
/// doubling).
pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `CREATE PUBLICATION` for inserts into the outbox table only.
pub fn create_publication_sql(publication: &str, schema: &str, table: &str) -> String {
    format!(
        "CREATE PUBLICATION {} FOR TABLE {}.{} WITH (publish = 'insert')",
        quote(publication),
        quote(schema),
        quote(table)
    )
}

/// `COMMENT ON PUBLICATION` with `comment` (or removing it).
pub fn comment_sql(publication: &str, comment: Option<&str>) -> String {
    format!(
        "COMMENT ON PUBLICATION {} IS {}",
        quote(publication),
        comment.map_or_else(|| "NULL".to_owned(), quote_literal)
    )
}

// ---------------------------------------------------------------------------------------
// Preflight checks

/// Facts about the server and the role, read once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerFacts {
    /// `wal_level`.
    pub wal_level: String,
    /// `max_replication_slots`.
    pub max_replication_slots: i32,
    /// Slots that exist now.
    pub slots_in_use: i32,
    /// `max_wal_senders`.
    pub max_wal_senders: i32,
    /// The role has REPLICATION.
    pub replication: bool,
    /// The role is a superuser.
    pub superuser: bool,
    /// The role's name.
    pub user: String,
    /// The database's name.
    pub database: String,
    /// May create publications (CREATE on the database).
    pub can_create: bool,
}

/// What the server says about the outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableFacts {
    /// The table exists and the role sees it.
    pub exists: bool,
    /// Its columns.
    pub columns: Vec<String>,
    /// The role owns it (or is a member of its owner): needed to create a publication.
    pub owned: bool,
    /// Privileges the plan asks for that the role lacks.
    pub missing_privileges: Vec<(&'static str, &'static str)>,
}

/// An existing slot of that name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotFacts {
    /// Its database (NULL for a physical slot).
    pub database: Option<String>,
    /// Its output plugin.
    pub plugin: Option<String>,
    /// `logical` or `physical`.
    pub slot_type: String,
}

/// An existing publication of that name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicationFacts {
    /// It publishes inserts.
    pub publishes_insert: bool,
    /// It includes the outbox table.
    pub has_table: bool,
    /// Its comment.
    pub comment: Option<String>,
}

/// Everything the checks look at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// Server and role.
    pub server: ServerFacts,
    /// The table.
    pub table: TableFacts,
    /// The slot, when one of that name exists (log tailing only).
    pub slot: Option<SlotFacts>,
    /// The publication, when one of that name exists (log tailing only).
    pub publication: Option<PublicationFacts>,
}

/// Reads what the checks need (read-only).
pub async fn gather(client: &Client, plan: &Plan) -> Result<Facts, PgError> {
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), \
                    current_setting('max_replication_slots')::int4, \
                    (SELECT count(*) FROM pg_replication_slots)::int4, \
                    current_setting('max_wal_senders')::int4, \
                    r.rolreplication, r.rolsuper, current_user::text, current_database()::text, \
                    has_database_privilege(current_database(), 'CREATE') \
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
                owned: row.get(1),
                missing_privileges,
            }
        }
    };
    let (mut slot, mut publication) = (None, None);
    if let Some(lt) = &plan.log_tailing {
        slot = client
            .query_opt(
                "SELECT database::text, plugin::text, slot_type::text \
                 FROM pg_replication_slots WHERE slot_name = $1",
                &[&lt.slot],
            )
            .await
            .map_err(db("looking up the replication slot"))?
            .map(|r| SlotFacts {
                database: r.get(0),
                plugin: r.get(1),
                slot_type: r.get(2),
            });
        publication = read_publication(client, &lt.publication, plan).await?;
    }
    Ok(Facts {
        server,
        table,
        slot,
        publication,
    })
}

async fn read_publication(
    client: &Client,
    publication: &str,
    plan: &Plan,
) -> Result<Option<PublicationFacts>, PgError> {
    Ok(client
        .query_opt(
            "SELECT p.pubinsert, EXISTS (SELECT 1 FROM pg_publication_tables t \
                 WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3), \
                 obj_description(p.oid, 'pg_publication') \
             FROM pg_publication p WHERE p.pubname = $1",
            &[&publication, &plan.schema, &plan.table],
        )
        .await
        .map_err(db("looking up the publication"))?
        .map(|r| PublicationFacts {
            publishes_insert: r.get(0),
            has_table: r.get(1),
            comment: r.get(2),
        }))
}

/// The checks, in order, from the facts (pure). Database checks come first; slot
/// checks only for log tailing.
pub fn evaluate(plan: &Plan, facts: &Facts) -> Vec<Check> {
    use Scope::{Database, Slot};
    let s = &facts.server;
    let t = &facts.table;
    let table = format!("{}.{}", plan.schema, plan.table);
    let mut checks = vec![Check::pass(
        Database,
        "connection",
        "Connected",
        format!("connected to database {} as {}", s.database, s.user),
    )];
    if !t.exists {
        checks.push(Check::fail(
            Database,
            "table",
            "TableNotFound",
            format!(
                "table {table} does not exist in database {} or role {} cannot see it; create it (see examples/schema.sql), grant USAGE on schema {} to {}, or fix spec.table",
                s.database, s.user, plan.schema, s.user
            ),
        ));
    } else {
        checks.push(Check::pass(
            Database,
            "table",
            "TableFound",
            format!("table {table} exists"),
        ));
        let missing: Vec<String> = plan
            .columns
            .iter()
            .filter(|(_, c)| !t.columns.contains(c))
            .map(|(field, c)| format!("{c} ({field})"))
            .collect();
        if missing.is_empty() {
            checks.push(Check::pass(
                Database,
                "columns",
                "ColumnsFound",
                format!("table {table} has every configured column"),
            ));
        } else {
            checks.push(Check::fail(
                Database,
                "columns",
                "ColumnMissing",
                format!(
                    "table {table} has no column {}; add the column or change the spec field named",
                    missing.join(", no column ")
                ),
            ));
        }
        if t.missing_privileges.is_empty() {
            let names: Vec<&str> = plan.privileges.iter().map(|(p, _)| *p).collect();
            checks.push(Check::pass(
                Database,
                "privileges",
                "PrivilegesGranted",
                format!("role {} has {} on {table}", s.user, names.join(", ")),
            ));
        } else {
            let names: Vec<&str> = t.missing_privileges.iter().map(|(p, _)| *p).collect();
            let why: Vec<String> = t
                .missing_privileges
                .iter()
                .map(|(p, w)| format!("{p}: {w}"))
                .collect();
            checks.push(Check::fail(
                Database,
                "privileges",
                "PermissionDenied",
                format!(
                    "role {} lacks {} on {table} ({}); run GRANT {} ON {} TO {}",
                    s.user,
                    names.join(", "),
                    why.join("; "),
                    names.join(", "),
                    plan.qualified(),
                    quote(&s.user)
                ),
            ));
        }
    }
    let Some(lt) = &plan.log_tailing else {
        return checks;
    };
    if s.wal_level == "logical" {
        checks.push(Check::pass(
            Slot,
            "wal_level",
            "WalLevelLogical",
            "wal_level is logical".to_owned(),
        ));
    } else {
        checks.push(Check::fail(
            Slot,
            "wal_level",
            "WalLevelNotLogical",
            format!(
                "wal_level is {}; set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL",
                s.wal_level
            ),
        ));
    }
    if s.replication || s.superuser {
        checks.push(Check::pass(
            Slot,
            "replication",
            "ReplicationAllowed",
            format!(
                "role {} may replicate ({})",
                s.user,
                if s.superuser {
                    "superuser"
                } else {
                    "REPLICATION"
                }
            ),
        ));
    } else {
        checks.push(Check::fail(
            Slot,
            "replication",
            "ReplicationNotAllowed",
            format!(
                "role {} has neither the REPLICATION attribute nor superuser; run ALTER ROLE {} REPLICATION (on managed services, grant the provider's replication role)",
                s.user,
                quote(&s.user)
            ),
        ));
    }
    if s.max_wal_senders < 1 {
        checks.push(Check::fail(
            Slot,
            "max_wal_senders",
            "NoWalSenders",
            "max_wal_senders is 0; set max_wal_senders to at least 1 in postgresql.conf and restart PostgreSQL".to_owned(),
        ));
    }
    match &facts.slot {
        Some(slot) => {
            let same_db = slot.database.as_deref() == Some(s.database.as_str());
            if slot.slot_type != "logical" || slot.plugin.as_deref() != Some("pgoutput") || !same_db
            {
                checks.push(Check::fail(
                    Slot,
                    "slot",
                    "SlotConflict",
                    format!(
                        "replication slot {} exists but is a {} slot{}{} and cannot be used; set another spec.mode.logTailing.slotName or drop that slot",
                        lt.slot,
                        slot.slot_type,
                        slot.plugin
                            .as_deref()
                            .map_or_else(String::new, |p| format!(" with plugin {p}")),
                        slot.database
                            .as_deref()
                            .map_or_else(String::new, |d| format!(" of database {d}")),
                    ),
                ));
            } else {
                checks.push(Check::pass(
                    Slot,
                    "slot",
                    "SlotExists",
                    format!("replication slot {} exists", lt.slot),
                ));
            }
        }
        None if s.slots_in_use >= s.max_replication_slots => checks.push(Check::fail(
            Slot,
            "slot",
            "NoFreeSlots",
            format!(
                "max_replication_slots is {} and {} slots exist, so slot {} cannot be created; raise max_replication_slots in postgresql.conf and restart PostgreSQL, or drop a slot no longer used",
                s.max_replication_slots, s.slots_in_use, lt.slot
            ),
        )),
        None => checks.push(Check::pass(
            Slot,
            "slot",
            "SlotCanBeCreated",
            format!(
                "slot {} will be created ({} of {} slots in use)",
                lt.slot, s.slots_in_use, s.max_replication_slots
            ),
        )),
    }
    match &facts.publication {
        Some(p) if !p.has_table || !p.publishes_insert => checks.push(Check::fail(
            Slot,
            "publication",
            "PublicationConflict",
            format!(
                "publication {} exists but does not publish inserts into {table}; run ALTER PUBLICATION {} ADD TABLE {} (and publish = 'insert'), or set another spec.mode.logTailing.publicationName",
                lt.publication,
                quote(&lt.publication),
                plan.qualified()
            ),
        )),
        Some(_) => checks.push(Check::pass(
            Slot,
            "publication",
            "PublicationExists",
            format!("publication {} publishes inserts into {table}", lt.publication),
        )),
        None if t.exists && !(s.superuser || (t.owned && s.can_create)) => {
            checks.push(Check::fail(
                Slot,
                "publication",
                "PublicationNotPermitted",
                format!(
                    "role {} cannot create publication {} (it needs CREATE on database {} and ownership of {table}); run CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert') as the table's owner, or grant those",
                    s.user,
                    lt.publication,
                    s.database,
                    quote(&lt.publication),
                    plan.qualified()
                ),
            ))
        }
        None => checks.push(Check::pass(
            Slot,
            "publication",
            "PublicationCanBeCreated",
            format!("publication {} will be created", lt.publication),
        )),
    }
    checks
}

/// The first failed check of a scope, if any.
pub fn first_failure(checks: &[Check], scope: Scope) -> Option<&Check> {
    checks.iter().find(|c| c.scope == scope && !c.ok)
}

// ---------------------------------------------------------------------------------------
// Create or adopt

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
    super::replication::slot_stats(client, slot).await
}

// ---------------------------------------------------------------------------------------
// Drop

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
/// adopted publication. Objects without this owner's marker are left alone. Idempotent:
/// what is already gone counts as dropped.
pub async fn drop_owned(
    client: &Client,
    slot: &str,
    publication: &str,
    owner: &Owner,
) -> Result<Dropped, PgError> {
    let mut out = Dropped::default();
    let comment: Option<Option<String>> = client
        .query_opt(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(db("looking up the publication"))?
        .map(|r| r.get(0));
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

// ---------------------------------------------------------------------------------------
// Orphans

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

// ---------------------------------------------------------------------------------------
// Backlog for status

/// Rows waiting (capped at [`BACKLOG_COUNT_LIMIT`]) and the oldest one's age in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backlog {
    /// Rows waiting to be published (at most the limit).
    pub rows: i64,
    /// Age of the oldest, when the table has the created-at column and rows wait.
    pub oldest_age_seconds: Option<f64>,
}

/// The backlog SQL for a plan: `None` when the table does not show it (log tailing
/// that keeps rows: every row stays in the table, published or not).
pub fn backlog_sql(plan: &Plan, has_created_at: bool) -> Option<(String, Option<String>)> {
    let filter = match (&plan.log_tailing, &plan.published_at) {
        (Some(lt), _) if !lt.delete_after_publish => return None,
        (_, Some(published_at)) => format!("WHERE {} IS NULL", quote(published_at)),
        _ => String::new(),
    };
    let table = plan.qualified();
    let count = format!(
        "SELECT count(*) FROM (SELECT 1 FROM {table} {filter} LIMIT {BACKLOG_COUNT_LIMIT}) b"
    );
    // Oldest by id: the id grows with insertion, and the primary key finds it without
    // reading every waiting row.
    let age = has_created_at.then(|| {
        format!(
            "SELECT extract(epoch FROM now() - {})::float8 FROM {table} {filter} ORDER BY {} LIMIT 1",
            quote(&plan.created_at),
            quote(&plan.id)
        )
    });
    Some((count, age))
}

/// Measures the backlog with short statement timeouts; `None` when the mode does not
/// show one in the table.
pub async fn backlog(client: &Client, plan: &Plan) -> Result<Option<Backlog>, PgError> {
    let has_created_at = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
             WHERE table_schema = $1 AND table_name = $2 AND column_name = $3)",
            &[&plan.schema, &plan.table, &plan.created_at],
        )
        .await
        .map_err(db("looking up the created-at column"))?
        .get(0);
    let Some((count_sql, age_sql)) = backlog_sql(plan, has_created_at) else {
        return Ok(None);
    };
    client
        .batch_execute(&format!(
            "SET statement_timeout = {}",
            quote_literal(STATUS_QUERY_TIMEOUT)
        ))
        .await
        .map_err(db("limiting the status queries"))?;
    let result = async {
        let rows: i64 = client
            .query_one(&count_sql, &[])
            .await
            .map_err(db("counting the backlog"))?
            .get(0);
        let oldest_age_seconds = match (&age_sql, rows) {
            (Some(sql), n) if n > 0 => client
                .query_opt(sql, &[])
                .await
                .map_err(db("measuring the oldest unpublished row"))?
                .and_then(|r| r.get::<_, Option<f64>>(0))
                .map(|a| a.max(0.0)),
            _ => None,
        };
        Ok(Some(Backlog {
            rows,
            oldest_age_seconds,
        }))
    }
    .await;
    let _ = client.batch_execute("RESET statement_timeout").await;
    result
}

/// An age for people: `0s`, `42s`, `4m12s`, `3h5m`, `2d4h`.
pub fn human_age(seconds: f64) -> String {
    // Whole seconds are enough for people; negative clock skew reads as 0s.
    let total = if seconds.is_finite() && seconds > 0.0 {
        seconds as u64
    } else {
        0
    };
    let (d, h, m, s) = (
        total / 86_400,
        total % 86_400 / 3600,
        total % 3600 / 60,
        total % 60,
    );
    if d > 0 {
        format!("{d}d{h}h")
    } else if h > 0 {
        format!("{h}h{m}m")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

/// Whether a connection error means the database (or its host) no longer exists, which
/// counts as cleaned up: there is nothing left to drop.
pub fn database_is_gone(err: &PgError) -> bool {
    let PgError::Db { source, .. } = err else {
        return false;
    };
    if source.code() == Some(&SqlState::INVALID_CATALOG_NAME) {
        return true;
    }
    // Name resolution failed: the host is gone (a refused or timed-out connection is
    // an outage, not a deletion, and is retried).
    let text = std::error::Error::source(source)
        .map(ToString::to_string)
        .unwrap_or_default()
        .to_lowercase();
    text.contains("failed to lookup address")
        || text.contains("name or service not known")
        || text.contains("no such host")
        || text.contains("nodename nor servname")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relay(yaml: &str) -> ValidRelay {
        let relay: crate::api::OutboxRelay = serde_yaml::from_str(yaml).unwrap();
        crate::spec::parse(&relay).unwrap_or_else(|e| panic!("{e}"))
    }

    const TAILING: &str = "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop, uid: u-1}
spec:
  database: {postgres: {connectionSecretRef: {name: db}}}
  table: {headers: [traceparent]}
  mode: {logTailing: {}}
  broker: {nats: {url: 'nats://n:4222'}}
";

    fn facts() -> Facts {
        Facts {
            server: ServerFacts {
                wal_level: "logical".to_owned(),
                max_replication_slots: 10,
                slots_in_use: 2,
                max_wal_senders: 10,
                replication: true,
                superuser: false,
                user: "app".to_owned(),
                database: "shop".to_owned(),
                can_create: true,
            },
            table: TableFacts {
                exists: true,
                columns: [
                    "id",
                    "aggregatetype",
                    "aggregateid",
                    "type",
                    "payload",
                    "traceparent",
                    "created_at",
                ]
                .map(str::to_owned)
                .to_vec(),
                owned: true,
                missing_privileges: Vec::new(),
            },
            slot: None,
            publication: None,
        }
    }

    #[test]
    fn a_log_tailing_plan_names_slot_publication_and_header_columns() {
        let plan = Plan::for_relay(&relay(TAILING));
        let lt = plan.log_tailing.clone().unwrap();
        assert_eq!(lt.slot, "outbox_shop_orders");
        assert_eq!(lt.publication, "outbox_shop_orders");
        assert!(
            plan.columns
                .contains(&("table.headers".to_owned(), "traceparent".to_owned()))
        );
        assert!(plan.privileges.iter().any(|(p, _)| *p == "DELETE"));
        assert!(evaluate(&plan, &facts()).iter().all(|c| c.ok));
    }

    #[test]
    fn replica_wal_level_names_the_setting_to_change() {
        let plan = Plan::for_relay(&relay(TAILING));
        let mut f = facts();
        f.server.wal_level = "replica".to_owned();
        let checks = evaluate(&plan, &f);
        let failed = first_failure(&checks, Scope::Slot).unwrap();
        assert_eq!(failed.reason, "WalLevelNotLogical");
        assert!(
            failed
                .message
                .contains("wal_level is replica; set wal_level = logical"),
            "{}",
            failed.message
        );
        assert!(first_failure(&checks, Scope::Database).is_none());
    }

    #[test]
    fn missing_columns_privileges_and_replication_are_named() {
        let plan = Plan::for_relay(&relay(TAILING));
        let mut f = facts();
        f.table.columns.retain(|c| c != "traceparent");
        f.table.missing_privileges = vec![("DELETE", "log tailing with deleteAfterPublish")];
        f.server.replication = false;
        let checks = evaluate(&plan, &f);
        let columns = checks.iter().find(|c| c.name == "columns").unwrap();
        assert!(!columns.ok);
        assert!(
            columns
                .message
                .contains("has no column traceparent (table.headers)"),
            "{}",
            columns.message
        );
        let privileges = checks.iter().find(|c| c.name == "privileges").unwrap();
        assert!(
            privileges
                .message
                .contains("GRANT DELETE ON \"public\".\"outbox\" TO \"app\""),
            "{}",
            privileges.message
        );
        let replication = first_failure(&checks, Scope::Slot).unwrap();
        assert_eq!(replication.reason, "ReplicationNotAllowed");
        assert!(
            replication
                .message
                .contains("ALTER ROLE \"app\" REPLICATION")
        );
    }

    #[test]
    fn full_slots_and_conflicting_objects_fail() {
        let plan = Plan::for_relay(&relay(TAILING));
        let mut f = facts();
        f.server.slots_in_use = 10;
        assert_eq!(
            first_failure(&evaluate(&plan, &f), Scope::Slot)
                .unwrap()
                .reason,
            "NoFreeSlots"
        );
        // An existing slot of ours needs no free one.
        f.slot = Some(SlotFacts {
            database: Some("shop".to_owned()),
            plugin: Some("pgoutput".to_owned()),
            slot_type: "logical".to_owned(),
        });
        assert!(first_failure(&evaluate(&plan, &f), Scope::Slot).is_none());
        f.slot = Some(SlotFacts {
            database: Some("other".to_owned()),
            plugin: Some("test_decoding".to_owned()),
            slot_type: "logical".to_owned(),
        });
        let failed = evaluate(&plan, &f);
        let failed = first_failure(&failed, Scope::Slot).unwrap();
        assert_eq!(failed.reason, "SlotConflict");
        assert!(
            failed.message.contains("test_decoding"),
            "{}",
            failed.message
        );
        f.slot = None;
        f.server.slots_in_use = 2;
        f.publication = Some(PublicationFacts {
            publishes_insert: true,
            has_table: false,
            comment: None,
        });
        assert_eq!(
            first_failure(&evaluate(&plan, &f), Scope::Slot)
                .unwrap()
                .reason,
            "PublicationConflict"
        );
    }

    #[test]
    fn a_missing_table_is_one_clear_failure() {
        let plan = Plan::for_relay(&relay(TAILING));
        let mut f = facts();
        f.table = TableFacts {
            exists: false,
            columns: Vec::new(),
            owned: false,
            missing_privileges: Vec::new(),
        };
        let checks = evaluate(&plan, &f);
        let failed = first_failure(&checks, Scope::Database).unwrap();
        assert_eq!(failed.reason, "TableNotFound");
        assert!(failed.message.contains("public.outbox does not exist"));
        assert!(!checks.iter().any(|c| c.name == "columns"));
    }

    #[test]
    fn markers_round_trip_and_foreign_comments_are_not_markers() {
        let marker = Marker {
            owner: Owner {
                namespace: "shop".to_owned(),
                name: "o'rders".to_owned(),
                uid: "u-1".to_owned(),
            },
            slot: "outbox_shop_orders".to_owned(),
            publication: Origin::Created,
            slot_origin: Origin::Adopted,
        };
        let comment = marker.to_comment();
        assert!(comment.starts_with(MARKER_PREFIX));
        assert_eq!(Marker::from_comment(&comment), Some(marker));
        assert_eq!(Marker::from_comment("made by hand"), None);
        assert_eq!(Marker::from_comment("outbox-operator not json"), None);
        let sql = comment_sql("p", Some(&comment));
        assert!(
            sql.starts_with("COMMENT ON PUBLICATION \"p\" IS '"),
            "{sql}"
        );
        assert!(sql.contains("o''rders"), "{sql}");
        assert_eq!(
            comment_sql("p", None),
            "COMMENT ON PUBLICATION \"p\" IS NULL"
        );
        assert_eq!(
            create_publication_sql("p", "public", "outbox"),
            "CREATE PUBLICATION \"p\" FOR TABLE \"public\".\"outbox\" WITH (publish = 'insert')"
        );
    }

    #[test]
    fn backlog_queries_follow_the_mode() {
        let mark = relay(&TAILING.replace("{logTailing: {}}", "{polling: {}}"));
        let (count, age) = backlog_sql(&Plan::for_relay(&mark), true).unwrap();
        assert!(
            count.contains("WHERE \"published_at\" IS NULL LIMIT 100000"),
            "{count}"
        );
        assert!(age.unwrap().contains("ORDER BY \"id\" LIMIT 1"));
        let (_, age) = backlog_sql(&Plan::for_relay(&mark), false).unwrap();
        assert!(age.is_none());
        let delete =
            relay(&TAILING.replace("{logTailing: {}}", "{polling: {afterPublish: delete}}"));
        let (count, _) = backlog_sql(&Plan::for_relay(&delete), true).unwrap();
        assert!(!count.contains("WHERE"), "{count}");
        // Log tailing that deletes rows: the table is the backlog.
        assert!(backlog_sql(&Plan::for_relay(&relay(TAILING)), true).is_some());
        let keep = relay(&TAILING.replace(
            "{logTailing: {}}",
            "{logTailing: {deleteAfterPublish: false}}",
        ));
        assert!(backlog_sql(&Plan::for_relay(&keep), true).is_none());
    }

    #[test]
    fn ages_read_like_people_write_them() {
        assert_eq!(human_age(0.4), "0s");
        assert_eq!(human_age(-3.0), "0s");
        assert_eq!(human_age(42.0), "42s");
        assert_eq!(human_age(252.0), "4m12s");
        assert_eq!(human_age(3.0 * 3600.0 + 300.0), "3h5m");
        assert_eq!(human_age(2.0 * 86_400.0 + 4.0 * 3600.0), "2d4h");
    }
}
