//! Moving from Debezium: its documented outbox table (`id uuid`) and a working outbox
//! connector config, translated by `render --from-debezium` and applied unchanged, run
//! as the relay the rendered ConfigMap configures; on the wire each record is what
//! Debezium's EventRouter sends for the same rows (topic, key, value, and its headers
//! with their values), checked against `tests/golden/debezium-router.json`.

use crate::common;

use std::collections::BTreeMap;

use common::{RelayBroker, RelayProcess};

/// Debezium's documented outbox table.
const DEBEZIUM_TABLE: &str = "CREATE TABLE public.outbox (
    id uuid NOT NULL PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb)";

/// The rows, in insertion order: id, aggregate type, aggregate id, type, payload.
const ROWS: [(&str, &str, &str, &str, Option<&str>); 4] = [
    (
        "0e37df36-f698-11e6-8dd4-cb9ced3df976",
        "Order",
        "order-1",
        "OrderCreated",
        Some(r#"{"total": 10, "id": 1}"#),
    ),
    (
        "7a3b1c20-9f1e-4d55-8a6b-2c4d5e6f7a8b",
        "Order",
        "order-1",
        "OrderLineAdded",
        Some(r#"{"id": 1, "total": 12, "lines": [{"sku": "A-1", "qty": 2}]}"#),
    ),
    (
        "f47ac10b-58cc-4372-a567-0e02b2c3d479",
        "Customer",
        "customer-9",
        "CustomerRegistered",
        Some(r#"{"name": "Ada"}"#),
    ),
    (
        "9b2e4c6a-1d3f-4a5b-8c7d-0e1f2a3b4c5d",
        "Order",
        "order-1",
        "OrderDeleted",
        None,
    ),
];

/// The `relay.yaml` of the ConfigMap in `render`'s output.
fn relay_config(rendered: &str) -> String {
    for document in serde_yaml::Deserializer::from_str(rendered) {
        let value = <serde_yaml::Value as serde::Deserialize>::deserialize(document)
            .unwrap_or_else(|err| panic!("render printed YAML that does not parse: {err}"));
        if value["kind"].as_str() == Some("ConfigMap")
            && let Some(config) = value["data"]["relay.yaml"].as_str()
        {
            return config.to_owned();
        }
    }
    panic!("no ConfigMap with relay.yaml in:\n{rendered}");
}

fn outbox_operator(args: &[&str]) -> String {
    let output = std::process::Command::new(common::operator::operator_binary())
        .args(args)
        .env_remove("OUTBOX_RELAY_IMAGE")
        .output()
        .unwrap_or_else(|err| panic!("outbox-operator {args:?}: {err}"));
    assert!(
        output.status.success(),
        "outbox-operator {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debeziums_table_and_connector_give_the_records_debeziums_router_sends() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    db.client.batch_execute(DEBEZIUM_TABLE).await.unwrap();
    let run = common::unique_suffix();
    let prefix = format!("dbz{run}");
    let slot = format!("dbz_{run}");
    // A working Debezium outbox connector (the Kafka Connect REST API's JSON).
    let connector = serde_json::json!({
        "name": "orders-outbox",
        "config": {
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "plugin.name": "pgoutput",
            "database.hostname": "orders-db",
            "database.port": "5432",
            "database.user": "debezium",
            "database.password": "secret",
            "database.dbname": "orders",
            "topic.prefix": "orders",
            "table.include.list": "public.outbox",
            "slot.name": slot,
            "publication.name": slot,
            "key.converter": "org.apache.kafka.connect.storage.StringConverter",
            "value.converter": "org.apache.kafka.connect.storage.StringConverter",
            "transforms": "outbox",
            "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
            "transforms.outbox.route.topic.replacement": format!("{prefix}.${{routedByValue}}"),
            "transforms.outbox.route.tombstone.on.empty.payload": "true",
            "transforms.outbox.table.fields.additional.placement": "type:header:eventType"
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let connector_path = dir.path().join("connector.json");
    std::fs::write(&connector_path, connector.to_string()).unwrap();
    let manifest = outbox_operator(&[
        "render",
        "--from-debezium",
        connector_path.to_str().unwrap(),
        "--bootstrap-servers",
        rig.kafka_bootstrap(),
        "--namespace",
        "test",
    ]);
    let manifest_path = dir.path().join("relay.yaml");
    std::fs::write(&manifest_path, &manifest).unwrap();
    let config = relay_config(&outbox_operator(&[
        "render",
        "-f",
        manifest_path.to_str().unwrap(),
    ]));
    for aggregate in ["Order", "Customer"] {
        common::create_topic(
            rig.kafka_bootstrap(),
            &format!("{prefix}.{aggregate}"),
            1,
            &[],
        )
        .await;
    }
    // The operator creates the slot and publication; here the test does.
    common::create_replication(&db.client, &slot, &slot).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: format!("{prefix}.{{aggregateType}}"),
    };
    let relay = RelayProcess::start(&config, &db.url, &broker);
    common::wait_slot_active(&db.client, &slot, &relay).await;
    for (id, aggregate_type, aggregate_id, event_type, payload) in ROWS {
        db.client
            .execute(
                "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload) \
                 VALUES ($1::text::uuid, $2, $3, $4, $5::text::jsonb)",
                &[&id, &aggregate_type, &aggregate_id, &event_type, &payload],
            )
            .await
            .unwrap();
    }
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("../golden/debezium-router.json")).unwrap();
    let expected = golden["records"].as_array().unwrap();
    // Every record of both topics, in each topic's order.
    let mut got: BTreeMap<String, Vec<common::KcatRecord>> = BTreeMap::new();
    for (aggregate, count) in [("Order", 3), ("Customer", 1)] {
        let topic = format!("{prefix}.{aggregate}");
        let records = tokio::task::spawn_blocking(move || common::kcat_records(&topic, count))
            .await
            .unwrap();
        got.insert(aggregate.to_owned(), records);
    }
    drop(relay);
    let mut cursor: BTreeMap<String, usize> = BTreeMap::new();
    for want in expected {
        let topic = want["topic"].as_str().unwrap().replace("{prefix}", &prefix);
        let aggregate = topic.rsplit('.').next().unwrap().to_owned();
        let at = cursor.entry(aggregate.clone()).or_insert(0);
        let records = &got[&aggregate];
        let record = records
            .get(*at)
            .unwrap_or_else(|| panic!("{topic}: only {} records", records.len()));
        *at += 1;
        let id = want["headers"]["id"].as_str().unwrap();
        assert_eq!(record.json["topic"].as_str(), Some(topic.as_str()), "{id}");
        assert_eq!(record.json["key"], want["key"], "{id}: key");
        assert_eq!(record.json["payload"], want["value"], "{id}: value");
        for (name, value) in want["headers"].as_object().unwrap() {
            let seen: Vec<&str> = record
                .headers
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
                .collect();
            assert_eq!(seen, vec![value.as_str().unwrap()], "{id}: header {name}");
        }
    }
    // Nothing beyond what the router sends.
    for (aggregate, records) in &got {
        assert_eq!(
            records.len(),
            cursor.get(aggregate).copied().unwrap_or(0),
            "{aggregate}: more records than Debezium's router sends"
        );
    }
    db.client
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .ok();
}

/// Debezium's table as documented has nothing that grows with insertion (a random uuid
/// id, no `createdAt`), so a poller could only order it by id and would reorder each
/// aggregate. With a `seq bigserial` column added and named in `table.columns.order`,
/// the poller reads it oldest first: 200 rows of random uuids (checked to sort otherwise
/// than they were inserted) written before and while the relay runs, polled to Kafka,
/// each arrive under their uuid's text with their payload, and each aggregate's first
/// deliveries keep insertion order (relay_ids.rs's writer and checker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debeziums_table_is_polled_in_insertion_order_by_a_sequence_column() {
    use crate::relay_ids::{self, IdKind, Mode, Target, Written};
    let mut db = common::fresh_database().await;
    db.client
        .batch_execute(&format!(
            "{DEBEZIUM_TABLE}; ALTER TABLE public.outbox ADD COLUMN seq bigserial NOT NULL"
        ))
        .await
        .unwrap();
    let (broker, sink) = relay_ids::open(Target::Kafka).await;
    let (yaml, _) = relay_ids::relay_yaml(&db, &broker, Mode::Polling, "50ms", "unused").await;
    let yaml = common::with_spec_line(
        &yaml,
        "table",
        "{schema: public, name: outbox, columns: {order: seq}}",
    );
    let mut written = Written::default();
    relay_ids::write(&mut db.client, IdKind::Uuid, 20, &mut written).await;
    let mut sorted = written.order.clone();
    sorted.sort();
    assert_ne!(
        sorted, written.order,
        "the ids happen to sort in insertion order"
    );
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    relay_ids::write(&mut db.client, IdKind::Uuid, 20, &mut written).await;
    relay_ids::until_published_then_stop(&db.client, &mut relay).await;
    let deliveries = relay_ids::drain(&sink, written.order.len()).await;
    let report = relay_ids::check(&deliveries, &written);
    println!(
        "Debezium's table + seq, polled: {} rows, {} messages, {} missing, {} orphans, \
         {} order violations, {} mismatches",
        written.order.len(),
        report.received,
        report.missing.len(),
        report.orphans.len(),
        report.order_violations.len(),
        report.mismatches.len()
    );
    assert!(
        report.orphans.is_empty(),
        "unknown ids: {:?}",
        report.orphans
    );
    assert!(report.missing.is_empty(), "lost: {:?}", report.missing);
    assert!(report.mismatches.is_empty(), "{:?}", report.mismatches);
    assert!(
        report.order_violations.is_empty(),
        "per-aggregate order broken: {:?}",
        report.order_violations
    );
    db.drop_database().await;
}
