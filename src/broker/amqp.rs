//! RabbitMQ publisher (lapin): publisher confirms, persistent messages, `mandatory` so
//! an unroutable message is reported instead of silently dropped.

use futures::future::BoxFuture;
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use lapin::ExchangeKind;
use lapin::options::ExchangeDeclareOptions;

use super::probe::{Probe, TIMEOUT};
use super::{Broker, Message, PublishError};
use crate::api::RabbitMqSpec;
use crate::rules::{BrokerKind, Problems, check_secret_ref, check_template_into};
use crate::secrets::{Content, Delivery, ENV_RABBITMQ_URL, SecretSlot, SecretUse};

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

// ---------------------------------------------------------------------------------------
// The spec's rules, Secrets and settings of a RabbitMQ relay, and `check`'s probe.

/// Every problem of a RabbitMQ spec.
pub fn check(r: &RabbitMqSpec, p: &mut Problems) {
    if r.exchange.len() > 255 {
        p.push(
            "spec.broker.rabbitmq.exchange",
            "is longer than 255 bytes",
            "use a shorter exchange name",
        );
    }
    check_template_into(
        p,
        BrokerKind::Amqp,
        "spec.broker.rabbitmq.routingKey",
        &r.routing_key,
    );
    check_secret_ref(
        p,
        "spec.broker.rabbitmq.urlSecretRef",
        &r.url_secret_ref.name,
        &r.url_secret_ref.key,
    );
}

/// The Secret references of a RabbitMQ spec: the AMQP URI, as a variable.
pub fn secrets(r: &RabbitMqSpec) -> Vec<SecretSlot> {
    vec![SecretSlot {
        field: "spec.broker.rabbitmq.urlSecretRef",
        purpose: SecretUse::Broker,
        reference: r.url_secret_ref.clone(),
        delivery: Delivery::Env(ENV_RABBITMQ_URL),
        content: Content::AmqpUrl,
    }]
}

/// RabbitMQ settings with the URI resolved. No `Debug`: the URI holds a password.
#[derive(Clone)]
pub struct RabbitMqSettings {
    /// AMQP URI (secret).
    pub url: String,
    /// Variable or Secret the URI came from, for messages.
    pub url_source: String,
    /// Exchange.
    pub exchange: String,
    /// Routing-key template.
    pub routing_key: String,
}

/// The settings of a RabbitMQ spec, with the URI resolved (`value`, by field).
pub fn settings(r: &RabbitMqSpec, value: &dyn Fn(&str) -> String) -> RabbitMqSettings {
    RabbitMqSettings {
        url: value("spec.broker.rabbitmq.urlSecretRef"),
        url_source: format!(
            "Secret {} key {}",
            r.url_secret_ref.name, r.url_secret_ref.key
        ),
        exchange: r.exchange.clone(),
        routing_key: r.routing_key.clone(),
    }
}

/// `check`'s questions to RabbitMQ: does it accept the login, and does the exchange
/// exist (passive declare)?
pub async fn probe(r: &RabbitMqSettings) -> Vec<Probe> {
    let url = &r.url;
    let connected = tokio::time::timeout(
        TIMEOUT,
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await;
    // lapin's errors do not contain the URI.
    let connection = match connected {
        Ok(Ok(c)) => c,
        Ok(Err(err)) => {
            return vec![Probe::fail(
                "broker",
                format!(
                    "cannot connect to RabbitMQ with the URI in {}: {err}",
                    r.url_source
                ),
            )];
        }
        Err(_) => {
            return vec![Probe::fail(
                "broker",
                format!("RabbitMQ did not answer within {TIMEOUT:?}"),
            )];
        }
    };
    let mut probes = vec![Probe::ok(
        "broker",
        "RabbitMQ answers and accepts the login",
    )];
    let checked = async {
        let channel = connection.create_channel().await?;
        // Passive: only asks whether it exists; the server closes the channel if not.
        channel
            .exchange_declare(
                r.exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
    }
    .await;
    probes.push(match checked {
        Ok(()) => Probe::ok("exchange", format!("exchange {} exists", r.exchange)),
        Err(err) => Probe::fail(
            "exchange",
            format!(
                "exchange {} cannot be used ({err}): declare it and bind a queue for routing key {} (the relay never declares exchanges)",
                r.exchange, r.routing_key
            ),
        ),
    });
    let _ = connection.close(200, "check done".into()).await;
    probes
}
