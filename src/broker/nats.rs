//! NATS JetStream publisher: `Nats-Msg-Id` = the relay's scope and the row id
//! (`<namespace>/<name>/<id>`), so JetStream drops a re-published row within its
//! duplicate window but never another relay's row with the same id (two tables or two
//! databases feeding one stream); the bare row id is the `id` header. Every publish
//! waits for the stream's PubAck.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use futures::future::BoxFuture;

use super::AGGREGATE_TYPE_PLACEHOLDER;
use super::probe::{Probe, TIMEOUT};
use super::tls::{self, TlsFiles};
use super::{Broker, Delivered, Message, PublishError};
use crate::api::{NatsSpec, SecretKeyRef};
use crate::rules::{BrokerKind, Problems, check_secret_ref, check_template_into};
use crate::secrets::{
    Content, Delivery, ENV_NATS_CREDENTIALS_FILE, ENV_NATS_NKEY_SEED, ENV_NATS_PASSWORD,
    ENV_NATS_TOKEN, ENV_NATS_USERNAME, NATS_CREDENTIALS_PATH, SecretSlot, SecretUse,
};

/// Publishes to JetStream. The client reconnects by itself after an outage; publishes
/// made meanwhile time out and are retried by the relay.
pub struct NatsBroker {
    jetstream: async_nats::jetstream::Context,
    msg_id_scope: String,
    /// The last error the server reported on the connection, and when. A publish the
    /// server refuses (a subject the user may not publish to) is never answered, so it
    /// fails as a timeout; the server's reason comes only as such an event.
    server_said: Arc<Mutex<Option<(Instant, String)>>>,
}

impl NatsBroker {
    /// Why no stream took a message for `subject`. JetStream answers "no responders"
    /// both when no stream captures the subject and while it is starting or
    /// unreachable; asking which stream captures the subject tells the two apart. Both
    /// are outages, retried without counting toward `failure.maxAttempts`: a missing
    /// stream is the server's configuration, as a missing Kafka topic is, and counted
    /// against the row it would dead-letter every row of the subject until someone
    /// adds the stream. Only a subject that cannot exist (made invalid by the row's
    /// own values) is the row's fault.
    async fn no_stream(&self, subject: &str, err: &impl std::fmt::Display) -> PublishError {
        match self.jetstream.stream_by_subject(subject).await {
            Err(lookup) if lookup.kind() == GetStreamByNameErrorKind::NotFound => {
                PublishError::outage(format!(
                    "NATS: no JetStream stream captures subject {subject} ({err}); add a stream for it"
                ))
            }
            Err(lookup) if lookup.kind() == GetStreamByNameErrorKind::InvalidSubject => {
                PublishError::refused(format!("NATS: {subject} is not a valid subject ({err})"))
            }
            Ok(stream) => PublishError::outage(format!(
                "NATS: stream {stream} captures subject {subject} now ({err}); retrying"
            )),
            Err(lookup) => PublishError::outage(format!(
                "NATS: no stream answered for subject {subject} ({err}) and JetStream cannot be asked which would ({lookup})"
            )),
        }
    }

    /// Starts connecting (in the background when the server is down at start).
    pub async fn new(config: &NatsSettings) -> Result<Self, PublishError> {
        let server_said: Arc<Mutex<Option<(Instant, String)>>> = Arc::default();
        let said = server_said.clone();
        let options = connect_options(config)
            .await
            .map_err(|err| PublishError::outage(format!("NATS: {err}")))?
            .connection_timeout(Duration::from_secs(5))
            .retry_on_initial_connect()
            .max_reconnects(None::<usize>)
            .event_callback(move |event| {
                if let async_nats::Event::ServerError(err) = event
                    && let Ok(mut said) = said.lock()
                {
                    *said = Some((Instant::now(), err.to_string()));
                }
                std::future::ready(())
            });
        let client = options
            .connect(config.url.as_str())
            .await
            .map_err(|err| PublishError::outage(format!("NATS: cannot connect: {err}")))?;
        let mut jetstream = async_nats::jetstream::new(client);
        jetstream.set_timeout(Duration::from_secs(5));
        Ok(Self {
            jetstream,
            msg_id_scope: config.msg_id_scope.clone(),
            server_said,
        })
    }

    /// A publish to `subject` that failed with `err` after being sent at `sent`, with
    /// what the server reported since then about that subject, or about no subject in
    /// particular (a permissions violation fails a publish only as a timeout, and the
    /// relay's message should say why; another subject's violation is not this one's).
    fn failed(&self, err: &impl std::fmt::Display, subject: &str, sent: Instant) -> PublishError {
        let said = self
            .server_said
            .lock()
            .ok()
            .and_then(|said| said.clone())
            .filter(|(at, what)| {
                *at >= sent && (what.contains(&format!("\"{subject}\"")) || !what.contains('"'))
            })
            .map(|(_, what)| format!(" (the server said: {what})"))
            .unwrap_or_default();
        PublishError::outage(format!("NATS: {err}{said}"))
    }
}

impl Broker for NatsBroker {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>> {
        Box::pin(async move {
            let mut publish = PublishMessage::build()
                .payload(message.payload.clone().unwrap_or_default())
                .message_id(msg_id(&self.msg_id_scope, &message.id));
            for (key, value) in &message.headers {
                // Names are fixed or checked SQL identifiers; values were checked for
                // line breaks in build_message.
                publish = publish.header(key.as_str(), value.as_str());
            }
            let sent = Instant::now();
            let ack = self
                .jetstream
                .send_publish(message.destination.clone(), publish)
                .await
                .map_err(|err| match err.kind() {
                    PublishErrorKind::MaxPayloadExceeded => {
                        PublishError::refused(format!("NATS: row {}: {err}", message.id))
                    }
                    _ => self.failed(&err, &message.destination, sent),
                })?;
            match ack.await {
                Ok(_) => Ok(Delivered::default()),
                Err(err) if err.kind() == PublishErrorKind::StreamNotFound => {
                    Err(self.no_stream(&message.destination, &err).await)
                }
                Err(err) => Err(self.failed(&err, &message.destination, sent)),
            }
        })
    }
}

// ---------------------------------------------------------------------------------------
// The spec's rules, Secrets and settings of a NATS relay, and `check`'s probe.

/// Every problem of a NATS spec.
pub fn check(n: &NatsSpec, p: &mut Problems) {
    let all_tls = n.url.split(',').all(|u| u.trim().starts_with("tls://"));
    if (n.username_secret_ref.is_some() || n.token_secret_ref.is_some())
        && n.tls.is_none()
        && !all_tls
        && !n.allow_plaintext_credentials
    {
        p.push(
            if n.token_secret_ref.is_some() {
                TOKEN
            } else {
                USERNAME
            },
            "a password or token over a nats:// URL without tls may cross the network unencrypted",
            "add spec.broker.nats.tls (or use tls:// URLs), or set spec.broker.nats.allowPlaintextCredentials: true to accept that",
        );
    }
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
    for (field, reference) in auth_refs(n) {
        if let Some(r) = reference {
            check_secret_ref(p, field, &r.name, &r.key);
        }
    }
    let ways = [
        n.credentials_secret_ref.is_some(),
        n.nkey_seed_secret_ref.is_some(),
        n.token_secret_ref.is_some(),
        n.username_secret_ref.is_some() || n.password_secret_ref.is_some(),
    ];
    if ways.iter().filter(|w| **w).count() > 1 {
        p.push(
            "spec.broker.nats",
            "names more than one way to authenticate",
            "keep one of credentialsSecretRef, nkeySeedSecretRef, tokenSecretRef, usernameSecretRef with passwordSecretRef",
        );
    }
    if n.username_secret_ref.is_some() != n.password_secret_ref.is_some() {
        p.push(
            "spec.broker.nats.usernameSecretRef",
            "a user name needs a password, and a password a user name",
            "set both usernameSecretRef and passwordSecretRef",
        );
    }
    tls::check(n.tls.as_ref(), tls::NATS, p);
}

const CREDENTIALS: &str = "spec.broker.nats.credentialsSecretRef";
const NKEY_SEED: &str = "spec.broker.nats.nkeySeedSecretRef";
const TOKEN: &str = "spec.broker.nats.tokenSecretRef";
const USERNAME: &str = "spec.broker.nats.usernameSecretRef";
const PASSWORD: &str = "spec.broker.nats.passwordSecretRef";

fn auth_refs(n: &NatsSpec) -> [(&'static str, Option<SecretKeyRef>); 5] {
    [
        (CREDENTIALS, n.credentials_secret_ref.clone()),
        (NKEY_SEED, n.nkey_seed_secret_ref.clone()),
        (TOKEN, n.token_secret_ref.clone()),
        (
            USERNAME,
            n.username_secret_ref.as_ref().map(SecretKeyRef::from),
        ),
        (
            PASSWORD,
            n.password_secret_ref.as_ref().map(SecretKeyRef::from),
        ),
    ]
}

/// The Secret references of a NATS spec: the credentials file and TLS files mounted,
/// the other credentials as variables.
pub fn secrets(n: &NatsSpec) -> Vec<SecretSlot> {
    let mut all: Vec<SecretSlot> = auth_refs(n)
        .into_iter()
        .filter_map(|(field, reference)| {
            let delivery = match field {
                CREDENTIALS => Delivery::File {
                    path: NATS_CREDENTIALS_PATH,
                    local_env: ENV_NATS_CREDENTIALS_FILE,
                },
                NKEY_SEED => Delivery::Env(ENV_NATS_NKEY_SEED),
                TOKEN => Delivery::Env(ENV_NATS_TOKEN),
                USERNAME => Delivery::Env(ENV_NATS_USERNAME),
                _ => Delivery::Env(ENV_NATS_PASSWORD),
            };
            reference.map(|r| SecretSlot {
                field,
                purpose: SecretUse::Broker,
                reference: r.clone(),
                delivery,
                content: Content::Text,
            })
        })
        .collect();
    all.extend(tls::secrets(n.tls.as_ref(), tls::NATS));
    all
}

/// The `Nats-Msg-Id` of a row: its relay's scope and its id.
pub fn msg_id(scope: &str, id: &str) -> String {
    format!("{scope}/{id}")
}

/// How a relay authenticates to NATS. No `Debug`: it holds secrets.
#[derive(Clone)]
pub enum NatsAuth {
    /// No credentials.
    None,
    /// A `.creds` file (user JWT and nkey seed).
    CredentialsFile(String),
    /// A user nkey seed.
    NkeySeed(String),
    /// A token.
    Token(String),
    /// User name and password.
    UserPassword(String, String),
}

/// NATS settings with credentials resolved and files located. No `Debug`: it holds
/// secrets.
#[derive(Clone)]
pub struct NatsSettings {
    /// Server URL(s).
    pub url: String,
    /// Subject template.
    pub subject: String,
    /// How to authenticate.
    pub auth: NatsAuth,
    /// TLS required, with these files.
    pub tls: Option<TlsFiles>,
    /// Scope of the `Nats-Msg-Id`: the relay's `<namespace>/<name>`.
    pub msg_id_scope: String,
}

/// The settings of a NATS spec, with Secret values (`value`, by field) and mounted
/// files (`file`, by field) resolved.
pub fn settings(
    n: &NatsSpec,
    msg_id_scope: String,
    value: &dyn Fn(&str) -> String,
    file: &dyn Fn(&str) -> Option<String>,
) -> NatsSettings {
    let auth = if n.credentials_secret_ref.is_some() {
        file(CREDENTIALS).map_or(NatsAuth::None, NatsAuth::CredentialsFile)
    } else if n.nkey_seed_secret_ref.is_some() {
        NatsAuth::NkeySeed(value(NKEY_SEED).trim().to_owned())
    } else if n.token_secret_ref.is_some() {
        NatsAuth::Token(value(TOKEN).trim().to_owned())
    } else if n.username_secret_ref.is_some() {
        NatsAuth::UserPassword(value(USERNAME), value(PASSWORD))
    } else {
        NatsAuth::None
    };
    NatsSettings {
        url: n.url.clone(),
        subject: n.subject.clone(),
        auth,
        tls: n.tls.as_ref().map(|_| TlsFiles::locate(tls::NATS, file)),
        msg_id_scope,
    }
}

/// Why the client options of a NATS relay cannot be made. The text names a file or a
/// setting, never a secret.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    /// The credentials file cannot be read or does not parse.
    #[error("cannot read credentials file {path}: {error}")]
    CredentialsFile {
        /// The file.
        path: String,
        /// Why.
        error: std::io::Error,
    },
    /// The nkey seed is not a user seed (`SU...`).
    #[error("the nkey seed is not a valid user seed (SU...)")]
    NkeySeed,
    /// The TLS files cannot be used.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
}

/// The client options of `config`: credentials and TLS. Errors name a file or a
/// setting, never a secret.
pub async fn connect_options(
    config: &NatsSettings,
) -> Result<async_nats::ConnectOptions, OptionsError> {
    let mut options = match &config.auth {
        NatsAuth::None => async_nats::ConnectOptions::new(),
        NatsAuth::CredentialsFile(path) => async_nats::ConnectOptions::new()
            .credentials_file(path)
            .await
            .map_err(|error| OptionsError::CredentialsFile {
                path: path.clone(),
                error,
            })?,
        NatsAuth::NkeySeed(seed) => {
            nkeys::KeyPair::from_seed(seed).map_err(|_| OptionsError::NkeySeed)?;
            async_nats::ConnectOptions::with_nkey(seed.clone())
        }
        NatsAuth::Token(token) => async_nats::ConnectOptions::with_token(token.clone()),
        NatsAuth::UserPassword(user, password) => {
            async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
        }
    };
    if let Some(files) = &config.tls {
        options = options
            .require_tls(true)
            .tls_client_config(files.rustls_config()?);
    }
    Ok(options)
}

/// `check`'s questions to NATS: does it answer, and does a JetStream stream capture the
/// subject?
pub async fn probe(n: &NatsSettings) -> Vec<Probe> {
    let options = match connect_options(n).await {
        Ok(o) => o.connection_timeout(TIMEOUT),
        Err(err) => return vec![Probe::fail("broker", err.to_string())],
    };
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
