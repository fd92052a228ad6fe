//! `render --from-debezium FILE`: the OutboxRelay equivalent to a Debezium PostgreSQL
//! connector that runs the outbox event router, so a team can move a connector over
//! line by line.
//!
//! Reads a Kafka Connect connector (the REST API's JSON, `{"name", "config"}` or the
//! bare `config` object) or a Debezium Server `application.properties`
//! (`debezium.source.*`, `debezium.transforms.*`, `debezium.sink.*`). Every option is
//! either translated, explained in a note (printed as comments above the manifest), or
//! refused with the reason. Credentials are never copied: the manifest names a Secret,
//! and the note says what to put in it without the password.

use std::collections::BTreeMap;

use crate::api::{
    AdditionalField, BrokerSpec, ColumnsSpec, DatabaseSpec, KafkaSpec, LogTailingSpec, MessageSpec,
    ModeSpec, NatsSpec, OutboxRelay, OutboxRelaySpec, Placement, PostgresSpec, SecretKeyRef,
    SslMode, TableSpec,
};

/// The router's class name.
const ROUTER: &str = "io.debezium.transforms.outbox.EventRouter";
/// The PostgreSQL connector's class name.
const POSTGRES_CONNECTOR: &str = "io.debezium.connector.postgresql.PostgresConnector";
/// The router's default `route.topic.regex`.
const DEFAULT_TOPIC_REGEX: &str = "(?<routedByValue>.*)";

/// A connector configuration that cannot be translated.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TranslateError(pub String);

/// The translation: the manifest and what the user must know or do.
#[derive(Debug, Clone)]
pub struct Translation {
    /// The OutboxRelay.
    pub relay: OutboxRelay,
    /// One line per option that changed meaning, was dropped, or needs an action.
    pub notes: Vec<String>,
}

impl Translation {
    /// The manifest as YAML, the notes as comments above it.
    pub fn to_yaml(&self) -> Result<String, serde_yaml::Error> {
        let mut out = String::from(
            "# Translated from a Debezium connector by `outbox-operator render --from-debezium`.\n",
        );
        for note in &self.notes {
            out.push_str("# - ");
            out.push_str(note);
            out.push('\n');
        }
        out.push_str(&serde_yaml::to_string(&self.relay)?);
        Ok(out)
    }
}

/// Names the translation cannot take from the connector.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The OutboxRelay's name; default the connector's name (or `outbox`).
    pub name: Option<String>,
    /// Its namespace; left out when not given.
    pub namespace: Option<String>,
    /// Kafka bootstrap servers, when the file has none (Kafka Connect keeps them in
    /// the worker's configuration, not the connector's).
    pub bootstrap_servers: Option<String>,
}

/// Reads a connector file's text: JSON when it starts with `{`, else properties.
pub fn parse_config(
    text: &str,
) -> Result<(Option<String>, BTreeMap<String, String>), TranslateError> {
    if text.trim_start().starts_with('{') {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| TranslateError(format!("not JSON: {e}")))?;
        let name = value
            .get("name")
            .and_then(|n| n.as_str())
            .map(str::to_owned);
        let config = match value.get("config") {
            Some(config) => config,
            None => &value,
        };
        let object = config.as_object().ok_or_else(|| {
            TranslateError("the connector's `config` is not an object".to_owned())
        })?;
        let map = object
            .iter()
            .map(|(k, v)| {
                let text = match v {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), text)
            })
            .collect();
        Ok((name, map))
    } else {
        let raw = java_properties::read(text.as_bytes())
            .map_err(|e| TranslateError(format!("not a properties file: {e}")))?;
        Ok((None, server_to_connect(raw.into_iter().collect())))
    }
}

/// Debezium Server's keys in Kafka Connect's terms: `debezium.source.X` → `X`,
/// `debezium.transforms…` → `transforms…`; sink keys kept under `debezium.sink.`.
fn server_to_connect(raw: BTreeMap<String, String>) -> BTreeMap<String, String> {
    raw.into_iter()
        .map(|(k, v)| {
            let key = if let Some(rest) = k.strip_prefix("debezium.source.") {
                rest.to_owned()
            } else if let Some(rest) = k.strip_prefix("debezium.") {
                if rest.starts_with("transforms") {
                    rest.to_owned()
                } else {
                    k
                }
            } else {
                k
            };
            (key, v)
        })
        .collect()
}

/// Translates a connector configuration (already read by [`parse_config`]).
pub fn translate(
    connector_name: Option<&str>,
    config: &BTreeMap<String, String>,
    options: &Options,
) -> Result<Translation, TranslateError> {
    let get = |k: &str| config.get(k).map(String::as_str).filter(|v| !v.is_empty());
    let mut notes = Vec::new();
    match get("connector.class") {
        Some(POSTGRES_CONNECTOR) | Some("PostgresConnector") => {}
        Some(other) => {
            return Err(TranslateError(format!(
                "connector.class is {other}: only the PostgreSQL connector's outbox tables translate"
            )));
        }
        None => return Err(TranslateError("no connector.class".to_owned())),
    }
    match get("plugin.name") {
        Some("pgoutput") => {}
        // Debezium's default plugin is decoderbufs.
        plugin => notes.push(format!(
            "plugin.name {}: the relay always decodes with pgoutput (built into PostgreSQL); a slot made for another plugin is not adopted (SlotReady says SlotConflict): give the relay another slotName",
            plugin.unwrap_or("unset (decoderbufs)")
        )),
    }

    // The router, by its name in `transforms`.
    let names: Vec<&str> = get("transforms")
        .map(|t| {
            t.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let router = names
        .iter()
        .find(|n| get(&format!("transforms.{n}.type")) == Some(ROUTER))
        .ok_or_else(|| {
            TranslateError(format!(
                "no transform of type {ROUTER} in `transforms`: this connector does not run the outbox router"
            ))
        })?;
    for other in names.iter().filter(|n| *n != router) {
        notes.push(format!(
            "transform {other} ({}) has no equivalent and is dropped",
            get(&format!("transforms.{other}.type")).unwrap_or("no type")
        ));
    }
    let prefix = format!("transforms.{router}.");
    let mut router_options: BTreeMap<&str, &str> = config
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(&prefix)?, v.as_str())))
        .filter(|(k, _)| *k != "type")
        .collect();
    let mut take = |k: &str| router_options.remove(k);

    // The table.
    let table_list = get("table.include.list").or_else(|| get("table.whitelist"));
    let (schema, table) = match table_list {
        Some(list) => {
            let tables: Vec<&str> = list.split(',').map(str::trim).collect();
            if tables.len() != 1 {
                return Err(TranslateError(format!(
                    "table.include.list names {} tables; an OutboxRelay reads one outbox table: make one relay per table",
                    tables.len()
                )));
            }
            // The list holds regular expressions; an outbox table is named plainly.
            let plain = tables[0].replace("\\.", ".");
            match plain.split_once('.') {
                Some((s, t)) => (s.to_owned(), t.to_owned()),
                None => ("public".to_owned(), plain),
            }
        }
        None => {
            notes.push(
                "no table.include.list: the table is public.outbox; set spec.table if it is not"
                    .to_owned(),
            );
            ("public".to_owned(), "outbox".to_owned())
        }
    };
    let mut columns = ColumnsSpec::default();
    if let Some(c) = take("table.field.event.id") {
        columns.id = c.to_owned();
        notes.push(format!(
            "table.field.event.id {c}: its text is the message id; bigint, integer, smallint, uuid, text and varchar ids work (the relay written here tails the log; polling a uuid or text id needs table.columns.createdAt)"
        ));
    }
    if let Some(c) = take("table.field.event.key") {
        columns.aggregate_id = c.to_owned();
    }
    if let Some(c) = take("table.field.event.payload") {
        columns.payload = c.to_owned();
    }
    if let Some(c) = take("table.field.event.type") {
        columns.r#type = c.to_owned();
    }
    if let Some(c) = take("table.field.event.timestamp") {
        columns.timestamp = Some(c.to_owned());
    }
    if let Some(c) = take("route.by.field") {
        columns.aggregate_type = c.to_owned();
    }
    if let Some(c) = take("table.field.event.schema.version") {
        notes.push(format!(
            "table.field.event.schema.version {c}: there are no Connect schemas on the relay's records; dropped"
        ));
    }
    let mut additional_fields = Vec::new();
    if let Some(placements) = take("table.fields.additional.placement") {
        for item in placements
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            additional_fields.push(placement(item)?);
        }
    }
    for key in [
        "table.fields.additional.error.on.missing",
        "table.field.additional.missing",
    ] {
        if let Some(v) = take(key) {
            notes.push(format!(
                "{key} {v}: the relay checks every placed column when it starts and refuses a table without one"
            ));
        }
    }
    if let Some(v) = take("table.op.invalid.behavior") {
        notes.push(format!(
            "table.op.invalid.behavior {v}: updates and deletes of outbox rows are never published (the relay reads inserts)"
        ));
    }
    if let Some(v) = take("table.json.payload.null.behavior") {
        notes.push(format!(
            "table.json.payload.null.behavior {v}: dropped (payloads are sent as stored)"
        ));
    }
    let message = MessageSpec {
        tombstone_on_empty_payload: take("route.tombstone.on.empty.payload")
            .is_some_and(|v| v.eq_ignore_ascii_case("true")),
        expand_json_payload: take("table.expand.json.payload")
            .is_some_and(|v| v.eq_ignore_ascii_case("true")),
        cloud_events: None,
    };

    // The destination.
    if let Some(regex) = take("route.topic.regex")
        && regex != DEFAULT_TOPIC_REGEX
    {
        return Err(TranslateError(format!(
            "route.topic.regex {regex}: only the default ({DEFAULT_TOPIC_REGEX}) translates; the relay's topic is a template over the whole aggregate type"
        )));
    }
    let template = take("route.topic.replacement")
        .unwrap_or("outbox.event.${routedByValue}")
        .replace("${routedByValue}", crate::rules::AGGREGATE_TYPE_PLACEHOLDER);
    for (k, v) in std::mem::take(&mut router_options) {
        if k.starts_with("tracing.") {
            notes.push(format!(
                "{prefix}{k} {v}: the relay copies a traceparent column into a header with spec.table.headers"
            ));
        } else {
            notes.push(format!(
                "{prefix}{k} {v}: not an option of the router the relay knows; dropped"
            ));
        }
    }
    let broker = broker(config, template, options, &mut notes)?;

    // The slot and the database.
    let log_tailing = LogTailingSpec {
        slot_name: get("slot.name").map(str::to_owned),
        publication_name: get("publication.name").map(str::to_owned),
        heartbeat_interval: get("heartbeat.interval.ms")
            .and_then(|ms| ms.parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map_or_else(
                || LogTailingSpec::default().heartbeat_interval,
                |ms| format!("{ms}ms"),
            ),
        // Debezium leaves published rows in the table.
        delete_after_publish: false,
        sweep: None,
        max_retained_wal: None,
        return_after: None,
        synchronized_standby_slots: Vec::new(),
    };
    notes.push(
        "deleteAfterPublish is false, as Debezium leaves rows in the table; set it to true to have the relay delete published rows".to_owned(),
    );
    if get("slot.name").is_some() {
        notes.push(
            "the operator adopts the connector's slot and publication (used, never dropped, as it did not create them): stop the connector first, a slot has one reader; the relay goes on from the connector's confirmed position, so what the connector sent but had not confirmed is sent again"
                .to_owned(),
        );
    }
    if let Some(mode) = get("snapshot.mode")
        && !matches!(mode, "never" | "no_data" | "no-data")
    {
        notes.push(format!(
            "snapshot.mode {mode}: rows already in the table when the slot is created are published by the relay's back-fill, not by a snapshot"
        ));
    }
    let name = options
        .name
        .clone()
        .or_else(|| connector_name.map(dns_label))
        .unwrap_or_else(|| "outbox".to_owned());
    let secret = format!("{name}-db");
    let host = get("database.hostname").unwrap_or("localhost");
    let port = get("database.port").unwrap_or("5432");
    let user = get("database.user").unwrap_or("postgres");
    let dbname = get("database.dbname").unwrap_or("postgres");
    notes.push(format!(
        "create Secret {secret} with key uri = postgres://{user}:<password>@{host}:{port}/{dbname} (the password is not copied from the connector)"
    ));
    // Debezium's default is `prefer`.
    let ssl_mode = match get("database.sslmode") {
        Some("disable") => SslMode::Disable,
        None | Some("prefer") | Some("allow") => SslMode::Prefer,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some(other) => {
            return Err(TranslateError(format!(
                "database.sslmode {other} is not a libpq sslmode"
            )));
        }
    };
    if get("database.sslrootcert").is_some() || get("database.sslcert").is_some() {
        notes.push(
            "database.sslrootcert / sslcert: put the PEM files in Secrets and name them in spec.database.postgres.caSecretRef / clientCertSecretRef / clientKeySecretRef".to_owned(),
        );
    }

    let spec = OutboxRelaySpec {
        database: DatabaseSpec {
            postgres: Some(PostgresSpec {
                connection_secret_ref: SecretKeyRef {
                    name: secret,
                    key: "uri".to_owned(),
                },
                ssl_mode,
                ca_secret_ref: None,
                client_cert_secret_ref: None,
                client_key_secret_ref: None,
            }),
            database_ref: None,
        },
        table: TableSpec {
            schema,
            name: table,
            columns,
            headers: Vec::new(),
            additional_fields,
            archive: None,
        },
        mode: ModeSpec {
            polling: None,
            log_tailing: Some(log_tailing),
        },
        broker,
        message,
        ..serde_yaml::from_str::<OutboxRelaySpec>(MINIMAL_SPEC)
            .map_err(|e| TranslateError(format!("internal: {e}")))?
    };
    let mut relay = OutboxRelay::new(&name, spec);
    relay.metadata.namespace = options.namespace.clone();
    drop_refused_properties(&mut relay, producer_prefix(config), &mut notes).map_err(
        |problems| {
            TranslateError(format!(
                "the translated OutboxRelay is not valid: {problems}"
            ))
        },
    )?;
    // What the API server holds it to beyond that, e.g. at most 128 producer settings.
    let json =
        serde_json::to_value(&relay).map_err(|e| TranslateError(format!("internal: {e}")))?;
    let refused = crate::schema::problems(&json);
    if !refused.is_empty() {
        return Err(TranslateError(format!(
            "the translated OutboxRelay does not fit the CRD's schema: {}",
            refused.join("; ")
        )));
    }
    Ok(Translation { relay, notes })
}

/// Drops, each with a note, the Kafka properties the relay's spec check refuses in the
/// translated relay: settings librdkafka takes one by one but not beside the relay's
/// idempotent producer or one another, a partitioner that would scatter an aggregate's
/// events, a timeout the relay cannot keep. A translation is a relay that starts, and
/// its notes say what was left behind. Repeats until none is refused, since dropping
/// one property can change the rules between the others (each round drops at least
/// one, so it ends). Returns the problems of the relay it leaves, if any remain.
fn drop_refused_properties(
    relay: &mut OutboxRelay,
    prefix: &str,
    notes: &mut Vec<String>,
) -> Result<(), crate::rules::Problems> {
    const PROPERTIES: &str = "spec.broker.kafka.properties";
    loop {
        let Err(problems) = crate::spec::parse(relay) else {
            return Ok(());
        };
        let Some(kafka) = relay.spec.broker.kafka.as_mut() else {
            return Err(problems);
        };
        let mut dropped = false;
        for problem in &problems.0 {
            // The timeout's problem names the map, not a key.
            let keys: Vec<String> = match problem.field.strip_prefix(PROPERTIES) {
                Some("") => crate::broker::kafka::deadline_culprits(&kafka.properties),
                Some(rest) => rest
                    .strip_prefix('.')
                    .map(str::to_owned)
                    .into_iter()
                    .collect(),
                None => continue,
            };
            for key in keys {
                if kafka.properties.remove(&key).is_some() {
                    notes.push(format!(
                        "{prefix}{key}: the relay refuses it ({}); dropped",
                        problem.message
                    ));
                    dropped = true;
                }
            }
        }
        if !dropped {
            return Err(problems);
        }
    }
}

/// Where a connector file keeps its Kafka producer's settings: Debezium Server's sink
/// or Kafka Connect's per-connector overrides.
fn producer_prefix(config: &BTreeMap<String, String>) -> &'static str {
    if config
        .get("debezium.sink.type")
        .is_some_and(|v| !v.is_empty())
    {
        "debezium.sink.kafka.producer."
    } else {
        "producer.override."
    }
}

/// A spec with every field at its default, for the fields a connector does not set.
const MINIMAL_SPEC: &str = "database: {postgres: {connectionSecretRef: {name: x}}}\nmode: {logTailing: {}}\nbroker: {kafka: {bootstrapServers: x}}\n";

/// One `column:placement[:alias]` item.
fn placement(item: &str) -> Result<AdditionalField, TranslateError> {
    let parts: Vec<&str> = item.split(':').map(str::trim).collect();
    let (column, placement, alias) = match parts.as_slice() {
        [c, p] => (*c, *p, None),
        [c, p, a] => (*c, *p, Some((*a).to_owned())),
        _ => {
            return Err(TranslateError(format!(
                "table.fields.additional.placement item `{item}` is not column:placement[:alias]"
            )));
        }
    };
    let placement = match placement.to_ascii_lowercase().as_str() {
        "header" => Placement::Header,
        "envelope" => Placement::Envelope,
        // The router ignores an alias here.
        "partition" => {
            return Ok(AdditionalField {
                column: column.to_owned(),
                placement: Placement::Partition,
                alias: None,
            });
        }
        other => {
            return Err(TranslateError(format!(
                "table.fields.additional.placement item `{item}`: placement {other} is not header, envelope or partition"
            )));
        }
    };
    Ok(AdditionalField {
        column: column.to_owned(),
        placement,
        alias: alias.filter(|a| a != column),
    })
}

/// The broker: Kafka for Kafka Connect and Debezium Server's Kafka sink, NATS for its
/// JetStream sink.
fn broker(
    config: &BTreeMap<String, String>,
    template: String,
    options: &Options,
    notes: &mut Vec<String>,
) -> Result<BrokerSpec, TranslateError> {
    let get = |k: &str| config.get(k).map(String::as_str).filter(|v| !v.is_empty());
    match get("debezium.sink.type") {
        None | Some("kafka") => {
            let producer_prefix = producer_prefix(config);
            let bootstrap = options
                .bootstrap_servers
                .clone()
                .or_else(|| get(&format!("{producer_prefix}bootstrap.servers")).map(str::to_owned))
                .ok_or_else(|| {
                    TranslateError(
                        "no Kafka bootstrap servers in the file (Kafka Connect keeps them in the worker's configuration): pass --bootstrap-servers".to_owned(),
                    )
                })?;
            if let Some(protocol) = get(&format!("{producer_prefix}security.protocol"))
                && protocol != "PLAINTEXT"
            {
                notes.push(format!(
                    "{producer_prefix}security.protocol {protocol}: set spec.broker.kafka.tls (CA and client certificate Secrets) and sasl (mechanism and credential Secrets) by hand"
                ));
            }
            let mut properties = BTreeMap::new();
            for (k, v) in config {
                let Some(key) = k.strip_prefix(producer_prefix) else {
                    continue;
                };
                if key == "bootstrap.servers" {
                    continue;
                }
                if crate::rules::is_fixed_kafka_property(key) {
                    notes.push(format!(
                        "{k}: fixed by the relay (acks=all, idempotence) or set through spec.broker.kafka.tls / sasl; dropped"
                    ));
                } else if let Some(why) = crate::broker::kafka::refused_by_librdkafka(key, v) {
                    // The Java client's settings that librdkafka does not share
                    // (buffer.memory, max.block.ms, …) would keep the relay from starting.
                    notes.push(format!(
                        "{k}: librdkafka, the relay's Kafka client, refuses this name or value ({why}); dropped"
                    ));
                } else {
                    properties.insert(key.to_owned(), v.clone());
                }
            }
            for key in ["key.converter", "value.converter"] {
                if let Some(converter) = get(key)
                    && !converter.ends_with("StringConverter")
                    && !converter.ends_with("ByteArrayConverter")
                    && !converter.ends_with("ByteBufferConverter")
                {
                    notes.push(format!(
                        "{key} {converter}: the relay sends keys and payloads as stored, as Connect's StringConverter does; consumers that expect the converter's encoding must change"
                    ));
                }
            }
            Ok(BrokerSpec {
                kafka: Some(KafkaSpec {
                    bootstrap_servers: bootstrap,
                    kafka_ref: None,
                    topic: template,
                    tls: None,
                    sasl: None,
                    properties,
                    allow_plaintext_credentials: false,
                }),
                nats: None,
                rabbitmq: None,
            })
        }
        Some("nats-jetstream") => {
            let raw = get("debezium.sink.nats-jetstream.url").ok_or_else(|| {
                TranslateError("debezium.sink.nats-jetstream.url is missing".to_owned())
            })?;
            // Credentials in the URL stay out of the manifest.
            let url = raw
                .split(',')
                .map(|u| match (u.split_once("://"), u.rsplit_once('@')) {
                    (Some((scheme, _)), Some((_, host))) => format!("{scheme}://{host}"),
                    _ => u.to_owned(),
                })
                .collect::<Vec<_>>()
                .join(",");
            if url != raw {
                notes.push(
                    "the NATS URL held credentials: they are not copied; put them in Secrets and name them in spec.broker.nats (usernameSecretRef and passwordSecretRef, or tokenSecretRef)".to_owned(),
                );
            }
            notes.push(
                "NATS: the subject is the router's topic with '.' kept; a JetStream stream must capture it".to_owned(),
            );
            Ok(BrokerSpec {
                kafka: None,
                nats: Some(NatsSpec {
                    url,
                    subject: template,
                    ..serde_yaml::from_str("url: x")
                        .map_err(|e| TranslateError(format!("internal: {e}")))?
                }),
                rabbitmq: None,
            })
        }
        Some(other) => Err(TranslateError(format!(
            "debezium.sink.type {other}: translate the broker by hand (the relay publishes to Kafka, NATS JetStream and RabbitMQ)"
        ))),
    }
}

/// A connector name as a DNS label (lower case, `-` for anything else).
fn dns_label(name: &str) -> String {
    let mut label: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    label = label.trim_matches('-').to_owned();
    label.truncate(50);
    let label = label.trim_end_matches('-').to_owned();
    if label.starts_with(|c: char| c.is_ascii_lowercase()) {
        label
    } else {
        format!("outbox-{label}").trim_end_matches('-').to_owned()
    }
}

#[cfg(test)]
mod tests;
