//! `outbox-operator check -f relay.yaml` asks the broker too: against the rig's Kafka,
//! NATS and RabbitMQ, a manifest whose destination exists passes (exit 0), and one whose
//! destination is missing fails (exit 1) with a line naming it — without creating it.

use crate::common;

use std::process::Output;

use serde_json::{Value, json};

fn manifest(name: &str, broker: Value) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db"}, "sslMode": "disable"}},
            "mode": {"polling": {}},
            "ordering": {"mode": "perAggregate", "partitions": 4},
            "broker": broker,
        }
    })
}

/// Runs `check` on `manifest` with the database URL and extra variables.
fn check(manifest: &Value, database_url: &str, env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.yaml");
    std::fs::write(&file, serde_yaml::to_string(manifest).unwrap()).unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-operator"));
    command
        .args(["check", "-f"])
        .arg(&file)
        .env("OUTBOX_DATABASE_URL", database_url)
        .env_remove("OUTBOX_RABBITMQ_URL");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

fn has_line(output: &Output, prefix: &str, contains: &str) -> bool {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .any(|l| l.starts_with(prefix) && l.contains(contains))
}

fn assert_exit(output: &Output, code: i32) {
    assert_eq!(
        output.status.code(),
        Some(code),
        "{}",
        common::describe_output(output)
    );
}

#[tokio::test]
async fn check_finds_the_kafka_topic_and_reports_a_missing_one_without_creating_it() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(3).await;
    let bootstrap = rig.kafka_bootstrap();

    let good = manifest(
        "orders",
        json!({"kafka": {"bootstrapServers": bootstrap, "topic": topic}}),
    );
    let output = check(&good, &db.url, &[]);
    assert_exit(&output, 0);
    assert!(
        has_line(&output, "ok    broker", "Kafka at"),
        "{}",
        common::describe_output(&output)
    );
    assert!(
        has_line(
            &output,
            "ok    producer id",
            "Kafka grants an idempotent producer id"
        ),
        "{}",
        common::describe_output(&output)
    );
    assert!(
        has_line(
            &output,
            "ok    topic",
            &format!("topic {topic} exists with 3 partition(s)")
        ),
        "{}",
        common::describe_output(&output)
    );

    let missing = format!("missing-{}", common::unique_suffix());
    let bad = manifest(
        "orders",
        json!({"kafka": {"bootstrapServers": bootstrap, "topic": missing}}),
    );
    let output = check(&bad, &db.url, &[]);
    assert_exit(&output, 1);
    assert!(
        has_line(
            &output,
            "FAIL  topic",
            &format!("topic {missing} does not exist")
        ),
        "{}",
        common::describe_output(&output)
    );
    // The metadata request did not create it (auto-creation is off for the check).
    let again = check(&bad, &db.url, &[]);
    assert_exit(&again, 1);

    let unreachable = manifest(
        "orders",
        json!({"kafka": {"bootstrapServers": "127.0.0.1:1", "topic": topic}}),
    );
    let output = check(&unreachable, &db.url, &[]);
    assert_exit(&output, 1);
    assert!(
        has_line(&output, "FAIL  broker", "cannot reach Kafka at 127.0.0.1:1"),
        "{}",
        common::describe_output(&output)
    );
    db.drop_database().await;
}

#[tokio::test]
async fn check_finds_the_jetstream_stream_for_the_subject_and_reports_a_subject_without_one() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let stream = common::fresh_stream().await;

    let good = manifest(
        "orders",
        json!({"nats": {"url": rig.nats_url(), "subject": format!("{}.{{aggregateType}}", stream.subject_prefix)}}),
    );
    let output = check(&good, &db.url, &[]);
    assert_exit(&output, 0);
    assert!(
        has_line(
            &output,
            "ok    stream",
            &format!("stream {} captures", stream.name)
        ),
        "{}",
        common::describe_output(&output)
    );

    let bad = manifest(
        "orders",
        json!({"nats": {"url": rig.nats_url(), "subject": format!("nowhere.{}", common::unique_suffix())}}),
    );
    let output = check(&bad, &db.url, &[]);
    assert_exit(&output, 1);
    assert!(
        has_line(
            &output,
            "FAIL  stream",
            "no JetStream stream captures subject nowhere."
        ),
        "{}",
        common::describe_output(&output)
    );
    let _ = stream.jetstream.delete_stream(&stream.name).await;
    db.drop_database().await;
}

#[tokio::test]
async fn check_finds_the_rabbitmq_exchange_and_reports_a_missing_one_or_uri() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let queue = common::fresh_queue().await;
    let exchange = common::fresh_exchange_for(&queue).await;
    let broker = |exchange: &str| json!({"rabbitmq": {"urlSecretRef": {"name": "amqp", "key": "url"}, "allowPlaintextCredentials": true, "exchange": exchange, "routingKey": "orders"}});

    let output = check(
        &manifest("orders", broker(&exchange)),
        &db.url,
        &[("OUTBOX_RABBITMQ_URL", rig.amqp_url())],
    );
    assert_exit(&output, 0);
    assert!(
        has_line(
            &output,
            "ok    exchange",
            &format!("exchange {exchange} exists")
        ),
        "{}",
        common::describe_output(&output)
    );

    let missing = format!("missing-{}", common::unique_suffix());
    let output = check(
        &manifest("orders", broker(&missing)),
        &db.url,
        &[("OUTBOX_RABBITMQ_URL", rig.amqp_url())],
    );
    assert_exit(&output, 1);
    assert!(
        has_line(
            &output,
            "FAIL  exchange",
            &format!("exchange {missing} cannot be used")
        ),
        "{}",
        common::describe_output(&output)
    );

    // Without the URI the check says which variable to set; the password never shows.
    let output = check(&manifest("orders", broker(&exchange)), &db.url, &[]);
    assert_exit(&output, 1);
    assert!(
        has_line(&output, "FAIL  broker", "set OUTBOX_RABBITMQ_URL"),
        "{}",
        common::describe_output(&output)
    );
    db.drop_database().await;
}
