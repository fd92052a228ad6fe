//! The `OutboxRelay` custom resource (`outbox.dev/v1alpha1`): spec, status, defaults and
//! the validation the API server enforces through the generated schema.
//!
//! Validation lives in the schema (patterns, ranges, enums, CEL rules) so that the API
//! server rejects a bad object before the controller ever sees it. The few checks that a
//! schema cannot express (a duration that parses but is zero, say) live in
//! [`OutboxRelaySpec::validate`], which the controller and `render` both call.

mod broker;
mod duration;
mod quantity;
mod status;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, ResourceRequirements, Toleration};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use broker::{
    AmqpAuthMechanism, Broker, BrokerSpec, KafkaSpec, NatsSpec, RabbitMqSpec, SaslMechanism,
    SaslSpec, TlsSpec,
};
pub use duration::{DurationError, parse_duration};
pub use quantity::{QuantityError, parse_bytes};
pub use status::{
    FallbackStatus, OutboxRelayStatus, PartitionsStatus, SlotLeftBehind, SlotLoss, SlotStatus,
};

/// The API group of every outbox-operator resource.
pub const GROUP: &str = "outbox.dev";

/// The annotation that lets a relay without `deleteAfterPublish` go on after its
/// replication slot was lost: set to `status.slot.lost.detectedAt`, it makes the operator
/// create a new slot, which streams only what commits after it. A value of an earlier
/// loss does not match a later one, so an annotation left behind never accepts a loss
/// nobody looked at.
pub const RECREATE_LOST_SLOT_ANNOTATION: &str = "outbox.dev/recreate-lost-slot";

/// The annotation that clears `status.slot.leftBehind` once the slot left in the database
/// the Secret no longer reaches is dropped there: set to its `detectedAt`.
pub const LEFT_BEHIND_SLOT_DROPPED_ANNOTATION: &str = "outbox.dev/left-behind-slot-dropped";

/// The annotation that lets a log-tailing relay without `deleteAfterPublish` go on after
/// what publishes its table changed (inserts in between may not have been streamed):
/// the identities the relay logged, comma-separated. It reaches the relay's settings,
/// so setting it rolls the relay's pods.
pub const ACCEPT_PUBLICATION_CHANGE_ANNOTATION: &str = "outbox.dev/accept-publication-change";

pub use crate::rules::{DURATION_PATTERN, IDENTIFIER_PATTERN, SLOT_NAME_PATTERN};

/// One OutboxRelay: publishes the committed rows of one outbox table to one broker.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "outbox.dev",
    version = "v1alpha1",
    kind = "OutboxRelay",
    plural = "outboxrelays",
    shortname = "obr",
    category = "outbox",
    namespaced,
    status = "OutboxRelayStatus",
    validation = Rule::new("self.metadata.name.size() <= 50 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must be a DNS label of at most 50 characters starting with a letter: it names the relay's Deployment and Service"),
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".status.mode"}"#,
    printcolumn = r#"{"name":"Broker","type":"string","jsonPath":".status.broker"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Backlog","type":"integer","jsonPath":".status.backlogRows"}"#,
    printcolumn = r#"{"name":"Oldest","type":"string","jsonPath":".status.oldestUnpublishedAge"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.mode.polling) && has(self.retention) && has(self.retention.publishedRows) && has(self.mode.polling.interval) && (!has(self.mode.polling.afterPublish) || self.mode.polling.afterPublish == 'mark')) || duration(self.retention.publishedRows) >= duration(self.mode.polling.interval)").message("spec.retention.publishedRows is shorter than the poll interval (keep published rows at least one poll interval)"))]
#[x_kube(validation = Rule::new("!(has(self.failure) && has(self.failure.onExhausted) && self.failure.onExhausted == 'deadLetter' && !has(self.failure.deadLetterTable)) || !has(self.table) || !has(self.table.name) || size(self.table.name) <= 51").message("spec.failure.deadLetterTable: the default <table>_dead_letter is longer than 63 characters: set spec.failure.deadLetterTable"))]
#[x_kube(validation = Rule::new("!(has(self.failure) && has(self.failure.deadLetterTable) && has(self.failure.onExhausted) && self.failure.onExhausted == 'deadLetter') || self.failure.deadLetterTable != (has(self.table) && has(self.table.name) ? self.table.name : 'outbox')").message("spec.failure.deadLetterTable is the outbox table itself: name another table for exhausted rows"))]
#[x_kube(validation = Rule::new("!has(self.table) || !has(self.table.additionalFields) || !self.table.additionalFields.exists(f, f.placement == 'partition') || has(self.broker.kafka)").message("spec.table.additionalFields: only Kafka has partitions; place the column as a header"))]
pub struct OutboxRelaySpec {
    /// The database that holds the outbox table.
    pub database: DatabaseSpec,
    /// The outbox table and how its columns map to message fields.
    #[serde(default)]
    pub table: TableSpec,
    /// How committed rows are found: exactly one of `polling` or `logTailing`.
    pub mode: ModeSpec,
    /// Where messages go: exactly one of `kafka`, `nats` or `rabbitmq`.
    pub broker: BrokerSpec,
    /// Per-aggregate ordering and how rows are spread over partitions.
    #[serde(default)]
    pub ordering: OrderingSpec,
    /// Number of relay pods. Log tailing runs one active consumer whatever this says
    /// (a replication slot admits one); the others stand by.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 64))]
    pub replicas: i32,
    /// How long published rows are kept (polling with `afterPublish: mark`).
    #[serde(default)]
    pub retention: RetentionSpec,
    /// What happens to a row that cannot be published.
    #[serde(default)]
    pub failure: FailureSpec,
    /// Prometheus alerting rules rendered for this relay.
    #[serde(default)]
    pub alerting: AlertingSpec,
    /// Overrides for the relay pods.
    #[serde(default, skip_serializing_if = "RelayPodSpec::is_empty")]
    pub relay: RelayPodSpec,
    /// How a row becomes a message, beyond the column mapping: the options of
    /// Debezium's outbox event router that are not column names.
    #[serde(default, skip_serializing_if = "MessageSpec::is_default")]
    pub message: MessageSpec,
    /// OpenTelemetry traces of publishing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<TracingSpec>,
}

/// OpenTelemetry traces: a span per published message, sent over OTLP.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TracingSpec {
    /// The collector's OTLP/HTTP base URL (`http://otel-collector.observability:4318`;
    /// plain HTTP): spans go to `<otlpEndpoint>/v1/traces` as OTLP JSON. Each span (kind producer,
    /// named `send <destination>`) lasts from sending to the broker's acknowledgement
    /// (an aggregate's later events of a batch, sent together, end together) and is a
    /// child of the message's `traceparent` header (a column placed as that
    /// header, with `tracestate`), so a trace continues from the request that wrote the
    /// row to the consumer.
    #[schemars(length(min = 1, max = 512))]
    pub otlp_endpoint: String,
    /// The spans' `service.name`.
    #[serde(default = "default_service_name")]
    #[schemars(length(min = 1, max = 255))]
    pub service_name: String,
}

fn default_service_name() -> String {
    "outbox-relay".to_owned()
}

/// How a row becomes a message.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MessageSpec {
    /// Debezium's `route.tombstone.on.empty.payload`. A row whose payload is NULL is
    /// always sent to Kafka as a tombstone (a record with a null value, which deletes
    /// its key from a compacted topic), as the router sends it; with this set, a
    /// payload that is empty or only whitespace is sent as a tombstone too. NATS and
    /// RabbitMQ have no tombstones: there such a row is a message with an empty body.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tombstone_on_empty_payload: bool,
    /// Debezium's `table.expand.json.payload`, for the envelope
    /// (`table.additionalFields` with `placement: envelope`): the payload is embedded
    /// as JSON, as stored, instead of as a string holding it. A payload that does not
    /// start with `{` or `[` or is not JSON stays a string, as the router keeps it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expand_json_payload: bool,
    /// Send each row as a CloudEvents 1.0 event: `id` the row id, `source` the relay,
    /// `type` the event type column (a row without one is refused), `subject` the
    /// aggregate id, `time` the record timestamp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_events: Option<CloudEventsSpec>,
}

/// CloudEvents 1.0 on the wire.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CloudEventsSpec {
    /// `binary`: the payload as the body, attributes as headers (`ce_` for Kafka,
    /// `ce-` for NATS, `cloudEvents_` for RabbitMQ, per the protocol bindings);
    /// `structured`: the body is the event in JSON (`application/cloudevents+json`).
    #[serde(default)]
    pub mode: CloudEventsMode,
    /// The `source` attribute, a URI reference naming where events come from; default
    /// `/outboxrelays/<namespace>/<name>`. With the row id it identifies an event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub source: Option<String>,
    /// The `datacontenttype` attribute: the payload's media type.
    #[serde(default = "default_data_content_type")]
    #[schemars(length(min = 1, max = 255))]
    pub data_content_type: String,
}

fn default_data_content_type() -> String {
    "application/json".to_owned()
}

/// The CloudEvents content mode.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum CloudEventsMode {
    /// Attributes in headers, the payload as the body.
    #[default]
    Binary,
    /// The whole event as a JSON body.
    Structured,
}

impl MessageSpec {
    /// Whether every field has its default (the field is then left out when written).
    pub fn is_default(&self) -> bool {
        self == &Self::default()
    }
}

fn default_replicas() -> i32 {
    2
}

/// The database holding the outbox table: `postgres` (a connection URL Secret) or
/// `databaseRef` (a CloudNativePG cluster).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.postgres) != has(self.databaseRef)").message("spec.database: set exactly one of postgres and databaseRef"))]
pub struct DatabaseSpec {
    /// PostgreSQL reached through a connection URL Secret (with `wal_level=logical` for
    /// log tailing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postgres: Option<PostgresSpec>,
    /// A CloudNativePG `Cluster` (`postgresql.cnpg.io/v1`) in the relay's namespace,
    /// instead of `postgres`: the relay connects as the cluster's application user
    /// (the `uri` of its `<name>-app` Secret, which points at the `<name>-rw` Service),
    /// over TLS verified (`verify-full`) against the cluster's CA (`ca.crt` of
    /// `<name>-ca`). The controller checks the Cluster and its `-rw` Service exist and,
    /// for log tailing, that the cluster keeps `wal_level = logical` and synchronises
    /// logical slots to its standbys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_ref: Option<DatabaseRef>,
}

impl DatabaseSpec {
    /// How the relay reaches PostgreSQL: `postgres` as written, or what `databaseRef`
    /// stands for (see [`DatabaseRef::connection`]). With neither, a reference to no
    /// Secret, which the spec's checks refuse.
    pub fn postgres(&self) -> PostgresSpec {
        match (&self.postgres, &self.database_ref) {
            (Some(pg), _) => pg.clone(),
            (None, Some(r)) => r.connection(),
            (None, None) => PostgresSpec {
                connection_secret_ref: SecretKeyRef {
                    name: String::new(),
                    key: default_secret_key(),
                },
                ssl_mode: SslMode::default(),
                ca_secret_ref: None,
                client_cert_secret_ref: None,
                client_key_secret_ref: None,
            },
        }
    }
}

/// A PostgreSQL cluster managed by another operator.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.secretName) && has(self.userSecretName))").message("spec.database.databaseRef: secretName (a uri) and userSecretName (a username and password) exclude each other"))]
#[x_kube(validation = Rule::new("!has(self.database) || has(self.userSecretName)").message("spec.database.databaseRef.database goes with userSecretName (the app Secret's uri names its database)"))]
pub struct DatabaseRef {
    /// The kind of cluster: `Cluster` (CloudNativePG, `postgresql.cnpg.io/v1`).
    #[serde(default)]
    pub kind: DatabaseRefKind,
    /// The cluster's name, in the relay's namespace.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
    /// The Secret to connect with, by its `uri` key; default `<name>-app` (the
    /// application user CloudNativePG creates). Name it when the Cluster bootstraps its
    /// application user from a Secret of its own (`spec.bootstrap.initdb.secret.name`),
    /// or to connect as the superuser (`<name>-superuser`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub secret_name: Option<String>,
    /// A `kubernetes.io/basic-auth` Secret (`username`, `password`) to log in with
    /// instead: a CloudNativePG managed role's `passwordSecret` (a role with
    /// `replication: true` for log tailing). The relay then connects to the `-rw`
    /// Service (`<name>-rw.<namespace>:5432`) and `database`. Not with `secretName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub user_secret_name: Option<String>,
    /// With `userSecretName`: the database to connect to; default `app`
    /// (CloudNativePG's default application database).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub database: Option<String>,
    /// The Secret holding the server's CA (`ca.crt`); default `<name>-ca`. Name it when
    /// the Cluster brings its own (`spec.certificates.serverCASecret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub ca_secret_name: Option<String>,
}

/// A login from parts: the host, port and database the spec names, and a Secret's
/// user name and password (never in one URL Secret).
#[derive(Clone, Debug, PartialEq)]
pub struct Login {
    /// Host name.
    pub host: String,
    /// Port.
    pub port: u16,
    /// Database.
    pub dbname: String,
    /// The Secret key holding the user name.
    pub user: SecretKeyRef,
    /// The Secret key holding the password.
    pub password: SecretKeyRef,
}

impl Login {
    /// The connection URL, user name and password percent-encoded.
    pub fn url(&self, user: &str, password: &str) -> String {
        use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
        let enc = |s: &str| utf8_percent_encode(s.trim(), NON_ALPHANUMERIC).to_string();
        format!(
            "postgresql://{}:{}@{}:{}/{}",
            enc(user),
            enc(password),
            self.host,
            self.port,
            enc(&self.dbname)
        )
    }
}

/// The kinds of cluster `databaseRef` can name.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DatabaseRefKind {
    /// CloudNativePG's `Cluster` (`postgresql.cnpg.io/v1`).
    #[default]
    Cluster,
}

impl DatabaseRef {
    /// The Secret the relay connects with (its `uri` key).
    pub fn secret(&self) -> String {
        self.secret_name
            .clone()
            .unwrap_or_else(|| format!("{}-app", self.name))
    }

    /// The Secret holding the server's CA (its `ca.crt` key).
    pub fn ca_secret(&self) -> String {
        self.ca_secret_name
            .clone()
            .unwrap_or_else(|| format!("{}-ca", self.name))
    }

    /// The read-write Service the cluster's `uri` points at.
    pub fn rw_service(&self) -> String {
        format!("{}-rw", self.name)
    }

    /// With `userSecretName`: where to log in (the `-rw` Service in `namespace`) and
    /// with which Secret's `username` and `password`.
    pub fn login(&self, namespace: &str) -> Option<Login> {
        let secret = self.user_secret_name.clone()?;
        Some(Login {
            host: format!("{}.{namespace}", self.rw_service()),
            port: 5432,
            dbname: self.database.clone().unwrap_or_else(|| "app".to_owned()),
            user: SecretKeyRef {
                name: secret.clone(),
                key: "username".to_owned(),
            },
            password: SecretKeyRef {
                name: secret,
                key: "password".to_owned(),
            },
        })
    }

    /// The connection it stands for: the Secret's `uri`, TLS verified against the
    /// cluster's CA (CloudNativePG's server certificates name the `-rw` Service). With
    /// `userSecretName` the reference is that Secret's `password` (the rest of the
    /// login is [`DatabaseRef::login`]).
    pub fn connection(&self) -> PostgresSpec {
        PostgresSpec {
            connection_secret_ref: match &self.user_secret_name {
                Some(secret) => SecretKeyRef {
                    name: secret.clone(),
                    key: "password".to_owned(),
                },
                None => SecretKeyRef {
                    name: self.secret(),
                    key: "uri".to_owned(),
                },
            },
            ssl_mode: SslMode::VerifyFull,
            ca_secret_ref: Some(SecretKeyRef {
                name: self.ca_secret(),
                key: "ca.crt".to_owned(),
            }),
            client_cert_secret_ref: None,
            client_key_secret_ref: None,
        }
    }
}

/// How to reach PostgreSQL.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.clientCertSecretRef) == has(self.clientKeySecretRef)").message("spec.database.postgres.clientCertSecretRef and clientKeySecretRef go together: set both, or neither"))]
#[x_kube(validation = Rule::new("!has(self.clientCertSecretRef) || !has(self.sslMode) || self.sslMode != 'disable'").message("spec.database.postgres.clientCertSecretRef needs TLS: set sslMode to verify-full (or require, verify-ca)"))]
pub struct PostgresSpec {
    /// The Secret key holding a connection URI (`postgres://user:password@host:5432/db`).
    /// The relay reads it from its environment; it never appears in a ConfigMap, log,
    /// event or status.
    pub connection_secret_ref: SecretKeyRef,
    /// TLS to the database, with libpq's meanings: `disable`, `prefer` (TLS when the
    /// server offers it, not verified), `require` (TLS, not verified), `verify-ca` (TLS,
    /// chain verified) or `verify-full` (TLS, chain and host name verified; recommended).
    /// Applies to every connection: the operator's, the relay's and its replication
    /// stream. It overrides an `sslmode` in the URL.
    #[serde(default)]
    pub ssl_mode: SslMode,
    /// A Secret key holding the CA certificate(s), PEM, that verify the server
    /// (`verify-ca`, `verify-full`); default the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
    /// A Secret key holding a client certificate (PEM), sent when the server asks for
    /// one (libpq's `sslcert`): for `cert` authentication in pg_hba.conf, or
    /// `clientcert=verify-full`. Needs an `sslMode` other than `disable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_secret_ref: Option<SecretKeyRef>,
    /// A Secret key holding the client certificate's private key (PEM, unencrypted;
    /// libpq's `sslkey`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_secret_ref: Option<SecretKeyRef>,
}

/// A key in a Secret in the relay's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
    /// Key within the Secret; `uri` when left out, for every reference.
    #[serde(default = "default_secret_key")]
    #[schemars(length(min = 1, max = 253), regex(pattern = "^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

fn default_secret_key() -> String {
    crate::rules::DEFAULT_SECRET_KEY.to_owned()
}

/// TLS mode for the database connection, as libpq names them.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS when the server offers it.
    #[default]
    Prefer,
    /// TLS, without verifying the server certificate.
    Require,
    /// TLS, verifying the certificate chain but not the host name.
    VerifyCa,
    /// TLS, verifying the certificate chain and the host name.
    VerifyFull,
}

/// The outbox table. The column defaults are Debezium's, so existing outbox tables work
/// unchanged.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TableSpec {
    /// Schema of the table.
    #[serde(default = "default_schema")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub schema: String,
    /// Name of the table.
    #[serde(default = "default_table")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub name: String,
    /// Which column holds which message field.
    #[serde(default)]
    pub columns: ColumnsSpec,
    /// Extra columns copied into message headers under the column's name, for example
    /// `traceparent`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(regex(pattern = IDENTIFIER_PATTERN)))]
    #[x_kube(validation = Rule::new("self.all(h, !(h in ['id', 'type', 'aggregateType']))").message("spec.table.headers may not name id, type or aggregateType: the relay sets those headers itself"))]
    pub headers: Vec<String>,
    /// Debezium's `table.fields.additional.placement`, one entry per
    /// `column:placement[:alias]`: more columns placed as headers (under another name
    /// than the column's, unlike `headers`), as fields of a JSON envelope around the
    /// payload, or as the Kafka partition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new("self.filter(f, f.placement == 'partition').size() <= 1").message("spec.table.additionalFields: at most one column sets the partition"))]
    pub additional_fields: Vec<AdditionalField>,
}

/// A column placed in the message (one item of Debezium's
/// `table.fields.additional.placement`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.placement != 'partition' || !has(self.as)").message("spec.table.additionalFields: a partition placement takes no alias (`as`)"))]
pub struct AdditionalField {
    /// The column.
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub column: String,
    /// Where the value goes.
    pub placement: Placement,
    /// The header or envelope field name; the column's name when left out.
    #[serde(default, rename = "as", skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = FIELD_NAME_PATTERN))]
    pub alias: Option<String>,
}

/// Where an additional column goes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Placement {
    /// A message header (text form; a NULL value sends no header).
    Header,
    /// A field of the JSON envelope the value becomes: `{"payload": …, "<as>": …}`,
    /// numbers and booleans as JSON numbers and booleans, other types as strings of
    /// their text form, NULL as `null`.
    Envelope,
    /// The Kafka partition (an integer column; NULL leaves it to the partitioner).
    Partition,
}

/// Names of headers and envelope fields.
pub const FIELD_NAME_PATTERN: &str = "^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$";

impl Default for TableSpec {
    fn default() -> Self {
        Self {
            schema: default_schema(),
            name: default_table(),
            columns: ColumnsSpec::default(),
            headers: Vec::new(),
            additional_fields: Vec::new(),
        }
    }
}

fn default_schema() -> String {
    "public".to_owned()
}
fn default_table() -> String {
    "outbox".to_owned()
}

/// Column names of the outbox table.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ColumnsSpec {
    /// Debezium's `table.field.event.id`: the row id, a bigint that grows with
    /// insertion (`bigserial` or an identity column); it becomes the message id (the
    /// `id` header).
    #[serde(default = "col_id")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub id: String,
    /// Debezium's `route.by.field`: the aggregate type, `{aggregateType}` in topic,
    /// subject and routing-key templates.
    #[serde(default = "col_aggregate_type")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub aggregate_type: String,
    /// Debezium's `table.field.event.key`: the aggregate id, the message key, and what
    /// per-aggregate order is kept for.
    #[serde(default = "col_aggregate_id")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub aggregate_id: String,
    /// Debezium's `table.field.event.type`: the event type, sent as the `type` header
    /// (and the CloudEvents `type`).
    #[serde(default = "col_type")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub r#type: String,
    /// Debezium's `table.field.event.payload`: the payload (`jsonb`, `json`, `text` or
    /// `bytea`), sent as stored.
    #[serde(default = "col_payload")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub payload: String,
    /// Insertion time, used for the oldest-unpublished age and end-to-end lag.
    #[serde(default = "col_created_at")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub created_at: String,
    /// Publication time, set by polling with `afterPublish: mark`.
    #[serde(default = "col_published_at")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub published_at: String,
    /// Debezium's `table.field.event.timestamp`: a `timestamptz` or `timestamp`
    /// (read as UTC) column whose value becomes the record's timestamp (Kafka's record
    /// timestamp, RabbitMQ's `timestamp` property). Left out, the record carries the
    /// row's commit time in log tailing and its `createdAt` column in polling (the
    /// time of publishing when the table has none). A NULL value falls back the same
    /// way. Kafka's time-based retention goes by this time: records whose time is older
    /// than the topic's `retention.ms` (old events, a long backlog) are deleted soon
    /// after they are written, unless the topic has `message.timestamp.type=LogAppendTime`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub timestamp: Option<String>,
}

impl Default for ColumnsSpec {
    fn default() -> Self {
        Self {
            id: col_id(),
            aggregate_type: col_aggregate_type(),
            aggregate_id: col_aggregate_id(),
            r#type: col_type(),
            payload: col_payload(),
            created_at: col_created_at(),
            published_at: col_published_at(),
            timestamp: None,
        }
    }
}

fn col_id() -> String {
    "id".to_owned()
}
fn col_aggregate_type() -> String {
    "aggregatetype".to_owned()
}
fn col_aggregate_id() -> String {
    "aggregateid".to_owned()
}
fn col_type() -> String {
    "type".to_owned()
}
fn col_payload() -> String {
    "payload".to_owned()
}
fn col_created_at() -> String {
    "created_at".to_owned()
}
fn col_published_at() -> String {
    "published_at".to_owned()
}

/// How the relay finds committed rows. Exactly one field is set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.polling) != has(self.logTailing)").message("set exactly one of mode.polling and mode.logTailing"))]
pub struct ModeSpec {
    /// Poll the table for unpublished rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub polling: Option<PollingSpec>,
    /// Stream inserts from a logical replication slot (`pgoutput`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_tailing: Option<LogTailingSpec>,
}

/// The mode, as one value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode<'a> {
    /// Polling mode.
    Polling(&'a PollingSpec),
    /// Log-tailing mode.
    LogTailing(&'a LogTailingSpec),
}

impl ModeSpec {
    /// The one mode that is set. The schema guarantees exactly one; an object that
    /// bypassed it (set both) is read as polling, the mode that needs nothing in the
    /// database, and [`OutboxRelaySpec::validate`] reports it.
    pub fn get(&self) -> Option<Mode<'_>> {
        match (&self.polling, &self.log_tailing) {
            (Some(p), _) => Some(Mode::Polling(p)),
            (None, Some(l)) => Some(Mode::LogTailing(l)),
            (None, None) => None,
        }
    }
}

impl Mode<'_> {
    /// The mode's name as the spec spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Polling(_) => "polling",
            Mode::LogTailing(_) => "logTailing",
        }
    }
}

/// Polling mode settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PollingSpec {
    /// Time from one round of polls' start to the next (the longest a committed row
    /// waits to be looked at): a full batch polls again at once, within the round, and
    /// the round ends with a poll that does not fill a batch.
    #[serde(default = "default_interval")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1ms')").message("spec.mode.polling.interval must be at least 1ms"))]
    pub interval: String,
    /// Rows per batch (one transaction), at most: with large rows a batch takes fewer,
    /// about 2 MiB of payloads.
    #[serde(default = "default_batch_size")]
    #[schemars(range(min = 1, max = 10000))]
    pub batch_size: i32,
    /// What to do with a row once the broker acknowledged it.
    #[serde(default)]
    pub after_publish: AfterPublish,
    /// Batch loops each relay process runs at once, each on a database session of its
    /// own that owns its share of the partitions, so one loop's select and commit
    /// overlap another's publishing. Each is one more database connection; together
    /// they hold the same 2 MiB of payloads a single loop would. Worth 2 for a single
    /// replica; with several, each worker sees fewer aggregates per batch.
    #[serde(default = "default_workers", skip_serializing_if = "is_one")]
    #[schemars(range(min = 1, max = 16), extend("default" = 1))]
    pub workers: i32,
}

impl Default for PollingSpec {
    fn default() -> Self {
        Self {
            interval: default_interval(),
            batch_size: default_batch_size(),
            after_publish: AfterPublish::default(),
            workers: default_workers(),
        }
    }
}

fn default_interval() -> String {
    "500ms".to_owned()
}
fn default_batch_size() -> i32 {
    500
}
fn default_workers() -> i32 {
    1
}
/// The default worker count is left out of the relay's config, so a relay that does
/// not set it renders as before workers existed (and does not roll on upgrade).
#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_one(workers: &i32) -> bool {
    *workers == 1
}

/// What polling does with a published row.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum AfterPublish {
    /// Set the `publishedAt` column; `retention.publishedRows` deletes it later.
    #[default]
    Mark,
    /// Delete the row in the same transaction.
    Delete,
}

/// Log-tailing mode settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(oldSelf.slotName) == has(self.slotName)").message("logTailing.slotName cannot be added or removed once the relay tails the log: the slot would change and its position be lost"))]
#[x_kube(validation = Rule::new("has(oldSelf.publicationName) == has(self.publicationName)").message("logTailing.publicationName cannot be added or removed once the relay tails the log"))]
#[x_kube(validation = Rule::new("!has(self.maxRetainedWal) || !has(self.deleteAfterPublish) || self.deleteAfterPublish").message("spec.mode.logTailing.maxRetainedWal needs deleteAfterPublish: true (the fall back to polling finds the rows not yet published only when published rows leave the table)"))]
pub struct LogTailingSpec {
    /// Replication slot name; default `outbox_<namespace>_<name>`. Cannot change once
    /// set: a new name would abandon the old slot and its position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = SLOT_NAME_PATTERN))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("logTailing.slotName is immutable"))]
    pub slot_name: Option<String>,
    /// Publication name; default the slot name. Cannot change once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = SLOT_NAME_PATTERN))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("logTailing.publicationName is immutable"))]
    pub publication_name: Option<String>,
    /// How often an idle relay writes a heartbeat so the slot keeps advancing.
    #[serde(default = "default_heartbeat")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('100ms')").message("spec.mode.logTailing.heartbeatInterval must be at least 100ms"))]
    pub heartbeat_interval: String,
    /// Delete rows once published, so the table stays small (deletes are not published).
    #[serde(default = "default_true")]
    pub delete_after_publish: bool,
    /// A reconciliation sweep: now and then the relay looks in the table for rows older
    /// than `olderThan` (with `deleteAfterPublish`, rows the log tail should long have
    /// published and deleted: the publication was altered, the slot recreated) and
    /// publishes them, counting them in `outbox_relay_sweep_found_total`, which the
    /// `OutboxRelaySweepFoundRows` alert watches. Needs the `createdAt` column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<SweepSpec>,
    /// A WAL budget, as a Kubernetes quantity (`10Gi`): when the slot retains more WAL
    /// than this (the relay is stuck, the broker down for long), the operator switches
    /// the relay to polling the same table, drops the slot so the server's disk is safe,
    /// and returns to log tailing once the backlog is drained (and `returnAfter` has
    /// passed), with no event lost and per-aggregate order kept. Needs
    /// `deleteAfterPublish` (the table then holds exactly the rows not yet published).
    /// Absent: no budget; the `OutboxRelaySlotRetainedWalHigh` alert still warns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), regex(pattern = "^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$"))]
    #[x_kube(validation = Rule::new("!self.matches('^0+[A-Za-z]*$')").message("spec.mode.logTailing.maxRetainedWal must be positive"))]
    pub max_retained_wal: Option<String>,
    /// After a fall back to polling, the least time the relay polls before log tailing
    /// is tried again (each try creates the slot anew); default `5m`. Ignored without
    /// `maxRetainedWal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.mode.logTailing.returnAfter must be at least 1s"))]
    pub return_after: Option<String>,
    /// Physical replication slots of standbys that must hold a commit before the relay
    /// publishes it: an event is sent only once every named slot's `restart_lsn` (the
    /// position its standby flushed) has passed the commit. After a failover to one of
    /// them, no event is out for a commit the new primary lacks. PostgreSQL 17+ does
    /// the same server-side with `synchronized_standby_slots`; on 15 and 16 this is the
    /// way to fail over without phantom events. A named slot that is missing holds
    /// publishing back (logged, `outbox_relay_standby_wait_bytes`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(regex(pattern = SLOT_NAME_PATTERN)))]
    pub synchronized_standby_slots: Vec<String>,
}

/// The reconciliation sweep of a log-tailing relay.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SweepSpec {
    /// Time between sweeps.
    #[serde(default = "default_sweep_interval")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub interval: String,
    /// Age (by `createdAt`) from which a row still in the table counts as missed.
    #[serde(default = "default_sweep_older_than")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub older_than: String,
}

fn default_sweep_interval() -> String {
    "1m".to_owned()
}
fn default_sweep_older_than() -> String {
    "5m".to_owned()
}

impl Default for LogTailingSpec {
    fn default() -> Self {
        Self {
            slot_name: None,
            publication_name: None,
            heartbeat_interval: default_heartbeat(),
            delete_after_publish: true,
            sweep: None,
            max_retained_wal: None,
            return_after: None,
            synchronized_standby_slots: Vec::new(),
        }
    }
}

fn default_heartbeat() -> String {
    "30s".to_owned()
}
fn default_true() -> bool {
    true
}

/// Ordering of messages.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OrderingSpec {
    /// `perAggregate` keeps each aggregate's events in commit order; `none` publishes
    /// rows as they come.
    #[serde(default)]
    pub mode: OrderingMode,
    /// Rows map to partition `hash(aggregateId) mod partitions`; each partition is
    /// published by one relay process at a time, so partitions bound the parallelism.
    #[serde(default = "default_partitions")]
    #[schemars(range(min = 1, max = 1024))]
    pub partitions: i32,
}

impl Default for OrderingSpec {
    fn default() -> Self {
        Self {
            mode: OrderingMode::default(),
            partitions: default_partitions(),
        }
    }
}

fn default_partitions() -> i32 {
    4
}

/// Ordering modes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum OrderingMode {
    /// Each aggregate's events in commit order.
    #[default]
    PerAggregate,
    /// No order promised.
    None,
}

/// Retention of published rows.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RetentionSpec {
    /// Published rows older than this are deleted (polling with `afterPublish: mark`).
    #[serde(default = "default_retention")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.retention.publishedRows must be at least 1s"))]
    pub published_rows: String,
}

impl Default for RetentionSpec {
    fn default() -> Self {
        Self {
            published_rows: default_retention(),
        }
    }
}

fn default_retention() -> String {
    "24h".to_owned()
}

/// Handling of rows that cannot be published.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FailureSpec {
    /// Attempts before a row counts as exhausted.
    #[serde(default = "default_max_attempts")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_attempts: i32,
    /// `block` stops the row's partition (order kept); `deadLetter` moves the row to
    /// the dead-letter table and goes on.
    #[serde(default)]
    pub on_exhausted: OnExhausted,
    /// Dead-letter table (same schema); default `<table>_dead_letter`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = IDENTIFIER_PATTERN))]
    pub dead_letter_table: Option<String>,
}

impl Default for FailureSpec {
    fn default() -> Self {
        Self {
            max_attempts: default_max_attempts(),
            on_exhausted: OnExhausted::default(),
            dead_letter_table: None,
        }
    }
}

fn default_max_attempts() -> i32 {
    10
}

/// What happens to an exhausted row.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum OnExhausted {
    /// Stop the partition until the row can be published.
    #[default]
    Block,
    /// Move the row to the dead-letter table.
    DeadLetter,
}

/// Thresholds of the rendered alerting rules.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AlertingSpec {
    /// Render a PrometheusRule for this relay.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Alert when the oldest unpublished row is older than this.
    #[serde(default = "default_oldest_age")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.alerting.oldestUnpublishedAge must be at least 1s"))]
    pub oldest_unpublished_age: String,
    /// Alert when more rows than this wait to be published.
    #[serde(default = "default_backlog_rows")]
    #[schemars(range(min = 1))]
    pub backlog_rows: i64,
    /// Alert when the replication slot retains more WAL than this (log tailing), as a
    /// Kubernetes quantity (`512Mi`, `1Gi`).
    #[serde(default = "default_slot_wal")]
    #[schemars(length(max = 32), regex(pattern = "^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$"))]
    #[x_kube(validation = Rule::new("!self.matches('^0+[A-Za-z]*$')").message("spec.alerting.slotRetainedWal must be positive"))]
    pub slot_retained_wal: String,
}

impl Default for AlertingSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            oldest_unpublished_age: default_oldest_age(),
            backlog_rows: default_backlog_rows(),
            slot_retained_wal: default_slot_wal(),
        }
    }
}

fn default_oldest_age() -> String {
    "5m".to_owned()
}
fn default_backlog_rows() -> i64 {
    10_000
}
fn default_slot_wal() -> String {
    "1Gi".to_owned()
}

/// Overrides for the relay pods.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RelayPodSpec {
    /// Relay image; default the operator's own image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Container resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Log filter for the relay (`RUST_LOG` syntax), default `info`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub log_level: Option<String>,
    /// Extra pod labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_labels: BTreeMap<String, String>,
    /// Extra pod annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,
    /// Node selector.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Priority class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Service account the relay pods run as (they need no Kubernetes API access).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
}

impl RelayPodSpec {
    fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}
