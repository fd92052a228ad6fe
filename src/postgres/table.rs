//! The outbox table as the relays read and write it: its columns, checked once against
//! the table, and the SQL built from them (the polling batch select, the log-tailing
//! relay's sweep and back-fill selects, marking, deleting, dead-lettering, retention
//! and the backlog).

use std::collections::BTreeSet;
use std::time::Duration;

use tokio_postgres::Client;

pub use super::ids::{ID_TYPES, IdKind, id_param};
use super::polling::partition_expr;
use super::removal::{self, Removal};
use super::{OutboxRow, PgError, RowId, db, quote};
use crate::api::AfterPublish;

mod dead_letters;
mod replay;
pub use dead_letters::DeadLetter;
pub use replay::ReplayWindow;

/// The column types `table.columns.order` may have (`information_schema` names).
pub const ORDER_TYPES: [&str; 5] = [
    "smallint",
    "integer",
    "bigint",
    "timestamp with time zone",
    "timestamp without time zone",
];

/// The column types `table.columns.timestamp` may have (`information_schema` names).
const TIMESTAMP_TYPES: [&str; 2] = ["timestamp with time zone", "timestamp without time zone"];

/// Column names of the outbox table, already checked.
#[derive(Debug, Clone)]
pub struct Columns {
    /// Row id (bigint-compatible).
    pub id: String,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Payload.
    pub payload: String,
    /// Insertion time, when the table has it.
    pub created_at: Option<String>,
    /// Publication time (mark mode).
    pub published_at: String,
    /// The event's own time (`timestamptz` or `timestamp`), when configured.
    pub timestamp: Option<String>,
    /// What polling orders rows by, when the spec names it.
    pub order: Option<String>,
    /// Extra columns (`table.headers`, `table.additionalFields`), distinct.
    pub extra: Vec<String>,
}

impl Columns {
    /// The columns of a parsed relay's table, `createdAt` included (callers that do
    /// not read it set it to `None`).
    pub fn of(table: &crate::spec::Table) -> Self {
        let c = &table.columns;
        Self {
            id: c.id.clone(),
            aggregate_type: c.aggregate_type.clone(),
            aggregate_id: c.aggregate_id.clone(),
            event_type: c.event_type.clone(),
            payload: c.payload.clone(),
            created_at: Some(c.created_at.clone()),
            published_at: c.published_at.clone(),
            timestamp: c.timestamp.clone(),
            order: c.order.clone(),
            extra: table.extra_columns(),
        }
    }
}

/// The SQL of one outbox table, built once from the validated configuration and the
/// table's actual columns.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    /// `"schema"."table"`.
    qualified: String,
    /// `"schema"."dead_letter"`.
    dead_letter: String,
    columns: Columns,
    /// Every column of the table, quoted, for the dead-letter copy.
    all_columns: Vec<String>,
    /// How published rows leave the table (`None`: they are marked).
    removal: Option<Removal>,
    /// Where they go, with `afterPublish: archive`.
    archive: Option<crate::spec::Archive>,
    /// `WHERE <publishedAt> IS NULL` where the table has that column, else empty: a
    /// row marked published is never unpublished, whatever the mode.
    unpublished_where: String,
    partitions: i32,
    select: SelectSql,
    /// How each extra column's values go into JSON, in `columns.extra`'s order.
    extra_kinds: Vec<crate::broker::ValueKind>,
    /// How the ids are read and compared.
    id_kind: IdKind,
    /// The select list [`OutboxTable::row_of`] reads, and the order rows go out in.
    row_list: String,
    order_by: String,
}

/// The batch query in pieces: a branch per owned partition goes between `WITH
/// candidates AS MATERIALIZED (SELECT id FROM (` and `tail`.
#[derive(Debug, Clone)]
struct SelectSql {
    branch_head: String,
    branch_tail: String,
    tail: String,
    /// The reconciliation sweep's query; `None` without a created-at column.
    stale: Option<String>,
    /// Every row after an id, oldest first (a publication gap's back-fill).
    after: String,
    /// Whether `after` pages by an integer id (the rows' order); else it reads the
    /// oldest rows left.
    after_pages_by_id: bool,
}

impl SelectSql {
    /// The statement for `partitions` (not empty).
    fn for_partitions(&self, partitions: &BTreeSet<i64>) -> String {
        let branches: Vec<String> = partitions
            .iter()
            .map(|p| format!("{}{p}{}", self.branch_head, self.branch_tail))
            .collect();
        format!(
            "WITH candidates AS MATERIALIZED (SELECT u.id FROM ({}{}",
            branches.join(" UNION ALL "),
            self.tail
        )
    }
}

impl OutboxTable {
    /// Reads the table's columns and builds its SQL. Fails with one line naming what is
    /// missing when the table or a configured column does not exist, or when the
    /// archive (`table.archive`, used unless `after_publish` marks rows) cannot take
    /// its rows.
    pub async fn inspect(
        client: &Client,
        spec: &crate::spec::Table,
        dead_letter_table: &str,
        mut columns: Columns,
        after_publish: AfterPublish,
        partitions: i32,
    ) -> Result<Self, PgError> {
        let (schema, table) = (spec.schema.as_str(), spec.name.as_str());
        let rows = client
            .query(
                "SELECT column_name::text, data_type::text FROM information_schema.columns \
                 WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
                &[&schema, &table],
            )
            .await
            .map_err(db("reading the outbox table's columns"))?;
        let existing: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        if existing.is_empty() {
            return Err(PgError::Schema(format!(
                "table {schema}.{table} does not exist or the relay's user cannot see it"
            )));
        }
        let type_of = |name: &str| {
            existing
                .iter()
                .find(|(c, _)| c == name)
                .map(|(_, t)| t.clone())
        };
        let mut required = vec![
            ("table.columns.id", columns.id.clone()),
            (
                "table.columns.aggregateType",
                columns.aggregate_type.clone(),
            ),
            ("table.columns.aggregateId", columns.aggregate_id.clone()),
            ("table.columns.type", columns.event_type.clone()),
            ("table.columns.payload", columns.payload.clone()),
        ];
        if after_publish == AfterPublish::Mark {
            required.push(("table.columns.publishedAt", columns.published_at.clone()));
        }
        if let Some(timestamp) = &columns.timestamp {
            required.push(("table.columns.timestamp", timestamp.clone()));
        }
        if let Some(order) = &columns.order {
            required.push(("table.columns.order", order.clone()));
        }
        for column in &columns.extra {
            required.push(("table.headers / table.additionalFields", column.clone()));
        }
        let missing: Vec<String> = required
            .iter()
            .filter(|(_, c)| type_of(c).is_none())
            .map(|(field, c)| format!("{field}: column {c} is missing"))
            .collect();
        if !missing.is_empty() {
            return Err(PgError::Schema(format!(
                "{schema}.{table}: {}",
                missing.join("; ")
            )));
        }
        if let Some(timestamp) = &columns.timestamp
            && let Some(ty) = type_of(timestamp)
            && !TIMESTAMP_TYPES.contains(&ty.as_str())
        {
            return Err(PgError::Schema(format!(
                "{schema}.{table}: table.columns.timestamp: column {timestamp} is {ty}; \
                 it must be timestamp with time zone or timestamp (read as UTC)"
            )));
        }
        if let Some(order) = &columns.order
            && let Some(ty) = type_of(order)
            && !ORDER_TYPES.contains(&ty.as_str())
        {
            return Err(PgError::Schema(format!(
                "{schema}.{table}: table.columns.order: column {order} is {ty}; it must grow \
                 with insertion: an integer (bigserial, identity) or a timestamp"
            )));
        }
        let id_type = type_of(&columns.id).unwrap_or_default();
        let Some(id_kind) = IdKind::of_type(&id_type) else {
            return Err(PgError::Schema(format!(
                "{schema}.{table}: table.columns.id: column {} is {id_type}; the relay reads \
                 integer (bigint, integer, smallint), uuid and text (text, varchar) ids",
                columns.id
            )));
        };
        // createdAt is optional: without it there is no age or lag metric.
        if columns
            .created_at
            .as_deref()
            .is_some_and(|c| type_of(c).is_none())
        {
            columns.created_at = None;
        }
        let payload_is_bytea = type_of(&columns.payload).as_deref() == Some("bytea");
        let payload = if payload_is_bytea {
            quote(&columns.payload)
        } else {
            format!("convert_to({}::text, 'UTF8')", quote(&columns.payload))
        };
        let created = columns.created_at.as_deref().map_or_else(
            || "NULL::float8".to_owned(),
            |c| format!("extract(epoch FROM {})::float8", quote(c)),
        );
        // `timestamp` (without time zone) is read as UTC, as Debezium reads it.
        let event_time = columns.timestamp.as_deref().map_or_else(
            || "NULL::float8".to_owned(),
            |c| format!("extract(epoch FROM {})::float8", quote(c)),
        );
        let headers: String = columns
            .extra
            .iter()
            .map(|h| format!(", {}::text", quote(h)))
            .collect();
        let extra_kinds = columns
            .extra
            .iter()
            .map(|c| crate::broker::ValueKind::of_type_name(&type_of(c).unwrap_or_default()))
            .collect();
        let qualified = format!("{}.{}", quote(schema), quote(table));
        // A row marked published is published, whatever this relay does after
        // publishing: a table that was polled with `afterPublish: mark` keeps a day of
        // marked rows, which the back-fill relay (deleting), the sweep and a gap's
        // back-fill of a relay switched to log tailing must not send again. The same
        // rule as the operator's backlog and handover counts.
        let unpublished = if type_of(&columns.published_at).is_some() {
            format!("{} IS NULL AND ", quote(&columns.published_at))
        } else {
            String::new()
        };
        let pexpr = partition_expr(&columns.aggregate_id, partitions);
        // ORDER BY id: always from the oldest unpublished row, never from a remembered
        // position, because rows commit out of id order.
        //
        // The candidates are the first `$1` rows, in id order, of a merge of one ordered
        // scan of the `(partition, id)` index per owned partition: a UNION ALL of one
        // branch per partition under `ORDER BY id LIMIT $1` is planned as a Merge
        // Append, which pulls a row at a time from the branch with the lowest id and
        // stops after `$1`, so it reads `$1` index entries plus one per partition. (A
        // single `<partition> = ANY(...) ORDER BY id` cannot read that index in id order
        // across partitions and sorted the whole backlog, 105 ms at 40,000 waiting rows;
        // a LATERAL scan per partition read `$1` entries from each, and dead entries
        // with them: four times the rows with four partitions.) Each partition's
        // candidates are a prefix of it in id order, so per-aggregate order holds. The
        // partitions are literals (integers the relay computed), so the statement text
        // is one per owned set.
        //
        // Only the chosen rows are locked, in the outer statement. FOR UPDATE re-checks
        // the predicate on the current row version, so a row published meanwhile drops
        // out; SKIP LOCKED leaves rows a concurrent batch holds (ordering none, or a
        // dying owner's open transaction) alone instead of waiting for them.
        // What a row is read as (see `row_of`).
        let id_read = match id_kind {
            IdKind::Int => "int8",
            IdKind::Text { .. } => "text",
        };
        let row_list = format!(
            "{id}::{id_read}, coalesce({at}::text, ''), {aid}::text, {ty}::text, {payload}, \
             {pexpr}, {created}, {event_time}{headers}",
            id = quote(&columns.id),
            at = quote(&columns.aggregate_type),
            aid = quote(&columns.aggregate_id),
            ty = quote(&columns.event_type),
        );
        // The order rows go out in: the column the spec names; else the id where it is
        // an integer (it grows with insertion); else the created-at column; the id
        // breaking ties (a uuid or text id says nothing of when its row was written).
        let ordered = columns.order.clone().or(match id_kind {
            IdKind::Int => None,
            IdKind::Text { .. } => columns.created_at.clone(),
        });
        let (order_by, order_column, u_order) = match ordered.as_deref() {
            Some(c) => (
                format!("{}, {}", quote(c), quote(&columns.id)),
                format!(", {} AS o", quote(c)),
                "u.o, u.id",
            ),
            None => (quote(&columns.id), String::new(), "u.id"),
        };
        let select = SelectSql {
            branch_head: format!(
                "(SELECT {id} AS id{order_column} FROM {qualified} WHERE {unpublished}{pexpr} = ",
                id = quote(&columns.id)
            ),
            branch_tail: format!(" ORDER BY {order_by} LIMIT $1)"),
            tail: format!(
                ") AS u ORDER BY {u_order} LIMIT $1) \
                 SELECT {row_list} \
                 FROM {qualified} WHERE {unpublished}{id} = ANY(ARRAY(SELECT id FROM candidates)) \
                 ORDER BY {order_by} FOR UPDATE SKIP LOCKED",
                id = quote(&columns.id),
            ),
            // The sweep's: rows inserted before $1 (Unix seconds) by a transaction that
            // precedes xid $3 (`age` compares xids as the server does, modulo 2^32; a
            // frozen xmin is the oldest of all), oldest first.
            stale: columns.created_at.as_deref().map(|c| {
                format!(
                    "SELECT {row_list} FROM {qualified} \
                     WHERE {unpublished}extract(epoch FROM {created_at}) < $1::float8 \
                       AND age(xmin) > age($3::text::xid) \
                     ORDER BY {order_by} LIMIT $2 FOR UPDATE SKIP LOCKED",
                    created_at = quote(c),
                )
            }),
            // Integer ids that order the rows page by the last id; other ids cannot
            // (they do not grow, or not with insertion), so each page is the oldest rows
            // left: the back-fill deletes what it published.
            after: match (&ordered, id_kind) {
                (None, IdKind::Int) => format!(
                    "SELECT {row_list} FROM {qualified} WHERE {unpublished}{id} > $1::int8 \
                     ORDER BY {id} LIMIT $2 FOR UPDATE SKIP LOCKED",
                    id = quote(&columns.id),
                ),
                _ => format!(
                    "SELECT {row_list} FROM {qualified} {where_unpublished} \
                     ORDER BY {order_by} LIMIT $1 FOR UPDATE SKIP LOCKED",
                    where_unpublished = unpublished
                        .strip_suffix(" AND ")
                        .map_or_else(String::new, |c| format!("WHERE {c}")),
                ),
            },
            after_pages_by_id: ordered.is_none() && id_kind == IdKind::Int,
        };
        let archive = spec
            .archive
            .clone()
            .filter(|_| after_publish != AfterPublish::Mark);
        let removal = match after_publish {
            AfterPublish::Mark => None,
            AfterPublish::Delete | AfterPublish::Archive => Some(
                Removal::resolve(
                    client,
                    (schema, table),
                    &columns.id,
                    id_kind,
                    archive.as_ref(),
                    &columns.published_at,
                )
                .await?,
            ),
        };
        Ok(Self {
            removal,
            archive,
            qualified,
            dead_letter: format!("{}.{}", quote(schema), quote(dead_letter_table)),
            all_columns: existing.iter().map(|(c, _)| quote(c)).collect(),
            unpublished_where: unpublished
                .strip_suffix(" AND ")
                .map_or_else(String::new, |c| format!("WHERE {c}")),
            columns,
            partitions,
            select,
            extra_kinds,
            id_kind,
            row_list,
            order_by,
        })
    }

    /// How the ids are read and compared.
    pub fn id_kind(&self) -> IdKind {
        self.id_kind
    }

    /// Whether the rows go out in insertion order: by the order column, an integer
    /// id, or the created-at column (polling needs one of them for per-aggregate
    /// order).
    pub fn ordered_by_insertion(&self) -> bool {
        self.select.after_pages_by_id
            || self.columns.order.is_some()
            || self.columns.created_at.is_some()
    }

    /// Number of partitions rows are hashed into.
    pub fn partitions(&self) -> i32 {
        self.partitions
    }

    /// The oldest unpublished rows of `partitions`, locked for this transaction.
    pub async fn select_batch(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        partitions: &BTreeSet<i64>,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, PgError> {
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        // The planner underestimates how many rows one partition holds and would rather
        // bitmap-scan all of them and sort than walk the index in order and stop early.
        tx.batch_execute("SET LOCAL enable_bitmapscan = off")
            .await
            .map_err(db("preparing the batch query"))?;
        let rows = tx
            .query(&self.select.for_partitions(partitions), &[&limit])
            .await
            .map_err(db("selecting a batch"))?;
        Ok(rows.iter().map(|r| self.row_of(r)).collect())
    }

    /// Rows inserted before `cutoff` (Unix seconds) by a transaction older than `xid`
    /// ([`Horizon`](super::horizon::Horizon)) that are still in the table, oldest
    /// first, at most `limit`, locked for this transaction (the log-tailing relay's
    /// reconciliation sweep); an error when the table has no created-at column.
    pub async fn select_stale(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        cutoff: f64,
        xid: u32,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, PgError> {
        let sql = self.select.stale.as_deref().ok_or_else(|| {
            PgError::Schema(format!(
                "{}: the sweep needs the createdAt column (table.columns.createdAt)",
                self.qualified
            ))
        })?;
        let rows = tx
            .query(sql, &[&cutoff, &limit, &xid.to_string()])
            .await
            .map_err(db("sweeping for missed rows"))?;
        Ok(rows.iter().map(|r| self.row_of(r)).collect())
    }

    /// Rows after id `after` still in the table, oldest first, at most `limit`, locked
    /// for this transaction (what a log-tailing relay publishes from the table when the
    /// publication may have skipped inserts).
    pub async fn select_after(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        after: Option<&RowId>,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, PgError> {
        let rows = if self.select.after_pages_by_id {
            let after = after.and_then(RowId::as_int).unwrap_or(i64::MIN);
            tx.query(&self.select.after, &[&after, &limit]).await
        } else {
            // The oldest rows left (see the statement).
            tx.query(&self.select.after, &[&limit]).await
        }
        .map_err(db("reading the rows a publication change left behind"))?;
        Ok(rows.iter().map(|r| self.row_of(r)).collect())
    }

    /// An outbox row from a row of the batch or sweep query.
    fn row_of(&self, r: &tokio_postgres::Row) -> OutboxRow {
        OutboxRow {
            id: match self.id_kind {
                IdKind::Int => RowId::Int(r.get(0)),
                IdKind::Text { .. } => RowId::Text(r.get::<_, String>(0).into()),
            },
            aggregate_type: r.get(1),
            aggregate_id: r.get(2),
            event_type: r.get(3),
            payload: r.get::<_, Option<Vec<u8>>>(4).map(Into::into),
            partition: r.get(5),
            created_at: r.get(6),
            timestamp: r.get(7),
            extra: self
                .columns
                .extra
                .iter()
                .zip(&self.extra_kinds)
                .enumerate()
                .filter_map(|(i, (name, kind))| {
                    r.get::<_, Option<String>>(8 + i)
                        .map(|v| crate::broker::ColumnValue::new(name, v, *kind))
                })
                .collect(),
        }
    }

    /// Marks (`published_at = now()`), deletes or archives published rows, per
    /// `afterPublish`, in the batch's transaction.
    pub async fn finish_published(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        ids: &[RowId],
    ) -> Result<(), PgError> {
        if ids.is_empty() {
            return Ok(());
        }
        if let Some(removal) = &self.removal {
            removal.remove(tx, ids).await?;
            return Ok(());
        }
        let sql = format!(
            "UPDATE {} SET {} = now() WHERE {} = ANY({})",
            self.qualified,
            quote(&self.columns.published_at),
            quote(&self.columns.id),
            removal::id_array(self.id_kind),
        );
        tx.execute(&sql, &[&*id_param(self.id_kind, ids)])
            .await
            .map_err(db("marking published rows"))?;
        Ok(())
    }

    /// Creates the dead-letter table when it does not exist: the outbox's columns plus
    /// why and when the row was moved.
    pub async fn ensure_dead_letter_table(&self, client: &Client) -> Result<(), PgError> {
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} (LIKE {}, \
                 dead_letter_reason text NOT NULL, \
                 dead_lettered_at timestamptz NOT NULL DEFAULT now())",
                self.dead_letter, self.qualified
            ))
            .await
            .map_err(db("creating the dead-letter table"))
    }

    /// Moves one row to the dead-letter table in one statement (so it is atomic on any
    /// connection, in a transaction or not); returns how many rows moved (0 when the
    /// row is no longer in the table).
    pub async fn dead_letter(
        &self,
        client: &impl tokio_postgres::GenericClient,
        id: &RowId,
        reason: &str,
    ) -> Result<u64, PgError> {
        let cols = self.all_columns.join(", ");
        let id_col = quote(&self.columns.id);
        let ids = id_param(self.id_kind, std::slice::from_ref(id));
        client
            .execute(
                &format!(
                    "WITH moved AS (DELETE FROM {} WHERE {id_col} = ANY({}) RETURNING {cols}) \
                     INSERT INTO {} ({cols}, dead_letter_reason) SELECT {cols}, $2 FROM moved",
                    self.qualified,
                    removal::id_array(self.id_kind),
                    self.dead_letter
                ),
                &[&*ids, &reason],
            )
            .await
            .map_err(db("moving a row to the dead-letter table"))
    }

    /// [`dead_letter`](Self::dead_letter) inside a batch's transaction, in a savepoint:
    /// a dead-letter write that fails (the table dropped, a privilege revoked) is rolled
    /// back alone (the inner error), and the batch's marks still commit, so the rows it
    /// published are not published again. The outer error: the transaction itself
    /// failed.
    pub async fn dead_letter_in_batch(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        id: &RowId,
        reason: &str,
    ) -> Result<Result<u64, PgError>, PgError> {
        tx.batch_execute("SAVEPOINT outbox_dead_letter")
            .await
            .map_err(db("starting the dead-letter savepoint"))?;
        match self.dead_letter(tx, id, reason).await {
            Ok(moved) => {
                tx.batch_execute("RELEASE SAVEPOINT outbox_dead_letter")
                    .await
                    .map_err(db("releasing the dead-letter savepoint"))?;
                Ok(Ok(moved))
            }
            Err(err) => {
                tx.batch_execute("ROLLBACK TO SAVEPOINT outbox_dead_letter")
                    .await
                    .map_err(db("rolling back the dead-letter savepoint"))?;
                Ok(Err(err))
            }
        }
    }

    /// Deletes up to `limit` rows published before `older_than` — marked rows from the
    /// table, then archived ones from the archive — and returns how many. Marked rows go
    /// whatever `afterPublish` is now: a table polled with `mark` before keeps them
    /// otherwise for good. Each call is short statements, so retention never holds long
    /// locks.
    pub async fn delete_published_before(
        &self,
        client: &Client,
        older_than: Duration,
        limit: i64,
    ) -> Result<u64, PgError> {
        let mut deleted = 0;
        if !self.unpublished_where.is_empty() {
            let id = quote(&self.columns.id);
            let at = quote(&self.columns.published_at);
            deleted = client
                .execute(
                    &format!(
                        "DELETE FROM {t} WHERE {id} IN (SELECT {id} FROM {t} \
                         WHERE {at} < now() - make_interval(secs => $1) \
                         ORDER BY {id} LIMIT $2 FOR UPDATE SKIP LOCKED)",
                        t = self.qualified
                    ),
                    &[&older_than.as_secs_f64(), &limit],
                )
                .await
                .map_err(db("deleting old published rows"))?;
        }
        if let Some(archive) = self.archive.as_ref().filter(|_| deleted < limit as u64) {
            deleted += removal::trim(
                client,
                archive,
                &self.columns.published_at,
                older_than,
                limit,
            )
            .await?;
        }
        Ok(deleted)
    }

    /// Rows waiting to be published and the age in seconds of the oldest (when the table
    /// has a created-at column).
    pub async fn backlog(&self, client: &Client) -> Result<(i64, Option<f64>), PgError> {
        let unpublished = &self.unpublished_where;
        let age = self.columns.created_at.as_deref().map_or_else(
            || "NULL::float8".to_owned(),
            |c| format!("extract(epoch FROM now() - min({}))::float8", quote(c)),
        );
        let row = client
            .query_one(
                &format!(
                    "SELECT count(*), {age} FROM {} {unpublished}",
                    self.qualified
                ),
                &[],
            )
            .await
            .map_err(db("measuring the backlog"))?;
        Ok((row.get(0), row.get(1)))
    }
}
