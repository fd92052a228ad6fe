//! How published rows leave the outbox table: deleted, or moved to the archive table
//! (`afterPublish: archive`, or log tailing's deletes with `spec.table.archive`) with
//! the time of the move. The move is one statement — a `DELETE … RETURNING` feeding an
//! `INSERT` — inside whatever transaction takes the rows out, so at every moment a row
//! is in exactly one of the two tables, and a row already moved (a redelivery after a
//! crash) is neither deleted nor archived twice. Retention trims the archive by the time
//! of the move.

use std::time::Duration;

use tokio_postgres::{Client, GenericClient};

use super::ids::{IdKind, id_param};
use super::{PgError, RowId, db, quote};
use crate::spec::Archive;

/// The column types the archive's time-of-move column may have (`format_type`).
const MOVED_AT_TYPES: [&str; 2] = ["timestamp with time zone", "timestamp without time zone"];

/// A column as the catalogue describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Its name.
    pub name: String,
    /// Its type, as `format_type` spells it.
    pub ty: String,
    /// A generated column (its value is computed, never inserted).
    pub generated: bool,
}

/// Why the archive cannot take the outbox table's rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// The archive table does not exist (or the role cannot see it).
    NoTable,
    /// A column of the outbox table the archive lacks.
    Missing { column: String, ty: String },
    /// A column both have, of different types.
    Type {
        column: String,
        outbox: String,
        archive: String,
    },
    /// The time-of-move column (`columns.publishedAt`) is missing (`None`) or not a
    /// timestamp (its type).
    MovedAt { column: String, ty: Option<String> },
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoTable => write!(f, "the table does not exist or the role cannot see it"),
            Self::Missing { column, ty } => write!(f, "it has no column {column} ({ty})"),
            Self::Type {
                column,
                outbox,
                archive,
            } => write!(
                f,
                "column {column} is {archive} there but {outbox} in the outbox table"
            ),
            Self::MovedAt { column, ty: None } => write!(
                f,
                "it has no column {column} (table.columns.publishedAt) for the time a row was archived"
            ),
            Self::MovedAt {
                column,
                ty: Some(ty),
            } => write!(
                f,
                "its column {column} (table.columns.publishedAt) is {ty}, not a timestamp"
            ),
        }
    }
}

/// The statement that makes an archive able to take the rows (one per mismatch; none
/// for a type mismatch, which needs a person to decide).
pub fn fix_sql(archive: &str, mismatches: &[Mismatch]) -> String {
    let lines: Vec<String> = mismatches
        .iter()
        .filter_map(|m| match m {
            Mismatch::Missing { column, ty } => Some(format!(
                "ALTER TABLE {archive} ADD COLUMN {} {ty}",
                quote(column)
            )),
            Mismatch::MovedAt { column, ty: None } => Some(format!(
                "ALTER TABLE {archive} ADD COLUMN {} timestamptz NOT NULL DEFAULT now()",
                quote(column)
            )),
            _ => None,
        })
        .collect();
    lines.join("; ")
}

/// The outbox columns copied into the archive: every one but the time-of-move column
/// (`moved_at`, set by the move) and those the archive computes itself (generated
/// there); or everything that keeps the archive from taking the rows.
pub fn copied_columns(
    outbox: &[Column],
    archive: &[Column],
    moved_at: &str,
) -> Result<Vec<String>, Vec<Mismatch>> {
    if archive.is_empty() {
        return Err(vec![Mismatch::NoTable]);
    }
    let mut copied = Vec::new();
    let mut problems = Vec::new();
    for column in outbox.iter().filter(|c| c.name != moved_at) {
        match archive.iter().find(|a| a.name == column.name) {
            None => problems.push(Mismatch::Missing {
                column: column.name.clone(),
                ty: column.ty.clone(),
            }),
            Some(a) if a.generated => {}
            Some(a) if a.ty != column.ty => problems.push(Mismatch::Type {
                column: column.name.clone(),
                outbox: column.ty.clone(),
                archive: a.ty.clone(),
            }),
            Some(_) => copied.push(column.name.clone()),
        }
    }
    match archive.iter().find(|a| a.name == moved_at) {
        Some(a) if MOVED_AT_TYPES.contains(&a.ty.as_str()) || a.ty.starts_with("timestamp(") => {}
        found => problems.push(Mismatch::MovedAt {
            column: moved_at.to_owned(),
            ty: found.map(|a| a.ty.clone()),
        }),
    }
    if problems.is_empty() {
        Ok(copied)
    } else {
        Err(problems)
    }
}

/// The columns of `schema.table` in order (none when it does not exist).
pub async fn read_columns(
    client: &impl GenericClient,
    schema: &str,
    table: &str,
) -> Result<Vec<Column>, PgError> {
    Ok(client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attgenerated <> '' \
             FROM pg_attribute a \
             WHERE a.attrelid = to_regclass(format('%I.%I', $1::text, $2::text)) \
               AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            &[&schema, &table],
        )
        .await
        .map_err(db("reading a table's columns"))?
        .iter()
        .map(|r| Column {
            name: r.get(0),
            ty: r.get(1),
            generated: r.get(2),
        })
        .collect())
}

/// `schema.name`, quoted.
fn qualified(schema: &str, name: &str) -> String {
    format!("{}.{}", quote(schema), quote(name))
}

/// `$1` as an array of the id column's type (the cast is on the parameter, so the id's
/// index serves the comparison).
pub fn id_array(kind: IdKind) -> String {
    match kind {
        IdKind::Int => "$1::int8[]".to_owned(),
        IdKind::Text { cast } => format!("$1::text[]::{cast}[]"),
    }
}

/// The statement that deletes rows by id (`$1`) from `outbox`.
///
/// The id column is compared as it is, never cast: `id::int8 = ANY(…)` on an `integer`
/// or `smallint` id is an expression the primary key cannot serve, and every chunk
/// became a sequential scan of the whole table. PostgreSQL compares the integer types
/// with each other inside one operator family, so the key serves all three.
fn delete_sql(outbox: &str, id_column: &str, kind: IdKind) -> String {
    format!(
        "DELETE FROM {outbox} WHERE {} = ANY({})",
        quote(id_column),
        id_array(kind)
    )
}

/// The statement that moves rows by id (`$1`) from `outbox` to `archive`, copying
/// `columns` and setting `moved_at` to the time of the move. `OVERRIDING SYSTEM VALUE`
/// keeps the ids of an archive made with `LIKE … INCLUDING ALL` (an identity column).
fn move_sql(
    outbox: &str,
    archive: &str,
    id_column: &str,
    kind: IdKind,
    columns: &[String],
    moved_at: &str,
) -> String {
    let list: Vec<String> = columns.iter().map(|c| quote(c)).collect();
    let list = list.join(", ");
    format!(
        "WITH moved AS (DELETE FROM {outbox} WHERE {} = ANY({}) RETURNING {list}) \
         INSERT INTO {archive} ({list}, {}) OVERRIDING SYSTEM VALUE \
         SELECT {list}, clock_timestamp() FROM moved",
        quote(id_column),
        id_array(kind),
        quote(moved_at),
    )
}

/// How this relay takes published rows out of the outbox table: the statement, built
/// once from the catalogue.
#[derive(Debug, Clone)]
pub struct Removal {
    sql: String,
    kind: IdKind,
    archives: bool,
}

impl Removal {
    /// The removal from `schema.table` of rows by `id_column` (of `kind`): a delete, or
    /// with `archive` a move there, `moved_at` taking the time. Fails, saying what to
    /// change, when the archive cannot take the outbox table's rows.
    pub async fn resolve(
        client: &impl GenericClient,
        (schema, table): (&str, &str),
        id_column: &str,
        kind: IdKind,
        archive: Option<&Archive>,
        moved_at: &str,
    ) -> Result<Self, PgError> {
        let outbox = qualified(schema, table);
        let Some(archive) = archive else {
            return Ok(Self {
                sql: delete_sql(&outbox, id_column, kind),
                kind,
                archives: false,
            });
        };
        let target = qualified(&archive.schema, &archive.name);
        let outbox_columns = read_columns(client, schema, table).await?;
        let archive_columns = read_columns(client, &archive.schema, &archive.name).await?;
        let columns = copied_columns(&outbox_columns, &archive_columns, moved_at).map_err(
            |problems| {
                let said: Vec<String> = problems.iter().map(ToString::to_string).collect();
                let fix = fix_sql(&target, &problems);
                PgError::Schema(format!(
                    "archive table {}.{} (spec.table.archive) cannot take the rows of {schema}.{table}: {}{}",
                    archive.schema,
                    archive.name,
                    said.join("; "),
                    if fix.is_empty() {
                        String::new()
                    } else {
                        format!("; run {fix}")
                    }
                ))
            },
        )?;
        Ok(Self {
            sql: move_sql(&outbox, &target, id_column, kind, &columns, moved_at),
            kind,
            archives: true,
        })
    }

    /// The statement (`$1`: the ids, as [`id_param`] makes them).
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// Whether rows move to the archive (else they are deleted).
    pub fn archives(&self) -> bool {
        self.archives
    }

    /// Takes the rows with `ids` out of the outbox table (into the archive); returns
    /// how many left (rows already gone are not counted).
    pub async fn remove(&self, client: &impl GenericClient, ids: &[RowId]) -> Result<u64, PgError> {
        client
            .execute(&self.sql, &[&*id_param(self.kind, ids)])
            .await
            .map_err(db(if self.archives {
                "moving published rows to the archive table"
            } else {
                "deleting published rows"
            }))
    }
}

/// Deletes up to `limit` rows archived longer than `older_than` ago from `archive`;
/// returns how many. One short statement, needing SELECT and DELETE on the archive (no
/// row lock in the inner select, which would need UPDATE: one relay trims at a time).
pub async fn trim(
    client: &Client,
    archive: &Archive,
    moved_at: &str,
    older_than: Duration,
    limit: i64,
) -> Result<u64, PgError> {
    // By `ctid`, so the archive needs no key; the time is checked again on the rows
    // found, which keeps a partitioned archive (where a `ctid` repeats across
    // partitions) to rows past the retention.
    let at = quote(moved_at);
    let archive = qualified(&archive.schema, &archive.name);
    client
        .execute(
            &format!(
                "DELETE FROM {archive} WHERE ctid = ANY(ARRAY( \
                   SELECT ctid FROM {archive} \
                   WHERE {at} < now() - make_interval(secs => $1) \
                   LIMIT $2)) \
                 AND {at} < now() - make_interval(secs => $1)"
            ),
            &[&older_than.as_secs_f64(), &limit],
        )
        .await
        .map_err(db("deleting old archived rows"))
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

    fn outbox() -> Vec<Column> {
        vec![
            col("id", "uuid"),
            col("aggregatetype", "character varying(255)"),
            col("payload", "jsonb"),
            col("published_at", "timestamp with time zone"),
        ]
    }

    #[test]
    fn every_outbox_column_but_the_time_of_the_move_is_copied() {
        let mut archive = outbox();
        archive.push(col("note", "text"));
        assert_eq!(
            copied_columns(&outbox(), &archive, "published_at"),
            Ok(vec![
                "id".to_owned(),
                "aggregatetype".to_owned(),
                "payload".to_owned()
            ])
        );
        // A column the archive generates is computed there, not copied.
        archive[2].generated = true;
        assert_eq!(
            copied_columns(&outbox(), &archive, "published_at"),
            Ok(vec!["id".to_owned(), "aggregatetype".to_owned()])
        );
    }

    #[test]
    fn an_archive_that_cannot_take_the_rows_says_each_reason_and_the_fix() {
        let archive = vec![col("id", "text"), col("published_at", "date")];
        let problems = copied_columns(&outbox(), &archive, "published_at").unwrap_err();
        assert_eq!(
            problems,
            vec![
                Mismatch::Type {
                    column: "id".to_owned(),
                    outbox: "uuid".to_owned(),
                    archive: "text".to_owned()
                },
                Mismatch::Missing {
                    column: "aggregatetype".to_owned(),
                    ty: "character varying(255)".to_owned()
                },
                Mismatch::Missing {
                    column: "payload".to_owned(),
                    ty: "jsonb".to_owned()
                },
                Mismatch::MovedAt {
                    column: "published_at".to_owned(),
                    ty: Some("date".to_owned())
                },
            ]
        );
        assert_eq!(
            fix_sql("\"public\".\"a\"", &problems),
            "ALTER TABLE \"public\".\"a\" ADD COLUMN \"aggregatetype\" character varying(255); \
             ALTER TABLE \"public\".\"a\" ADD COLUMN \"payload\" jsonb"
        );
        assert_eq!(
            copied_columns(&outbox(), &[], "published_at"),
            Err(vec![Mismatch::NoTable])
        );
        let no_time = copied_columns(&outbox(), &outbox()[..3], "published_at").unwrap_err();
        assert_eq!(
            no_time[0].to_string(),
            "it has no column published_at (table.columns.publishedAt) for the time a row was archived"
        );
    }

    #[test]
    fn the_move_is_one_statement_from_the_outbox_into_the_archive() {
        let sql = move_sql(
            "\"s\".\"outbox\"",
            "\"s\".\"outbox_archive\"",
            "id",
            IdKind::Text { cast: "uuid" },
            &["id".to_owned(), "payload".to_owned()],
            "published_at",
        );
        assert_eq!(
            sql,
            "WITH moved AS (DELETE FROM \"s\".\"outbox\" WHERE \"id\" = ANY($1::text[]::uuid[]) \
             RETURNING \"id\", \"payload\") INSERT INTO \"s\".\"outbox_archive\" (\"id\", \
             \"payload\", \"published_at\") OVERRIDING SYSTEM VALUE SELECT \"id\", \"payload\", \
             clock_timestamp() FROM moved"
        );
        assert_eq!(
            delete_sql("\"s\".\"outbox\"", "id", IdKind::Int),
            "DELETE FROM \"s\".\"outbox\" WHERE \"id\" = ANY($1::int8[])"
        );
    }
}
