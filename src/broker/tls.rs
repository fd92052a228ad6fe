//! A broker's `tls` block, the same for Kafka, NATS and RabbitMQ: its Secret
//! references (mounted as files under one folder of the relay pod), their checks, and
//! the files as each client library takes them.

use crate::api::{SecretKeyRef, TlsSpec};
use crate::rules::{Problems, check_secret_ref};
use crate::secrets::{
    BROKER_CA_PATH, BROKER_CLIENT_CERT_PATH, BROKER_CLIENT_KEY_PATH, Content, Delivery,
    ENV_BROKER_CA_FILE, ENV_BROKER_CLIENT_CERT_FILE, ENV_BROKER_CLIENT_KEY_FILE, SecretSlot,
    SecretUse,
};

/// The spec fields of one broker's `tls` block.
#[derive(Clone, Copy, Debug)]
pub struct TlsFields {
    /// `…tls.caSecretRef`.
    pub ca: &'static str,
    /// `…tls.clientCertSecretRef`.
    pub cert: &'static str,
    /// `…tls.clientKeySecretRef`.
    pub key: &'static str,
}

/// Kafka's `tls` fields.
pub const KAFKA: TlsFields = TlsFields {
    ca: "spec.broker.kafka.tls.caSecretRef",
    cert: "spec.broker.kafka.tls.clientCertSecretRef",
    key: "spec.broker.kafka.tls.clientKeySecretRef",
};
/// NATS's `tls` fields.
pub const NATS: TlsFields = TlsFields {
    ca: "spec.broker.nats.tls.caSecretRef",
    cert: "spec.broker.nats.tls.clientCertSecretRef",
    key: "spec.broker.nats.tls.clientKeySecretRef",
};
/// RabbitMQ's `tls` fields.
pub const RABBITMQ: TlsFields = TlsFields {
    ca: "spec.broker.rabbitmq.tls.caSecretRef",
    cert: "spec.broker.rabbitmq.tls.clientCertSecretRef",
    key: "spec.broker.rabbitmq.tls.clientKeySecretRef",
};

fn refs(tls: &TlsSpec, fields: TlsFields) -> [(&'static str, Option<SecretKeyRef>); 3] {
    let [ca, cert, key] = tls.refs();
    [(fields.ca, ca), (fields.cert, cert), (fields.key, key)]
}

/// Every problem of a `tls` block.
pub fn check(tls: Option<&TlsSpec>, fields: TlsFields, p: &mut Problems) {
    let Some(tls) = tls else { return };
    for (field, reference) in refs(tls, fields) {
        if let Some(r) = reference {
            check_secret_ref(p, field, &r.name, &r.key);
        }
    }
    if tls.client_key_secret_ref.is_some() && tls.client_cert_secret_ref.is_none() {
        p.push(
            fields.key,
            "a client key without its certificate is never sent",
            "set clientCertSecretRef (its Secret's tls.key is the key when clientKeySecretRef is left out)",
        );
    }
}

/// The Secret references of a `tls` block: files under `/etc/outbox-relay/broker-tls`.
pub fn secrets(tls: Option<&TlsSpec>, fields: TlsFields) -> Vec<SecretSlot> {
    let Some(tls) = tls else {
        return Vec::new();
    };
    let places = [
        (BROKER_CA_PATH, ENV_BROKER_CA_FILE, Content::Certificates),
        (
            BROKER_CLIENT_CERT_PATH,
            ENV_BROKER_CLIENT_CERT_FILE,
            Content::Certificates,
        ),
        (
            BROKER_CLIENT_KEY_PATH,
            ENV_BROKER_CLIENT_KEY_FILE,
            Content::PrivateKey,
        ),
    ];
    refs(tls, fields)
        .into_iter()
        .zip(places)
        .filter_map(|((field, reference), (path, local_env, content))| {
            reference.map(|r| SecretSlot {
                field,
                purpose: SecretUse::Broker,
                reference: r.clone(),
                delivery: Delivery::File { path, local_env },
                content,
            })
        })
        .collect()
}

/// Where a relay finds its broker TLS files. Paths only: the files hold the key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA certificate(s); `None`: the system's roots.
    pub ca: Option<String>,
    /// Client certificate and key, for mutual TLS.
    pub client: Option<(String, String)>,
}

impl TlsFiles {
    /// The files of a `tls` block, located by `file` (by field).
    pub fn locate(fields: TlsFields, file: &dyn Fn(&str) -> Option<String>) -> Self {
        Self {
            ca: file(fields.ca),
            client: file(fields.cert).zip(file(fields.key)),
        }
    }

    /// A rustls configuration that verifies the server (chain and host name) and
    /// presents the client certificate when there is one.
    pub fn rustls_config(&self) -> Result<rustls::ClientConfig, crate::tls::TlsError> {
        let ca = self.ca.as_deref().map(crate::tls::read_pem).transpose()?;
        let identity = match &self.client {
            Some((cert, key)) => Some(crate::tls::Identity::from_pem(
                &crate::tls::read_pem(cert)?,
                &crate::tls::read_pem(key)?,
            )?),
            None => None,
        };
        crate::tls::verifying_client_config(ca.as_deref(), identity.as_ref())
    }
}
