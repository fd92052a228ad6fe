//! What `outbox-operator audit` reads from the database: the rows of a time window that
//! the relay has published, by the evidence the table keeps — marked rows (polling,
//! `afterPublish: mark`), rows kept in place (log tailing without `deleteAfterPublish`),
//! or rows moved to the archive table — in the order the relay had to keep per
//! aggregate.

use tokio_postgres::Client;

use super::{PgError, db, quote};
use crate::api::AfterPublish;
use crate::spec::{Table, ValidMode, ValidRelay};

/// Where the published rows of a window are found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Evidence {
    /// The outbox table, rows whose published-at column is set.
    Marked,
    /// The outbox table, every row (log tailing keeps rows; the relay publishes all).
    Kept,
    /// The archive table (`schema`, `name`): every row was published before its move.
    Archived(String, String),
}

impl Evidence {
    /// Where `valid` leaves evidence of what it published, or why it leaves none.
    pub fn of(valid: &ValidRelay) -> Result<Self, String> {
        let archived = || {
            valid
                .table
                .archive
                .as_ref()
                .map(|a| Self::Archived(a.schema.clone(), a.name.clone()))
        };
        let none = "the relay deletes what it publishes and keeps no archive (spec.table.archive): the table holds nothing to audit or replay";
        match &valid.mode {
            ValidMode::Polling(p) => match p.after_publish {
                AfterPublish::Mark => Ok(Self::Marked),
                AfterPublish::Archive => archived().ok_or_else(|| none.to_owned()),
                AfterPublish::Delete => Err(none.to_owned()),
            },
            ValidMode::LogTailing(lt) if !lt.delete_after_publish => Ok(Self::Kept),
            ValidMode::LogTailing(_) => archived().ok_or_else(|| none.to_owned()),
        }
    }

    /// What its rows are, for reports.
    pub fn describe(&self) -> String {
        match self {
            Self::Marked => "rows marked published".to_owned(),
            Self::Kept => "rows the log-tailing relay keeps".to_owned(),
            Self::Archived(schema, name) => format!("rows archived in {schema}.{name}"),
        }
    }
}

/// One published row, as the audit compares it with the broker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRow {
    /// The message id (the id column as text).
    pub id: String,
    /// The aggregate id (empty when NULL).
    pub aggregate_id: String,
    /// The aggregate type: where the row's message went.
    pub aggregate_type: String,
}

/// The published rows created between `since` and `until` (Unix seconds), oldest first
/// in the relay's order: by `order_by` (`columns.order`, or the id for integer ids),
/// else by insertion time and id. Needs the table's created-at column.
pub async fn published_rows(
    client: &Client,
    table: &Table,
    evidence: &Evidence,
    order_by: Option<&str>,
    since: f64,
    until: f64,
) -> Result<Vec<AuditRow>, PgError> {
    let c = &table.columns;
    let (schema, name) = match evidence {
        Evidence::Archived(schema, name) => (schema.as_str(), name.as_str()),
        Evidence::Marked | Evidence::Kept => (table.schema.as_str(), table.name.as_str()),
    };
    let created = quote(&c.created_at);
    let marked = match evidence {
        Evidence::Marked => format!(" AND {} IS NOT NULL", quote(&c.published_at)),
        Evidence::Kept | Evidence::Archived(..) => String::new(),
    };
    let order = match order_by {
        Some(column) => format!("{}, {}", quote(column), quote(&c.id)),
        None => format!("{created}, {}", quote(&c.id)),
    };
    let sql = format!(
        "SELECT {id}::text, coalesce({agg}::text, ''), coalesce({kind}::text, '') \
           FROM {schema}.{name} \
          WHERE {created} >= to_timestamp($1) AND {created} < to_timestamp($2){marked} \
          ORDER BY {order}",
        id = quote(&c.id),
        agg = quote(&c.aggregate_id),
        kind = quote(&c.aggregate_type),
        schema = quote(schema),
        name = quote(name),
    );
    let rows = client
        .query(&sql, &[&since, &until])
        .await
        .map_err(db("reading the published rows of the audit's window"))?;
    Ok(rows
        .iter()
        .map(|r| AuditRow {
            id: r.get(0),
            aggregate_id: r.get(1),
            aggregate_type: r.get(2),
        })
        .collect())
}
