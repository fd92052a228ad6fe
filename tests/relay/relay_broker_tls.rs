//! TLS and authentication to every broker, against servers started with the rig's
//! per-run CA (tests/rig/certs.sh): the rig's Kafka (a SASL_SSL listener with PLAIN and
//! SCRAM users, an SSL listener that requires a client certificate), the rig's RabbitMQ
//! (an amqps listener, EXTERNAL logins by certificate) and private NATS servers with
//! TLS and each way to log in. Relays publish end to end with verification on, in both
//! modes; each wrong setting is refused with a message that says why, and none falls
//! back to plaintext.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{self, RelayBroker, RelayOptions, RelayProcess, SlotGuard};
use outbox_operator::api::OutboxRelay;
use outbox_operator::broker::probe::Probe;
use outbox_operator::secrets::{
    ENV_BROKER_CA_FILE, ENV_BROKER_CLIENT_CERT_FILE, ENV_BROKER_CLIENT_KEY_FILE,
    ENV_KAFKA_SASL_PASSWORD, ENV_KAFKA_SASL_USERNAME,
};

const WAIT: Duration = Duration::from_secs(90);

/// A file of the rig's TLS folder.
pub fn tls_file(name: &str) -> String {
    format!("{}/{name}", common::Rig::load().get("OUTBOX_RIG_TLS_DIR"))
}

/// The `tls` block naming Secrets `ca`, and `client` when `mutual`.
pub fn tls_block(mutual: bool) -> Value {
    let mut tls = json!({"caSecretRef": {"name": "broker-tls", "key": "ca.crt"}});
    if mutual {
        tls["clientCertSecretRef"] = json!({"name": "broker-tls", "key": "tls.crt"});
        tls["clientKeySecretRef"] = json!({"name": "broker-tls", "key": "tls.key"});
    }
    tls
}

/// Local copies of the mounted TLS files: the rig's CA (or `ca`), its client
/// certificate and key.
pub fn tls_env(ca: &str) -> Vec<(&'static str, String)> {
    vec![
        (ENV_BROKER_CA_FILE, ca.to_owned()),
        (ENV_BROKER_CLIENT_CERT_FILE, tls_file("client.crt")),
        (ENV_BROKER_CLIENT_KEY_FILE, tls_file("client.key")),
    ]
}

/// The broker settings a relay with `broker` (JSON) resolves, with Secret values and
/// file copies from `env`.
pub fn broker_settings(
    broker: Value,
    env: &[(&str, String)],
) -> outbox_operator::broker::BrokerSettings {
    let relay: OutboxRelay = serde_json::from_value(json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "probe", "namespace": "test"},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db"}, "sslMode": "disable"}},
            "mode": {"polling": {}},
            "broker": broker,
        }
    }))
    .unwrap();
    let valid = outbox_operator::spec::parse(&relay).unwrap_or_else(|p| panic!("{p}"));
    let lookup = |name: &str| env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone());
    outbox_operator::spec::config::read_broker(&valid, &lookup).unwrap_or_else(|e| panic!("{e}"))
}

/// `check`'s broker probes for a relay with `broker`, with Secret values and file
/// copies from `env`.
pub async fn probe(broker: Value, env: &[(&str, String)]) -> Vec<Probe> {
    broker_settings(broker, env).probe().await
}

/// The first probe (the connection) passed.
pub fn connected(probes: &[Probe]) -> Result<(), String> {
    match probes.first() {
        Some(p) if p.ok => Ok(()),
        Some(p) => Err(p.message.clone()),
        None => Err("no probe".to_owned()),
    }
}

/// Asserts that every case connects or is refused as expected, the refusal naming
/// one of `needles`; prints one line per case.
pub fn assert_cases(cases: Vec<(&str, Result<(), String>, &[&str])>, secret: &str) {
    let mut report = Vec::new();
    for (what, result, needles) in cases {
        match (&result, needles.is_empty()) {
            (Ok(()), true) => report.push(format!("{what:<64} connected")),
            (Err(message), false) => {
                let lower = message.to_lowercase();
                assert!(
                    needles.iter().any(|n| lower.contains(&n.to_lowercase())),
                    "{what}: none of {needles:?} in: {message}"
                );
                assert!(
                    secret.is_empty() || !message.contains(secret),
                    "{what}: a secret leaked: {message}"
                );
                report.push(format!("{what:<64} refused: {message}"));
            }
            (Ok(()), false) => panic!("{what}: connected, but must be refused"),
            (Err(message), true) => panic!("{what}: refused: {message}"),
        }
    }
    println!("{}", report.join("\n"));
}

/// A relay config whose broker is `broker` (JSON), in polling mode or tailing
/// `slot`, with the mounted files at `files`.
pub fn relay_yaml(broker: &Value, files: &[(&str, String)], slot: Option<&str>) -> String {
    let placeholder = RelayBroker::Nats {
        url: "nats://127.0.0.1:1".to_owned(),
        subject: "x".to_owned(),
    };
    let mut yaml = common::with_spec_line(
        &common::relay_config_yaml(&placeholder, &RelayOptions::default()),
        "broker",
        &broker.to_string(),
    );
    if let Some(slot) = slot {
        yaml = common::with_spec_line(&yaml, "mode", &common::log_tailing_mode(slot, true));
    }
    let mut lines = vec![yaml];
    if !files.is_empty() {
        let entries: Vec<String> = files
            .iter()
            .map(|(field, path)| format!("{field}: \"{path}\""))
            .collect();
        lines.push(format!("secretFiles: {{{}}}", entries.join(", ")));
    }
    lines.join("\n")
}

/// Inserts `count` rows with aggregate ids `<prefix><n>` and waits until the relay has
/// published them: none unpublished (polling), the table empty (log tailing, which
/// deletes after publishing).
pub async fn publish_through(
    db: &common::TestDatabase,
    relay: &RelayProcess,
    prefix: &str,
    count: usize,
    log_tailing: bool,
) {
    for i in 0..count {
        common::insert_row(
            &db.client,
            "order",
            &format!("{prefix}{}", i % 3),
            &json!({"i": i, "aggregate": format!("{prefix}{}", i % 3)}),
        )
        .await;
    }
    common::wait_for_relays(
        &format!("the relay to publish the {prefix} rows through TLS"),
        WAIT,
        &[relay],
        || async {
            if log_tailing {
                db.client
                    .query_one("SELECT count(*) FROM public.outbox", &[])
                    .await
                    .map(|r| r.get::<_, i64>(0) == 0)
                    .unwrap_or(false)
            } else {
                common::unpublished_rows(&db.client).await == 0
            }
        },
    )
    .await;
}

/// Kafka: SASL_SSL with SCRAM-SHA-512 (polling) and mTLS (log tailing) publish every
/// row; PLAIN and SCRAM-SHA-256 log in; wrong password, wrong CA, wrong host name,
/// a missing client certificate and TLS to a plaintext port are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_relays_publish_over_sasl_ssl_and_mutual_tls_and_bad_settings_are_refused() {
    let rig = common::Rig::load();
    let sasl_ssl = rig.get("OUTBOX_RIG_KAFKA_SASL_SSL_BOOTSTRAP").to_owned();
    let mtls = rig.get("OUTBOX_RIG_KAFKA_SSL_BOOTSTRAP").to_owned();
    let user = rig.get("OUTBOX_RIG_KAFKA_USER").to_owned();
    let password = rig.get("OUTBOX_RIG_KAFKA_PASSWORD").to_owned();
    let topic = common::fresh_topic(4).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;

    let sasl = |mechanism: &str| {
        json!({"mechanism": mechanism,
               "usernameSecretRef": {"name": "kafka", "key": "user"},
               "passwordSecretRef": {"name": "kafka", "key": "password"}})
    };
    let kafka = |bootstrap: &str, tls: Option<Value>, sasl: Option<Value>| {
        let mut k = json!({"bootstrapServers": bootstrap, "topic": topic});
        if let Some(t) = tls {
            k["tls"] = t;
        }
        if let Some(s) = sasl {
            k["sasl"] = s;
        }
        json!({"kafka": k})
    };
    let ca = tls_file("ca.crt");
    let mut env = tls_env(&ca);
    env.push((ENV_KAFKA_SASL_USERNAME, user.clone()));
    env.push((ENV_KAFKA_SASL_PASSWORD, password.clone()));
    let files = |mutual: bool| {
        let mut f = vec![("spec.broker.kafka.tls.caSecretRef", ca.clone())];
        if mutual {
            f.push((
                "spec.broker.kafka.tls.clientCertSecretRef",
                tls_file("client.crt"),
            ));
            f.push((
                "spec.broker.kafka.tls.clientKeySecretRef",
                tls_file("client.key"),
            ));
        }
        f
    };
    let placeholder = RelayBroker::Kafka {
        bootstrap: sasl_ssl.clone(),
        topic: topic.clone(),
    };

    // Polling over SASL_SSL with SCRAM-SHA-512.
    let broker = kafka(
        &sasl_ssl,
        Some(tls_block(false)),
        Some(sasl("SCRAM-SHA-512")),
    );
    let relay = RelayProcess::start_with_env(
        &relay_yaml(&broker, &files(false), None),
        &db.url,
        &placeholder,
        &[
            (ENV_KAFKA_SASL_USERNAME, user.as_str()),
            (ENV_KAFKA_SASL_PASSWORD, password.as_str()),
        ],
    );
    publish_through(&db, &relay, "scram", 20, false).await;
    drop(relay);

    // Log tailing over SSL with a client certificate.
    let rig_pg = rig.pg_url().to_owned();
    db.client
        .batch_execute("DELETE FROM public.outbox")
        .await
        .unwrap();
    let guard = SlotGuard::new(&rig_pg, "kafkatls");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let broker = kafka(&mtls, Some(tls_block(true)), None);
    let relay = RelayProcess::start(
        &relay_yaml(&broker, &files(true), Some(&guard.slot)),
        &db.url,
        &placeholder,
    );
    publish_through(&db, &relay, "mtls", 20, true).await;
    drop(relay);
    drop(guard);

    let received = common::consume_kafka(&topic);
    let mut ids: Vec<i64> = received.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 40, "every row arrived once at least");

    let by_ip = sasl_ssl.replace("localhost", "127.0.0.1");
    let mut wrong = env.clone();
    for (k, v) in wrong.iter_mut() {
        if *k == ENV_KAFKA_SASL_PASSWORD {
            *v = "wrong-password".to_owned();
        }
    }
    let other_ca = tls_env(&tls_file("other-ca.crt"));
    let mut other_ca_env = env.clone();
    other_ca_env.retain(|(k, _)| *k != ENV_BROKER_CA_FILE);
    other_ca_env.extend(
        other_ca
            .into_iter()
            .filter(|(k, _)| *k == ENV_BROKER_CA_FILE),
    );
    let plaintext = rig.kafka_bootstrap().to_owned();
    let cases: Vec<(&str, Result<(), String>, &[&str])> = vec![
        (
            "SASL_SSL, PLAIN",
            connected(
                &probe(
                    kafka(&sasl_ssl, Some(tls_block(false)), Some(sasl("PLAIN"))),
                    &env,
                )
                .await,
            ),
            &[],
        ),
        (
            "SASL_SSL, SCRAM-SHA-256",
            connected(
                &probe(
                    kafka(
                        &sasl_ssl,
                        Some(tls_block(false)),
                        Some(sasl("SCRAM-SHA-256")),
                    ),
                    &env,
                )
                .await,
            ),
            &[],
        ),
        (
            "SSL with a client certificate",
            connected(&probe(kafka(&mtls, Some(tls_block(true)), None), &env).await),
            &[],
        ),
        (
            "SASL_SSL, SCRAM-SHA-512, the wrong password",
            connected(
                &probe(
                    kafka(
                        &sasl_ssl,
                        Some(tls_block(false)),
                        Some(sasl("SCRAM-SHA-512")),
                    ),
                    &wrong,
                )
                .await,
            ),
            &["authentication"],
        ),
        (
            "SASL_SSL, a CA that did not sign the broker's certificate",
            connected(
                &probe(
                    kafka(
                        &sasl_ssl,
                        Some(tls_block(false)),
                        Some(sasl("SCRAM-SHA-512")),
                    ),
                    &other_ca_env,
                )
                .await,
            ),
            &["certificate verify failed", "ssl handshake failed"],
        ),
        (
            "SASL_SSL through 127.0.0.1 (the certificate is for localhost)",
            connected(
                &probe(
                    kafka(&by_ip, Some(tls_block(false)), Some(sasl("SCRAM-SHA-512"))),
                    &env,
                )
                .await,
            ),
            &[
                "certificate verify failed",
                "ssl handshake failed",
                "hostname",
            ],
        ),
        (
            "SSL without a client certificate, listener requires one",
            connected(&probe(kafka(&mtls, Some(tls_block(false)), None), &env).await),
            &["ssl", "handshake", "certificate", "disconnected"],
        ),
        (
            "TLS to the plaintext listener",
            connected(&probe(kafka(&plaintext, Some(tls_block(false)), None), &env).await),
            &["ssl", "handshake", "disconnected", "wrong version"],
        ),
    ];
    assert_cases(cases, &password);
    db.drop_database().await;
}

/// RabbitMQ: amqps with the rig's CA and a password (polling) and with a client
/// certificate and EXTERNAL login (log tailing) publish every row; a foreign CA, the
/// wrong host name, the wrong password, a certificate-less EXTERNAL login and `tls`
/// with an `amqp://` URI are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_relays_publish_over_amqps_with_password_and_certificate_logins() {
    let rig = common::Rig::load();
    let amqps = rig.get("OUTBOX_RIG_AMQPS_URL").to_owned();
    // The certificate's user (CN=outbox_cert) logs in by EXTERNAL; the URI's password
    // is wrong, so a PLAIN login would be refused: publishing proves EXTERNAL was used.
    let external = amqps.replace("guest:guest@", "guest:not-used@");
    let queue = common::fresh_queue().await;
    let exchange = common::fresh_exchange_for(&queue).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;

    let rabbitmq = |tls: Option<Value>, mechanism: Option<&str>| {
        let mut r = json!({"urlSecretRef": {"name": "amqp"}, "exchange": exchange, "routingKey": "{aggregateType}"});
        if let Some(t) = tls {
            r["tls"] = t;
        }
        if let Some(m) = mechanism {
            r["authMechanism"] = json!(m);
        }
        json!({"rabbitmq": r})
    };
    let ca = tls_file("ca.crt");
    let files = |mutual: bool| {
        let mut f = vec![("spec.broker.rabbitmq.tls.caSecretRef", ca.clone())];
        if mutual {
            f.push((
                "spec.broker.rabbitmq.tls.clientCertSecretRef",
                tls_file("client.crt"),
            ));
            f.push((
                "spec.broker.rabbitmq.tls.clientKeySecretRef",
                tls_file("client.key"),
            ));
        }
        f
    };
    let with_url = |url: &str, ca: &str| {
        let mut env = tls_env(ca);
        env.push(("OUTBOX_RABBITMQ_URL", url.to_owned()));
        env
    };
    let broker_for = |url: &str| RelayBroker::Amqp {
        url: url.to_owned(),
        exchange: exchange.clone(),
        routing_key: "{aggregateType}".to_owned(),
    };

    // Polling, amqps with the CA and the URI's password.
    let relay = RelayProcess::start(
        &relay_yaml(&rabbitmq(Some(tls_block(false)), None), &files(false), None),
        &db.url,
        &broker_for(&amqps),
    );
    publish_through(&db, &relay, "plain", 20, false).await;
    drop(relay);

    // Log tailing, amqps with a client certificate and EXTERNAL.
    db.client
        .batch_execute("DELETE FROM public.outbox")
        .await
        .unwrap();
    let guard = SlotGuard::new(rig.pg_url(), "amqptls");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let relay = RelayProcess::start(
        &relay_yaml(
            &rabbitmq(Some(tls_block(true)), Some("EXTERNAL")),
            &files(true),
            Some(&guard.slot),
        ),
        &db.url,
        &broker_for(&external),
    );
    publish_through(&db, &relay, "cert", 20, true).await;
    drop(relay);
    drop(guard);

    let mut ids: Vec<i64> = common::consume_amqp(&queue)
        .await
        .iter()
        .map(|r| r.id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 40, "every row arrived once at least");

    let by_ip = amqps.replace("localhost", "127.0.0.1");
    let wrong_password = amqps.replace("guest:guest@", "guest:wrong-password@");
    let plaintext = rig.amqp_url().to_owned();
    let cases: Vec<(&str, Result<(), String>, &[&str])> = vec![
        (
            "amqps, a CA that did not sign the server certificate",
            connected(
                &probe(
                    rabbitmq(Some(tls_block(false)), None),
                    &with_url(&amqps, &tls_file("other-ca.crt")),
                )
                .await,
            ),
            &["UnknownIssuer", "certificate"],
        ),
        (
            "amqps through 127.0.0.1 (the certificate is for localhost)",
            connected(
                &probe(
                    rabbitmq(Some(tls_block(false)), None),
                    &with_url(&by_ip, &ca),
                )
                .await,
            ),
            &["NotValidForName", "certificate"],
        ),
        (
            "amqps, the wrong password",
            connected(
                &probe(
                    rabbitmq(Some(tls_block(false)), None),
                    &with_url(&wrong_password, &ca),
                )
                .await,
            ),
            &["ACCESS_REFUSED", "login", "auth"],
        ),
        (
            "EXTERNAL with an expired client certificate",
            connected(
                &probe(
                    rabbitmq(Some(tls_block(true)), Some("EXTERNAL")),
                    &with_url(&external, &ca)
                        .into_iter()
                        .map(|(k, v)| {
                            if k == ENV_BROKER_CLIENT_CERT_FILE {
                                (k, tls_file("expired.crt"))
                            } else if k == ENV_BROKER_CLIENT_KEY_FILE {
                                (k, tls_file("expired.key"))
                            } else {
                                (k, v)
                            }
                        })
                        .collect::<Vec<_>>(),
                )
                .await,
            ),
            // The server refuses the certificate with an alert, or (timing) resets the
            // connection before the alert is read.
            &[
                "HandshakeFailure",
                "certificate expired",
                "connection reset",
            ],
        ),
        (
            "tls set, but the URI is amqp://",
            connected(
                &probe(
                    rabbitmq(Some(tls_block(false)), None),
                    &with_url(&plaintext, &ca),
                )
                .await,
            ),
            &["use amqps://"],
        ),
    ];
    assert_cases(cases, "wrong-password");
    db.drop_database().await;
}

/// NATS decentralized authentication for one server: an operator, an account with
/// JetStream and a user, as JWTs signed with their nkeys (what `nsc` would write).
struct NatsOperator {
    operator_jwt: String,
    account: String,
    account_jwt: String,
    /// JetStream needs a system account.
    system: String,
    system_jwt: String,
    /// The user's `.creds` file: user JWT and nkey seed.
    creds: String,
}

fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, nats: Value) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = json!({
        "jti": common::unique_suffix().to_uppercase(),
        "iat": now,
        "iss": issuer.public_key(),
        "sub": subject,
        "name": subject,
        "nats": nats,
    });
    let signed = format!("{header}.{}", b64.encode(claims.to_string()));
    let signature = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", b64.encode(signature))
}

impl NatsOperator {
    fn new() -> Self {
        let operator = nkeys::KeyPair::new_operator();
        let account = nkeys::KeyPair::new_account();
        let user = nkeys::KeyPair::new_user();
        let operator_jwt = nats_jwt(
            &operator,
            &operator.public_key(),
            json!({"type": "operator", "version": 2}),
        );
        let account_jwt = nats_jwt(
            &operator,
            &account.public_key(),
            json!({"type": "account", "version": 2,
                   "limits": {"subs": -1, "data": -1, "payload": -1, "imports": -1,
                              "exports": -1, "wildcards": true, "conn": -1, "leaf": -1,
                              "mem_storage": -1, "disk_storage": -1, "streams": -1,
                              "consumer": -1}}),
        );
        let system = nkeys::KeyPair::new_account();
        let system_jwt = nats_jwt(
            &operator,
            &system.public_key(),
            json!({"type": "account", "version": 2}),
        );
        let user_jwt = nats_jwt(
            &account,
            &user.public_key(),
            json!({"type": "user", "version": 2, "pub": {}, "sub": {},
                   "subs": -1, "data": -1, "payload": -1}),
        );
        let creds = format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            user.seed().unwrap()
        );
        Self {
            operator_jwt,
            account: account.public_key(),
            account_jwt,
            system: system.public_key(),
            system_jwt,
            creds,
        }
    }

    /// The server configuration lines of operator mode.
    fn config(&self) -> String {
        format!(
            "operator: \"{}\"\nsystem_account: {}\nresolver: MEMORY\n\
             resolver_preload: {{ {}: \"{}\", {}: \"{}\" }}\n",
            self.operator_jwt,
            self.system,
            self.account,
            self.account_jwt,
            self.system,
            self.system_jwt
        )
    }
}

/// A nats-server configuration with JetStream, TLS from the rig's files (`cert` names
/// the server certificate: `server` or `expired`), client certificates required when
/// `verify`, and `auth` lines.
fn nats_config(cert: &str, verify: bool, auth: &str) -> String {
    format!(
        "listen: \"127.0.0.1:{{port}}\"\njetstream {{ store_dir: \"{{store}}\" }}\n\
         tls {{ cert_file: \"{}\", key_file: \"{}\", ca_file: \"{}\", verify: {verify}, timeout: 2 }}\n{auth}\n",
        tls_file(&format!("{cert}.crt")),
        tls_file(&format!("{cert}.key")),
        tls_file("ca.crt"),
    )
}

/// A client of the relay's own making for `broker` (JSON) and `env`.
async fn nats_client(broker: &Value, env: &[(&str, String)]) -> async_nats::Client {
    let outbox_operator::broker::BrokerSettings::Nats(settings) =
        broker_settings(broker.clone(), env)
    else {
        panic!("not NATS");
    };
    outbox_operator::broker::nats::connect_options(&settings)
        .await
        .unwrap()
        .connect(settings.url.as_str())
        .await
        .unwrap_or_else(|e| panic!("test client: {e}"))
}

/// NATS: TLS with a client certificate and a `.creds` login (polling) and TLS with an
/// nkey login (log tailing) publish every row; user/password and token log in; the
/// wrong password, the wrong token, a foreign CA, the wrong host name, an expired
/// server certificate and a missing client certificate are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_relays_publish_over_tls_with_creds_nkey_password_and_token_logins() {
    use outbox_operator::secrets::{
        ENV_NATS_CREDENTIALS_FILE, ENV_NATS_NKEY_SEED, ENV_NATS_PASSWORD, ENV_NATS_TOKEN,
        ENV_NATS_USERNAME,
    };
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = tls_file("ca.crt");

    // Server 1: operator mode, client certificates required.
    let operator = NatsOperator::new();
    let creds_file = dir.path().join("relay.creds").display().to_string();
    std::fs::write(&creds_file, &operator.creds).unwrap();
    let creds_server = common::private::PrivateNats::start_with_config(&nats_config(
        "server",
        true,
        &operator.config(),
    ));
    let creds_url = format!("nats://localhost:{}", creds_server.port);
    let nats = |url: &str, mutual: bool, auth: Value| {
        let mut n = json!({"url": url, "subject": "placeholder", "tls": tls_block(mutual)});
        for (k, v) in auth.as_object().unwrap() {
            n[k] = v.clone();
        }
        json!({"nats": n})
    };
    let creds_auth = json!({"credentialsSecretRef": {"name": "nats", "key": "relay.creds"}});
    let mut env = tls_env(&ca);
    env.push((ENV_NATS_CREDENTIALS_FILE, creds_file.clone()));
    let client = nats_client(&nats(&creds_url, true, creds_auth.clone()), &env).await;
    let stream = common::stream_on(client).await;
    let subject = format!("{}.orders", stream.subject_prefix);
    let with_subject = |mut broker: Value| {
        broker["nats"]["subject"] = json!(subject);
        broker
    };
    let files = |mutual: bool, extra: &[(&'static str, String)]| {
        let mut f = vec![("spec.broker.nats.tls.caSecretRef", ca.clone())];
        if mutual {
            f.push((
                "spec.broker.nats.tls.clientCertSecretRef",
                tls_file("client.crt"),
            ));
            f.push((
                "spec.broker.nats.tls.clientKeySecretRef",
                tls_file("client.key"),
            ));
        }
        f.extend_from_slice(extra);
        f
    };
    let placeholder = RelayBroker::Nats {
        url: creds_url.clone(),
        subject: subject.clone(),
    };
    let relay = RelayProcess::start(
        &relay_yaml(
            &with_subject(nats(&creds_url, true, creds_auth.clone())),
            &files(
                true,
                &[("spec.broker.nats.credentialsSecretRef", creds_file.clone())],
            ),
            None,
        ),
        &db.url,
        &placeholder,
    );
    publish_through(&db, &relay, "creds", 20, false).await;
    drop(relay);
    let mut ids: Vec<i64> = common::consume_nats(&stream)
        .await
        .iter()
        .map(|r| r.id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 20, "every row arrived once at least");

    // Server 2: TLS, users by password and by nkey.
    let nkey = nkeys::KeyPair::new_user();
    let seed = nkey.seed().unwrap();
    let password = "Nats-s3cret_9";
    let users_server = common::private::PrivateNats::start_with_config(&nats_config(
        "server",
        false,
        &format!(
            "authorization {{ users: [ {{user: relay, password: \"{password}\"}}, {{nkey: {}}} ] }}",
            nkey.public_key()
        ),
    ));
    let users_url = format!("nats://localhost:{}", users_server.port);
    let nkey_auth = json!({"nkeySeedSecretRef": {"name": "nats", "key": "seed"}});
    let user_auth = json!({"usernameSecretRef": {"name": "nats", "key": "user"},
                           "passwordSecretRef": {"name": "nats", "key": "password"}});
    let mut env2 = tls_env(&ca);
    env2.push((ENV_NATS_NKEY_SEED, seed.clone()));
    env2.push((ENV_NATS_USERNAME, "relay".to_owned()));
    env2.push((ENV_NATS_PASSWORD, password.to_owned()));
    let client = nats_client(&nats(&users_url, false, nkey_auth.clone()), &env2).await;
    let stream = common::stream_on(client).await;
    let subject = format!("{}.orders", stream.subject_prefix);
    let with_subject = |mut broker: Value| {
        broker["nats"]["subject"] = json!(subject);
        broker
    };
    db.client
        .batch_execute("DELETE FROM public.outbox")
        .await
        .unwrap();
    let guard = SlotGuard::new(rig.pg_url(), "natstls");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let relay = RelayProcess::start_with_env(
        &relay_yaml(
            &with_subject(nats(&users_url, false, nkey_auth.clone())),
            &files(false, &[]),
            Some(&guard.slot),
        ),
        &db.url,
        &placeholder,
        &[(ENV_NATS_NKEY_SEED, seed.as_str())],
    );
    publish_through(&db, &relay, "nkey", 20, true).await;
    drop(relay);
    drop(guard);
    let mut ids: Vec<i64> = common::consume_nats(&stream)
        .await
        .iter()
        .map(|r| r.id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 20, "every row arrived once at least");

    // Server 3: TLS and a token. Server 4: an expired certificate.
    let token = "tok-s3cret";
    let token_server = common::private::PrivateNats::start_with_config(&nats_config(
        "server",
        false,
        &format!("authorization {{ token: \"{token}\" }}"),
    ));
    let token_url = format!("nats://localhost:{}", token_server.port);
    let expired_server =
        common::private::PrivateNats::start_with_config(&nats_config("expired", false, ""));
    let expired_url = format!("nats://localhost:{}", expired_server.port);
    let token_auth = json!({"tokenSecretRef": {"name": "nats", "key": "token"}});
    let mut env3 = tls_env(&ca);
    env3.push((ENV_NATS_TOKEN, token.to_owned()));
    let mut wrong_token = tls_env(&ca);
    wrong_token.push((ENV_NATS_TOKEN, "wrong-token".to_owned()));
    let mut wrong_password = env2.clone();
    wrong_password.retain(|(k, _)| *k != ENV_NATS_PASSWORD);
    wrong_password.push((ENV_NATS_PASSWORD, "wrong-password".to_owned()));
    let mut other_ca = tls_env(&tls_file("other-ca.crt"));
    other_ca.push((ENV_NATS_USERNAME, "relay".to_owned()));
    other_ca.push((ENV_NATS_PASSWORD, password.to_owned()));
    let by_ip = users_url.replace("localhost", "127.0.0.1");
    let cases: Vec<(&str, Result<(), String>, &[&str])> = vec![
        (
            "TLS, user and password",
            connected(&probe(nats(&users_url, false, user_auth.clone()), &env2).await),
            &[],
        ),
        (
            "TLS, token",
            connected(&probe(nats(&token_url, false, token_auth.clone()), &env3).await),
            &[],
        ),
        (
            "TLS, the wrong password",
            connected(&probe(nats(&users_url, false, user_auth.clone()), &wrong_password).await),
            &["authorization violation"],
        ),
        (
            "TLS, the wrong token",
            connected(&probe(nats(&token_url, false, token_auth.clone()), &wrong_token).await),
            &["authorization violation"],
        ),
        (
            "TLS, a CA that did not sign the server certificate",
            connected(&probe(nats(&users_url, false, user_auth.clone()), &other_ca).await),
            &["UnknownIssuer"],
        ),
        (
            "TLS through 127.0.0.1 (the certificate is for localhost)",
            connected(&probe(nats(&by_ip, false, user_auth.clone()), &env2).await),
            &["not valid for name"],
        ),
        (
            "TLS, the server's certificate expired",
            connected(&probe(nats(&expired_url, false, json!({})), &tls_env(&ca)).await),
            &["Expired"],
        ),
        (
            "creds, but no client certificate where one is required",
            connected(&probe(nats(&creds_url, false, creds_auth.clone()), &env).await),
            &[
                "handshake",
                "certificate",
                "broken pipe",
                "connection reset",
                "timed out",
                "tls",
            ],
        ),
    ];
    assert_cases(cases, password);
    drop((creds_server, users_server, token_server, expired_server));
    db.drop_database().await;
}
