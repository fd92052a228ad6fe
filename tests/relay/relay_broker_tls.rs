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

/// `check`'s broker probes for a relay with `broker`, with Secret values and file
/// copies from `env`.
pub async fn probe(broker: Value, env: &[(&str, String)]) -> Vec<Probe> {
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
    let settings = outbox_operator::spec::config::read_broker(&valid, &lookup)
        .unwrap_or_else(|e| panic!("{e}"));
    settings.probe().await
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
    let yaml = common::relay_config_yaml(&placeholder, &RelayOptions::default());
    let mut lines: Vec<String> = yaml
        .lines()
        .map(|line| {
            if line.starts_with("  broker:") {
                format!("  broker: {broker}")
            } else if line.starts_with("  mode:")
                && let Some(slot) = slot
            {
                format!(
                    "  mode: {{logTailing: {{slotName: {slot}, publicationName: {slot}, heartbeatInterval: 1s, deleteAfterPublish: true}}}}"
                )
            } else {
                line.to_owned()
            }
        })
        .collect();
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
