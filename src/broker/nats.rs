//! NATS JetStream publisher: `Nats-Msg-Id` = row id, so JetStream drops a re-published
//! row within its duplicate window, and every publish waits for the stream's PubAck.

use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use futures::future::BoxFuture;

use super::AGGREGATE_TYPE_PLACEHOLDER;
use super::probe::{Probe, TIMEOUT};
use super::{Broker, Message, PublishError};
use crate::api::NatsSpec;
use crate::rules::{BrokerKind, Problems, check_secret_ref, check_template_into};
use crate::secrets::{
    Content, Delivery, ENV_NATS_CREDENTIALS_FILE, NATS_CREDENTIALS_PATH, SecretSlot, SecretUse,
};

/// Publishes to JetStream. The client reconnects by itself after an outage; publishes
/// made meanwhile time out and are retried by the relay.
pub struct NatsBroker {
    jetstream: async_nats::jetstream::Context,
}

impl NatsBroker {
    /// Starts connecting (in the background when the server is down at start).
    pub async fn new(config: &NatsSettings) -> Result<Self, PublishError> {
        let mut options = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .retry_on_initial_connect()
            .max_reconnects(None::<usize>);
        if let Some(path) = &config.credentials_file {
            options = options.credentials_file(path).await.map_err(|err| {
                PublishError::transient(format!("NATS: cannot read credentials file {path}: {err}"))
            })?;
        }
        let client = options
            .connect(config.url.as_str())
            .await
            .map_err(|err| PublishError::transient(format!("NATS: cannot connect: {err}")))?;
        let mut jetstream = async_nats::jetstream::new(client);
        jetstream.set_timeout(Duration::from_secs(5));
        Ok(Self { jetstream })
    }
}

impl Broker for NatsBroker {
    fn publish<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let mut publish = PublishMessage::build()
                .payload(message.payload.clone().into())
                .message_id(&message.id);
            for (key, value) in &message.headers {
                // Names are fixed or checked SQL identifiers; values were checked for
                // line breaks in build_message.
                publish = publish.header(key.as_str(), value.as_str());
            }
            let ack = self
                .jetstream
                .send_publish(message.destination.clone(), publish)
                .await
                .map_err(|err| match err.kind() {
                    PublishErrorKind::MaxPayloadExceeded => {
                        PublishError::row(format!("NATS: row {}: {err}", message.id))
                    }
                    _ => PublishError::transient(format!("NATS: {err}")),
                })?;
            // A missing stream (no responders) is retried as an outage, not counted
            // against the row: a JetStream server that is starting answers the same way.
            ack.await.map_err(|err| match err.kind() {
                PublishErrorKind::StreamNotFound => PublishError::transient(format!(
                    "NATS: no JetStream stream captures subject {}: {err}",
                    message.destination
                )),
                _ => PublishError::transient(format!("NATS: {err}")),
            })?;
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------------------------
// The spec's rules, Secrets and settings of a NATS relay, and `check`'s probe.

/// Every problem of a NATS spec.
pub fn check(n: &NatsSpec, p: &mut Problems) {
    if n.url.trim().is_empty() {
        p.push(
            "spec.broker.nats.url",
            "is empty",
            "name the server, nats://host:4222",
        );
    } else if n
        .url
        .split(',')
        .any(|u| !(u.trim().starts_with("nats://") || u.trim().starts_with("tls://")))
    {
        p.push(
            "spec.broker.nats.url",
            format!("`{}` is not a list of nats:// or tls:// URLs", n.url),
            "write nats://host:4222 (comma-separated for several servers)",
        );
    }
    check_template_into(p, BrokerKind::Nats, "spec.broker.nats.subject", &n.subject);
    if let Some(creds) = &n.credentials_secret_ref {
        check_secret_ref(
            p,
            "spec.broker.nats.credentialsSecretRef",
            &creds.name,
            &creds.key,
        );
    }
}

/// The Secret references of a NATS spec: the credentials file, mounted.
pub fn secrets(n: &NatsSpec) -> Vec<SecretSlot> {
    n.credentials_secret_ref
        .iter()
        .map(|creds| SecretSlot {
            field: "spec.broker.nats.credentialsSecretRef",
            purpose: SecretUse::Broker,
            reference: creds.clone(),
            delivery: Delivery::File {
                path: NATS_CREDENTIALS_PATH,
                local_env: ENV_NATS_CREDENTIALS_FILE,
            },
            content: Content::Text,
        })
        .collect()
}

/// NATS settings with the credentials file located.
#[derive(Clone, Debug)]
pub struct NatsSettings {
    /// Server URL(s).
    pub url: String,
    /// Subject template.
    pub subject: String,
    /// Credentials file.
    pub credentials_file: Option<String>,
}

/// The settings of a NATS spec, with the credentials file located (`file`, by field).
pub fn settings(n: &NatsSpec, file: &dyn Fn(&str) -> Option<String>) -> NatsSettings {
    NatsSettings {
        url: n.url.clone(),
        subject: n.subject.clone(),
        credentials_file: file("spec.broker.nats.credentialsSecretRef"),
    }
}

/// `check`'s questions to NATS: does it answer, and does a JetStream stream capture the
/// subject?
pub async fn probe(n: &NatsSettings) -> Vec<Probe> {
    let mut options = async_nats::ConnectOptions::new().connection_timeout(TIMEOUT);
    if let Some(path) = &n.credentials_file {
        options = match options.credentials_file(path).await {
            Ok(o) => o,
            Err(err) => {
                return vec![Probe::fail(
                    "broker",
                    format!("cannot read credentials file {path}: {err}"),
                )];
            }
        };
    }
    let client = match tokio::time::timeout(TIMEOUT * 2, options.connect(n.url.as_str())).await {
        Ok(Ok(c)) => c,
        Ok(Err(err)) => {
            return vec![Probe::fail(
                "broker",
                format!("cannot connect to NATS at {}: {err}", n.url),
            )];
        }
        Err(_) => {
            return vec![Probe::fail(
                "broker",
                format!("NATS at {} did not answer within {:?}", n.url, TIMEOUT * 2),
            )];
        }
    };
    let mut probes = vec![Probe::ok("broker", format!("NATS at {} answers", n.url))];
    let mut jetstream = async_nats::jetstream::new(client);
    jetstream.set_timeout(TIMEOUT);
    // A templated subject: any stream capturing some aggregate type's subject.
    let subject = n.subject.replace(AGGREGATE_TYPE_PLACEHOLDER, "*");
    probes.push(match jetstream.stream_by_subject(subject.clone()).await {
        Ok(stream) => Probe::ok(
            "stream",
            format!("JetStream stream {stream} captures subject {subject}"),
        ),
        Err(err) => Probe::fail(
            "stream",
            format!(
                "no JetStream stream captures subject {subject} ({err}): create one whose subjects cover it, with a duplicate window (the relay never creates streams)"
            ),
        ),
    });
    probes
}
