//! A broker that refuses the relay's user, against real servers.
//!
//! Kafka: the cluster's ACLs deny a user an idempotent producer, so the broker answers
//! its producer-id request with CLUSTER_AUTHORIZATION_FAILED, which librdkafka makes a
//! fatal error. The relay replaces such a producer, gives up after three in a row and
//! exits with an error that says why (a pod then restarts it, and its status says it
//! crash-loops), and `check` says so before any relay runs. NATS: a user denied the
//! subject; the server never answers such a publish, and the relay retries it with the
//! server's reason. RabbitMQ: a user denied the exchange, retried with the server's
//! ACCESS_REFUSED. In each, no row counts as published meanwhile, so a relay the broker
//! takes publishes every one of them.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;

use crate::common::{self, RelayBroker, RelayProcess, SlotGuard};
use crate::relay_broker_tls::{probe, publish_through, relay_yaml, tls_block, tls_env, tls_file};
use outbox_operator::secrets::{ENV_KAFKA_SASL_PASSWORD, ENV_KAFKA_SASL_USERNAME};

/// Rows committed before the refused relay starts.
const ROWS: usize = 30;

/// Asserts that every row of `ids` is among the `received` ones.
fn assert_arrived(what: &str, ids: &[i64], received: &[common::Received]) {
    let got: HashSet<i64> = received.iter().map(|r| r.id).collect();
    let missing: Vec<i64> = ids.iter().filter(|id| !got.contains(id)).copied().collect();
    assert!(
        missing.is_empty(),
        "{what}: rows committed while the broker refused the relay never arrived: {missing:?}"
    );
}

/// Waits until a line of the relay's log says it will retry and contains `reason`.
async fn wait_retrying_with(relay: &RelayProcess, reason: &str) {
    common::wait_for_relays(
        &format!("the relay to retry, giving the server's reason ({reason})"),
        Duration::from_secs(60),
        &[relay],
        || async {
            relay
                .log()
                .lines()
                .any(|line| line.contains("will retry") && line.contains(reason))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_the_cluster_refuses_for_good_stops_the_relay_and_loses_no_row() {
    let rig = common::Rig::load();
    let sasl_ssl = rig.get("OUTBOX_RIG_KAFKA_SASL_SSL_BOOTSTRAP").to_owned();
    let denied = rig.get("OUTBOX_RIG_KAFKA_DENIED_USER").to_owned();
    let denied_password = rig.get("OUTBOX_RIG_KAFKA_DENIED_PASSWORD").to_owned();
    let user = rig.get("OUTBOX_RIG_KAFKA_USER").to_owned();
    let password = rig.get("OUTBOX_RIG_KAFKA_PASSWORD").to_owned();
    let rig_pg = rig.pg_url().to_owned();
    tokio::task::spawn_blocking({
        let denied = denied.clone();
        move || common::deny_idempotent_writes(&denied)
    })
    .await
    .unwrap();

    let ca = tls_file("ca.crt");
    let files = [("spec.broker.kafka.tls.caSecretRef", ca.clone())];

    let kafka = |topic: &str| {
        json!({"kafka": {
            "bootstrapServers": sasl_ssl,
            "topic": topic,
            "tls": tls_block(false),
            "sasl": {"mechanism": "SCRAM-SHA-512",
                     "usernameSecretRef": {"name": "kafka", "key": "user"},
                     "passwordSecretRef": {"name": "kafka", "key": "password"}},
        }})
    };

    // `check` says so before any relay runs: it asks for a producer id as the relay's
    // producers do.
    for (name, secret, granted) in [(&denied, &denied_password, false), (&user, &password, true)] {
        let mut env = tls_env(&ca);
        env.push((ENV_KAFKA_SASL_USERNAME, name.clone()));
        env.push((ENV_KAFKA_SASL_PASSWORD, secret.clone()));
        let probes = probe(kafka("probed"), &env).await;
        let found = probes
            .iter()
            .find(|p| p.name == "producer id")
            .unwrap_or_else(|| panic!("no producer id probe: {probes:?}"));
        assert_eq!(found.ok, granted, "{name}: {found:?}");
        if !granted {
            assert!(
                found.message.contains("Cluster authorization failed")
                    && found.message.contains("IDEMPOTENT_WRITE")
                    && !found.message.contains(secret.as_str()),
                "{}",
                found.message
            );
        }
        println!("check as {name}: {}", found.message);
    }
    for log_tailing in [false, true] {
        let what = if log_tailing {
            "log tailing"
        } else {
            "polling"
        };
        let topic = common::fresh_topic(4).await;
        let db = common::fresh_database().await;
        common::create_outbox_table(&db.client, 4).await;
        let guard = log_tailing.then(|| SlotGuard::new(&rig_pg, "fatal"));
        if let Some(guard) = &guard {
            common::create_replication(&db.client, &guard.slot, &guard.slot).await;
        }
        let yaml = relay_yaml(
            &kafka(&topic),
            &files,
            guard.as_ref().map(|g| g.slot.as_str()),
        );
        let placeholder = RelayBroker::Kafka {
            bootstrap: sasl_ssl.clone(),
            topic: topic.clone(),
        };
        let ids = common::commit_rows(&db.client, "refused", ROWS).await;

        // The user the cluster refuses: each producer stops on a fatal error at its
        // first send; after the third in a row the relay exits.
        let mut refused = RelayProcess::start_with_env(
            &yaml,
            &db.url,
            &placeholder,
            &[
                (ENV_KAFKA_SASL_USERNAME, denied.as_str()),
                (ENV_KAFKA_SASL_PASSWORD, denied_password.as_str()),
            ],
        );
        let (status, refused) = tokio::task::spawn_blocking(move || {
            let status = refused.wait_exit(
                Duration::from_secs(90),
                "though the cluster refuses its producers",
            );
            (status, refused)
        })
        .await
        .unwrap();
        let log = refused.log();
        assert!(
            !status.success(),
            "{what}: the relay exited successfully; log:\n{log}"
        );
        // Its last word (which it also leaves as a pod's termination message) says it
        // gave up, and why.
        let last = log
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default();
        assert!(
            last.contains("failed permanently")
                && last.contains("stopped on a fatal error")
                && last.contains("Cluster authorization failed"),
            "{what}: the relay's exit does not say it gave up on the broker, and why: \
             {last}\nlog:\n{log}"
        );
        assert!(
            !log.contains(&password) && !log.contains(&denied_password),
            "{what}: a password reached the log"
        );
        // Nothing counts as published: the rows wait, unmarked, or (log tailing) in
        // the table and behind the slot's position.
        if log_tailing {
            let left: i64 = db
                .client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(left, ROWS as i64, "{what}: rows were deleted");
        } else {
            assert_eq!(
                common::unpublished_rows(&db.client).await,
                ROWS as i64,
                "{what}: rows were marked published"
            );
        }
        drop(refused);

        // A relay the broker takes publishes every row, the ones before included.
        let relay = RelayProcess::start_with_env(
            &yaml,
            &db.url,
            &placeholder,
            &[
                (ENV_KAFKA_SASL_USERNAME, user.as_str()),
                (ENV_KAFKA_SASL_PASSWORD, password.as_str()),
            ],
        );
        publish_through(&db, &relay, "after", 5, log_tailing).await;
        drop(relay);
        let received = tokio::task::spawn_blocking({
            let topic = topic.clone();
            move || common::consume_kafka(&topic)
        })
        .await
        .unwrap();
        assert_arrived(what, &ids, &received);
    }
}

/// A NATS user the server denies publishing to the subject: the server never answers
/// such a publish, so it fails as a timeout, and the reason came only as a separate
/// client event. The relay keeps retrying (a permission can be granted at any time),
/// its errors give the server's reason, and no row counts as published; a user allowed
/// to publish then gets every row through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_user_denied_the_subject_is_retried_with_the_servers_reason_and_loses_no_row() {
    use outbox_operator::secrets::{ENV_NATS_PASSWORD, ENV_NATS_USERNAME};
    let server = common::private::PrivateNats::start_with_config(
        "listen: \"127.0.0.1:{port}\"\njetstream { store_dir: \"{store}\" }\n\
         authorization { users: [ {user: admin, password: admin-s3cret}, \
         {user: relay, password: relay-s3cret, permissions: {publish: {deny: [\"test.>\"]}}} ] }\n",
    );
    let url = format!("nats://127.0.0.1:{}", server.port);
    let admin =
        async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin-s3cret".into())
            .connect(url.as_str())
            .await
            .unwrap_or_else(|e| panic!("admin client: {e}"));
    let stream = common::stream_on(admin).await;
    let subject = format!("{}.orders", stream.subject_prefix);
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let broker = json!({"nats": {"url": url, "subject": subject,
        "allowPlaintextCredentials": true,
        "usernameSecretRef": {"name": "nats", "key": "user"},
        "passwordSecretRef": {"name": "nats", "key": "password"}}});
    let yaml = relay_yaml(&broker, &[], None);
    let placeholder = RelayBroker::Nats {
        url: url.clone(),
        subject: subject.clone(),
    };
    let ids = common::commit_rows(&db.client, "denied", ROWS).await;

    let denied = RelayProcess::start_with_env(
        &yaml,
        &db.url,
        &placeholder,
        &[
            (ENV_NATS_USERNAME, "relay"),
            (ENV_NATS_PASSWORD, "relay-s3cret"),
        ],
    );
    wait_retrying_with(
        &denied,
        "(the server said: nats: Permissions Violation for Publish to",
    )
    .await;
    let log = denied.log();
    assert!(!log.contains("relay-s3cret"), "a password reached the log");
    assert_eq!(
        common::unpublished_rows(&db.client).await,
        ROWS as i64,
        "rows were marked published while the server refused them"
    );
    drop(denied);

    let allowed = RelayProcess::start_with_env(
        &yaml,
        &db.url,
        &placeholder,
        &[
            (ENV_NATS_USERNAME, "admin"),
            (ENV_NATS_PASSWORD, "admin-s3cret"),
        ],
    );
    publish_through(&db, &allowed, "after", 5, false).await;
    drop(allowed);
    assert_arrived("NATS", &ids, &common::consume_nats(&stream).await);
}

/// A RabbitMQ user that may not write to the exchange: the server closes the channel
/// with ACCESS_REFUSED, which the relay retries as an outage with that reason (a
/// permission can be granted at any time); no row counts as published, and a user
/// allowed to write then gets every row through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_user_denied_the_exchange_is_retried_with_the_servers_reason_and_loses_no_row() {
    let rig = common::Rig::load();
    let denied_url = rig.get("OUTBOX_RIG_AMQP_DENIED_URL").to_owned();
    let queue = common::fresh_queue().await;
    let exchange = common::fresh_exchange_for(&queue).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let broker = |url: &str| RelayBroker::Amqp {
        url: url.to_owned(),
        exchange: exchange.clone(),
        routing_key: "outbox.{aggregateType}".to_owned(),
    };
    let yaml = common::relay_config_yaml(&broker(&denied_url), &common::RelayOptions::default());
    let ids = common::commit_rows(&db.client, "denied", ROWS).await;

    let denied = RelayProcess::start(&yaml, &db.url, &broker(&denied_url));
    wait_retrying_with(&denied, "ACCESS_REFUSED - access to exchange").await;
    let password = denied_url
        .split_once("outbox_denied:")
        .and_then(|(_, rest)| rest.split_once('@'))
        .map(|(password, _)| password.to_owned())
        .unwrap_or_default();
    assert!(
        !password.is_empty() && !denied.log().contains(&password),
        "a password reached the log"
    );
    assert_eq!(
        common::unpublished_rows(&db.client).await,
        ROWS as i64,
        "rows were marked published while the server refused them"
    );
    drop(denied);

    let allowed = RelayProcess::start(&yaml, &db.url, &broker(rig.amqp_url()));
    publish_through(&db, &allowed, "after", 5, false).await;
    drop(allowed);
    assert_arrived("RabbitMQ", &ids, &common::consume_amqp(&queue).await);
}
