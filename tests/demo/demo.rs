//! `make demo`: the operator end to end on the local control plane, interactively.
//!
//! Run by tests/rig/demo.sh (which starts a rig of its own and installs the chart's
//! CRDs) or, against a running rig, as `OUTBOX_RIG_ENV=.rig/rig.env cargo run --example
//! demo`. For three examples from `examples/` — polling to Kafka, polling to NATS
//! JetStream, log tailing to RabbitMQ — it creates a namespace, a database from
//! `examples/schema.sql`, the Secrets the example's header asks for and the broker's
//! topic / stream / queue, and applies the example (broker addresses pointed at the
//! rig). Then it runs the `outbox-operator controller` binary — its relay pods run as
//! containers on the rig's node (kubelet, containerd, runc) from the operator's image
//! built from this checkout, or, when another rig has the node, on the pod runner as
//! local processes — a small event generator per database
//! and a consumer per broker; it prints a line per batch of events each relay delivered
//! and, every few seconds, `kubectl get obr` with its BACKLOG and OLDEST columns.
//!
//! Ctrl-C (SIGINT), SIGTERM or `--duration` end it: the OutboxRelays are deleted (the
//! operator stops their relays), the operator is stopped, and everything the demo made
//! is removed. Every process it started is stopped by its PID.

#![forbid(unsafe_code)]

#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use outbox_operator::api::OutboxRelay;
use serde_json::json;
use tokio::sync::{mpsc, watch};

use common::node::RelayPods;
use common::operator::{self, ControllerProcess};

#[derive(Parser, Debug)]
#[command(about = "outbox-operator end to end on a local control plane")]
struct Args {
    /// Stop on its own after this long (`40s`, `5m`); default: run until Ctrl-C.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Prefix of the names the demo creates (namespaces, aggregate type, stream).
    #[arg(long, default_value = "demo")]
    prefix: String,
    /// The rig is shared with other tests: run one operator per demo namespace (each
    /// watching only its own) instead of one for the whole cluster.
    #[arg(long)]
    shared_rig: bool,
    /// Events each generator writes per second.
    #[arg(long, default_value_t = 20)]
    rate: u32,
    /// Seconds between two `kubectl get obr` tables.
    #[arg(long, default_value_t = 5)]
    table_every: u64,
}

/// The examples the demo applies, and the broker each publishes to.
const EXAMPLES: [(&str, Broker); 3] = [
    ("polling-kafka", Broker::Kafka),
    ("polling-nats", Broker::Nats),
    ("log-tailing-rabbitmq", Broker::Rabbitmq),
];

#[derive(Clone, Copy, Debug)]
enum Broker {
    Kafka,
    Nats,
    Rabbitmq,
}

/// One example as the demo set it up.
struct Relay {
    example: &'static str,
    namespace: String,
    database: common::TestDatabase,
    slot: Option<String>,
}

fn say(line: &str) {
    println!("[demo {}] {line}", clock());
}

fn clock() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "{:02}:{:02}:{:02}",
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let rig = common::Rig::load();
    let client = common::kube_client().await;
    require_crd(&client).await;
    let aggregate_type = format!("{}-order", args.prefix);
    let started = Instant::now();

    // --- what the examples need, made the way their headers say -------------------------
    let mut relays = Vec::new();
    for (example, broker) in EXAMPLES {
        let namespace = format!("{}-{example}", args.prefix);
        create_namespace(&client, &namespace).await;
        let database = operator::example_database().await;
        let data = common::node::db_secret_for_pods(&database.url);
        let data: Vec<(&str, &str)> = data.iter().map(|(k, v)| (*k, v.as_str())).collect();
        operator::create_secret(&client, &namespace, "orders-db", &data).await;
        let mut manifest = operator::example_manifest(&format!("{example}.yaml"));
        manifest["metadata"]["labels"] = json!({"outbox.dev/demo": args.prefix});
        match broker {
            Broker::Kafka => {
                manifest["spec"]["broker"]["kafka"]["bootstrapServers"] =
                    json!(rig.kafka_bootstrap());
            }
            Broker::Nats => manifest["spec"]["broker"]["nats"]["url"] = json!(rig.nats_url()),
            Broker::Rabbitmq => {
                operator::create_secret(
                    &client,
                    &namespace,
                    "orders-amqp",
                    &[("uri", &common::node::amqp_for_pods())],
                )
                .await;
            }
        }
        let slot = manifest["spec"]["mode"]
            .get("logTailing")
            .map(|_| outbox_operator::relay::config::default_slot_name(&namespace, example));
        say(&format!(
            "{example}: namespace {namespace}, database {}, Secret orders-db",
            database.name
        ));
        relays.push((
            Relay {
                example,
                namespace,
                database,
                slot,
            },
            manifest,
            broker,
        ));
    }

    // --- consumers first, so every event is seen ------------------------------------------
    let (seen_tx, seen_rx) = mpsc::unbounded_channel::<(&'static str, i64)>();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut nats_stream = None;
    let mut amqp_queue = None;
    for (relay, _, broker) in &relays {
        let seen = seen_tx.clone();
        let stop = stop_rx.clone();
        let example = relay.example;
        match broker {
            Broker::Kafka => {
                let topic = format!("outbox.event.{aggregate_type}");
                common::create_topic(rig.kafka_bootstrap(), &topic, 3, &[]).await;
                tasks.push(tokio::spawn(consume_kafka(topic, example, seen, stop)));
            }
            Broker::Nats => {
                let subject = format!("outbox.{aggregate_type}");
                let stream = nats_stream_for(&subject, &args.prefix).await;
                let subscriber = stream
                    .client
                    .subscribe(subject.clone())
                    .await
                    .unwrap_or_else(|e| panic!("NATS subscribe {subject}: {e}"));
                tasks.push(tokio::spawn(consume_nats(subscriber, example, seen, stop)));
                nats_stream = Some(stream);
            }
            Broker::Rabbitmq => {
                let queue = amqp_queue_for(&aggregate_type).await;
                let consumer = amqp_consumer(&queue).await;
                tasks.push(tokio::spawn(consume_amqp(consumer, example, seen, stop)));
                amqp_queue = Some(queue);
            }
        }
    }
    drop(seen_tx);

    // --- where relay pods run, and the operator ---------------------------------------------
    let mut runners = Vec::new();
    for (relay, _, _) in &relays {
        runners.push(Arc::new(RelayPods::start(&client, &relay.namespace).await));
    }
    if common::node::available() {
        say(&format!(
            "relay pods run as containers on node {} (kubelet, containerd, runc) from image {}",
            common::node::name(),
            common::node::operator_image().0
        ));
    } else {
        say("pod runner running: relay pods run as local processes (this rig has no node)");
    }
    let env: Vec<(&str, String)> = runners
        .first()
        .map(|r| r.controller_env())
        .unwrap_or_default();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut controllers = Vec::new();
    if args.shared_rig {
        for (relay, _, _) in &relays {
            controllers.push(ControllerProcess::start_with_env(
                Some(&relay.namespace),
                &format!("outbox-operator-{}", relay.namespace),
                &relay.namespace,
                &env,
            ));
        }
    } else {
        controllers.push(ControllerProcess::start_with_env(
            None,
            "outbox-operator-demo",
            "default",
            &env,
        ));
    }
    for controller in &controllers {
        say(&format!(
            "operator running: outbox-operator controller (pid {})",
            controller.pid()
        ));
    }
    for ((relay, manifest, _), runner) in relays.iter().zip(&runners) {
        runner
            .apply_relay(&client, &relay.namespace, manifest)
            .await;
        say(&format!(
            "applied examples/{}.yaml in namespace {}",
            relay.example, relay.namespace
        ));
    }

    // --- the application: a few events per second into each database -----------------------
    for (relay, _, _) in &relays {
        let url = relay.database.url.clone();
        let aggregate_type = aggregate_type.clone();
        let stop = stop_rx.clone();
        let slot = relay.slot.clone();
        let rate = args.rate;
        tasks.push(tokio::spawn(async move {
            generate(&url, &aggregate_type, rate, slot.as_deref(), stop).await;
        }));
    }
    let printer = tokio::spawn(print_arrivals(seen_rx));
    let table = tokio::spawn(print_tables(
        rig.kubectl().to_owned(),
        rig.kubeconfig().to_owned(),
        args.prefix.clone(),
        Duration::from_secs(args.table_every.max(1)),
        stop_rx.clone(),
    ));

    say(match args.duration {
        Some(_) => "running; stops on its own after --duration (or on Ctrl-C)",
        None => "running; press Ctrl-C to stop",
    });
    wait_for_stop(args.duration).await;
    say(&format!(
        "stopping after {:.0}s",
        started.elapsed().as_secs_f64()
    ));

    // --- shut down, in the order a cluster would -------------------------------------------
    let _ = stop_tx.send(true);
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), table).await;
    say("generators and consumers stopped; deleting the OutboxRelays");
    let mut clean = true;
    for (relay, manifest, _) in &relays {
        let name = manifest["metadata"]["name"].as_str().unwrap_or_default();
        let api: Api<OutboxRelay> = Api::namespaced(client.clone(), &relay.namespace);
        let _ = api.delete(name, &DeleteParams::default()).await;
    }
    for ((relay, manifest, _), runner) in relays.iter().zip(&runners) {
        let name = manifest["metadata"]["name"].as_str().unwrap_or_default();
        let api: Api<OutboxRelay> = Api::namespaced(client.clone(), &relay.namespace);
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let gone = matches!(api.get_opt(name).await, Ok(None));
            if gone && runner.running().is_empty() {
                say(&format!(
                    "{}: OutboxRelay deleted, relay processes stopped",
                    relay.example
                ));
                break;
            }
            if Instant::now() > deadline {
                say(&format!(
                    "{}: not gone after 90s (running: {:?})",
                    relay.example,
                    runner.running()
                ));
                clean = false;
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    for controller in &mut controllers {
        match controller.stop(Duration::from_secs(60)) {
            Ok(status) if status.success() => {
                say(&format!("operator (pid {}) stopped", controller.pid()));
            }
            Ok(status) => {
                say(&format!("operator exited with {status}"));
                clean = false;
            }
            Err(err) => {
                say(&err);
                clean = false;
            }
        }
    }
    drop(runners);
    let _ = tokio::time::timeout(Duration::from_secs(5), printer).await;

    for (relay, _, _) in relays {
        if let Some(slot) = &relay.slot {
            let left = relay
                .database
                .client
                .query_one(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
                    &[slot],
                )
                .await
                .map_or(-1, |r| r.get::<_, i64>(0));
            if left != 0 {
                say(&format!(
                    "{}: replication slot {slot} was left behind; dropping it",
                    relay.example
                ));
                if let Err(err) =
                    operator::drop_slot_and_publication(slot, slot, &relay.database.url).await
                {
                    say(&err);
                    clean = false;
                }
            }
        }
        common::delete_namespace(&client, &relay.namespace).await;
        relay.database.drop_database().await;
    }
    if let Some(stream) = nats_stream {
        let _ = stream.jetstream.delete_stream(&stream.name).await;
    }
    if let Some(queue) = amqp_queue {
        let _ = queue
            .channel
            .queue_delete(
                queue.name.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await;
    }
    say(if clean {
        "demo stopped; everything it started is gone"
    } else {
        "demo stopped, but not everything stopped cleanly (see above)"
    });
    if !clean {
        std::process::exit(1);
    }
}

/// The chart's CRD must be installed (tests/rig/demo.sh applies
/// charts/outbox-operator/crds); fails with one line saying how otherwise.
async fn require_crd(client: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let established = crds
        .get_opt("outboxrelays.outbox.dev")
        .await
        .ok()
        .flatten()
        .and_then(|c| c.status)
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Established" && c.status == "True");
    if !established {
        eprintln!(
            "the OutboxRelay CRD is not installed: kubectl apply --server-side -f charts/outbox-operator/crds"
        );
        std::process::exit(2);
    }
}

async fn create_namespace(client: &kube::Client, name: &str) {
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                "outbox.dev/demo".to_owned(),
                "true".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "creating namespace {name} failed (left from an earlier run? delete it first): {e}"
            )
        });
}

/// Waits for SIGINT, SIGTERM or the end of `duration`.
async fn wait_for_stop(duration: Option<Duration>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term =
        signal(SignalKind::terminate()).unwrap_or_else(|e| panic!("installing SIGTERM: {e}"));
    let mut int =
        signal(SignalKind::interrupt()).unwrap_or_else(|e| panic!("installing SIGINT: {e}"));
    let timer = async {
        match duration {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        () = timer => {}
    }
}

/// Writes `rate` events a second into the database at `url`, in small transactions over
/// five aggregates. For log tailing it first waits for the slot: rows committed before
/// the slot exists are never streamed.
async fn generate(
    url: &str,
    aggregate_type: &str,
    rate: u32,
    slot: Option<&str>,
    mut stop: watch::Receiver<bool>,
) {
    let Ok(mut client) = common::pg_connect(url).await else {
        say("generator: cannot connect to the database");
        return;
    };
    if let Some(slot) = slot {
        loop {
            let ready = client
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .ok()
                .flatten()
                .is_some();
            if ready || *stop.borrow() {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(500), stop.changed()).await;
        }
    }
    let per_tx = 5_u32;
    let pause = Duration::from_secs_f64(f64::from(per_tx) / f64::from(rate.max(1)));
    let mut n: u64 = 0;
    while !*stop.borrow() {
        let Ok(tx) = client.transaction().await else {
            return;
        };
        for _ in 0..per_tx {
            n += 1;
            let aggregate = format!("order-{}", n % 5);
            let payload = json!({"aggregate": aggregate, "n": n}).to_string();
            let _ = tx
                .execute(
                    "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
                     VALUES ($1, $2, 'OrderChanged', ($3::text)::jsonb)",
                    &[&aggregate_type, &aggregate, &payload],
                )
                .await;
        }
        let _ = tx.commit().await;
        let _ = tokio::time::timeout(pause, stop.changed()).await;
    }
}

async fn consume_kafka(
    topic: String,
    example: &'static str,
    seen: mpsc::UnboundedSender<(&'static str, i64)>,
    mut stop: watch::Receiver<bool>,
) {
    use rdkafka::Message;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::Headers;
    let consumer: StreamConsumer = common::kafka_config()
        .set("group.id", format!("demo-{}", common::unique_suffix()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap_or_else(|e| panic!("Kafka consumer: {e}"));
    consumer
        .subscribe(&[&topic])
        .unwrap_or_else(|e| panic!("Kafka subscribe {topic}: {e}"));
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            message = consumer.recv() => {
                let Ok(message) = message else { continue };
                let id = message.headers().and_then(|h| {
                    h.iter().find(|h| h.key == "id").and_then(|h| {
                        std::str::from_utf8(h.value?).ok()?.parse().ok()
                    })
                });
                if let Some(id) = id {
                    let _ = seen.send((example, id));
                }
            }
        }
    }
}

async fn nats_stream_for(subject: &str, prefix: &str) -> common::TestStream {
    let client = common::nats_connect().await;
    let jetstream = async_nats::jetstream::new(client.clone());
    let name = format!("DEMO_{}", prefix.to_uppercase().replace('-', "_"));
    jetstream
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.to_owned()],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("NATS: creating stream {name} for {subject} failed: {e}"));
    common::TestStream {
        client,
        jetstream,
        name,
        subject_prefix: subject.to_owned(),
    }
}

async fn consume_nats(
    mut subscriber: async_nats::Subscriber,
    example: &'static str,
    seen: mpsc::UnboundedSender<(&'static str, i64)>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            message = subscriber.next() => {
                let Some(message) = message else { return };
                let id = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("id"))
                    .and_then(|v| v.as_str().parse().ok());
                if let Some(id) = id {
                    let _ = seen.send((example, id));
                }
            }
        }
    }
}

/// A queue bound to exchange `outbox` (the example's) for the demo's routing key.
async fn amqp_queue_for(routing_key: &str) -> common::TestQueue {
    let queue = common::fresh_queue().await;
    common::bind_queue(&queue, "outbox", routing_key).await;
    queue
}

async fn amqp_consumer(queue: &common::TestQueue) -> lapin::Consumer {
    use lapin::options::BasicConsumeOptions;
    use lapin::types::FieldTable;
    queue
        .channel
        .basic_consume(
            queue.name.as_str().into(),
            "demo".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ basic_consume: {e}"))
}

async fn consume_amqp(
    mut consumer: lapin::Consumer,
    example: &'static str,
    seen: mpsc::UnboundedSender<(&'static str, i64)>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            delivery = consumer.next() => {
                let Some(Ok(delivery)) = delivery else { return };
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|v| v.as_str().parse().ok());
                if let Some(id) = id {
                    let _ = seen.send((example, id));
                }
            }
        }
    }
}

/// Prints, once a second, a line per relay that delivered events since the last one.
async fn print_arrivals(mut seen: mpsc::UnboundedReceiver<(&'static str, i64)>) {
    let mut totals: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut batch: BTreeMap<&'static str, (u64, i64, i64)> = BTreeMap::new();
    loop {
        tokio::select! {
            got = seen.recv() => {
                let Some((example, id)) = got else { break };
                let entry = batch.entry(example).or_insert((0, i64::MAX, i64::MIN));
                entry.0 += 1;
                entry.1 = entry.1.min(id);
                entry.2 = entry.2.max(id);
            }
            _ = tick.tick() => flush(&mut batch, &mut totals),
        }
    }
    flush(&mut batch, &mut totals);
}

fn flush(
    batch: &mut BTreeMap<&'static str, (u64, i64, i64)>,
    totals: &mut BTreeMap<&'static str, u64>,
) {
    for (example, (count, low, high)) in std::mem::take(batch) {
        let total = totals.entry(example).or_default();
        *total += count;
        say(&format!(
            "received {example:<22} +{count:<4} events (ids {low}..{high}), {total} in all"
        ));
    }
}

/// Prints `kubectl get obr` for the demo's relays every `every`.
async fn print_tables(
    kubectl: std::path::PathBuf,
    kubeconfig: std::path::PathBuf,
    prefix: String,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        if tokio::time::timeout(every, stop.changed()).await.is_ok() {
            return;
        }
        let output = tokio::process::Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            // The full resource name: on a shared rig, test CRDs may claim `obr` too.
            .args(["get", "outboxrelays.outbox.dev", "-A"])
            .args(["-l", &format!("outbox.dev/demo={prefix}")])
            .stdin(std::process::Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .output()
            .await;
        match output {
            Ok(output) => {
                say("kubectl get obr -A   (outboxrelays.outbox.dev)");
                print!("{}", String::from_utf8_lossy(&output.stdout));
                eprint!("{}", String::from_utf8_lossy(&output.stderr));
            }
            Err(err) => say(&format!("kubectl: {err}")),
        }
    }
}
