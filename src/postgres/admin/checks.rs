//! The preflight checks: what the [`Facts`] mean for a [`Plan`], as [`Check`]s with a
//! message naming what to change (pure: no client).

use super::{Check, Facts, Plan, Scope};
use crate::postgres::quote;
use crate::postgres::table::IdKind;

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
        let wrong_type = t.timestamp_type.as_deref().filter(|ty| {
            !matches!(
                *ty,
                "timestamp with time zone" | "timestamp without time zone"
            ) && !ty.starts_with("timestamp(")
        });
        if let Some(ty) = wrong_type {
            checks.push(Check::fail(
                Database,
                "columns",
                "ColumnType",
                format!(
                    "column {} of table {table} (table.columns.timestamp) is {ty}; it must be timestamp with time zone or timestamp (read as UTC)",
                    plan.columns
                        .iter()
                        .find(|(f, _)| f == "table.columns.timestamp")
                        .map_or("", |(_, c)| c.as_str())
                ),
            ));
        } else if missing.is_empty() {
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
        if let Some(check) = id_check(&table, plan, &t.columns, t.id_column.as_ref()) {
            checks.push(check);
        }
        if let Some(check) = order_check(&table, plan, t.order_column.as_ref()) {
            checks.push(check);
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
    if let (Some(archive), Some(archive_facts)) = (&plan.archive, &facts.archive) {
        checks.push(super::archive::check(
            archive,
            archive_facts,
            &plan.qualified(),
            &s.user,
        ));
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

/// Whether the relays can read the id column (`id_column`: its type and NOT NULL): an
/// integer, uuid or text id that is never NULL; polling a uuid or text id also needs the
/// created-at column to order rows by. `None` when the column is missing (the columns check
/// says so).
fn id_check(
    table: &str,
    plan: &Plan,
    columns: &[String],
    id_column: Option<&(String, bool)>,
) -> Option<Check> {
    let (ty, not_null) = id_column?;
    let column = plan
        .columns
        .iter()
        .find(|(f, _)| f == "table.columns.id")
        .map_or("", |(_, c)| c.as_str());
    let kind = IdKind::of_type(ty);
    Some(if kind.is_none() {
        Check::fail(
            Scope::Database,
            "id",
            "IdColumnType",
            format!(
                "column {column} of table {table} (table.columns.id) is {ty}; the relay reads integer (bigint, integer, smallint), uuid and text (text, varchar) ids: change the column's type, or add an id column of one of those types and name it in spec.table.columns.id"
            ),
        )
    } else if kind != Some(IdKind::Int)
        && plan
            .log_tailing
            .as_ref()
            .is_none_or(|lt| lt.delete_after_publish)
        && !columns.contains(&plan.created_at)
        && named(plan, "table.columns.order").is_none()
    {
        Check::fail(
            Scope::Database,
            "id",
            "IdColumnOrder",
            format!(
                "column {column} of table {table} (table.columns.id) is {ty}, which says nothing of when a row was written, so a polling relay (the mode, or log tailing's back-fill and fall-back relays with deleteAfterPublish) orders rows by table.columns.createdAt ({created}), which the table lacks: ALTER TABLE {table} ADD COLUMN {created} timestamptz NOT NULL DEFAULT clock_timestamp(), or name a column that grows with insertion in spec.table.columns.order (or tail the log keeping rows, which streams in commit order)",
                created = plan.created_at
            ),
        )
    } else if !not_null {
        Check::fail(
            Scope::Database,
            "id",
            "IdColumnNullable",
            format!(
                "column {column} of table {table} (table.columns.id) may be NULL; every row needs an id (it is the message id): ALTER TABLE {table} ALTER COLUMN {column} SET NOT NULL, or make it the primary key"
            ),
        )
    } else {
        Check::pass(
            Scope::Database,
            "id",
            "IdColumnUsable",
            format!("column {column} of table {table} is a {ty} that is never NULL"),
        )
    })
}

/// The column the plan names for spec field `field`.
fn named<'a>(plan: &'a Plan, field: &str) -> Option<&'a str> {
    plan.columns
        .iter()
        .find(|(f, _)| f == field)
        .map(|(_, c)| c.as_str())
}

/// Whether polling can order rows by the `table.columns.order` column (`order_column`:
/// its type and NOT NULL): an integer or a timestamp that is never NULL. `None` when the
/// spec names none or the column is missing (the columns check says so).
fn order_check(table: &str, plan: &Plan, order_column: Option<&(String, bool)>) -> Option<Check> {
    let (ty, not_null) = order_column?;
    let column = named(plan, "table.columns.order").unwrap_or_default();
    let orders =
        crate::postgres::table::ORDER_TYPES.contains(&ty.as_str()) || ty.starts_with("timestamp(");
    Some(if !orders {
        Check::fail(
            Scope::Database,
            "order",
            "OrderColumnType",
            format!(
                "column {column} of table {table} (table.columns.order) is {ty}; polling orders rows by it, so it must grow with insertion: an integer (ALTER TABLE {table} ADD COLUMN seq bigserial) or a timestamp (ADD COLUMN … timestamptz NOT NULL DEFAULT clock_timestamp()), named in spec.table.columns.order"
            ),
        )
    } else if !not_null {
        Check::fail(
            Scope::Database,
            "order",
            "OrderColumnNullable",
            format!(
                "column {column} of table {table} (table.columns.order) may be NULL, and a row without it has no place in the order: ALTER TABLE {table} ALTER COLUMN {column} SET NOT NULL"
            ),
        )
    } else {
        Check::pass(
            Scope::Database,
            "order",
            "OrderColumnUsable",
            format!("polling orders rows of {table} by column {column} ({ty}), then by id"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{TAILING, relay};
    use super::super::{PublicationFacts, ServerFacts, SlotFacts, TableFacts};
    use super::*;

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
                version_num: 150_000,
                synchronized_standby_slots: String::new(),
                physical_slots: Vec::new(),
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
                timestamp_type: None,
                id_column: Some(("bigint".into(), true)),
                order_column: None,
                owned: true,
                missing_privileges: Vec::new(),
            },
            slot: None,
            publication: None,
            unpublished_before_slot: None,
            other_markers: Vec::new(),
            backlog: None,
            archive: None,
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
            failover: None,
            retained_wal_bytes: None,
            active: false,
        });
        assert!(first_failure(&evaluate(&plan, &f), Scope::Slot).is_none());
        f.slot = Some(SlotFacts {
            database: Some("other".to_owned()),
            plugin: Some("test_decoding".to_owned()),
            slot_type: "logical".to_owned(),
            failover: None,
            retained_wal_bytes: None,
            active: false,
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
            identity: String::new(),
        });
        assert_eq!(
            first_failure(&evaluate(&plan, &f), Scope::Slot)
                .unwrap()
                .reason,
            "PublicationConflict"
        );
    }

    #[test]
    fn a_timestamp_column_of_another_type_is_refused() {
        let yaml = TAILING.replace(
            "table: {headers: [traceparent]}",
            "table: {headers: [traceparent], columns: {timestamp: created_at}}",
        );
        let plan = Plan::for_relay(&relay(&yaml));
        for (ty, ok) in [
            ("timestamp with time zone", true),
            ("timestamp(3) without time zone", true),
            ("bigint", false),
            ("text", false),
        ] {
            let mut f = facts();
            f.table.timestamp_type = Some(ty.to_owned());
            let checks = evaluate(&plan, &f);
            let failed = first_failure(&checks, Scope::Database);
            assert_eq!(failed.is_none(), ok, "{ty}: {failed:?}");
            if let Some(failed) = failed {
                assert_eq!(failed.reason, "ColumnType");
                assert!(failed.message.contains(ty), "{}", failed.message);
            }
        }
    }

    #[test]
    fn ids_the_relay_cannot_read_or_order_are_refused_with_the_fix() {
        let mut tailing = Plan::for_relay(&relay(TAILING));
        let mut polling = tailing.clone();
        polling.log_tailing = None;
        // Log tailing that deletes rows runs polling relays at times (the back-fill).
        let deleting = tailing.clone();
        if let Some(lt) = tailing.log_tailing.as_mut() {
            lt.delete_after_publish = false;
        }
        let id = |plan: &Plan, f: &Facts| {
            evaluate(plan, f)
                .into_iter()
                .find(|c| c.name == "id")
                .unwrap()
        };
        let mut f = facts();
        for ty in crate::postgres::table::ID_TYPES {
            f.table.id_column = Some((ty.to_owned(), true));
            assert!(id(&tailing, &f).ok, "{ty}");
            assert!(id(&polling, &f).ok, "{ty}: the table has created_at");
        }
        f.table.id_column = Some(("numeric".into(), true));
        let check = id(&tailing, &f);
        assert_eq!((check.ok, check.reason), (false, "IdColumnType"));
        // Debezium's own table has no created_at: log tailing streams it in commit
        // order; the poller has nothing to order a uuid id by.
        f.table.id_column = Some(("uuid".into(), true));
        f.table.columns.retain(|c| c != "created_at");
        assert!(id(&tailing, &f).ok);
        assert_eq!(id(&deleting, &f).reason, "IdColumnOrder");
        let check = id(&polling, &f);
        assert_eq!((check.ok, check.reason), (false, "IdColumnOrder"));
        assert!(
            check.message.contains("ADD COLUMN created_at timestamptz"),
            "{}",
            check.message
        );
        f.table.id_column = Some(("bigint".into(), true));
        assert!(id(&polling, &f).ok, "an integer id orders the rows itself");
        f.table.id_column = Some(("bigint".into(), false));
        let check = id(&tailing, &f);
        assert_eq!((check.ok, check.reason), (false, "IdColumnNullable"));
        assert!(check.message.contains("SET NOT NULL"), "{}", check.message);
        assert_eq!(
            first_failure(&evaluate(&tailing, &f), Scope::Database).map(|c| c.reason),
            Some("IdColumnNullable")
        );
    }

    #[test]
    fn a_named_order_column_orders_a_uuid_table_without_created_at_if_it_can() {
        let mut polling = Plan::for_relay(&relay(&TAILING.replace(
            "table: {headers: [traceparent]}",
            "table: {headers: [traceparent], columns: {order: seq}}",
        )));
        polling.log_tailing = None;
        let named =
            |f: &Facts, name: &str| evaluate(&polling, f).into_iter().find(|c| c.name == name);
        let mut f = facts();
        f.table.id_column = Some(("uuid".into(), true));
        f.table.columns.retain(|c| c != "created_at");
        f.table.columns.push("seq".into());
        // The order column is missing: the columns check names it, no order check.
        f.table.order_column = None;
        assert!(named(&f, "order").is_none());
        for (ty, not_null, reason) in [
            ("bigint", true, "OrderColumnUsable"),
            ("timestamp with time zone", true, "OrderColumnUsable"),
            ("timestamp(3) without time zone", true, "OrderColumnUsable"),
            ("text", true, "OrderColumnType"),
            ("uuid", true, "OrderColumnType"),
            ("bigint", false, "OrderColumnNullable"),
        ] {
            f.table.order_column = Some((ty.to_owned(), not_null));
            let check = named(&f, "order").expect("an order check");
            assert_eq!(check.reason, reason, "{ty}: {}", check.message);
            assert_eq!(check.ok, reason == "OrderColumnUsable");
            // With an order column named, the uuid id needs no created_at.
            assert!(named(&f, "id").is_some_and(|c| c.ok), "{ty}");
        }
        assert!(
            polling
                .columns
                .contains(&("table.columns.order".to_owned(), "seq".to_owned())),
            "the columns check looks for it"
        );
    }

    #[test]
    fn a_missing_table_is_one_clear_failure() {
        let plan = Plan::for_relay(&relay(TAILING));
        let mut f = facts();
        f.table = TableFacts {
            exists: false,
            columns: Vec::new(),
            timestamp_type: None,
            id_column: None,
            order_column: None,
            owned: false,
            missing_privileges: Vec::new(),
        };
        let checks = evaluate(&plan, &f);
        let failed = first_failure(&checks, Scope::Database).unwrap();
        assert_eq!(failed.reason, "TableNotFound");
        assert!(failed.message.contains("public.outbox does not exist"));
        assert!(!checks.iter().any(|c| c.name == "columns"));
    }
}
