//! SQL for the polling relay: the outbox table's batch select, mark and delete, the
//! partition expression, advisory locks for partition ownership, retention and backlog.
//!
//! Every user identifier passes [`check_identifier`] when the configuration is validated
//! and is double-quoted here, so no SQL is ever built from unchecked text.
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

pub mod admin;
pub mod coverage;
pub mod horizon;
pub mod hosts;
pub mod pooling;
pub mod provision;
pub mod replication;
pub mod snapshot;
pub mod standby;
pub mod tls;

use std::collections::BTreeSet;
use std::time::Duration;

use tokio_postgres::Client;

use crate::api::AfterPublish;
use tls::PgTls;

/// The PostgreSQL problems the relay reports.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// A statement or the connection failed; the text never contains the URL. The causes
    /// are spelled out (a TLS handshake error names the certificate problem).
    #[error("PostgreSQL: {what}: {}", with_causes(source))]
    Db {
        /// What the relay was doing.
        what: &'static str,
        /// The driver's error (server message or I/O error).
        source: tokio_postgres::Error,
    },
    /// The table does not have the shape the configuration names.
    #[error("outbox table: {0}")]
    Schema(String),
    /// The replication slot or publication is missing, in use or in conflict.
    #[error("{0}")]
    Replication(String),
    /// TLS cannot be set up as the spec asks (the CA is unusable).
    #[error("PostgreSQL TLS: {0}")]
    Tls(String),
    /// No pooled connection could be had (the pool's wait or create timeout).
    #[error("PostgreSQL connection pool: {0}")]
    Pool(String),
    /// The connection URL cannot be used.
    #[error("database URL (from ${env}): {message}")]
    Url {
        /// The variable that held it.
        env: String,
        /// Why, without the URL itself.
        message: String,
    },
}

/// An error and its causes on one line, without repeating a cause its parent already
/// printed (tokio-postgres repeats "db error" and TLS messages).
fn with_causes(error: &tokio_postgres::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = cause.source();
    }
    text
}

fn db(what: &'static str) -> impl FnOnce(tokio_postgres::Error) -> PgError {
    move |source| PgError::Db { what, source }
}

pub use crate::rules::check_identifier;

/// Double-quotes an identifier, doubling any quote inside it as SQL requires. Every
/// identifier passed [`check_identifier`] (so holds no quote); the escaping keeps this
/// function safe on its own.
pub fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// A PostgreSQL connection string for logs and reports: `postgres://user:***@host:port/db`,
/// rebuilt from what the driver's own parser read (URL or key=value form), so nothing
/// of the password can leak whatever characters it holds or how they are encoded, and
/// query parameters (which may carry `password=`) are dropped.
pub fn redact_url(url: &str) -> String {
    let Ok(config) = url.parse::<tokio_postgres::Config>() else {
        return "<not a PostgreSQL connection string>".to_owned();
    };
    // A password written unencoded can move the parser's `@` or `/` and land in what it
    // reads as host, user or database: a part is shown only when it looks like one.
    let plain = |text: &str| {
        if !text.is_empty()
            && text
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '/'))
        {
            text.to_owned()
        } else {
            "***".to_owned()
        }
    };
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let host = match host {
                tokio_postgres::config::Host::Tcp(h) => plain(h),
                tokio_postgres::config::Host::Unix(p) => plain(&p.display().to_string()),
            };
            match ports.get(i).or(ports.first()) {
                Some(port) => format!("{host}:{port}"),
                None => host,
            }
        })
        .collect();
    let user = config.get_user().map(plain).unwrap_or_default();
    let password = if config.get_password().is_some() {
        ":***"
    } else {
        ""
    };
    let at = if user.is_empty() && password.is_empty() {
        String::new()
    } else {
        format!("{user}{password}@")
    };
    format!(
        "postgres://{at}{}/{}",
        hosts.join(","),
        config.get_dbname().map(plain).unwrap_or_default()
    )
}

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

/// Connects with a short timeout and TLS as `tls` says, and spawns the connection task.
pub async fn connect(url: &str, env: &str, tls: &PgTls) -> Result<Client, PgError> {
    connect_as(url, env, tls, "outbox-relay").await
}

/// [`connect`] under another `application_name` (the operator's own sessions show as
/// `outbox-operator` in `pg_stat_activity`).
pub async fn connect_as(
    url: &str,
    env: &str,
    tls: &PgTls,
    application_name: &str,
) -> Result<Client, PgError> {
    let config = client_config(url, env, tls, application_name)?;
    let (client, connection) = config
        .connect(tls::connector(tls)?)
        .await
        .map_err(db("connect"))?;
    tokio::spawn(async move {
        if let Err(err) = connection.await {
            tracing::warn!(error = %err, "PostgreSQL connection ended");
        }
    });
    Ok(client)
}

/// The driver settings [`connect_as`] uses (short connect timeout, keepalives, the TLS
/// mode of `tls` whatever the URL says, `application_name`), for callers that keep
/// connections in a pool (they connect with [`tls::connector`]).
pub fn client_config(
    url: &str,
    env: &str,
    tls: &PgTls,
    application_name: &str,
) -> Result<tokio_postgres::Config, PgError> {
    let mut config: tokio_postgres::Config = url.parse().map_err(|_| PgError::Url {
        env: env.to_owned(),
        // The parser's message can quote the input, which may hold the password.
        message: "not a valid postgres:// URL or key=value connection string".to_owned(),
    })?;
    config
        .ssl_mode(tls::driver_mode(tls.mode))
        .connect_timeout(Duration::from_secs(5))
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        // A peer that stopped answering (a cut link, a crashed host) is noticed within
        // about 25 s rather than the system's default of more than ten minutes, and
        // data left unacknowledged for 30 s ends the connection.
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3)
        .tcp_user_timeout(Duration::from_secs(30))
        .application_name(application_name);
    hosts::prefer_primary(&mut config);
    Ok(config)
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

/// Turns off, for this session only, the server's idle timeouts
/// (`idle_in_transaction_session_timeout`, and `idle_session_timeout` where the server
/// has it) that a role or database may set. A relay's transaction stays open, idle,
/// while the broker acknowledges what it selected: ended by such a timeout, it would
/// release the partition locks (and row locks) it publishes under, and another replica
/// would publish the same aggregates at the same time. The relay bounds its own
/// transactions (the fence, the broker's message timeout). Plain `set_config` calls,
/// not startup options, so they pass session-mode poolers; settings the server does
/// not know are skipped.
pub async fn keep_open_while_publishing(client: &Client) -> Result<(), PgError> {
    client
        .batch_execute(
            "SELECT set_config(name, '0', false) FROM pg_settings \
             WHERE name IN ('idle_in_transaction_session_timeout', 'idle_session_timeout')",
        )
        .await
        .map_err(db("turning the session's idle timeouts off"))
}

/// Session settings of the operator's own connections: a DDL statement waiting behind
/// a table lock (a migration holding `ACCESS EXCLUSIVE`), a slot creation waiting for
/// old transactions, or a forgotten transaction fails after a bounded time with the
/// reason in a condition and is retried, instead of holding a reconcile (and a pooled
/// connection) forever. Relays set their own per statement.
pub const OPERATOR_SESSION_OPTIONS: &str =
    "-c lock_timeout=5s -c statement_timeout=60s -c idle_in_transaction_session_timeout=60s";

/// [`client_config`] for the operator: the same, plus [`OPERATOR_SESSION_OPTIONS`]
/// appended to any `options` the URL carries.
pub fn operator_client_config(
    url: &str,
    env: &str,
    tls: &PgTls,
) -> Result<tokio_postgres::Config, PgError> {
    let mut config = client_config(url, env, tls, "outbox-operator")?;
    let options = match config.get_options() {
        Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {OPERATOR_SESSION_OPTIONS}"),
        _ => OPERATOR_SESSION_OPTIONS.to_owned(),
    };
    config.options(options);
    Ok(config)
}

/// Connects as the operator ([`operator_client_config`]) and spawns the connection task.
pub async fn connect_operator(url: &str, env: &str, tls: &PgTls) -> Result<Client, PgError> {
    let config = operator_client_config(url, env, tls)?;
    let (client, connection) = config
        .connect(tls::connector(tls)?)
        .await
        .map_err(db("connect"))?;
    tokio::spawn(async move {
        if let Err(err) = connection.await {
            tracing::warn!(error = %err, "PostgreSQL connection ended");
        }
    });
    Ok(client)
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
            extra: table.extra_columns(),
        }
    }
}

pub use crate::broker::OutboxRow;

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
    after_publish: AfterPublish,
    /// `WHERE <publishedAt> IS NULL` where the table has that column, else empty: a
    /// row marked published is never unpublished, whatever the mode.
    unpublished_where: String,
    partitions: i32,
    select: SelectSql,
    /// How each extra column's values go into JSON, in `columns.extra`'s order.
    extra_kinds: Vec<crate::broker::ValueKind>,
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
    /// missing when the table or a configured column does not exist.
    pub async fn inspect(
        client: &Client,
        schema: &str,
        table: &str,
        dead_letter_table: &str,
        mut columns: Columns,
        after_publish: AfterPublish,
        partitions: i32,
    ) -> Result<Self, PgError> {
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
        let row_list = format!(
            "{id}::int8, coalesce({at}::text, ''), {aid}::text, {ty}::text, {payload}, \
             {pexpr}, {created}, {event_time}{headers}",
            id = quote(&columns.id),
            at = quote(&columns.aggregate_type),
            aid = quote(&columns.aggregate_id),
            ty = quote(&columns.event_type),
        );
        let select = SelectSql {
            branch_head: format!(
                "(SELECT {id} AS id FROM {qualified} WHERE {unpublished}{pexpr} = ",
                id = quote(&columns.id)
            ),
            branch_tail: format!(" ORDER BY {} LIMIT $1)", quote(&columns.id)),
            tail: format!(
                ") AS u ORDER BY u.id LIMIT $1) \
                 SELECT {row_list} \
                 FROM {qualified} WHERE {unpublished}{id} = ANY(ARRAY(SELECT id FROM candidates)) \
                 ORDER BY {id} FOR UPDATE SKIP LOCKED",
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
                     ORDER BY {id} LIMIT $2 FOR UPDATE SKIP LOCKED",
                    created_at = quote(c),
                    id = quote(&columns.id),
                )
            }),
            after: format!(
                "SELECT {row_list} FROM {qualified} WHERE {unpublished}{id} > $1::int8 \
                 ORDER BY {id} LIMIT $2 FOR UPDATE SKIP LOCKED",
                id = quote(&columns.id),
            ),
        };
        Ok(Self {
            qualified,
            dead_letter: format!("{}.{}", quote(schema), quote(dead_letter_table)),
            all_columns: existing.iter().map(|(c, _)| quote(c)).collect(),
            unpublished_where: unpublished
                .strip_suffix(" AND ")
                .map_or_else(String::new, |c| format!("WHERE {c}")),
            columns,
            after_publish,
            partitions,
            select,
            extra_kinds,
        })
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
    /// ([`horizon::Horizon`]) that are still in the table, oldest first, at most
    /// `limit`, locked for this transaction (the log-tailing relay's reconciliation
    /// sweep); an error when the table has no created-at column.
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
        after: i64,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, PgError> {
        let rows = tx
            .query(&self.select.after, &[&after, &limit])
            .await
            .map_err(db("reading the rows a publication change left behind"))?;
        Ok(rows.iter().map(|r| self.row_of(r)).collect())
    }

    /// An outbox row from a row of the batch or sweep query.
    fn row_of(&self, r: &tokio_postgres::Row) -> OutboxRow {
        OutboxRow {
            id: r.get(0),
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

    /// Marks (`published_at = now()`) or deletes published rows, per `afterPublish`.
    pub async fn finish_published(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        ids: &[i64],
    ) -> Result<(), PgError> {
        if ids.is_empty() {
            return Ok(());
        }
        let sql = match self.after_publish {
            AfterPublish::Mark => format!(
                "UPDATE {} SET {} = now() WHERE {} = ANY($1::int8[])",
                self.qualified,
                quote(&self.columns.published_at),
                quote(&self.columns.id)
            ),
            AfterPublish::Delete => format!(
                "DELETE FROM {} WHERE {} = ANY($1::int8[])",
                self.qualified,
                quote(&self.columns.id)
            ),
        };
        tx.execute(&sql, &[&ids])
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
        id: i64,
        reason: &str,
    ) -> Result<u64, PgError> {
        let cols = self.all_columns.join(", ");
        let id_col = quote(&self.columns.id);
        client
            .execute(
                &format!(
                    "WITH moved AS (DELETE FROM {} WHERE {id_col} = $1 RETURNING {cols}) \
                     INSERT INTO {} ({cols}, dead_letter_reason) SELECT {cols}, $2 FROM moved",
                    self.qualified, self.dead_letter
                ),
                &[&id, &reason],
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
        id: i64,
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

    /// Deletes up to `limit` rows published before `older_than`; returns how many. Each
    /// call is its own short statement, so retention never holds long locks.
    pub async fn delete_published_before(
        &self,
        client: &Client,
        older_than: Duration,
        limit: i64,
    ) -> Result<u64, PgError> {
        if self.after_publish == AfterPublish::Delete {
            return Ok(0);
        }
        let id = quote(&self.columns.id);
        let at = quote(&self.columns.published_at);
        client
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
            .map_err(db("deleting old published rows"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked() {
        for good in ["outbox", "_x", "Outbox_2", &"a".repeat(63)] {
            assert!(check_identifier(good).is_ok(), "{good}");
        }
        for bad in ["", "1a", "a-b", "a\"b", "a b", &"a".repeat(64), "é"] {
            assert!(check_identifier(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/orders?password=x"),
            "postgres://app:***@db:5432/orders"
        );
        assert_eq!(
            redact_url("host=db port=6543 user=app password=s3cret dbname=shop"),
            "postgres://app:***@db:6543/shop"
        );
        assert_eq!(redact_url("postgres://db/shop"), "postgres://db:5432/shop");
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "<not a PostgreSQL connection string>"
        );
    }

    /// Percent-encodes everything but letters and digits, as a careful user would.
    fn encode(text: &str) -> String {
        text.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    }

    /// Generated passwords of every printable character, percent-encoded or written
    /// as they are (which may make the URL unparseable, or move the `@`): no form of
    /// the password reaches the redacted text, the URL error, or a Secret value check.
    #[test]
    fn no_generated_password_survives_redaction_or_an_error_message() {
        use rand::Rng;
        let mut rng = rand::rng();
        let printable: Vec<char> = (0x20u8..0x7f).map(char::from).collect();
        let slot = crate::secrets::SecretSlot {
            field: "spec.database.postgres.connectionSecretRef",
            purpose: crate::secrets::SecretUse::Database,
            reference: crate::api::SecretKeyRef {
                name: "db".into(),
                key: "uri".into(),
            },
            delivery: crate::secrets::Delivery::Env("OUTBOX_DATABASE_URL"),
            content: crate::secrets::Content::PostgresUrl,
        };
        for _ in 0..2000 {
            let len = rng.random_range(10..24);
            let password: String = (0..len)
                .map(|_| printable[rng.random_range(0..printable.len())])
                .collect();
            for url in [
                format!("postgres://app:{}@db.example:5432/shop", encode(&password)),
                format!("postgres://app:{password}@db.example:5432/shop"),
                format!(
                    "postgresql://app@db.example/shop?password={}",
                    encode(&password)
                ),
                format!(
                    "host=db user=app password='{}' dbname=shop",
                    password.replace('\\', "\\\\").replace('\'', "\\'")
                ),
            ] {
                let outputs = [
                    redact_url(&url),
                    client_config(&url, "OUTBOX_DATABASE_URL", &PgTls::disabled(), "t")
                        .err()
                        .map(|e| e.to_string())
                        .unwrap_or_default(),
                    slot.check_value(&url).err().unwrap_or_default(),
                ];
                for output in outputs {
                    assert!(
                        !output.contains(&password) && !output.contains(&encode(&password)),
                        "password {password:?} leaked from {url:?}: {output}"
                    );
                }
            }
        }
    }

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
