//! Log tailing on the PostgreSQL side: decoding of the `pgoutput` messages the relay
//! needs (Relation, Insert; the rest is recognised and skipped), and the SQL the relay
//! runs around the replication slot: slot statistics, heartbeats and the deletion of
//! published rows. Creating and dropping slot and publication is the controller's
//! (`super::admin`).
//!
//! The replication connection itself (replication-mode startup, `START_REPLICATION`,
//! CopyBoth framing, keepalive replies and standby status updates) is the
//! `pgwire-replication` crate's; it hands over Begin/Commit/Message boundaries already
//! parsed and every other pgoutput message as raw bytes, decoded here.
//!
//! Formats: <https://www.postgresql.org/docs/15/protocol-logicalrep-message-formats.html>
//! (protocol version 1, text-format column values).

use tokio_postgres::Client;

use super::table::IdKind;
use super::{PgError, db};

/// Type OID of `bytea`: its text form is `\x` + hex and is decoded back to bytes, so a
/// bytea payload is published as the stored bytes (as the polling relay does).
pub const BYTEA_OID: u32 = 17;

/// Prefix of the logical messages the relay writes as heartbeats.
pub const HEARTBEAT_PREFIX: &str = "outbox-heartbeat";

pub use crate::rules::check_slot_name;

/// A column of a relation as pgoutput describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Column name.
    pub name: String,
    /// Type OID.
    pub type_oid: u32,
}

/// A Relation message: sent before the first change of a table in a session and again
/// whenever its definition changes, so columns are looked up by name per relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Table OID, the key later change messages refer to.
    pub oid: u32,
    /// Schema.
    pub namespace: String,
    /// Table name.
    pub name: String,
    /// Columns in tuple order.
    pub columns: Vec<RelationColumn>,
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TupleValue {
    /// SQL NULL.
    Null,
    /// An unchanged TOASTed value (updates only; never in an insert).
    UnchangedToast,
    /// The value in the type's text format.
    Text(bytes::Bytes),
    /// The value in binary format (only with the `binary` option, which we do not use).
    Binary(bytes::Bytes),
}

/// The pgoutput messages the relay acts on; everything else is [`PgOutput::Other`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgOutput {
    /// Relation (table) description.
    Relation(Relation),
    /// A new row.
    Insert {
        /// Table OID.
        relation: u32,
        /// Column values in the relation's column order.
        tuple: Vec<TupleValue>,
    },
    /// Update, Delete, Truncate, Type, Origin and anything newer: ignored by the relay
    /// (the outbox publishes inserts only), named by its tag for logs.
    Other(u8),
}

/// A pgoutput message that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed pgoutput message: {0}")]
pub struct DecodeError(pub String);

/// A cursor over a message's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.bytes.len() < n {
            return Err(DecodeError(format!("truncated {what}")));
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn i16(&mut self, what: &str) -> Result<i16, DecodeError> {
        let b = self.take(2, what)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn i32(&mut self, what: &str) -> Result<i32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn cstring(&mut self, what: &str) -> Result<String, DecodeError> {
        let end = self
            .bytes
            .iter()
            .position(|b| *b == 0)
            .ok_or_else(|| DecodeError(format!("unterminated {what}")))?;
        let s = String::from_utf8_lossy(&self.bytes[..end]).into_owned();
        self.bytes = &self.bytes[end + 1..];
        Ok(s)
    }
}

/// Decodes one pgoutput (protocol version 1) message.
pub fn decode(data: &bytes::Bytes) -> Result<PgOutput, DecodeError> {
    let mut r = Reader { bytes: data };
    let tag = r.u8("message tag")?;
    match tag {
        b'R' => {
            let oid = r.u32("relation oid")?;
            let namespace = r.cstring("namespace")?;
            let name = r.cstring("relation name")?;
            let _replica_identity = r.u8("replica identity")?;
            let count = r.i16("column count")?;
            let mut columns = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
            for _ in 0..count {
                let _flags = r.u8("column flags")?;
                let name = r.cstring("column name")?;
                let type_oid = r.u32("column type")?;
                let _typmod = r.i32("column typmod")?;
                columns.push(RelationColumn { name, type_oid });
            }
            Ok(PgOutput::Relation(Relation {
                oid,
                namespace,
                name,
                columns,
            }))
        }
        b'I' => {
            let relation = r.u32("relation oid")?;
            let kind = r.u8("tuple marker")?;
            if kind != b'N' {
                return Err(DecodeError(format!(
                    "insert: expected new tuple marker 'N', got {kind:#04x}"
                )));
            }
            let tuple = tuple(&mut r)?;
            Ok(PgOutput::Insert { relation, tuple })
        }
        other => Ok(PgOutput::Other(other)),
    }
}

/// The values of a tuple.
fn tuple(r: &mut Reader<'_>) -> Result<Vec<TupleValue>, DecodeError> {
    let count = r.i16("tuple column count")?;
    let mut values = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    for _ in 0..count {
        let value = match r.u8("tuple value kind")? {
            b'n' => TupleValue::Null,
            b'u' => TupleValue::UnchangedToast,
            kind @ (b't' | b'b') => {
                let len = usize::try_from(r.i32("value length")?)
                    .map_err(|_| DecodeError("negative value length".to_owned()))?;
                // Copied once, into a buffer of its own: a slice of the message would
                // keep the reader's whole buffer alive as long as the row lives (with
                // 16 KiB payloads that doubled the relay's peak RSS, 52 → 115 MiB).
                // The row and the broker message share this copy.
                let bytes = bytes::Bytes::copy_from_slice(r.take(len, "value")?);
                if kind == b't' {
                    TupleValue::Text(bytes)
                } else {
                    TupleValue::Binary(bytes)
                }
            }
            other => {
                return Err(DecodeError(format!(
                    "unknown tuple value kind {other:#04x}"
                )));
            }
        };
        values.push(value);
    }
    Ok(values)
}

/// `\x0a1b…` (bytea's text output, hex format) → bytes.
pub fn decode_bytea_hex(text: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let hex = text
        .strip_prefix(b"\\x")
        .ok_or_else(|| DecodeError("bytea value not in hex format".to_owned()))?;
    if hex.len() % 2 != 0 {
        return Err(DecodeError("bytea hex of odd length".to_owned()));
    }
    let digit = |b: u8| match b {
        b'0'..=b'9' => Ok(b - b'0'),
        b'a'..=b'f' => Ok(b - b'a' + 10),
        b'A'..=b'F' => Ok(b - b'A' + 10),
        _ => Err(DecodeError("bytea hex digit expected".to_owned())),
    };
    hex.chunks(2)
        .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

/// A `timestamptz` or `timestamp` value in its text form under `DateStyle=ISO` (the
/// replication session sets it, see [`replication_config`]): `2026-12-05
/// 02:48:00.123456+00`, the offset `±HH[:MM[:SS]]` left out for `timestamp` (read as
/// UTC, as Debezium reads it), ` BC` for years before 1. Returns Unix seconds;
/// `Ok(None)` for `infinity` and `-infinity`, which have no instant.
///
/// Written here because no crate in the tree reads PostgreSQL's own layout (RFC 3339
/// parsers want a `T`, a colon in the offset and four-digit years).
pub fn parse_timestamp(text: &str) -> Result<Option<f64>, DecodeError> {
    if text == "infinity" || text == "-infinity" {
        return Ok(None);
    }
    let bad = || DecodeError(format!("`{text}` is not an ISO timestamp"));
    let (text_ad, bc) = match text.strip_suffix(" BC") {
        Some(rest) => (rest, true),
        None => (text, false),
    };
    let (date, time) = text_ad.split_once(' ').ok_or_else(bad)?;
    let mut ymd = date.splitn(3, '-');
    let number = |s: Option<&str>| -> Result<i64, DecodeError> {
        s.filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse().ok())
            .ok_or_else(bad)
    };
    let year = number(ymd.next())?;
    let (month, day) = (number(ymd.next())?, number(ymd.next())?);
    // Year 1 BC is year 0 of the proleptic calendar.
    let year = if bc { 1 - year } else { year };
    // The offset starts at the first sign after the seconds.
    let (clock, offset) = match time.find(['+', '-']) {
        Some(i) => (&time[..i], Some(&time[i..])),
        None => (time, None),
    };
    let mut hms = clock.splitn(3, ':');
    let (hour, minute) = (number(hms.next())?, number(hms.next())?);
    let seconds_text = hms.next().ok_or_else(bad)?;
    let (whole, fraction) = match seconds_text.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (seconds_text, None),
    };
    let second = number(Some(whole))?;
    let fraction = match fraction {
        Some(f) if !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()) => {
            format!("0.{f}").parse::<f64>().map_err(|_| bad())?
        }
        Some(_) => return Err(bad()),
        None => 0.0,
    };
    let offset_seconds = match offset {
        None => 0,
        Some(o) => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            let mut parts = o[1..].splitn(3, ':');
            let h = number(parts.next())?;
            let m = parts.next().map_or(Ok(0), |p| number(Some(p)))?;
            let s = parts.next().map_or(Ok(0), |p| number(Some(p)))?;
            sign * (h * 3600 + m * 60 + s)
        }
    };
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 24
        || minute > 59
        || second > 60
    {
        return Err(bad());
    }
    let days = days_from_civil(year, month, day);
    let local = days * 86_400 + hour * 3600 + minute * 60 + second;
    Ok(Some((local - offset_seconds) as f64 + fraction))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The replication connection's settings from the relay's database URL: same host,
/// port, user, password and database as its normal connections. Starts at the slot's
/// confirmed position (`0/0` asks the server for it) and reports nothing as confirmed
/// until the relay calls `update_applied_lsn`.
pub fn replication_config(
    url: &str,
    env: &str,
    tls: pgwire_replication::config::TlsConfig,
    slot: &str,
    publication: &str,
    status_interval: std::time::Duration,
) -> Result<pgwire_replication::ReplicationConfig, PgError> {
    let parsed: tokio_postgres::Config = url.parse().map_err(|_| PgError::Url {
        env: env.to_owned(),
        // The parser's message can quote the input, which may hold the password.
        message: "not a valid postgres:// URL or key=value connection string".to_owned(),
    })?;
    let host = match parsed.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(tokio_postgres::config::Host::Unix(path)) => path.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = parsed.get_ports().first().copied().unwrap_or(5432);
    let user = parsed.get_user().unwrap_or("postgres").to_owned();
    let password = parsed
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let database = parsed.get_dbname().unwrap_or(&user).to_owned();
    Ok(pgwire_replication::ReplicationConfig::new(
        host,
        user,
        password,
        database,
        slot,
        publication,
    )
    .with_port(port)
    .with_status_interval(status_interval)
    .with_wakeup_interval(status_interval.max(std::time::Duration::from_secs(1)))
    .with_application_name("outbox-relay-log-tailing")
    // Values stream in their text forms, which follow these settings: ISO dates and
    // UTC offsets are what [`parse_timestamp`] reads.
    .with_options("-c datestyle=ISO,MDY -c timezone=UTC")
    .with_buffer_size(STREAM_BUFFER_EVENTS)
    .with_tls(tls))
}

/// Events the replication client buffers ahead of the relay: a batch of rows. The
/// library's default (8,192 events) buffered 128 MiB of 16 KiB rows whenever the
/// walsender was ahead of the broker (relay peak RSS 115–192 MiB; 74 MiB with 2,048
/// events, no slower at 1 KiB); the batch is bounded by rows and bytes, and this keeps
/// the read-ahead bounded too.
const STREAM_BUFFER_EVENTS: usize = 1024;

// ---------------------------------------------------------------------------------------
// SQL around the slot. Slot and publication names passed [`check_slot_name`]; the table
// names passed `check_identifier`.

/// What `pg_replication_slots` says about the slot.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotStats {
    /// A walsender streams it right now.
    pub active: bool,
    /// `reserved`, `extended`, `unreserved` or `lost` (NULL for a slot that never
    /// reserved WAL, reported as empty).
    pub wal_status: String,
    /// `pg_current_wal_lsn() - restart_lsn`: the WAL this slot keeps from being recycled.
    pub retained_wal_bytes: i64,
    /// The position confirmed by the consumer, as text (`0/1A2B3C`).
    pub confirmed_flush_lsn: Option<String>,
}

/// The slot's statistics, or `None` when it does not exist.
pub async fn slot_stats(client: &Client, slot: &str) -> Result<Option<SlotStats>, PgError> {
    let row = client
        .query_opt(
            "SELECT active, coalesce(wal_status, ''), \
             coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8, \
             confirmed_flush_lsn::text \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(db("reading the replication slot"))?;
    Ok(row.map(|r| SlotStats {
        active: r.get(0),
        wal_status: r.get(1),
        retained_wal_bytes: r.get(2),
        confirmed_flush_lsn: r.get(3),
    }))
}

/// Writes a non-transactional logical message: it reaches the relay's stream at once,
/// and confirming its position lets an idle slot advance.
pub async fn emit_heartbeat(client: &Client) -> Result<(), PgError> {
    client
        .query_one(
            // The content is the database's clock when written: up to then every
            // commit precedes the heartbeat in the WAL.
            "SELECT pg_logical_emit_message(false, $1, extract(epoch FROM clock_timestamp())::text)",
            &[&HEARTBEAT_PREFIX],
        )
        .await
        .map_err(db("writing a heartbeat"))?;
    Ok(())
}

/// Whether publication `$1` publishes the inserts into table `$2.$3`: the table is
/// listed, or (a partitioned table whose publication lacks `publish_via_partition_root`)
/// its partitions are. The one definition of "covers", for the operator's checks and
/// the relay's confirmation ([`super::coverage::coverage`]).
///
/// Listed tables are matched by name against the table and its partition tree (empty
/// for a table that is not partitioned), never cast to
/// `regclass` one by one: under `FOR ALL TABLES` the list holds tables in schemas the
/// relay's role may not use (`pg_toast`), and the cast failed there with "permission
/// denied for schema", for every role but a superuser.
pub const PUBLICATION_COVERS_TABLE: &str = "EXISTS (SELECT 1 FROM pg_publication_tables t \
     JOIN pg_publication p ON p.pubname = t.pubname \
     JOIN pg_namespace n ON n.nspname = t.schemaname \
     JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename \
     WHERE t.pubname = $1 AND p.pubinsert \
       AND (c.oid = to_regclass(format('%I.%I', $2::text, $3::text)) \
            OR c.oid IN (SELECT relid FROM pg_partition_tree(to_regclass(format('%I.%I', $2::text, $3::text))))))";

/// Whether relation `oid` (a table the stream names) is a partition of table
/// `schema.table`: a publication without `publish_via_partition_root` streams a
/// partitioned table's rows under each partition's name.
pub async fn is_partition_of(
    client: &Client,
    oid: u32,
    schema: &str,
    table: &str,
) -> Result<bool, PgError> {
    Ok(client
        .query_one(
            "SELECT coalesce(pg_partition_root($1::oid::regclass) \
                 = to_regclass(format('%I.%I', $2::text, $3::text)), false)",
            &[&oid, &schema, &table],
        )
        .await
        .map_err(db("looking up a streamed table's partition root"))?
        .get(0))
}

/// The current snapshot as text (`xmin:xmax:xip,...`, xid8 values).
pub async fn current_snapshot(client: &Client) -> Result<String, PgError> {
    Ok(client
        .query_one("SELECT pg_current_snapshot()::text", &[])
        .await
        .map_err(db("reading the current snapshot"))?
        .get(0))
}

/// How the ids of `schema.table`'s `id_column` compare (its type, read from the
/// catalogue).
pub async fn id_kind_of(
    client: &Client,
    schema: &str,
    table: &str,
    id_column: &str,
) -> Result<IdKind, PgError> {
    let ty: Option<String> = client
        .query_opt(
            "SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a \
             JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = $3 AND NOT a.attisdropped",
            &[&schema, &table, &id_column],
        )
        .await
        .map_err(db("reading the id column's type"))?
        .map(|r| r.get(0));
    let ty = ty.unwrap_or_default();
    IdKind::of_type(&ty).ok_or_else(|| {
        PgError::Schema(format!(
            "{schema}.{table}: table.columns.id: column {id_column} is {ty}, which the relay cannot read"
        ))
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamps_in_postgres_iso_text_become_unix_seconds() {
        let at = |t: &str| parse_timestamp(t).unwrap().unwrap();
        assert_eq!(at("1970-01-01 00:00:00+00"), 0.0);
        assert_eq!(at("2000-01-01 00:00:00+00"), 946_684_800.0);
        assert_eq!(at("2000-01-01 05:30:00+05:30"), 946_684_800.0);
        assert_eq!(at("1999-12-31 21:00:00-03"), 946_684_800.0);
        // `timestamp` without a zone is read as UTC.
        assert_eq!(at("2000-01-01 00:00:00"), 946_684_800.0);
        assert_eq!(at("2000-02-29 12:00:00.25+00"), 951_825_600.25);
        assert_eq!(at("1969-12-31 23:59:59.5+00"), -0.5);
        // Local mean time offsets carry seconds.
        assert_eq!(at("1900-01-01 00:09:21+00:09:21"), -2_208_988_800.0);
        assert_eq!(at("0001-01-01 00:00:00+00"), -62_135_596_800.0);
        assert_eq!(at("0001-12-31 00:00:00+00 BC"), -62_135_683_200.0);
        assert_eq!(at("10000-01-01 00:00:00+00"), 253_402_300_800.0);
        assert_eq!(parse_timestamp("infinity").unwrap(), None);
        assert_eq!(parse_timestamp("-infinity").unwrap(), None);
        for bad in [
            "2000-01-01T00:00:00Z",
            "01/01/2000 00:00:00",
            "2000-13-01 00:00:00",
            "",
            "2000-01-01 00:00:00.+00",
        ] {
            assert!(parse_timestamp(bad).is_err(), "{bad}");
        }
    }

    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    // Captured from PostgreSQL 15 with pg_logical_slot_peek_binary_changes(slot, NULL,
    // NULL, 'proto_version', '1', 'publication_names', 'p') after
    // INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, traceparent)
    // VALUES ('Order', 'o-1', 'Created', '{"a": 1}', NULL) on the tests' outbox table.
    const RELATION: &str = "52000042b47075626c6963006f7574626f78006400080169640000000014ffffffff00616767726567617465747970650000000019ffffffff0061676772656761746569640000000019ffffffff00747970650000000019ffffffff007061796c6f61640000000edaffffffff007472616365706172656e740000000019ffffffff00637265617465645f617400000004a0ffffffff007075626c69736865645f617400000004a0ffffffff";
    const INSERT: &str = "49000042b44e000874000000013174000000054f7264657274000000036f2d3174000000074372656174656474000000087b2261223a20317d6e740000001d323032362d31322d30322031383a33383a30302e3833393038332b30306e";
    const BEGIN: &str = "4200000000106df260000304a9b613617700004fbc";

    #[test]
    fn a_captured_relation_message_decodes() {
        let PgOutput::Relation(rel) = decode(&hex(RELATION).into()).unwrap() else {
            panic!("not a relation");
        };
        assert_eq!(rel.oid, 0x42b4);
        assert_eq!(
            (rel.namespace.as_str(), rel.name.as_str()),
            ("public", "outbox")
        );
        let names: Vec<&str> = rel.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "id",
                "aggregatetype",
                "aggregateid",
                "type",
                "payload",
                "traceparent",
                "created_at",
                "published_at"
            ]
        );
        assert_eq!(rel.columns[0].type_oid, 20); // int8
        assert_eq!(rel.columns[4].type_oid, 3802); // jsonb
    }

    #[test]
    fn a_captured_insert_decodes_with_nulls_and_text_values() {
        let PgOutput::Insert { relation, tuple } = decode(&hex(INSERT).into()).unwrap() else {
            panic!("not an insert");
        };
        assert_eq!(relation, 0x42b4);
        assert_eq!(tuple.len(), 8);
        assert_eq!(tuple[0], TupleValue::Text(bytes::Bytes::from_static(b"1")));
        assert_eq!(
            tuple[1],
            TupleValue::Text(bytes::Bytes::from_static(b"Order"))
        );
        assert_eq!(
            tuple[2],
            TupleValue::Text(bytes::Bytes::from_static(b"o-1"))
        );
        assert_eq!(
            tuple[4],
            TupleValue::Text(bytes::Bytes::from_static(br#"{"a": 1}"#))
        );
        assert_eq!(tuple[5], TupleValue::Null);
        assert_eq!(tuple[7], TupleValue::Null);
    }

    #[test]
    fn other_messages_are_recognised_and_skipped() {
        assert_eq!(decode(&hex(BEGIN).into()).unwrap(), PgOutput::Other(b'B'));
        // Update of relation 0x42b4: new tuple with one NULL column.
        assert_eq!(
            decode(&hex("55000042b44e00016e").into()).unwrap(),
            PgOutput::Other(b'U')
        );
        assert_eq!(
            decode(&bytes::Bytes::from_static(b"D")).unwrap(),
            PgOutput::Other(b'D')
        );
    }

    #[test]
    fn truncated_or_malformed_messages_are_errors_not_panics() {
        let insert = bytes::Bytes::from(hex(INSERT));
        for cut in 1..insert.len() {
            assert!(decode(&insert.slice(..cut)).is_err(), "cut at {cut}");
        }
        let relation = bytes::Bytes::from(hex(RELATION));
        for cut in 1..relation.len() {
            assert!(decode(&relation.slice(..cut)).is_err(), "cut at {cut}");
        }
        assert!(decode(&hex("49000042b44b0000").into()).is_err()); // 'K' tuple in an insert
        assert!(decode(&hex("49000042b44e000178").into()).is_err()); // unknown value kind
        assert!(decode(&hex("49000042b44e000174ffffffff").into()).is_err()); // negative length
        assert!(decode(&bytes::Bytes::new()).is_err());
    }

    #[test]
    fn bytea_text_decodes_to_bytes() {
        assert_eq!(
            decode_bytea_hex(b"\\x00ff10Ab").unwrap(),
            vec![0, 255, 16, 171]
        );
        assert_eq!(decode_bytea_hex(b"\\x").unwrap(), Vec::<u8>::new());
        assert!(decode_bytea_hex(b"\\x0").is_err());
        assert!(decode_bytea_hex(b"abc").is_err());
        assert!(decode_bytea_hex(b"\\xzz").is_err());
    }

    #[test]
    fn slot_names_are_checked() {
        for good in ["outbox_shop_orders", "a", "0_9", &"a".repeat(63)] {
            assert!(check_slot_name(good).is_ok(), "{good}");
        }
        for bad in ["", "Outbox", "a-b", "a b", "a\"b", &"a".repeat(64), "é"] {
            assert!(check_slot_name(bad).is_err(), "{bad}");
        }
    }
}
