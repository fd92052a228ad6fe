//! [`parse`]: every rule of the OutboxRelay spec, checked in one pass that reports all
//! problems, each with its field and its fix, before anything uses the spec.

use std::time::Duration;

use super::fields::{check_additional_fields, identifier, standby_slots};
use super::{
    Alerting, Columns, Failure, LogTailing, Polling, Problems, Table, ValidBroker, ValidMode,
    ValidRelay,
};
use crate::api::{
    AfterPublish, Broker, LogTailingSpec, Mode, OnExhausted, OrderingMode, OutboxRelay,
    OutboxRelaySpec, PollingSpec, SslMode, parse_bytes, parse_duration,
};
use crate::rules::{
    MIN_HEARTBEAT, RESERVED_HEADERS, check_identifier, check_secret_ref, check_slot_name,
    default_slot_name,
};

/// How long a relay that fell back to polling polls at least, unless
/// `spec.mode.logTailing.returnAfter` says otherwise.
pub const DEFAULT_RETURN_AFTER: Duration = Duration::from_secs(300);

/// Parses an OutboxRelay: every rule of the spec, all problems at once. Each section
/// below checks its part of the spec and adds to the same problems.
pub fn parse(relay: &OutboxRelay) -> Result<ValidRelay, Problems> {
    let mut p = Problems(Vec::new());
    let spec = &relay.spec;
    let (namespace, name) = metadata(relay, &mut p);
    let ssl_mode = database(spec, &mut p);
    let table = table(spec, &mut p);
    let (cloud_events, tracing) = message(spec, &namespace, &name, &mut p);
    let mode = mode(spec, &namespace, &name, &mut p);
    let table = Table {
        archive: super::fields::archive(spec, mode.as_ref(), &mut p),
        ..table
    };
    let broker = broker(spec, &namespace, &mut p);
    let (partitions, retention) = ordering(spec, mode.as_ref(), &mut p);
    let failure = failure(spec, &table.name, &mut p);
    let alerting = alerting(spec, &mut p);
    let (Some(mode), Some(broker)) = (mode, broker) else {
        return Err(p);
    };
    if !p.is_empty() {
        return Err(p);
    }
    let mut relay = relay.clone();
    relay.metadata.namespace = Some(namespace.clone());
    if let (ValidMode::LogTailing(l), Some(spec_l)) = (&mode, relay.spec.mode.log_tailing.as_mut())
    {
        spec_l.slot_name = Some(l.slot.clone());
        spec_l.publication_name = Some(l.publication.clone());
    }
    let login = spec
        .database
        .database_ref
        .as_ref()
        .and_then(|r| r.login(&namespace));
    Ok(ValidRelay {
        connection: spec.database.postgres().connection_secret_ref.clone(),
        relay,
        namespace,
        name,
        login,
        ssl_mode,
        table,
        mode,
        broker,
        per_aggregate: spec.ordering.mode == OrderingMode::PerAggregate,
        partitions,
        retention,
        failure,
        alerting,
        tombstone_on_empty_payload: spec.message.tombstone_on_empty_payload,
        expand_json_payload: spec.message.expand_json_payload,
        cloud_events,
        tracing,
    })
}

/// `metadata`: the relay's namespace and name.
fn metadata(relay: &OutboxRelay, p: &mut Problems) -> (String, String) {
    let namespace = relay
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let name = relay.metadata.name.clone().unwrap_or_default();
    let dns_label = |s: &str| {
        let b = s.as_bytes();
        !b.is_empty()
            && b.len() <= 50
            && b[0].is_ascii_lowercase()
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && !s.ends_with('-')
    };
    if !dns_label(&name) {
        p.push(
            "metadata.name",
            format!("`{name}` is not a DNS label of at most 50 characters starting with a letter"),
            "it names the relay's Deployment and Service: choose a name like orders-relay",
        );
    }

    (namespace, name)
}

/// `spec.database`: one source, its Secret references, TLS.
fn database(spec: &OutboxRelaySpec, p: &mut Problems) -> SslMode {
    let pg = spec.database.postgres();
    if spec.database.postgres.is_some() == spec.database.database_ref.is_some() {
        p.push(
            "spec.database",
            "needs exactly one of postgres and databaseRef",
            "keep postgres (a connection URL Secret) or databaseRef (a CloudNativePG Cluster)",
        );
    }
    // The CRD's two rules between databaseRef's fields (render and check see manifests
    // the API server has not held to them).
    if let Some(r) = &spec.database.database_ref {
        if r.secret_name.is_some() && r.user_secret_name.is_some() {
            p.push(
                "spec.database.databaseRef",
                "sets both secretName and userSecretName, which exclude each other",
                "keep secretName (a Secret with a uri) or userSecretName (a Secret with a username and password)",
            );
        }
        if r.database.is_some() && r.user_secret_name.is_none() {
            p.push(
                "spec.database.databaseRef.database",
                "is set without userSecretName",
                "set userSecretName too, or remove database: the app Secret's uri names its database",
            );
        }
    }
    let db = &pg.connection_secret_ref;
    let connection_field = if spec.database.database_ref.is_some() {
        "spec.database.databaseRef.secretName"
    } else {
        "spec.database.postgres.connectionSecretRef"
    };
    if !(db.name.is_empty() && spec.database.database_ref.is_none()) {
        check_secret_ref(p, connection_field, &db.name, &db.key);
    }
    for (field, reference) in [
        super::PG_CA_FIELD,
        super::PG_CLIENT_CERT_FIELD,
        super::PG_CLIENT_KEY_FIELD,
    ]
    .into_iter()
    .zip(&pg.tls_refs())
    {
        if let Some(r) = reference {
            check_secret_ref(p, field, &r.name, &r.key);
        }
    }
    if pg.client_key_secret_ref.is_some() && pg.client_cert_secret_ref.is_none() {
        p.push(
            super::PG_CLIENT_KEY_FIELD,
            "a client key without its certificate is never sent",
            "set clientCertSecretRef (its Secret's tls.key is the key when clientKeySecretRef is left out)",
        );
    }
    if pg.client_cert_secret_ref.is_some() && pg.ssl_mode == SslMode::Disable {
        p.push(
            "spec.database.postgres.sslMode",
            "is disable, but a client certificate is only sent over TLS",
            "set sslMode: verify-full (or require, verify-ca)",
        );
    }

    pg.ssl_mode
}

/// `spec.table`: names, columns, headers and additional fields.
fn table(spec: &OutboxRelaySpec, p: &mut Problems) -> Table {
    let t = &spec.table;
    let c = &t.columns;
    let columns = Columns {
        id: c.id.clone(),
        aggregate_type: c.aggregate_type.clone(),
        aggregate_id: c.aggregate_id.clone(),
        event_type: c.r#type.clone(),
        payload: c.payload.clone(),
        created_at: c.created_at.clone(),
        published_at: c.published_at.clone(),
        timestamp: c.timestamp.clone(),
        order: c.order.clone(),
    };
    for (field, value) in [
        ("spec.table.schema", &t.schema),
        ("spec.table.name", &t.name),
    ] {
        identifier(p, field, value);
    }
    for (field, value, _) in columns.catalogue() {
        identifier(p, field, value);
    }
    if let Some(timestamp) = &columns.timestamp {
        identifier(p, "spec.table.columns.timestamp", timestamp);
    }
    if let Some(order) = &columns.order {
        identifier(p, "spec.table.columns.order", order);
    }
    for (i, header) in t.headers.iter().enumerate() {
        let field = format!("spec.table.headers[{i}]");
        identifier(p, &field, header);
        if RESERVED_HEADERS.contains(&header.as_str()) {
            p.push(
                &field,
                format!("`{header}` is a header the relay sets itself"),
                "remove it from spec.table.headers",
            );
        }
    }
    check_additional_fields(p, t, spec.broker.get());
    if t.headers.len() > 32 {
        p.push(
            "spec.table.headers",
            format!("{} header columns; at most 32", t.headers.len()),
            "copy fewer columns into headers",
        );
    }

    Table {
        schema: t.schema.clone(),
        name: t.name.clone(),
        columns,
        headers: t.headers.clone(),
        additional: t.additional_fields.clone(),
        archive: None,
    }
}

/// `spec.message` and `spec.tracing`: CloudEvents and the span exporter.
fn message(
    spec: &OutboxRelaySpec,
    namespace: &str,
    name: &str,
    p: &mut Problems,
) -> (
    Option<crate::broker::CloudEvents>,
    Option<crate::spec::Tracing>,
) {
    let cloud_events = spec.message.cloud_events.as_ref().map(|ce| {
        let printable = |s: &str| !s.is_empty() && !s.chars().any(char::is_control);
        if let Some(source) = &ce.source
            && (!printable(source) || source.contains(char::is_whitespace))
        {
            p.push(
                "spec.message.cloudEvents.source",
                "is not a URI reference (empty, or with spaces or control characters)",
                "use a URI or a path such as /orders/outbox",
            );
        }
        if !printable(&ce.data_content_type) {
            p.push(
                "spec.message.cloudEvents.dataContentType",
                "is not a media type (empty, or with control characters)",
                "use a media type such as application/json",
            );
        }
        crate::broker::CloudEvents {
            mode: ce.mode,
            source: ce
                .source
                .clone()
                .unwrap_or_else(|| format!("/outboxrelays/{namespace}/{name}")),
            data_content_type: ce.data_content_type.clone(),
        }
    });

    let tracing = spec.tracing.as_ref().map(|t| {
        let endpoint = t.otlp_endpoint.trim_end_matches('/');
        if endpoint.starts_with("https://") {
            p.push(
                "spec.tracing.otlpEndpoint",
                "is https://: the relay exports spans over plain HTTP only",
                "use the collector's plain OTLP/HTTP port inside the cluster, e.g. http://otel-collector:4318",
            );
        } else if !endpoint.starts_with("http://") || endpoint.contains(char::is_whitespace) {
            p.push(
                "spec.tracing.otlpEndpoint",
                "is not an http:// URL",
                "give the collector's OTLP/HTTP base URL, e.g. http://otel-collector:4318",
            );
        }
        if t.service_name.trim().is_empty() {
            p.push(
                "spec.tracing.serviceName",
                "is empty",
                "leave it out for outbox-relay",
            );
        }
        crate::spec::Tracing {
            otlp_endpoint: endpoint.to_owned(),
            service_name: t.service_name.clone(),
        }
    });

    (cloud_events, tracing)
}

/// `spec.mode`: exactly one of polling and log tailing.
fn mode(
    spec: &OutboxRelaySpec,
    namespace: &str,
    name: &str,
    p: &mut Problems,
) -> Option<ValidMode> {
    if spec.mode.polling.is_some() == spec.mode.log_tailing.is_some() {
        p.push(
            "spec.mode",
            "set exactly one of polling and logTailing",
            "keep the one mode the relay should run",
        );
        return None;
    }
    match spec.mode.get()? {
        Mode::Polling(poll) => Some(polling(poll, p)),
        Mode::LogTailing(l) => Some(log_tailing(l, namespace, name, p)),
    }
}

/// `spec.mode.polling`.
fn polling(poll: &PollingSpec, p: &mut Problems) -> ValidMode {
    let interval = duration(
        p,
        "spec.mode.polling.interval",
        &poll.interval,
        Duration::from_millis(1),
    );
    if !(1..=10_000).contains(&poll.batch_size) {
        p.push(
            "spec.mode.polling.batchSize",
            format!("{} is not between 1 and 10000", poll.batch_size),
            "choose a batch size from 1 to 10000",
        );
    }
    if !(1..=16).contains(&poll.workers) {
        p.push(
            "spec.mode.polling.workers",
            format!("{} is not between 1 and 16", poll.workers),
            "choose 1 to 16 workers",
        );
    }
    ValidMode::Polling(Polling {
        interval: interval.unwrap_or_default(),
        batch_size: i64::from(poll.batch_size),
        after_publish: poll.after_publish,
        workers: usize::try_from(poll.workers).unwrap_or(1).max(1),
    })
}

/// `spec.mode.logTailing`: the slot and publication names (defaulted from the relay's),
/// the heartbeat, the sweep, the WAL budget and the standby slots.
fn log_tailing(l: &LogTailingSpec, namespace: &str, name: &str, p: &mut Problems) -> ValidMode {
    let slot = l
        .slot_name
        .clone()
        .unwrap_or_else(|| default_slot_name(namespace, name));
    let publication = l.publication_name.clone().unwrap_or_else(|| slot.clone());
    if let Err(message) = check_slot_name(&slot) {
        p.push(
            "spec.mode.logTailing.slotName",
            message,
            "use lowercase letters, digits and _ (PostgreSQL's rule for slot names)",
        );
    }
    if let Err(message) = check_slot_name(&publication) {
        p.push(
            "spec.mode.logTailing.publicationName",
            message,
            "use lowercase letters, digits and _ (pgoutput folds unquoted publication names to lower case)",
        );
    }
    let heartbeat = duration(
        p,
        "spec.mode.logTailing.heartbeatInterval",
        &l.heartbeat_interval,
        MIN_HEARTBEAT,
    );
    let sweep = sweep(l, p);
    let budget = budget(l, p);
    ValidMode::LogTailing(LogTailing {
        slot_named: slot != default_slot_name(namespace, name),
        slot,
        publication,
        heartbeat: heartbeat.unwrap_or_default(),
        delete_after_publish: l.delete_after_publish,
        sweep,
        budget,
        standby_slots: standby_slots(p, &l.synchronized_standby_slots),
    })
}

/// `spec.mode.logTailing.sweep`.
fn sweep(l: &LogTailingSpec, p: &mut Problems) -> Option<crate::spec::Sweep> {
    l.sweep.as_ref().map(|s| {
        if !l.delete_after_publish {
            p.push(
                "spec.mode.logTailing.sweep",
                "needs deleteAfterPublish: with published rows kept, the table cannot tell a missed row from a published one",
                "set deleteAfterPublish: true, or remove the sweep",
            );
        }
        let interval = duration(
            p,
            "spec.mode.logTailing.sweep.interval",
            &s.interval,
            Duration::from_secs(1),
        );
        let older_than = duration(
            p,
            "spec.mode.logTailing.sweep.olderThan",
            &s.older_than,
            Duration::from_secs(1),
        );
        crate::spec::Sweep {
            interval: interval.unwrap_or_default(),
            older_than: older_than.unwrap_or_default(),
        }
    })
}

/// `spec.mode.logTailing.maxRetainedWal` and `returnAfter`.
fn budget(l: &LogTailingSpec, p: &mut Problems) -> Option<crate::spec::WalBudget> {
    // Checked whenever it is set, as the CRD's rule does, though only a
    // budget uses it.
    let return_after = l
        .return_after
        .as_deref()
        .map_or(Some(DEFAULT_RETURN_AFTER), |text| {
            duration(
                p,
                "spec.mode.logTailing.returnAfter",
                text,
                Duration::from_secs(1),
            )
        });
    l.max_retained_wal.as_ref().map(|max| {
        if !l.delete_after_publish {
            p.push(
                "spec.mode.logTailing.maxRetainedWal",
                "needs deleteAfterPublish: the fall back to polling finds the rows not yet published only when published rows leave the table",
                "set deleteAfterPublish: true, or remove maxRetainedWal",
            );
        }
        let bytes = match parse_bytes(max) {
            Ok(0) => {
                p.push(
                    "spec.mode.logTailing.maxRetainedWal",
                    "is zero",
                    "choose a positive size such as 10Gi",
                );
                0
            }
            Ok(bytes) => bytes,
            Err(e) => {
                p.push(
                    "spec.mode.logTailing.maxRetainedWal",
                    e.to_string(),
                    "write a quantity such as 512Mi or 10Gi",
                );
                0
            }
        };
        crate::spec::WalBudget {
            max_retained_wal: bytes,
            return_after: return_after.unwrap_or_default(),
        }
    })
}

/// `spec.broker`: exactly one broker, checked by its module.
fn broker(spec: &OutboxRelaySpec, namespace: &str, p: &mut Problems) -> Option<ValidBroker> {
    match spec.broker.get() {
        None => {
            p.push(
                "spec.broker",
                "set exactly one of kafka, nats and rabbitmq",
                "keep the one broker the relay publishes to",
            );
            None
        }
        Some(Broker::Kafka(written)) => {
            if written.kafka_ref.is_some() && (written.tls.is_some() || written.sasl.is_some()) {
                p.push(
                    "spec.broker.kafka.kafkaRef",
                    "is set beside tls or sasl",
                    "remove tls and sasl: kafkaRef gives TLS and the login from the Strimzi cluster and KafkaUser",
                );
            }
            let k = &written.resolved(namespace);
            crate::broker::kafka::check(k, p);
            if spec.ordering.mode == OrderingMode::PerAggregate
                && let Some(why) = crate::broker::kafka::partitioner_scatters_keys(&k.properties)
            {
                p.push(
                    "spec.broker.kafka.properties.partitioner",
                    format!("{why}: an aggregate's events would land on more than one partition, and per-aggregate order would not hold"),
                    "remove it (the default, murmur2_random, hashes the key as the Java client does; consistent is CRC32 with empty keys on one partition)",
                );
            }
            Some(ValidBroker::Kafka(k.clone()))
        }
        Some(Broker::Nats(n)) => {
            crate::broker::nats::check(n, p);
            Some(ValidBroker::Nats(n.clone()))
        }
        Some(Broker::RabbitMq(r)) => {
            crate::broker::amqp::check(r, p);
            Some(ValidBroker::RabbitMq(r.clone()))
        }
    }
}

/// `spec.ordering`, `spec.replicas` and `spec.retention`: the partition count and how
/// long published rows stay.
fn ordering(spec: &OutboxRelaySpec, mode: Option<&ValidMode>, p: &mut Problems) -> (i32, Duration) {
    let partitions = spec.ordering.partitions;
    if !(1..=1024).contains(&partitions) {
        p.push(
            "spec.ordering.partitions",
            format!("{partitions} is not between 1 and 1024"),
            "choose 1 to 1024 partitions",
        );
    }
    if !(0..=64).contains(&spec.replicas) {
        p.push(
            "spec.replicas",
            format!("{} is not between 0 and 64", spec.replicas),
            "choose 0 to 64 replicas",
        );
    }
    let retention = duration(
        p,
        "spec.retention.publishedRows",
        &spec.retention.published_rows,
        Duration::from_secs(1),
    );
    if let (Some(retention), Some(ValidMode::Polling(poll))) = (retention, mode)
        && poll.after_publish == AfterPublish::Mark
        && retention < poll.interval
    {
        p.push(
            "spec.retention.publishedRows",
            format!(
                "{} is shorter than the poll interval {}",
                spec.retention.published_rows,
                spec.mode
                    .polling
                    .as_ref()
                    .map_or("", |poll| poll.interval.as_str())
            ),
            "keep published rows at least one poll interval",
        );
    }
    (partitions, retention.unwrap_or_default())
}

/// `spec.failure`: attempts, and the dead-letter table (by default `<table>_dead_letter`).
fn failure(spec: &OutboxRelaySpec, table_name: &str, p: &mut Problems) -> Failure {
    let max_attempts = match u32::try_from(spec.failure.max_attempts) {
        Ok(n) if (1..=1000).contains(&n) => n,
        _ => {
            p.push(
                "spec.failure.maxAttempts",
                format!("{} is not between 1 and 1000", spec.failure.max_attempts),
                "choose 1 to 1000 attempts",
            );
            1
        }
    };
    let dead_letter_table = (spec.failure.on_exhausted == OnExhausted::DeadLetter).then(|| {
        spec.failure
            .dead_letter_table
            .clone()
            .unwrap_or_else(|| format!("{table_name}_dead_letter"))
    });
    if let Some(table) = &dead_letter_table {
        if let Err(message) = check_identifier(table) {
            let fix = if spec.failure.dead_letter_table.is_some() {
                "name a valid table in spec.failure.deadLetterTable"
            } else {
                "the default <table>_dead_letter is too long: set spec.failure.deadLetterTable"
            };
            p.push("spec.failure.deadLetterTable", message, fix);
        } else if *table == table_name {
            p.push(
                "spec.failure.deadLetterTable",
                format!("`{table}` is the outbox table itself"),
                "name another table for exhausted rows",
            );
        }
    }
    Failure {
        max_attempts,
        dead_letter_table,
    }
}

/// `spec.alerting`: the thresholds of the shipped alerts.
fn alerting(spec: &OutboxRelaySpec, p: &mut Problems) -> Alerting {
    for (key, value) in &spec.monitoring.labels {
        if let Err(why) = crate::rules::check_label(key, value) {
            p.push(
                "spec.monitoring.labels",
                why,
                "give Kubernetes label keys and values",
            );
        }
    }
    let oldest = duration(
        p,
        "spec.alerting.oldestUnpublishedAge",
        &spec.alerting.oldest_unpublished_age,
        Duration::from_secs(1),
    );
    if spec.alerting.backlog_rows < 1 {
        p.push(
            "spec.alerting.backlogRows",
            format!("{} is not positive", spec.alerting.backlog_rows),
            "choose a threshold of at least 1 row",
        );
    }
    let wal = match parse_bytes(&spec.alerting.slot_retained_wal) {
        Ok(0) => {
            p.push(
                "spec.alerting.slotRetainedWal",
                "is zero",
                "choose a positive size such as 1Gi",
            );
            None
        }
        Ok(bytes) => Some(bytes),
        Err(e) => {
            p.push(
                "spec.alerting.slotRetainedWal",
                e.to_string(),
                "write a quantity such as 512Mi or 1Gi",
            );
            None
        }
    };

    Alerting {
        enabled: spec.alerting.enabled,
        oldest_unpublished_age: oldest.unwrap_or_default(),
        backlog_rows: spec.alerting.backlog_rows,
        slot_retained_wal_bytes: wal.unwrap_or_default(),
        as_written: (
            spec.alerting.oldest_unpublished_age.clone(),
            spec.alerting.slot_retained_wal.clone(),
        ),
    }
}

fn duration(p: &mut Problems, field: &str, value: &str, min: Duration) -> Option<Duration> {
    match parse_duration(value) {
        Ok(d) if d >= min => Some(d),
        Ok(_) => {
            p.push(
                field,
                format!(
                    "`{value}` is shorter than {}",
                    humantime::format_duration(min)
                ),
                "choose a longer duration",
            );
            None
        }
        Err(e) => {
            p.push(
                field,
                e.to_string(),
                "write a duration such as 500ms, 30s, 5m or 24h",
            );
            None
        }
    }
}
