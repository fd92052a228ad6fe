//! The rows `outbox-operator replay` publishes again: those of a window — a time range
//! of the created-at column, ids, aggregate ids, event types, any together — among the
//! rows the relay has published, read whole from where the table keeps them (marked
//! rows, rows log tailing keeps, the archive), in the order the relay sent them.

use tokio_postgres::Client;
use tokio_postgres::types::ToSql;

use super::OutboxTable;
use crate::postgres::audit::Evidence;
use crate::postgres::{OutboxRow, PgError, db, quote};

/// Which published rows a replay takes; every part that is set narrows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayWindow {
    /// Created at or after (Unix seconds).
    pub since: Option<f64>,
    /// Created before (Unix seconds).
    pub until: Option<f64>,
    /// These ids (as text).
    pub ids: Vec<String>,
    /// Of these aggregates.
    pub aggregate_ids: Vec<String>,
    /// Of these event types.
    pub event_types: Vec<String>,
}

impl OutboxTable {
    /// The published rows of `window` in `evidence`'s table, in the relay's order, at
    /// most `limit` (one more tells the caller the window holds more). A time range
    /// needs the created-at column.
    pub async fn replay_rows(
        &self,
        client: &Client,
        evidence: &Evidence,
        window: &ReplayWindow,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, PgError> {
        let c = &self.columns;
        let from = match evidence {
            Evidence::Archived(schema, name) => format!("{}.{}", quote(schema), quote(name)),
            Evidence::Marked | Evidence::Kept => self.qualified.clone(),
        };
        let mut conditions = Vec::new();
        if *evidence == Evidence::Marked {
            conditions.push(format!("{} IS NOT NULL", quote(&c.published_at)));
        }
        let mut params: Vec<Box<dyn ToSql + Sync + Send>> = Vec::new();
        let mut param = |value: Box<dyn ToSql + Sync + Send>| {
            params.push(value);
            format!("${}", params.len())
        };
        if window.since.is_some() || window.until.is_some() {
            let created = c.created_at.as_deref().ok_or_else(|| {
                PgError::Schema(format!(
                    "{from}: a time window needs the createdAt column (table.columns.createdAt); give ids instead"
                ))
            })?;
            if let Some(since) = window.since {
                let p = param(Box::new(since));
                conditions.push(format!("{} >= to_timestamp({p})", quote(created)));
            }
            if let Some(until) = window.until {
                let p = param(Box::new(until));
                conditions.push(format!("{} < to_timestamp({p})", quote(created)));
            }
        }
        for (column, values) in [
            (&c.id, &window.ids),
            (&c.aggregate_id, &window.aggregate_ids),
            (&c.event_type, &window.event_types),
        ] {
            if !values.is_empty() {
                let p = param(Box::new(values.clone()));
                conditions.push(format!("{}::text = ANY({p}::text[])", quote(column)));
            }
        }
        let p = param(Box::new(limit + 1));
        let sql = format!(
            "SELECT {rows} FROM {from}{where_} ORDER BY {order} LIMIT {p}",
            rows = self.row_list,
            where_ = if conditions.is_empty() {
                String::new()
            } else {
                format!(" WHERE {}", conditions.join(" AND "))
            },
            order = self.order_by,
        );
        let refs: Vec<&(dyn ToSql + Sync)> = params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        let rows = client
            .query(&sql, &refs)
            .await
            .map_err(db("reading the rows to replay"))?;
        Ok(rows.iter().map(|r| self.row_of(r)).collect())
    }
}
