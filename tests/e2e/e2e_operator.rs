//! End to end through the operator, once per mode, as a user runs it (issue #8):
//!
//! a namespace, a Secret and an OutboxRelay; the `outbox-operator controller` binary
//! (as a process) creates the Deployment (and, for log tailing, the database objects);
//! the pod runner (tests/common/pod_runner.rs) starts the relay from the pod spec; an
//! application writes 10,000 events over 100 aggregates in concurrent multi-row
//! transactions, some rolled back; an independent consumer receives every committed
//! event, in per-aggregate order, and none of the rolled-back ones; the OutboxRelay
//! reaches `Ready=True` with a backlog of 0; a spec edit mid-run rolls the relay to a
//! new ReplicaSet while writes go on, without loss; deleting the OutboxRelay stops the
//! relay and removes its Deployment, slot and publication.
//!
//! - polling, Kafka, `perAggregate` over 8 partitions, 2 replicas (partition ownership
//!   shared and handed over during a RollingUpdate);
//! - log tailing, NATS JetStream, one streaming process (Recreate).
//!
//! Status figures (`status.backlogRows`) and the slot's lifecycle belong to the
//! controller; the assertions on them are collected and reported at the end, so every
//! other step is still proven when one of them fails.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use kube::api::{Api, DeleteParams, ListParams};
use kube::{Client, ResourceExt};
use outbox_operator::api::OutboxRelay;
use serde_json::{Value, json};

use common::app_writer::{AppWriter, Ledger, WriterOptions};
use common::ids::OutboxIds;
use common::node::RelayPods;
use common::operator;
use common::pod_runner::ProcessEvent;

const WAIT: Duration = Duration::from_secs(120);
/// Owned objects are collected by kube-controller-manager's garbage collector; the relay
/// pods get their grace period first.
const GC_WAIT: Duration = Duration::from_secs(150);
/// How long the controller gets to report figures it owns (backlog) before the test
/// records the assertion as failed and goes on.
const STATUS_WAIT: Duration = Duration::from_secs(60);
const EVENTS: usize = 10_000;
const AGGREGATES: usize = 100;
/// Events written before the spec edit, and the budget while the relay rolls.
const BEFORE_ROLL: usize = 3_000;
const DURING_ROLL: usize = 7_000;

/// Where the events are read back, by a client of the test's own.
enum Sink {
    Kafka { topic: String },
    Nats(Box<common::TestStream>),
}

impl Sink {
    /// Messages the broker holds now (cheap; no message is read).
    async fn stored(&self) -> u64 {
        match self {
            Sink::Kafka { topic } => {
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || kafka_stored(&topic))
                    .await
                    .unwrap_or_else(|e| panic!("Kafka watermark task: {e}"))
            }
            Sink::Nats(stream) => {
                let mut s = stream
                    .jetstream
                    .get_stream(&stream.name)
                    .await
                    .unwrap_or_else(|e| panic!("NATS get_stream: {e}"));
                s.info()
                    .await
                    .map(|i| i.state.messages)
                    .unwrap_or_else(|e| panic!("NATS stream info: {e}"))
            }
        }
    }

    /// Every message, from the beginning.
    async fn received(&self) -> Vec<common::Received> {
        match self {
            Sink::Kafka { topic } => {
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                    .await
                    .unwrap_or_else(|e| panic!("Kafka consumer task: {e}"))
            }
            Sink::Nats(stream) => common::consume_nats(stream).await,
        }
    }
}

fn kafka_stored(topic: &str) -> u64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = common::kafka_config()
        .set("group.id", format!("count-{}", common::unique_suffix()))
        .create()
        .unwrap_or_else(|e| panic!("Kafka consumer: {e}"));
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("Kafka metadata: {e}"));
    metadata.topics()[0]
        .partitions()
        .iter()
        .map(|p| {
            consumer
                .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
                .map_or(0, |(low, high)| u64::try_from(high - low).unwrap_or(0))
        })
        .sum()
}

/// One run: the relay's manifest and what the test changes mid-run.
struct Scenario {
    name: &'static str,
    /// Partitions of the outbox table's index (`spec.ordering.partitions`).
    partitions: i32,
    manifest: Value,
    /// The spec edit that must roll the relay.
    edit: fn(&mut Value),
    /// Relay processes the Deployment runs.
    processes: usize,
    /// While polling, the sessions that own partitions: processes × the workers each
    /// runs (`mode.polling.workers`, 1 unless set).
    sessions: usize,
    /// Log tailing after the edit.
    log_tailing: bool,
    /// Log tailing from the start (false: the edit switches a polling relay to it).
    starts_tailing: bool,
    /// The outbox table's ids (the manifest's `spec.table` is set to match).
    ids: OutboxIds,
}

/// Figures printed at the end of each test.
#[derive(Debug, Default)]
struct Figures {
    events: usize,
    transactions: usize,
    rollbacks: usize,
    rolled_back_rows: usize,
    received: usize,
    duplicates: usize,
    written_during_roll: usize,
    roll_seconds: f64,
    delivery_seconds: f64,
    total_seconds: f64,
}

/// Runs `scenario` in a fresh namespace with the controller binary and the pod runner;
/// afterwards (also after a panic) deletes the relay while the controller still runs,
/// stops both, drops anything a relay left in PostgreSQL, and deletes the namespace.
async fn run(scenario: Scenario, sink: Sink, db: common::TestDatabase) {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let runner = Arc::new(RelayPods::start(&client, &ns).await);
    let mut controller = runner.controller(&ns, &[]);
    let slot = slot_of(&scenario, &ns);

    let outcome = AssertUnwindSafe(body(&client, &ns, &scenario, &sink, &db, &runner))
        .catch_unwind()
        .await;
    if outcome.is_err() {
        eprintln!(
            "--- controller log tail ---\n{}\n--- relay log tails ---{}",
            controller.log_tail(40),
            runner.log_tails(40)
        );
    }

    operator::delete_relays(&client, &ns, WAIT).await;
    let stopped = controller.stop(WAIT);
    drop(runner);
    // A slot nobody drops retains the shared cluster's WAL: with every relay process
    // stopped, drop whatever is left (nothing, once the operator's finalizer did it).
    if let Some((slot, publication)) = &slot
        && let Err(err) = operator::drop_slot_and_publication(slot, publication, &db.url).await
    {
        eprintln!("WARNING: {err}");
    }
    common::delete_namespace(&client, &ns).await;
    if let Sink::Nats(stream) = &sink {
        let _ = stream.jetstream.delete_stream(&stream.name).await;
    }
    db.drop_database().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    match stopped {
        Ok(status) => assert!(status.success(), "the controller exited with {status}"),
        Err(err) => panic!("{err}"),
    }
}

/// The slot and publication of a log-tailing scenario (default names).
fn slot_of(scenario: &Scenario, ns: &str) -> Option<(String, String)> {
    scenario.log_tailing.then(|| {
        let slot = outbox_operator::relay::config::default_slot_name(ns, scenario.name);
        (slot.clone(), slot)
    })
}

async fn body(
    client: &Client,
    ns: &str,
    scenario: &Scenario,
    sink: &Sink,
    db: &common::TestDatabase,
    runner: &RelayPods,
) {
    let started = Instant::now();
    let name = scenario.name;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let deployment = format!("{name}-relay");
    // Assertions on what the controller reports about the database (backlog, slot):
    // checked, collected, and reported together at the end.
    let mut pending: Vec<String> = Vec::new();

    common::ids::create_outbox_table_with(&db.client, scenario.partitions, scenario.ids).await;
    operator::create_secret(client, ns, "orders-db", &[("uri", &runner.url(&db.url))]).await;
    let mut manifest = scenario.manifest.clone();
    if scenario.ids != OutboxIds::Bigint {
        manifest["spec"]["table"] = scenario.ids.table_spec();
    }
    runner.adapt(&mut manifest);
    operator::apply_relay(client, ns, &manifest).await;

    // The operator's Deployment, run by the runner from its pod spec.
    let first: BTreeSet<String> = common::wait_for_some_or(
        &format!(
            "{name}: {} relay processes started from the pod spec",
            scenario.processes
        ),
        WAIT,
        || runner.log_tails(30),
        || async {
            let running = runner.running();
            (running.len() == scenario.processes).then(|| running.into_iter().collect())
        },
    )
    .await;
    let _ = deployments
        .get(&deployment)
        .await
        .unwrap_or_else(|e| panic!("{name}: Deployment {deployment}: {e}"));
    if runner.on_node() {
        // As `kubectl get pods -o wide` and `crictl ps` show them: Running on the node,
        // as containers of its runtime.
        let wide = common::node::pods_wide(client, ns).await;
        for pod in &first {
            assert_eq!(
                wide.get(pod)
                    .map(|(phase, node)| (phase.as_str(), node.as_str())),
                Some(("Running", common::node::name())),
                "{name}: pod {pod}: {wide:?}"
            );
        }
        let listed: BTreeSet<String> = common::node::crictl_pods(ns).into_iter().collect();
        assert_eq!(listed, first, "{name}: crictl ps");
        println!(
            "{name}: relay pods {first:?} Running on node {} (crictl ps lists them)",
            common::node::name()
        );
    }
    wait_ready(&relays, name, runner, Some(1)).await;

    let slot = slot_of(scenario, ns);
    if let Some((slot, publication)) = slot.as_ref().filter(|_| scenario.starts_tailing) {
        // Rows committed before the slot exists are never streamed.
        common::wait_for_some_or(
            &format!("{name}: slot {slot} streamed by the relay"),
            WAIT,
            || runner.log_tails(30),
            || async {
                db.client
                    .query_opt(
                        "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 \
                         AND database = current_database() AND plugin = 'pgoutput' AND active",
                        &[slot],
                    )
                    .await
                    .ok()
                    .flatten()
                    .map(|_| ())
            },
        )
        .await;
        assert_eq!(
            count(
                db,
                "SELECT count(*) FROM pg_publication WHERE pubname = $1",
                publication
            )
            .await,
            1,
            "{name}: publication {publication}"
        );
    } else {
        // Partition ownership: every worker of both replicas holds partitions
        // (advisory locks).
        common::wait_for_some_or(
            &format!(
                "{name}: {} relay sessions owning partitions",
                scenario.sessions
            ),
            WAIT,
            || runner.log_tails(30),
            || async {
                (owners(db).await == i64::try_from(scenario.sessions).unwrap_or(0)).then_some(())
            },
        )
        .await;
    }

    // The application writes; the spec is edited mid-run.
    let writer = AppWriter::start(
        &db.url,
        WriterOptions {
            aggregate_type: "order".to_owned(),
            aggregates: AGGREGATES,
            writers: 4,
            rollback_ratio: 0.1,
            pause: Duration::from_millis(10),
            failover: false,
        },
    )
    .await;
    writer.allow(BEFORE_ROLL);
    writer.wait_committed(BEFORE_ROLL, WAIT).await;

    let hashes_before = template_hashes(client, ns, name).await;
    assert_eq!(
        hashes_before.len(),
        1,
        "{name}: ReplicaSets {hashes_before:?}"
    );
    (scenario.edit)(&mut manifest);
    let edited = operator::apply_relay(client, ns, &manifest).await;
    assert_eq!(edited.metadata.generation, Some(2), "{name}: spec edit");
    let roll_started = Instant::now();
    let at_edit = writer.committed();
    writer.allow(DURING_ROLL);
    let new_hash = common::wait_for_some_or(
        &format!("{name}: rolled to a new ReplicaSet, old relay processes replaced"),
        WAIT,
        || format!("running: {:?}{}", runner.running(), runner.log_tails(30)),
        || async {
            let hashes = template_hashes(client, ns, name).await;
            let new: Vec<&String> = hashes
                .iter()
                .filter(|(hash, _)| !hashes_before.contains_key(*hash))
                .map(|(hash, _)| hash)
                .collect();
            let [new] = new.as_slice() else {
                return None;
            };
            let old_scaled_down = hashes
                .iter()
                .filter(|(hash, _)| hash != new)
                .all(|(_, replicas)| *replicas == 0);
            let status = deployments.get(&deployment).await.ok()?.status?;
            let want = i32::try_from(scenario.processes).unwrap_or(0);
            let running: BTreeSet<String> = runner.running().into_iter().collect();
            (old_scaled_down
                && status.updated_replicas == Some(want)
                && status.available_replicas == Some(want)
                && status.replicas == Some(want)
                && running.len() == scenario.processes
                && running.is_disjoint(&first))
            .then(|| (*new).clone())
        },
    )
    .await;
    let roll_seconds = roll_started.elapsed().as_secs_f64();
    let at_roll_done = writer.committed();
    // The runner really replaced the processes: each old one ended.
    let history = runner.history();
    for pod in &first {
        assert!(
            history.contains(&ProcessEvent::Ended(pod.clone())),
            "{name}: the process of old pod {pod} never ended: {history:?}"
        );
    }
    if scenario.log_tailing {
        // Recreate: a slot admits one consumer, so the old process ended before any new
        // one started.
        let first_new_start = history
            .iter()
            .position(|e| matches!(e, ProcessEvent::Started(pod) if !first.contains(pod)));
        for pod in &first {
            let ended = history
                .iter()
                .position(|e| *e == ProcessEvent::Ended(pod.clone()));
            assert!(
                ended < first_new_start,
                "{name}: old pod {pod} ended after a new one started: {history:?}"
            );
        }
    }
    assert!(
        at_roll_done > at_edit,
        "{name}: no event was committed while the relay rolled ({at_edit} before, {at_roll_done} after)"
    );
    println!(
        "{name}: spec edit rolled ReplicaSet {:?} -> {new_hash} in {roll_seconds:.1}s; \
         events committed during the roll: {}",
        hashes_before.keys().collect::<Vec<_>>(),
        at_roll_done - at_edit
    );
    wait_ready(&relays, name, runner, Some(2)).await;

    writer.allow(EVENTS);
    let ledger = writer.finish().await;
    assert_eq!(ledger.committed.len(), EVENTS, "{name}: events committed");
    let writing_done = Instant::now();

    // The independent consumer gets every committed event.
    let received = wait_all_received(name, sink, &ledger, runner).await;
    let delivery_seconds = writing_done.elapsed().as_secs_f64();
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    assert!(
        report.missing.is_empty(),
        "{name}: {} committed events never arrived, first {:?}",
        report.missing.len(),
        &report.missing[..report.missing.len().min(20)]
    );
    assert!(
        report.orphans.is_empty(),
        "{name}: {} events arrived that were never committed (rolled back or foreign), first {:?}",
        report.orphans.len(),
        &report.orphans[..report.orphans.len().min(20)]
    );
    assert!(
        report.order_violations.is_empty(),
        "{name}: per-aggregate order broken {} times, first {:?}",
        report.order_violations.len(),
        &report.order_violations[..report.order_violations.len().min(10)]
    );
    for message in &received {
        assert_eq!(
            message.aggregate,
            common::aggregate_of(&message.payload),
            "{name}: message {} carries the wrong aggregate",
            message.id
        );
    }
    let aggregates: BTreeSet<&str> = received.iter().map(|m| m.aggregate.as_str()).collect();
    assert_eq!(aggregates.len(), AGGREGATES, "{name}: aggregates seen");

    // Nothing left to publish, as the database says ...
    let left_sql = if scenario.starts_tailing {
        // deleteAfterPublish: published rows are deleted.
        "SELECT count(*) FROM public.outbox"
    } else {
        // Polling marks rows; after a switch, log tailing deletes the rows it publishes
        // and leaves those polling marked.
        "SELECT count(*) FROM public.outbox WHERE published_at IS NULL"
    };
    common::wait_for_some_or(
        &format!("{name}: no unpublished rows left in the table"),
        WAIT,
        || runner.log_tails(30),
        || async {
            (db.client
                .query_one(left_sql, &[])
                .await
                .is_ok_and(|r| r.get::<_, i64>(0) == 0))
            .then_some(())
        },
    )
    .await;
    // ... and as the OutboxRelay's status says.
    let ready = wait_ready(&relays, name, runner, Some(2)).await;
    let backlog = wait_status_backlog_zero(&relays, name).await;
    if let Err(why) = backlog {
        pending.push(why);
    } else {
        println!("{name}: Ready=True with status.backlogRows 0");
    }
    if let Some((slot, _)) = &slot {
        let reported = ready.status.as_ref().and_then(|s| s.slot.as_ref());
        if reported.is_none_or(|s| &s.name != slot) {
            pending.push(format!(
                "{name}: status.slot does not name slot {slot}: {}",
                operator::describe(Some(&ready))
            ));
        }
    }

    // Deleting the OutboxRelay stops the relay and removes what the operator made.
    relays
        .delete(name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("deleting {name} failed: {e}"));
    common::wait_for_some_or(
        &format!("{name}: OutboxRelay gone and its relay processes stopped"),
        GC_WAIT,
        || format!("running: {:?}{}", runner.running(), runner.log_tails(10)),
        || async {
            (matches!(relays.get_opt(name).await, Ok(None)) && runner.running().is_empty())
                .then_some(())
        },
    )
    .await;
    common::wait_for(
        &format!("{name}: Deployment {deployment} garbage-collected"),
        GC_WAIT,
        || async { matches!(deployments.get_opt(&deployment).await, Ok(None)) },
    )
    .await;
    if let Some((slot, publication)) = &slot {
        let slots = count(
            db,
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            slot,
        )
        .await;
        let publications = count(
            db,
            "SELECT count(*) FROM pg_publication WHERE pubname = $1",
            publication,
        )
        .await;
        if slots != 0 || publications != 0 {
            pending.push(format!(
                "{name}: after deleting the OutboxRelay, slot {slot} is still there ({slots}) \
                 and/or publication {publication} ({publications}): the operator's finalizer \
                 must drop both once the relay's pods are gone"
            ));
        } else {
            println!("{name}: slot {slot} and publication {publication} dropped on delete");
        }
    }

    let figures = Figures {
        events: ledger.committed.len(),
        transactions: ledger.transactions,
        rollbacks: ledger.rollbacks,
        rolled_back_rows: ledger.aborted.len(),
        received: report.received,
        duplicates: report.duplicates,
        written_during_roll: at_roll_done - at_edit,
        roll_seconds,
        delivery_seconds,
        total_seconds: started.elapsed().as_secs_f64(),
    };
    let Figures {
        events,
        transactions,
        rollbacks,
        rolled_back_rows,
        received,
        duplicates,
        written_during_roll,
        roll_seconds,
        delivery_seconds,
        total_seconds,
    } = figures;
    println!(
        "{name}: {events} events committed in {transactions} transactions \
         ({rollbacks} transactions with {rolled_back_rows} rows rolled back, none delivered); \
         consumer received {received} messages, {duplicates} duplicates; \
         {written_during_roll} events written during a {roll_seconds:.1}s roll; \
         all delivered {delivery_seconds:.1}s after the last commit; test body {total_seconds:.0}s"
    );
    assert!(
        pending.is_empty(),
        "{name}: everything else held, but:\n- {}",
        pending.join("\n- ")
    );
}

/// Waits for `Ready=True` (with `DatabaseReady` and `BrokerReady`) for `generation`.
async fn wait_ready(
    relays: &Api<OutboxRelay>,
    name: &str,
    runner: &RelayPods,
    generation: Option<i64>,
) -> OutboxRelay {
    let relay = common::wait_for_some_or(
        &format!("{name}: Ready=True for generation {generation:?}"),
        WAIT,
        || runner.log_tails(30),
        || async {
            let relay = relays.get_opt(name).await.ok().flatten()?;
            (operator::is_ready(&relay) && relay.metadata.generation == generation).then_some(relay)
        },
    )
    .await;
    for type_ in ["DatabaseReady", "BrokerReady"] {
        let cond = operator::condition(&relay, type_)
            .unwrap_or_else(|| panic!("{name}: no {type_} condition"));
        assert_eq!(
            cond.status,
            "True",
            "{name} {type_}: {}",
            operator::describe(Some(&relay))
        );
    }
    relay
}

/// Waits for `status.backlogRows` 0; the error says what the status showed instead.
async fn wait_status_backlog_zero(relays: &Api<OutboxRelay>, name: &str) -> Result<(), String> {
    let deadline = Instant::now() + STATUS_WAIT;
    loop {
        let relay = relays.get(name).await.ok();
        let backlog = relay
            .as_ref()
            .and_then(|r| r.status.as_ref())
            .and_then(|s| s.backlog_rows);
        if backlog == Some(0) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{name}: status.backlogRows is {backlog:?} after {STATUS_WAIT:?} with nothing \
                 left to publish (want Some(0)); status: {}",
                operator::describe(relay.as_ref())
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until the broker holds every committed event and returns all messages read.
async fn wait_all_received(
    name: &str,
    sink: &Sink,
    ledger: &Ledger,
    runner: &RelayPods,
) -> Vec<common::Received> {
    let want = ledger.committed.len() as u64;
    let deadline = Instant::now() + WAIT;
    loop {
        if sink.stored().await >= want {
            let received = sink.received().await;
            let ids: BTreeSet<i64> = received.iter().map(|m| m.id).collect();
            if ledger.committed.is_subset(&ids) {
                return received;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{name}: timed out after {WAIT:?} waiting for {want} events at the broker; it holds {}{}",
            sink.stored().await,
            runner.log_tails(30)
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The relay's ReplicaSets by pod-template hash, with their desired replicas.
async fn template_hashes(client: &Client, ns: &str, name: &str) -> BTreeMap<String, i32> {
    let sets: Api<ReplicaSet> = Api::namespaced(client.clone(), ns);
    sets.list(&ListParams::default().labels(&format!("app.kubernetes.io/instance={name}")))
        .await
        .unwrap_or_else(|e| panic!("listing ReplicaSets: {e}"))
        .items
        .into_iter()
        .filter_map(|rs| {
            let hash = rs.labels().get("pod-template-hash")?.clone();
            Some((hash, rs.spec.and_then(|s| s.replicas).unwrap_or(0)))
        })
        .collect()
}

/// Sessions holding partition locks in the test database: the relay workers that
/// own partitions (not the housekeeping session, which holds the retention lock).
async fn owners(db: &common::TestDatabase) -> i64 {
    db.client
        .query_one(
            "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' \
             AND granted AND objsubid = 2 AND objid::int8 < 1024 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

async fn count(db: &common::TestDatabase, sql: &str, arg: &str) -> i64 {
    db.client
        .query_one(sql, &[&arg])
        .await
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_kafka_relay_runs_end_to_end_through_the_operator() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    let topic = common::fresh_topic(4).await;
    let manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "orders"},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"polling": {"interval": "100ms", "batchSize": 200, "afterPublish": "mark", "workers": 2}},
            "broker": {"kafka": {"bootstrapServers": rig.kafka_bootstrap(), "topic": topic}},
            "ordering": {"mode": "perAggregate", "partitions": 8},
            "replicas": 2,
        }
    });
    let scenario = Scenario {
        name: "orders",
        partitions: 8,
        manifest,
        edit: |m| m["spec"]["mode"]["polling"]["batchSize"] = json!(150),
        processes: 2,
        sessions: 4,
        log_tailing: false,
        starts_tailing: false,
        ids: OutboxIds::Bigint,
    };
    run(scenario, Sink::Kafka { topic }, db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_nats_relay_runs_end_to_end_through_the_operator() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    let stream = common::fresh_stream().await;
    let manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "payments"},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"logTailing": {"heartbeatInterval": "5s", "deleteAfterPublish": true}},
            "broker": {"nats": {
                "url": rig.nats_url(),
                "subject": format!("{}.{{aggregateType}}", stream.subject_prefix)}},
        }
    });
    let scenario = Scenario {
        name: "payments",
        partitions: 4,
        manifest,
        edit: |m| m["spec"]["mode"]["logTailing"]["heartbeatInterval"] = json!("7s"),
        processes: 1,
        sessions: 0,
        log_tailing: true,
        starts_tailing: true,
        ids: OutboxIds::Bigint,
    };
    run(scenario, Sink::Nats(Box::new(stream)), db).await;
}

/// A polling relay switched to log tailing while the application writes: the slot the
/// switch creates streams only later commits, so the operator keeps the polling relay
/// until it has published every row committed before the slot, then replaces it.
/// Polling every 3 s, there are always such rows at the switch; before the handover
/// they were never published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_relay_switched_to_log_tailing_loses_nothing() {
    switch_scenario(OutboxIds::Bigint).await;
}

/// The same switch on a table whose message ids are random uuids: the polling relay
/// orders rows by `created_at`, and the hand-over tells rows before the slot by their
/// inserting transaction, not their id; nothing is lost or reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_relay_on_a_uuid_table_switched_to_log_tailing_loses_nothing() {
    switch_scenario(OutboxIds::Uuid).await;
}

async fn switch_scenario(ids: OutboxIds) {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    let topic = common::fresh_topic(4).await;
    let manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "switch"},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"polling": {"interval": "3s", "batchSize": 500, "afterPublish": "mark"}},
            "broker": {"kafka": {"bootstrapServers": rig.kafka_bootstrap(), "topic": topic}},
            "ordering": {"mode": "perAggregate", "partitions": 4},
            "replicas": 1,
        }
    });
    let scenario = Scenario {
        name: "switch",
        partitions: 4,
        manifest,
        edit: |m| {
            m["spec"]["mode"] =
                json!({"logTailing": {"heartbeatInterval": "5s", "deleteAfterPublish": true}});
        },
        processes: 1,
        sessions: 1,
        log_tailing: true,
        starts_tailing: false,
        ids,
    };
    run(scenario, Sink::Kafka { topic }, db).await;
}
