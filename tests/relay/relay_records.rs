//! The exact Kafka records a table of rows becomes, as Debezium's outbox event router
//! would produce them: topic, partition (Java's murmur2, from Kafka's own jars), key
//! bytes, value bytes (a tombstone for a NULL payload, and for a blank one with
//! `tombstoneOnEmptyPayload`), headers and record timestamp (the event's time column,
//! else the row's `created_at` in polling and its commit time in log tailing). The
//! records are read back by kcat, not by our client; the expected values come from the
//! rows as PostgreSQL reports them, not from the relay's code.

use crate::common::{self, RelayBroker, RelayProcess, SlotGuard};
use crate::relay_partitioning::java_partitions;

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

const PARTITIONS: i32 = 6;

/// One row of the table: key, event type, payload, traceparent, event time.
type Row = (
    Option<&'static str>,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
    Option<&'static str>,
);

/// Every case the router's options distinguish.
const ROWS: [Row; 8] = [
    (
        Some("order-1"),
        "OrderCreated",
        Some(r#"{"total": 12.5, "lines": [1, 2]}"#),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        Some("2026-01-02 03:04:05.678+00"),
    ),
    // NULL payload: a tombstone, whatever the option says.
    (Some("order-1"), "OrderDeleted", None, None, None),
    // Empty and blank payloads: sent as stored, tombstones with the option.
    (Some("order-2"), "Empty", Some(""), None, None),
    (
        Some("order-2"),
        "Blank",
        Some(" \n\t "),
        None,
        Some("1999-12-31 23:59:59.999+05:30"),
    ),
    (Some("order-2"), "Padded", Some(" {} "), None, None),
    // No aggregate id: no key.
    (None, "Keyless", Some("x"), None, None),
    (
        Some("Ölfaß-Überweisung"),
        "Unicode",
        Some(r#"{"name": "Zoë"}"#),
        None,
        Some("1969-07-20 20:17:40+00"),
    ),
    (
        Some("0b6f3c1e-9d2a-4f4e-8a51-3c1f2b9e7d10"),
        "Uuid",
        Some("[]"),
        None,
        Some("infinity"),
    ),
];

/// What a consumer must see for one row.
#[derive(Debug, PartialEq)]
struct Record {
    partition: Option<i32>,
    key: Option<String>,
    value: Option<String>,
    headers: Vec<(String, String)>,
    /// Exact, or a window (log tailing's commit time, read from a clock).
    timestamp: (i64, i64),
}

async fn create_table(client: &tokio_postgres::Client) {
    common::create_outbox_table(client, 4).await;
    client
        .batch_execute(
            "ALTER TABLE public.outbox ALTER COLUMN payload TYPE text, \
             ALTER COLUMN aggregateid DROP NOT NULL, ADD COLUMN occurred_at timestamptz, \
             ADD COLUMN version int4, ADD COLUMN urgent boolean, ADD COLUMN part int4",
        )
        .await
        .unwrap();
}

/// Inserts [`ROWS`] in one transaction; returns each row's id and `created_at` (Unix
/// ms) as PostgreSQL stored them, and the wall clock around the commit.
async fn insert_rows(client: &mut tokio_postgres::Client) -> (Vec<(i64, i64)>, (i64, i64)) {
    let before = now_ms();
    let tx = client.transaction().await.unwrap();
    let mut ids = Vec::new();
    for (i, (key, ty, payload, trace, at)) in ROWS.into_iter().enumerate() {
        let (version, urgent, part) = placed_values(i);
        let row = tx
            .query_one(
                "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, traceparent, \
                 occurred_at, version, urgent, part) \
                 VALUES ('Order', $1, $2, $3, $4, $5::text::timestamptz, $6, $7, $8) \
                 RETURNING id, floor(extract(epoch FROM created_at) * 1000)::int8",
                &[&key, &ty, &payload, &trace, &at, &version, &urgent, &part],
            )
            .await
            .unwrap();
        ids.push((row.get(0), row.get(1)));
    }
    tx.commit().await.unwrap();
    (ids, (before, now_ms()))
}

/// Row `i`'s `version`, `urgent` and `part` columns (placed by the `placed` scenario).
fn placed_values(i: usize) -> (i32, bool, Option<i32>) {
    let i = i32::try_from(i).unwrap();
    (i, i % 2 == 0, (i % 3 != 0).then_some(i % PARTITIONS))
}

/// The value the router's envelope holds for row `i` with `table.expand.json.payload`:
/// `{"payload": …, "version": …, "isUrgent": …}`.
fn envelope(i: usize, payload: Option<&str>) -> serde_json::Value {
    let (version, urgent, _) = placed_values(i);
    let payload = match payload {
        None => serde_json::Value::Null,
        Some(p) if p.starts_with(['{', '[']) => serde_json::from_str(p).unwrap(),
        Some(p) => serde_json::Value::String(p.to_owned()),
    };
    serde_json::json!({"payload": payload, "version": version, "isUrgent": urgent})
}

fn now_ms() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// The event times as PostgreSQL reads them (Unix ms); left out: NULL, infinity and
/// times before 1970 (no Kafka timestamp), which fall back.
async fn event_times(client: &tokio_postgres::Client) -> BTreeMap<i64, i64> {
    client
        .query(
            "SELECT id, floor(extract(epoch FROM occurred_at) * 1000)::int8 FROM public.outbox \
             WHERE occurred_at IS NOT NULL AND isfinite(occurred_at) \
             AND occurred_at >= 'epoch'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// The records Debezium's router would produce for [`ROWS`].
fn expected(
    ids: &[(i64, i64)],
    commit_window: Option<(i64, i64)>,
    events: &BTreeMap<i64, i64>,
    tombstone_on_empty: bool,
    placed: bool,
) -> Vec<Record> {
    let keys: Vec<String> = ROWS.iter().filter_map(|r| r.0.map(str::to_owned)).collect();
    let java = java_partitions(&keys, PARTITIONS);
    ROWS.iter()
        .zip(ids)
        .enumerate()
        .map(|(i, ((key, ty, payload, trace, _), (id, created)))| {
            let mut headers = vec![
                ("id".to_owned(), id.to_string()),
                ("type".to_owned(), (*ty).to_owned()),
                ("aggregateType".to_owned(), "Order".to_owned()),
            ];
            if let Some(t) = trace {
                headers.push(("traceparent".to_owned(), (*t).to_owned()));
            }
            if placed {
                headers.push(("eventType".to_owned(), (*ty).to_owned()));
            }
            let value = match payload {
                Some(p) if tombstone_on_empty && p.trim().is_empty() => None,
                other if placed => Some(envelope(i, *other).to_string()),
                other => other.map(str::to_owned),
            };
            let part = placed_values(i).2.filter(|_| placed);
            let timestamp = match (events.get(id), commit_window) {
                (Some(at), _) => (*at, *at),
                (None, Some(window)) => window,
                (None, None) => (*created, *created),
            };
            Record {
                partition: part.or_else(|| key.map(|k| java[k])),
                key: key.map(str::to_owned),
                value,
                headers,
                timestamp,
            }
        })
        .collect()
}

/// Every record of `topic`, read by kcat (`-J`: JSON envelopes, a null payload as
/// `null`), in row-id order.
fn kcat_records(topic: &str, count: usize) -> Vec<(Record, i64)> {
    let mut records: Vec<(Record, i64)> = common::kcat_records(topic, count)
        .into_iter()
        .map(|r| {
            let v = &r.json;
            assert_eq!(v["tstype"], "create", "{v}");
            let id: i64 = r
                .headers
                .iter()
                .find(|(k, _)| k == "id")
                .unwrap()
                .1
                .parse()
                .unwrap();
            let ts = v["ts"].as_i64().unwrap();
            (
                Record {
                    partition: Some(i32::try_from(v["partition"].as_i64().unwrap()).unwrap()),
                    key: v["key"].as_str().map(str::to_owned),
                    value: v["payload"].as_str().map(str::to_owned),
                    headers: r.headers.clone(),
                    timestamp: (ts, ts),
                },
                id,
            )
        })
        .collect();
    records.sort_by_key(|(_, id)| *id);
    records
}

async fn scenario(log_tailing: bool, tombstone_on_empty: bool, placed: bool) {
    scenario_on(false, log_tailing, tombstone_on_empty, placed).await;
}

/// [`scenario`] on the rig's PostgreSQL 18 (`pg18`) or 15.
async fn scenario_on(pg18: bool, log_tailing: bool, tombstone_on_empty: bool, placed: bool) {
    let rig = common::Rig::load();
    let mut db = if pg18 {
        common::fresh_database_18().await
    } else {
        common::fresh_database().await
    };
    create_table(&db.client).await;
    let topic = common::fresh_topic(PARTITIONS).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let mut yaml = common::with_spec_line(
        &common::relay_config_yaml(&broker, &common::RelayOptions::default()),
        "table",
        "{schema: public, name: outbox, headers: [traceparent], columns: {timestamp: occurred_at}}",
    );
    if tombstone_on_empty {
        yaml = yaml.replace(
            "\nlisten:",
            "\n  message: {tombstoneOnEmptyPayload: true}\nlisten:",
        );
    }
    if placed {
        // transforms.outbox.table.fields.additional.placement=
        //   type:header:eventType,version:envelope,urgent:envelope:isUrgent,part:partition
        // transforms.outbox.table.expand.json.payload=true
        yaml = common::with_spec_line(
            &yaml,
            "table",
            "{schema: public, name: outbox, headers: [traceparent], columns: {timestamp: occurred_at}, \
             additionalFields: [{column: type, placement: header, as: eventType}, \
             {column: version, placement: envelope}, {column: urgent, placement: envelope, as: isUrgent}, \
             {column: part, placement: partition}]}",
        );
        yaml = yaml.replace(
            "\nlisten:",
            "\n  message: {expandJsonPayload: true}\nlisten:",
        );
    }
    let admin_url = common::pg_url_for(&db.url, "postgres");
    let guard = log_tailing.then(|| SlotGuard::new(&admin_url, "records"));
    if let Some(guard) = &guard {
        common::create_replication(&db.client, &guard.slot, &guard.slot).await;
        yaml = common::with_spec_line(&yaml, "mode", &common::log_tailing_mode(&guard.slot, false));
    }
    let (ids, window) = insert_rows(&mut db.client).await;
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    let events = event_times(&db.client).await;
    let topic_for_kcat = topic.clone();
    let got = match tokio::task::spawn_blocking(move || kcat_records(&topic_for_kcat, ROWS.len()))
        .await
    {
        Ok(got) => got,
        // Say what the relay was doing: its log goes with it otherwise.
        Err(err) => panic!("{err}\nthe relay's log:\n{}", relay.log_tail(80)),
    };
    let want = expected(
        &ids,
        log_tailing.then_some(window),
        &events,
        tombstone_on_empty,
        placed,
    );
    assert_eq!(got.len(), want.len(), "one record per row: {got:#?}");
    for ((record, id), want) in got.iter().zip(&want) {
        let Record {
            partition,
            key,
            value,
            headers,
            timestamp: (at, _),
        } = record;
        let context = format!(
            "row {id}: got {record:?}, want {want:?}\n{}",
            relay.log_tail(20)
        );
        if want.partition.is_some() {
            assert_eq!(*partition, want.partition, "partition of {context}");
        }
        assert_eq!((key, headers), (&want.key, &want.headers), "{context}");
        if placed && let (Some(got), Some(want)) = (value, &want.value) {
            // The envelope's fields in the router's order, payload first; the values
            // compared as JSON.
            assert!(got.starts_with("{\"payload\":"), "{context}");
            let parse = |v: &str| serde_json::from_str::<serde_json::Value>(v).unwrap();
            assert_eq!(parse(got), parse(want), "{context}");
        } else {
            assert_eq!(value, &want.value, "{context}");
        }
        assert!(
            (want.timestamp.0..=want.timestamp.1).contains(at),
            "timestamp of {context}"
        );
    }
    drop(relay);
    drop(guard);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_sends_the_records_debeziums_router_sends() {
    scenario(false, false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blank_payloads_become_tombstones_when_asked() {
    scenario(false, true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_sends_the_same_records_stamped_with_the_commit_time() {
    scenario(true, false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_columns_go_to_headers_envelope_and_partition_in_both_modes() {
    scenario(false, false, true).await;
    scenario(true, false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_18_streams_the_same_records_in_both_modes() {
    scenario_on(true, true, false, true).await;
    scenario_on(true, false, false, true).await;
}
