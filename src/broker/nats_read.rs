//! `audit`'s reading of NATS JetStream: the ids of the messages the stream that
//! captures a subject received from a time on, in stream order, read with the relay's
//! own connection settings through an ordered consumer that acknowledges nothing.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use futures::StreamExt;

use super::nats::{NatsSettings, connect_options};
use super::probe::TIMEOUT;
use crate::broker::ReadError;

/// How long the read waits for the next message before taking the stream as read.
const QUIET: Duration = Duration::from_secs(5);

/// The `id` header of every message on `subject` that its stream received at or after
/// `since`, up to the stream's end when the read began, in stream order. A message
/// without an `id` header (not the relay's) is left out.
pub async fn ids_since(
    n: &NatsSettings,
    subject: &str,
    since: SystemTime,
) -> Result<Vec<String>, ReadError> {
    let options = connect_options(n)
        .await
        .map_err(|e| ReadError::failed("NATS", "connection settings", e))?
        .connection_timeout(TIMEOUT);
    let connecting = format!("connecting to {}", n.url);
    let client = tokio::time::timeout(TIMEOUT * 2, options.connect(n.url.as_str()))
        .await
        .map_err(|_| {
            ReadError::failed(
                "NATS",
                &connecting,
                format!("no answer within {:?}", TIMEOUT * 2),
            )
        })?
        .map_err(|e| ReadError::failed("NATS", &connecting, e))?;
    let jetstream = async_nats::jetstream::new(client);
    let name = jetstream
        .stream_by_subject(subject)
        .await
        .map_err(|_| ReadError::Missing {
            broker: "NATS",
            destination: format!("a JetStream stream capturing {subject}"),
        })?;
    let mut stream = jetstream
        .get_stream(&name)
        .await
        .map_err(|e| ReadError::failed("NATS", format!("stream {name}"), e))?;
    let last = stream
        .info()
        .await
        .map_err(|e| ReadError::failed("NATS", format!("stream {name}"), e))?
        .state
        .last_sequence;
    let nanos = since
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX));
    let start_time = async_nats::datetime::from_nanos(nanos)
        .map_err(|e| ReadError::failed("NATS", "the window's start", e))?;
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: subject.to_owned(),
            deliver_policy: DeliverPolicy::ByStartTime { start_time },
            ..OrderedConfig::default()
        })
        .await
        .map_err(|e| ReadError::failed("NATS", format!("reading stream {name}"), e))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| ReadError::failed("NATS", format!("reading stream {name}"), e))?;
    let mut ids = Vec::new();
    loop {
        let next = match tokio::time::timeout(QUIET, messages.next()).await {
            // Nothing more within the quiet time: the window is read.
            Err(_) | Ok(None) => break,
            Ok(Some(next)) => {
                next.map_err(|e| ReadError::failed("NATS", format!("reading stream {name}"), e))?
            }
        };
        let info = next
            .info()
            .map_err(|e| ReadError::failed("NATS", format!("reading stream {name}"), e))?;
        let (sequence, pending) = (info.stream_sequence, info.pending);
        if let Some(id) = next.headers.as_ref().and_then(|h| h.get("id")) {
            ids.push(id.as_str().to_owned());
        }
        if pending == 0 || sequence >= last {
            break;
        }
    }
    Ok(ids)
}
