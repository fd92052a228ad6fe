//! The dead-letter table seen from outside the relay (`outbox-operator dead-letters`):
//! its rows listed, and rows moved back into the outbox table (redrive) with their ids,
//! so the relay publishes them again as the same messages and consumers that
//! deduplicate by message id stay correct.

use tokio_postgres::Client;

use super::{OutboxTable, removal};
use crate::api::AfterPublish;
use crate::postgres::ids::{IdKind, id_param};
use crate::postgres::{PgError, RowId, db, quote};
use crate::spec::{ValidMode, ValidRelay};

/// One dead-lettered row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// The row id (message id), as text.
    pub id: String,
    /// Its aggregate id (empty when NULL).
    pub aggregate_id: String,
    /// Why it was moved (the broker's or the relay's reason).
    pub reason: String,
    /// When, RFC 3339.
    pub at: String,
}

impl OutboxTable {
    /// The table of a parsed relay, inspected as the relay reads it (log tailing: as
    /// rows that leave once published), for the tools that work on it from outside the
    /// relay (`dead-letters`, `replay`).
    pub async fn of_relay(client: &Client, valid: &ValidRelay) -> Result<Self, PgError> {
        let after_publish = match &valid.mode {
            ValidMode::Polling(p) => p.after_publish,
            ValidMode::LogTailing(_) => AfterPublish::Delete,
        };
        Self::inspect(
            client,
            &valid.table,
            &valid.dead_letter_table(),
            super::Columns::of(&valid.table),
            after_publish,
            valid.partitions,
        )
        .await
    }

    /// Whether the id column is an integer (ids given as text are read as numbers).
    pub fn has_int_ids(&self) -> bool {
        self.id_kind == IdKind::Int
    }

    /// The dead-lettered rows, oldest move first, at most `limit`.
    pub async fn dead_letters(
        &self,
        client: &Client,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, PgError> {
        let sql = format!(
            "SELECT {id}::text, coalesce({agg}::text, ''), dead_letter_reason, \
                    to_char(dead_lettered_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
               FROM {table} ORDER BY dead_lettered_at, {id} LIMIT $1",
            id = quote(&self.columns.id),
            agg = quote(&self.columns.aggregate_id),
            table = self.dead_letter,
        );
        let rows = client
            .query(&sql, &[&limit])
            .await
            .map_err(db("reading the dead-letter table"))?;
        Ok(rows
            .iter()
            .map(|r| DeadLetter {
                id: r.get(0),
                aggregate_id: r.get(1),
                reason: r.get(2),
                at: r.get(3),
            })
            .collect())
    }

    /// Moves dead-lettered rows back into the outbox table in one statement, with their
    /// ids (`OVERRIDING SYSTEM VALUE`: an identity column takes them too) and their
    /// columns as they were (a published-at column NULL, so polling selects them; log
    /// tailing streams the insert): those of `ids`, or every one. In insertion order
    /// (created-at, then id), so an aggregate's redriven rows go out in their order.
    /// Returns how many moved.
    pub async fn redrive(&self, client: &Client, ids: Option<&[RowId]>) -> Result<u64, PgError> {
        let cols = self.all_columns.join(", ");
        let id = quote(&self.columns.id);
        let order = match (self.id_kind, self.columns.created_at.as_deref()) {
            (IdKind::Text { .. }, Some(created)) => format!("{}, {id}", quote(created)),
            _ => id.clone(),
        };
        let which = match ids {
            Some(_) => format!("{id} = ANY({})", removal::id_array(self.id_kind)),
            None => "true".to_owned(),
        };
        let sql = format!(
            "WITH moved AS (DELETE FROM {dead} WHERE {which} RETURNING {cols}) \
             INSERT INTO {table} ({cols}) OVERRIDING SYSTEM VALUE \
             SELECT {cols} FROM moved ORDER BY {order}",
            dead = self.dead_letter,
            table = self.qualified,
        );
        let moved = match ids {
            Some(ids) => {
                let param = id_param(self.id_kind, ids);
                client.execute(&sql, &[&*param]).await
            }
            None => client.execute(&sql, &[]).await,
        };
        moved.map_err(db("moving dead-lettered rows back into the outbox table"))
    }
}
