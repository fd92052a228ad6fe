//! The archive table's preflight: what a relay that moves published rows there needs
//! (its columns, the time-of-move column, privileges), read by [`gather`] and judged by
//! [`check`], with the same column rule the relay builds its move from
//! ([`crate::postgres::removal::copied_columns`]).

use tokio_postgres::Client;

use super::{Check, Scope};
use crate::postgres::removal::{self, Column, Mismatch};
use crate::postgres::{PgError, db, quote};

/// The archive a relay moves published rows to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchivePlan {
    /// Its schema.
    pub schema: String,
    /// Its name.
    pub name: String,
    /// The time-of-move column (`table.columns.publishedAt`).
    pub moved_at: String,
}

/// Privileges the relay uses on the archive table, with why.
pub const PRIVILEGES: [(&str, &str); 3] = [
    ("INSERT", "published rows are moved there"),
    ("SELECT", "retention looks for old archived rows"),
    ("DELETE", "retention deletes old archived rows"),
];

/// What the server says about the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveFacts {
    /// The outbox table's columns.
    pub outbox: Vec<Column>,
    /// The archive's (none: it does not exist, or the role cannot see it).
    pub archive: Vec<Column>,
    /// Privileges of [`PRIVILEGES`] the role lacks on it.
    pub missing_privileges: Vec<(&'static str, &'static str)>,
}

/// Reads the archive's facts (read-only).
pub async fn gather(
    client: &Client,
    plan: &ArchivePlan,
    outbox: (&str, &str),
) -> Result<ArchiveFacts, PgError> {
    let outbox = removal::read_columns(client, outbox.0, outbox.1).await?;
    let archive = removal::read_columns(client, &plan.schema, &plan.name).await?;
    let mut missing_privileges = Vec::new();
    if !archive.is_empty() {
        for (privilege, why) in PRIVILEGES {
            let has: bool = client
                .query_one(
                    "SELECT has_table_privilege(format('%I.%I', $1::text, $2::text), $3::text)",
                    &[&plan.schema, &plan.name, &privilege],
                )
                .await
                .map_err(db("checking the archive table's privileges"))?
                .get(0);
            if !has {
                missing_privileges.push((privilege, why));
            }
        }
    }
    Ok(ArchiveFacts {
        outbox,
        archive,
        missing_privileges,
    })
}

/// The archive's check: it exists, takes every column of the outbox table, has a
/// timestamp column for the time of the move, and the role may use it; or what to run.
pub fn check(plan: &ArchivePlan, facts: &ArchiveFacts, outbox: &str, user: &str) -> Check {
    let name = format!("{}.{}", plan.schema, plan.name);
    let qualified = format!("{}.{}", quote(&plan.schema), quote(&plan.name));
    match removal::copied_columns(&facts.outbox, &facts.archive, &plan.moved_at) {
        Err(problems) if problems == [Mismatch::NoTable] => {
            let has_moved_at = facts.outbox.iter().any(|c| c.name == plan.moved_at);
            let create = if has_moved_at {
                format!("CREATE TABLE {qualified} (LIKE {outbox} INCLUDING DEFAULTS)")
            } else {
                format!(
                    "CREATE TABLE {qualified} (LIKE {outbox} INCLUDING DEFAULTS, {} timestamptz NOT NULL DEFAULT now())",
                    quote(&plan.moved_at)
                )
            };
            Check::fail(
                Scope::Database,
                "archive",
                "ArchiveNotFound",
                format!(
                    "archive table {name} (spec.table.archive) does not exist or role {user} cannot see it; run {create} (and CREATE INDEX ON {qualified} ({}) for retention), or name another in spec.table.archive",
                    quote(&plan.moved_at)
                ),
            )
        }
        Err(problems) => {
            let said: Vec<String> = problems.iter().map(ToString::to_string).collect();
            let fix = removal::fix_sql(&qualified, &problems);
            Check::fail(
                Scope::Database,
                "archive",
                "ArchiveColumns",
                format!(
                    "archive table {name} cannot take the rows of the outbox table: {}; {}",
                    said.join("; "),
                    if fix.is_empty() {
                        "give the archive the outbox table's columns and types".to_owned()
                    } else {
                        format!("run {fix}")
                    }
                ),
            )
        }
        Ok(_) if !facts.missing_privileges.is_empty() => {
            let names: Vec<&str> = facts.missing_privileges.iter().map(|(p, _)| *p).collect();
            let why: Vec<String> = facts
                .missing_privileges
                .iter()
                .map(|(p, w)| format!("{p}: {w}"))
                .collect();
            Check::fail(
                Scope::Database,
                "archive",
                "ArchivePermissionDenied",
                format!(
                    "role {user} lacks {} on archive table {name} ({}); run GRANT {} ON {qualified} TO {}",
                    names.join(", "),
                    why.join("; "),
                    names.join(", "),
                    quote(user)
                ),
            )
        }
        Ok(copied) => Check::pass(
            Scope::Database,
            "archive",
            "ArchiveReady",
            format!(
                "archive table {name} takes the outbox table's {} columns, with the time of the move in {}",
                copied.len(),
                plan.moved_at
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, ty: &str) -> Column {
        Column {
            name: name.to_owned(),
            ty: ty.to_owned(),
            generated: false,
        }
    }

    fn plan() -> ArchivePlan {
        ArchivePlan {
            schema: "public".to_owned(),
            name: "outbox_archive".to_owned(),
            moved_at: "published_at".to_owned(),
        }
    }

    fn facts() -> ArchiveFacts {
        let outbox = vec![col("id", "uuid"), col("payload", "jsonb")];
        let mut archive = outbox.clone();
        archive.push(col("published_at", "timestamp with time zone"));
        ArchiveFacts {
            outbox,
            archive,
            missing_privileges: Vec::new(),
        }
    }

    fn judged(facts: &ArchiveFacts) -> Check {
        check(&plan(), facts, "\"public\".\"outbox\"", "relay")
    }

    #[test]
    fn a_ready_archive_passes() {
        let c = judged(&facts());
        assert!(c.ok, "{}", c.message);
        assert_eq!(c.reason, "ArchiveReady");
        assert!(c.message.contains("2 columns"), "{}", c.message);
    }

    #[test]
    fn a_missing_archive_says_how_to_create_it() {
        let mut f = facts();
        f.archive.clear();
        let c = judged(&f);
        assert_eq!((c.ok, c.reason), (false, "ArchiveNotFound"));
        assert!(
            c.message.contains(
                "CREATE TABLE \"public\".\"outbox_archive\" (LIKE \"public\".\"outbox\" INCLUDING DEFAULTS, \"published_at\" timestamptz NOT NULL DEFAULT now())"
            ),
            "{}",
            c.message
        );
        // An outbox that has the column already (it was marking): LIKE copies it.
        f.outbox
            .push(col("published_at", "timestamp with time zone"));
        let c = judged(&f);
        assert!(
            c.message
                .contains("(LIKE \"public\".\"outbox\" INCLUDING DEFAULTS) (and"),
            "{}",
            c.message
        );
    }

    #[test]
    fn missing_columns_and_privileges_say_what_to_run() {
        let mut f = facts();
        f.archive.remove(1);
        let c = judged(&f);
        assert_eq!((c.ok, c.reason), (false, "ArchiveColumns"));
        assert!(
            c.message.contains(
                "run ALTER TABLE \"public\".\"outbox_archive\" ADD COLUMN \"payload\" jsonb"
            ),
            "{}",
            c.message
        );
        let mut f = facts();
        f.missing_privileges = vec![PRIVILEGES[0], PRIVILEGES[2]];
        let c = judged(&f);
        assert_eq!((c.ok, c.reason), (false, "ArchivePermissionDenied"));
        assert!(
            c.message
                .contains("run GRANT INSERT, DELETE ON \"public\".\"outbox_archive\" TO \"relay\""),
            "{}",
            c.message
        );
    }
}
