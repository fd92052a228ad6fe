//! The relay's settings at run time: the config file parsed with the controller's own
//! [`crate::spec::parse`], plus the Secret values read as the catalogue names them and
//! the figures the loops use. The file format itself is `crate::spec::config`.

use std::time::Duration;

pub use crate::broker::BrokerSettings;
pub use crate::rules::default_slot_name;
use crate::secrets::Delivery;
pub use crate::secrets::ENV_DATABASE_URL;
pub use crate::spec::config::{CONFIG_PATH, ConfigError, HTTP_PORT, RelayConfig, Resolved};
use crate::spec::{LogTailing, ValidMode, ValidRelay};

/// A relay ready to run: spec parsed, secrets read. No `Debug`: it holds secrets.
#[derive(Clone)]
pub struct Settings {
    /// The parsed spec.
    pub valid: ValidRelay,
    /// Pause after a poll that found less than a full batch.
    pub interval: Duration,
    /// Rows per batch.
    pub batch_size: i64,
    /// Polling's batch loops per process, each on its own session (1 for log tailing).
    pub workers: usize,
    /// Age after which published rows are deleted.
    pub retention: Duration,
    /// Attempts before a row is exhausted.
    pub max_attempts: u32,
    /// Dead-letter table name (same schema as the outbox table); used only when
    /// exhausted rows move there.
    pub dead_letter_table: String,
    /// Address of the HTTP server.
    pub listen: std::net::SocketAddr,
    /// PostgreSQL URL (secret).
    pub database_url: String,
    /// Where the URL came from, for messages (never the URL itself).
    pub url_env: String,
    /// TLS to PostgreSQL: the spec's mode and the CA from its mounted file.
    pub pg_tls: crate::postgres::tls::PgTls,
    /// The mounted CA file, for the replication connection.
    pub pg_ca_file: Option<String>,
    /// The mounted client certificate and key files, for the replication connection.
    pub pg_client_files: Option<(String, String)>,
    /// The broker.
    pub broker: BrokerSettings,
    /// Log tailing's settings; `None` for a polling relay.
    pub log_tailing: Option<LogTailing>,
    /// Accepted changes of what publishes the outbox table (log tailing keeping rows).
    pub coverage_accepted: Vec<String>,
    /// What published the outbox table when the operator first saw the slot
    /// (`status.slot.coverageBaseline`, from the file beside the config file).
    pub coverage_baseline: Option<String>,
}

impl Settings {
    /// What happens to a row that exhausted its attempts.
    pub fn on_exhausted(&self) -> crate::api::OnExhausted {
        if self.valid.failure.dead_letter_table.is_some() {
            crate::api::OnExhausted::DeadLetter
        } else {
            crate::api::OnExhausted::Block
        }
    }

    /// Parses the file's spec and reads its Secret values from the process environment
    /// and mounted files.
    pub fn from_config(config: &RelayConfig) -> Result<Self, ConfigError> {
        Self::with_env(config, &|name| std::env::var(name).ok())
    }

    /// [`Settings::from_config`] with `env` looking up environment variables.
    pub fn with_env(
        config: &RelayConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let valid = config.parse()?;
        let listen =
            config
                .listen
                .parse::<std::net::SocketAddr>()
                .map_err(|_| ConfigError::Setting {
                    field: "listen".to_owned(),
                    message: format!("`{}` is not an address like 0.0.0.0:8080", config.listen),
                });
        // A Secret file is read where the config file says it is mounted; the
        // catalogue's fallback variable is answered with that path.
        let slots = valid.secrets();
        let env_or_file = |name: &str| {
            env(name).or_else(|| {
                slots
                    .iter()
                    .find(|s| matches!(s.delivery, Delivery::File { local_env, .. } if local_env == name))
                    .and_then(|s| config.secret_files.get(s.field).cloned())
            })
        };
        let resolved = Resolved::read(&valid, &env_or_file);
        // The replication connection opens the files itself; the others get the PEM.
        let path_of = |field: &str| {
            slots
                .iter()
                .find(|s| s.field == field)
                .and_then(|s| s.file_path(&env_or_file))
        };
        let pg_ca_file = path_of(crate::spec::PG_CA_FIELD);
        let pg_client_files = path_of(crate::spec::PG_CLIENT_CERT_FIELD)
            .zip(path_of(crate::spec::PG_CLIENT_KEY_FIELD));
        let pg_tls = crate::postgres::tls::PgTls::from_files(&valid, &env_or_file).map_err(
            |(field, message)| ConfigError::Setting {
                field: field.to_owned(),
                message,
            },
        )?;
        let (listen, resolved) = match (listen, resolved) {
            (Ok(l), Ok(r)) => (l, r),
            (Err(a), Err(b)) => return Err(ConfigError::Many(vec![a, b])),
            (Err(e), _) | (_, Err(e)) => return Err(e),
        };
        let (interval, batch_size, workers) = match &valid.mode {
            ValidMode::Polling(p) => (p.interval, p.batch_size, p.workers),
            ValidMode::LogTailing(_) => (Duration::from_millis(500), 500, 1),
        };
        Ok(Self {
            interval,
            batch_size,
            workers,
            retention: valid.retention,
            max_attempts: valid.failure.max_attempts,
            dead_letter_table: valid.dead_letter_table(),
            listen,
            database_url: resolved.database_url,
            url_env: ENV_DATABASE_URL.to_owned(),
            pg_tls,
            pg_ca_file,
            pg_client_files,
            broker: resolved.broker,
            log_tailing: valid.mode.log_tailing().cloned(),
            coverage_accepted: config.coverage_accepted.clone(),
            coverage_baseline: None,
            valid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bad_field_is_named_and_secrets_are_not_printed() {
        let yaml = "relay: {namespace: n, name: r}
spec:
  database: {postgres: {connectionSecretRef: {name: db}}}
  table: {name: \"bad-name\", headers: [\"id\"]}
  mode: {polling: {interval: 5x, batchSize: 0, workers: 17}}
  broker: {kafka: {bootstrapServers: k, topic: \"has space\", properties: {acks: \"1\"}}}
  ordering: {partitions: 0}
  retention: {publishedRows: 0s}
  failure: {maxAttempts: 0}
listen: nowhere
";
        let config: RelayConfig = serde_yaml::from_str(yaml).unwrap();
        let Err(err) = Settings::with_env(&config, &|_| Some("postgres://u:s3cret@h/d".into()))
        else {
            panic!("invalid config accepted");
        };
        let text = err.to_string();
        for field in [
            "spec.table.name",
            "spec.table.headers[0]",
            "spec.mode.polling.interval",
            "spec.mode.polling.batchSize",
            "spec.mode.polling.workers",
            "spec.broker.kafka.topic",
            "spec.broker.kafka.properties.acks",
            "spec.ordering.partitions",
            "spec.retention.publishedRows",
            "spec.failure.maxAttempts",
        ] {
            assert!(text.contains(field), "{field} missing from:\n{text}");
        }
        assert!(!text.contains("s3cret"), "{text}");
    }

    #[test]
    fn a_good_file_reads_its_secrets_from_the_catalogue() {
        let good = "relay: {namespace: n, name: r}
spec:
  database: {postgres: {connectionSecretRef: {name: db}}}
  mode: {polling: {}}
  broker: {rabbitmq: {urlSecretRef: {name: mq}, allowPlaintextCredentials: true, exchange: x, routingKey: \"{aggregateType}\"}}
listen: 127.0.0.1:0
";
        let config: RelayConfig = serde_yaml::from_str(good).unwrap();
        let env = |v: &str| match v {
            "OUTBOX_DATABASE_URL" => Some("postgres://u@h/d".to_owned()),
            "OUTBOX_RABBITMQ_URL" => Some("amqp://u:s3cret@h/v".to_owned()),
            _ => None,
        };
        let settings = Settings::with_env(&config, &env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(settings.batch_size, 500);
        assert_eq!(settings.workers, 1);
        assert_eq!(settings.dead_letter_table, "outbox_dead_letter");
        let BrokerSettings::RabbitMq(r) = &settings.broker else {
            panic!("not rabbitmq");
        };
        assert_eq!(r.url, "amqp://u:s3cret@h/v");
        let env = |v: &str| (v == "OUTBOX_DATABASE_URL").then(|| "postgres://u@h/d".to_owned());
        let Err(err) = Settings::with_env(&config, &env) else {
            panic!("a missing AMQP URL was accepted");
        };
        assert!(err.to_string().contains("OUTBOX_RABBITMQ_URL"), "{err}");
    }
}
