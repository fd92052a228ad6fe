//! Outbox ids that are not integers: `uuid` (random, as `gen_random_uuid()` makes them,
//! and time-ordered in UUIDv7's layout), `text` and `varchar` (`evt-<n>`, made by the
//! application), through the real relay in both modes and to every broker.
//!
//! Such ids say nothing about insertion order: random uuids have none, and `evt-10`
//! sorts before `evt-9`. So each test proves, on every delivery (redeliveries
//! included), that every inserted row arrives under its id's text as PostgreSQL prints
//! it (a uuid lowercase with hyphens) — Kafka's `id` header, NATS's `id` header and
//! `Nats-Msg-Id`, RabbitMQ's `message_id` and `id` header — that nothing else arrives,
//! that the payload is the stored one byte for byte, and that each aggregate's first
//! deliveries keep insertion order (the payload's `seq`). Polling finds that order in
//! the `created_at` column, log tailing in the commit order; a relay that ordered by id,
//! or sent the id in another form, fails them.
//!
//! Rows are written by one client, several rows (of random aggregates) a transaction,
//! half before the relay starts (a backlog) and half while it runs; `created_at` is
//! `clock_timestamp()`, so rows of one transaction get distinct times.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::{RelayBroker, RelayOptions, RelayProcess, SlotGuard};
use rand::Rng;

/// Aggregates the rows are spread over.
const AGGREGATES: usize = 5;
/// Rows per transaction.
const ROWS_PER_TRANSACTION: usize = 5;
/// Transactions before the relay starts, and as many again while it runs: 200 rows.
const TRANSACTIONS_PER_HALF: usize = 20;

/// The id column under test and how its values are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IdKind {
    /// `uuid` from `gen_random_uuid()` (version 4): no order at all.
    Uuid,
    /// `uuid` in UUIDv7's layout (milliseconds since the epoch, then random bits): grows
    /// with time, but not within a millisecond.
    UuidV7,
    /// `text`, `evt-<n>` for the n-th row.
    Text,
    /// `varchar(64)`, likewise.
    Varchar,
}

impl IdKind {
    /// The id column's type.
    fn column_type(self) -> &'static str {
        match self {
            IdKind::Uuid | IdKind::UuidV7 => "uuid",
            IdKind::Text => "text",
            IdKind::Varchar => "varchar(64)",
        }
    }

    /// Whether the application makes the id (`evt-<n>`) rather than the database.
    fn app_made(self) -> bool {
        matches!(self, IdKind::Text | IdKind::Varchar)
    }

    /// The id's SQL in the INSERT: made by the database, or the application's `$3`.
    fn value_sql(self) -> &'static str {
        match self {
            IdKind::Uuid => "gen_random_uuid()",
            IdKind::UuidV7 => "public.uuid_v7_like()",
            IdKind::Text | IdKind::Varchar => "$3",
        }
    }
}

/// The relay's mode.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Mode {
    /// `polling` with `ordering: perAggregate` and `afterPublish: delete`, 25 rows a
    /// batch (several batches each way).
    Polling,
    /// `logTailing` with `deleteAfterPublish: true`.
    LogTailing,
}

/// Where the relay publishes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Target {
    Kafka,
    Nats,
    RabbitMq,
}

/// What a test reads its messages back from.
pub(crate) enum Sink {
    Kafka(String),
    Nats(common::TestStream),
    RabbitMq(common::TestQueue),
}

/// One message as a consumer saw it.
#[derive(Debug)]
pub(crate) struct Delivery {
    /// The message id (Kafka and NATS header `id`, RabbitMQ `message_id`).
    pub(crate) id: String,
    /// Other places that must carry the same id, by name (`None`: missing).
    pub(crate) also: Vec<(&'static str, Option<String>)>,
    /// The message key, where the broker has one (Kafka).
    pub(crate) key: Option<String>,
    pub(crate) payload: Vec<u8>,
}

/// One committed row.
struct Row {
    aggregate: String,
    /// `payload::text`: what the relay must send.
    payload: String,
}

/// What the writer committed: rows by id text, ids in insertion order, and each
/// aggregate's last `seq`.
#[derive(Default)]
pub(crate) struct Written {
    rows: HashMap<String, Row>,
    pub(crate) order: Vec<String>,
    seqs: HashMap<String, i64>,
}

impl Written {
    /// The payload (as `payload::text`) row `id` was written with; `None`: no such row.
    pub(crate) fn payload_of(&self, id: &str) -> Option<&str> {
        self.rows.get(id).map(|row| row.payload.as_str())
    }
}

/// Creates `public.outbox` with Debezium's columns and an id of `kind`, and the
/// UUIDv7-like generator.
pub(crate) async fn create_table(client: &tokio_postgres::Client, kind: IdKind) {
    client
        .batch_execute(&format!(
            "CREATE TABLE public.outbox (
                id {} PRIMARY KEY,
                aggregatetype text NOT NULL,
                aggregateid text NOT NULL,
                type text NOT NULL,
                payload jsonb,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp());
             CREATE FUNCTION public.uuid_v7_like() RETURNS uuid LANGUAGE sql VOLATILE AS $$
                SELECT (lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::bigint), 12, '0')
                        || '7' || substr(md5(random()::text), 1, 3)
                        || substr('89ab', 1 + floor(random() * 4)::int, 1)
                        || substr(md5(random()::text), 1, 15))::uuid
             $$;",
            kind.column_type()
        ))
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: creating the outbox table failed: {err}"));
}

/// Commits `transactions` transactions of [`ROWS_PER_TRANSACTION`] rows, each of a
/// random aggregate with the aggregate's next `seq` in its payload.
pub(crate) async fn write(
    client: &mut tokio_postgres::Client,
    kind: IdKind,
    transactions: usize,
    written: &mut Written,
) {
    let sql = format!(
        "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload) \
         VALUES ({}, 'Order', $1, 'Happened', ($2::text)::jsonb) \
         RETURNING id::text, payload::text",
        kind.value_sql()
    );
    for _ in 0..transactions {
        let tx = client.transaction().await.unwrap();
        let mut rows = Vec::new();
        for _ in 0..ROWS_PER_TRANSACTION {
            let aggregate = format!("agg-{}", rand::rng().random_range(0..AGGREGATES));
            let seq = written.seqs.get(&aggregate).copied().unwrap_or(0) + 1;
            written.seqs.insert(aggregate.clone(), seq);
            let payload = serde_json::json!({"aggregate": aggregate, "seq": seq}).to_string();
            let app_id = format!("evt-{}", written.order.len() + rows.len() + 1);
            let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                vec![&aggregate, &payload];
            if kind.app_made() {
                params.push(&app_id);
            }
            let row = tx.query_one(&sql, &params).await.unwrap();
            let (id, stored): (String, String) = (row.get(0), row.get(1));
            rows.push((id, aggregate, stored));
        }
        tx.commit().await.unwrap();
        for (id, aggregate, payload) in rows {
            written.order.push(id.clone());
            written.rows.insert(id, Row { aggregate, payload });
        }
    }
}

/// A fresh destination on `target`, and the relay's broker for it.
pub(crate) async fn open(target: Target) -> (RelayBroker, Sink) {
    let rig = common::Rig::load();
    match target {
        Target::Kafka => {
            let topic = common::fresh_topic(3).await;
            let broker = RelayBroker::Kafka {
                bootstrap: rig.kafka_bootstrap().to_owned(),
                topic: topic.clone(),
            };
            (broker, Sink::Kafka(topic))
        }
        Target::Nats => {
            let stream = common::fresh_stream().await;
            let broker = RelayBroker::Nats {
                url: rig.nats_url().to_owned(),
                subject: format!("{}.orders", stream.subject_prefix),
            };
            (broker, Sink::Nats(stream))
        }
        Target::RabbitMq => {
            let queue = common::fresh_queue().await;
            let broker = RelayBroker::Amqp {
                url: rig.amqp_url().to_owned(),
                exchange: common::fresh_exchange_for(&queue).await,
                routing_key: "outbox.{aggregateType}".to_owned(),
            };
            (broker, Sink::RabbitMq(queue))
        }
    }
}

/// Every message of `sink`, in the order a consumer gets them. (`common`'s consumers
/// read ids as integers.) `at_least`: what must be there already.
pub(crate) async fn drain(sink: &Sink, at_least: usize) -> Vec<Delivery> {
    match sink {
        Sink::Kafka(topic) => {
            let topic = topic.clone();
            // rdkafka's consumer hands over header values and payloads as the bytes they
            // are (a bytea payload need not be text).
            let records = tokio::task::spawn_blocking(move || common::kafka_records(&topic))
                .await
                .unwrap();
            assert!(
                records.len() >= at_least,
                "{} records, {at_least} expected at least",
                records.len()
            );
            records
                .into_iter()
                .map(|r| {
                    let ids: Vec<&String> = r
                        .headers
                        .iter()
                        .filter(|(name, _)| name == "id")
                        .map(|(_, v)| v)
                        .collect();
                    assert_eq!(ids.len(), 1, "Kafka record with {} id headers", ids.len());
                    Delivery {
                        id: ids[0].clone(),
                        also: Vec::new(),
                        key: r.key.map(|k| String::from_utf8_lossy(&k).into_owned()),
                        payload: r.payload,
                    }
                })
                .collect()
        }
        Sink::Nats(stream) => {
            let mut s = stream.jetstream.get_stream(&stream.name).await.unwrap();
            let last = s.info().await.unwrap().state.last_sequence;
            let mut out = Vec::new();
            for seq in 1..=last {
                let message = s.get_raw_message(seq).await.unwrap();
                let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
                // The relay scopes the id with its `<namespace>/<name>`.
                let msg_id = header("Nats-Msg-Id")
                    .and_then(|v| v.strip_prefix("test/relay/").map(str::to_owned));
                out.push(Delivery {
                    id: header("id").unwrap_or_default(),
                    also: vec![("Nats-Msg-Id after its scope test/relay/", msg_id)],
                    key: None,
                    payload: message.payload.to_vec(),
                });
            }
            out
        }
        Sink::RabbitMq(queue) => {
            use lapin::options::BasicGetOptions;
            let mut out = Vec::new();
            while let Some(message) = queue
                .channel
                .basic_get(queue.name.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                let props = &message.delivery.properties;
                let header = props.headers().as_ref().and_then(|table| {
                    table.into_iter().find_map(|(k, v)| match v {
                        lapin::types::AMQPValue::LongString(s) if k.as_str() == "id" => {
                            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                        }
                        _ => None,
                    })
                });
                out.push(Delivery {
                    id: props
                        .message_id()
                        .as_ref()
                        .map(|v| v.as_str().to_owned())
                        .unwrap_or_default(),
                    also: vec![("header id", header)],
                    key: None,
                    payload: message.delivery.data.clone(),
                });
            }
            out
        }
    }
}

/// What the deliveries say about the written rows.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub(crate) received: usize,
    pub(crate) duplicates: usize,
    /// Rows that never arrived, in insertion order.
    pub(crate) missing: Vec<String>,
    /// Message ids of no written row.
    pub(crate) orphans: Vec<String>,
    /// First deliveries after a later row of their aggregate.
    pub(crate) order_violations: Vec<String>,
    /// Messages whose other ids, key or payload disagree with their id's row.
    pub(crate) mismatches: Vec<String>,
}

/// Compares every delivery (redeliveries included) with the written rows.
pub(crate) fn check(deliveries: &[Delivery], written: &Written) -> Report {
    let mut report = Report {
        received: deliveries.len(),
        ..Report::default()
    };
    let mut seen = HashSet::new();
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    for d in deliveries {
        for (what, value) in &d.also {
            if value.as_deref() != Some(d.id.as_str()) {
                report
                    .mismatches
                    .push(format!("message {:?}: {what} is {value:?}", d.id));
            }
        }
        let Some(row) = written.rows.get(&d.id) else {
            report.orphans.push(d.id.clone());
            continue;
        };
        if d.payload != row.payload.as_bytes() {
            report.mismatches.push(format!(
                "row {}: payload {:?}, stored {:?}",
                d.id,
                String::from_utf8_lossy(&d.payload),
                row.payload
            ));
        }
        if d.key.as_ref().is_some_and(|k| *k != row.aggregate) {
            report.mismatches.push(format!(
                "row {}: key {:?}, aggregate {}",
                d.id, d.key, row.aggregate
            ));
        }
        if !seen.insert(d.id.as_str()) {
            report.duplicates += 1;
            continue;
        }
        let body: serde_json::Value = serde_json::from_slice(&d.payload).unwrap_or_default();
        let (Some(aggregate), Some(seq)) = (body["aggregate"].as_str(), body["seq"].as_i64())
        else {
            report
                .mismatches
                .push(format!("row {}: payload without aggregate and seq", d.id));
            continue;
        };
        let last = last_seq.entry(aggregate.to_owned()).or_insert(0);
        if seq <= *last {
            report.order_violations.push(format!(
                "aggregate {aggregate}: seq {seq} (row {}) after seq {last}",
                d.id
            ));
        }
        *last = seq.max(*last);
    }
    report.missing = written
        .order
        .iter()
        .filter(|id| !seen.contains(id.as_str()))
        .cloned()
        .collect();
    report
}

/// The config of a relay in `mode` to `broker` on Debezium's table (no header
/// columns), deleting what it publishes; polling every `interval`, or tailing a slot
/// made now (named after `slot_prefix`, dropped with the guard): rows committed from
/// then on are in its stream.
pub(crate) async fn relay_yaml(
    db: &common::TestDatabase,
    broker: &RelayBroker,
    mode: Mode,
    interval: &str,
    slot_prefix: &str,
) -> (String, Option<SlotGuard>) {
    let (yaml, guard) = match mode {
        Mode::Polling => (
            common::with_spec_line(
                &common::relay_config_yaml(broker, &RelayOptions::default()),
                "mode",
                &format!(
                    "{{polling: {{interval: {interval}, batchSize: 25, afterPublish: delete}}}}"
                ),
            ),
            None,
        ),
        Mode::LogTailing => {
            let guard = SlotGuard::new(common::Rig::load().pg_url(), slot_prefix);
            common::create_replication(&db.client, &guard.slot, &guard.slot).await;
            (
                common::log_tailing_yaml(broker, &guard.slot, true),
                Some(guard),
            )
        }
    };
    (
        common::with_spec_line(&yaml, "table", "{schema: public, name: outbox}"),
        guard,
    )
}

/// Waits until `public.outbox` is empty (every row published and taken out, 90 s at
/// most), then stops `relay` with SIGTERM; it must exit cleanly.
pub(crate) async fn until_published_then_stop(
    client: &tokio_postgres::Client,
    relay: &mut RelayProcess,
) {
    common::wait_for_relays(
        "every row published and deleted",
        Duration::from_secs(90),
        &[&*relay],
        || async {
            client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .is_ok_and(|r| r.get::<_, i64>(0) == 0)
        },
    )
    .await;
    let status = relay.terminate(Duration::from_secs(20));
    assert!(
        status.success(),
        "relay exit {status}; log:\n{}",
        relay.log()
    );
}

/// Writes rows with ids of `kind`, runs a relay in `mode` to `target` until the table
/// is empty (every row published and deleted), and checks every message.
async fn ids_arrive_as_text_in_order(kind: IdKind, mode: Mode, target: Target) {
    let mut db = common::fresh_database().await;
    create_table(&db.client, kind).await;
    let (broker, sink) = open(target).await;
    let (yaml, guard) = relay_yaml(&db, &broker, mode, "50ms", "ids").await;

    let mut written = Written::default();
    write(&mut db.client, kind, TRANSACTIONS_PER_HALF, &mut written).await;
    if kind != IdKind::UuidV7 {
        // Otherwise the test could not tell an id order from the insertion order.
        let mut sorted = written.order.clone();
        sorted.sort();
        assert_ne!(
            sorted, written.order,
            "the ids happen to sort in insertion order"
        );
    }
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    if let Some(guard) = &guard {
        common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    }
    write(&mut db.client, kind, TRANSACTIONS_PER_HALF, &mut written).await;
    until_published_then_stop(&db.client, &mut relay).await;

    let deliveries = drain(&sink, written.order.len()).await;
    let report = check(&deliveries, &written);
    println!(
        "{kind:?} ids, {mode:?} to {target:?}: {} rows written, {} messages, {} duplicates, \
         {} missing, {} orphans, {} order violations, {} mismatches",
        written.order.len(),
        report.received,
        report.duplicates,
        report.missing.len(),
        report.orphans.len(),
        report.order_violations.len(),
        report.mismatches.len()
    );
    assert!(
        report.orphans.is_empty(),
        "message ids of no row (the ids written look like {:?}): {:?}",
        &written.order[..3],
        report.orphans
    );
    assert!(report.missing.is_empty(), "lost: {:?}", report.missing);
    assert!(
        report.mismatches.is_empty(),
        "messages that disagree with their row: {:?}",
        report.mismatches
    );
    assert!(
        report.order_violations.is_empty(),
        "per-aggregate order broken: {:?}",
        report.order_violations
    );
    drop(guard);
    db.drop_database().await;
}

/// Random uuids, polled: the batch select follows `created_at`, not the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_polled_to_kafka() {
    ids_arrive_as_text_in_order(IdKind::Uuid, Mode::Polling, Target::Kafka).await;
}

/// Random uuids, tailed from the log: decoded from the stream as the uuid's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_tailed_to_kafka() {
    ids_arrive_as_text_in_order(IdKind::Uuid, Mode::LogTailing, Target::Kafka).await;
}

/// UUIDv7-like ids, polled: time-ordered ids still arrive in insertion order where a
/// millisecond holds several rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_v7_ids_polled_to_kafka() {
    ids_arrive_as_text_in_order(IdKind::UuidV7, Mode::Polling, Target::Kafka).await;
}

/// UUIDv7-like ids, tailed from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_v7_ids_tailed_to_kafka() {
    ids_arrive_as_text_in_order(IdKind::UuidV7, Mode::LogTailing, Target::Kafka).await;
}

/// Application-made text ids, polled: `evt-10` sorts before `evt-9`, insertion order
/// must not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_ids_polled_to_kafka() {
    ids_arrive_as_text_in_order(IdKind::Text, Mode::Polling, Target::Kafka).await;
}

/// Application-made text ids, tailed from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_ids_tailed_to_kafka() {
    ids_arrive_as_text_in_order(IdKind::Text, Mode::LogTailing, Target::Kafka).await;
}

/// `varchar` ids, polled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn varchar_ids_polled_to_kafka() {
    ids_arrive_as_text_in_order(IdKind::Varchar, Mode::Polling, Target::Kafka).await;
}

/// `varchar` ids, tailed from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn varchar_ids_tailed_to_kafka() {
    ids_arrive_as_text_in_order(IdKind::Varchar, Mode::LogTailing, Target::Kafka).await;
}

/// Random uuids, polled to NATS: the `id` header and the scoped `Nats-Msg-Id` carry
/// the uuid's text (JetStream deduplicates by it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_polled_to_nats() {
    ids_arrive_as_text_in_order(IdKind::Uuid, Mode::Polling, Target::Nats).await;
}

/// Random uuids, tailed from the log to NATS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_tailed_to_nats() {
    ids_arrive_as_text_in_order(IdKind::Uuid, Mode::LogTailing, Target::Nats).await;
}

/// Random uuids, polled to RabbitMQ: `message_id` and the `id` header carry the
/// uuid's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_polled_to_rabbitmq() {
    ids_arrive_as_text_in_order(IdKind::Uuid, Mode::Polling, Target::RabbitMq).await;
}

/// Random uuids, tailed from the log to RabbitMQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_ids_tailed_to_rabbitmq() {
    ids_arrive_as_text_in_order(IdKind::Uuid, Mode::LogTailing, Target::RabbitMq).await;
}

/// UUIDv7-like and application-made text ids to NATS and RabbitMQ, both modes: every
/// id kind reaches every broker under its text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_v7_ids_polled_to_nats() {
    ids_arrive_as_text_in_order(IdKind::UuidV7, Mode::Polling, Target::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_v7_ids_tailed_to_nats() {
    ids_arrive_as_text_in_order(IdKind::UuidV7, Mode::LogTailing, Target::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_v7_ids_polled_to_rabbitmq() {
    ids_arrive_as_text_in_order(IdKind::UuidV7, Mode::Polling, Target::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_v7_ids_tailed_to_rabbitmq() {
    ids_arrive_as_text_in_order(IdKind::UuidV7, Mode::LogTailing, Target::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_ids_polled_to_nats() {
    ids_arrive_as_text_in_order(IdKind::Text, Mode::Polling, Target::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_ids_tailed_to_nats() {
    ids_arrive_as_text_in_order(IdKind::Text, Mode::LogTailing, Target::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_ids_polled_to_rabbitmq() {
    ids_arrive_as_text_in_order(IdKind::Text, Mode::Polling, Target::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_ids_tailed_to_rabbitmq() {
    ids_arrive_as_text_in_order(IdKind::Text, Mode::LogTailing, Target::RabbitMq).await;
}
