//! What only a kubelet does to a relay pod, on the rig's real node (issue #20): the
//! liveness probe restarting a relay that hangs, and the runtime killing a relay that
//! passes its memory limit. Both through the controller binary, the operator's image and
//! a writer committing throughout; the test's own consumer checks that every committed
//! event arrives, in per-aggregate order. (A spec change rolling the Deployment without
//! loss is e2e_operator's, which runs on the node too.)

use crate::common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ContainerStatus, Event, Pod};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use outbox_operator::api::OutboxRelay;
use serde_json::{Value, json};

use common::app_writer::{AppWriter, Ledger, WriterOptions};
use common::node::RelayPods;
use common::operator::{self, ControllerProcess};
use common::pod_runner::MANAGED_PODS;

const WAIT: Duration = Duration::from_secs(120);

/// Where the test's consumer reads the relay's messages.
enum Sink {
    Nats(common::TestStream),
    /// The queue, and what was read from it so far (reading takes the messages).
    Rabbit(common::TestQueue, std::sync::Mutex<Vec<common::Received>>),
}

impl Sink {
    async fn nats() -> Self {
        Self::Nats(common::fresh_stream().await)
    }

    async fn rabbit() -> Self {
        Self::Rabbit(common::fresh_queue().await, std::sync::Mutex::default())
    }

    /// The relay's `spec.broker`; a RabbitMQ URL is read from Secret `orders-mq`.
    async fn broker(&self) -> Value {
        match self {
            Self::Nats(stream) => json!({"nats": {
                "url": common::Rig::load().nats_url(),
                "subject": format!("{}.{{aggregateType}}", stream.subject_prefix)}}),
            Self::Rabbit(queue, _) => json!({"rabbitmq": {
                "urlSecretRef": {"name": "orders-mq", "key": "url"},
                "allowPlaintextCredentials": true,
                "exchange": common::fresh_exchange_for(queue).await,
                "routingKey": "{aggregateType}"}}),
        }
    }

    async fn received(&self) -> Vec<common::Received> {
        match self {
            Self::Nats(stream) => common::consume_nats(stream).await,
            Self::Rabbit(queue, read) => {
                let more = common::consume_amqp(queue).await;
                let mut read = read
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                read.extend(more);
                read.clone()
            }
        }
    }

    async fn delete(self) {
        if let Self::Nats(stream) = self {
            let _ = stream.jetstream.delete_stream(&stream.name).await;
        }
    }
}

/// One log-tailing relay on the node, with the writer and the consumer.
struct Setup {
    client: Client,
    ns: String,
    controller: ControllerProcess,
    pods: RelayPods,
    db: common::TestDatabase,
    sink: Sink,
    writer: AppWriter,
    manifest: Value,
}

const NAME: &str = "kubelet";

async fn setup(relay: Value, sink: Sink) -> Setup {
    common::node::name();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let pods = RelayPods::start(&client, &ns).await;
    let controller = pods.controller(&ns, &[]);
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &pods.url(&db.url))]).await;
    operator::create_secret(&client, &ns, "orders-mq", &[("url", &pods.amqp_url())]).await;
    let mut manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": NAME},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"logTailing": {"heartbeatInterval": "5s", "deleteAfterPublish": true}},
            "broker": sink.broker().await,
            "ordering": {"mode": "perAggregate", "partitions": 4},
            "relay": relay,
        }
    });
    pods.adapt(&mut manifest);
    operator::apply_relay(&client, &ns, &manifest).await;
    let writer = AppWriter::start(
        &db.url,
        WriterOptions {
            aggregates: 50,
            writers: 2,
            pause: Duration::from_millis(10),
            ..WriterOptions::default()
        },
    )
    .await;
    Setup {
        client,
        ns,
        controller,
        pods,
        db,
        sink,
        writer,
        manifest,
    }
}

impl Setup {
    fn relays(&self) -> Api<OutboxRelay> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The relay's one pod and its relay container's status, once it has one.
    async fn pod(&self) -> Option<(Pod, ContainerStatus)> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        let list = pods
            .list(&ListParams::default().labels(MANAGED_PODS))
            .await
            .ok()?;
        let pod = list
            .items
            .into_iter()
            .find(|p| p.metadata.deletion_timestamp.is_none())?;
        let status = pod
            .status
            .as_ref()?
            .container_statuses
            .as_ref()?
            .iter()
            .find(|c| c.name == "relay")?
            .clone();
        Some((pod, status))
    }

    /// Waits for the relay Ready with its slot streaming and `events` committed.
    async fn wait_streaming(&self, events: usize) {
        self.writer.allow(events);
        let slot = outbox_operator::relay::config::default_slot_name(&self.ns, NAME);
        common::wait_for_some_or(
            "the relay Ready on the node, its slot streaming",
            WAIT,
            || self.pods.log_tails(30),
            || async {
                let relay = self.relays().get_opt(NAME).await.ok().flatten()?;
                let active = common::slot_active(&self.db.client, &slot).await;
                (operator::is_ready(&relay) && active && self.writer.committed() >= events)
                    .then_some(())
            },
        )
        .await;
    }

    /// Lets the writer finish `total` events and checks the consumer received every
    /// committed one (and `extra` ids committed by the test), in per-aggregate order.
    async fn finish(self, total: usize, extra: &BTreeSet<i64>) -> (Ledger, common::DeliveryReport) {
        self.writer.allow(total);
        let mut ledger = self.writer.finish().await;
        ledger.committed.extend(extra.iter().copied());
        let want = ledger.committed.len();
        let received = common::wait_for_some_or(
            &format!("all {want} committed events at the consumer"),
            WAIT,
            || self.pods.log_tails(30),
            || async {
                let received = self.sink.received().await;
                let ids: BTreeSet<i64> = received.iter().map(|m| m.id).collect();
                ledger.committed.is_subset(&ids).then_some(received)
            },
        )
        .await;
        let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
        report.assert_complete();
        operator::delete_relays(&self.client, &self.ns, WAIT).await;
        let mut controller = self.controller;
        let stopped = controller.stop(WAIT);
        drop(self.pods);
        common::delete_namespace(&self.client, &self.ns).await;
        self.sink.delete().await;
        self.db.drop_database().await;
        assert!(stopped.is_ok_and(|s| s.success()), "the controller's exit");
        (ledger, report)
    }

    /// Waits for `Ready=False` with `reason` on the OutboxRelay and returns the condition.
    async fn wait_not_ready(
        &self,
        reason: &str,
    ) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        common::wait_for_some_or(
            &format!("Ready=False with reason {reason} on the OutboxRelay"),
            WAIT,
            || self.pods.log_tails(20),
            || async {
                let relay = self.relays().get_opt(NAME).await.ok().flatten()?;
                operator::condition(&relay, "Ready")
                    .filter(|c| c.status == "False" && c.reason == reason)
            },
        )
        .await
    }

    /// Kubelet Events about the relay's pods: (reason, message).
    async fn pod_events(&self) -> Vec<(String, String)> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.ns);
        events
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.involved_object.kind.as_deref() == Some("Pod"))
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
            .collect()
    }
}

/// The host PID of a running container, as its runtime reports it (`crictl inspect`).
pub(crate) fn container_pid(container_id: &str) -> i64 {
    let rig = common::Rig::load();
    let id = container_id
        .strip_prefix("containerd://")
        .unwrap_or(container_id);
    let out = std::process::Command::new(rig.get("OUTBOX_RIG_CRICTL"))
        .args([
            "--runtime-endpoint",
            &format!("unix://{}", rig.get("OUTBOX_RIG_CONTAINERD_SOCK")),
            "inspect",
            id,
        ])
        .output()
        .unwrap_or_else(|e| panic!("crictl inspect: {e}"));
    assert!(
        out.status.success(),
        "crictl inspect: {}",
        common::describe_output(&out)
    );
    let inspect: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("crictl inspect: {e}"));
    inspect["info"]["pid"]
        .as_i64()
        .unwrap_or_else(|| panic!("no pid in crictl inspect: {inspect}"))
}

fn signal(pid: i64, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap_or_else(|e| panic!("kill: {e}"));
    assert!(status.success(), "kill -{signal} {pid}");
}

/// First a relay no node takes (a node selector nothing matches): the scheduler's reason
/// is the OutboxRelay's (`RelayUnschedulable`), and fixing the selector brings it up.
/// Then it stops answering (SIGSTOP: its loop, its probes, everything), fails its
/// liveness probe, and the kubelet kills it after the probe's own short grace period and
/// starts it again; nothing committed meanwhile is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_relay_is_restarted_by_its_liveness_probe_and_loses_nothing() {
    let setup = setup(
        json!({"nodeSelector": {"outbox.dev/pool": "nonexistent"}}),
        Sink::nats().await,
    )
    .await;
    let why = setup.wait_not_ready("RelayUnschedulable").await;
    assert!(why.message.contains("no node takes it"), "{}", why.message);
    println!("Ready=False RelayUnschedulable: {}", why.message);
    let mut manifest = setup.manifest.clone();
    if let Some(relay) = manifest["spec"]["relay"].as_object_mut() {
        relay.remove("nodeSelector");
    }
    operator::apply_relay(&setup.client, &setup.ns, &manifest).await;

    setup.wait_streaming(1_000).await;
    let (pod, status) = setup.pod().await.unwrap_or_else(|| panic!("no relay pod"));
    let old = status
        .container_id
        .clone()
        .unwrap_or_else(|| panic!("the relay container has no id: {status:?}"));
    let pid = container_pid(&old);
    signal(pid, "STOP");
    let hung = Instant::now();
    setup.writer.allow(3_000);

    let restarted = common::wait_for_some_or(
        "the kubelet restarting the hung relay container",
        WAIT,
        || setup.pods.log_tails(20),
        || async {
            let (p, s) = setup.pod().await?;
            let running = s.state.as_ref()?.running.is_some();
            (p.name_any() == pod.name_any()
                && s.restart_count >= 1
                && running
                && s.container_id.as_deref() != Some(old.as_str()))
            .then_some(s)
        },
    )
    .await;
    let seconds = hung.elapsed().as_secs_f64();
    let events = setup.pod_events().await;
    assert!(
        events
            .iter()
            .any(|(r, m)| r == "Unhealthy" && m.contains("Liveness probe failed")),
        "no liveness failure among the pod's Events: {events:?}"
    );
    assert!(
        events
            .iter()
            .any(|(r, m)| r == "Killing" && m.contains("failed liveness probe")),
        "no kill for the failed liveness probe among the pod's Events: {events:?}"
    );
    let terminated = restarted
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.clone())
        .unwrap_or_else(|| panic!("no last state after the restart: {restarted:?}"));
    println!(
        "hung relay (pid {pid}) restarted by the kubelet {seconds:.1}s after SIGSTOP; \
         the old container ended with {} ({:?}); restarts: {}",
        terminated.exit_code, terminated.reason, restarted.restart_count
    );
    let (ledger, report) = setup.finish(5_000, &BTreeSet::new()).await;
    println!(
        "liveness: {} events committed, {} received, {} duplicates, 0 lost, 0 reordered",
        ledger.committed.len(),
        report.received,
        report.duplicates
    );
}

/// One event too large for the relay's memory limit of 64Mi (48 MiB, which RabbitMQ
/// takes: its limit is 128 MiB) takes the relay past it: the runtime kills it (OOMKilled), and the
/// kubelet restarts it, again and again on the same event, as it would in a cluster.
/// The OutboxRelay's `Ready` says so (`RelayOOMKilled`, with the limit). Raising the
/// limit rolls the Deployment, and every event arrives: those from before,
/// the large one, and those committed while the relay was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_for_memory_comes_back_and_loses_nothing() {
    let limited = json!({"resources": {
        "requests": {"cpu": "50m", "memory": "32Mi"},
        "limits": {"memory": "64Mi"}}});
    let setup = setup(limited, Sink::rabbit().await).await;
    setup.wait_streaming(1_000).await;
    let (pod, status) = setup.pod().await.unwrap_or_else(|| panic!("no relay pod"));
    assert_eq!(
        status.restart_count, 0,
        "the relay restarted before the large event: {status:?}"
    );

    let large: BTreeSet<i64> = setup
        .db
        .client
        .query(
            "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload)
             VALUES ($1, 'large', 'Large',
                     jsonb_build_object('aggregate', 'large', 'blob', repeat('x', 48 * 1024 * 1024)))
             RETURNING id",
            &[&WriterOptions::default().aggregate_type],
        )
        .await
        .unwrap_or_else(|e| panic!("inserting the large event: {e}"))
        .iter()
        .map(|r| r.get(0))
        .collect();
    let committed_at = Instant::now();
    setup.writer.allow(2_000);
    let killed = common::wait_for_some_or(
        "the runtime killing the relay for memory (OOMKilled), the kubelet restarting it",
        WAIT,
        || setup.pods.log_tails(20),
        || async {
            let (p, s) = setup.pod().await?;
            let reason = s.last_state.as_ref()?.terminated.as_ref()?.reason.clone()?;
            (p.name_any() == pod.name_any() && reason == "OOMKilled" && s.restart_count >= 1)
                .then_some(s)
        },
    )
    .await;
    println!(
        "relay OOMKilled {:.1}s after the large event's commit; restarts so far: {}",
        committed_at.elapsed().as_secs_f64(),
        killed.restart_count
    );

    // The OutboxRelay says why its relay is down, and what to change.
    let why = setup.wait_not_ready("RelayOOMKilled").await;
    assert!(
        why.message.contains("64Mi") && why.message.contains("spec.relay.resources.limits.memory"),
        "{}",
        why.message
    );
    println!("Ready=False RelayOOMKilled: {}", why.message);

    // The user raises the limit: a new pod, and everything arrives.
    let mut manifest = setup.manifest.clone();
    manifest["spec"]["relay"]["resources"]["limits"]["memory"] = json!("512Mi");
    operator::apply_relay(&setup.client, &setup.ns, &manifest).await;
    common::wait_for_some_or(
        "a new relay pod with the raised limit, Ready",
        WAIT,
        || setup.pods.log_tails(20),
        || async {
            let (p, s) = setup.pod().await?;
            let relay = setup.relays().get_opt(NAME).await.ok().flatten()?;
            (p.name_any() != pod.name_any()
                && s.ready
                && operator::is_ready(&relay)
                && relay.metadata.generation == Some(2))
            .then_some(())
        },
    )
    .await;
    let (ledger, report) = setup.finish(4_000, &large).await;
    println!(
        "OOM: {} events committed (one of 48 MiB), {} received, {} duplicates, \
         0 lost, 0 reordered",
        ledger.committed.len(),
        report.received,
        report.duplicates
    );
}

/// A relay its broker refuses for good (a Kafka user the cluster's ACLs deny an
/// idempotent producer, which librdkafka makes a fatal error) exits saying why; the
/// kubelet keeps that as the container's termination message, and the OutboxRelay's
/// `Ready` condition repeats it (`RelayCrashLooping`), so `kubectl get` tells the user
/// what to fix rather than "its log says why". Giving the Secret a user the broker
/// takes brings the relay up, and every row committed meanwhile arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_its_broker_refuses_says_why_in_its_status_and_loses_nothing() {
    const RELAY: &str = "refused";
    const ROWS: usize = 20;
    common::node::name();
    let rig = common::Rig::load();
    let denied = rig.get("OUTBOX_RIG_KAFKA_DENIED_USER").to_owned();
    let denied_password = rig.get("OUTBOX_RIG_KAFKA_DENIED_PASSWORD").to_owned();
    tokio::task::spawn_blocking({
        let denied = denied.clone();
        move || common::deny_idempotent_writes(&denied)
    })
    .await
    .unwrap();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(4).await;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let pods = RelayPods::start(&client, &ns).await;
    let mut controller = pods.controller(&ns, &[]);
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &pods.url(&db.url))]).await;
    operator::create_kafka_secret(&client, &ns, &denied, &denied_password).await;
    let mut manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": RELAY},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"polling": {"interval": "200ms"}},
            "broker": {"kafka": {
                "bootstrapServers": rig.get("OUTBOX_RIG_KAFKA_SASL_SSL_BOOTSTRAP"),
                "topic": topic,
                "tls": {"caSecretRef": {"name": "orders-kafka", "key": "ca.crt"}},
                "sasl": {"mechanism": "SCRAM-SHA-512",
                         "usernameSecretRef": {"name": "orders-kafka", "key": "username"},
                         "passwordSecretRef": {"name": "orders-kafka", "key": "password"}}}},
            "ordering": {"mode": "perAggregate", "partitions": 4},
        }
    });
    pods.adapt(&mut manifest);
    operator::apply_relay(&client, &ns, &manifest).await;
    let ids: BTreeSet<i64> = common::commit_rows(&db.client, "refused", ROWS)
        .await
        .into_iter()
        .collect();

    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let why = common::wait_for_some_or(
        "Ready=False RelayCrashLooping, giving the broker's reason",
        WAIT,
        || pods.log_tails(20),
        || async {
            let relay = relays.get_opt(RELAY).await.ok().flatten()?;
            operator::condition(&relay, "Ready").filter(|c| {
                c.status == "False"
                    && c.reason == "RelayCrashLooping"
                    && c.message.contains("Cluster authorization failed")
            })
        },
    )
    .await;
    println!("Ready=False RelayCrashLooping: {}", why.message);
    assert!(
        why.message.contains("failed permanently") && !why.message.contains(&denied_password),
        "{}",
        why.message
    );
    assert_eq!(
        common::unpublished_rows(&db.client).await,
        ROWS as i64,
        "rows were marked published while the broker refused every producer"
    );

    // The user fixes the Secret: the relay comes up, and every row arrives.
    operator::set_secret_key(
        &client,
        &ns,
        "orders-kafka",
        "username",
        rig.get("OUTBOX_RIG_KAFKA_USER"),
    )
    .await;
    operator::set_secret_key(
        &client,
        &ns,
        "orders-kafka",
        "password",
        rig.get("OUTBOX_RIG_KAFKA_PASSWORD"),
    )
    .await;
    common::wait_for_some_or(
        "the relay Ready with every row published",
        WAIT,
        || pods.log_tails(20),
        || async {
            let relay = relays.get_opt(RELAY).await.ok().flatten()?;
            (operator::is_ready(&relay) && common::unpublished_rows(&db.client).await == 0)
                .then_some(())
        },
    )
    .await;
    let received = tokio::task::spawn_blocking({
        let topic = topic.clone();
        move || common::consume_kafka(&topic)
    })
    .await
    .unwrap();
    let got: BTreeSet<i64> = received.iter().map(|r| r.id).collect();
    assert!(
        ids.is_subset(&got),
        "rows committed while the broker refused the relay never arrived: {:?}",
        ids.difference(&got).collect::<Vec<_>>()
    );

    operator::delete_relays(&client, &ns, WAIT).await;
    let stopped = controller.stop(WAIT);
    drop(pods);
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
    assert!(stopped.is_ok_and(|s| s.success()), "the controller's exit");
}
