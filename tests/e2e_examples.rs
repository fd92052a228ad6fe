//! End to end, the way a user meets the operator: each example manifest in `examples/`
//! applied with the Secrets its header asks for, reconciled by the controller (run
//! in-process), its relay pods run by the pod runner (tests/common/pod_runner.rs) from
//! exactly the Deployment the controller built, rows inserted into a database created
//! from `examples/schema.sql` — and then `Ready=True` on the OutboxRelay and every row
//! at the broker.
//!
//! The examples name in-cluster Services (`kafka:9092`, `nats://nats:4222`); the rig's
//! brokers listen on loopback ports, so the test points those two fields at the rig and
//! changes nothing else. Each test uses an aggregate type of its own, so the example's
//! routing (`outbox.event.{aggregateType}`, `outbox.{aggregateType}`, routing key
//! `{aggregateType}`) lands on a topic / subject / binding no other test shares.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::{self, ControllerArgs, Metrics};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use common::pod_runner::PodRunner;

const WAIT: Duration = Duration::from_secs(90);
/// kube-controller-manager discovers a new CRD for garbage collection only after ~30 s,
/// and the relay pods then get their grace period.
const GC_WAIT: Duration = Duration::from_secs(150);
const ROWS: usize = 24;

// ---------------------------------------------------------------------------------------
// Helpers

async fn install_crd(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = OutboxRelay::crd();
    let name = crd.name_any();
    crds.patch(
        &name,
        &PatchParams::apply("outbox-operator-test").force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap_or_else(|e| panic!("the API server refused the OutboxRelay CRD: {e}"));
    common::wait_for("the OutboxRelay CRD to be Established", WAIT, || async {
        crds.get_opt(&name).await.ok().flatten().is_some_and(|c| {
            c.status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
    })
    .await;
}

/// The controller, in-process, watching one namespace.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), controller::Error>>,
}

fn start_controller(client: &Client, namespace: &str) -> Running {
    outbox_operator::telemetry::init_logging();
    let mut args = ControllerArgs::for_namespace(namespace);
    args.identity = Some("e2e".to_owned());
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(controller::run(
        client.clone(),
        args,
        Arc::new(Metrics::new()),
        async move {
            let _ = rx.await;
        },
    ));
    Running {
        stop: Some(tx),
        task,
    }
}

impl Running {
    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match tokio::time::timeout(WAIT, self.task).await {
            Ok(Ok(Ok(()))) => {}
            other => panic!("the controller did not stop cleanly: {other:?}"),
        }
    }
}

fn example(file: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()))
}

async fn apply(client: &Client, namespace: &str, manifest: &Value) -> OutboxRelay {
    let api: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    let name = manifest["metadata"]["name"].as_str().unwrap_or_default();
    api.patch(
        name,
        &PatchParams::apply("e2e-user"),
        &Patch::Apply(manifest),
    )
    .await
    .unwrap_or_else(|e| panic!("applying example {name} failed: {e}"))
}

async fn create_secret(client: &Client, namespace: &str, name: &str, data: &[(&str, &str)]) {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_or_else(|e| panic!("creating Secret {name} failed: {e}"));
}

fn condition(relay: &OutboxRelay, type_: &str) -> Option<Condition> {
    relay
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .cloned()
}

fn describe(relay: Option<&OutboxRelay>) -> String {
    relay.and_then(|r| r.status.as_ref()).map_or_else(
        || "no status".to_owned(),
        |s| serde_json::to_string_pretty(s).unwrap_or_default(),
    )
}

/// A database made from examples/schema.sql, as a user would create it.
async fn example_database() -> common::TestDatabase {
    let db = common::fresh_database().await;
    let schema =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/schema.sql"))
            .unwrap_or_else(|e| panic!("cannot read examples/schema.sql: {e}"));
    db.client
        .batch_execute(&schema)
        .await
        .unwrap_or_else(|e| panic!("examples/schema.sql failed: {e}"));
    db
}

/// Inserts `ROWS` rows of `aggregate_type` over six aggregates; returns their ids.
async fn insert_rows(db: &common::TestDatabase, aggregate_type: &str) -> BTreeSet<i64> {
    let mut ids = BTreeSet::new();
    for i in 0..ROWS {
        let aggregate = format!("order-{}", i % 6);
        let payload = json!({"aggregate": aggregate, "n": i}).to_string();
        let row = db
            .client
            .query_one(
                "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
                 VALUES ($1, $2, 'OrderPlaced', ($3::text)::jsonb) RETURNING id",
                &[&aggregate_type, &aggregate, &payload],
            )
            .await
            .unwrap_or_else(|e| panic!("inserting an outbox row failed: {e}"));
        ids.insert(row.get(0));
    }
    ids
}

async fn unpublished(db: &common::TestDatabase) -> i64 {
    db.client
        .query_one(
            "SELECT count(*) FROM public.outbox WHERE published_at IS NULL",
            &[],
        )
        .await
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

/// Where the example's events are read back.
enum Sink {
    Kafka { topic: String },
    Nats(common::TestStream),
    Amqp(common::TestQueue),
}

impl Sink {
    async fn received(&self) -> Vec<common::Received> {
        match self {
            Sink::Kafka { topic } => {
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                    .await
                    .unwrap_or_else(|e| panic!("Kafka consumer task: {e}"))
            }
            Sink::Nats(stream) => common::consume_nats(stream).await,
            Sink::Amqp(queue) => common::consume_amqp(queue).await,
        }
    }
}

/// Runs `body` with a fresh namespace, the controller and (with `run_pods`) the pod
/// runner; afterwards,
/// also when `body` panicked, deletes the namespace's OutboxRelays while the controller
/// still runs (their finalizer would otherwise block the namespace's deletion), stops
/// everything and deletes the namespace.
async fn with_operator<F, Fut>(run_pods: bool, body: F)
where
    F: FnOnce(Client, String, Option<Arc<PodRunner>>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let client = common::kube_client().await;
    install_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let running = start_controller(&client, &ns);
    let runner = if run_pods {
        Some(Arc::new(
            PodRunner::start(
                &client,
                &ns,
                Path::new(env!("CARGO_BIN_EXE_outbox-operator")),
            )
            .await,
        ))
    } else {
        None
    };
    let outcome = AssertUnwindSafe(body(client.clone(), ns.clone(), runner.clone()))
        .catch_unwind()
        .await;

    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let _ = relays
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let gone = tokio::time::timeout(WAIT, async {
        while !relays
            .list(&ListParams::default())
            .await
            .is_ok_and(|l| l.items.is_empty())
        {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    if gone.is_err() {
        // Never leave a namespace stuck on our finalizer.
        for relay in relays
            .list(&ListParams::default())
            .await
            .into_iter()
            .flat_map(|l| l.items)
        {
            let _ = relays
                .patch(
                    &relay.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                )
                .await;
        }
    }
    running.stop().await;
    drop(runner);
    common::delete_namespace(&client, &ns).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Applies a polling example and proves it works: Ready=True, every row at the broker,
/// nothing left unpublished; then deleting it stops its pods.
async fn polling_example_publishes(
    client: Client,
    ns: String,
    runner: Option<Arc<PodRunner>>,
    manifest: Value,
    db: common::TestDatabase,
    aggregate_type: &str,
    sink: Sink,
) {
    let name = manifest["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let created = apply(&client, &ns, &manifest).await;
    let wanted = created.spec.replicas;
    let runner = runner.unwrap_or_else(|| panic!("polling examples need the pod runner"));

    let ids = insert_rows(&db, aggregate_type).await;

    let relay = common::wait_for_some_or(
        &format!("{name}: Ready=True for the current generation"),
        WAIT,
        || runner.log_tails(30),
        || async {
            let relay = relays.get_opt(&name).await.ok().flatten()?;
            let ready = condition(&relay, "Ready")?;
            (ready.status == "True" && ready.observed_generation == relay.metadata.generation)
                .then_some(relay)
        },
    )
    .await;
    let ready = condition(&relay, "Ready").unwrap_or_else(|| panic!("no Ready condition"));
    assert_eq!(ready.reason, "RelayAvailable", "{}", describe(Some(&relay)));
    for type_ in ["DatabaseReady", "BrokerReady"] {
        let cond = condition(&relay, type_).unwrap_or_else(|| panic!("no {type_} condition"));
        assert_eq!(cond.status, "True", "{type_}: {}", describe(Some(&relay)));
    }

    // Every row arrives, once per id at least (at-least-once), in per-aggregate order.
    let mut seen: Vec<common::Received> = Vec::new();
    let mut distinct = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        // RabbitMQ's basic.get drains the queue: keep what each poll returned; the
        // others read everything from the start each time.
        let batch = sink.received().await;
        if !matches!(sink, Sink::Amqp(_)) {
            seen.clear();
            distinct.clear();
        }
        for message in batch {
            distinct.insert(message.id);
            seen.push(message);
        }
        if ids.is_subset(&distinct) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name}: timed out after {WAIT:?} waiting for all {ROWS} rows at the broker; got {} of them{}",
            ids.intersection(&distinct).count(),
            runner.log_tails(30)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let report = common::check_delivery(&seen, &ids, &BTreeSet::new());
    assert!(report.orphans.is_empty(), "{name}: orphans {report:?}");
    assert!(report.missing.is_empty(), "{name}: missing {report:?}");
    assert!(
        report.order_violations.is_empty(),
        "{name}: per-aggregate order broken: {report:?}"
    );
    for message in &seen {
        assert_eq!(
            message.aggregate,
            common::aggregate_of(&message.payload),
            "{name}: message {} carries the wrong aggregate",
            message.id
        );
    }

    // The database agrees: nothing left to publish (marked or deleted, per the example).
    common::wait_for_some_or(
        &format!("{name}: no unpublished rows left"),
        WAIT,
        || runner.log_tails(30),
        || async { (unpublished(&db).await == 0).then_some(()) },
    )
    .await;
    // The controller does not report a backlog yet (status.backlogRows is never
    // written); when it does, it must come down to 0 here.
    if relays
        .get(&name)
        .await
        .ok()
        .and_then(|r| r.status?.backlog_rows)
        .is_some()
    {
        common::wait_for(&format!("{name}: status.backlogRows 0"), WAIT, || async {
            relays
                .get(&name)
                .await
                .ok()
                .and_then(|r| r.status?.backlog_rows)
                == Some(0)
        })
        .await;
    }

    // The runner ran as many pods as the example asks for.
    assert_eq!(
        runner.running().len(),
        usize::try_from(wanted).unwrap_or(0),
        "{name}: running pods {:?}",
        runner.running()
    );

    // Deleting the relay: finalizer done, children collected, relay processes stopped.
    relays
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("deleting {name} failed: {e}"));
    common::wait_for_some_or(
        &format!("{name}: gone and its relay processes stopped"),
        GC_WAIT,
        || runner.log_tails(10),
        || async {
            (matches!(relays.get_opt(&name).await, Ok(None)) && runner.running().is_empty())
                .then_some(())
        },
    )
    .await;
    db.drop_database().await;
}

// ---------------------------------------------------------------------------------------
// Tests

fn aggregate_type() -> String {
    format!("e2e{}", common::unique_suffix())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_kafka_example_reaches_ready_and_publishes_every_row() {
    with_operator(true, |client, ns, runner| async move {
        let db = example_database().await;
        create_secret(&client, &ns, "orders-db", &[("uri", &db.url)]).await;
        let kind = aggregate_type();
        let topic = format!("outbox.event.{kind}");
        let rig = common::Rig::load();
        common::create_topic(rig.kafka_bootstrap(), &topic, 3, &[]).await;
        let mut manifest = example("polling-kafka.yaml");
        manifest["spec"]["broker"]["kafka"]["bootstrapServers"] = json!(rig.kafka_bootstrap());
        polling_example_publishes(
            client,
            ns,
            runner,
            manifest,
            db,
            &kind,
            Sink::Kafka { topic },
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_example_reaches_ready_and_publishes_every_row() {
    with_operator(true, |client, ns, runner| async move {
        let db = example_database().await;
        create_secret(&client, &ns, "orders-db", &[("uri", &db.url)]).await;
        let kind = aggregate_type();
        let topic = format!("outbox.event.{kind}");
        let rig = common::Rig::load();
        common::create_topic(rig.kafka_bootstrap(), &topic, 3, &[]).await;
        let mut manifest = example("orders-relay.yaml");
        manifest["spec"]["broker"]["kafka"]["bootstrapServers"] = json!(rig.kafka_bootstrap());
        polling_example_publishes(
            client,
            ns,
            runner,
            manifest,
            db,
            &kind,
            Sink::Kafka { topic },
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_nats_example_reaches_ready_and_publishes_every_row() {
    with_operator(true, |client, ns, runner| async move {
        let db = example_database().await;
        create_secret(&client, &ns, "orders-db", &[("uri", &db.url)]).await;
        let kind = aggregate_type();
        // The example's header: "a stream must capture outbox.>". A stream capturing
        // only this test's subject keeps parallel tests apart.
        let nats = common::nats_connect().await;
        let jetstream = async_nats::jetstream::new(nats.clone());
        let stream_name = format!("E2E_{}", kind.to_uppercase());
        let subject = format!("outbox.{kind}");
        jetstream
            .create_stream(async_nats::jetstream::stream::Config {
                name: stream_name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("creating stream {stream_name} failed: {e}"));
        let mut manifest = example("polling-nats.yaml");
        manifest["spec"]["broker"]["nats"]["url"] = json!(common::Rig::load().nats_url());
        let sink = Sink::Nats(common::TestStream {
            client: nats,
            jetstream: jetstream.clone(),
            name: stream_name.clone(),
            subject_prefix: subject,
        });
        polling_example_publishes(client, ns, runner, manifest, db, &kind, sink).await;
        let _ = jetstream.delete_stream(&stream_name).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_rabbitmq_example_reaches_ready_and_publishes_every_row() {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use lapin::types::FieldTable;

    with_operator(true, |client, ns, runner| async move {
        let db = example_database().await;
        let rig = common::Rig::load();
        create_secret(&client, &ns, "orders-db", &[("uri", &db.url)]).await;
        create_secret(&client, &ns, "orders-amqp", &[("uri", rig.amqp_url())]).await;
        let kind = aggregate_type();
        // The example publishes to exchange `outbox` with the aggregate type as routing
        // key; a queue bound to this test's key sees this test's events only.
        let queue = common::fresh_queue().await;
        queue
            .channel
            .exchange_declare(
                "outbox".into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("declaring exchange outbox failed: {e}"));
        queue
            .channel
            .queue_bind(
                queue.name.as_str().into(),
                "outbox".into(),
                kind.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("binding the queue failed: {e}"));
        let manifest = example("polling-rabbitmq.yaml");
        polling_example_publishes(client, ns, runner, manifest, db, &kind, Sink::Amqp(queue)).await;
    })
    .await;
}

/// Log tailing's relay is not built yet (its issue comes later), so its pods are not run
/// here: this proves only that the controller takes each log-tailing example with the
/// Secrets its header names, builds its children and says in status why it is not Ready.
#[tokio::test]
async fn log_tailing_examples_get_the_controllers_conditions() {
    with_operator(false, |client, ns, _| async move {
        create_secret(
            &client,
            &ns,
            "orders-db",
            &[("uri", "postgres://u@db:5432/shop")],
        )
        .await;
        create_secret(
            &client,
            &ns,
            "orders-kafka",
            &[
                ("ca.crt", "not a real CA"),
                ("username", "u"),
                ("password", "p"),
            ],
        )
        .await;
        create_secret(
            &client,
            &ns,
            "orders-nats",
            &[("nats.creds", "not real creds")],
        )
        .await;
        create_secret(
            &client,
            &ns,
            "orders-amqp",
            &[("uri", "amqp://u:p@rabbitmq:5672/%2f")],
        )
        .await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        for file in [
            "log-tailing-kafka.yaml",
            "log-tailing-nats.yaml",
            "log-tailing-rabbitmq.yaml",
        ] {
            let manifest = example(file);
            let name = manifest["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            apply(&client, &ns, &manifest).await;
            let relay = common::wait_for_some(
                &format!("{name}: status for its generation"),
                WAIT,
                || async {
                    let relay = relays.get_opt(&name).await.ok().flatten()?;
                    let observed = relay.status.as_ref()?.observed_generation;
                    (observed == relay.metadata.generation && condition(&relay, "Ready").is_some())
                        .then_some(relay)
                },
            )
            .await;
            let status = describe(Some(&relay));
            let ready = condition(&relay, "Ready").unwrap_or_else(|| panic!("no Ready"));
            // No pods run for it here: Ready says so, naming the Deployment.
            assert_eq!(
                (ready.status.as_str(), ready.reason.as_str()),
                ("False", "RelayUnavailable"),
                "{name}: {status}"
            );
            assert!(
                ready.message.contains(&format!("{name}-relay")),
                "{name}: {status}"
            );
            for type_ in ["DatabaseReady", "BrokerReady"] {
                let cond = condition(&relay, type_).unwrap_or_else(|| panic!("no {type_}"));
                assert_eq!(cond.status, "True", "{name} {type_}: {status}");
            }
            assert_eq!(
                relay.status.as_ref().and_then(|s| s.mode.as_deref()),
                Some("logTailing"),
                "{name}: {status}"
            );
        }
        relays
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await
            .unwrap_or_else(|e| panic!("deleting the relays failed: {e}"));
        common::wait_for("the log-tailing relays to be gone", WAIT, || async {
            relays
                .list(&ListParams::default())
                .await
                .is_ok_and(|l| l.items.is_empty())
        })
        .await;
    })
    .await;
}

/// A spec change rolls the relay: the real deployment controller replaces every pod
/// (new pod-template hash), the runner stops the old processes and starts the new
/// ones, the relay is Ready again and keeps publishing; scaling down stops processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_example_rolls_its_relay_processes_on_a_spec_change_and_scales_down() {
    with_operator(true, |client, ns, runner| async move {
        let runner = runner.unwrap_or_else(|| panic!("this test needs the pod runner"));
        let db = example_database().await;
        create_secret(&client, &ns, "orders-db", &[("uri", &db.url)]).await;
        let kind = aggregate_type();
        let nats = common::nats_connect().await;
        let jetstream = async_nats::jetstream::new(nats.clone());
        let stream_name = format!("E2E_{}", kind.to_uppercase());
        let subject = format!("outbox.{kind}");
        jetstream
            .create_stream(async_nats::jetstream::stream::Config {
                name: stream_name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("creating stream {stream_name} failed: {e}"));
        let stream = common::TestStream {
            client: nats,
            jetstream: jetstream.clone(),
            name: stream_name.clone(),
            subject_prefix: subject,
        };
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
            Api::namespaced(client.clone(), &ns);

        let mut manifest = example("polling-nats.yaml");
        manifest["spec"]["broker"]["nats"]["url"] = json!(common::Rig::load().nats_url());
        apply(&client, &ns, &manifest).await;
        let first: BTreeSet<String> = common::wait_for_some_or(
            "three relay processes of generation 1",
            WAIT,
            || runner.log_tails(20),
            || async {
                let running = runner.running();
                (running.len() == 3).then(|| running.into_iter().collect())
            },
        )
        .await;

        // Any change of the relay config rolls the pods (config-hash annotation).
        manifest["spec"]["mode"]["polling"]["interval"] = json!("2s");
        let changed = apply(&client, &ns, &manifest).await;
        assert_eq!(changed.metadata.generation, Some(2));
        common::wait_for_some_or(
            "three new relay processes and none of the old ones",
            WAIT,
            || format!("running: {:?}{}", runner.running(), runner.log_tails(20)),
            || async {
                let running: BTreeSet<String> = runner.running().into_iter().collect();
                (running.len() == 3 && running.is_disjoint(&first)).then_some(())
            },
        )
        .await;
        common::wait_for_some_or(
            "the Deployment rolled out and the relay Ready for generation 2",
            WAIT,
            || runner.log_tails(20),
            || async {
                let deployment = deployments.get("polling-nats-relay").await.ok()?;
                let status = deployment.status?;
                let relay = relays.get("polling-nats").await.ok()?;
                let ready = condition(&relay, "Ready")?;
                (status.updated_replicas == Some(3)
                    && status.available_replicas == Some(3)
                    && status.replicas == Some(3)
                    && ready.status == "True"
                    && ready.observed_generation == Some(2))
                .then_some(())
            },
        )
        .await;

        // The new processes publish.
        let ids = insert_rows(&db, &kind).await;
        common::wait_for_some_or(
            "every row published by the rolled relay",
            WAIT,
            || runner.log_tails(20),
            || async {
                let got: BTreeSet<i64> = common::consume_nats(&stream)
                    .await
                    .iter()
                    .map(|m| m.id)
                    .collect();
                ids.is_subset(&got).then_some(())
            },
        )
        .await;

        // Scaling down stops processes; the relay stays Ready.
        manifest["spec"]["replicas"] = json!(1);
        apply(&client, &ns, &manifest).await;
        common::wait_for_some_or(
            "one relay process left after scaling to 1",
            WAIT,
            || format!("running: {:?}", runner.running()),
            || async { (runner.running().len() == 1).then_some(()) },
        )
        .await;
        common::wait_for("Ready=True for generation 3", WAIT, || async {
            relays.get("polling-nats").await.ok().is_some_and(|r| {
                condition(&r, "Ready")
                    .is_some_and(|c| c.status == "True" && c.observed_generation == Some(3))
            })
        })
        .await;
        let _ = jetstream.delete_stream(&stream_name).await;
        db.drop_database().await;
    })
    .await;
}
