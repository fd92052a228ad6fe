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
//!
//! # Submodules
//!
//! This module holds the shared types (the [`Plan`], the [`Marker`], the preflight
//! [`Facts`], a [`Check`]) and the SQL builders; each concern lives in a submodule
//! below it and is re-exported here: reading the facts (`facts`), judging them
//! (`checks`), the slot's presence and state (`slot`), dropping (`drop`), marked
//! publications (`orphans`) and the backlog for status (`backlog`).

pub mod archive;
mod backlog;
mod checks;
mod drop;
mod facts;
mod handover;
mod marker_lock;
mod orphans;
mod slot;

pub use backlog::{
    BACKLOG_COUNT_LIMIT, Backlog, Pacing, backlog, backlog_sql, dead_letter_rows, human_age,
};
pub use checks::{evaluate, first_failure};
pub use drop::{Dropped, database_is_gone, drop_owned, drop_slot_over_budget, hand_over};
pub use facts::gather;
pub use handover::{handover_snapshot, unpublished_before};
pub use marker_lock::{current_comment, with_marker_lock};
pub use orphans::{Marked, list_marked};
pub use slot::{replication_objects_exist, slot_state};

use serde::{Deserialize, Serialize};

use super::quote;
use crate::api::AfterPublish;
use crate::spec::{ColumnNeed, ValidMode, ValidRelay};
pub use archive::{ArchiveFacts, ArchivePlan};

/// Prefix of the publication comment that marks the operator's objects.
pub const MARKER_PREFIX: &str = "outbox-operator ";

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
    /// The published-at column's name whatever the mode: where the table has it, a row
    /// with it set is published (rows polling marked before a switch to log tailing),
    /// and the backlog and the handover count only rows where it is NULL.
    pub marker: String,
    /// Table privileges the relay uses, with why.
    pub privileges: Vec<(&'static str, &'static str)>,
    /// Log tailing's slot and publication; `None` for polling.
    pub log_tailing: Option<SlotPlan>,
    /// The archive published rows move to (`spec.table.archive`).
    pub archive: Option<ArchivePlan>,
    /// The dead-letter table (in the outbox table's schema).
    pub dead_letter: String,
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
                AfterPublish::Delete | AfterPublish::Archive => {
                    privileges.push((
                        "UPDATE",
                        "polling locks a batch's rows (SELECT … FOR UPDATE SKIP LOCKED)",
                    ));
                    privileges.push((
                        "DELETE",
                        if p.after_publish == AfterPublish::Delete {
                            "polling with afterPublish: delete"
                        } else {
                            "polling with afterPublish: archive moves rows out"
                        },
                    ));
                }
            },
            ValidMode::LogTailing(l) => {
                if l.delete_after_publish {
                    privileges.push(("DELETE", "log tailing with deleteAfterPublish"));
                    privileges.push((
                        "UPDATE",
                        "before a new slot streams, a polling relay back-fills the rows committed earlier (SELECT … FOR UPDATE)",
                    ));
                }
                if l.sweep.is_some() {
                    columns.push((
                        "table.columns.createdAt".to_owned(),
                        t.columns.created_at.clone(),
                    ));
                }
                log_tailing = Some(SlotPlan {
                    slot: l.slot.clone(),
                    publication: l.publication.clone(),
                    delete_after_publish: l.delete_after_publish,
                });
            }
        }
        if let Some(timestamp) = &t.columns.timestamp {
            columns.push(("table.columns.timestamp".to_owned(), timestamp.clone()));
        }
        if let Some(order) = &t.columns.order {
            columns.push(("table.columns.order".to_owned(), order.clone()));
        }
        for header in &t.headers {
            columns.push(("table.headers".to_owned(), header.clone()));
        }
        for field in &t.additional {
            columns.push(("table.additionalFields".to_owned(), field.column.clone()));
        }
        Self {
            schema: t.schema.clone(),
            table: t.name.clone(),
            id: t.columns.id.clone(),
            columns,
            created_at: t.columns.created_at.clone(),
            published_at,
            marker: t.columns.published_at.clone(),
            privileges,
            log_tailing,
            archive: t.archive.as_ref().map(|a| ArchivePlan {
                schema: a.schema.clone(),
                name: a.name.clone(),
                moved_at: t.columns.published_at.clone(),
            }),
            dead_letter: valid.dead_letter_table(),
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

/// `CREATE PUBLICATION` for inserts into the outbox table only. A partitioned table's
/// rows are published under the table's own name (`publish_via_partition_root`), not
/// under each partition's.
pub fn create_publication_sql(publication: &str, schema: &str, table: &str) -> String {
    format!(
        "CREATE PUBLICATION {} FOR TABLE {}.{} WITH (publish = 'insert', publish_via_partition_root = true)",
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
// Preflight facts: read by [`gather`], judged by [`evaluate`]

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
    /// `server_version_num` (170000 and up have failover slots).
    pub version_num: i32,
    /// `synchronized_standby_slots` (PostgreSQL 17+; empty when unset or older).
    pub synchronized_standby_slots: String,
    /// Physical slots on the server (the standbys'), with whether one streams now.
    pub physical_slots: Vec<(String, bool)>,
}

/// The first PostgreSQL release with failover slots.
pub const FAILOVER_SLOTS_SINCE: i32 = 170_000;

impl ServerFacts {
    /// Whether slots can be made to survive a failover.
    pub fn has_failover_slots(&self) -> bool {
        self.version_num >= FAILOVER_SLOTS_SINCE
    }

    /// The slots `synchronized_standby_slots` names.
    pub fn standby_slots(&self) -> Vec<String> {
        self.synchronized_standby_slots
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            // As PostgreSQL reads identifiers: quoted as written, unquoted folded.
            .map(
                |s| match s.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
                    Some(quoted) => quoted.replace("\"\"", "\""),
                    None => s.to_lowercase(),
                },
            )
            .collect()
    }

    /// The major version as people say it (`15`, `18`).
    pub fn major(&self) -> i32 {
        self.version_num / 10_000
    }
}

/// What the server says about the outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableFacts {
    /// The table exists and the role sees it.
    pub exists: bool,
    /// Its columns.
    pub columns: Vec<String>,
    /// The type of the `table.columns.timestamp` column, as `format_type` spells it.
    pub timestamp_type: Option<String>,
    /// The id column's type (as `format_type` spells it) and whether it is NOT NULL;
    /// `None` when the column is missing.
    pub id_column: Option<(String, bool)>,
    /// The `table.columns.order` column's type and NOT NULL, when the spec names one
    /// and the table has it.
    pub order_column: Option<(String, bool)>,
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
    /// Its `failover` flag (PostgreSQL 17+; `None` on older servers).
    pub failover: Option<bool>,
    /// WAL it retains on the server, bytes (current WAL position minus `restart_lsn`;
    /// `None` on a standby or before the slot reserved WAL).
    pub retained_wal_bytes: Option<i64>,
    /// A walsender streams it.
    pub active: bool,
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
    /// What makes it publish the table ([`crate::postgres::coverage::Coverage::identity`]).
    pub identity: String,
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
    /// While switching from polling to log tailing: unpublished rows committed before
    /// the slot was created (`None`: not counted).
    pub unpublished_before_slot: Option<i64>,
    /// Markers of *other* publications of this database that name the slot (another
    /// relay with the same `slotName` but its own publication).
    pub other_markers: Vec<Marker>,
    /// While a log-tailing relay polls after passing its WAL budget: the rows waiting
    /// (`None`: not measured).
    pub backlog: Option<BacklogFacts>,
    /// The archive, when the plan has one and the outbox table exists.
    pub archive: Option<ArchiveFacts>,
}

/// The rows waiting to be published, as the return from a fall back looks at them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BacklogFacts {
    /// Rows waiting (at most the backlog query's limit).
    pub rows: i64,
    /// Age of the oldest, whole seconds (`None`: no `createdAt` column, or none waits).
    pub oldest_age_seconds: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn relay(yaml: &str) -> ValidRelay {
        let relay: crate::api::OutboxRelay = serde_yaml::from_str(yaml).unwrap();
        crate::spec::parse(&relay).unwrap_or_else(|e| panic!("{e}"))
    }

    pub(super) const TAILING: &str = "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop, uid: u-1}
spec:
  database: {postgres: {connectionSecretRef: {name: db}}}
  table: {headers: [traceparent]}
  mode: {logTailing: {}}
  broker: {nats: {url: 'nats://n:4222'}}
";

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
            "CREATE PUBLICATION \"p\" FOR TABLE \"public\".\"outbox\" WITH (publish = 'insert', publish_via_partition_root = true)"
        );
    }
}
