//! How the relays read and compare row ids: integers as `int8`, uuid and text ids as
//! their text, each compared as the column's own type so its index serves.

use super::RowId;

/// The id types the relays read, as `format_type` and `information_schema` name them:
/// integers (the message id is the decimal text), and uuid and text ids (the message id
/// is the id's text; a uuid as PostgreSQL prints it).
pub const ID_TYPES: [&str; 6] = [
    "smallint",
    "integer",
    "bigint",
    "uuid",
    "text",
    "character varying",
];

/// How the relay reads and names the ids of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdKind {
    /// An integer id: read as `int8`, compared as `int8`; it orders the rows.
    Int,
    /// A uuid or text id: read as text, compared as `cast` (`uuid` or `text`); rows
    /// are ordered by the created-at column, the id breaking ties.
    Text { cast: &'static str },
}

impl IdKind {
    /// The kind of an id column of type `ty` (`information_schema` or `format_type`
    /// spelling, a length modifier allowed); `None` for a type the relay cannot use.
    pub fn of_type(ty: &str) -> Option<Self> {
        let base = ty.split('(').next().unwrap_or(ty).trim();
        match base {
            "smallint" | "integer" | "bigint" => Some(IdKind::Int),
            "uuid" => Some(IdKind::Text { cast: "uuid" }),
            "text" | "character varying" => Some(IdKind::Text { cast: "text" }),
            _ => None,
        }
    }
}

/// `ids` as one statement parameter: `int8[]` for integer ids, `text[]` for the others
/// (the statement casts it to the column's type).
pub fn id_param(
    kind: IdKind,
    ids: &[RowId],
) -> Box<dyn tokio_postgres::types::ToSql + Sync + Send> {
    match kind {
        IdKind::Int => Box::new(ids.iter().filter_map(RowId::as_int).collect::<Vec<i64>>()),
        IdKind::Text { .. } => {
            Box::new(ids.iter().map(ToString::to_string).collect::<Vec<String>>())
        }
    }
}
