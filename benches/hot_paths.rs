//! Micro-benchmarks (criterion) of the relay's and the operator's hot paths: building a
//! broker message from a row, splitting a batch into per-aggregate chains, decoding a
//! pgoutput Insert, and rendering every object of an OutboxRelay.
//!
//! `cargo bench --bench hot_paths` measures; `cargo test --benches` (CI) runs each once.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use outbox_operator::api::OutboxRelay;
use outbox_operator::broker::{BrokerKind, ColumnValue, Shape, ValueKind};
use outbox_operator::postgres::OutboxRow;
use outbox_operator::postgres::replication::decode;
use outbox_operator::relay::chains::chains;
use outbox_operator::resources::{BuildOptions, build};

/// A 1 KiB JSON payload, as the end-to-end benchmark writes.
fn payload(seq: i64) -> Vec<u8> {
    let mut p = format!(
        r#"{{"aggregate": "agg-{}", "seq": {seq}, "data": ""#,
        seq % 1000
    );
    p.push_str(&"x".repeat(1024 - p.len() - 2));
    p.push_str(r#""}"#);
    p.into_bytes()
}

fn row(id: i64) -> OutboxRow {
    OutboxRow {
        id: id.into(),
        aggregate_type: "order".into(),
        aggregate_id: Some(format!("agg-{}", id % 1000)),
        event_type: Some("Happened".into()),
        payload: Some(payload(id).into()),
        extra: vec![ColumnValue::new(
            "traceparent",
            "00-trace-01".into(),
            ValueKind::Text,
        )],
        partition: id % 4,
        created_at: Some(1.7e9),
        timestamp: None,
    }
}

fn message_building(c: &mut Criterion) {
    let r = row(42);
    let mut group = c.benchmark_group("build_message");
    group.throughput(Throughput::Elements(1));
    let kafka = Shape::new(BrokerKind::Kafka, "outbox.event.{aggregateType}");
    group.bench_function("kafka", |b| b.iter(|| kafka.build(black_box(&r))));
    let nats = Shape::new(BrokerKind::Nats, "outbox.{aggregateType}");
    group.bench_function("nats", |b| b.iter(|| nats.build(black_box(&r))));
    group.finish();
}

fn chain_splitting(c: &mut Criterion) {
    let batch: Vec<OutboxRow> = (0..500).map(row).collect();
    let mut group = c.benchmark_group("chains");
    group.throughput(Throughput::Elements(500));
    group.bench_function("per_aggregate_500_rows_1000_aggregates", |b| {
        b.iter_batched(
            || batch.clone(),
            |rows| chains(rows, true),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

/// A pgoutput Insert message as the server sends it for one outbox row (protocol 1, text
/// format): tag `I`, relation OID, `N`, column count, then each column as `t` + length +
/// bytes (or `n` for NULL), in the table's column order.
fn insert_message(id: i64) -> Vec<u8> {
    let columns: Vec<Option<Vec<u8>>> = vec![
        Some(id.to_string().into_bytes()),
        Some(b"order".to_vec()),
        Some(format!("agg-{}", id % 1000).into_bytes()),
        Some(b"Happened".to_vec()),
        Some(payload(id)),
        Some(b"00-trace-01".to_vec()),
        Some(b"2026-12-03 01:02:03.456789+00".to_vec()),
        None,
    ];
    let mut out = vec![b'I'];
    out.extend_from_slice(&16_384u32.to_be_bytes());
    out.push(b'N');
    out.extend_from_slice(&(columns.len() as i16).to_be_bytes());
    for column in columns {
        match column {
            Some(bytes) => {
                out.push(b't');
                out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
                out.extend_from_slice(&bytes);
            }
            None => out.push(b'n'),
        }
    }
    out
}

fn pgoutput_decoding(c: &mut Criterion) {
    let message = bytes::Bytes::from(insert_message(42));
    assert!(
        decode(&message).is_ok(),
        "the benchmark's Insert must decode"
    );
    let mut group = c.benchmark_group("pgoutput");
    group.throughput(Throughput::Bytes(message.len() as u64));
    group.bench_function("decode_insert_1kib", |b| {
        b.iter(|| decode(black_box(&message)))
    });
    group.finish();
}

fn rendering(c: &mut Criterion) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/orders-relay.yaml");
    let text = std::fs::read_to_string(path).expect("examples/orders-relay.yaml");
    let mut relay: OutboxRelay = serde_yaml::from_str(&text).expect("an OutboxRelay manifest");
    relay.metadata.namespace = Some("shop".into());
    let options = BuildOptions::default();
    let valid = outbox_operator::spec::parse(&relay).expect("the example must parse");
    assert!(build(&valid, &options).is_ok(), "the example must render");
    // Parse and build, as every reconcile and `render` does.
    c.bench_function("render/orders_relay_all_objects", |b| {
        b.iter(|| {
            outbox_operator::spec::parse(black_box(&relay)).map(|v| build(&v, &options).is_ok())
        })
    });
}

criterion_group! {
    name = hot_paths;
    // Short runs: these are regressions guards inside `make bench`, which must stay
    // within its time budget; the functions are sub-microsecond to tens of microseconds.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    targets = message_building, chain_splitting, pgoutput_decoding, rendering
}
criterion_main!(hot_paths);
