//! Where the outbox columns sit in the table's tuples as `pgoutput` streams them, and
//! the outbox row an inserted tuple becomes.

use crate::broker::{ColumnValue, ValueKind};
use crate::postgres::{OutboxRow, RowId};

/// `int2`, `int4`, `int8`: id columns whose values are integers.
const INT_OIDS: [u32; 3] = [21, 23, 20];
use crate::postgres::replication::{self as repl, BYTEA_OID, Relation, TupleValue};
use crate::postgres::table::Columns;

/// Why a relation or an inserted tuple cannot be read as the outbox table's.
#[derive(Debug, thiserror::Error)]
pub(super) enum LayoutError {
    /// The relation lacks a configured column.
    #[error("{schema}.{table} has no column {column} (stream)")]
    NoColumn {
        /// The outbox table's schema.
        schema: String,
        /// The outbox table.
        table: String,
        /// The column the configuration names.
        column: String,
    },
    /// A column's value is neither text nor NULL.
    #[error("column {column}: unexpected value {value:?}")]
    UnexpectedValue {
        /// Its position in the tuple.
        column: usize,
        /// What came.
        value: TupleValue,
    },
    /// The tuple is shorter than the relation.
    #[error("column {0} missing from the tuple")]
    MissingValue(usize),
    /// The id is NULL, or not an integer where the column is one.
    #[error("the id is NULL, or not an integer in an integer id column")]
    Id,
    /// The event-time column does not parse.
    #[error("row {id}: timestamp column: {error}")]
    Timestamp {
        /// The row.
        id: RowId,
        /// Why.
        error: repl::DecodeError,
    },
    /// A `bytea` payload does not decode.
    #[error("row {id}: payload: {error}")]
    Payload {
        /// The row.
        id: RowId,
        /// Why.
        error: repl::DecodeError,
    },
    /// The payload column is not in the tuple.
    #[error("row {id}: payload column missing")]
    NoPayload {
        /// The row.
        id: RowId,
    },
}

/// Where the outbox columns sit in the table's tuples.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Layout {
    id: usize,
    /// The id column is an integer (`int2`, `int4`, `int8`); else its text is the id.
    id_int: bool,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: usize,
    payload: usize,
    payload_bytea: bool,
    /// `table.columns.timestamp`, when configured.
    timestamp: Option<usize>,
    /// Extra columns: name, position, JSON kind.
    extra: Vec<(String, usize, ValueKind)>,
}

impl Layout {
    /// Whether `relation` is the outbox table by name (a partition of it streams under
    /// its own name; the caller asks the database about those).
    pub(super) fn names_table(relation: &Relation, schema: &str, table: &str) -> bool {
        relation.namespace == schema && relation.name == table
    }

    /// The layout of `relation` when it is the outbox table or one of its partitions
    /// (`ours`); `Ok(None)` for any other table; an error when it lacks a configured
    /// column. Columns are found by name: a partition may order them differently.
    pub(super) fn of(
        relation: &Relation,
        ours: bool,
        schema: &str,
        table: &str,
        columns: &Columns,
    ) -> Result<Option<Self>, LayoutError> {
        if !ours {
            return Ok(None);
        }
        let find = |name: &str| {
            relation
                .columns
                .iter()
                .position(|c| c.name == name)
                .ok_or_else(|| LayoutError::NoColumn {
                    schema: schema.to_owned(),
                    table: table.to_owned(),
                    column: name.to_owned(),
                })
        };
        let payload = find(&columns.payload)?;
        let id = find(&columns.id)?;
        Ok(Some(Self {
            id,
            id_int: INT_OIDS.contains(&relation.columns[id].type_oid),
            aggregate_type: find(&columns.aggregate_type)?,
            aggregate_id: find(&columns.aggregate_id)?,
            event_type: find(&columns.event_type)?,
            payload,
            payload_bytea: relation.columns[payload].type_oid == BYTEA_OID,
            timestamp: columns.timestamp.as_deref().map(find).transpose()?,
            extra: columns
                .extra
                .iter()
                .map(|h| {
                    let i = find(h)?;
                    Ok((
                        h.clone(),
                        i,
                        ValueKind::of_oid(relation.columns[i].type_oid),
                    ))
                })
                .collect::<Result<_, LayoutError>>()?,
        }))
    }

    /// The outbox row of an inserted tuple; `commit_unix` becomes its `created_at`
    /// (the end-to-end lag then runs from the commit).
    /// Takes `tuple` by value: the payload moves on to the broker as the same buffer.
    pub(super) fn row(
        &self,
        mut tuple: Vec<TupleValue>,
        commit_unix: f64,
    ) -> Result<OutboxRow, LayoutError> {
        let text = |i: usize| -> Result<Option<String>, LayoutError> {
            match tuple.get(i) {
                Some(TupleValue::Text(b)) => Ok(Some(String::from_utf8_lossy(b).into_owned())),
                Some(TupleValue::Null) => Ok(None),
                Some(other) => Err(LayoutError::UnexpectedValue {
                    column: i,
                    value: other.clone(),
                }),
                None => Err(LayoutError::MissingValue(i)),
            }
        };
        let id = match text(self.id)? {
            Some(s) if self.id_int => RowId::Int(s.parse::<i64>().map_err(|_| LayoutError::Id)?),
            Some(s) => RowId::Text(s.into()),
            None => return Err(LayoutError::Id),
        };
        let aggregate_type = text(self.aggregate_type)?.unwrap_or_default();
        let aggregate_id = text(self.aggregate_id)?;
        let event_type = text(self.event_type)?;
        let timestamp = match self.timestamp {
            Some(i) => match text(i)? {
                // `infinity` and its kin have no instant: the commit time stands in.
                Some(t) => repl::parse_timestamp(&t).map_err(|error| LayoutError::Timestamp {
                    id: id.clone(),
                    error,
                })?,
                None => None,
            },
            None => None,
        };
        let mut extra = Vec::new();
        for (name, i, kind) in &self.extra {
            if let Some(v) = text(*i)? {
                extra.push(ColumnValue::new(name, v, *kind));
            }
        }
        // Read last, as it is moved out of the tuple.
        let payload = match tuple
            .get_mut(self.payload)
            .map(|v| std::mem::replace(v, TupleValue::Null))
        {
            Some(TupleValue::Text(b)) if self.payload_bytea => Some(
                repl::decode_bytea_hex(&b)
                    .map_err(|error| LayoutError::Payload {
                        id: id.clone(),
                        error,
                    })?
                    .into(),
            ),
            Some(TupleValue::Text(b)) => Some(b),
            Some(TupleValue::Null) => None,
            _ => return Err(LayoutError::NoPayload { id: id.clone() }),
        };
        Ok(OutboxRow {
            id,
            aggregate_type,
            aggregate_id,
            event_type,
            payload,
            extra,
            partition: 0,
            created_at: Some(commit_unix),
            timestamp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::replication::RelationColumn;

    fn columns() -> Columns {
        Columns {
            id: "id".into(),
            aggregate_type: "aggregatetype".into(),
            aggregate_id: "aggregateid".into(),
            event_type: "type".into(),
            payload: "payload".into(),
            created_at: None,
            published_at: "published_at".into(),
            timestamp: None,
            order: None,
            extra: vec!["traceparent".into()],
        }
    }

    fn relation(payload_oid: u32) -> Relation {
        let col = |name: &str, type_oid| RelationColumn {
            name: name.into(),
            type_oid,
        };
        Relation {
            oid: 7,
            namespace: "public".into(),
            name: "outbox".into(),
            columns: vec![
                col("id", 20),
                col("aggregatetype", 25),
                col("aggregateid", 25),
                col("type", 25),
                col("payload", payload_oid),
                col("traceparent", 25),
            ],
        }
    }

    fn text(s: &str) -> TupleValue {
        TupleValue::Text(bytes::Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn an_inserted_tuple_becomes_the_row_polling_would_read() {
        let layout = Layout::of(&relation(3802), true, "public", "outbox", &columns())
            .unwrap()
            .unwrap();
        let tuple = [
            text("42"),
            text("Order"),
            text("o-1"),
            text("Created"),
            text(r#"{"a": 1}"#),
            text("00-abc-01"),
        ];
        let row = layout.row(tuple.to_vec(), 5.0).unwrap();
        assert_eq!(row.id, RowId::Int(42));
        assert_eq!(row.aggregate_id.as_deref(), Some("o-1"));
        assert_eq!(row.payload.as_deref(), Some(&br#"{"a": 1}"#[..]));
        assert_eq!(
            row.extra,
            vec![ColumnValue::new(
                "traceparent",
                "00-abc-01".into(),
                ValueKind::Text
            )]
        );
        let mut nulls = tuple.clone();
        nulls[4] = TupleValue::Null;
        nulls[5] = TupleValue::Null;
        let row = layout.row(nulls.to_vec(), 5.0).unwrap();
        assert!(row.payload.is_none() && row.extra.is_empty());
    }

    #[test]
    fn the_timestamp_column_is_read_from_its_text_form() {
        let mut r = relation(3802);
        r.columns.push(RelationColumn {
            name: "occurred_at".into(),
            type_oid: 1184,
        });
        let cols = Columns {
            timestamp: Some("occurred_at".into()),
            ..columns()
        };
        let layout = Layout::of(&r, true, "public", "outbox", &cols)
            .unwrap()
            .unwrap();
        let mut tuple = vec![
            text("1"),
            text("A"),
            text("a"),
            text("T"),
            text("{}"),
            TupleValue::Null,
            text("2000-01-01 00:00:00.5+00"),
        ];
        let row = layout.row(tuple.clone(), 7.0).unwrap();
        assert_eq!(
            (row.timestamp, row.created_at),
            (Some(946_684_800.5), Some(7.0))
        );
        tuple[6] = TupleValue::Null;
        assert_eq!(layout.row(tuple.clone(), 7.0).unwrap().timestamp, None);
        tuple[6] = text("infinity");
        assert_eq!(layout.row(tuple.clone(), 7.0).unwrap().timestamp, None);
        tuple[6] = text("Sat Jan 01 00:00:00 2000 UTC");
        let err = layout.row(tuple, 7.0).unwrap_err().to_string();
        assert!(err.contains("row 1: timestamp column"), "{err}");
        let missing = Columns {
            timestamp: Some("nope".into()),
            ..columns()
        };
        assert!(Layout::of(&relation(25), true, "public", "outbox", &missing).is_err());
    }

    #[test]
    fn bytea_payloads_are_published_as_bytes() {
        let layout = Layout::of(&relation(BYTEA_OID), true, "public", "outbox", &columns())
            .unwrap()
            .unwrap();
        let tuple = [
            text("1"),
            text("A"),
            text("a"),
            text("T"),
            text("\\x00ff"),
            TupleValue::Null,
        ];
        assert_eq!(
            layout.row(tuple.to_vec(), 0.0).unwrap().payload.as_deref(),
            Some(&[0, 255][..])
        );
    }

    #[test]
    fn other_tables_are_skipped_and_missing_columns_named() {
        let r = relation(25);
        assert!(Layout::names_table(&r, "public", "outbox"));
        assert!(!Layout::names_table(&r, "public", "other"));
        assert!(!Layout::names_table(&r, "audit", "outbox"));
        assert_eq!(
            Layout::of(&r, false, "public", "other", &columns()).unwrap(),
            None
        );
        // A partition (another name) is read by column name like the table.
        let mut partition = relation(25);
        partition.name = "outbox_2026".into();
        partition.columns.reverse();
        let layout = Layout::of(&partition, true, "public", "outbox", &columns()).unwrap();
        assert!(layout.is_some());
        let mut r = relation(25);
        r.columns.pop();
        let err = Layout::of(&r, true, "public", "outbox", &columns())
            .unwrap_err()
            .to_string();
        assert!(err.contains("traceparent"), "{err}");
    }
}
