//! `audit`'s reading of RabbitMQ: a queue hands each message to one consumer and takes
//! it away, so what RabbitMQ received is read from a **stream** queue the user binds to
//! the relay's exchange as an audit tap (`x-queue-type: stream`, kept as long as the
//! windows audited). A stream is read without taking anything from it: from the
//! window's start (`x-stream-offset`) up to an end marker the read appends first, so
//! everything the stream held when the read began is read, and nothing after.
//!
//! A classic or quorum queue is never read: declaring the queue with
//! `x-queue-type: stream` must be accepted as equivalent, and the first delivery must
//! carry the stream's `x-stream-offset` header; otherwise the read stops before
//! acknowledging anything, and says why.

use std::time::{Duration, SystemTime};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection};

use super::amqp::{RabbitMqSettings, connect};
use super::probe::TIMEOUT;
use crate::broker::ReadError;

/// How long the read waits for the next message (the end marker comes last).
const QUIET: Duration = Duration::from_secs(10);
/// The header RabbitMQ sets on every message delivered from a stream.
const STREAM_OFFSET: &str = "x-stream-offset";

/// The message id of every message the stream `stream` received at or after `since`
/// (RabbitMQ starts at the chunk holding that time: a little earlier), up to the end
/// when the read began, in stream order.
pub async fn ids_since(
    r: &RabbitMqSettings,
    stream: &str,
    since: SystemTime,
) -> Result<Vec<String>, ReadError> {
    let connection = tokio::time::timeout(TIMEOUT * 2, connect(r))
        .await
        .map_err(|_| {
            ReadError::failed(
                "RabbitMQ",
                "connecting",
                format!("no answer within {:?}", TIMEOUT * 2),
            )
        })?
        .map_err(|e| ReadError::failed("RabbitMQ", "connecting", e))?;
    let read = read(&connection, stream, since).await;
    let _ = connection.close(200, "audit read done".into()).await;
    read
}

async fn read(
    connection: &Connection,
    stream: &str,
    since: SystemTime,
) -> Result<Vec<String>, ReadError> {
    let failed = |what: &str, e: lapin::Error| ReadError::failed("RabbitMQ", what, e);
    // Is it there, and a stream? A passive declare asks the first; an equivalent
    // declare with the stream's type the second (the server refuses another type).
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| failed("opening a channel", e))?;
    channel
        .queue_declare(
            stream.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|_| ReadError::Missing {
            broker: "RabbitMQ",
            destination: format!("stream queue {stream}"),
        })?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| failed("opening a channel", e))?;
    let mut stream_type = FieldTable::default();
    stream_type.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("stream".into()),
    );
    if let Err(err) = channel
        .queue_declare(
            stream.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            stream_type,
        )
        .await
        && err.to_string().contains("x-queue-type")
    {
        return Err(not_a_stream(stream));
    }
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| failed("opening a channel", e))?;
    // A stream is read with acknowledgements and a prefetch (RabbitMQ asks both).
    channel
        .basic_qos(500, BasicQosOptions::default())
        .await
        .map_err(|e| failed("setting the prefetch", e))?;
    let seconds = since
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut arguments = FieldTable::default();
    arguments.insert(STREAM_OFFSET.into(), AMQPValue::Timestamp(seconds));
    let mut consumer = channel
        .basic_consume(
            stream.into(),
            "outbox-audit".into(),
            BasicConsumeOptions::default(),
            arguments,
        )
        .await
        .map_err(|e| failed("reading the stream", e))?;
    // The end: a marker appended now, through the default exchange, to this stream only.
    let marker = format!(
        "outbox-audit-end-{}",
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let publisher = connection
        .create_channel()
        .await
        .map_err(|e| failed("opening a channel", e))?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| failed("confirming the end marker", e))?;
    publisher
        .basic_publish(
            "".into(),
            stream.into(),
            BasicPublishOptions::default(),
            b"",
            BasicProperties::default().with_message_id(ShortString::from(marker.as_str())),
        )
        .await
        .map_err(|e| failed("appending the end marker", e))?
        .await
        .map_err(|e| failed("appending the end marker", e))?;
    let mut ids = Vec::new();
    let mut first = true;
    loop {
        let delivery = match tokio::time::timeout(QUIET, consumer.next()).await {
            Ok(Some(Ok(delivery))) => delivery,
            Ok(Some(Err(e))) => return Err(failed("reading the stream", e)),
            Ok(None) => {
                return Err(ReadError::failed(
                    "RabbitMQ",
                    "reading the stream",
                    "the server ended the read",
                ));
            }
            Err(_) => {
                return Err(ReadError::failed(
                    "RabbitMQ",
                    "reading the stream",
                    format!("the end marker did not come back within {QUIET:?}"),
                ));
            }
        };
        let from_stream = delivery
            .properties
            .headers()
            .as_ref()
            .is_some_and(|h| h.inner().contains_key(STREAM_OFFSET));
        if first && !from_stream {
            // Not a stream after all: stop before acknowledging (the message stays).
            return Err(not_a_stream(stream));
        }
        first = false;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned());
        delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(|e| failed("reading the stream", e))?;
        match id {
            Some(id) if id == marker => return Ok(ids),
            Some(id) => ids.push(id),
            None => {}
        }
    }
}

fn not_a_stream(stream: &str) -> ReadError {
    ReadError::Failed {
        broker: "RabbitMQ",
        what: format!("reading {stream}"),
        message: "it is not a stream queue (x-queue-type: stream): a classic or quorum queue gives each message to one consumer, so it was not read".to_owned(),
    }
}
