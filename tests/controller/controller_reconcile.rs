//! The controller against the rig's real kube-apiserver, run in-process per test and
//! watching only the test's namespace: children with owner references, rollout on spec
//! change, idempotent reconcile, pruning, finalizer and garbage collection, the
//! bad-input table, and leader election between two replicas.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::{self, ControllerArgs, Metrics};
use outbox_operator::resources::CONFIG_HASH_ANNOTATION;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// What a person applies with kubectl: a field manager that is not the operator's.
const USER: &str = "test-user";
const WAIT: Duration = Duration::from_secs(60);
/// kube-controller-manager discovers a new CRD for garbage collection only after ~30 s.
const GC_WAIT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------
// Helpers

/// A controller replica running in this test's runtime.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), controller::Error>>,
    metrics: Arc<Metrics>,
    identity: String,
}

fn start_controller(client: &Client, namespace: &str, identity: &str) -> Running {
    start_controller_with(client, ControllerArgs::for_namespace(namespace), identity)
}

fn start_controller_with(client: &Client, mut args: ControllerArgs, identity: &str) -> Running {
    outbox_operator::telemetry::init_logging();
    args.identity = Some(identity.to_owned());
    args.lease_name = "outbox-operator-test".to_owned();
    let metrics = Arc::new(Metrics::new());
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(controller::run(
        client.clone(),
        args,
        metrics.clone(),
        async move {
            let _ = rx.await;
        },
    ));
    Running {
        stop: Some(tx),
        task,
        metrics,
        identity: identity.to_owned(),
    }
}

/// Deletes every OutboxRelay in `namespace` and waits until the running controller's
/// finalizer let them go. Tests call it before stopping their controller: a relay that
/// keeps its finalizer with no controller left holds its namespace in Terminating.
async fn delete_relays(client: &Client, namespace: &str) {
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    relays
        .delete_collection(&DeleteParams::default(), &Default::default())
        .await
        .unwrap();
    common::wait_for(
        "every OutboxRelay to be finalized and gone",
        WAIT,
        || async {
            relays
                .list(&Default::default())
                .await
                .is_ok_and(|list| list.items.is_empty())
        },
    )
    .await;
}

impl Running {
    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the controller did not stop within 60s of its shutdown signal")
            .expect("the controller task panicked")
            .expect("the controller returned an error");
    }
}

fn example(file: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

async fn apply_relay(
    client: &Client,
    namespace: &str,
    manifest: &Value,
) -> kube::Result<OutboxRelay> {
    let api: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    let name = manifest["metadata"]["name"].as_str().unwrap();
    api.patch(name, &PatchParams::apply(USER), &Patch::Apply(manifest))
        .await
}

/// A Secret whose `keys` all hold `value` (a database URL where the controller connects).
async fn create_secret(client: &Client, namespace: &str, name: &str, keys: &[&str], value: &str) {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(
            keys.iter()
                .map(|k| ((*k).to_owned(), ByteString(value.as_bytes().to_vec())))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

/// Secret `orders-db` as the examples ask for it: the URL and the CA their default
/// verify-full checks the server with.
async fn create_example_db_secret(client: &Client, namespace: &str, url: &str) {
    let data = common::node::db_secret_for_pods(url);
    let data: Vec<(&str, &str)> = data.iter().map(|(k, v)| (*k, v.as_str())).collect();
    common::operator::create_secret(client, namespace, "orders-db", &data).await;
}

/// A fresh database with the tests' outbox table: the controller checks it before it
/// creates a relay.
async fn outbox_database() -> common::TestDatabase {
    let database = common::fresh_database().await;
    common::create_outbox_table(&database.client, 4).await;
    database
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

/// Waits until the relay's status describes its current generation and `check` holds.
async fn wait_status(
    api: &Api<OutboxRelay>,
    name: &str,
    what: &str,
    check: impl Fn(&OutboxRelay) -> bool,
) -> OutboxRelay {
    common::wait_for_some(what, WAIT, || async {
        let relay = api.get_opt(name).await.ok().flatten()?;
        let observed = relay.status.as_ref().and_then(|s| s.observed_generation);
        (observed == relay.metadata.generation && check(&relay)).then_some(relay)
    })
    .await
}

fn is_owned_by(meta: &ObjectMeta, relay: &OutboxRelay) -> bool {
    meta.owner_references.iter().flatten().any(|o| {
        Some(&o.uid) == relay.meta().uid.as_ref()
            && o.controller == Some(true)
            && o.kind == "OutboxRelay"
    })
}

fn config_hash(deployment: &Deployment) -> Option<String> {
    deployment
        .spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(CONFIG_HASH_ANNOTATION)
        .cloned()
}

/// The resourceVersions of the relay's ConfigMap and Service (objects without a status).
async fn versions_of_unchanged_children(
    config_maps: &Api<ConfigMap>,
    services: &Api<Service>,
) -> [Option<String>; 2] {
    [
        config_maps
            .get("orders-relay-config")
            .await
            .unwrap()
            .resource_version(),
        services
            .get("orders-relay")
            .await
            .unwrap()
            .resource_version(),
    ]
}

/// The generations of the relay's Deployment and PodDisruptionBudget (their spec).
async fn generations(
    deployments: &Api<Deployment>,
    budgets: &Api<PodDisruptionBudget>,
) -> [Option<i64>; 2] {
    [
        deployments
            .get("orders-relay")
            .await
            .unwrap()
            .metadata
            .generation,
        budgets
            .get("orders-relay")
            .await
            .unwrap()
            .metadata
            .generation,
    ]
}

// ---------------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn relay_lifecycle_creates_owned_children_rolls_on_change_and_is_collected() {
    // Ready's reason below is the scheduler's verdict on the relay pods, and the rig
    // runs kube-scheduler only with its node: without one, say so now rather than time
    // out waiting for that verdict.
    common::node::name();
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let database = outbox_database().await;
    create_example_db_secret(&client, &ns, &database.url).await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);

    let mut manifest = example("orders-relay.yaml");
    let created = apply_relay(&client, &ns, &manifest).await.unwrap();
    // The relay's Service as an older operator made it, with a cluster IP: the relay's
    // is headless now, and a cluster IP cannot be taken away, so the controller makes
    // it again. (A Service of the same name that is not the relay's is left alone.)
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "orders-relay", "ownerReferences": [{
                    "apiVersion": "outbox.dev/v1alpha1", "kind": "OutboxRelay",
                    "name": "orders", "uid": created.metadata.uid,
                    "controller": true, "blockOwnerDeletion": true
                }]},
                "spec": {"type": "ClusterIP", "ports": [{"name": "http", "port": 8080}]}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let running = start_controller(&client, &ns, "solo");

    // Every child exists and is controlled by the relay.
    let relay = wait_status(&relays, "orders", "orders status for generation 1", |r| {
        condition(r, "DatabaseReady").is_some_and(|c| c.status == "True")
    })
    .await;
    assert!(
        relay
            .finalizers()
            .iter()
            .any(|f| f == controller::FINALIZER)
    );
    let cm = config_maps.get("orders-relay-config").await.unwrap();
    let deployment = deployments.get("orders-relay").await.unwrap();
    let service = services.get("orders-relay").await.unwrap();
    assert_eq!(
        service.spec.as_ref().and_then(|s| s.cluster_ip.as_deref()),
        Some("None"),
        "the metrics Service is headless"
    );
    let pdb = budgets.get("orders-relay").await.unwrap();
    for meta in [
        &cm.metadata,
        &deployment.metadata,
        &service.metadata,
        &pdb.metadata,
    ] {
        assert!(
            is_owned_by(meta, &relay),
            "{:?} is not owned by the relay",
            meta.name
        );
    }
    let status = relay.status.clone().unwrap();
    assert_eq!(status.mode.as_deref(), Some("polling"));
    assert_eq!(status.broker.as_deref(), Some("kafka"));
    // The pods do not tolerate the rig node's taint: they stay Pending, so Ready says
    // why it is not (the scheduler's reason, once it has tried).
    let ready = condition(&relay, "Ready").unwrap();
    assert_eq!(ready.status, "False");
    assert!(
        ["RelayUnavailable", "RelayUnschedulable"].contains(&ready.reason.as_str()),
        "{}",
        ready.reason
    );
    assert!(ready.message.contains("0 of 2"), "{}", ready.message);
    // The rig has no Prometheus operator CRDs: a condition says so.
    let monitoring = condition(&relay, "MonitoringReady").unwrap();
    assert_eq!(monitoring.status, "False");
    assert_eq!(monitoring.reason, "PrometheusOperatorNotInstalled");

    // Settle first: the scheduler reports on each pod in its own time, and Ready then
    // names the first unschedulable pod; from there on nothing changes.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
    let first_pod = common::wait_for_some(
        "the scheduler's verdict on both relay pods",
        WAIT,
        || async {
            let list = pods
                .list(&kube::api::ListParams::default().labels("app.kubernetes.io/instance=orders"))
                .await
                .ok()?;
            let unschedulable = |p: &k8s_openapi::api::core::v1::Pod| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| {
                        c.iter().any(|c| {
                            c.type_ == "PodScheduled"
                                && c.status == "False"
                                && c.reason.as_deref() == Some("Unschedulable")
                        })
                    })
            };
            (list.items.len() == 2 && list.items.iter().all(unschedulable))
                .then(|| list.items.iter().map(ResourceExt::name_any).min())
                .flatten()
        },
    )
    .await;
    wait_status(
        &relays,
        "orders",
        "Ready naming the first unschedulable pod",
        |r| {
            condition(r, "Ready").is_some_and(|c| {
                c.reason == "RelayUnschedulable" && c.message.contains(&format!("pod {first_pod}:"))
            })
        },
    )
    .await;

    // A second pass changes nothing: the controller writes nothing, no child's
    // resourceVersion (the Deployment's and the budget's generation: Kubernetes moves
    // their status, and so their resourceVersion, as pods come and go) moves, and the
    // status keeps its timestamps.
    let before_versions = versions_of_unchanged_children(&config_maps, &services).await;
    let before_generations = generations(&deployments, &budgets).await;
    let before_status = relays.get("orders").await.unwrap().status;
    let reconciles = running.metrics.reconciles_total();
    let writes = running.metrics.writes_total();
    // Touching metadata (not spec) triggers a reconcile without a new generation.
    relays
        .patch(
            "orders",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"test/poke": "1"}}})),
        )
        .await
        .unwrap();
    common::wait_for("another reconcile pass", WAIT, || async {
        running.metrics.reconciles_total() > reconciles
    })
    .await;
    assert_eq!(
        running.metrics.writes_total(),
        writes,
        "a no-op reconcile wrote to the API server"
    );
    assert_eq!(
        before_versions,
        versions_of_unchanged_children(&config_maps, &services).await,
        "a no-op reconcile rewrote a child"
    );
    assert_eq!(
        before_generations,
        generations(&deployments, &budgets).await,
        "a no-op reconcile changed the Deployment's or the budget's spec"
    );
    assert_eq!(before_status, relays.get("orders").await.unwrap().status);

    // A spec change rolls the pods (new config hash) and is observed in status.
    let old_hash = config_hash(&deployment).unwrap();
    manifest["spec"]["ordering"]["partitions"] = json!(8);
    let changed = apply_relay(&client, &ns, &manifest).await.unwrap();
    assert_eq!(changed.metadata.generation, Some(2));
    common::wait_for(
        "the Deployment to carry a new config hash",
        WAIT,
        || async {
            deployments
                .get("orders-relay")
                .await
                .ok()
                .and_then(|d| config_hash(&d))
                .is_some_and(|h| h != old_hash)
        },
    )
    .await;
    wait_status(&relays, "orders", "status.observedGeneration 2", |r| {
        condition(r, "Ready").is_some_and(|c| c.observed_generation == Some(2))
    })
    .await;

    // With one replica no PDB is built, and the old one is deleted.
    manifest["spec"]["replicas"] = json!(1);
    apply_relay(&client, &ns, &manifest).await.unwrap();
    common::wait_for("the PodDisruptionBudget to be deleted", WAIT, || async {
        matches!(budgets.get_opt("orders-relay").await, Ok(None))
    })
    .await;

    // Deleting the relay runs the finalizer; garbage collection removes the children.
    relays
        .delete("orders", &DeleteParams::default())
        .await
        .unwrap();
    common::wait_for(
        "the OutboxRelay to be gone (finalizer done)",
        WAIT,
        || async { matches!(relays.get_opt("orders").await, Ok(None)) },
    )
    .await;
    common::wait_for("the children to be garbage-collected", GC_WAIT, || async {
        matches!(config_maps.get_opt("orders-relay-config").await, Ok(None))
            && matches!(deployments.get_opt("orders-relay").await, Ok(None))
            && matches!(services.get_opt("orders-relay").await, Ok(None))
    })
    .await;

    running.stop().await;
    common::delete_namespace(&client, &ns).await;
    database.drop_database().await;
}

/// Reconciles are what the API server's CPU goes to when many relays change: a settled
/// relay is reconciled again for a change of someone else's, not for the echoes of the
/// controller's own writes (its finalizer, its status, its children) nor for status
/// written by anyone.
#[tokio::test]
async fn a_settled_relay_reconciles_for_others_changes_not_for_its_own_writes() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let database = outbox_database().await;
    create_example_db_secret(&client, &ns, &database.url).await;
    // No periodic recheck within the test.
    let mut args = ControllerArgs::for_namespace(&ns);
    args.status_interval_seconds = 600;
    args.resync_seconds = 600;
    let running = start_controller_with(&client, args, "quiet");
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);

    // kube-controller-manager writes the Deployment's and the PodDisruptionBudget's
    // status as it sees fit (and slowly on a busy machine): those are someone else's
    // changes, and each may reconcile the relay. The test counts them itself.
    let foreign = StatusChanges::watch(&client, &ns);
    apply_relay(&client, &ns, &example("orders-relay.yaml"))
        .await
        .unwrap();
    wait_status(&relays, "orders", "orders status for generation 1", |r| {
        condition(r, "DatabaseReady").is_some_and(|c| c.status == "True")
    })
    .await;
    let settled = quiet(&running.metrics, &foreign).await;
    let others = foreign.count();
    assert!(
        settled <= 1 + others,
        "a new relay took {settled} reconciles for {others} status changes of its children \
         by kube-controller-manager (its own writes reconcile it again?)"
    );

    // Status written by another manager (a tool, or the operator's figures task). A
    // child's status written in the same window would reconcile the relay for a good
    // reason and prove nothing: that attempt is repeated.
    let mut proven = false;
    for attempt in 0..5 {
        let before = quiet(&running.metrics, &foreign).await;
        let others = foreign.count();
        relays
            .patch_status(
                "orders",
                &PatchParams::apply("outbox-test-figures").force(),
                &Patch::Apply(json!({
                    "apiVersion": "outbox.dev/v1alpha1",
                    "kind": "OutboxRelay",
                    "status": {"backlogRows": 7 + attempt}
                })),
            )
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(4)).await;
        if foreign.count() != others {
            continue;
        }
        assert_eq!(
            running.metrics.reconciles_total(),
            before,
            "a status-only change reconciled the relay"
        );
        proven = true;
        break;
    }
    assert!(
        proven,
        "the children's status kept changing: no quiet window to try a status-only change in"
    );

    // Someone edits a field of the ConfigMap the operator owns: reconciled and repaired.
    let settled = quiet(&running.metrics, &foreign).await;
    let others = foreign.count();
    let cm = config_maps.get("orders-relay-config").await.unwrap();
    let (key, value) = cm
        .data
        .as_ref()
        .and_then(|d| d.iter().next())
        .map(|(k, v)| (k.clone(), v.clone()))
        .expect("the relay's ConfigMap holds data");
    config_maps
        .patch(
            "orders-relay-config",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {key.clone(): "edited"}})),
        )
        .await
        .unwrap();
    common::wait_for("the edited ConfigMap to be repaired", WAIT, || async {
        config_maps
            .get("orders-relay-config")
            .await
            .ok()
            .and_then(|c| c.data)
            .and_then(|d| d.get(&key).cloned())
            .is_some_and(|v| v == value)
    })
    .await;
    // Counted when the reconcile that repaired it ends, which may be just after.
    common::wait_for("the repair to be counted as a reconcile", WAIT, || async {
        running.metrics.reconciles_total() > settled
    })
    .await;
    // One reconcile for the edit; the repair's own write (its echo) adds none.
    let after = quiet(&running.metrics, &foreign).await;
    let others = foreign.count() - others;
    assert!(
        after - settled <= 1 + others,
        "one edit took {} reconciles for {others} status changes of the children \
         meanwhile (the repair's own write reconciled the relay again?)",
        after - settled
    );

    delete_relays(&client, &ns).await;
    running.stop().await;
    database.drop_database().await;
}

/// Status changes of the Deployments and PodDisruptionBudgets of one namespace, counted
/// by a watch of the test's own: the controller never writes a child's status, so each
/// is someone else's change.
struct StatusChanges {
    count: Arc<std::sync::atomic::AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
}

impl StatusChanges {
    fn watch(client: &Client, namespace: &str) -> Self {
        let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tasks = vec![
            tokio::spawn(count_status_changes(
                Api::<Deployment>::namespaced(client.clone(), namespace),
                count.clone(),
            )),
            tokio::spawn(count_status_changes(
                Api::<PodDisruptionBudget>::namespaced(client.clone(), namespace),
                count.clone(),
            )),
        ];
        Self { count, tasks }
    }

    fn count(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for StatusChanges {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Counts into `count` every change of an object's status seen by a watch of `api`; an
/// object first seen with a status counts once.
async fn count_status_changes<K>(api: Api<K>, count: Arc<std::sync::atomic::AtomicU64>)
where
    K: Resource
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug
        + Send
        + 'static,
{
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let mut seen: BTreeMap<String, Value> = BTreeMap::new();
    let mut events = std::pin::pin!(
        watcher(api, watcher::Config::default())
            .default_backoff()
            .applied_objects()
    );
    while let Some(event) = events.next().await {
        let Ok(object) = event else { continue };
        let now = serde_json::to_value(&object)
            .ok()
            .and_then(|o| o.get("status").cloned())
            .unwrap_or(Value::Null);
        let before = seen.insert(object.name_any(), now.clone());
        let empty = now.is_null() || now == json!({});
        if before.map_or(!empty, |b| b != now) {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// Waits until no reconcile ended and no child's status changed for 4 s; returns the
/// reconciles counted then.
async fn quiet(metrics: &Metrics, foreign: &StatusChanges) -> u64 {
    let since = std::time::Instant::now();
    let mut last = (metrics.reconciles_total(), foreign.count());
    loop {
        tokio::time::sleep(Duration::from_secs(4)).await;
        let now = (metrics.reconciles_total(), foreign.count());
        if now == last {
            return now.0;
        }
        last = now;
        assert!(
            since.elapsed() < WAIT,
            "the relay is reconciled again and again (or its children keep changing)"
        );
    }
}

/// A manifest for the bad-input table: polling to NATS, database Secret `db`.
fn base_manifest(name: &str) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db", "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"polling": {}},
            "broker": {"nats": {"url": "nats://nats:4222"}},
            "replicas": 1
        }
    })
}

#[tokio::test]
async fn bad_input_gets_a_clear_answer_and_changes_nothing() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let database = outbox_database().await;
    let running = start_controller(&client, &ns, "solo");
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);

    // Rejected by the API server, each with a message naming the problem.
    let mut both_modes = base_manifest("both-modes");
    both_modes["spec"]["mode"]["logTailing"] = json!({});
    let mut no_broker = base_manifest("no-broker");
    no_broker["spec"]["broker"] = json!({});
    let mut zero_partitions = base_manifest("zero-partitions");
    zero_partitions["spec"]["ordering"] = json!({"partitions": 0});
    let mut injected_table = base_manifest("injected-table");
    injected_table["spec"]["table"] = json!({"name": "orders; drop table x"});
    let mut two_brokers = base_manifest("two-brokers");
    two_brokers["spec"]["broker"]["kafka"] = json!({"bootstrapServers": "k:9092"});
    let mut big_batch = base_manifest("big-batch");
    big_batch["spec"]["mode"]["polling"] = json!({"batchSize": 10001});
    let rejected: [(&str, Value, &[&str]); 7] = [
        (
            "both modes",
            both_modes,
            &["set exactly one of mode.polling and mode.logTailing"],
        ),
        (
            "no broker",
            no_broker,
            &["set exactly one of broker.kafka, broker.nats and broker.rabbitmq"],
        ),
        (
            "two brokers",
            two_brokers,
            &["set exactly one of broker.kafka"],
        ),
        (
            "partitions 0",
            zero_partitions,
            &[
                "spec.ordering.partitions",
                "should be greater than or equal to 1",
            ],
        ),
        (
            "batch size 10001",
            big_batch,
            &["spec.mode.polling.batchSize", "less than or equal to 10000"],
        ),
        (
            "SQL in a table name",
            injected_table,
            &["spec.table.name", "should match"],
        ),
        (
            "bad name",
            {
                let mut m = base_manifest("bad-name");
                m["metadata"]["name"] = json!("bad.name");
                m
            },
            &["metadata.name must be a DNS label"],
        ),
    ];
    for (case, manifest, expected) in rejected {
        let name = manifest["metadata"]["name"].as_str().unwrap().to_owned();
        match apply_relay(&client, &ns, &manifest).await {
            Ok(_) => panic!("{case}: the API server accepted it"),
            Err(kube::Error::Api(status)) => {
                assert_eq!(status.code, 422, "{case}: {status:?}");
                for needle in expected {
                    assert!(
                        status.message.contains(needle),
                        "{case}: {:?} lacks {needle:?}",
                        status.message
                    );
                }
            }
            Err(other) => panic!("{case}: expected a 422, got {other}"),
        }
        assert!(
            matches!(relays.get_opt(&name).await, Ok(None)),
            "{case}: stored anyway"
        );
    }

    // Accepted, then a condition names the missing Secret; nothing that would crash-loop.
    apply_relay(&client, &ns, &base_manifest("missing-secret"))
        .await
        .unwrap();
    let relay = wait_status(
        &relays,
        "missing-secret",
        "Ready=False SecretNotFound",
        |r| {
            condition(r, "Ready")
                .is_some_and(|c| c.status == "False" && c.reason == "SecretNotFound")
        },
    )
    .await;
    let ready = condition(&relay, "Ready").unwrap();
    assert!(
        ready.message.contains("Secret db not found"),
        "{}",
        ready.message
    );
    let db = condition(&relay, "DatabaseReady").unwrap();
    assert_eq!(
        (db.status.as_str(), db.reason.as_str()),
        ("False", "SecretNotFound")
    );
    assert_eq!(condition(&relay, "Degraded").unwrap().status, "True");

    // A Secret without the key: a spec problem (the relay could not run), named.
    let mut wrong_key = base_manifest("wrong-key");
    wrong_key["spec"]["database"]["postgres"]["connectionSecretRef"] =
        json!({"name": "db-nokey", "key": "uri"});
    create_secret(&client, &ns, "db-nokey", &["url"], &database.url).await;
    apply_relay(&client, &ns, &wrong_key).await.unwrap();
    let relay = wait_status(&relays, "wrong-key", "Ready=False InvalidSpec", |r| {
        condition(r, "Ready").is_some_and(|c| c.status == "False" && c.reason == "InvalidSpec")
    })
    .await;
    let message = condition(&relay, "Ready").unwrap().message;
    assert!(
        message.contains("db-nokey") && message.contains("no key uri"),
        "{message}"
    );

    // Nothing was created for either: no pods that would crash-loop on the missing value.
    for name in ["missing-secret-relay", "wrong-key-relay"] {
        assert!(
            matches!(deployments.get_opt(name).await, Ok(None)),
            "{name} was created"
        );
    }
    for name in ["missing-secret-relay-config", "wrong-key-relay-config"] {
        assert!(
            matches!(config_maps.get_opt(name).await, Ok(None)),
            "{name} was created"
        );
    }

    // Creating the Secret lets the relay through without touching the OutboxRelay.
    create_secret(&client, &ns, "db", &["uri"], &database.url).await;
    common::wait_for("the Deployment once the Secret exists", WAIT, || async {
        matches!(
            deployments.get_opt("missing-secret-relay").await,
            Ok(Some(_))
        )
    })
    .await;

    // An immutable field cannot change.
    // (A unique slot name: slots are cluster-wide; the finalizer drops it.)
    let slot_a = format!("slot_a_{}", common::unique_suffix());
    let mut tailing = base_manifest("tailing");
    tailing["spec"]["mode"] = json!({"logTailing": {"slotName": slot_a}});
    apply_relay(&client, &ns, &tailing).await.unwrap();
    tailing["spec"]["mode"]["logTailing"]["slotName"] = json!("slot_b");
    match apply_relay(&client, &ns, &tailing).await {
        Ok(_) => panic!("changing logTailing.slotName was accepted"),
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{status:?}");
            assert!(
                status.message.contains("logTailing.slotName is immutable"),
                "{}",
                status.message
            );
        }
        Err(other) => panic!("expected a 422, got {other}"),
    }
    let stored = relays.get("tailing").await.unwrap();
    let slot = stored.spec.mode.log_tailing.unwrap().slot_name;
    assert_eq!(slot.as_deref(), Some(slot_a.as_str()));
    // Removing it is refused as well (the default name would differ).
    tailing["spec"]["mode"]["logTailing"] = json!({});
    assert!(
        apply_relay(&client, &ns, &tailing).await.is_err(),
        "removing slotName was accepted"
    );

    delete_relays(&client, &ns).await;
    running.stop().await;
    common::delete_namespace(&client, &ns).await;
    database.drop_database().await;
}

#[tokio::test]
async fn only_the_lease_holder_writes_and_a_standby_takes_over() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let database = outbox_database().await;
    create_example_db_secret(&client, &ns, &database.url).await;
    let first = start_controller(&client, &ns, "replica-a");
    common::wait_for("replica-a to lead", WAIT, || async {
        first.metrics.is_leader()
    })
    .await;
    let second = start_controller(&client, &ns, "replica-b");

    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let holder = leases
        .get("outbox-operator-test")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.holder_identity);
    assert_eq!(holder.as_deref(), Some(first.identity.as_str()));

    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let mut manifest = example("polling-nats.yaml");
    apply_relay(&client, &ns, &manifest).await.unwrap();
    wait_status(&relays, "polling-nats", "status from the leader", |r| {
        r.status.is_some()
    })
    .await;
    assert!(matches!(
        deployments.get_opt("polling-nats-relay").await,
        Ok(Some(_))
    ));
    assert!(first.metrics.writes_total() > 0);
    assert!(!second.metrics.is_leader());
    assert_eq!(second.metrics.writes_total(), 0, "the standby wrote");
    assert_eq!(
        second.metrics.reconciles_total(),
        0,
        "the standby reconciled"
    );

    // The leader stops (releasing the Lease); the standby takes over and reconciles.
    first.stop().await;
    common::wait_for("replica-b to lead", WAIT, || async {
        second.metrics.is_leader()
    })
    .await;
    manifest["spec"]["replicas"] = json!(2);
    apply_relay(&client, &ns, &manifest).await.unwrap();
    common::wait_for("replica-b to scale the Deployment", WAIT, || async {
        deployments
            .get("polling-nats-relay")
            .await
            .ok()
            .and_then(|d| d.spec?.replicas)
            == Some(2)
    })
    .await;
    assert!(second.metrics.writes_total() > 0);
    let holder = leases
        .get("outbox-operator-test")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.holder_identity);
    assert_eq!(holder.as_deref(), Some(second.identity.as_str()));

    delete_relays(&client, &ns).await;
    second.stop().await;
    common::delete_namespace(&client, &ns).await;
    database.drop_database().await;
}
