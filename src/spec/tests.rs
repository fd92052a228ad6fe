use super::*;

const BASE: &str = r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: orders-db}}}
  mode: {polling: {}}
  broker: {kafka: {bootstrapServers: "kafka:9092"}}
"#;

fn relay(yaml: &str) -> OutboxRelay {
    serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
}

/// BASE with `spec` replaced by the given lines (indented two spaces under spec:).
fn with_spec(spec: &str) -> OutboxRelay {
    let head = BASE.split("spec:").next().unwrap_or_default();
    relay(&format!("{head}spec:\n{spec}"))
}

fn fields(relay: &OutboxRelay) -> Vec<String> {
    match parse(relay) {
        Ok(_) => Vec::new(),
        Err(p) => p.0.into_iter().map(|p| p.field).collect(),
    }
}

#[test]
fn a_good_spec_parses_with_its_defaults() {
    let valid = parse(&relay(BASE)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(valid.namespace, "shop");
    assert_eq!(valid.table.columns.aggregate_id, "aggregateid");
    assert_eq!(valid.partitions, 4);
    assert!(valid.per_aggregate);
    let ValidMode::Polling(p) = &valid.mode else {
        panic!("not polling")
    };
    assert_eq!(p.interval, Duration::from_millis(500));
    assert_eq!(valid.broker.name(), "kafka");
    assert_eq!(valid.secrets().len(), 1);
    assert_eq!(valid.alerting.slot_retained_wal_bytes, 1 << 30);
}

#[test]
fn log_tailing_names_its_slot_and_the_resource_carries_it() {
    let valid = parse(&relay(&BASE.replace("{polling: {}}", "{logTailing: {}}")))
        .unwrap_or_else(|e| panic!("{e}"));
    let lt = valid.mode.log_tailing().unwrap();
    assert_eq!(lt.slot, "outbox_shop_orders");
    assert_eq!(lt.publication, "outbox_shop_orders");
    let spec_lt = valid.relay.spec.mode.log_tailing.as_ref().unwrap();
    assert_eq!(spec_lt.slot_name.as_deref(), Some("outbox_shop_orders"));
    assert_eq!(valid.effective_replicas(), 1);
}

#[test]
fn default_slot_names_of_two_namespaces_can_be_alike_and_give_no_right_to_the_other_slot() {
    let at = |namespace: &str, name: &str, mode: &str| {
        let yaml = BASE.replace("{polling: {}}", mode).replace(
            "{name: orders, namespace: shop}",
            &format!("{{name: {name}, namespace: {namespace}}}"),
        );
        parse(&relay(&yaml)).unwrap_or_else(|e| panic!("{e}"))
    };
    let a = at("team-a", "orders", "{logTailing: {}}");
    let b = at("team", "a-orders", "{logTailing: {}}");
    assert_eq!(
        a.mode.log_tailing().unwrap().slot,
        b.mode.log_tailing().unwrap().slot,
        "the collision this guards against"
    );
    // A rename keeps its namespace; another namespace's relay of the same default name
    // takes nothing over.
    assert!(a.may_take_over("team-a"));
    assert!(!a.may_take_over("team"));
    // Naming the slot says it is meant, in any namespace; naming the default name is
    // the default (it survives the relay's own round trip through its config file).
    let named = at(
        "team-a",
        "orders",
        "{logTailing: {slotName: shared_orders}}",
    );
    assert!(named.may_take_over("team"));
    let default_named = at(
        "team-a",
        "orders",
        "{logTailing: {slotName: outbox_team_a_orders}}",
    );
    assert!(!default_named.may_take_over("team"));
    assert_eq!(default_named.mode, a.mode);
}

/// Each case: a spec (lines under `spec:`) and the fields its problems must name.
/// The API server refuses most of these through the CRD's schema; parse is the same
/// rule for render, check, the controller and the relay.
const INVALID: &[(&str, &str, &[&str])] = &[
    (
        "a PostgreSQL client key without certificate, over no TLS",
        "  database: {postgres: {connectionSecretRef: {name: db}, sslMode: disable, clientKeySecretRef: {name: pg}}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &["spec.database.postgres.clientKeySecretRef"],
    ),
    (
        "two NATS logins, a user without password, a key without certificate",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\", tokenSecretRef: {name: n, key: t}, usernameSecretRef: {name: n, key: u}, tls: {clientKeySecretRef: {name: n, key: k}}}}",
        &[
            "spec.broker.nats",
            "spec.broker.nats.usernameSecretRef",
            "spec.broker.nats.tls.clientKeySecretRef",
        ],
    ),
    (
        "RabbitMQ EXTERNAL without a client certificate",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {rabbitmq: {urlSecretRef: {name: amqp}, authMechanism: EXTERNAL}}",
        &["spec.broker.rabbitmq.authMechanism"],
    ),
    (
        "a CA Secret that cannot exist",
        "  database: {postgres: {connectionSecretRef: {name: db}, sslMode: verify-full, caSecretRef: {name: Pg_CA}}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &["spec.database.postgres.caSecretRef.name"],
    ),
    (
        "upper-case publication name",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {logTailing: {publicationName: Orders}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &["spec.mode.logTailing.publicationName"],
    ),
    (
        "both modes",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}, logTailing: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &["spec.mode"],
    ),
    (
        "no broker",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {}",
        &["spec.broker"],
    ),
    (
        "bad identifiers everywhere",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  table: {schema: \"1x\", name: \"orders; drop table x\", columns: {id: \"a-b\", payload: \"p q\"}, headers: [id, \"x\\\"y\"]}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &[
            "spec.table.schema",
            "spec.table.name",
            "spec.table.columns.id",
            "spec.table.columns.payload",
            "spec.table.headers[0]",
            "spec.table.headers[1]",
        ],
    ),
    (
        "additional fields the router would not place either",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  table: {headers: [traceparent], columns: {timestamp: \"t s\"}, additionalFields: [{column: \"a b\", placement: header}, {column: x, placement: header, as: type}, {column: y, placement: header, as: traceparent}, {column: v, placement: header, as: ce_id}, {column: z, placement: envelope, as: payload}, {column: w, placement: envelope, as: \"no space\"}, {column: p, placement: partition, as: q}, {column: r, placement: partition}]}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &[
            "spec.table.columns.timestamp",
            "spec.table.additionalFields[0].column",
            "spec.table.additionalFields[1]",
            "spec.table.additionalFields[2]",
            "spec.table.additionalFields[3]",
            "spec.table.additionalFields[4]",
            "spec.table.additionalFields[5].as",
            "spec.table.additionalFields[6].as",
            "spec.table.additionalFields[6]",
            "spec.table.additionalFields[7]",
            "spec.table.additionalFields[7]",
        ],
    ),
    (
        "cloud events with a bad source and media type",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}\n  message: {cloudEvents: {source: \"/a b\", dataContentType: \"\"}}",
        &[
            "spec.message.cloudEvents.source",
            "spec.message.cloudEvents.dataContentType",
        ],
    ),
    (
        "a tracing endpoint that is not a URL",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}\n  tracing: {otlpEndpoint: \"otel:4318\", serviceName: \" \"}",
        &["spec.tracing.otlpEndpoint", "spec.tracing.serviceName"],
    ),
    (
        "a sweep without deleteAfterPublish, and too short",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {logTailing: {deleteAfterPublish: false, sweep: {interval: 10ms, olderThan: 5x}}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &[
            "spec.mode.logTailing.sweep",
            "spec.mode.logTailing.sweep.interval",
            "spec.mode.logTailing.sweep.olderThan",
        ],
    ),
    (
        "a WAL budget without deleteAfterPublish, zero, and a bad returnAfter",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {logTailing: {deleteAfterPublish: false, maxRetainedWal: \"0Mi\", returnAfter: 10ms}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &[
            "spec.mode.logTailing.returnAfter",
            "spec.mode.logTailing.maxRetainedWal",
            "spec.mode.logTailing.maxRetainedWal",
        ],
    ),
    (
        "a bad returnAfter without a WAL budget (the CRD's rule holds it whenever it is set)",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {logTailing: {returnAfter: 500ms}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &["spec.mode.logTailing.returnAfter"],
    ),
    (
        "a duration longer than the API server's durations hold",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {interval: 9999999h}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &["spec.mode.polling.interval"],
    ),
    (
        "databaseRef: secretName beside userSecretName, database without userSecretName",
        "  database: {databaseRef: {name: pg, secretName: pg-app, userSecretName: pg-user}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &["spec.database.databaseRef"],
    ),
    (
        "databaseRef: database without userSecretName",
        "  database: {databaseRef: {name: pg, database: shop}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &["spec.database.databaseRef.database"],
    ),
    (
        "ranges",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {batchSize: 0}}\n  broker: {nats: {url: \"nats://n:4222\"}}\n  ordering: {partitions: 2000}\n  replicas: 65\n  failure: {maxAttempts: 0}\n  alerting: {backlogRows: 0}",
        &[
            "spec.mode.polling.batchSize",
            "spec.ordering.partitions",
            "spec.replicas",
            "spec.failure.maxAttempts",
            "spec.alerting.backlogRows",
        ],
    ),
    (
        "durations",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {interval: 0s}}\n  broker: {nats: {url: \"nats://n:4222\"}}\n  retention: {publishedRows: 5x}\n  alerting: {oldestUnpublishedAge: 0ms, slotRetainedWal: \"0\"}",
        &[
            "spec.mode.polling.interval",
            "spec.retention.publishedRows",
            "spec.alerting.oldestUnpublishedAge",
            "spec.alerting.slotRetainedWal",
        ],
    ),
    (
        "retention shorter than the poll interval",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {interval: 10s}}\n  broker: {nats: {url: \"nats://n:4222\"}}\n  retention: {publishedRows: 5s}",
        &["spec.retention.publishedRows"],
    ),
    (
        "short heartbeat and bad slot name",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {logTailing: {slotName: Bad-Slot, heartbeatInterval: 10ms}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
        &[
            "spec.mode.logTailing.slotName",
            "spec.mode.logTailing.heartbeatInterval",
        ],
    ),
    (
        "dead-letter table is the outbox table",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}\n  failure: {onExhausted: deadLetter, deadLetterTable: outbox}",
        &["spec.failure.deadLetterTable"],
    ),
    (
        "default dead-letter table name too long",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  table: {name: a234567890123456789012345678901234567890123456789012345}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}\n  failure: {onExhausted: deadLetter}",
        &["spec.failure.deadLetterTable"],
    ),
    (
        "kafka: fixed properties and a bad topic",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {kafka: {bootstrapServers: \" \", topic: \"has space\", properties: {acks: \"1\", ssl.ca.location: /x, max.in.flight.requests.per.connection: \"9\"}}}",
        &[
            "spec.broker.kafka.bootstrapServers",
            "spec.broker.kafka.topic",
            "spec.broker.kafka.properties.acks",
            "spec.broker.kafka.properties.ssl.ca.location",
            "spec.broker.kafka.properties.max.in.flight.requests.per.connection",
        ],
    ),
    (
        "kafka: a partitioner that ignores the key, with per-aggregate order",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {kafka: {bootstrapServers: \"k:9092\", properties: {partitioner: random}}}",
        &["spec.broker.kafka.properties.partitioner"],
    ),
    (
        "nats: bad url and subject",
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"http://n:4222\", subject: \"outbox.>\"}}",
        &["spec.broker.nats.url", "spec.broker.nats.subject"],
    ),
    (
        "secret references",
        "  database: {postgres: {connectionSecretRef: {name: Orders_DB, key: \"a b\"}}}\n  mode: {polling: {}}\n  broker: {rabbitmq: {urlSecretRef: {name: \"-mq\"}, routingKey: \"{aggregateType}\"}}",
        &[
            "spec.database.postgres.connectionSecretRef.name",
            "spec.database.postgres.connectionSecretRef.key",
            "spec.broker.rabbitmq.urlSecretRef.name",
        ],
    ),
];

#[test]
fn every_problem_of_an_invalid_spec_is_named() {
    for (what, spec, expected) in INVALID {
        let relay = with_spec(spec);
        let found = fields(&relay);
        for field in *expected {
            assert!(
                found.iter().any(|f| f == field),
                "{what}: {field} not among {found:?}"
            );
        }
        let Err(problems) = parse(&relay) else {
            panic!("{what}: accepted");
        };
        for p in &problems.0 {
            assert!(!p.fix.is_empty(), "{what}: {p} has no fix");
        }
    }
}

#[test]
fn any_partitioner_does_without_per_aggregate_order() {
    let kafka = "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {kafka: {bootstrapServers: \"k:9092\", properties: {partitioner: PARTITIONER}}}";
    let unordered = format!("{kafka}\n  ordering: {{mode: none}}");
    assert!(parse(&with_spec(&unordered.replace("PARTITIONER", "random"))).is_ok());
    assert!(
        parse(&with_spec(
            &unordered.replace("PARTITIONER", "consistent_random")
        ))
        .is_ok()
    );
    // With per-aggregate order: keys that stay on one partition, and librdkafka's reading
    // (leading blanks skipped).
    assert!(parse(&with_spec(&kafka.replace("PARTITIONER", "consistent"))).is_ok());
    assert!(
        parse(&with_spec(
            &kafka.replace("PARTITIONER", "\" consistent_random\"")
        ))
        .is_err()
    );
}

#[test]
fn a_bad_name_is_a_problem() {
    let mut r = relay(BASE);
    r.metadata.name = Some("Orders_Relay".into());
    assert_eq!(fields(&r), vec!["metadata.name".to_owned()]);
}

#[test]
fn the_install_policy_refuses_image_and_service_account_unless_allowed() {
    let mut r = relay(BASE);
    r.spec.relay.image = Some("evil:1".into());
    r.spec.relay.service_account_name = Some("admin".into());
    let refused: Vec<String> = Policy::default()
        .check(&r)
        .into_iter()
        .map(|p| p.field)
        .collect();
    assert_eq!(
        refused,
        vec![
            "spec.relay.image".to_owned(),
            "spec.relay.serviceAccountName".to_owned()
        ]
    );
    let open = Policy {
        allow_image: true,
        allow_service_account: true,
        secret_label: None,
    };
    assert!(open.check(&r).is_empty());
    assert!(Policy::default().check(&relay(BASE)).is_empty());
}

#[test]
fn with_a_secret_label_only_opted_in_secrets_are_usable() {
    let field = "spec.database.postgres.connectionSecretRef";
    let unlabelled = std::collections::BTreeMap::new();
    assert_eq!(
        Policy::default().secret_problem(field, "db", "shop", &unlabelled),
        None,
        "without the policy every Secret of the namespace is usable"
    );
    let policy = Policy {
        secret_label: Some(("outbox.dev/relays".to_owned(), "allowed".to_owned())),
        ..Policy::default()
    };
    let problem = policy
        .secret_problem(field, "db-superuser", "shop", &unlabelled)
        .unwrap();
    assert_eq!(problem.field, field);
    assert!(
        problem
            .fix
            .contains("kubectl -n shop label secret db-superuser outbox.dev/relays=allowed"),
        "{}",
        problem.fix
    );
    let wrong = [("outbox.dev/relays".to_owned(), "no".to_owned())].into();
    assert!(policy.secret_problem(field, "db", "shop", &wrong).is_some());
    let opted_in = [("outbox.dev/relays".to_owned(), "allowed".to_owned())].into();
    assert_eq!(policy.secret_problem(field, "db", "shop", &opted_in), None);
}

#[test]
fn additional_fields_resolve_to_placements_after_the_headers() {
    let valid = parse(&with_spec(
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  table: {headers: [traceparent], additionalFields: [{column: event_type, placement: header, as: eventType}, {column: event_type, placement: envelope}, {column: part, placement: partition}]}\n  mode: {polling: {}}\n  broker: {kafka: {bootstrapServers: \"k:9092\"}}\n  message: {expandJsonPayload: true}",
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let placed: Vec<(String, crate::api::Placement, String)> = valid
        .table
        .placed()
        .into_iter()
        .map(|p| (p.column, p.placement, p.name))
        .collect();
    use crate::api::Placement::*;
    assert_eq!(
        placed,
        [
            ("traceparent".into(), Header, "traceparent".into()),
            ("event_type".into(), Header, "eventType".into()),
            ("event_type".into(), Envelope, "event_type".into()),
            ("part".into(), Partition, "part".into()),
        ]
    );
    assert_eq!(
        valid.table.extra_columns(),
        ["traceparent", "event_type", "part"]
    );
    assert!(valid.expand_json_payload && !valid.tombstone_on_empty_payload);
}

#[test]
fn cloud_events_name_the_relay_as_their_source_by_default() {
    let valid = parse(&with_spec(
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {}}\n  broker: {nats: {url: \"nats://n:4222\"}}\n  message: {cloudEvents: {}}",
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let ce = valid.cloud_events.unwrap();
    assert_eq!(ce.source, "/outboxrelays/shop/orders");
    assert_eq!(ce.data_content_type, "application/json");
    assert_eq!(ce.mode, crate::api::CloudEventsMode::Binary);
}

#[test]
fn a_wal_budget_parses_with_its_default_return() {
    let valid = parse(&with_spec(
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {logTailing: {maxRetainedWal: 10Gi}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let budget = valid.mode.log_tailing().and_then(|l| l.budget).unwrap();
    assert_eq!(budget.max_retained_wal, 10 << 30);
    assert_eq!(budget.return_after, Duration::from_secs(300));
    let valid = parse(&with_spec(
        "  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {logTailing: {maxRetainedWal: 64Mi, returnAfter: 30s}}\n  broker: {nats: {url: \"nats://n:4222\"}}",
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let budget = valid.mode.log_tailing().and_then(|l| l.budget).unwrap();
    assert_eq!(budget.return_after, Duration::from_secs(30));
}

#[test]
fn standby_slots_are_physical_slot_names_named_once() {
    let at = |slots: &str| {
        relay(&BASE.replace(
            "{polling: {}}",
            &format!("{{logTailing: {{synchronizedStandbySlots: {slots}}}}}"),
        ))
    };
    let valid = parse(&at("[standby_1, standby_2]")).unwrap_or_else(|e| panic!("{e}"));
    let ValidMode::LogTailing(l) = &valid.mode else {
        panic!("not log tailing")
    };
    assert_eq!(l.standby_slots, ["standby_1", "standby_2"]);
    assert_eq!(
        fields(&at("[standby_1, Standby-2, standby_1]")),
        [
            "spec.mode.logTailing.synchronizedStandbySlots[1]",
            "spec.mode.logTailing.synchronizedStandbySlots[2]"
        ]
    );
    // None named: no wait.
    let valid = parse(&relay(&BASE.replace("{polling: {}}", "{logTailing: {}}")))
        .unwrap_or_else(|e| panic!("{e}"));
    let ValidMode::LogTailing(l) = &valid.mode else {
        panic!("not log tailing")
    };
    assert!(l.standby_slots.is_empty());
}

#[test]
fn the_archive_is_defaulted_where_the_mode_moves_rows_there_and_refused_elsewhere() {
    let archive_of = |yaml: &str| parse(&relay(yaml)).map(|v| v.table.archive);
    let polling = |after: &str, table: &str| {
        BASE.replace(
            "{polling: {}}",
            &format!("{{polling: {{afterPublish: {after}}}}}"),
        )
        .replace("  mode:", &format!("  table: {table}\n  mode:"))
    };
    assert_eq!(
        archive_of(&polling("archive", "{name: events}")).unwrap(),
        Some(Archive {
            schema: "public".to_owned(),
            name: "events_archive".to_owned()
        })
    );
    assert_eq!(
        archive_of(&polling(
            "archive",
            "{schema: app, archive: {schema: history, name: sent}}"
        ))
        .unwrap(),
        Some(Archive {
            schema: "history".to_owned(),
            name: "sent".to_owned()
        })
    );
    // The backfill relay of an archiving log-tailing relay archives too.
    let tailing = BASE
        .replace("{polling: {}}", "{logTailing: {}}")
        .replace("  mode:", "  table: {archive: {}}\n  mode:");
    let valid = parse(&relay(&tailing)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        valid.table.archive.as_ref().map(|a| a.name.as_str()),
        Some("outbox_archive")
    );
    let backfill = valid.backfill().expect("a backfill relay");
    let ValidMode::Polling(p) = &backfill.mode else {
        panic!("the backfill relay polls")
    };
    assert_eq!(p.after_publish, AfterPublish::Archive);
    assert_eq!(backfill.table.archive, valid.table.archive);
    // Without the archive, log tailing deletes and its backfill relay too.
    let plain = parse(&relay(&BASE.replace("{polling: {}}", "{logTailing: {}}")))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(plain.table.archive, None);
    let ValidMode::Polling(p) = &plain.backfill().expect("backfill").mode else {
        panic!("the backfill relay polls")
    };
    assert_eq!(p.after_publish, AfterPublish::Delete);
    // An archive that would never be written, or that is the outbox table itself.
    for yaml in [
        polling("delete", "{archive: {}}"),
        polling("mark", "{archive: {name: old}}"),
        BASE.replace("{polling: {}}", "{logTailing: {deleteAfterPublish: false}}")
            .replace("  mode:", "  table: {archive: {}}\n  mode:"),
        polling("archive", "{archive: {name: outbox}}"),
        polling("archive", "{archive: {name: \"bad name\"}}"),
    ] {
        assert_eq!(
            fields(&relay(&yaml))
                .iter()
                .filter(|f| f.starts_with("spec.table.archive"))
                .count(),
            1,
            "{yaml}"
        );
    }
}
