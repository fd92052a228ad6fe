//! The relay's configuration file: what the controller renders into the relay's
//! ConfigMap and what `outbox-operator relay --config FILE` reads.
//!
//! It is the OutboxRelay spec with every Secret reference replaced by the name of an
//! environment variable or a mounted file, so the file itself holds no secret. The
//! Deployment the controller builds maps those Secrets onto exactly these variables
//! and paths (see the constants below).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::api::{
    Broker, FailureSpec, ModeSpec, OrderingSpec, OutboxRelay, RetentionSpec, SaslMechanism,
    SslMode, TableSpec,
};

/// Where the relay pod mounts its configuration file.
pub const CONFIG_PATH: &str = "/etc/outbox-relay/relay.yaml";
/// Environment variable holding the PostgreSQL connection URI.
pub const ENV_DATABASE_URL: &str = "OUTBOX_DATABASE_URL";
/// Environment variable holding the RabbitMQ URI.
pub const ENV_RABBITMQ_URL: &str = "OUTBOX_RABBITMQ_URL";
/// Environment variables holding Kafka SASL credentials.
pub const ENV_KAFKA_SASL_USERNAME: &str = "OUTBOX_KAFKA_SASL_USERNAME";
/// See [`ENV_KAFKA_SASL_USERNAME`].
pub const ENV_KAFKA_SASL_PASSWORD: &str = "OUTBOX_KAFKA_SASL_PASSWORD";
/// Where the Kafka CA certificate Secret key is mounted.
pub const KAFKA_CA_PATH: &str = "/etc/outbox-relay/kafka-ca/ca.crt";
/// Where the NATS credentials Secret key is mounted.
pub const NATS_CREDENTIALS_PATH: &str = "/etc/outbox-relay/nats/nats.creds";
/// Port of the relay's HTTP server (`/metrics`, `/healthz`, `/readyz`).
pub const HTTP_PORT: u16 = 8080;

/// The whole relay configuration file.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RelayConfig {
    /// Which OutboxRelay this relay serves (labels metrics and logs).
    pub relay: RelayIdentity,
    /// The database.
    pub database: DatabaseConfig,
    /// The outbox table.
    #[serde(default)]
    pub table: TableSpec,
    /// Polling or log tailing.
    pub mode: ModeSpec,
    /// The broker.
    pub broker: BrokerConfig,
    /// Ordering and partitions.
    #[serde(default)]
    pub ordering: OrderingSpec,
    /// Retention of published rows.
    #[serde(default)]
    pub retention: RetentionSpec,
    /// Failure handling.
    #[serde(default)]
    pub failure: FailureSpec,
    /// Address of the HTTP server for metrics and probes.
    #[serde(default = "default_listen")]
    pub listen: String,
}

fn default_listen() -> String {
    format!("0.0.0.0:{HTTP_PORT}")
}

/// Namespace and name of the OutboxRelay.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RelayIdentity {
    /// Namespace of the OutboxRelay.
    pub namespace: String,
    /// Name of the OutboxRelay.
    pub name: String,
}

/// How the relay reaches PostgreSQL.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Environment variable holding the connection URI.
    #[serde(default = "default_database_env")]
    pub url_env: String,
    /// TLS mode.
    #[serde(default)]
    pub ssl_mode: SslMode,
}

fn default_database_env() -> String {
    ENV_DATABASE_URL.to_owned()
}

/// The broker: exactly one field is set.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BrokerConfig {
    /// Kafka.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaConfig>,
    /// NATS JetStream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsConfig>,
    /// RabbitMQ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rabbitmq: Option<RabbitMqConfig>,
}

/// Kafka producer settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KafkaConfig {
    /// `host:port` list.
    pub bootstrap_servers: String,
    /// Topic template with `{aggregateType}`.
    pub topic: String,
    /// CA certificate file; set when TLS is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<String>,
    /// TLS on (with the system roots when no CA file is given).
    #[serde(default)]
    pub tls: bool,
    /// SASL mechanism and the variables holding the credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl: Option<KafkaSaslConfig>,
    /// Extra librdkafka producer settings.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub properties: std::collections::BTreeMap<String, String>,
}

/// Kafka SASL settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KafkaSaslConfig {
    /// Mechanism.
    pub mechanism: SaslMechanism,
    /// Environment variable holding the user name.
    pub username_env: String,
    /// Environment variable holding the password.
    pub password_env: String,
}

/// NATS JetStream settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URL(s).
    pub url: String,
    /// Subject template with `{aggregateType}`.
    pub subject: String,
    /// Credentials file, when the spec names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_file: Option<String>,
}

/// RabbitMQ settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RabbitMqConfig {
    /// Environment variable holding the AMQP URI.
    #[serde(default = "default_rabbitmq_env")]
    pub url_env: String,
    /// Exchange.
    pub exchange: String,
    /// Routing-key template with `{aggregateType}`.
    pub routing_key: String,
}

fn default_rabbitmq_env() -> String {
    ENV_RABBITMQ_URL.to_owned()
}

/// A configuration that cannot be built or read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read relay config {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid YAML for this format; serde names the field.
    #[error("relay config {path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Why, with the field and position.
        source: serde_yaml::Error,
    },
    /// A field holds a value that cannot be used.
    #[error("relay config: {field}: {message}")]
    Invalid {
        /// The field, as a path (`mode.polling.interval`).
        field: String,
        /// What is wrong.
        message: String,
    },
    /// Several fields are invalid: one line each.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Many(Vec<ConfigError>),
}

impl RelayConfig {
    /// The configuration for an OutboxRelay, as the controller renders it.
    pub fn for_relay(relay: &OutboxRelay) -> Result<Self, ConfigError> {
        let spec = &relay.spec;
        let invalid = |field: &str, message: &str| ConfigError::Invalid {
            field: field.to_owned(),
            message: message.to_owned(),
        };
        let broker = match spec.broker.get() {
            Some(Broker::Kafka(k)) => BrokerConfig {
                kafka: Some(KafkaConfig {
                    bootstrap_servers: k.bootstrap_servers.clone(),
                    topic: k.topic.clone(),
                    tls: k.tls.is_some(),
                    tls_ca_file: k
                        .tls
                        .as_ref()
                        .and_then(|t| t.ca_secret_ref.as_ref())
                        .map(|_| KAFKA_CA_PATH.to_owned()),
                    sasl: k.sasl.as_ref().map(|s| KafkaSaslConfig {
                        mechanism: s.mechanism,
                        username_env: ENV_KAFKA_SASL_USERNAME.to_owned(),
                        password_env: ENV_KAFKA_SASL_PASSWORD.to_owned(),
                    }),
                    properties: k.properties.clone(),
                }),
                ..BrokerConfig::default()
            },
            Some(Broker::Nats(n)) => BrokerConfig {
                nats: Some(NatsConfig {
                    url: n.url.clone(),
                    subject: n.subject.clone(),
                    credentials_file: n
                        .credentials_secret_ref
                        .as_ref()
                        .map(|_| NATS_CREDENTIALS_PATH.to_owned()),
                }),
                ..BrokerConfig::default()
            },
            Some(Broker::RabbitMq(r)) => BrokerConfig {
                rabbitmq: Some(RabbitMqConfig {
                    url_env: ENV_RABBITMQ_URL.to_owned(),
                    exchange: r.exchange.clone(),
                    routing_key: r.routing_key.clone(),
                }),
                ..BrokerConfig::default()
            },
            None => {
                return Err(invalid(
                    "spec.broker",
                    "set exactly one of kafka, nats and rabbitmq",
                ));
            }
        };
        let mut mode = spec.mode.clone();
        if let Some(l) = mode.log_tailing.as_mut() {
            // The names the controller uses are fixed here, so relay and controller agree.
            let slot = slot_name(relay);
            l.publication_name.get_or_insert_with(|| slot.clone());
            l.slot_name = Some(slot);
        }
        Ok(Self {
            relay: RelayIdentity {
                namespace: relay.metadata.namespace.clone().unwrap_or_default(),
                name: relay.metadata.name.clone().unwrap_or_default(),
            },
            database: DatabaseConfig {
                url_env: ENV_DATABASE_URL.to_owned(),
                ssl_mode: spec.database.postgres.ssl_mode,
            },
            table: spec.table.clone(),
            mode,
            broker,
            ordering: spec.ordering.clone(),
            retention: spec.retention.clone(),
            failure: spec.failure.clone(),
            listen: default_listen(),
        })
    }

    /// Reads and parses a configuration file. Field-level checks are the caller's
    /// ([`RelayConfig::validate`]), so they can report every problem at once.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let display = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: display.clone(),
            source,
        })?;
        serde_yaml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: display,
            source,
        })
    }

    /// The file's text, as the ConfigMap holds it.
    pub fn to_yaml(&self) -> Result<String, serde_yaml::Error> {
        serde_yaml::to_string(self)
    }
}

/// The broker half of [`Settings`], with secrets resolved from the environment.
pub enum BrokerSettings {
    /// Kafka, with SASL user name and password when configured.
    Kafka {
        /// The file's settings.
        config: KafkaConfig,
        /// User name and password.
        sasl: Option<(String, String)>,
    },
    /// NATS JetStream.
    Nats(NatsConfig),
    /// RabbitMQ.
    RabbitMq {
        /// AMQP URI (secret).
        url: String,
        /// Exchange.
        exchange: String,
        /// Routing-key template.
        routing_key: String,
    },
}

/// A validated configuration: durations parsed, secrets read, limits checked. It has no
/// `Debug`, because it holds secrets.
pub struct Settings {
    /// The file as read.
    pub config: RelayConfig,
    /// Pause after a poll that found less than a full batch.
    pub interval: std::time::Duration,
    /// Rows per batch.
    pub batch_size: i64,
    /// Age after which published rows are deleted.
    pub retention: std::time::Duration,
    /// Attempts before a row is exhausted.
    pub max_attempts: u32,
    /// Dead-letter table name (same schema as the outbox table).
    pub dead_letter_table: String,
    /// Address of the HTTP server.
    pub listen: std::net::SocketAddr,
    /// PostgreSQL URL (secret).
    pub database_url: String,
    /// The broker.
    pub broker: BrokerSettings,
    /// Log tailing's settings; `None` for a polling relay.
    pub log_tailing: Option<LogTailingSettings>,
}

/// The validated `mode.logTailing` block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogTailingSettings {
    /// Replication slot (`^[a-z0-9_]{1,63}$`).
    pub slot: String,
    /// Publication (same rule).
    pub publication: String,
    /// Heartbeat period of an idle relay.
    pub heartbeat: std::time::Duration,
    /// Delete rows once their commit is confirmed.
    pub delete_after_publish: bool,
}

/// Librdkafka settings the relay fixes, so `properties` may not weaken or bypass them.
const FIXED_KAFKA_PROPERTIES: [&str; 5] = [
    "acks",
    "request.required.acks",
    "enable.idempotence",
    "security.protocol",
    "max.in.flight.requests.per.connection",
];

impl RelayConfig {
    /// Validates every field against the process environment.
    pub fn validate(&self) -> Result<Settings, ConfigError> {
        self.validate_with(|name| std::env::var(name).ok())
    }

    /// Validates every field; `env` looks up environment variables. Reports every
    /// problem, each naming its field.
    pub fn validate_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigError> {
        use crate::api::{Mode, OnExhausted, parse_duration};
        use crate::broker::{BrokerKind, check_template};
        use crate::postgres::check_identifier;
        use crate::postgres::replication::check_slot_name;

        let mut errors = Vec::new();
        let mut invalid = |field: &str, message: String| {
            errors.push(ConfigError::Invalid {
                field: field.to_owned(),
                message,
            })
        };
        if self.relay.namespace.is_empty() {
            invalid("relay.namespace", "must not be empty".to_owned());
        }
        if self.relay.name.is_empty() {
            invalid("relay.name", "must not be empty".to_owned());
        }
        let secret = |invalid: &mut dyn FnMut(&str, String), field: &str, var: &str| match env(var)
            .filter(|v| !v.is_empty())
        {
            Some(value) => value,
            None => {
                invalid(
                    field,
                    format!("environment variable {var} is not set or empty"),
                );
                String::new()
            }
        };
        let database_url = secret(&mut invalid, "database.urlEnv", &self.database.url_env);
        if matches!(
            self.database.ssl_mode,
            SslMode::Require | SslMode::VerifyFull
        ) {
            invalid(
                "database.sslMode",
                "TLS to PostgreSQL is not supported by this relay yet; use disable or prefer"
                    .to_owned(),
            );
        }
        let t = &self.table;
        let c = &t.columns;
        let identifiers = [
            ("table.schema", &t.schema),
            ("table.name", &t.name),
            ("table.columns.id", &c.id),
            ("table.columns.aggregateType", &c.aggregate_type),
            ("table.columns.aggregateId", &c.aggregate_id),
            ("table.columns.type", &c.r#type),
            ("table.columns.payload", &c.payload),
            ("table.columns.createdAt", &c.created_at),
            ("table.columns.publishedAt", &c.published_at),
        ];
        for (field, value) in identifiers {
            if let Err(message) = check_identifier(value) {
                invalid(field, message);
            }
        }
        for (i, header) in t.headers.iter().enumerate() {
            if let Err(message) = check_identifier(header) {
                invalid(&format!("table.headers[{i}]"), message);
            }
            if ["id", "type", "aggregateType"].contains(&header.as_str()) {
                invalid(
                    &format!("table.headers[{i}]"),
                    format!("`{header}` is a header the relay sets itself"),
                );
            }
        }
        let mut interval = std::time::Duration::from_millis(500);
        let mut batch_size = 500;
        let mut log_tailing = None;
        match self.mode.get() {
            Some(Mode::Polling(p)) => {
                match parse_duration(&p.interval) {
                    Ok(d) => interval = d,
                    Err(e) => invalid("mode.polling.interval", e.to_string()),
                }
                if !(1..=10_000).contains(&p.batch_size) {
                    invalid(
                        "mode.polling.batchSize",
                        format!("{} is not between 1 and 10000", p.batch_size),
                    );
                }
                batch_size = i64::from(p.batch_size);
            }
            Some(Mode::LogTailing(l)) => {
                let slot = l
                    .slot_name
                    .clone()
                    .unwrap_or_else(|| default_slot_name(&self.relay.namespace, &self.relay.name));
                let publication = l.publication_name.clone().unwrap_or_else(|| slot.clone());
                if let Err(message) = check_slot_name(&slot) {
                    invalid("mode.logTailing.slotName", message);
                }
                if let Err(message) = check_slot_name(&publication) {
                    invalid("mode.logTailing.publicationName", message);
                }
                let heartbeat = match parse_duration(&l.heartbeat_interval) {
                    Ok(d) if d >= std::time::Duration::from_millis(100) => d,
                    Ok(_) => {
                        invalid(
                            "mode.logTailing.heartbeatInterval",
                            "must be at least 100ms".to_owned(),
                        );
                        std::time::Duration::from_secs(30)
                    }
                    Err(e) => {
                        invalid("mode.logTailing.heartbeatInterval", e.to_string());
                        std::time::Duration::from_secs(30)
                    }
                };
                if self.failure.on_exhausted == crate::api::OnExhausted::DeadLetter {
                    invalid(
                        "failure.onExhausted",
                        "deadLetter is not supported with logTailing yet: a refused row blocks the stream (use block)"
                            .to_owned(),
                    );
                }
                log_tailing = Some(LogTailingSettings {
                    slot,
                    publication,
                    heartbeat,
                    delete_after_publish: l.delete_after_publish,
                });
            }
            None => invalid(
                "mode",
                "set exactly one of polling and logTailing".to_owned(),
            ),
        }
        if self.mode.polling.is_some() && self.mode.log_tailing.is_some() {
            invalid(
                "mode",
                "set exactly one of polling and logTailing".to_owned(),
            );
        }
        let broker = match (&self.broker.kafka, &self.broker.nats, &self.broker.rabbitmq) {
            (Some(k), None, None) => {
                if k.bootstrap_servers.trim().is_empty() {
                    invalid(
                        "broker.kafka.bootstrapServers",
                        "must not be empty".to_owned(),
                    );
                }
                if let Err(message) = check_template(BrokerKind::Kafka, &k.topic) {
                    invalid("broker.kafka.topic", format!("`{}` {message}", k.topic));
                }
                for key in k.properties.keys() {
                    if FIXED_KAFKA_PROPERTIES.contains(&key.as_str())
                        || key.starts_with("sasl.")
                        || key.starts_with("ssl.")
                        || key == "bootstrap.servers"
                    {
                        invalid(
                            &format!("broker.kafka.properties.{key}"),
                            "is fixed by the relay (delivery guarantees) or set through tls/sasl"
                                .to_owned(),
                        );
                    }
                }
                if let Some(ca) = &k.tls_ca_file
                    && !Path::new(ca).is_file()
                {
                    invalid(
                        "broker.kafka.tlsCaFile",
                        format!("{ca} is not a readable file"),
                    );
                }
                let sasl = k.sasl.as_ref().map(|s| {
                    (
                        secret(
                            &mut invalid,
                            "broker.kafka.sasl.usernameEnv",
                            &s.username_env,
                        ),
                        secret(
                            &mut invalid,
                            "broker.kafka.sasl.passwordEnv",
                            &s.password_env,
                        ),
                    )
                });
                Some(BrokerSettings::Kafka {
                    config: k.clone(),
                    sasl,
                })
            }
            (None, Some(n), None) => {
                if n.url.trim().is_empty() {
                    invalid("broker.nats.url", "must not be empty".to_owned());
                }
                if let Err(message) = check_template(BrokerKind::Nats, &n.subject) {
                    invalid("broker.nats.subject", format!("`{}` {message}", n.subject));
                }
                if let Some(path) = &n.credentials_file
                    && !Path::new(path).is_file()
                {
                    invalid(
                        "broker.nats.credentialsFile",
                        format!("{path} is not a readable file"),
                    );
                }
                Some(BrokerSettings::Nats(n.clone()))
            }
            (None, None, Some(r)) => {
                let url = secret(&mut invalid, "broker.rabbitmq.urlEnv", &r.url_env);
                if !url.is_empty() && !url.starts_with("amqp://") && !url.starts_with("amqps://") {
                    invalid(
                        "broker.rabbitmq.urlEnv",
                        format!("${} does not hold an amqp:// or amqps:// URI", r.url_env),
                    );
                }
                if r.exchange.len() > 255 {
                    invalid(
                        "broker.rabbitmq.exchange",
                        "is longer than 255 bytes".to_owned(),
                    );
                }
                if let Err(message) = check_template(BrokerKind::Amqp, &r.routing_key) {
                    invalid("broker.rabbitmq.routingKey", message);
                }
                Some(BrokerSettings::RabbitMq {
                    url,
                    exchange: r.exchange.clone(),
                    routing_key: r.routing_key.clone(),
                })
            }
            _ => {
                invalid(
                    "broker",
                    "set exactly one of kafka, nats and rabbitmq".to_owned(),
                );
                None
            }
        };
        if !(1..=1024).contains(&self.ordering.partitions) {
            invalid(
                "ordering.partitions",
                format!("{} is not between 1 and 1024", self.ordering.partitions),
            );
        }
        let retention = match parse_duration(&self.retention.published_rows) {
            Ok(d) => d,
            Err(e) => {
                invalid("retention.publishedRows", e.to_string());
                std::time::Duration::from_secs(86_400)
            }
        };
        let max_attempts = match u32::try_from(self.failure.max_attempts) {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => {
                invalid(
                    "failure.maxAttempts",
                    format!("{} is not between 1 and 1000", self.failure.max_attempts),
                );
                1
            }
        };
        let dead_letter_table = self
            .failure
            .dead_letter_table
            .clone()
            .unwrap_or_else(|| format!("{}_dead_letter", t.name));
        if self.failure.on_exhausted == OnExhausted::DeadLetter
            && let Err(message) = check_identifier(&dead_letter_table)
        {
            invalid("failure.deadLetterTable", message);
        }
        let listen = match self.listen.parse::<std::net::SocketAddr>() {
            Ok(addr) => Some(addr),
            Err(_) => {
                invalid(
                    "listen",
                    format!("`{}` is not an address like 0.0.0.0:8080", self.listen),
                );
                None
            }
        };
        match (broker, listen) {
            (Some(broker), Some(listen)) if errors.is_empty() => Ok(Settings {
                config: self.clone(),
                interval,
                batch_size,
                retention,
                max_attempts,
                dead_letter_table,
                listen,
                database_url,
                broker,
                log_tailing,
            }),
            _ => Err(ConfigError::Many(errors)),
        }
    }
}

/// The replication slot of a log-tailing relay: the spec's `slotName`, or
/// `outbox_<namespace>_<name>` made safe for PostgreSQL (lowercase letters, digits and
/// underscores, at most 63 bytes; a hash suffix keeps long names distinct).
pub fn slot_name(relay: &OutboxRelay) -> String {
    if let Some(name) = relay
        .spec
        .mode
        .log_tailing
        .as_ref()
        .and_then(|l| l.slot_name.clone())
    {
        return name;
    }
    default_slot_name(
        relay.metadata.namespace.as_deref().unwrap_or_default(),
        relay.metadata.name.as_deref().unwrap_or_default(),
    )
}

/// `outbox_<namespace>_<name>`, made safe for PostgreSQL (see [`slot_name`]).
pub fn default_slot_name(namespace: &str, name: &str) -> String {
    let raw = format!("outbox_{namespace}_{name}");
    let mut safe: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if safe.len() > 63 {
        // Namespace and name are each up to 63/253 characters; keep a readable prefix
        // and make the rest unique with a stable hash of the full name.
        let hash = fnv1a64(raw.as_bytes());
        safe.truncate(46);
        safe = format!("{safe}_{hash:016x}");
    }
    safe
}

/// FNV-1a: stable across releases and platforms, unlike `std`'s hasher.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relay(yaml: &str) -> OutboxRelay {
        serde_yaml::from_str(yaml).unwrap()
    }

    const LOG_TAILING_KAFKA: &str = r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: orders-db}}}
  mode: {logTailing: {}}
  broker: {kafka: {bootstrapServers: "kafka:9092", sasl: {mechanism: SCRAM-SHA-512, usernameSecretRef: {name: k, key: user}, passwordSecretRef: {name: k, key: pass}}}}
"#;

    #[test]
    fn secrets_become_variable_names_and_the_slot_is_named() {
        let config = RelayConfig::for_relay(&relay(LOG_TAILING_KAFKA)).unwrap();
        let yaml = config.to_yaml().unwrap();
        assert!(yaml.contains("urlEnv: OUTBOX_DATABASE_URL"), "{yaml}");
        assert!(
            yaml.contains("usernameEnv: OUTBOX_KAFKA_SASL_USERNAME"),
            "{yaml}"
        );
        let lt = config.mode.log_tailing.as_ref().unwrap();
        assert_eq!(lt.slot_name.as_deref(), Some("outbox_shop_orders"));
        assert_eq!(lt.publication_name.as_deref(), Some("outbox_shop_orders"));
        assert_eq!(
            config.broker.kafka.unwrap().topic,
            "outbox.event.{aggregateType}"
        );
    }

    #[test]
    fn log_tailing_fields_are_validated() {
        let yaml = |mode: &str| {
            format!(
                "relay: {{namespace: shop, name: orders}}
database: {{}}
mode: {{logTailing: {mode}}}
broker: {{nats: {{url: \"nats://n:4222\", subject: \"o.{{aggregateType}}\"}}}}
"
            )
        };
        let config: RelayConfig = serde_yaml::from_str(&yaml("{}")).unwrap();
        let settings = config
            .validate_with(|_| Some("postgres://u@h/db".into()))
            .unwrap_or_else(|e| panic!("{e}"));
        let lt = settings.log_tailing.unwrap();
        assert_eq!(lt.slot, "outbox_shop_orders");
        assert_eq!(lt.publication, "outbox_shop_orders");
        assert_eq!(lt.heartbeat, std::time::Duration::from_secs(30));
        assert!(lt.delete_after_publish);
        let bad = "{slotName: \"Bad-Slot\", publicationName: \"x;drop\", heartbeatInterval: 10ms}";
        let config: RelayConfig = serde_yaml::from_str(&yaml(bad)).unwrap();
        let Err(err) = config.validate_with(|_| Some("postgres://u@h/db".into())) else {
            panic!("invalid log tailing accepted");
        };
        let text = err.to_string();
        for field in [
            "mode.logTailing.slotName",
            "mode.logTailing.publicationName",
            "mode.logTailing.heartbeatInterval",
        ] {
            assert!(text.contains(field), "{field} missing from:\n{text}");
        }
    }

    #[test]
    fn the_file_round_trips() {
        let config = RelayConfig::for_relay(&relay(LOG_TAILING_KAFKA)).unwrap();
        let back: RelayConfig = serde_yaml::from_str(&config.to_yaml().unwrap()).unwrap();
        assert_eq!(back, config);
    }

    #[test]
    fn unknown_fields_are_named() {
        let err = serde_yaml::from_str::<RelayConfig>("relay: {namespace: a, name: b}\nbogus: 1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus"), "{err}");
    }

    #[test]
    fn slot_names_are_safe_and_distinct() {
        let mut r = relay(LOG_TAILING_KAFKA);
        r.metadata.namespace = Some("team-a".into());
        r.metadata.name = Some("Orders.v2".into());
        assert_eq!(slot_name(&r), "outbox_team_a_orders_v2");
        r.metadata.name = Some("x".repeat(200));
        let long_a = slot_name(&r);
        r.metadata.name = Some(format!("{}y", "x".repeat(199)));
        let long_b = slot_name(&r);
        assert!(long_a.len() <= 63 && long_b.len() <= 63);
        assert_ne!(long_a, long_b);
        let pattern = |s: &str| {
            s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        };
        assert!(pattern(&long_a));
    }

    #[test]
    fn every_bad_field_is_named_and_secrets_are_not_printed() {
        let yaml = "relay: {namespace: '', name: r}
database: {urlEnv: DB}
table: {name: \"bad-name\", headers: [\"id\"]}
mode: {polling: {interval: 5x, batchSize: 0}}
broker: {kafka: {bootstrapServers: k, topic: \"has space\", properties: {acks: \"1\"}}}
ordering: {partitions: 0}
retention: {publishedRows: 0s}
failure: {maxAttempts: 0}
listen: nowhere
";
        let config: RelayConfig = serde_yaml::from_str(yaml).unwrap();
        let Err(err) = config.validate_with(|_| None) else {
            panic!("invalid config accepted");
        };
        let text = err.to_string();
        for field in [
            "relay.namespace",
            "database.urlEnv",
            "table.name",
            "table.headers[0]",
            "mode.polling.interval",
            "mode.polling.batchSize",
            "broker.kafka.topic",
            "broker.kafka.properties.acks",
            "ordering.partitions",
            "retention.publishedRows",
            "failure.maxAttempts",
            "listen",
        ] {
            assert!(text.contains(field), "{field} missing from:\n{text}");
        }
        let good = "relay: {namespace: n, name: r}
database: {}
mode: {polling: {}}
broker: {rabbitmq: {exchange: x, routingKey: \"{aggregateType}\"}}
";
        let config: RelayConfig = serde_yaml::from_str(good).unwrap();
        let settings = config
            .validate_with(|v| Some(format!("amqp://u:s3cret@h/{v}")))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(settings.batch_size, 500);
        assert_eq!(settings.dead_letter_table, "outbox_dead_letter");
    }
}
