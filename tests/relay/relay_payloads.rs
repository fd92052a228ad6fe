//! Payload columns of every type the relay reads reach the broker as the bytes the
//! table holds, in both modes: `bytea` (Debezium's ByteArrayConverter users) with bytes
//! that are not UTF-8 (NUL, 0xFF, a lone continuation byte) to Kafka, NATS and
//! RabbitMQ; `json`, whose text PostgreSQL keeps as written (spacing, key order,
//! duplicate keys), and `text` to Kafka. A relay that re-encoded a payload (parsed the
//! JSON, decoded bytea's hex form as text, replaced invalid UTF-8) would change bytes.
//!
//! The table is Debezium's with a uuid id; each row's aggregate and place in it are
//! remembered by id, so the check needs nothing from the payload: every row arrives
//! under its id with its exact bytes, nothing else arrives, and each aggregate's first
//! deliveries keep insertion order (relay_ids.rs's brokers, readers and relay config).

use crate::common;
use crate::relay_ids::{self, Delivery, Mode, Target};

use std::collections::{HashMap, HashSet};

use common::RelayProcess;
use rand::Rng;

/// Transactions of [`ROWS`] rows before the relay starts, and as many while it runs.
const TRANSACTIONS: usize = 10;
const ROWS: usize = 4;
const AGGREGATES: usize = 4;

/// The payload column's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Payload {
    Bytea,
    Json,
    Text,
}

impl Payload {
    fn column_type(self) -> &'static str {
        match self {
            Payload::Bytea => "bytea",
            Payload::Json => "json",
            Payload::Text => "text",
        }
    }

    /// A payload for row `seq` of `aggregate`, as bytes to bind.
    fn make(self, aggregate: &str, seq: usize) -> Vec<u8> {
        match self {
            Payload::Bytea => {
                let mut bytes = format!("{aggregate}|{seq}|").into_bytes();
                bytes.extend_from_slice(&[0x00, 0xff, 0x80, 0xc3, 0x28, b'\\', b'x']);
                let mut rng = rand::rng();
                bytes.extend((0..rng.random_range(0..64)).map(|_| rng.random::<u8>()));
                bytes
            }
            // Spacing, key order and a duplicate key that jsonb would not keep.
            Payload::Json => format!(
                "{{ \"seq\" : {seq},\n\t\"aggregate\":\"{aggregate}\", \"seq\": {seq}, \"note\": \"d\\u00e9j\\u00e0 \u{e9}\" }}"
            )
            .into_bytes(),
            // Starting as bytea's hex text does: still text.
            Payload::Text => {
                format!("\\x41{aggregate} #{seq}: caf\u{e9} \\x00 ✓\n\ttab").into_bytes()
            }
        }
    }

    /// The INSERT's payload parameter: bytes as they are, text as text.
    fn value_sql(self) -> &'static str {
        match self {
            Payload::Bytea => "$2::bytea",
            Payload::Json => "convert_from($2::bytea, 'UTF8')::json",
            Payload::Text => "convert_from($2::bytea, 'UTF8')",
        }
    }
}

/// A written row: its aggregate, its place in it, and the bytes the table holds.
struct Row {
    aggregate: String,
    seq: usize,
    stored: Vec<u8>,
}

#[derive(Default)]
struct Written {
    rows: HashMap<String, Row>,
    order: Vec<String>,
    seqs: HashMap<String, usize>,
}

async fn create_table(client: &tokio_postgres::Client, payload: Payload) {
    client
        .batch_execute(&format!(
            "CREATE TABLE public.outbox (
                id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
                aggregatetype text NOT NULL,
                aggregateid text NOT NULL,
                type text NOT NULL,
                payload {} NOT NULL,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp())",
            payload.column_type()
        ))
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: creating the outbox table failed: {err}"));
}

/// Commits `transactions` transactions of [`ROWS`] rows; what the table holds is read
/// back as bytes (`bytea` as it is, the others as their UTF-8 text).
async fn write(
    client: &mut tokio_postgres::Client,
    payload: Payload,
    transactions: usize,
    written: &mut Written,
) {
    let stored = if payload == Payload::Bytea {
        "payload"
    } else {
        "convert_to(payload::text, 'UTF8')"
    };
    let sql = format!(
        "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
         VALUES ('Order', $1, 'Happened', {}) RETURNING id::text, {stored}",
        payload.value_sql()
    );
    for _ in 0..transactions {
        let tx = client.transaction().await.unwrap();
        let mut rows = Vec::new();
        for _ in 0..ROWS {
            let aggregate = format!("agg-{}", rand::rng().random_range(0..AGGREGATES));
            let seq = written.seqs.get(&aggregate).copied().unwrap_or(0) + 1;
            written.seqs.insert(aggregate.clone(), seq);
            let bytes = payload.make(&aggregate, seq);
            let row = tx
                .query_one(&sql, &[&aggregate, &bytes])
                .await
                .unwrap_or_else(|err| panic!("inserting a {payload:?} payload: {err}"));
            let stored: Vec<u8> = row.get(1);
            assert_eq!(
                stored, bytes,
                "the table does not keep the {payload:?} payload as written"
            );
            rows.push((row.get::<_, String>(0), aggregate, seq, stored));
        }
        tx.commit().await.unwrap();
        for (id, aggregate, seq, stored) in rows {
            written.order.push(id.clone());
            written.rows.insert(
                id,
                Row {
                    aggregate,
                    seq,
                    stored,
                },
            );
        }
    }
}

/// Every delivery against the written rows: `(orphans, missing, mismatches, order
/// violations)`.
fn check(deliveries: &[Delivery], written: &Written) -> [Vec<String>; 4] {
    let (mut orphans, mut mismatches, mut order) = (Vec::new(), Vec::new(), Vec::new());
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for d in deliveries {
        for (what, value) in &d.also {
            if value.as_deref() != Some(d.id.as_str()) {
                mismatches.push(format!("message {}: {what} is {value:?}", d.id));
            }
        }
        let Some(row) = written.rows.get(&d.id) else {
            orphans.push(d.id.clone());
            continue;
        };
        if d.payload != row.stored {
            mismatches.push(format!(
                "row {}: payload {:?}, stored {:?}",
                d.id, d.payload, row.stored
            ));
        }
        if d.key.as_ref().is_some_and(|k| *k != row.aggregate) {
            mismatches.push(format!(
                "row {}: key {:?}, aggregate {}",
                d.id, d.key, row.aggregate
            ));
        }
        if !seen.insert(d.id.as_str()) {
            continue;
        }
        let before = last.entry(row.aggregate.as_str()).or_insert(0);
        if row.seq <= *before {
            order.push(format!(
                "{}: row {} (#{}) after #{before}",
                row.aggregate, d.id, row.seq
            ));
        }
        *before = row.seq.max(*before);
    }
    let missing = written
        .order
        .iter()
        .filter(|id| !seen.contains(id.as_str()))
        .cloned()
        .collect();
    [orphans, missing, mismatches, order]
}

/// Writes rows with `payload` payloads, runs a relay in `mode` to `target` until the
/// table is empty, and checks every message.
async fn payloads_arrive_as_stored(payload: Payload, mode: Mode, target: Target) {
    let mut db = common::fresh_database().await;
    create_table(&db.client, payload).await;
    let (broker, sink) = relay_ids::open(target).await;
    let (yaml, guard) = relay_ids::relay_yaml(&db, &broker, mode, "50ms", "payloads").await;
    let mut written = Written::default();
    write(&mut db.client, payload, TRANSACTIONS, &mut written).await;
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    if let Some(guard) = &guard {
        common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    }
    write(&mut db.client, payload, TRANSACTIONS, &mut written).await;
    relay_ids::until_published_then_stop(&db.client, &mut relay).await;

    let deliveries = relay_ids::drain(&sink, written.order.len()).await;
    let [orphans, missing, mismatches, order] = check(&deliveries, &written);
    println!(
        "{payload:?} payloads, {mode:?} to {target:?}: {} rows, {} messages, {} missing, \
         {} orphans, {} mismatches, {} order violations",
        written.order.len(),
        deliveries.len(),
        missing.len(),
        orphans.len(),
        mismatches.len(),
        order.len()
    );
    assert!(orphans.is_empty(), "message ids of no row: {orphans:?}");
    assert!(missing.is_empty(), "lost: {missing:?}");
    assert!(
        mismatches.is_empty(),
        "messages unlike their row: {mismatches:?}"
    );
    assert!(order.is_empty(), "per-aggregate order broken: {order:?}");
    drop(guard);
    db.drop_database().await;
}

/// Binary payloads, polled to Kafka: read as bytes, sent as bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_polled_to_kafka() {
    payloads_arrive_as_stored(Payload::Bytea, Mode::Polling, Target::Kafka).await;
}

/// Binary payloads, tailed from the log to Kafka: pgoutput sends bytea in its hex text
/// form, which the relay turns back into the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_tailed_to_kafka() {
    payloads_arrive_as_stored(Payload::Bytea, Mode::LogTailing, Target::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_polled_to_nats() {
    payloads_arrive_as_stored(Payload::Bytea, Mode::Polling, Target::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_tailed_to_nats() {
    payloads_arrive_as_stored(Payload::Bytea, Mode::LogTailing, Target::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_polled_to_rabbitmq() {
    payloads_arrive_as_stored(Payload::Bytea, Mode::Polling, Target::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_tailed_to_rabbitmq() {
    payloads_arrive_as_stored(Payload::Bytea, Mode::LogTailing, Target::RabbitMq).await;
}

/// `json` as written, spacing, key order and the duplicate key included: not parsed and
/// printed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_payloads_polled_to_kafka_keep_their_text() {
    payloads_arrive_as_stored(Payload::Json, Mode::Polling, Target::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_payloads_tailed_to_kafka_keep_their_text() {
    payloads_arrive_as_stored(Payload::Json, Mode::LogTailing, Target::Kafka).await;
}

/// `text` that starts as bytea's hex form does (`\x41…`), with non-ASCII characters
/// and control characters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_payloads_polled_to_kafka() {
    payloads_arrive_as_stored(Payload::Text, Mode::Polling, Target::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_payloads_tailed_to_kafka() {
    payloads_arrive_as_stored(Payload::Text, Mode::LogTailing, Target::Kafka).await;
}
