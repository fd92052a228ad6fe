use super::*;

/// A Kafka Connect connector as the outbox router's documentation configures it.
const CONNECT_JSON: &str = r#"{
  "name": "orders-outbox",
  "config": {
    "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
    "plugin.name": "pgoutput",
    "database.hostname": "orders-db.shop.svc",
    "database.port": "5432",
    "database.user": "debezium",
    "database.password": "s3cret-do-not-copy",
    "database.dbname": "orders",
    "database.sslmode": "verify-full",
    "topic.prefix": "orders",
    "table.include.list": "shop\\.outbox_events",
    "slot.name": "orders_outbox",
    "publication.name": "orders_outbox_pub",
    "heartbeat.interval.ms": 5000,
    "snapshot.mode": "initial",
    "key.converter": "org.apache.kafka.connect.storage.StringConverter",
    "value.converter": "org.apache.kafka.connect.json.JsonConverter",
    "producer.override.compression.type": "lz4",
    "producer.override.acks": "1",
    "producer.override.buffer.memory": "67108864",
    "transforms": "unwrap, outbox",
    "transforms.unwrap.type": "io.debezium.transforms.ExtractNewRecordState",
    "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
    "transforms.outbox.table.field.event.key": "aggregate_id",
    "transforms.outbox.table.field.event.payload": "body",
    "transforms.outbox.table.field.event.timestamp": "occurred_at",
    "transforms.outbox.route.by.field": "aggregate_type",
    "transforms.outbox.route.topic.replacement": "shop.${routedByValue}.events",
    "transforms.outbox.route.tombstone.on.empty.payload": "true",
    "transforms.outbox.table.expand.json.payload": "true",
    "transforms.outbox.table.fields.additional.placement": "event_type:header:eventType, version:envelope, tenant:envelope:tenantId, part:partition:ignored"
  }
}"#;

fn translated(text: &str, options: &Options) -> Result<Translation, TranslateError> {
    let (name, config) = parse_config(text)?;
    translate(name.as_deref(), &config, options)
}

fn kafka(options: Option<&str>) -> Options {
    Options {
        bootstrap_servers: options.map(str::to_owned),
        ..Options::default()
    }
}

#[test]
fn a_connect_connector_becomes_the_same_relay_line_by_line() {
    let t = translated(CONNECT_JSON, &kafka(Some("kafka:9092"))).unwrap();
    let r = &t.relay;
    assert_eq!(r.metadata.name.as_deref(), Some("orders-outbox"));
    let s = &r.spec;
    assert_eq!(
        (s.table.schema.as_str(), s.table.name.as_str()),
        ("shop", "outbox_events")
    );
    let c = &s.table.columns;
    assert_eq!(c.aggregate_id, "aggregate_id");
    assert_eq!(c.payload, "body");
    assert_eq!(c.aggregate_type, "aggregate_type");
    assert_eq!(c.timestamp.as_deref(), Some("occurred_at"));
    assert_eq!(c.id, "id");
    let fields: Vec<(&str, Placement, Option<&str>)> = s
        .table
        .additional_fields
        .iter()
        .map(|f| (f.column.as_str(), f.placement, f.alias.as_deref()))
        .collect();
    assert_eq!(
        fields,
        [
            ("event_type", Placement::Header, Some("eventType")),
            ("version", Placement::Envelope, None),
            ("tenant", Placement::Envelope, Some("tenantId")),
            ("part", Placement::Partition, None),
        ]
    );
    assert!(s.message.tombstone_on_empty_payload && s.message.expand_json_payload);
    let k = s.broker.kafka.as_ref().unwrap();
    assert_eq!(k.topic, "shop.{aggregateType}.events");
    assert_eq!(k.bootstrap_servers, "kafka:9092");
    assert_eq!(
        k.properties.get("compression.type").map(String::as_str),
        Some("lz4")
    );
    assert!(!k.properties.contains_key("acks"));
    let lt = s.mode.log_tailing.as_ref().unwrap();
    assert_eq!(lt.slot_name.as_deref(), Some("orders_outbox"));
    assert_eq!(lt.publication_name.as_deref(), Some("orders_outbox_pub"));
    assert_eq!(lt.heartbeat_interval, "5000ms");
    assert!(!lt.delete_after_publish);
    assert_eq!(s.database.postgres().ssl_mode, SslMode::VerifyFull);
    assert_eq!(
        s.database.postgres().connection_secret_ref.name,
        "orders-outbox-db"
    );
    let notes = t.notes.join("\n");
    for expected in [
        "transform unwrap",
        "producer.override.acks",
        "producer.override.buffer.memory: librdkafka, the relay's Kafka client, refuses this name or value",
        "value.converter org.apache.kafka.connect.json.JsonConverter",
        "snapshot.mode initial",
        "postgres://debezium:<password>@orders-db.shop.svc:5432/orders",
    ] {
        assert!(notes.contains(expected), "no note on {expected}:\n{notes}");
    }
    let yaml = t.to_yaml().unwrap();
    assert!(!yaml.contains("s3cret"), "the password leaked:\n{yaml}");
    // The output is a manifest `render` and the API accept.
    let back: OutboxRelay = serde_yaml::from_str(&yaml).unwrap();
    assert_eq!(back.spec, r.spec);
    assert_eq!(back.metadata.name, r.metadata.name);
}

#[test]
fn debezium_server_properties_translate_too() {
    let properties = r"
debezium.sink.type=kafka
debezium.sink.kafka.producer.bootstrap.servers=broker-1:9092,broker-2:9092
debezium.sink.kafka.producer.linger.ms=5
debezium.source.connector.class=io.debezium.connector.postgresql.PostgresConnector
debezium.source.database.hostname=db
debezium.source.database.user=relay
debezium.source.database.password=hunter2
debezium.source.database.dbname=app
debezium.source.table.include.list=public.outbox
debezium.transforms=outbox
debezium.transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
";
    let t = translated(properties, &kafka(None)).unwrap();
    let s = &t.relay.spec;
    assert_eq!(t.relay.metadata.name.as_deref(), Some("outbox"));
    let k = s.broker.kafka.as_ref().unwrap();
    assert_eq!(k.bootstrap_servers, "broker-1:9092,broker-2:9092");
    assert_eq!(k.topic, "outbox.event.{aggregateType}");
    assert_eq!(k.properties.get("linger.ms").map(String::as_str), Some("5"));
    // The router's defaults are the spec's.
    assert_eq!(s.table.columns, ColumnsSpec::default());
    assert_eq!(s.message, MessageSpec::default());
    assert!(!t.to_yaml().unwrap().contains("hunter2"));

    assert_eq!(
        s.database.postgres().ssl_mode,
        SslMode::Prefer,
        "Debezium's default"
    );
    let nats = properties.replace(
        "debezium.sink.type=kafka",
        "debezium.sink.type=nats-jetstream\ndebezium.sink.nats-jetstream.url=nats://app:s3cret@nats:4222",
    );
    let t = translated(&nats, &kafka(None)).unwrap();
    let n = t.relay.spec.broker.nats.as_ref().unwrap();
    assert_eq!(
        (n.url.as_str(), n.subject.as_str()),
        ("nats://nats:4222", "outbox.event.{aggregateType}")
    );
    let yaml = t.to_yaml().unwrap();
    assert!(
        !yaml.contains("s3cret") && yaml.contains("NATS URL held credentials"),
        "{yaml}"
    );
}

#[test]
fn what_does_not_translate_is_refused_with_the_reason() {
    let with =
        |from: &str, to: &str| translated(&CONNECT_JSON.replace(from, to), &kafka(Some("k:9092")));
    let err = |r: Result<Translation, TranslateError>| r.unwrap_err().0;
    assert!(err(translated(CONNECT_JSON, &kafka(None))).contains("--bootstrap-servers"));
    assert!(err(with("PostgresConnector", "MySqlConnector")).contains("connector.class"));
    assert!(err(with("shop\\\\.outbox_events", "shop.a,shop.b")).contains("one relay per table"));
    assert!(
        err(with("io.debezium.transforms.outbox.EventRouter", "x.Other")).contains("outbox router")
    );
    assert!(err(with(":partition:ignored", ":elsewhere")).contains("placement elsewhere"));
    assert!(err(with("event_type:header:eventType", "event_type")).contains("column:placement"));
    let regex = CONNECT_JSON.replace(
        "\"transforms.outbox.route.by.field\"",
        "\"transforms.outbox.route.topic.regex\": \"(?<routedByValue>.*)Created\",\n    \"transforms.outbox.route.by.field\"",
    );
    assert!(err(translated(&regex, &kafka(Some("k:9092")))).contains("route.topic.regex"));
    // A placement the relay refuses (an envelope field named payload) is refused here too.
    assert!(err(with("tenant:envelope:tenantId", "tenant:envelope:payload")).contains("not valid"));
}

#[test]
fn connector_names_become_dns_labels() {
    assert_eq!(dns_label("Orders_Outbox.v2"), "orders-outbox-v2");
    assert_eq!(dns_label("42-connector"), "outbox-42-connector");
    assert!(dns_label(&"x".repeat(80)).len() <= 50);
}

/// Producer settings librdkafka takes one by one, but the relay's spec check refuses
/// (beside its idempotent producer, beside one another, or against per-aggregate order)
/// are dropped with a note, so the translation is a relay that starts; what it takes
/// stays.
#[test]
fn settings_the_relay_refuses_are_dropped_with_a_note() {
    let with = CONNECT_JSON.replace(
        "\"producer.override.acks\": \"1\",",
        r#""producer.override.acks": "1",
    "producer.override.queuing.strategy": "lifo",
    "producer.override.partitioner": "random",
    "producer.override.reconnect.backoff.max.ms": "50",
    "producer.override.linger.ms": "20",
    "producer.override.delivery.timeout.ms": "10",
    "producer.override.batch.num.messages": "5000","#,
    );
    let t = translated(&with, &kafka(Some("k:9092"))).unwrap();
    let k = t.relay.spec.broker.kafka.as_ref().unwrap();
    let kept: Vec<&str> = k.properties.keys().map(String::as_str).collect();
    assert_eq!(
        kept,
        ["batch.num.messages", "compression.type", "linger.ms"]
    );
    let notes = t.notes.join("\n");
    for expected in [
        "producer.override.queuing.strategy: the relay refuses it (must be fifo",
        "producer.override.partitioner: the relay refuses it (",
        "producer.override.reconnect.backoff.max.ms: the relay refuses it (reconnect.backoff.max.ms (50)",
        "producer.override.delivery.timeout.ms: the relay refuses it (Kafka property delivery.timeout.ms = 10 is not longer than linger.ms",
    ] {
        assert!(notes.contains(expected), "no note on {expected}:\n{notes}");
    }
}

/// A `linger.ms` the relay's default timeout cannot outlast (a Java producer waits six
/// times as long by default) is dropped, in Debezium Server's file too; beside a timeout
/// shorter than both, the timeout goes first, then, as the default still falls short,
/// the linger: the check runs again after each round of drops.
#[test]
fn a_linger_longer_than_the_timeout_is_dropped_after_the_timeout() {
    let server = |extra: &str| {
        format!(
            "debezium.sink.type=kafka
debezium.sink.kafka.producer.bootstrap.servers=broker-1:9092
{extra}
debezium.source.connector.class=io.debezium.connector.postgresql.PostgresConnector
debezium.source.database.hostname=db
debezium.source.database.dbname=app
debezium.source.table.include.list=public.outbox
debezium.transforms=outbox
debezium.transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
"
        )
    };
    let kept = |t: &Translation| -> Vec<String> {
        let k = t.relay.spec.broker.kafka.as_ref().unwrap();
        k.properties.keys().cloned().collect()
    };
    let t = translated(
        &server("debezium.sink.kafka.producer.queue.buffering.max.ms=30000\ndebezium.sink.kafka.producer.batch.size=65536"),
        &kafka(None),
    )
    .unwrap();
    assert_eq!(kept(&t), ["batch.size"]);
    let notes = t.notes.join("\n");
    assert!(
        notes.contains("debezium.sink.kafka.producer.queue.buffering.max.ms: the relay refuses it (Kafka property message.timeout.ms (by default) = 20000 is not longer than linger.ms (30000)"),
        "{notes}"
    );
    let t = translated(
        &server("debezium.sink.kafka.producer.linger.ms=30000\ndebezium.sink.kafka.producer.delivery.timeout.ms=10"),
        &kafka(None),
    )
    .unwrap();
    assert!(kept(&t).is_empty(), "{:?}", kept(&t));
    let notes = t.notes.join("\n");
    let timeout = notes
        .find("producer.delivery.timeout.ms: the relay refuses it (Kafka property delivery.timeout.ms = 10")
        .unwrap_or_else(|| panic!("no note on the timeout:\n{notes}"));
    let linger = notes
        .find("producer.linger.ms: the relay refuses it (Kafka property message.timeout.ms (by default) = 20000")
        .unwrap_or_else(|| panic!("no note on the linger:\n{notes}"));
    assert!(timeout < linger, "the timeout goes first:\n{notes}");
    // A timeout long enough keeps both.
    let t = translated(
        &server("debezium.sink.kafka.producer.linger.ms=30000\ndebezium.sink.kafka.producer.delivery.timeout.ms=120000"),
        &kafka(None),
    )
    .unwrap();
    assert_eq!(kept(&t), ["delivery.timeout.ms", "linger.ms"]);
}

/// A translation the API server would refuse (here bootstrap servers past the CRD's
/// 2,048 characters) fails with the schema's reason, rather than printing a manifest
/// that `kubectl apply` then refuses.
#[test]
fn a_translation_the_schema_refuses_fails_with_the_reason() {
    let servers = vec!["broker-0123456789.kafka.example:9092"; 60].join(",");
    let err = translated(CONNECT_JSON, &kafka(Some(&servers))).unwrap_err();
    assert!(
        err.0
            .contains("spec.broker.kafka.bootstrapServers: may not be longer than 2048"),
        "{err:?}"
    );
    assert!(translated(CONNECT_JSON, &kafka(Some("k:9092"))).is_ok());
}
