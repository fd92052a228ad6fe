//! RabbitMQ publisher (lapin): publisher confirms, persistent messages, `mandatory` so
//! an unroutable message is reported instead of silently dropped.

use futures::future::BoxFuture;
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri, SASLMechanism};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, DefaultConnectionBuilder};
use tokio::sync::Mutex;

use lapin::ExchangeKind;
use lapin::options::ExchangeDeclareOptions;

use super::probe::{Probe, TIMEOUT};
use super::tls::{self, TlsFiles};
use super::{Broker, Delivered, Message, PublishError};
use crate::api::{AmqpAuthMechanism, RabbitMqSpec};
use crate::rules::{BrokerKind, Problems, check_secret_ref, check_template_into};
use crate::secrets::{Content, Delivery, ENV_RABBITMQ_URL, SecretSlot, SecretUse};

/// How long opening a connection (TCP, the AMQP handshake, a channel, confirms) may
/// take. A broker still booting can accept the connection and never answer; without a
/// bound the relay would wait on it for good, holding every publisher behind the lock.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a failed attempt to connect answers for the publishes queued behind it.
const FAILURE_SHARED_FOR: std::time::Duration = std::time::Duration::from_secs(1);
/// How long one publish may wait for the broker's confirm before the connection is
/// given up and the message retried (a duplicate at worst).
const CONFIRM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Publishes to one exchange. lapin does not reconnect by itself, so the connection is
/// opened lazily and replaced after it breaks.
pub struct AmqpBroker {
    settings: RabbitMqSettings,
    exchange: String,
    channel: Mutex<Option<(Connection, Channel)>>,
    /// The last failed attempt to connect, so that the publishes that waited behind it
    /// fail at once instead of each trying (and timing out) in turn.
    failed: std::sync::Mutex<Option<(std::time::Instant, String)>>,
}

impl AmqpBroker {
    /// A publisher that connects on first use. The URI is never logged.
    pub fn new(settings: RabbitMqSettings) -> Self {
        Self {
            exchange: settings.exchange.clone(),
            settings,
            channel: Mutex::new(None),
            failed: std::sync::Mutex::new(None),
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
        let fresh_failure = self
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .filter(|(at, _)| at.elapsed() < FAILURE_SHARED_FOR)
            .map(|(_, why)| why.clone());
        if let Some(why) = fresh_failure {
            return Err(PublishError::outage(why));
        }
        let opened = self.open().await;
        if let Err(err) = &opened {
            *self
                .failed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some((std::time::Instant::now(), err.message().into_owned()));
        }
        let (connection, channel) = opened?;
        *guard = Some((connection, channel.clone()));
        Ok(channel)
    }

    /// One attempt to connect, open a channel and enable confirms, bounded by
    /// [`CONNECT_TIMEOUT`].
    async fn open(&self) -> Result<(Connection, Channel), PublishError> {
        // On a task of its own: lapin's connect can hold the thread it is polled on, and
        // the bound below must fire all the same. An abandoned attempt ends by itself.
        let settings = self.settings.clone();
        let open = tokio::spawn(async move {
            let connection = connect(&settings)
                .await
                .map_err(|err| PublishError::outage(format!("RabbitMQ: {err}")))?;
            let channel = connection.create_channel().await.map_err(|err| {
                PublishError::outage(format!("RabbitMQ: cannot open a channel: {err}"))
            })?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(|err| {
                    PublishError::outage(format!("RabbitMQ: cannot enable confirms: {err}"))
                })?;
            Ok::<_, PublishError>((connection, channel))
        });
        let (connection, channel) = match tokio::time::timeout(CONNECT_TIMEOUT, open).await {
            Ok(Ok(opened)) => opened?,
            Ok(Err(failed)) => {
                return Err(PublishError::outage(format!(
                    "RabbitMQ: the connection attempt failed: {failed}"
                )));
            }
            Err(_) => {
                return Err(PublishError::outage(format!(
                    "RabbitMQ: no answer within {CONNECT_TIMEOUT:?} while connecting (the broker may be starting)"
                )));
            }
        };
        Ok((connection, channel))
    }

    async fn forget_channel(&self) {
        *self.channel.lock().await = None;
    }
}

impl Broker for AmqpBroker {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>> {
        Box::pin(async move {
            let channel = self.channel().await?;
            let mut headers = FieldTable::default();
            for (key, value) in &message.headers {
                headers.insert(
                    ShortString::from(key.as_str()),
                    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
                );
            }
            let mut properties = BasicProperties::default()
                // 2 = persistent: the broker writes the message to disk before confirming.
                .with_delivery_mode(2)
                .with_message_id(ShortString::from(message.id.as_str()))
                .with_headers(headers);
            if let Some(media_type) = &message.content_type {
                properties = properties.with_content_type(ShortString::from(media_type.as_str()));
            }
            if let Some(ms) = message.timestamp_ms {
                // AMQP 0-9-1 timestamps are whole seconds.
                properties =
                    properties.with_timestamp(u64::try_from(ms.div_euclid(1000)).unwrap_or(0));
            }
            let confirm = async {
                let confirm = channel
                    .basic_publish(
                        ShortString::from(self.exchange.as_str()),
                        ShortString::from(message.destination.as_str()),
                        BasicPublishOptions {
                            mandatory: true,
                            immediate: false,
                        },
                        message.payload.as_deref().unwrap_or_default(),
                        properties,
                    )
                    .await;
                match confirm {
                    Ok(confirm) => confirm.await,
                    Err(err) => Err(err),
                }
            };
            let Ok(confirmation) = tokio::time::timeout(CONFIRM_TIMEOUT, confirm).await else {
                self.forget_channel().await;
                return Err(PublishError::outage(format!(
                    "RabbitMQ: no publisher confirm for row {} within {CONFIRM_TIMEOUT:?}; reconnecting",
                    message.id
                )));
            };
            match confirmation {
                Ok(Confirmation::Ack(None)) => Ok(Delivered::default()),
                // Returned unroutable: the exchange has no binding for this routing
                // key. The broker's configuration, as a missing exchange is, so an
                // outage: counted against the row, it would dead-letter every row of
                // the key until someone binds a queue.
                Ok(Confirmation::Ack(Some(returned))) | Ok(Confirmation::Nack(Some(returned))) => {
                    Err(PublishError::outage(format!(
                        "RabbitMQ: row {}: exchange `{}` routed routing key `{}` to no queue ({} {}); bind a queue for it",
                        message.id,
                        self.exchange,
                        message.destination,
                        returned.reply_code,
                        returned.reply_text
                    )))
                }
                Ok(Confirmation::Nack(None)) => Err(PublishError::outage(format!(
                    "RabbitMQ: broker refused row {} (nack)",
                    message.id
                ))),
                Ok(Confirmation::NotRequested) => Err(PublishError::outage(
                    "RabbitMQ: publisher confirms are off on this channel",
                )),
                Err(err) => {
                    self.forget_channel().await;
                    Err(classify(&err, &message.id))
                }
            }
        })
    }
}

/// A publish that closed the channel. PRECONDITION_FAILED refuses this message as it is
/// (larger than the broker's `max_message_size`, a header the broker rejects): a row
/// fault, counted against `failure.maxAttempts`. Everything else (a lost connection, a
/// missing exchange, access refused) concerns every row: an outage, retried without
/// counting, so a misconfigured exchange never dead-letters the whole table.
fn classify(err: &lapin::Error, id: &str) -> PublishError {
    use lapin::ErrorKind;
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    match err.kind() {
        ErrorKind::ProtocolError(amqp)
            if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) =>
        {
            PublishError::refused(format!("RabbitMQ: row {id} refused: {err}"))
        }
        _ => PublishError::outage(format!("RabbitMQ: {err}")),
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
    tls::check(r.tls.as_ref(), tls::RABBITMQ, p);
    if r.auth_mechanism == Some(AmqpAuthMechanism::External)
        && r.tls
            .as_ref()
            .and_then(|t| t.client_cert_secret_ref.as_ref())
            .is_none()
    {
        p.push(
            "spec.broker.rabbitmq.authMechanism",
            "is EXTERNAL, which logs in with the TLS client certificate, but none is set",
            "set tls.clientCertSecretRef and tls.clientKeySecretRef",
        );
    }
}

/// The Secret references of a RabbitMQ spec: the AMQP URI as a variable, the TLS files
/// mounted.
pub fn secrets(r: &RabbitMqSpec) -> Vec<SecretSlot> {
    let mut all = vec![SecretSlot {
        field: "spec.broker.rabbitmq.urlSecretRef",
        purpose: SecretUse::Broker,
        reference: r.url_secret_ref.clone(),
        delivery: Delivery::Env(ENV_RABBITMQ_URL),
        // With `tls` set an amqp:// URI is refused before any login (TLS is never
        // skipped), so only the spec's word matters without it.
        content: Content::AmqpUrl {
            plaintext_credentials: r.allow_plaintext_credentials || r.tls.is_some(),
        },
    }];
    all.extend(tls::secrets(r.tls.as_ref(), tls::RABBITMQ));
    all
}

/// Why a connection to RabbitMQ cannot be opened. The text never contains the URI
/// (lapin's does not either): it names where the URI came from.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URI does not parse.
    #[error("the URI in {url_source} is not an AMQP URI")]
    NotAnAmqpUri {
        /// Where the URI came from.
        url_source: String,
    },
    /// TLS is configured but the URI is `amqp://`.
    #[error(
        "spec.broker.rabbitmq.tls is set but the URI in {url_source} is amqp://: use amqps:// (TLS is never skipped)"
    )]
    TlsWithoutAmqps {
        /// Where the URI came from.
        url_source: String,
    },
    /// The TLS files cannot be used.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// The AMQP client found no async runtime.
    #[error("no async runtime for the AMQP client: {0}")]
    Runtime(lapin::Error),
    /// The server could not be reached or refused the connection.
    #[error("cannot connect with the URI in {url_source}: {error}")]
    Connect {
        /// Where the URI came from.
        url_source: String,
        /// lapin's reason.
        error: lapin::Error,
    },
}

/// Opens a connection with `settings`: the URI, TLS files read now (so a rotated
/// certificate is used on the next connection) and the login mechanism. Errors never
/// contain the URI (lapin's do not either).
pub async fn connect(settings: &RabbitMqSettings) -> Result<Connection, ConnectError> {
    let mut uri: AMQPUri = settings
        .url
        .parse()
        .map_err(|_| ConnectError::NotAnAmqpUri {
            url_source: settings.url_source.clone(),
        })?;
    let mut tls_config = OwnedTLSConfig::default();
    if let Some(files) = &settings.tls {
        if uri.scheme != AMQPScheme::AMQPS {
            return Err(ConnectError::TlsWithoutAmqps {
                url_source: settings.url_source.clone(),
            });
        }
        if let Some(ca) = &files.ca {
            tls_config.cert_chain = Some(crate::tls::read_pem(ca)?);
        }
        if let Some((cert, key)) = &files.client {
            let cert = crate::tls::read_pem(cert)?;
            let key = crate::tls::read_pem(key)?;
            // Checked here so a bad file is named; lapin only says "invalid data".
            crate::tls::Identity::from_pem(&cert, &key)?;
            tls_config.identity = Some(OwnedIdentity::PKCS8 {
                pem: cert.into_bytes(),
                key: key.into_bytes(),
            });
        }
    }
    if settings.external {
        uri.query.auth_mechanism = Some(SASLMechanism::External);
    }
    let builder = DefaultConnectionBuilder::new().map_err(ConnectError::Runtime)?;
    builder
        .with_uri(uri)
        .with_properties(ConnectionProperties::default())
        .with_tls_config(tls_config)
        .connect()
        .await
        .map_err(|error| ConnectError::Connect {
            url_source: settings.url_source.clone(),
            error,
        })
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
    /// TLS files (`amqps://` URIs).
    pub tls: Option<TlsFiles>,
    /// Log in with the client certificate (SASL EXTERNAL).
    pub external: bool,
}

/// The settings of a RabbitMQ spec, with the URI resolved (`value`, by field).
pub fn settings(
    r: &RabbitMqSpec,
    value: &dyn Fn(&str) -> String,
    file: &dyn Fn(&str) -> Option<String>,
) -> RabbitMqSettings {
    RabbitMqSettings {
        url: value("spec.broker.rabbitmq.urlSecretRef"),
        url_source: format!(
            "Secret {} key {}",
            r.url_secret_ref.name, r.url_secret_ref.key
        ),
        exchange: r.exchange.clone(),
        routing_key: r.routing_key.clone(),
        tls: r
            .tls
            .as_ref()
            .map(|_| TlsFiles::locate(tls::RABBITMQ, file)),
        external: r.auth_mechanism == Some(AmqpAuthMechanism::External),
    }
}

/// `check`'s questions to RabbitMQ: does it accept the login, and does the exchange
/// exist (passive declare)?
pub async fn probe(r: &RabbitMqSettings) -> Vec<Probe> {
    let connected = tokio::time::timeout(TIMEOUT, connect(r)).await;
    let connection = match connected {
        Ok(Ok(c)) => c,
        Ok(Err(err)) => {
            return vec![Probe::fail("broker", format!("RabbitMQ: {err}"))];
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
