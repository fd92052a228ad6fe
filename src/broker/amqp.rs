//! RabbitMQ publisher (lapin): publisher confirms, persistent messages, `mandatory` so
//! an unroutable message is reported instead of silently dropped.

use futures::future::BoxFuture;
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use super::{Broker, Message, PublishError};

/// Publishes to one exchange. lapin does not reconnect by itself, so the connection is
/// opened lazily and replaced after it breaks.
pub struct AmqpBroker {
    url: String,
    exchange: String,
    channel: Mutex<Option<(Connection, Channel)>>,
}

impl AmqpBroker {
    /// A publisher that connects on first use. `url` is never logged.
    pub fn new(url: String, exchange: String) -> Self {
        Self {
            url,
            exchange,
            channel: Mutex::new(None),
        }
    }

    async fn channel(&self) -> Result<Channel, PublishError> {
        let mut guard = self.channel.lock().await;
        if let Some((connection, channel)) = guard.as_ref()
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        *guard = None;
        // lapin's errors do not contain the URL.
        let connection = Connection::connect(&self.url, ConnectionProperties::default())
            .await
            .map_err(|err| PublishError::transient(format!("RabbitMQ: cannot connect: {err}")))?;
        let channel = connection.create_channel().await.map_err(|err| {
            PublishError::transient(format!("RabbitMQ: cannot open a channel: {err}"))
        })?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|err| {
                PublishError::transient(format!("RabbitMQ: cannot enable confirms: {err}"))
            })?;
        *guard = Some((connection, channel.clone()));
        Ok(channel)
    }

    async fn forget_channel(&self) {
        *self.channel.lock().await = None;
    }
}

impl Broker for AmqpBroker {
    fn publish<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let channel = self.channel().await?;
            let mut headers = FieldTable::default();
            for (key, value) in &message.headers {
                headers.insert(
                    ShortString::from(key.as_str()),
                    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
                );
            }
            let properties = BasicProperties::default()
                // 2 = persistent: the broker writes the message to disk before confirming.
                .with_delivery_mode(2)
                .with_message_id(ShortString::from(message.id.as_str()))
                .with_headers(headers);
            let confirm = channel
                .basic_publish(
                    ShortString::from(self.exchange.as_str()),
                    ShortString::from(message.destination.as_str()),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    &message.payload,
                    properties,
                )
                .await;
            let confirmation = match confirm {
                Ok(confirm) => confirm.await,
                Err(err) => Err(err),
            };
            match confirmation {
                Ok(Confirmation::Ack(None)) => Ok(()),
                Ok(Confirmation::Ack(Some(returned))) | Ok(Confirmation::Nack(Some(returned))) => {
                    Err(PublishError::row(format!(
                        "RabbitMQ: row {}: exchange `{}` routed routing key `{}` to no queue ({} {})",
                        message.id,
                        self.exchange,
                        message.destination,
                        returned.reply_code,
                        returned.reply_text
                    )))
                }
                Ok(Confirmation::Nack(None)) => Err(PublishError::transient(format!(
                    "RabbitMQ: broker refused row {} (nack)",
                    message.id
                ))),
                Ok(Confirmation::NotRequested) => Err(PublishError::transient(
                    "RabbitMQ: publisher confirms are off on this channel",
                )),
                Err(err) => {
                    self.forget_channel().await;
                    Err(PublishError::transient(format!("RabbitMQ: {err}")))
                }
            }
        })
    }
}
