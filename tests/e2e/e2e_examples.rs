//! End to end, the way a user meets the operator: each example manifest in `examples/`
//! applied with the Secrets its header asks for, reconciled by the controller (run
//! in-process), its relay pods run from exactly the Deployment the controller built —
//! as containers on the rig's kubelet, from the operator's image (tests/common/node.rs),
//! or by the pod runner where the rig has no node — rows inserted into a database created
//! from `examples/schema.sql` — and then `Ready=True` on the OutboxRelay and every row
//! at the broker.
//!
//! The examples name in-cluster Services (`kafka:9092`, `nats://nats:4222`); the rig's
//! brokers listen on loopback ports, so the test points those two fields at the rig
//! (and, on the node, the pods tolerate its taint and use the addresses pods reach the
//! servers at) and changes nothing else. Each test uses an aggregate type of its own, so the example's
//! routing (`outbox.event.{aggregateType}`, `outbox.{aggregateType}`, routing key
//! `{aggregateType}`) lands on a topic / subject / binding no other test shares.

use crate::common;

use std::collections::BTreeSet;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use kube::Client;
use kube::api::{Api, DeleteParams};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::{self, ControllerArgs, Metrics};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use common::node::RelayPods;
use common::operator;

const WAIT: Duration = Duration::from_secs(90);
/// kube-controller-manager discovers a new CRD for garbage collection only after ~30 s,
/// and the relay pods then get their grace period.
const GC_WAIT: Duration = Duration::from_secs(150);
const ROWS: usize = 24;

// ---------------------------------------------------------------------------------------
// Helpers

/// The controller, in-process, watching one namespace.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), controller::Error>>,
}

/// `relay_image`: the relay pods' image when it is not the default (on the rig's node,
/// the image built from the binary under test).
fn start_controller(client: &Client, namespace: &str, relay_image: Option<String>) -> Running {
    outbox_operator::telemetry::init_logging();
    let mut args = ControllerArgs::for_namespace(namespace);
    args.identity = Some("e2e".to_owned());
    if let Some(image) = relay_image {
        args.build.relay_image = image;
    }
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
    F: FnOnce(Client, String, Option<Arc<RelayPods>>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let runner = if run_pods {
        Some(Arc::new(RelayPods::start(&client, &ns).await))
    } else {
        None
    };
    let relay_image = runner
        .as_ref()
        .filter(|r| r.on_node())
        .map(|_| common::node::operator_image().0.clone());
    let running = start_controller(&client, &ns, relay_image);
    let outcome = AssertUnwindSafe(body(client.clone(), ns.clone(), runner.clone()))
        .catch_unwind()
        .await;

    operator::delete_relays(&client, &ns, WAIT).await;
    running.stop().await;
    drop(runner);
    common::delete_namespace(&client, &ns).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Secret `orders-db` as the examples ask: the database's URL as the relay pods reach
/// it, and the CA of its server's certificate.
async fn create_db_secret(client: &Client, ns: &str, db: &common::TestDatabase) {
    let data = common::node::db_secret_for_pods(&db.url);
    let data: Vec<(&str, &str)> = data.iter().map(|(k, v)| (*k, v.as_str())).collect();
    operator::create_secret(client, ns, "orders-db", &data).await;
}

/// Waits for `Ready=True` (reason `RelayAvailable`) for the relay's current generation,
/// with `DatabaseReady` and `BrokerReady` true as well.
async fn wait_ready(relays: &Api<OutboxRelay>, name: &str, runner: &RelayPods) -> OutboxRelay {
    let relay = common::wait_for_some_or(
        &format!("{name}: Ready=True for the current generation"),
        WAIT,
        || runner.log_tails(30),
        || async {
            let relay = relays.get_opt(name).await.ok().flatten()?;
            let ready = operator::condition(&relay, "Ready")?;
            (ready.status == "True" && ready.observed_generation == relay.metadata.generation)
                .then_some(relay)
        },
    )
    .await;
    let ready =
        operator::condition(&relay, "Ready").unwrap_or_else(|| panic!("no Ready condition"));
    assert_eq!(
        ready.reason,
        "RelayAvailable",
        "{}",
        operator::describe(Some(&relay))
    );
    for type_ in ["DatabaseReady", "BrokerReady"] {
        let cond =
            operator::condition(&relay, type_).unwrap_or_else(|| panic!("no {type_} condition"));
        assert_eq!(
            cond.status,
            "True",
            "{type_}: {}",
            operator::describe(Some(&relay))
        );
    }
    relay
}

/// Waits until every id in `ids` is at the broker, then checks the delivery: nothing
/// foreign, nothing missing, per-aggregate order, each message's aggregate right.
/// At-least-once: duplicates are allowed.
async fn wait_every_row(name: &str, sink: &Sink, ids: &BTreeSet<i64>, runner: &RelayPods) {
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
            "{name}: timed out after {WAIT:?} waiting for all {} rows at the broker; got {} of them{}",
            ids.len(),
            ids.intersection(&distinct).count(),
            runner.log_tails(30)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let report = common::check_delivery(&seen, ids, &BTreeSet::new());
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
}

/// Deletes the relay and waits until it is gone (finalizer done, children collected)
/// and the runner's relay processes have stopped.
async fn delete_and_wait_stopped(relays: &Api<OutboxRelay>, name: &str, runner: &RelayPods) {
    relays
        .delete(name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("deleting {name} failed: {e}"));
    common::wait_for_some_or(
        &format!("{name}: gone and its relay processes stopped"),
        GC_WAIT,
        || runner.log_tails(10),
        || async {
            (matches!(relays.get_opt(name).await, Ok(None)) && runner.running().is_empty())
                .then_some(())
        },
    )
    .await;
}

/// Applies a polling example and proves it works: Ready=True, every row at the broker,
/// nothing left unpublished; then deleting it stops its pods.
async fn polling_example_publishes(
    client: Client,
    ns: String,
    runner: Option<Arc<RelayPods>>,
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
    let runner = runner.unwrap_or_else(|| panic!("polling examples need relay pods"));
    let created = runner.apply_relay(&client, &ns, &manifest).await;
    let wanted = created.spec.replicas;

    let ids = insert_rows(&db, aggregate_type).await;
    wait_ready(&relays, &name, &runner).await;
    wait_every_row(&name, &sink, &ids, &runner).await;

    // The database agrees: nothing left to publish (marked or deleted, per the example).
    common::wait_for_some_or(
        &format!("{name}: no unpublished rows left"),
        WAIT,
        || runner.log_tails(30),
        || async { (unpublished(&db).await == 0).then_some(()) },
    )
    .await;
    // The controller measures the backlog on its status interval: it comes down to 0.
    common::wait_for(&format!("{name}: status.backlogRows 0"), WAIT, || async {
        relays
            .get(&name)
            .await
            .ok()
            .and_then(|r| r.status?.backlog_rows)
            == Some(0)
    })
    .await;

    // The runner ran as many pods as the example asks for.
    assert_eq!(
        runner.running().len(),
        usize::try_from(wanted).unwrap_or(0),
        "{name}: running pods {:?}",
        runner.running()
    );

    delete_and_wait_stopped(&relays, &name, &runner).await;
    db.drop_database().await;
}

/// The replication slot and publication the operator created for a log-tailing example,
/// dropped by the test should it fail before the finalizer did (a leaked slot retains
/// the shared cluster's WAL). Declare it in the test function, outside [`with_operator`], and hand a clone
/// to the body: on a panic the last clone is dropped after `with_operator` has deleted
/// the relays and stopped the pod runner, and `Drop` removes the slot and publication.
#[derive(Clone, Default)]
struct Replication(Arc<std::sync::Mutex<Option<ReplicationObjects>>>);

#[derive(Clone)]
struct ReplicationObjects {
    slot: String,
    publication: String,
    /// The database holding the publication (the slot is bound to it as well).
    database_url: String,
}

impl Replication {
    fn track(&self, objects: ReplicationObjects) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(objects);
    }

    /// Drops the slot and publication now; panics when they are still there afterwards.
    async fn drop_now(&self) {
        let objects = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(objects) = objects
            && let Err(err) = drop_replication(&objects).await
        {
            panic!("{err}");
        }
    }
}

impl Drop for Replication {
    fn drop(&mut self) {
        if Arc::strong_count(&self.0) > 1 {
            return;
        }
        let Some(objects) = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        else {
            return;
        };
        // Drop runs inside the test's runtime: use a thread with its own.
        let outcome = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?
                .block_on(drop_replication(&objects))
        })
        .join()
        .unwrap_or_else(|_| Err("the cleanup thread panicked".to_owned()));
        if let Err(err) = outcome {
            eprintln!("WARNING: {err}");
        }
    }
}

/// Drops the slot and publication and checks both are gone.
async fn drop_replication(objects: &ReplicationObjects) -> Result<(), String> {
    operator::drop_slot_and_publication(&objects.slot, &objects.publication, &objects.database_url)
        .await
}

/// Rows left in the outbox table.
async fn outbox_rows(db: &common::TestDatabase) -> i64 {
    db.client
        .query_one("SELECT count(*) FROM public.outbox", &[])
        .await
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

/// Applies a log-tailing example and proves it works: one relay process streaming its
/// slot, Ready=True, every row inserted after that at the broker in per-aggregate
/// order (and deleted, with `deleteAfterPublish`); then deleting it stops its process
/// and the finalizer drops the slot and publication.
#[allow(clippy::too_many_arguments)]
async fn log_tailing_example_publishes(
    client: Client,
    ns: String,
    runner: Option<Arc<RelayPods>>,
    manifest: Value,
    db: common::TestDatabase,
    aggregate_type: &str,
    sink: Sink,
    replication: Replication,
) {
    let name = manifest["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let runner = runner.unwrap_or_else(|| panic!("log-tailing examples need relay pods"));
    let created = runner.apply_relay(&client, &ns, &manifest).await;
    let spec = created
        .spec
        .mode
        .log_tailing
        .clone()
        .unwrap_or_else(|| panic!("{name} is not a log-tailing example"));
    let slot = outbox_operator::spec::parse(&created)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .mode
        .log_tailing()
        .map(|l| l.slot.clone())
        .unwrap_or_else(|| panic!("{name} is not a log-tailing example"));
    let publication = spec
        .publication_name
        .clone()
        .unwrap_or_else(|| slot.clone());
    if spec.slot_name.is_none() {
        assert!(
            slot.starts_with("outbox_"),
            "{name}: default slot name {slot}"
        );
    }
    replication.track(ReplicationObjects {
        slot: slot.clone(),
        publication: publication.clone(),
        database_url: db.url.clone(),
    });

    // Rows committed before the slot exists are never streamed: wait until the operator
    // created it (in this database) and the relay streams it.
    common::wait_for_some_or(
        &format!("{name}: the relay streaming slot {slot}"),
        WAIT,
        || runner.log_tails(30),
        || async {
            db.client
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 \
                     AND database = current_database() AND plugin = 'pgoutput' AND active",
                    &[&slot],
                )
                .await
                .ok()
                .flatten()
                .map(|_| ())
        },
    )
    .await;
    let has_publication = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map(|r| r.get::<_, i64>(0))
        .unwrap_or(-1);
    assert_eq!(has_publication, 1, "{name}: publication {publication}");

    let relay = wait_ready(&relays, &name, &runner).await;
    assert_eq!(
        relay.status.as_ref().and_then(|s| s.mode.as_deref()),
        Some("logTailing"),
        "{name}: {}",
        operator::describe(Some(&relay))
    );
    let ids = insert_rows(&db, aggregate_type).await;
    wait_every_row(&name, &sink, &ids, &runner).await;

    if spec.delete_after_publish {
        common::wait_for_some_or(
            &format!("{name}: published rows deleted (deleteAfterPublish)"),
            WAIT,
            || runner.log_tails(30),
            || async { (outbox_rows(&db).await == 0).then_some(()) },
        )
        .await;
    } else {
        // Log tailing does not mark rows: they stay as they were inserted.
        assert_eq!(unpublished(&db).await, i64::try_from(ROWS).unwrap_or(-1));
    }

    // Log tailing runs one process, whatever spec.replicas says (default 2).
    assert_eq!(
        runner.running().len(),
        1,
        "{name}: replicas {}, running pods {:?}",
        created.spec.replicas,
        runner.running()
    );

    // status.slot names what the operator created.
    let status_slot = relays
        .get(&name)
        .await
        .ok()
        .and_then(|r| r.status?.slot)
        .unwrap_or_else(|| panic!("{name}: no status.slot"));
    assert_eq!(status_slot.name, slot, "{name}");
    assert_eq!(
        status_slot.publication.as_deref(),
        Some(publication.as_str())
    );

    delete_and_wait_stopped(&relays, &name, &runner).await;
    // The finalizer dropped the slot and publication the operator created.
    let left = db
        .client
        .query_one(
            "SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1)                   + (SELECT count(*) FROM pg_publication WHERE pubname = $2)",
            &[&slot, &publication],
        )
        .await
        .map(|r| r.get::<_, i64>(0))
        .unwrap_or(-1);
    assert_eq!(
        left, 0,
        "{name}: slot {slot} or publication {publication} left behind"
    );
    // Nothing is left to drop; this only covers a failure before this point.
    replication.drop_now().await;
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
        let db = operator::example_database().await;
        create_db_secret(&client, &ns, &db).await;
        let kind = aggregate_type();
        let topic = format!("outbox.event.{kind}");
        let rig = common::Rig::load();
        common::create_topic(rig.kafka_bootstrap(), &topic, 3, &[]).await;
        let mut manifest = operator::example_manifest("polling-kafka.yaml");
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
        let db = operator::example_database().await;
        create_db_secret(&client, &ns, &db).await;
        let kind = aggregate_type();
        let topic = format!("outbox.event.{kind}");
        let rig = common::Rig::load();
        common::create_topic(rig.kafka_bootstrap(), &topic, 3, &[]).await;
        let mut manifest = operator::example_manifest("orders-relay.yaml");
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
        let db = operator::example_database().await;
        create_db_secret(&client, &ns, &db).await;
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
        let mut manifest = operator::example_manifest("polling-nats.yaml");
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
    with_operator(true, |client, ns, runner| async move {
        let db = operator::example_database().await;
        create_db_secret(&client, &ns, &db).await;
        operator::create_secret(
            &client,
            &ns,
            "orders-amqp",
            &[("uri", &common::node::amqp_for_pods())],
        )
        .await;
        let kind = aggregate_type();
        // The example publishes to exchange `outbox` with the aggregate type as routing
        // key; a queue bound to this test's key sees this test's events only.
        let queue = common::fresh_queue().await;
        common::bind_queue(&queue, "outbox", &kind).await;
        let manifest = operator::example_manifest("polling-rabbitmq.yaml");
        polling_example_publishes(client, ns, runner, manifest, db, &kind, Sink::Amqp(queue)).await;
    })
    .await;
}

/// The Kafka example asks for TLS and SCRAM-SHA-512 on `kafka:9093`: the test points it
/// at the rig's SASL_SSL listener and gives Secret orders-kafka the rig's CA and SCRAM
/// user, so the CA reaches the relay as a mounted Secret file and the credentials as
/// variables, as in a cluster; the rest of the example is as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_kafka_example_reaches_ready_and_publishes_every_row() {
    let replication = Replication::default();
    let tracked = replication.clone();
    with_operator(true, |client, ns, runner| async move {
        let db = operator::example_database().await;
        create_db_secret(&client, &ns, &db).await;
        let kind = aggregate_type();
        let topic = format!("outbox.event.{kind}");
        let rig = common::Rig::load();
        common::create_topic(rig.kafka_bootstrap(), &topic, 3, &[]).await;
        operator::create_kafka_secret(
            &client,
            &ns,
            rig.get("OUTBOX_RIG_KAFKA_USER"),
            rig.get("OUTBOX_RIG_KAFKA_PASSWORD"),
        )
        .await;
        let mut manifest = operator::example_manifest("log-tailing-kafka.yaml");
        manifest["spec"]["broker"]["kafka"]["bootstrapServers"] =
            json!(rig.get("OUTBOX_RIG_KAFKA_SASL_SSL_BOOTSTRAP"));
        log_tailing_example_publishes(
            client,
            ns,
            runner,
            manifest,
            db,
            &kind,
            Sink::Kafka { topic },
            tracked,
        )
        .await;
    })
    .await;
    drop(replication);
}

/// The NATS example names a credentials file (Secret orders-nats). The rig's NATS
/// server requires no authentication and accepts any credentials, so the Secret holds
/// a well-formed creds file (a placeholder user JWT and a valid user NKEY seed): the
/// relay must read and use it from the mounted Secret to connect at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_nats_example_reaches_ready_and_publishes_every_row() {
    const CREDS: &str = "-----BEGIN NATS USER JWT-----\n\
        eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.c2lnbmF0dXJl\n\
        ------END NATS USER JWT------\n\n\
        -----BEGIN USER NKEY SEED-----\n\
        SUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM\n\
        ------END USER NKEY SEED------\n";
    let replication = Replication::default();
    let tracked = replication.clone();
    with_operator(true, |client, ns, runner| async move {
        let db = operator::example_database().await;
        create_db_secret(&client, &ns, &db).await;
        operator::create_secret(&client, &ns, "orders-nats", &[("nats.creds", CREDS)]).await;
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
        let mut manifest = operator::example_manifest("log-tailing-nats.yaml");
        manifest["spec"]["broker"]["nats"]["url"] = json!(common::Rig::load().nats_url());
        let sink = Sink::Nats(common::TestStream {
            client: nats,
            jetstream: jetstream.clone(),
            name: stream_name.clone(),
            subject_prefix: subject,
        });
        log_tailing_example_publishes(client, ns, runner, manifest, db, &kind, sink, tracked).await;
        let _ = jetstream.delete_stream(&stream_name).await;
    })
    .await;
    drop(replication);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_rabbitmq_example_reaches_ready_and_publishes_every_row() {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use lapin::types::FieldTable;

    let replication = Replication::default();
    let tracked = replication.clone();
    with_operator(true, |client, ns, runner| async move {
        let db = operator::example_database().await;
        create_db_secret(&client, &ns, &db).await;
        operator::create_secret(
            &client,
            &ns,
            "orders-amqp",
            &[("uri", &common::node::amqp_for_pods())],
        )
        .await;
        let kind = aggregate_type();
        // Exchange `outbox`, routing key = aggregate type, as for polling-rabbitmq.
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
        let manifest = operator::example_manifest("log-tailing-rabbitmq.yaml");
        log_tailing_example_publishes(
            client,
            ns,
            runner,
            manifest,
            db,
            &kind,
            Sink::Amqp(queue),
            tracked,
        )
        .await;
    })
    .await;
    drop(replication);
}

/// A spec change rolls the relay: the real deployment controller replaces every pod
/// (new pod-template hash), the runner stops the old processes and starts the new
/// ones, the relay is Ready again and keeps publishing; scaling down through `/scale`
/// stops processes, and the one left owns every partition and publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_example_rolls_its_relay_processes_on_a_spec_change_and_scales_down() {
    with_operator(true, |client, ns, runner| async move {
        let runner = runner.unwrap_or_else(|| panic!("this test needs relay pods"));
        let db = operator::example_database().await;
        create_db_secret(&client, &ns, &db).await;
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

        let mut manifest = operator::example_manifest("polling-nats.yaml");
        manifest["spec"]["broker"]["nats"]["url"] = json!(common::Rig::load().nats_url());
        runner.apply_relay(&client, &ns, &manifest).await;
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
        let changed = runner.apply_relay(&client, &ns, &manifest).await;
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
                let ready = operator::condition(&relay, "Ready")?;
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

        // Scaling down through the /scale subresource, as `kubectl scale` and an
        // autoscaler do, stops processes; the relay stays Ready, the one left takes
        // every partition, and it publishes rows of all of them.
        relays
            .patch_scale(
                "polling-nats",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({"spec": {"replicas": 1}})),
            )
            .await
            .unwrap_or_else(|e| panic!("kubectl scale --replicas=1: {e}"));
        common::wait_for_some_or(
            "one relay process left after scaling to 1",
            WAIT,
            || format!("running: {:?}", runner.running()),
            || async { (runner.running().len() == 1).then_some(()) },
        )
        .await;
        common::wait_for("Ready=True for generation 3", WAIT, || async {
            relays.get("polling-nats").await.ok().is_some_and(|r| {
                operator::condition(&r, "Ready")
                    .is_some_and(|c| c.status == "True" && c.observed_generation == Some(3))
            })
        })
        .await;
        let after = insert_rows(&db, &kind).await;
        common::wait_for_some_or(
            "every row published by the one relay process left, every partition owned",
            WAIT,
            || runner.log_tails(20),
            || async {
                let got: BTreeSet<i64> = common::consume_nats(&stream)
                    .await
                    .iter()
                    .map(|m| m.id)
                    .collect();
                let relay = relays.get("polling-nats").await.ok()?;
                let partitions = relay.status?.partitions?;
                (after.is_subset(&got)
                    && partitions.owned == partitions.desired
                    && relay.spec.replicas == 1)
                    .then_some(())
            },
        )
        .await;
        let _ = jetstream.delete_stream(&stream_name).await;
        db.drop_database().await;
    })
    .await;
}
