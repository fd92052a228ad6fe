//! `spec.broker.kafka.kafkaRef`: a Strimzi `Kafka` cluster and, optionally, the
//! `KafkaUser` the relay logs in as, instead of a bootstrap address, `tls` and `sasl`
//! written by hand. What it stands for follows from Strimzi's naming alone (see
//! [`KafkaRef::resolve`]), so the controller, `render` and the relay agree without
//! reading the cluster; the controller then checks the cluster says the same
//! ([`crate::strimzi`]).

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{
    CaSecretRef, CertSecretRef, KeySecretRef, PasswordSecretRef, SaslMechanism, SaslSpec, TlsSpec,
};

/// A Strimzi Kafka cluster (`kafka.strimzi.io/v1beta2`) in the relay's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.user) || (!has(self.authentication) && !has(self.userSecretName))").message("spec.broker.kafka.kafkaRef: authentication and userSecretName describe a KafkaUser: set user too"))]
pub struct KafkaRef {
    /// The `Kafka` resource's name, in the relay's namespace. The relay connects to its
    /// bootstrap Service (`<name>-kafka-bootstrap.<namespace>.svc:<port>`) unless
    /// `bootstrapServers` names other addresses (an external listener), over TLS
    /// verified against the cluster CA (`ca.crt` of `<name>-cluster-ca-cert`).
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
    /// The port of the listener to use, as the Kafka resource declares it
    /// (`spec.kafka.listeners[].port`); default 9093. The listener must have
    /// `tls: true`, and with `user` the same authentication as the KafkaUser.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// A `KafkaUser` of this cluster to log in as; without it the relay connects
    /// without a client identity (a listener without authentication).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub user: Option<String>,
    /// How the KafkaUser authenticates, as its `spec.authentication.type` says: `tls`
    /// (a client certificate: `user.crt` and `user.key` of its Secret; the default) or
    /// `scram-sha-512` (its name and the `password` of its Secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authentication: Option<KafkaUserAuthentication>,
    /// The KafkaUser's Secret; default the user's name (the User Operator's naming
    /// without a Secret prefix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub user_secret_name: Option<String>,
    /// The Secret holding the cluster CA certificate (`ca.crt`); default
    /// `<name>-cluster-ca-cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub ca_secret_name: Option<String>,
}

fn default_port() -> u16 {
    9093
}

/// How a KafkaUser authenticates (`spec.authentication.type`), among those whose
/// Secret Strimzi writes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KafkaUserAuthentication {
    /// A client certificate signed by the clients CA.
    #[default]
    #[serde(rename = "tls")]
    Tls,
    /// SCRAM-SHA-512 with a generated password.
    #[serde(rename = "scram-sha-512")]
    ScramSha512,
}

impl KafkaUserAuthentication {
    /// The name Strimzi spells it with.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tls => "tls",
            Self::ScramSha512 => "scram-sha-512",
        }
    }
}

/// What a [`KafkaRef`] stands for.
#[derive(Clone, Debug, PartialEq)]
pub struct KafkaConnection {
    /// The bootstrap Service's address.
    pub bootstrap_servers: String,
    /// The cluster CA, and with a `tls` user its certificate and key.
    pub tls: TlsSpec,
    /// With a `scram-sha-512` user: its name and password.
    pub sasl: Option<SaslSpec>,
}

impl KafkaRef {
    /// The cluster's bootstrap Service.
    pub fn bootstrap_service(&self) -> String {
        format!("{}-kafka-bootstrap", self.name)
    }

    /// The Secret holding the cluster CA certificate.
    pub fn ca_secret(&self) -> String {
        self.ca_secret_name
            .clone()
            .unwrap_or_else(|| format!("{}-cluster-ca-cert", self.name))
    }

    /// The KafkaUser's Secret, when a user is named.
    pub fn user_secret(&self) -> Option<String> {
        let user = self.user.as_ref()?;
        Some(
            self.user_secret_name
                .clone()
                .unwrap_or_else(|| user.clone()),
        )
    }

    /// How the named user authenticates.
    pub fn authentication(&self) -> KafkaUserAuthentication {
        self.authentication.unwrap_or_default()
    }

    /// The connection it stands for, from a relay in `namespace`.
    pub fn resolve(&self, namespace: &str) -> KafkaConnection {
        let mut tls = TlsSpec {
            ca_secret_ref: Some(CaSecretRef::named(self.ca_secret())),
            ..TlsSpec::default()
        };
        let mut sasl = None;
        if let (Some(user), Some(secret)) = (&self.user, self.user_secret()) {
            match self.authentication() {
                KafkaUserAuthentication::Tls => {
                    tls.client_cert_secret_ref = Some(CertSecretRef {
                        name: secret.clone(),
                        key: "user.crt".to_owned(),
                    });
                    tls.client_key_secret_ref = Some(KeySecretRef {
                        name: secret,
                        key: "user.key".to_owned(),
                    });
                }
                KafkaUserAuthentication::ScramSha512 => {
                    sasl = Some(SaslSpec {
                        mechanism: SaslMechanism::ScramSha512,
                        username: Some(user.clone()),
                        username_secret_ref: None,
                        password_secret_ref: PasswordSecretRef::named(secret),
                    });
                }
            }
        }
        KafkaConnection {
            bootstrap_servers: format!(
                "{}.{namespace}.svc:{}",
                self.bootstrap_service(),
                self.port
            ),
            tls,
            sasl,
        }
    }
}

impl super::KafkaSpec {
    /// The spec as the relay uses it: with `kafkaRef`, its bootstrap address (unless
    /// `bootstrapServers` is given), TLS and login filled in; otherwise as written.
    pub fn resolved(&self, namespace: &str) -> Self {
        let Some(reference) = &self.kafka_ref else {
            return self.clone();
        };
        let connection = reference.resolve(namespace);
        let mut spec = self.clone();
        if spec.bootstrap_servers.trim().is_empty() {
            spec.bootstrap_servers = connection.bootstrap_servers;
        }
        spec.tls = Some(connection.tls);
        spec.sasl = connection.sasl;
        spec
    }
}

#[cfg(test)]
mod tests {
    use crate::api::KafkaSpec;

    fn kafka(yaml: &str) -> KafkaSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn a_tls_user_resolves_to_the_same_spec_as_its_secrets_written_by_hand() {
        let by_ref = kafka("kafkaRef: {name: events, user: orders-relay}").resolved("shop");
        let by_hand = kafka(
            "bootstrapServers: events-kafka-bootstrap.shop.svc:9093
tls:
  caSecretRef: {name: events-cluster-ca-cert}
  clientCertSecretRef: {name: orders-relay, key: user.crt}
  clientKeySecretRef: {name: orders-relay, key: user.key}",
        );
        assert_eq!(
            KafkaSpec {
                kafka_ref: None,
                ..by_ref
            },
            by_hand
        );
    }

    #[test]
    fn a_scram_user_logs_in_by_its_name_and_its_secrets_password() {
        let by_ref = kafka(
            "kafkaRef: {name: events, port: 9094, user: relay, authentication: scram-sha-512,
            userSecretName: kafka-relay, caSecretName: own-ca}",
        )
        .resolved("shop");
        let by_hand = kafka(
            "bootstrapServers: events-kafka-bootstrap.shop.svc:9094
tls: {caSecretRef: {name: own-ca}}
sasl: {mechanism: SCRAM-SHA-512, username: relay, passwordSecretRef: {name: kafka-relay}}",
        );
        assert_eq!(
            KafkaSpec {
                kafka_ref: None,
                ..by_ref
            },
            by_hand
        );
    }

    #[test]
    fn given_addresses_and_no_user_keep_the_cluster_ca_only() {
        let k = kafka("bootstrapServers: kafka.example.com:443\nkafkaRef: {name: events}")
            .resolved("shop");
        assert_eq!(k.bootstrap_servers, "kafka.example.com:443");
        assert_eq!(k.sasl, None);
        let tls = k.tls.unwrap();
        assert_eq!(
            tls.refs().map(|r| r.map(|r| (r.name, r.key))),
            [
                Some(("events-cluster-ca-cert".into(), "ca.crt".into())),
                None,
                None
            ]
        );
        // Without kafkaRef the spec is as written.
        let plain = kafka("bootstrapServers: k:9092");
        assert_eq!(plain.resolved("shop"), plain);
    }
}
