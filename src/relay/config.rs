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
    let namespace = relay.metadata.namespace.as_deref().unwrap_or_default();
    let name = relay.metadata.name.as_deref().unwrap_or_default();
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
}
