//! The catalogue of Secret references: for each reference a relay may hold, the spec
//! field that names it, what it is for, how it reaches the relay process (an
//! environment variable or a mounted file) and what its value must look like.
//!
//! The Deployment builder wires Secrets into pods from this table, the controller checks
//! the referenced keys from it, the relay reads the values from it and `check` names
//! the local variables from it, so the four can never disagree.

use crate::api::SecretKeyRef;

/// Environment variable holding the PostgreSQL connection URI.
pub const ENV_DATABASE_URL: &str = "OUTBOX_DATABASE_URL";
/// The user name of a login from parts (`databaseRef.userSecretName`).
pub const ENV_DATABASE_USER: &str = "OUTBOX_DATABASE_USER";
/// Its password.
pub const ENV_DATABASE_PASSWORD: &str = "OUTBOX_DATABASE_PASSWORD";
/// Environment variable holding the RabbitMQ URI.
pub const ENV_RABBITMQ_URL: &str = "OUTBOX_RABBITMQ_URL";
/// Environment variable holding the Kafka SASL user name.
pub const ENV_KAFKA_SASL_USERNAME: &str = "OUTBOX_KAFKA_SASL_USERNAME";
/// Environment variable holding the Kafka SASL password.
pub const ENV_KAFKA_SASL_PASSWORD: &str = "OUTBOX_KAFKA_SASL_PASSWORD";
/// Where the broker's CA certificate (`tls.caSecretRef`) is mounted in a relay pod.
pub const BROKER_CA_PATH: &str = "/etc/outbox-relay/broker-tls/ca.crt";
/// Where the broker client certificate (`tls.clientCertSecretRef`) is mounted.
pub const BROKER_CLIENT_CERT_PATH: &str = "/etc/outbox-relay/broker-tls/tls.crt";
/// Where the broker client key (`tls.clientKeySecretRef`) is mounted.
pub const BROKER_CLIENT_KEY_PATH: &str = "/etc/outbox-relay/broker-tls/tls.key";
/// Outside a pod (`check`, tests), the variable naming a local copy of the broker's CA.
pub const ENV_BROKER_CA_FILE: &str = "OUTBOX_BROKER_CA_FILE";
/// Outside a pod, the variable naming a local copy of the broker client certificate.
pub const ENV_BROKER_CLIENT_CERT_FILE: &str = "OUTBOX_BROKER_CLIENT_CERT_FILE";
/// Outside a pod, the variable naming a local copy of the broker client key.
pub const ENV_BROKER_CLIENT_KEY_FILE: &str = "OUTBOX_BROKER_CLIENT_KEY_FILE";
/// Environment variable holding the NATS user name.
pub const ENV_NATS_USERNAME: &str = "OUTBOX_NATS_USERNAME";
/// Environment variable holding the NATS password.
pub const ENV_NATS_PASSWORD: &str = "OUTBOX_NATS_PASSWORD";
/// Environment variable holding the NATS token.
pub const ENV_NATS_TOKEN: &str = "OUTBOX_NATS_TOKEN";
/// Environment variable holding the NATS user nkey seed.
pub const ENV_NATS_NKEY_SEED: &str = "OUTBOX_NATS_NKEY_SEED";
/// Where the PostgreSQL client certificate is mounted in a relay pod.
pub const POSTGRES_CLIENT_CERT_PATH: &str = "/etc/outbox-relay/postgres-tls/tls.crt";
/// Where the PostgreSQL client key is mounted in a relay pod.
pub const POSTGRES_CLIENT_KEY_PATH: &str = "/etc/outbox-relay/postgres-tls/tls.key";
/// Outside a pod, the variable naming a local copy of the PostgreSQL client certificate.
pub const ENV_POSTGRES_CLIENT_CERT_FILE: &str = "OUTBOX_POSTGRES_CLIENT_CERT_FILE";
/// Outside a pod, the variable naming a local copy of the PostgreSQL client key.
pub const ENV_POSTGRES_CLIENT_KEY_FILE: &str = "OUTBOX_POSTGRES_CLIENT_KEY_FILE";
/// Where the NATS credentials file is mounted in a relay pod.
pub const NATS_CREDENTIALS_PATH: &str = "/etc/outbox-relay/nats/nats.creds";
/// Where the PostgreSQL CA certificate is mounted in a relay pod.
pub const POSTGRES_CA_PATH: &str = "/etc/outbox-relay/postgres-ca/ca.crt";
/// Outside a pod, the variable naming a local copy of the PostgreSQL CA.
pub const ENV_POSTGRES_CA_FILE: &str = "OUTBOX_POSTGRES_CA_FILE";
/// Outside a pod, the variable naming a local copy of the NATS credentials file.
pub const ENV_NATS_CREDENTIALS_FILE: &str = "OUTBOX_NATS_CREDENTIALS_FILE";

/// What a Secret is needed for, which decides the condition that reports a problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecretUse {
    /// The database connection (`DatabaseReady`).
    Database,
    /// The broker connection (`BrokerReady`).
    Broker,
}

/// How a Secret key reaches the relay process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// As this environment variable.
    Env(&'static str),
    /// As a file at this path; outside a pod the variable names a local copy.
    File {
        /// Path inside the pod.
        path: &'static str,
        /// Variable naming the file outside a pod.
        local_env: &'static str,
    },
}

/// What the value must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Content {
    /// A `postgres://` URL or a libpq key=value string.
    PostgresUrl,
    /// An `amqp://` or `amqps://` URI.
    AmqpUrl {
        /// An `amqp://` URI may carry a password (`allowPlaintextCredentials`).
        plaintext_credentials: bool,
    },
    /// Any non-empty text (a user name, a password, a creds file).
    Text,
    /// PEM certificates.
    Certificates,
    /// A PEM private key, unencrypted.
    PrivateKey,
    /// The user name of a login from parts.
    PostgresUser,
    /// The password of a login from parts.
    PostgresPassword,
}

/// One Secret reference of a relay.
#[derive(Clone, Debug, PartialEq)]
pub struct SecretSlot {
    /// The spec field holding the reference (`spec.database.postgres.connectionSecretRef`).
    pub field: &'static str,
    /// What it is for.
    pub purpose: SecretUse,
    /// The Secret and key.
    pub reference: SecretKeyRef,
    /// How the value reaches the relay.
    pub delivery: Delivery,
    /// What the value must be.
    pub content: Content,
}

impl SecretSlot {
    /// Checks a value read from the Secret; the message never quotes the value.
    pub fn check_value(&self, value: &str) -> Result<(), String> {
        let value = value.trim();
        if value.is_empty() {
            return Err(format!(
                "Secret {} key {} is empty",
                self.reference.name, self.reference.key
            ));
        }
        let ok = match self.content {
            Content::PostgresUrl => value.parse::<tokio_postgres::Config>().is_ok(),
            Content::AmqpUrl {
                plaintext_credentials,
            } => {
                if !plaintext_credentials && amqp_password_in_clear(value) {
                    return Err(format!(
                        "Secret {} key {} holds an amqp:// URI with a password, which would cross the network unencrypted: use amqps:// (and spec.broker.rabbitmq.tls), or set spec.broker.rabbitmq.allowPlaintextCredentials: true to accept that",
                        self.reference.name, self.reference.key
                    ));
                }
                value.starts_with("amqp://") || value.starts_with("amqps://")
            }
            Content::Text | Content::PostgresUser | Content::PostgresPassword => true,
            Content::Certificates => value.contains("-----BEGIN CERTIFICATE-----"),
            Content::PrivateKey => {
                value.contains("PRIVATE KEY-----") && !value.contains("ENCRYPTED PRIVATE KEY")
            }
        };
        if ok {
            return Ok(());
        }
        let wanted = match self.content {
            Content::PostgresUrl => {
                "a postgres:// URL or key=value connection string (postgres://user:password@host:5432/db)"
            }
            Content::AmqpUrl { .. } => "an amqp:// or amqps:// URI",
            Content::Text | Content::PostgresUser | Content::PostgresPassword => "text",
            Content::Certificates => "PEM certificates (-----BEGIN CERTIFICATE-----)",
            Content::PrivateKey => {
                "an unencrypted PEM private key (-----BEGIN PRIVATE KEY-----, RSA or EC)"
            }
        };
        Err(format!(
            "Secret {} key {} does not hold {wanted}",
            self.reference.name, self.reference.key
        ))
    }

    /// Reads the value inside a relay pod (or, for files, from the local copy a
    /// variable names outside one). `env` looks up environment variables.
    pub fn read(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
        match self.delivery {
            Delivery::Env(var) => env(var).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
                format!(
                    "environment variable {var} is not set or empty: set {var} to the value of Secret {} key {}",
                    self.reference.name, self.reference.key
                )
            }),
            Delivery::File { path, local_env } => {
                let path = if std::path::Path::new(path).is_file() {
                    path.to_owned()
                } else {
                    env(local_env).ok_or_else(|| {
                        format!("{path} is not a file and {local_env} names no local copy")
                    })?
                };
                std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))
            }
        }
    }

    /// The path of a file delivery as the relay should open it: the pod path, or the
    /// local copy outside a pod. `None` for environment deliveries.
    pub fn file_path(&self, env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
        match self.delivery {
            Delivery::Env(_) => None,
            Delivery::File { path, local_env } => Some(
                if std::path::Path::new(path).is_file() {
                    Some(path.to_owned())
                } else {
                    env(local_env)
                }
                .unwrap_or_else(|| path.to_owned()),
            ),
        }
    }
}

/// Whether `uri` is a plain `amqp://` URI with a password in its user information.
fn amqp_password_in_clear(uri: &str) -> bool {
    let Some(rest) = uri.strip_prefix("amqp://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

/// The value of environment variable `name`, when set and not blank (how the CLI tools
/// and the relay read Secret values delivered as variables).
pub fn env_value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The database URL a CLI tool reads from variable `var`, or what to set.
pub fn database_url_from(var: &str) -> Result<String, String> {
    env_value(var).ok_or_else(|| format!("set {var} to the database URL the relay uses"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(content: Content) -> SecretSlot {
        SecretSlot {
            field: "spec.x",
            purpose: SecretUse::Database,
            reference: SecretKeyRef {
                name: "db".into(),
                key: "uri".into(),
            },
            delivery: Delivery::Env(ENV_DATABASE_URL),
            content,
        }
    }

    /// Every Secret reference of the CRD defaults its key the same way, and a manifest
    /// read offline (render, check, the relay's file) gets the same default.
    #[test]
    fn every_secret_reference_defaults_its_key_to_the_one_its_role_reads() {
        use kube::CustomResourceExt;
        fn walk(path: &str, node: &serde_json::Value, found: &mut Vec<(String, String)>) {
            if let Some(props) = node["properties"].as_object() {
                for (name, child) in props {
                    let here = format!("{path}.{name}");
                    if name.ends_with("SecretRef") {
                        let default = child["properties"]["key"]["default"]
                            .as_str()
                            .unwrap_or("<none>")
                            .to_owned();
                        found.push((here.clone(), default));
                    }
                    walk(&here, child, found);
                }
            }
        }
        let crd = serde_json::to_value(crate::api::OutboxRelay::crd()).unwrap();
        let mut found = Vec::new();
        walk(
            "spec",
            &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"],
            &mut found,
        );
        assert!(found.len() >= 6, "{found:?}");
        for (field, default) in &found {
            let role = [
                ("caSecretRef", "ca.crt"),
                ("clientCertSecretRef", "tls.crt"),
                ("clientKeySecretRef", "tls.key"),
                ("usernameSecretRef", "username"),
                ("passwordSecretRef", "password"),
            ]
            .into_iter()
            .find(|(suffix, _)| field.ends_with(suffix))
            .map_or(crate::rules::DEFAULT_SECRET_KEY, |(_, key)| key);
            assert_eq!(default, role, "{field}");
        }
        let offline: SecretKeyRef = serde_yaml::from_str("name: db").unwrap();
        assert_eq!(offline.key, crate::rules::DEFAULT_SECRET_KEY);
    }

    #[test]
    fn an_amqp_password_in_clear_is_refused_unless_allowed() {
        let strict = slot(Content::AmqpUrl {
            plaintext_credentials: false,
        });
        let err = strict
            .check_value("amqp://app:s3cret@mq:5672/%2f")
            .unwrap_err();
        assert!(
            err.contains("allowPlaintextCredentials") && !err.contains("s3cret"),
            "{err}"
        );
        assert!(strict.check_value("amqps://app:s3cret@mq:5671/%2f").is_ok());
        // No password to leak: the broker's default login, or a user name alone.
        assert!(strict.check_value("amqp://mq:5672/%2f").is_ok());
        assert!(strict.check_value("amqp://app@mq:5672/a@b").is_ok());
        let allowed = slot(Content::AmqpUrl {
            plaintext_credentials: true,
        });
        assert!(allowed.check_value("amqp://app:s3cret@mq:5672/%2f").is_ok());
    }

    #[test]
    fn values_are_checked_without_being_quoted() {
        let pg = slot(Content::PostgresUrl);
        assert!(pg.check_value("postgres://u:p@h:5432/d").is_ok());
        assert!(pg.check_value("host=h user=u").is_ok());
        let err = pg.check_value("mysql://u:s3cret@h/d").unwrap_err();
        assert!(!err.contains("s3cret"), "{err}");
        assert!(pg.check_value("  ").is_err());
        let amqp = slot(Content::AmqpUrl {
            plaintext_credentials: true,
        });
        assert!(amqp.check_value("amqps://u:p@h/v").is_ok());
        let err = amqp.check_value("http://u:s3cret@h").unwrap_err();
        assert!(!err.contains("s3cret"), "{err}");
    }
}
