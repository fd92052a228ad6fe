//! A relay whose broker takes no message is not healthy: through the controller binary
//! and the relay pods, a Kafka `bootstrapServers` that does not resolve and a RabbitMQ
//! exchange that does not exist each turn the OutboxRelay `Ready=False` with reason
//! `BrokerUnavailable` and the broker's own reason in the message (the operator asks the
//! pod's `/readyz`; it holds no broker credentials). Fixing the spec makes it ready and
//! the waiting rows go out.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use outbox_operator::api::OutboxRelay;
use serde_json::{Value, json};

use common::node::RelayPods;
use common::operator;

const WAIT: Duration = Duration::from_secs(150);

fn manifest(name: &str, secret: &str, broker: Value) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": secret, "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"polling": {"interval": "200ms"}},
            "broker": broker,
            "ordering": {"mode": "perAggregate", "partitions": 4},
            "replicas": 1,
        }
    })
}

/// Waits until `name` is `Ready=False` for `reason`, and returns the message.
async fn wait_not_ready(
    relays: &Api<OutboxRelay>,
    name: &str,
    reason: &str,
    context: &(dyn Fn() -> String + Sync),
) -> String {
    common::wait_for_some_or(
        &format!("{name}: Ready=False {reason}"),
        WAIT,
        context,
        || async {
            let relay = relays.get_opt(name).await.ok().flatten()?;
            let ready = operator::condition(&relay, "Ready")?;
            (ready.status == "False" && ready.reason == reason).then_some(ready.message)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_broker_takes_no_message_is_not_ready_with_the_brokers_reason() {
    // One database each: two relays on one table would share its partitions.
    let db = common::fresh_database().await;
    let mq_db = common::fresh_database().await;
    let mut ids = BTreeSet::new();
    for (n, d) in [&db, &mq_db].into_iter().enumerate() {
        common::create_outbox_table(&d.client, 4).await;
        for i in 0..10 {
            let aggregate = format!("agg-{}", i % 3);
            let id = common::insert_row(&d.client, "order", &aggregate, &json!({"i": i})).await;
            if n == 0 {
                ids.insert(id);
            }
        }
    }
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let runner = RelayPods::start(&client, &ns).await;
    let mut controller = runner.controller(&ns, &[]);
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &runner.url(&db.url))]).await;
    operator::create_secret(&client, &ns, "mq-db", &[("uri", &runner.url(&mq_db.url))]).await;
    operator::create_secret(
        &client,
        &ns,
        "orders-mq",
        &[("url", &common::node::amqp_for_pods())],
    )
    .await;
    let context = || {
        format!(
            "{}\n--- controller ---\n{}",
            runner.log_tails(30),
            controller.log_tail(30)
        )
    };
    let suffix = common::unique_suffix();
    let missing_exchange = format!("no-such-exchange-{suffix}");
    let unresolvable = format!("kafka-{suffix}.does-not-resolve.invalid:9092");
    let topic = common::fresh_topic(4).await;
    runner
        .apply_relay(
            &client,
            &ns,
            &manifest(
                "kafka",
                "orders-db",
                // A message fails after 5 s (not the default 20 s), so the test waits less.
                json!({"kafka": {"bootstrapServers": unresolvable, "topic": topic,
                    "properties": {"message.timeout.ms": "5000"}}}),
            ),
        )
        .await;
    runner
        .apply_relay(
            &client,
            &ns,
            &manifest(
                "rabbit",
                "mq-db",
                json!({"rabbitmq": {
                    "urlSecretRef": {"name": "orders-mq", "key": "url"},
                    "allowPlaintextCredentials": true,
                    "exchange": missing_exchange,
                    "routingKey": "{aggregateType}"}}),
            ),
        )
        .await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);

    // Each says why, in the broker's words.
    let message = wait_not_ready(&relays, "rabbit", "BrokerUnavailable", &context).await;
    assert!(
        message.contains(&missing_exchange) && message.contains("NOT_FOUND"),
        "{message}"
    );
    let message = wait_not_ready(&relays, "kafka", "BrokerUnavailable", &context).await;
    assert!(
        message.contains(&unresolvable) || message.contains("resolve"),
        "{message}"
    );
    assert!(
        !message.contains("identical error") && !message.contains("(after "),
        "counters and times stay out of the condition: {message}"
    );

    // Fixed: ready, and the rows waiting all along go out.
    relays
        .patch(
            "kafka",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"broker": {"kafka": {
                "bootstrapServers": runner.kafka_bootstrap()}}}})),
        )
        .await
        .unwrap();
    common::wait_for_some_or(
        "kafka: Ready=True after the fix, every row on the topic",
        WAIT,
        context,
        || async {
            let relay = relays.get_opt("kafka").await.ok().flatten()?;
            operator::is_ready(&relay).then_some(())?;
            let topic = topic.clone();
            let got: BTreeSet<i64> =
                tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                    .await
                    .ok()?
                    .iter()
                    .map(|r| r.id)
                    .collect();
            ids.is_subset(&got).then_some(())
        },
    )
    .await;
    controller.stop(Duration::from_secs(30)).unwrap();
}
