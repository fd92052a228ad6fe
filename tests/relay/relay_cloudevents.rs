//! CloudEvents 1.0 on each broker, read back by a client that is not the relay's:
//! kcat for Kafka, the NATS CLI for JetStream, and a reader on RabbitMQ's own Go client
//! (tests/rig/clients/amqpget) for RabbitMQ. Each event is checked against the
//! CloudEvents spec's required attributes (`specversion` 1.0, non-empty `id`, `source`
//! a URI reference, `type`) and its protocol binding's header names, and its attributes
//! against the row as PostgreSQL stored it.

use crate::common::{self, RelayBroker, RelayProcess};

use std::collections::BTreeMap;
use std::time::{Duration, UNIX_EPOCH};

use base64::Engine as _;

/// Rows: aggregate id, event type, payload.
const ROWS: [(&str, &str, &str); 3] = [
    ("order-1", "OrderCreated", r#"{"total": 12.5}"#),
    ("order-2", "OrderCreated", r#"{"total": 3}"#),
    ("order-1", "OrderShipped", r#"{"carrier": "Zoë & Co"}"#),
];

/// The source the relay names itself by (the test relays are `test/relay`).
const SOURCE: &str = "/outboxrelays/test/relay";

/// One event as a consumer saw it: CloudEvents attributes (prefix stripped), the
/// content type and the body.
#[derive(Debug)]
struct Seen {
    attributes: BTreeMap<String, String>,
    content_type: String,
    body: String,
}

/// Inserts [`ROWS`]; returns each row's id and `created_at` in Unix ms.
async fn insert_rows(client: &tokio_postgres::Client) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    for (aggregate, ty, payload) in ROWS {
        let row = client
            .query_one(
                "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
                 VALUES ('order', $1, $2, $3::text::jsonb) \
                 RETURNING id, floor(extract(epoch FROM created_at) * 1000)::int8",
                &[&aggregate, &ty, &payload],
            )
            .await
            .unwrap();
        out.push((row.get(0), row.get(1)));
    }
    out
}

/// The payload as PostgreSQL's jsonb prints it (the relay sends it so).
async fn stored_payloads(client: &tokio_postgres::Client) -> BTreeMap<i64, String> {
    client
        .query("SELECT id, payload::text FROM public.outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// The spec's rules for the required attributes, and the relay's mapping of the row.
fn check_event(seen: &Seen, row: usize, id: i64, created_ms: i64, payload: &str) {
    let a = &seen.attributes;
    let context = format!("{seen:#?}");
    assert_eq!(
        a.get("specversion").map(String::as_str),
        Some("1.0"),
        "{context}"
    );
    for required in ["id", "source", "type"] {
        assert!(
            a.get(required).is_some_and(|v| !v.is_empty()),
            "required attribute {required} missing: {context}"
        );
    }
    let source = &a["source"];
    assert!(
        !source.contains(char::is_whitespace) && !source.chars().any(char::is_control),
        "source is not a URI reference: {context}"
    );
    assert_eq!(a["id"], id.to_string(), "{context}");
    assert_eq!(source, SOURCE, "{context}");
    assert_eq!(a["type"], ROWS[row].1, "{context}");
    assert_eq!(
        a.get("subject").map(String::as_str),
        Some(ROWS[row].0),
        "{context}"
    );
    let time = humantime::parse_rfc3339(&a["time"])
        .unwrap_or_else(|e| panic!("time is not RFC 3339 ({e}): {context}"));
    let ms = i64::try_from(time.duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap();
    assert_eq!(ms, created_ms, "time is the row's createdAt: {context}");
    assert_eq!(seen.content_type, "application/json", "{context}");
    assert_eq!(seen.body, payload, "{context}");
}

fn check_all(seen: &[Seen], ids: &[(i64, i64)], payloads: &BTreeMap<i64, String>) {
    assert_eq!(seen.len(), ROWS.len(), "{seen:#?}");
    for (row, (id, created)) in ids.iter().enumerate() {
        let event = seen
            .iter()
            .find(|s| s.attributes.get("id") == Some(&id.to_string()))
            .unwrap_or_else(|| panic!("no event with id {id}: {seen:#?}"));
        check_event(event, row, *id, *created, &payloads[id]);
    }
}

/// A polling relay with `message.cloudEvents` (`mode`) publishing [`ROWS`] to `broker`;
/// returns the rows' ids and times and payloads once the relay has published them all.
async fn publish(
    broker: &RelayBroker,
    cloud_events: &str,
) -> (
    common::TestDatabase,
    RelayProcess,
    Vec<(i64, i64)>,
    BTreeMap<i64, String>,
) {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let yaml = common::relay_config_yaml(broker, &common::RelayOptions::default()).replace(
        "\nlisten:",
        &format!("\n  message: {{cloudEvents: {cloud_events}}}\nlisten:"),
    );
    let ids = insert_rows(&db.client).await;
    let payloads = stored_payloads(&db.client).await;
    let relay = RelayProcess::start(&yaml, &db.url, broker);
    common::wait_for_relays(
        "the relay to publish every row",
        Duration::from_secs(60),
        &[&relay],
        || async {
            db.client
                .query_one(
                    "SELECT count(*) FROM public.outbox WHERE published_at IS NULL",
                    &[],
                )
                .await
                .map(|r| r.get::<_, i64>(0) == 0)
                .unwrap_or(false)
        },
    )
    .await;
    (db, relay, ids, payloads)
}

/// Every record of `topic` through kcat: headers by name, and the value.
fn kcat_records(topic: &str, count: usize) -> Vec<(BTreeMap<String, String>, String)> {
    common::kcat_records(topic, count)
        .into_iter()
        .map(|r| {
            let value = r.json["payload"].as_str().unwrap_or_default().to_owned();
            (r.headers.into_iter().collect(), value)
        })
        .collect()
}

/// Attributes of a binary-mode message: the headers with `prefix`, prefix stripped.
fn attributes(headers: &BTreeMap<String, String>, prefix: &str) -> BTreeMap<String, String> {
    headers
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(prefix)?.to_owned(), v.clone())))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_binary_mode_carries_ce_headers() {
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let (db, relay, ids, payloads) = publish(&broker, "{}").await;
    let records = tokio::task::spawn_blocking(move || kcat_records(&topic, ROWS.len()))
        .await
        .unwrap();
    let seen: Vec<Seen> = records
        .into_iter()
        .map(|(headers, body)| Seen {
            attributes: attributes(&headers, "ce_"),
            content_type: headers.get("content-type").cloned().unwrap_or_default(),
            body,
        })
        .collect();
    check_all(&seen, &ids, &payloads);
    drop(relay);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_structured_mode_sends_the_event_as_json() {
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let (db, relay, ids, payloads) = publish(&broker, "{mode: structured}").await;
    let records = tokio::task::spawn_blocking(move || kcat_records(&topic, ROWS.len()))
        .await
        .unwrap();
    let seen: Vec<Seen> = records
        .into_iter()
        .map(|(headers, body)| {
            assert_eq!(
                headers.get("content-type").map(String::as_str),
                Some("application/cloudevents+json; charset=UTF-8")
            );
            assert!(!headers.keys().any(|k| k.starts_with("ce_")), "{headers:?}");
            let event: serde_json::Value = serde_json::from_str(&body).unwrap();
            let mut attributes: BTreeMap<String, String> = event
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| *k != "data")
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                .collect();
            let content_type = attributes.remove("datacontenttype").unwrap_or_default();
            // JSON data is embedded as JSON; compared in jsonb's own text form.
            Seen {
                attributes,
                content_type,
                body: event["data"].to_string(),
            }
        })
        .collect();
    let normalised: BTreeMap<i64, String> = payloads
        .iter()
        .map(|(id, p)| {
            let v: serde_json::Value = serde_json::from_str(p).unwrap();
            (*id, v.to_string())
        })
        .collect();
    check_all(&seen, &ids, &normalised);
    drop(relay);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_binary_mode_carries_ce_headers_read_by_the_nats_cli() {
    let rig = common::Rig::load();
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.{{aggregateType}}", stream.subject_prefix),
    };
    let (db, relay, ids, payloads) = publish(&broker, "{}").await;
    let cli = rig.get("OUTBOX_RIG_NATS_CLI").to_owned();
    let mut seen = Vec::new();
    for seq in 1..=ROWS.len() {
        let output = common::run_tool(
            std::path::Path::new(&cli),
            &[
                "--server",
                rig.nats_url(),
                "stream",
                "get",
                &stream.name,
                &seq.to_string(),
                "--json",
            ],
        );
        assert!(output.status.success(), "nats stream get: {output:?}");
        let stored: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        let decode = |field: &str| {
            String::from_utf8(
                base64::engine::general_purpose::STANDARD
                    .decode(stored[field].as_str().unwrap_or_default())
                    .unwrap(),
            )
            .unwrap()
        };
        // NATS/1.0 then `Name: value` lines.
        let headers: BTreeMap<String, String> = decode("hdrs")
            .lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
            .collect();
        seen.push(Seen {
            attributes: attributes(&headers, "ce-"),
            content_type: headers.get("content-type").cloned().unwrap_or_default(),
            body: decode("data"),
        });
    }
    check_all(&seen, &ids, &payloads);
    drop(relay);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_binary_mode_carries_cloudevents_application_properties() {
    let rig = common::Rig::load();
    let queue = common::fresh_queue().await;
    let exchange = common::fresh_exchange_for(&queue).await;
    let broker = RelayBroker::Amqp {
        url: rig.amqp_url().to_owned(),
        exchange,
        routing_key: "outbox.{aggregateType}".to_owned(),
    };
    let (db, relay, ids, payloads) = publish(&broker, "{}").await;
    let output = common::run_tool(
        std::path::Path::new(rig.get("OUTBOX_RIG_AMQPGET")),
        &[
            "-url",
            rig.amqp_url(),
            "-queue",
            &queue.name,
            "-count",
            &ROWS.len().to_string(),
        ],
    );
    assert!(output.status.success(), "amqpget: {output:?}");
    let seen: Vec<Seen> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            let m: serde_json::Value = serde_json::from_str(line).unwrap();
            let headers: BTreeMap<String, String> = m["headers"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect();
            assert_eq!(m["delivery_mode"], 2, "persistent: {line}");
            Seen {
                attributes: attributes(&headers, "cloudEvents_"),
                content_type: m["content_type"].as_str().unwrap_or_default().to_owned(),
                body: m["body"].as_str().unwrap_or_default().to_owned(),
            }
        })
        .collect();
    check_all(&seen, &ids, &payloads);
    drop(relay);
    db.drop_database().await;
}
