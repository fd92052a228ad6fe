//! NATS JetStream publisher: `Nats-Msg-Id` = row id, so JetStream drops a re-published
//! row within its duplicate window, and every publish waits for the stream's PubAck.

use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use futures::future::BoxFuture;

use super::{Broker, Message, PublishError};
use crate::spec::config::NatsSettings;

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
