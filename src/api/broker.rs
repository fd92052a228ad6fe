//! Where a relay's messages go: `spec.broker`, exactly one of Kafka, NATS JetStream and
//! RabbitMQ, with the schema rules the API server enforces for each.

use std::collections::BTreeMap;

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{
    CaSecretRef, CertSecretRef, KeySecretRef, PasswordSecretRef, SecretKeyRef, UsernameSecretRef,
};

/// Where messages go. Exactly one field is set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.kafka), has(self.nats), has(self.rabbitmq)].filter(x, x).size() == 1").message("set exactly one of broker.kafka, broker.nats and broker.rabbitmq"))]
pub struct BrokerSpec {
    /// Apache Kafka (or a Kafka-compatible broker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaSpec>,
    /// NATS with JetStream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsSpec>,
    /// RabbitMQ (AMQP 0-9-1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rabbitmq: Option<RabbitMqSpec>,
}

/// The broker, as one value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Broker<'a> {
    /// Kafka.
    Kafka(&'a KafkaSpec),
    /// NATS JetStream.
    Nats(&'a NatsSpec),
    /// RabbitMQ.
    RabbitMq(&'a RabbitMqSpec),
}

impl BrokerSpec {
    /// The one broker that is set, if exactly one is.
    pub fn get(&self) -> Option<Broker<'_>> {
        match (&self.kafka, &self.nats, &self.rabbitmq) {
            (Some(k), None, None) => Some(Broker::Kafka(k)),
            (None, Some(n), None) => Some(Broker::Nats(n)),
            (None, None, Some(r)) => Some(Broker::RabbitMq(r)),
            _ => None,
        }
    }
}

impl Broker<'_> {
    /// The broker's name as the spec spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Broker::Kafka(_) => "kafka",
            Broker::Nats(_) => "nats",
            Broker::RabbitMq(_) => "rabbitmq",
        }
    }
}

/// Apache Kafka. The producer is idempotent with `acks=all`; those cannot be overridden.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.sasl) || has(self.tls) || (has(self.allowPlaintextCredentials) && self.allowPlaintextCredentials)").message("spec.broker.kafka.sasl without tls sends the login unencrypted (SASL_PLAINTEXT): add tls, or set allowPlaintextCredentials: true to accept that"))]
#[x_kube(validation = Rule::new("has(self.bootstrapServers) || has(self.kafkaRef)").message("spec.broker.kafka: set bootstrapServers, or kafkaRef (a Strimzi Kafka cluster)"))]
#[x_kube(validation = Rule::new("!has(self.kafkaRef) || (!has(self.tls) && !has(self.sasl))").message("spec.broker.kafka.kafkaRef gives TLS and the login from the Strimzi cluster and KafkaUser: remove tls and sasl"))]
pub struct KafkaSpec {
    /// Comma-separated `host:port` list. With `kafkaRef`, default the cluster's
    /// bootstrap Service (`<name>-kafka-bootstrap.<namespace>.svc:<port>`); set it to
    /// reach the cluster through another listener's addresses.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(min = 1, max = 2048), regex(pattern = "\\S"))]
    pub bootstrap_servers: String,
    /// A Strimzi `Kafka` cluster in the relay's namespace, and the `KafkaUser` to log in
    /// as, instead of `tls` and `sasl`: the cluster CA and the user's Secret are read
    /// where Strimzi writes them. The controller checks the Kafka has a TLS listener on
    /// `port` whose authentication matches the user's, and that the KafkaUser belongs to
    /// the cluster and is ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka_ref: Option<super::KafkaRef>,
    /// Send the SASL login (`sasl` without `tls`: SASL_PLAINTEXT) over a connection without TLS. Off by default: anyone on the
    /// network path could read them. Set it only for a broker you cannot reach over TLS.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_plaintext_credentials: bool,

    /// Debezium's `route.topic.replacement`: the topic template; `{aggregateType}` (the
    /// router's `${routedByValue}`) is replaced by the row's aggregate type.
    #[serde(default = "default_kafka_topic")]
    #[schemars(length(min = 1, max = 249))]
    #[x_kube(validation = Rule::new("self.replace('{aggregateType}', 'Order').matches('^[A-Za-z0-9._-]{1,249}$')").message("spec.broker.kafka.topic must yield a valid Kafka topic (letters, digits, '.', '_', '-'; {aggregateType} is replaced by each row's aggregate type)"))]
    pub topic: String,
    /// TLS to the brokers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
    /// SASL authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl: Option<SaslSpec>,
    /// Extra librdkafka producer settings (for example `linger.ms`, `compression.type`
    /// `none`, `gzip`, `snappy`, `lz4` or `zstd`, the last for brokers and consumers of
    /// Kafka 2.1 or later). Settings that would weaken delivery
    /// (`acks`, `enable.idempotence`) and security settings (use `tls` and `sasl`) are
    /// rejected. A name or value librdkafka does not take (a Java client's setting,
    /// `compression.type: brotli`) or not beside the relay's producer (`queuing.strategy: lifo`),
    /// one that would break the relay's promises (`plugin.*`, `test.*`,
    /// `delivery.report.only.error`, `internal.termination.signal`) and, with
    /// per-aggregate order, a `partitioner` that scatters keys (`random`,
    /// `consistent_random`) make the relay `Ready=False` with reason `InvalidSpec` before
    /// its pods start. `message.timeout.ms` (or
    /// `delivery.timeout.ms`; default 20000, 0 waits for ever) is how long the relay
    /// waits for an event's acknowledgement before it replaces the producer and tries
    /// again; librdkafka's own timeout stays off, its retries unlimited and
    /// `enable.gapless.guarantee` on, whatever is set here, so that no event is ever
    /// written behind one of its aggregate that was given up. `linger.ms` (default 1)
    /// applies to a batch's first event of each aggregate and to an aggregate's other
    /// events of the batch, sent together once the first is acknowledged; a single next
    /// event goes at once through a second producer with the same settings. At most 128
    /// settings.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 128))]
    #[x_kube(validation = Rule::new("!self.exists(k, k in ['acks', 'request.required.acks', 'enable.idempotence', 'max.in.flight.requests.per.connection', 'max.in.flight', 'security.protocol', 'bootstrap.servers', 'metadata.broker.list', 'transactional.id', 'enable.ssl.certificate.verification', 'enable.sasl.oauthbearer.unsecure.jwt'] || k.startsWith('sasl.') || k.startsWith('ssl.') || k.startsWith('topic.'))").message("spec.broker.kafka.properties may not set acks, enable.idempotence, max.in.flight, security.protocol, bootstrap.servers, transactional.id, certificate verification, sasl.*, ssl.* or topic.* (under any of their names): delivery guarantees are fixed, use bootstrapServers, tls and sasl, and set topic settings without the topic. prefix"))]
    pub properties: BTreeMap<String, String>,
}

fn default_kafka_topic() -> String {
    "outbox.event.{aggregateType}".to_owned()
}

/// TLS to a broker. The server's certificate is always verified, host name included:
/// against the CA given here, else against the system's roots.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.clientKeySecretRef) || has(self.clientCertSecretRef)").message("tls.clientKeySecretRef needs tls.clientCertSecretRef: a key without its certificate is never sent"))]
pub struct TlsSpec {
    /// A Secret key holding the CA certificate(s) (PEM) that verify the server
    /// (`ca.crt` of a cert-manager Secret); default the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<CaSecretRef>,
    /// A Secret key holding the client certificate chain (PEM), for mutual TLS
    /// (`tls.crt` of a `kubernetes.io/tls` Secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_secret_ref: Option<CertSecretRef>,
    /// A Secret key holding the client's private key (PEM: PKCS#8, PKCS#1 or SEC1,
    /// unencrypted). Default: `tls.key` of the certificate's Secret, so one
    /// `kubernetes.io/tls` Secret named in `clientCertSecretRef` gives both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_secret_ref: Option<KeySecretRef>,
}

impl TlsSpec {
    /// The references: CA, client certificate, client key (resolved), each as set.
    pub fn refs(&self) -> [Option<SecretKeyRef>; 3] {
        super::secret_ref::tls_refs(
            self.ca_secret_ref.as_ref(),
            self.client_cert_secret_ref.as_ref(),
            self.client_key_secret_ref.as_ref(),
        )
    }
}

/// SASL credentials for Kafka: a user name (given, or from a Secret) and a password
/// from a Secret. A Strimzi `KafkaUser` with SCRAM: `username` is the KafkaUser's name,
/// `passwordSecretRef` names its Secret (key `password`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.username) != has(self.usernameSecretRef)").message("spec.broker.kafka.sasl: give the user name one way: username, or usernameSecretRef"))]
pub struct SaslSpec {
    /// SASL mechanism.
    pub mechanism: SaslMechanism,
    /// The user name (not a secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub username: Option<String>,
    /// Secret key holding the user name (instead of `username`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<UsernameSecretRef>,
    /// Secret key holding the password.
    pub password_secret_ref: PasswordSecretRef,
}

/// SASL mechanisms librdkafka supports with user name and password.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaslMechanism {
    /// PLAIN (use with TLS).
    #[serde(rename = "PLAIN")]
    Plain,
    /// SCRAM-SHA-256.
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    /// SCRAM-SHA-512.
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

/// NATS with JetStream. Core NATS has no acknowledgements, so publishing always goes
/// through JetStream: a stream must capture the subjects. At most one way to
/// authenticate: a credentials file, an nkey seed, a token, or a user name and password.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.credentialsSecretRef), has(self.nkeySeedSecretRef), has(self.tokenSecretRef), has(self.usernameSecretRef)].filter(x, x).size() <= 1").message("spec.broker.nats: authenticate one way: credentialsSecretRef, nkeySeedSecretRef, tokenSecretRef, or usernameSecretRef with passwordSecretRef"))]
#[x_kube(validation = Rule::new("has(self.usernameSecretRef) == has(self.passwordSecretRef)").message("spec.broker.nats.usernameSecretRef and passwordSecretRef go together"))]
#[x_kube(validation = Rule::new("!(has(self.usernameSecretRef) || has(self.tokenSecretRef)) || has(self.tls) || self.url.split(',').all(u, u.trim().startsWith('tls://')) || (has(self.allowPlaintextCredentials) && self.allowPlaintextCredentials)").message("spec.broker.nats: a password or token over a nats:// URL without tls may cross the network unencrypted: add tls (or tls:// URLs), or set allowPlaintextCredentials: true to accept that"))]
pub struct NatsSpec {
    /// Server URL(s), comma-separated (`nats://host:4222`).
    #[schemars(
        length(min = 1, max = 2048),
        regex(pattern = "^\\s*(nats|tls)://[^,]+(,\\s*(nats|tls)://[^,]+)*$")
    )]
    pub url: String,
    /// Send a password or token (`usernameSecretRef`, `tokenSecretRef` on `nats://` URLs without `tls`) over a connection without TLS. Off by default: anyone on the
    /// network path could read them. Set it only for a broker you cannot reach over TLS.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_plaintext_credentials: bool,
    /// Subject template; `{aggregateType}` is replaced by the row's aggregate type.
    #[serde(default = "default_nats_subject")]
    #[schemars(length(min = 1, max = 255))]
    #[x_kube(validation = Rule::new("self.replace('{aggregateType}', 'Order').matches('^[^\\\\s*>.]+([.][^\\\\s*>.]+)*$')").message("spec.broker.nats.subject must yield a valid NATS subject (no spaces, wildcards or empty tokens; {aggregateType} is replaced by each row's aggregate type)"))]
    pub subject: String,
    /// TLS to the servers (also used for `tls://` URLs; a `nats://` URL upgrades when
    /// the server asks for TLS). With `tls` set, TLS is required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
    /// A Secret key holding a NATS credentials file (`.creds`: user JWT and nkey seed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretKeyRef>,
    /// A Secret key holding a user nkey seed (`SU...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nkey_seed_secret_ref: Option<SecretKeyRef>,
    /// A Secret key holding an authentication token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,
    /// A Secret key holding the user name (with `passwordSecretRef`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<UsernameSecretRef>,
    /// A Secret key holding the password (with `usernameSecretRef`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<PasswordSecretRef>,
}

fn default_nats_subject() -> String {
    "outbox.{aggregateType}".to_owned()
}

/// RabbitMQ. Messages are persistent and published with publisher confirms.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.authMechanism) || self.authMechanism != 'EXTERNAL' || (has(self.tls) && has(self.tls.clientCertSecretRef))").message("spec.broker.rabbitmq.authMechanism EXTERNAL logs in with the client certificate: set tls.clientCertSecretRef and tls.clientKeySecretRef"))]
pub struct RabbitMqSpec {
    /// A Secret key holding the AMQP URI (`amqp://user:password@host:5672/vhost`, or
    /// `amqps://` for TLS).
    pub url_secret_ref: SecretKeyRef,
    /// Send the user name and password of an `amqp://` URI over a connection without TLS. Off by default: anyone on the
    /// network path could read them. Set it only for a broker you cannot reach over TLS.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_plaintext_credentials: bool,
    /// TLS settings for an `amqps://` URI: the CA that verifies the server and a client
    /// certificate for mutual TLS. The URI must be `amqps://` when this is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
    /// How the relay logs in: `PLAIN` (user and password of the URI, the default) or
    /// `EXTERNAL` (the client certificate's identity; RabbitMQ's
    /// `rabbitmq_auth_mechanism_ssl` plugin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth_mechanism: Option<AmqpAuthMechanism>,
    /// Exchange to publish to; it must exist.
    #[serde(default = "default_exchange")]
    #[schemars(length(max = 255))]
    pub exchange: String,
    /// Routing-key template; `{aggregateType}` is replaced by the row's aggregate type.
    #[serde(default = "default_routing_key")]
    #[schemars(length(max = 255))]
    pub routing_key: String,
}

/// How a relay logs in to RabbitMQ.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmqpAuthMechanism {
    /// User name and password from the URI.
    #[serde(rename = "PLAIN")]
    Plain,
    /// The TLS client certificate.
    #[serde(rename = "EXTERNAL")]
    External,
}

fn default_exchange() -> String {
    "outbox".to_owned()
}
fn default_routing_key() -> String {
    "{aggregateType}".to_owned()
}
