//! The OutboxRelay spec parsed once: [`parse`] turns a resource into a [`ValidRelay`]
//! or into every problem found, each with its field, what is wrong and how to fix it.
//!
//! This is the bottom layer both sides stand on. The controller parses before it
//! creates anything, `render` and `check` parse the manifest, and the relay parses the
//! config file the controller rendered from the same `ValidRelay` ([`config`]) with the
//! same function — so a spec the controller accepts is a spec the relay runs. The rules
//! the API server can enforce are also CEL rules and patterns on the CRD (`crate::api`),
//! with the same wording; this module holds every rule, including those.

pub mod config;
mod fields;
mod parse;

pub use parse::parse;

/// What an operator install lets an OutboxRelay choose for its pods (Helm values
/// `relayPolicy.*`). Both off by default: whoever may create an OutboxRelay must not
/// get a pod with another image, or another ServiceAccount's API rights, next to the
/// Secrets the relay names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// `spec.relay.image` is honoured.
    pub allow_image: bool,
    /// `spec.relay.serviceAccountName` is honoured.
    pub allow_service_account: bool,
    /// A relay may use only the Secrets carrying this label (`relayPolicy.secretLabel`):
    /// the namespace's owner opts each Secret in. `None`: any Secret of its namespace.
    pub secret_label: Option<(String, String)>,
}

impl Policy {
    /// The problems of a relay that asks for more than this install allows.
    pub fn check(&self, relay: &OutboxRelay) -> Vec<Problem> {
        let pod = &relay.spec.relay;
        let mut problems = Vec::new();
        if !self.allow_image && pod.image.as_deref().is_some_and(|i| !i.is_empty()) {
            problems.push(Problem {
                field: "spec.relay.image".to_owned(),
                message: "this operator's install does not let an OutboxRelay choose its image".to_owned(),
                fix: "remove it (relays run the operator's own image), or have the operator installed with relayPolicy.allowImage=true".to_owned(),
            });
        }
        if !self.allow_service_account && pod.service_account_name.is_some() {
            problems.push(Problem {
                field: "spec.relay.serviceAccountName".to_owned(),
                message: "this operator's install does not let an OutboxRelay choose its pods' ServiceAccount".to_owned(),
                fix: "remove it (relays need no Kubernetes API access), or have the operator installed with relayPolicy.allowServiceAccount=true".to_owned(),
            });
        }
        problems
    }

    /// The problem of a relay's reference (`field`) to Secret `name` in `namespace`,
    /// whose labels are `labels`, when this install opts Secrets in by label and this
    /// one is not.
    pub fn secret_problem(
        &self,
        field: &str,
        name: &str,
        namespace: &str,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Option<Problem> {
        let (key, value) = self.secret_label.as_ref()?;
        (labels.get(key) != Some(value)).then(|| Problem {
            field: field.to_owned(),
            message: format!(
                "Secret {name} is not open to relays: this operator's install lets a relay use only the Secrets labelled {key}={value}"
            ),
            fix: format!(
                "if relays may read it, label it (kubectl -n {namespace} label secret {name} {key}={value}; whoever may label Secrets in the namespace decides), or name a Secret that is"
            ),
        })
    }
}

use std::time::Duration;

use crate::api::{
    AfterPublish, KafkaSpec, NatsSpec, OutboxRelay, PollingSpec, RabbitMqSpec, SecretKeyRef,
    SslMode,
};
use crate::rules::BrokerKind;
use crate::secrets::{Content, Delivery, ENV_DATABASE_URL, SecretSlot, SecretUse};

pub use crate::rules::{Problem, Problems};

/// The outbox table's columns, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Columns {
    /// Row id (message id).
    pub id: String,
    /// Aggregate type (templates).
    pub aggregate_type: String,
    /// Aggregate id (message key, ordering).
    pub aggregate_id: String,
    /// Event type (header).
    pub event_type: String,
    /// Payload.
    pub payload: String,
    /// Insertion time (optional in the table).
    pub created_at: String,
    /// Publication time (polling with `afterPublish: mark`).
    pub published_at: String,
    /// The event's own time, when configured: the record timestamp.
    pub timestamp: Option<String>,
    /// What polling orders rows by, when the spec names it (`columns.order`).
    pub order: Option<String>,
}

impl Columns {
    /// The catalogue of columns: spec field, column name, whether every mode needs it.
    /// `createdAt` is optional in the table; `publishedAt` is needed by marking only.
    pub fn catalogue(&self) -> [(&'static str, &str, ColumnNeed); 7] {
        [
            ("spec.table.columns.id", &self.id, ColumnNeed::Always),
            (
                "spec.table.columns.aggregateType",
                &self.aggregate_type,
                ColumnNeed::Always,
            ),
            (
                "spec.table.columns.aggregateId",
                &self.aggregate_id,
                ColumnNeed::Always,
            ),
            (
                "spec.table.columns.type",
                &self.event_type,
                ColumnNeed::Always,
            ),
            (
                "spec.table.columns.payload",
                &self.payload,
                ColumnNeed::Always,
            ),
            (
                "spec.table.columns.createdAt",
                &self.created_at,
                ColumnNeed::Optional,
            ),
            (
                "spec.table.columns.publishedAt",
                &self.published_at,
                ColumnNeed::Marking,
            ),
        ]
    }
}

/// When a column must exist in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnNeed {
    /// In every mode.
    Always,
    /// Used when present.
    Optional,
    /// Polling with `afterPublish: mark`.
    Marking,
}

/// The outbox table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// Schema.
    pub schema: String,
    /// Table name.
    pub name: String,
    /// Columns.
    pub columns: Columns,
    /// Header columns.
    pub headers: Vec<String>,
    /// `table.additionalFields`, validated.
    pub additional: Vec<crate::api::AdditionalField>,
    /// Where published rows are moved instead of deleted (`spec.table.archive`,
    /// defaults filled in); `None`: they are deleted (or marked).
    pub archive: Option<Archive>,
}

/// The archive table, its names resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Archive {
    /// Schema.
    pub schema: String,
    /// Table name.
    pub name: String,
}

pub use crate::broker::Placed;

impl Table {
    /// `schema.name` with the default (Debezium's) column names, no extra column and no
    /// archive: a table looked at outside a relay (benchmarks, tools).
    pub fn named(schema: &str, name: &str) -> Self {
        let c = crate::api::ColumnsSpec::default();
        Self {
            schema: schema.to_owned(),
            name: name.to_owned(),
            columns: Columns {
                id: c.id,
                aggregate_type: c.aggregate_type,
                aggregate_id: c.aggregate_id,
                event_type: c.r#type,
                payload: c.payload,
                created_at: c.created_at,
                published_at: c.published_at,
                timestamp: c.timestamp,
                order: c.order,
            },
            headers: Vec::new(),
            additional: Vec::new(),
            archive: None,
        }
    }

    /// Every extra column and where it goes: `headers` (under the column's name), then
    /// `additionalFields`.
    pub fn placed(&self) -> Vec<Placed> {
        let headers = self.headers.iter().map(|h| Placed {
            column: h.clone(),
            placement: crate::api::Placement::Header,
            name: h.clone(),
        });
        let additional = self.additional.iter().map(|f| Placed {
            column: f.column.clone(),
            placement: f.placement,
            name: f.alias.clone().unwrap_or_else(|| f.column.clone()),
        });
        headers.chain(additional).collect()
    }

    /// The distinct extra columns the relay reads, in order.
    pub fn extra_columns(&self) -> Vec<String> {
        let mut columns: Vec<String> = Vec::new();
        for p in self.placed() {
            if !columns.contains(&p.column) {
                columns.push(p.column);
            }
        }
        columns
    }
}

/// Polling settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Polling {
    /// Pause after a poll that found less than a full batch.
    pub interval: Duration,
    /// Rows per batch.
    pub batch_size: i64,
    /// Mark, delete or archive.
    pub after_publish: AfterPublish,
    /// Batch loops per relay process, each on its own session.
    pub workers: usize,
}

/// Log-tailing settings, with the slot and publication names resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogTailing {
    /// Replication slot.
    pub slot: String,
    /// The spec names the slot (`slotName`), another than the default name (naming the
    /// default is the default, so the relay's own config file round-trips).
    pub slot_named: bool,
    /// Publication.
    pub publication: String,
    /// Heartbeat period of an idle relay.
    pub heartbeat: Duration,
    /// Delete rows once their commit is confirmed.
    pub delete_after_publish: bool,
    /// The reconciliation sweep, when configured.
    pub sweep: Option<Sweep>,
    /// The WAL budget, when configured.
    pub budget: Option<WalBudget>,
    /// Physical slots whose standbys must have flushed a commit before it is published.
    pub standby_slots: Vec<String>,
}

/// The WAL budget of a log-tailing relay: past it, the relay polls and the slot goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WalBudget {
    /// Retained WAL, bytes, beyond which the relay falls back to polling.
    pub max_retained_wal: u64,
    /// The least time on polling before log tailing is tried again.
    pub return_after: Duration,
}

/// The reconciliation sweep of a log-tailing relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sweep {
    /// Time between sweeps.
    pub interval: Duration,
    /// Age from which a row still in the table counts as missed.
    pub older_than: Duration,
}

/// The mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValidMode {
    /// Polling.
    Polling(Polling),
    /// Log tailing.
    LogTailing(LogTailing),
}

impl ValidMode {
    /// The mode's name as the spec spells it.
    pub fn name(&self) -> &'static str {
        match self {
            ValidMode::Polling(_) => "polling",
            ValidMode::LogTailing(_) => "logTailing",
        }
    }

    /// Log tailing's settings, if that is the mode.
    pub fn log_tailing(&self) -> Option<&LogTailing> {
        match self {
            ValidMode::LogTailing(l) => Some(l),
            ValidMode::Polling(_) => None,
        }
    }
}

/// The broker, with its spec as validated.
#[derive(Clone, Debug, PartialEq)]
pub enum ValidBroker {
    /// Kafka.
    Kafka(KafkaSpec),
    /// NATS JetStream.
    Nats(NatsSpec),
    /// RabbitMQ.
    RabbitMq(RabbitMqSpec),
}

impl ValidBroker {
    /// The broker's name as the spec spells it.
    pub fn name(&self) -> &'static str {
        self.kind_name().1
    }

    /// Which broker rules apply.
    pub fn kind(&self) -> BrokerKind {
        self.kind_name().0
    }

    fn kind_name(&self) -> (BrokerKind, &'static str) {
        match self {
            ValidBroker::Kafka(_) => (BrokerKind::Kafka, "kafka"),
            ValidBroker::Nats(_) => (BrokerKind::Nats, "nats"),
            ValidBroker::RabbitMq(_) => (BrokerKind::Amqp, "rabbitmq"),
        }
    }

    /// The destination template (topic, subject or routing key).
    pub fn template(&self) -> &str {
        match self {
            ValidBroker::Kafka(k) => &k.topic,
            ValidBroker::Nats(n) => &n.subject,
            ValidBroker::RabbitMq(r) => &r.routing_key,
        }
    }
}

/// Failure handling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Attempts before a row is exhausted.
    pub max_attempts: u32,
    /// The dead-letter table when exhausted rows move there; `None` blocks.
    pub dead_letter_table: Option<String>,
}

/// Alerting thresholds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alerting {
    /// Render a PrometheusRule.
    pub enabled: bool,
    /// Oldest unpublished age threshold.
    pub oldest_unpublished_age: Duration,
    /// Backlog threshold.
    pub backlog_rows: i64,
    /// Retained WAL threshold, bytes.
    pub slot_retained_wal_bytes: u64,
    /// The two thresholds as the spec writes them (`5m`, `10Gi`), for the alerts' text.
    pub as_written: (String, String),
}

/// An OutboxRelay that passed every rule. Only [`parse`] makes one, so a function that
/// takes it needs no checks of its own.
#[derive(Clone, Debug)]
pub struct ValidRelay {
    relay: OutboxRelay,
    /// Namespace (`default` for a manifest without one).
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The connection Secret and TLS mode (with a login from parts, its password key).
    pub connection: SecretKeyRef,
    /// A login from parts (`databaseRef.userSecretName`) instead of a URL Secret.
    pub login: Option<crate::api::Login>,
    /// TLS mode to PostgreSQL.
    pub ssl_mode: SslMode,
    /// The outbox table.
    pub table: Table,
    /// The mode.
    pub mode: ValidMode,
    /// The broker.
    pub broker: ValidBroker,
    /// Per-aggregate order.
    pub per_aggregate: bool,
    /// Partitions.
    pub partitions: i32,
    /// Retention of published rows (polling with mark).
    pub retention: Duration,
    /// Failure handling.
    pub failure: Failure,
    /// Alerting thresholds.
    pub alerting: Alerting,
    /// An empty or blank payload is sent as a tombstone too (a NULL one always is).
    pub tombstone_on_empty_payload: bool,
    /// The payload is embedded in the envelope as JSON.
    pub expand_json_payload: bool,
    /// CloudEvents on the wire, with the source resolved.
    pub cloud_events: Option<crate::broker::CloudEvents>,
    /// OpenTelemetry traces, when an OTLP endpoint is set.
    pub tracing: Option<Tracing>,
}

/// Where the relay sends its spans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tracing {
    /// OTLP/HTTP base URL.
    pub otlp_endpoint: String,
    /// `service.name`.
    pub service_name: String,
}

/// The spec field of the PostgreSQL CA reference.
pub const PG_CA_FIELD: &str = "spec.database.postgres.caSecretRef";
/// The spec field of the PostgreSQL client certificate reference.
pub const PG_CLIENT_CERT_FIELD: &str = "spec.database.postgres.clientCertSecretRef";
/// The spec field of the PostgreSQL client key reference.
pub const PG_CLIENT_KEY_FIELD: &str = "spec.database.postgres.clientKeySecretRef";

impl ValidRelay {
    /// How this relay turns rows into messages.
    pub fn shape(&self) -> crate::broker::Shape {
        crate::broker::Shape {
            placed: self.table.placed(),
            tombstone_on_empty_payload: self.tombstone_on_empty_payload,
            expand_json_payload: self.expand_json_payload,
            cloud_events: self.cloud_events.clone(),
            ..crate::broker::Shape::new(self.broker.kind(), self.broker.template())
        }
    }

    /// `metadata.uid` (none for a manifest not read from the API server).
    pub fn uid(&self) -> Option<&str> {
        self.relay.metadata.uid.as_deref()
    }

    /// `spec.relay`: the pods' image, resources and scheduling.
    pub fn pod(&self) -> &crate::api::RelayPodSpec {
        &self.relay.spec.relay
    }

    /// `spec.monitoring`: the labels of its ServiceMonitor and PrometheusRule.
    pub fn monitoring(&self) -> &crate::api::MonitoringSpec {
        &self.relay.spec.monitoring
    }

    /// `spec.broker.kafka.kafkaRef`: the Strimzi Kafka cluster, if the relay names one.
    pub fn kafka_ref(&self) -> Option<&crate::api::KafkaRef> {
        match &self.broker {
            ValidBroker::Kafka(k) => k.kafka_ref.as_ref(),
            _ => None,
        }
    }

    /// The dead-letter table's name (in the outbox table's schema):
    /// `spec.failure.deadLetterTable`, else `<table>_dead_letter`.
    pub fn dead_letter_table(&self) -> String {
        self.failure
            .dead_letter_table
            .clone()
            .unwrap_or_else(|| format!("{}_dead_letter", self.table.name))
    }

    /// The reference a Secret field was filled in from, when the user did not write
    /// it: `spec.broker.kafka.kafkaRef` for the Kafka TLS and SASL fields it gives.
    pub fn referenced_field(&self, field: &str) -> Option<&'static str> {
        (self.kafka_ref().is_some()
            && (field.starts_with("spec.broker.kafka.tls.")
                || field.starts_with("spec.broker.kafka.sasl.")))
        .then_some("spec.broker.kafka.kafkaRef")
    }

    /// `spec.database.databaseRef`: the CloudNativePG Cluster, if the relay names one.
    pub fn database_ref(&self) -> Option<&crate::api::DatabaseRef> {
        self.relay.spec.database.database_ref.as_ref()
    }

    /// What published the table when the operator first saw the slot with its
    /// publication (`status.slot.coverageBaseline`), for the relay's config.
    pub fn coverage_baseline(&self) -> Option<&str> {
        self.relay
            .status
            .as_ref()
            .and_then(|s| s.slot.as_ref())
            .and_then(|s| s.coverage_baseline.as_deref())
    }

    /// `spec.suspend`: no relay pod runs; the slot and publication stay.
    pub fn suspended(&self) -> bool {
        self.relay.spec.suspend
    }

    /// Pods the Deployment runs: none while suspended, else the spec's count, at most
    /// one for log tailing (a replication slot streams to one connection).
    pub fn effective_replicas(&self) -> i32 {
        if self.suspended() {
            return 0;
        }
        match self.mode {
            ValidMode::LogTailing(_) => self.relay.spec.replicas.min(1),
            ValidMode::Polling(_) => self.relay.spec.replicas,
        }
    }

    /// The polling relay that runs before log tailing starts on a new slot, to publish
    /// the rows committed before the slot existed (a slot streams only later commits):
    /// the same resource with `mode.polling` and `afterPublish: delete` instead, so the
    /// table keeps meaning "not published yet", as log tailing's `deleteAfterPublish`
    /// has it. `None` for polling, and for log tailing without `deleteAfterPublish`
    /// (there the table does not tell published rows from the others).
    pub fn backfill(&self) -> Option<ValidRelay> {
        let lt = self.mode.log_tailing()?;
        if !lt.delete_after_publish {
            return None;
        }
        let mut relay = self.relay.clone();
        relay.spec.mode.log_tailing = None;
        relay.spec.mode.polling = Some(PollingSpec {
            // Published rows leave the table as the tail's do: archived when it
            // archives them.
            after_publish: if self.table.archive.is_some() {
                AfterPublish::Archive
            } else {
                AfterPublish::Delete
            },
            ..PollingSpec::default()
        });
        parse(&relay).ok()
    }

    /// Whether this relay may take over the slot and position of another, gone relay
    /// in `namespace` whose marker names the same slot: a rename in the same namespace,
    /// or a slot this relay's spec names explicitly. Default slot names of two
    /// namespaces can be alike (`team-a/orders` and `team/a-orders` both default to
    /// `outbox_team_a_orders`), and that is no rename: the slot and its position are
    /// another relay's.
    pub fn may_take_over(&self, namespace: &str) -> bool {
        self.namespace == namespace || self.mode.log_tailing().is_some_and(|l| l.slot_named)
    }

    /// Every Secret reference of the relay, as the catalogue in [`secrets`] describes it.
    pub fn secrets(&self) -> Vec<SecretSlot> {
        let mut all = match &self.login {
            None => vec![SecretSlot {
                field: "spec.database.postgres.connectionSecretRef",
                purpose: SecretUse::Database,
                reference: self.connection.clone(),
                delivery: Delivery::Env(ENV_DATABASE_URL),
                content: Content::PostgresUrl,
            }],
            Some(login) => vec![
                SecretSlot {
                    field: "spec.database.databaseRef.userSecretName",
                    purpose: SecretUse::Database,
                    reference: login.user.clone(),
                    delivery: Delivery::Env(crate::secrets::ENV_DATABASE_USER),
                    content: Content::PostgresUser,
                },
                SecretSlot {
                    field: "spec.database.databaseRef.userSecretName",
                    purpose: SecretUse::Database,
                    reference: login.password.clone(),
                    delivery: Delivery::Env(crate::secrets::ENV_DATABASE_PASSWORD),
                    content: Content::PostgresPassword,
                },
            ],
        };
        let pg = self.relay.spec.database.postgres();
        let file = |field, reference: &SecretKeyRef, path, local_env, content| SecretSlot {
            field,
            purpose: SecretUse::Database,
            reference: reference.clone(),
            delivery: Delivery::File { path, local_env },
            content,
        };
        let [ca, cert, key] = pg.tls_refs();
        if let Some(ca) = &ca {
            all.push(file(
                PG_CA_FIELD,
                ca,
                crate::secrets::POSTGRES_CA_PATH,
                crate::secrets::ENV_POSTGRES_CA_FILE,
                Content::Certificates,
            ));
        }
        if let Some(cert) = &cert {
            all.push(file(
                PG_CLIENT_CERT_FIELD,
                cert,
                crate::secrets::POSTGRES_CLIENT_CERT_PATH,
                crate::secrets::ENV_POSTGRES_CLIENT_CERT_FILE,
                Content::Certificates,
            ));
        }
        if let Some(key) = &key {
            all.push(file(
                PG_CLIENT_KEY_FIELD,
                key,
                crate::secrets::POSTGRES_CLIENT_KEY_PATH,
                crate::secrets::ENV_POSTGRES_CLIENT_KEY_FILE,
                Content::PrivateKey,
            ));
        }
        all.extend(match &self.broker {
            ValidBroker::Kafka(k) => crate::broker::kafka::secrets(k),
            ValidBroker::Nats(n) => crate::broker::nats::secrets(n),
            ValidBroker::RabbitMq(r) => crate::broker::amqp::secrets(r),
        });
        all
    }
}

#[cfg(test)]
mod tests;
