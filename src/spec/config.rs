//! The relay's configuration file: what the controller renders into the relay's
//! ConfigMap and what `outbox-operator relay --config FILE` reads.
//!
//! The file holds the relay's identity and its spec exactly as [`super::parse`]
//! normalised it (defaults filled in, slot and publication named). The relay turns the
//! file back into an OutboxRelay and parses it with the same function the controller
//! used, so a spec the controller accepted is one the relay runs. Secret references
//! stay references: values reach the pod as the environment variables and files the
//! catalogue in [`super::secrets`] names, never through this file.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Problems, ValidBroker, ValidRelay, parse};
use crate::api::{OutboxRelay, OutboxRelaySpec};
use crate::broker::{self, BrokerSettings};
use crate::secrets::{Content, Delivery, SecretSlot, SecretUse};

/// Where the relay pod mounts its configuration file.
pub const CONFIG_PATH: &str = "/etc/outbox-relay/relay.yaml";
/// Port of the relay's HTTP server (`/metrics`, `/healthz`, `/readyz`).
pub const HTTP_PORT: u16 = 8080;

/// The whole relay configuration file.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RelayConfig {
    /// Which OutboxRelay this relay serves (labels metrics and logs; names the slot).
    pub relay: RelayIdentity,
    /// The OutboxRelay's spec, as parsed.
    pub spec: OutboxRelaySpec,
    /// Where the pod mounts each Secret file, by the spec field that names the Secret
    /// (the catalogue's paths, written out so the file says where everything is).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub secret_files: std::collections::BTreeMap<String, String>,
    /// Address of the HTTP server for metrics and probes.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Log tailing keeping rows: changes of what publishes the outbox table that the
    /// user accepted (annotation [`crate::api::ACCEPT_PUBLICATION_CHANGE_ANNOTATION`]),
    /// by the identity the relay logged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub coverage_accepted: Vec<String>,
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

/// A configuration that cannot be read or used.
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
    /// The spec in the file breaks a rule (every problem is listed).
    #[error("relay config: invalid spec: {0}")]
    Invalid(#[from] Problems),
    /// A setting outside the spec cannot be used, or a Secret value is missing or wrong.
    #[error("relay config: {field}: {message}")]
    Setting {
        /// The field or variable.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// Several settings are unusable: one line each.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Many(Vec<ConfigError>),
}

impl RelayConfig {
    /// The file for a parsed relay. Fields the relay process does not read (replicas,
    /// suspend, alerting, pod overrides) are left at their defaults: the file's hash
    /// rolls the pods, and scaling or a new alert threshold must not restart them.
    pub fn for_relay(valid: &ValidRelay) -> Self {
        let mut spec = valid.relay.spec.clone();
        spec.replicas = 1;
        spec.suspend = false;
        spec.alerting = crate::api::AlertingSpec::default();
        spec.relay = crate::api::RelayPodSpec::default();
        let secret_files = valid
            .secrets()
            .into_iter()
            .filter_map(|s| match s.delivery {
                Delivery::File { path, .. } => Some((s.field.to_owned(), path.to_owned())),
                Delivery::Env(_) => None,
            })
            .collect();
        Self {
            relay: RelayIdentity {
                namespace: valid.namespace.clone(),
                name: valid.name.clone(),
            },
            spec,
            secret_files,
            listen: default_listen(),
            coverage_accepted: valid
                .relay
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(crate::api::ACCEPT_PUBLICATION_CHANGE_ANNOTATION))
                .map(|v| {
                    v.split_whitespace()
                        .flat_map(|v| v.split(','))
                        .filter(|v| !v.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// The OutboxRelay the file describes (identity and spec).
    pub fn to_relay(&self) -> OutboxRelay {
        let mut relay = OutboxRelay::new(&self.relay.name, self.spec.clone());
        relay.metadata.namespace = Some(self.relay.namespace.clone());
        relay
    }

    /// Parses the spec in the file with [`parse`], the controller's own function.
    pub fn parse(&self) -> Result<ValidRelay, ConfigError> {
        Ok(parse(&self.to_relay())?)
    }

    /// Reads and parses a configuration file (YAML shape only; [`RelayConfig::parse`]
    /// checks the spec).
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

/// The Secret values a relay process needs, read as the catalogue says.
pub struct Resolved {
    /// PostgreSQL URL (secret).
    pub database_url: String,
    /// The broker.
    pub broker: BrokerSettings,
}

impl Resolved {
    /// Reads every Secret value of `valid` (environment variables and files, through
    /// `env`) and checks each against its catalogue rule. Reports every problem.
    pub fn read(
        valid: &ValidRelay,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let values = read_values(valid, env, |_| true)?;
        let value = |content| {
            values
                .iter()
                .find(|(s, _)| s.content == content)
                .map(|(_, v)| v.clone())
        };
        let database_url = match &valid.login {
            Some(login) => login.url(
                &value(Content::PostgresUser).unwrap_or_default(),
                &value(Content::PostgresPassword).unwrap_or_default(),
            ),
            None => value(Content::PostgresUrl).unwrap_or_default(),
        };
        Ok(Self {
            database_url,
            broker: broker_from_values(valid, env, &values),
        })
    }
}

/// Reads the broker's Secret values only (for `check`, which takes the database URL from
/// a variable of the user's choice).
pub fn read_broker(
    valid: &ValidRelay,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<BrokerSettings, ConfigError> {
    let values = read_values(valid, env, |s| s.purpose == SecretUse::Broker)?;
    Ok(broker_from_values(valid, env, &values))
}

/// The broker's settings from Secret values read (`values`) and mounted files located
/// through `env`: each broker module turns its spec into its settings.
fn broker_from_values(
    valid: &ValidRelay,
    env: &dyn Fn(&str) -> Option<String>,
    values: &[(SecretSlot, String)],
) -> BrokerSettings {
    let value = |field: &str| {
        values
            .iter()
            .find(|(s, _)| s.field == field)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let secrets = valid.secrets();
    let file = |field: &str| {
        secrets
            .iter()
            .find(|s| s.field == field)
            .and_then(|s| s.file_path(env))
    };
    match &valid.broker {
        ValidBroker::Kafka(k) => BrokerSettings::Kafka(broker::kafka::settings(k, &value, &file)),
        ValidBroker::Nats(n) => BrokerSettings::Nats(broker::nats::settings(
            n,
            format!("{}/{}", valid.namespace, valid.name),
            &value,
            &file,
        )),
        ValidBroker::RabbitMq(r) => {
            BrokerSettings::RabbitMq(broker::amqp::settings(r, &value, &file))
        }
    }
}

/// Reads and checks the Secret values of the slots `wanted` selects; every problem.
fn read_values(
    valid: &ValidRelay,
    env: &dyn Fn(&str) -> Option<String>,
    wanted: impl Fn(&SecretSlot) -> bool,
) -> Result<Vec<(SecretSlot, String)>, ConfigError> {
    let mut errors = Vec::new();
    let mut values = Vec::new();
    for slot in valid.secrets().into_iter().filter(|s| wanted(s)) {
        let read = slot.read(env).and_then(|value| {
            slot.check_value(&value)?;
            Ok(value.trim().to_owned())
        });
        match read {
            Ok(value) => values.push((slot, value)),
            Err(message) => errors.push(ConfigError::Setting {
                field: slot.field.to_owned(),
                message,
            }),
        }
    }
    if errors.is_empty() {
        Ok(values)
    } else {
        Err(ConfigError::Many(errors))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG_TAILING_KAFKA: &str = r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: orders-db}}}
  mode: {logTailing: {}}
  broker: {kafka: {bootstrapServers: "kafka:9092", allowPlaintextCredentials: true, sasl: {mechanism: SCRAM-SHA-512, usernameSecretRef: {name: k, key: user}, passwordSecretRef: {name: k, key: pass}}}}
"#;

    fn valid() -> ValidRelay {
        let relay: OutboxRelay = serde_yaml::from_str(LOG_TAILING_KAFKA).unwrap();
        parse(&relay).unwrap()
    }

    #[test]
    fn the_file_names_the_slot_and_holds_no_secret_value() {
        let config = RelayConfig::for_relay(&valid());
        let yaml = config.to_yaml().unwrap();
        assert!(yaml.contains("slotName: outbox_shop_orders"), "{yaml}");
        assert!(
            yaml.contains("publicationName: outbox_shop_orders"),
            "{yaml}"
        );
        assert!(yaml.contains("name: orders-db"), "{yaml}");
    }

    #[test]
    fn the_file_round_trips_through_the_same_parse() {
        let v = valid();
        let config = RelayConfig::for_relay(&v);
        let back: RelayConfig = serde_yaml::from_str(&config.to_yaml().unwrap()).unwrap();
        assert_eq!(back, config);
        let reparsed = back.parse().unwrap();
        assert_eq!(reparsed.table, v.table);
        assert_eq!(reparsed.mode, v.mode);
        assert_eq!(reparsed.broker, v.broker);
    }

    #[test]
    fn an_accepted_publication_change_reaches_the_file_and_only_then() {
        assert!(
            RelayConfig::for_relay(&valid())
                .coverage_accepted
                .is_empty()
        );
        let mut relay: OutboxRelay = serde_yaml::from_str(LOG_TAILING_KAFKA).unwrap();
        relay.metadata.annotations = Some(
            [(
                crate::api::ACCEPT_PUBLICATION_CHANGE_ANNOTATION.to_owned(),
                "16391/732;16394/730, 16391/740;16399/741".to_owned(),
            )]
            .into(),
        );
        let config = RelayConfig::for_relay(&parse(&relay).unwrap());
        assert_eq!(
            config.coverage_accepted,
            ["16391/732;16394/730", "16391/740;16399/741"]
        );
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
    fn secrets_are_read_from_the_catalogue_and_checked() {
        let v = valid();
        let env = |name: &str| match name {
            "OUTBOX_DATABASE_URL" => Some("postgres://u:p@h/d".to_owned()),
            "OUTBOX_KAFKA_SASL_USERNAME" => Some("user".to_owned()),
            _ => None,
        };
        let Err(err) = Resolved::read(&v, &env) else {
            panic!("a missing password was accepted");
        };
        let text = err.to_string();
        assert!(
            text.contains("spec.broker.kafka.sasl.passwordSecretRef")
                && text.contains("OUTBOX_KAFKA_SASL_PASSWORD"),
            "{text}"
        );
        let env = |name: &str| match name {
            "OUTBOX_DATABASE_URL" => Some("postgres://u:p@h/d".to_owned()),
            _ => Some("x".to_owned()),
        };
        let resolved = Resolved::read(&v, &env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(resolved.database_url, "postgres://u:p@h/d");
        let BrokerSettings::Kafka(k) = resolved.broker else {
            panic!("not kafka");
        };
        assert!(k.sasl.is_some() && !k.tls);
    }

    #[test]
    fn a_login_from_parts_reads_its_user_and_password_and_makes_the_url() {
        let relay: OutboxRelay = serde_yaml::from_str(
            r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {databaseRef: {name: pg, userSecretName: relay-role, database: orders}}
  mode: {logTailing: {}}
  broker: {nats: {url: "nats://n:4222"}}
"#,
        )
        .unwrap();
        let v = parse(&relay).unwrap_or_else(|e| panic!("{e}"));
        let vars: Vec<_> = v
            .secrets()
            .iter()
            .filter(|s| s.purpose == crate::secrets::SecretUse::Database)
            .map(|s| {
                (
                    s.delivery,
                    s.reference.name.clone(),
                    s.reference.key.clone(),
                )
            })
            .collect();
        assert_eq!(
            vars,
            vec![
                (
                    Delivery::Env("OUTBOX_DATABASE_USER"),
                    "relay-role".to_owned(),
                    "username".to_owned()
                ),
                (
                    Delivery::Env("OUTBOX_DATABASE_PASSWORD"),
                    "relay-role".to_owned(),
                    "password".to_owned()
                ),
                (
                    Delivery::File {
                        path: crate::secrets::POSTGRES_CA_PATH,
                        local_env: crate::secrets::ENV_POSTGRES_CA_FILE
                    },
                    "pg-ca".to_owned(),
                    "ca.crt".to_owned()
                ),
            ]
        );
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let env = |name: &str| match name {
            "OUTBOX_DATABASE_USER" => Some("relay\n".to_owned()),
            "OUTBOX_DATABASE_PASSWORD" => Some("s3cr@t/:x".to_owned()),
            "OUTBOX_POSTGRES_CA_FILE" => Some(ca.display().to_string()),
            _ => None,
        };
        let resolved = Resolved::read(&v, &env).unwrap_or_else(|e| panic!("{e}"));
        let config: tokio_postgres::Config = resolved.database_url.parse().unwrap();
        assert_eq!(config.get_user(), Some("relay"));
        assert_eq!(config.get_password(), Some(&b"s3cr@t/:x"[..]));
        assert_eq!(config.get_dbname(), Some("orders"));
        assert_eq!(
            config.get_hosts(),
            &[tokio_postgres::config::Host::Tcp("pg-rw.shop".to_owned())]
        );
    }
}
