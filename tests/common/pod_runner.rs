//! A stand-in for the scheduler and kubelet, so the relay pods the operator asks for
//! really run in tests on a rig without a node (tests/common/node.rs runs them on the
//! rig's kubelet when it has one).
//!
//! # Why pods, not Deployments
//!
//! The rig runs kube-controller-manager with its default controllers, so the real
//! deployment and replicaset controllers turn the operator's Deployment into ReplicaSets
//! and Pods — and the deployment controller computes `Deployment.status` from those pods
//! on every sync. A status patched onto the Deployment by a test is overwritten at the
//! controller's next sync (checked on the rig: `availableReplicas: 2` patched in, back to
//! the pods' count after the next scale). So the runner does what the missing components
//! do and nothing more:
//!
//! - as the scheduler, it binds the pods of the operator's Deployments (label
//!   `app.kubernetes.io/managed-by=outbox-operator`) in its namespace to a Node of its own;
//! - as the kubelet of that Node, it runs each bound pod's container as a local process,
//!   restarts it when it exits, probes `/readyz` (the pod spec's readiness probe) and
//!   reports the pod's phase, conditions and container status; when a pod is deleted it
//!   sends SIGTERM, waits the pod's grace period, SIGKILLs, and confirms the deletion.
//!
//! Everything else — scaling, a new pod-template hash replacing old pods, Recreate
//! stopping old pods before new ones start, RollingUpdate's surge, and the Deployment's
//! `availableReplicas` the operator's Ready condition reads — is done by the real
//! controllers from these pods, exactly as in a cluster. Binding (instead of reporting
//! status on unscheduled pods, which the API server would also accept) matters: an
//! unscheduled pod is deleted at once, so Recreate would start the new pod while the old
//! process still runs; a bound pod stays until its kubelet confirms it stopped.
//!
//! The Node keeps a heartbeat (its Lease in `kube-node-lease`), or the node-lifecycle
//! controller would mark its pods NotReady and evict them.
//!
//! # What a pod gets
//!
//! Exactly its spec: `command` + `args` (the image must be the operator's, whose
//! entrypoint `/outbox-operator` maps to the binary under test), `env` (values with
//! `$(VAR)` expansion, `secretKeyRef`, `configMapKeyRef`, `fieldRef`), `envFrom`, and its
//! ConfigMap / Secret / projected / emptyDir volumes written into a folder of its own.
//! A reference that cannot be resolved keeps the container from starting, with
//! `CreateContainerConfigError`, as kubelet does. Two things of a pod cannot be had
//! without a container runtime, and are emulated by rewriting text:
//!
//! - its own mount namespace: each volume mount path is replaced by the pod's folder in
//!   the command line, the environment and the mounted text files (the relay config names
//!   the paths of other mounted files);
//! - its own network namespace: the pod gets a loopback address of its own as pod IP
//!   (all of 127.0.0.0/8 is local on Linux), and a wildcard listen address `0.0.0.0:`
//!   is replaced by it, so replicas listening on the same container port do not collide.
//!   Probes go to that address, as kubelet's go to the pod IP.
//!
//! Security context (non-root user, read-only root filesystem), resources and the
//! liveness probe's exact timing are not enforced. Dropping the runner SIGKILLs every
//! process and deletes its Node; the pod-GC controller then removes pods left bound to it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    Binding, ConfigMap, Container, EnvVar, Node, NodeSpec, ObjectReference, Pod, Probe, Secret,
    Taint, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use rand::Rng;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Pods the runner takes: those of the operator's Deployments (their template labels).
pub const MANAGED_PODS: &str = "app.kubernetes.io/managed-by=outbox-operator";
/// The operator image's entrypoint, which stands for the binary under test.
const ENTRYPOINT: &str = "/outbox-operator";
/// Images the runner can run: the operator's (any tag; the controller names its version).
const OPERATOR_IMAGE: &str = "ghcr.io/outbox-operator/outbox-operator";
/// How often the Node renews its Lease (kubelet's default is 10 s; the node-lifecycle
/// controller calls a node unhealthy after 40 s without renewal).
const HEARTBEAT: Duration = Duration::from_secs(10);

/// One pod the runner has taken on, as the test can see it.
struct PodEntry {
    /// Stops the pod's supervisor: `Some(grace)` once the pod is being deleted.
    stop: watch::Sender<Option<i64>>,
    /// The running process, if any (SIGKILLed on drop).
    pid: Arc<Mutex<Option<u32>>>,
    /// The container state last reported, for failure messages.
    state: Arc<Mutex<String>>,
    log: PathBuf,
    task: JoinHandle<()>,
}

/// What every supervisor shares.
struct Shared {
    client: kube::Client,
    namespace: String,
    node: String,
    binary: PathBuf,
    dir: PathBuf,
    pods: Mutex<HashMap<String, PodEntry>>,
    /// Every process start and exit, in the order they happened.
    history: Mutex<Vec<ProcessEvent>>,
}

/// A container process of a pod started or ended (exited, or stopped by the runner).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProcessEvent {
    Started(String),
    Ended(String),
}

/// Runs the operator's relay pods of one namespace as local processes; see the module
/// documentation.
pub struct PodRunner {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl PodRunner {
    /// Registers a Node of its own and starts running the managed pods of `namespace`
    /// with `binary` standing for the operator image.
    pub async fn start(client: &kube::Client, namespace: &str, binary: &Path) -> PodRunner {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("tempdir: {err}"));
        let node = format!("pod-runner-{}", super::unique_suffix());
        register_node(client, &node).await;
        let shared = Arc::new(Shared {
            client: client.clone(),
            namespace: namespace.to_owned(),
            node,
            binary: binary.to_owned(),
            dir: dir.path().to_owned(),
            pods: Mutex::new(HashMap::new()),
            history: Mutex::new(Vec::new()),
        });
        let tasks = vec![
            tokio::spawn(heartbeat(shared.clone())),
            tokio::spawn(watch_pods(shared.clone())),
        ];
        PodRunner {
            shared,
            tasks,
            _dir: dir,
        }
    }

    /// The Node the runner's pods are bound to.
    pub fn node(&self) -> &str {
        &self.shared.node
    }

    /// Every process start and end so far, in order: what a rollout strategy promises
    /// (Recreate: the old process ended before the new one started) is checked on it.
    pub fn history(&self) -> Vec<ProcessEvent> {
        lock(&self.shared.history).clone()
    }

    /// Names of the pods whose process is running now.
    pub fn running(&self) -> Vec<String> {
        let pods = lock(&self.shared.pods);
        let mut names: Vec<String> = pods
            .iter()
            .filter(|(_, e)| lock(&e.pid).is_some())
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// The last `lines` log lines of every pod the runner ran, for failure messages.
    pub fn log_tails(&self, lines: usize) -> String {
        let pods = lock(&self.shared.pods);
        let mut names: Vec<&String> = pods.keys().collect();
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let entry = &pods[name];
                format!(
                    "\n--- pod {name} ({}) log tail ---\n{}",
                    lock(&entry.state),
                    super::private::tail(&entry.log, lines)
                )
            })
            .collect()
    }
}

impl Drop for PodRunner {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        let mut pods = lock(&self.shared.pods);
        for (_, entry) in pods.drain() {
            entry.task.abort();
            if let Some(pid) = lock(&entry.pid).take() {
                signal(pid, "KILL");
            }
        }
        drop(pods);
        // Drop runs inside the test's runtime, which may have a single thread that is
        // busy here: the API calls run on a runtime and client of their own.
        let node = self.shared.node.clone();
        let namespace = self.shared.namespace.clone();
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                let client = super::kube_client().await;
                // What kubelet would confirm once its containers stopped (they are
                // killed above): without it a pod being deleted waits for the pod-GC
                // controller to notice the Node is gone, and its namespace with it.
                let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
                let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
                for pod in pods.list(&on_node).await.into_iter().flat_map(|l| l.items) {
                    if let Some(name) = pod.metadata.name {
                        let _ = pods
                            .delete(&name, &DeleteParams::default().grace_period(0))
                            .await;
                    }
                }
                let _ = Api::<Lease>::namespaced(client.clone(), "kube-node-lease")
                    .delete(&node, &DeleteParams::default())
                    .await;
                let _ = Api::<Node>::all(client)
                    .delete(&node, &DeleteParams::default())
                    .await;
            });
        });
        let _ = cleanup.join();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A supervisor that panicked leaves nothing half-written that matters here.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn now() -> Time {
    Time(Timestamp::now())
}

fn signal(pid: u32, name: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

// ---------------------------------------------------------------------------------------
// The Node

async fn register_node(client: &kube::Client, name: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                "outbox.dev/test".to_owned(),
                "pod-runner".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        // The rig's kube-scheduler must never place a pod here (that would be a pod of
        // another test's namespace, which this runner does not run): no pod tolerates
        // this taint. The runner binds its pods itself.
        spec: Some(NodeSpec {
            taints: Some(vec![Taint {
                key: "outbox.dev/pod-runner".to_owned(),
                value: Some("true".to_owned()),
                effect: "NoSchedule".to_owned(),
                time_added: None,
            }]),
            ..NodeSpec::default()
        }),
        ..Node::default()
    };
    nodes
        .create(&PostParams::default(), &node)
        .await
        .unwrap_or_else(|err| panic!("pod runner: creating Node {name} failed: {err}"));
    report_node_ready(client, name).await;
    renew_lease(client, name).await;
}

async fn report_node_ready(client: &kube::Client, name: &str) {
    let status = json!({"status": {
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "outbox-operator test pod runner",
            "lastHeartbeatTime": now(), "lastTransitionTime": now(),
        }],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
    }});
    Api::<Node>::all(client.clone())
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|err| panic!("pod runner: reporting Node {name} Ready failed: {err}"));
}

async fn renew_lease(client: &kube::Client, name: &str) {
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": 40,
                 "renewTime": MicroTime(Timestamp::now())},
    });
    let result = Api::<Lease>::namespaced(client.clone(), "kube-node-lease")
        .patch(
            name,
            &PatchParams::apply("outbox-pod-runner").force(),
            &Patch::Apply(&lease),
        )
        .await;
    if let Err(err) = result {
        eprintln!("pod runner: renewing Lease {name} failed: {err}");
    }
}

async fn heartbeat(shared: Arc<Shared>) {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        renew_lease(&shared.client, &shared.node).await;
    }
}

// ---------------------------------------------------------------------------------------
// Watching pods

async fn watch_pods(shared: Arc<Shared>) {
    let pods: Api<Pod> = Api::namespaced(shared.client.clone(), &shared.namespace);
    // Below the client's 60 s read timeout, so an idle watch is renewed, not broken.
    let config = watcher::Config::default().labels(MANAGED_PODS).timeout(45);
    let mut events = watcher::watcher(pods, config).default_backoff().boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Apply(pod) | Event::InitApply(pod)) => on_pod(&shared, pod),
            Ok(Event::Delete(pod)) => {
                // Gone from the API (force-deleted): stop at once.
                let name = pod.metadata.name.unwrap_or_default();
                if let Some(entry) = lock(&shared.pods).get(&name) {
                    let _ = entry.stop.send(Some(0));
                }
            }
            Ok(Event::Init | Event::InitDone) => {}
            Err(err) => eprintln!("pod runner: watch error (retrying): {err}"),
        }
    }
}

fn on_pod(shared: &Arc<Shared>, pod: Pod) {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let deleting = pod.metadata.deletion_timestamp.is_some();
    match node.as_deref() {
        None if !deleting => {
            let shared = shared.clone();
            tokio::spawn(async move { bind(&shared, &name).await });
        }
        Some(node) if node == shared.node => {
            let mut pods = lock(&shared.pods);
            if let Some(entry) = pods.get(&name) {
                if deleting {
                    let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or(30);
                    let _ = entry.stop.send(Some(grace));
                }
            } else if deleting {
                // Never started here: nothing to stop; confirm the deletion.
                let shared = shared.clone();
                tokio::spawn(async move { confirm_deleted(&shared, &name).await });
            } else {
                let (stop, stopped) = watch::channel(None);
                let pid = Arc::new(Mutex::new(None));
                let state = Arc::new(Mutex::new("starting".to_owned()));
                let log = shared.dir.join(&name).join("container.log");
                let task = tokio::spawn(supervise(
                    shared.clone(),
                    pod,
                    stopped,
                    pid.clone(),
                    state.clone(),
                ));
                pods.insert(
                    name,
                    PodEntry {
                        stop,
                        pid,
                        state,
                        log,
                        task,
                    },
                );
            }
        }
        _ => {}
    }
}

async fn bind(shared: &Shared, pod: &str) {
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(pod.to_owned()),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Node".to_owned()),
            name: Some(shared.node.clone()),
            ..ObjectReference::default()
        },
    };
    let pods: Api<Pod> = Api::namespaced(shared.client.clone(), &shared.namespace);
    let bound: kube::Result<serde_json::Value> = pods
        .create_subresource("binding", pod, &PostParams::default(), &binding)
        .await;
    match bound {
        Ok(_) => {}
        // Already bound (a repeated event) or already gone: nothing to do.
        Err(kube::Error::Api(status)) if status.code == 409 || status.code == 404 => {}
        Err(err) => eprintln!("pod runner: binding pod {pod} failed: {err}"),
    }
}

/// What kubelet does once a pod's containers stopped: delete it for good.
async fn confirm_deleted(shared: &Shared, pod: &str) {
    let pods: Api<Pod> = Api::namespaced(shared.client.clone(), &shared.namespace);
    let result = pods
        .delete(pod, &DeleteParams::default().grace_period(0))
        .await;
    if let Err(err) = result
        && !matches!(&err, kube::Error::Api(s) if s.code == 404)
    {
        eprintln!("pod runner: confirming the deletion of pod {pod} failed: {err}");
    }
}

// ---------------------------------------------------------------------------------------
// One pod

/// A container ready to start: the resolved command line and environment.
struct Launch {
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    readiness: Option<HttpProbe>,
    liveness: Option<HttpProbe>,
}

#[derive(Clone)]
struct HttpProbe {
    url: String,
    period: Duration,
    timeout: Duration,
    initial_delay: Duration,
    failure_threshold: u32,
}

/// What the pod status reports about the container.
#[derive(Clone, Default)]
struct ContainerState {
    running_since: Option<Time>,
    waiting: Option<(String, String)>,
    last_exit: Option<(i32, Time)>,
    restarts: i32,
    ready: bool,
}

async fn supervise(
    shared: Arc<Shared>,
    pod: Pod,
    mut stop: watch::Receiver<Option<i64>>,
    pid: Arc<Mutex<Option<u32>>>,
    summary: Arc<Mutex<String>>,
) {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let pod_dir = shared.dir.join(&name);
    let _ = std::fs::create_dir_all(&pod_dir);
    let pod_ip = {
        let mut rng = rand::rng();
        format!(
            "127.{}.{}.{}",
            rng.random_range(64..250),
            rng.random_range(0..256),
            rng.random_range(1..255)
        )
    };
    let start_time = now();
    let mut state = ContainerState::default();
    let mut backoff = Duration::from_secs(1);

    'restart: loop {
        // Secrets and ConfigMaps are read at each start, as kubelet does.
        let launch = match resolve(&shared, &pod, &pod_dir, &pod_ip).await {
            Ok(launch) => launch,
            Err(message) => {
                state.waiting = Some(("CreateContainerConfigError".to_owned(), message));
                report(&shared, &pod, &pod_ip, &start_time, &state, &summary).await;
                if wait_or_stop(&mut stop, Duration::from_secs(2)).await {
                    break 'restart;
                }
                continue 'restart;
            }
        };
        let log = match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(pod_dir.join("container.log"))
        {
            Ok(file) => file,
            Err(err) => {
                eprintln!("pod runner: cannot open the log of pod {name}: {err}");
                break 'restart;
            }
        };
        let stderr = log.try_clone().map(std::process::Stdio::from);
        let mut command = tokio::process::Command::new(&launch.program);
        command
            .args(&launch.args)
            .env_clear()
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&pod_dir)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(stderr.unwrap_or_else(|_| std::process::Stdio::null()))
            // A process group of its own, as a container has: a Ctrl-C in the terminal
            // of an interactive run (make demo) must not reach the relays directly; they
            // stop when their pods are deleted, as in a cluster.
            .process_group(0)
            .kill_on_drop(true);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(err) => {
                state.waiting = Some(("RunContainerError".to_owned(), err.to_string()));
                report(&shared, &pod, &pod_ip, &start_time, &state, &summary).await;
                if wait_or_stop(&mut stop, backoff).await {
                    break 'restart;
                }
                continue 'restart;
            }
        };
        *lock(&pid) = child.id();
        lock(&shared.history).push(ProcessEvent::Started(name.clone()));
        state.waiting = None;
        state.running_since = Some(now());
        state.ready = false;
        report(&shared, &pod, &pod_ip, &start_time, &state, &summary).await;

        let started = tokio::time::Instant::now();
        let mut readiness_failures = 0u32;
        let mut liveness_failures = 0u32;
        let tick = launch
            .readiness
            .as_ref()
            .map_or(Duration::from_secs(1), |p| {
                p.period.min(Duration::from_secs(1))
            });
        let mut next_readiness = started
            + launch
                .readiness
                .as_ref()
                .map_or(Duration::ZERO, |p| p.initial_delay);
        let mut next_liveness = started
            + launch
                .liveness
                .as_ref()
                .map_or(Duration::ZERO, |p| p.initial_delay);
        let exit = loop {
            tokio::select! {
                exit = child.wait() => break Some(exit),
                _ = stop.changed() => break None,
                () = tokio::time::sleep(tick) => {}
            }
            let now_instant = tokio::time::Instant::now();
            if let Some(probe) = &launch.readiness
                && now_instant >= next_readiness
            {
                next_readiness = now_instant + probe.period;
                let ok = http_ok(probe).await;
                readiness_failures = if ok { 0 } else { readiness_failures + 1 };
                let ready = if ok {
                    true
                } else if readiness_failures >= probe.failure_threshold {
                    false
                } else {
                    state.ready
                };
                if ready != state.ready {
                    state.ready = ready;
                    report(&shared, &pod, &pod_ip, &start_time, &state, &summary).await;
                }
            } else if launch.readiness.is_none() && !state.ready {
                // No readiness probe: ready once started, as kubelet says.
                state.ready = true;
                report(&shared, &pod, &pod_ip, &start_time, &state, &summary).await;
            }
            if let Some(probe) = &launch.liveness
                && now_instant >= next_liveness
            {
                next_liveness = now_instant + probe.period;
                liveness_failures = if http_ok(probe).await {
                    0
                } else {
                    liveness_failures + 1
                };
                if liveness_failures >= probe.failure_threshold {
                    eprintln!("pod runner: pod {name} failed its liveness probe; restarting it");
                    stop_process(&mut child, 30).await;
                    break Some(child.wait().await);
                }
            }
        };
        match exit {
            None => {
                let grace = stop.borrow().unwrap_or(0);
                stop_process(&mut child, grace).await;
                *lock(&pid) = None;
                lock(&shared.history).push(ProcessEvent::Ended(name.clone()));
                break 'restart;
            }
            Some(status) => {
                *lock(&pid) = None;
                lock(&shared.history).push(ProcessEvent::Ended(name.clone()));
                let code = status.ok().and_then(|s| s.code()).unwrap_or(137);
                state.last_exit = Some((code, now()));
                state.restarts += 1;
                state.running_since = None;
                state.ready = false;
                state.waiting = Some((
                    "CrashLoopBackOff".to_owned(),
                    format!("exited with code {code}; restarting in {backoff:?}"),
                ));
                report(&shared, &pod, &pod_ip, &start_time, &state, &summary).await;
                // kubelet backs off from 10 s to 5 min; tests need a shorter leash.
                if wait_or_stop(&mut stop, backoff).await {
                    break 'restart;
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
    lock(&shared.pods).remove(&name);
    confirm_deleted(&shared, &name).await;
}

/// Waits `delay`; true when the pod is to stop instead.
async fn wait_or_stop(stop: &mut watch::Receiver<Option<i64>>, delay: Duration) -> bool {
    if stop.borrow().is_some() {
        return true;
    }
    tokio::select! {
        _ = stop.changed() => true,
        () = tokio::time::sleep(delay) => false,
    }
}

/// SIGTERM, then SIGKILL after `grace` seconds, as kubelet stops a container.
async fn stop_process(child: &mut tokio::process::Child, grace: i64) {
    if let Some(pid) = child.id() {
        signal(pid, "TERM");
    }
    let grace = Duration::from_secs(u64::try_from(grace).unwrap_or(0));
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

async fn http_ok(probe: &HttpProbe) -> bool {
    let response = reqwest::Client::new()
        .get(&probe.url)
        .timeout(probe.timeout)
        .send()
        .await;
    // kubelet counts 200-399 as success.
    response.is_ok_and(|r| r.status().is_success() || r.status().is_redirection())
}

/// Writes the pod status a kubelet would: phase, IPs, conditions, container status.
async fn report(
    shared: &Shared,
    pod: &Pod,
    pod_ip: &str,
    start_time: &Time,
    state: &ContainerState,
    summary: &Mutex<String>,
) {
    *lock(summary) = match &state.waiting {
        Some((reason, message)) => format!("waiting: {reason}: {message}"),
        None => format!(
            "running at {pod_ip}, ready={}, restarts={}",
            state.ready, state.restarts
        ),
    };
    let Some(container) = pod.spec.as_ref().and_then(|s| s.containers.first()) else {
        return;
    };
    let ready = if state.ready { "True" } else { "False" };
    let condition = |type_: &str, status: &str| json!({"type": type_, "status": status, "lastTransitionTime": now()});
    let container_state = match (&state.running_since, &state.waiting) {
        (Some(since), None) => json!({"running": {"startedAt": since}}),
        (_, Some((reason, message))) => json!({"waiting": {"reason": reason, "message": message}}),
        (None, None) => json!({"waiting": {"reason": "ContainerCreating"}}),
    };
    let last_state = state.last_exit.as_ref().map_or(
        json!({}),
        |(code, at)| json!({"terminated": {"exitCode": code, "reason": "Error", "finishedAt": at}}),
    );
    let status = json!({"status": {
        "phase": "Running",
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        "conditions": [
            condition("PodScheduled", "True"),
            condition("Initialized", "True"),
            condition("ContainersReady", ready),
            condition("Ready", ready),
        ],
        "containerStatuses": [{
            "name": container.name,
            "image": container.image.clone().unwrap_or_default(),
            "imageID": "",
            "ready": state.ready,
            "started": state.running_since.is_some(),
            "restartCount": state.restarts,
            "state": container_state,
            "lastState": last_state,
        }],
    }});
    let pods: Api<Pod> = Api::namespaced(shared.client.clone(), &shared.namespace);
    let name = pod.metadata.name.clone().unwrap_or_default();
    if let Err(err) = pods
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        && !matches!(&err, kube::Error::Api(s) if s.code == 404)
    {
        eprintln!("pod runner: reporting the status of pod {name} failed: {err}");
    }
}

// ---------------------------------------------------------------------------------------
// Resolving a pod spec into a command line, an environment and files

async fn resolve(
    shared: &Shared,
    pod: &Pod,
    pod_dir: &Path,
    pod_ip: &str,
) -> Result<Launch, String> {
    let spec = pod.spec.as_ref().ok_or("pod has no spec")?;
    let [container] = spec.containers.as_slice() else {
        return Err(format!(
            "the runner runs pods of one container; this one has {}",
            spec.containers.len()
        ));
    };
    let image = container.image.clone().unwrap_or_default();
    if !image.starts_with(&format!("{OPERATOR_IMAGE}:")) && image != OPERATOR_IMAGE {
        return Err(format!(
            "image {image} is not the operator image {OPERATOR_IMAGE}: only that one can be run here"
        ));
    }
    let namespace = &shared.namespace;
    let mut reader = Reader::new(&shared.client, namespace);

    // Volumes first: their folders are what mount paths are rewritten to.
    let volumes_dir = pod_dir.join("volumes");
    let _ = std::fs::remove_dir_all(&volumes_dir);
    let mut mounts: Vec<(String, PathBuf)> = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .ok_or_else(|| format!("volume mount {} names no volume", mount.name))?;
        let dir = volumes_dir.join(&volume.name);
        if !dir.exists() {
            materialize(&mut reader, pod, volume, &dir).await?;
        }
        let source = match &mount.sub_path {
            Some(sub) if !sub.is_empty() => dir.join(sub),
            _ => dir,
        };
        mounts.push((mount.mount_path.clone(), source));
    }
    // Longest first, so a mount nested in another is rewritten to its own folder.
    mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    let rewrite = |text: &str| -> String {
        let mut out = text.replace("0.0.0.0:", &format!("{pod_ip}:"));
        for (path, source) in &mounts {
            out = replace_path(&out, path, &source.to_string_lossy());
        }
        out
    };
    rewrite_files(&volumes_dir, &rewrite);

    // Environment, in kubelet's order: envFrom, then env (later names win).
    let mut env: Vec<(String, String)> = Vec::new();
    let set = |env: &mut Vec<(String, String)>, name: String, value: String| {
        env.retain(|(n, _)| *n != name);
        env.push((name, value));
    };
    for source in container.env_from.iter().flatten() {
        let prefix = source.prefix.clone().unwrap_or_default();
        let data = if let Some(cm) = &source.config_map_ref {
            reader
                .config_map(&cm.name, cm.optional.unwrap_or(false))
                .await?
        } else if let Some(secret) = &source.secret_ref {
            reader
                .secret(&secret.name, secret.optional.unwrap_or(false))
                .await?
        } else {
            BTreeMap::new()
        };
        for (key, value) in data {
            set(&mut env, format!("{prefix}{key}"), lossy(&value));
        }
    }
    for var in container.env.iter().flatten() {
        if let Some(value) = env_value(&mut reader, pod, pod_ip, var, &env).await? {
            set(&mut env, var.name.clone(), value);
        }
    }
    // The container runtime sets HOSTNAME to the pod name.
    if !env.iter().any(|(n, _)| n == "HOSTNAME") {
        env.push((
            "HOSTNAME".to_owned(),
            pod.metadata.name.clone().unwrap_or_default(),
        ));
    }
    let env: Vec<(String, String)> = env.into_iter().map(|(n, v)| (n, rewrite(&v))).collect();

    let mut argv: Vec<String> = container
        .command
        .clone()
        .unwrap_or_else(|| vec![ENTRYPOINT.to_owned()]);
    argv.extend(container.args.iter().flatten().cloned());
    let argv: Vec<String> = argv.iter().map(|a| rewrite(&expand(a, &env))).collect();
    let (program, args) = argv.split_first().ok_or("empty command line")?;
    if program != ENTRYPOINT {
        return Err(format!(
            "command {program} is not the operator image's entrypoint {ENTRYPOINT}"
        ));
    }

    Ok(Launch {
        program: shared.binary.clone(),
        args: args.to_vec(),
        env,
        readiness: http_probe(container, container.readiness_probe.as_ref(), pod_ip)?,
        liveness: http_probe(container, container.liveness_probe.as_ref(), pod_ip)?,
    })
}

/// Replaces `path` where it stands as a whole path or a prefix of one.
pub fn replace_path(text: &str, path: &str, with: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(path) {
        let after = &rest[at + path.len()..];
        let boundary = after.is_empty()
            || after.starts_with('/')
            || !after
                .starts_with(|c: char| c.is_alphanumeric() || c == '-' || c == '_' || c == '.');
        out.push_str(&rest[..at]);
        out.push_str(if boundary { with } else { path });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// `$(VAR)` references resolved against the environment defined so far; `$$` escapes.
pub fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
            && let Some((_, value)) = env.iter().find(|(n, _)| *n == inner[..end])
        {
            out.push_str(value);
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn rewrite_files(dir: &Path, rewrite: &dyn Fn(&str) -> String) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rewrite_files(&path, rewrite);
        } else if let Ok(text) = std::fs::read_to_string(&path) {
            let _ = std::fs::write(&path, rewrite(&text));
        }
    }
}

async fn env_value(
    reader: &mut Reader<'_>,
    pod: &Pod,
    pod_ip: &str,
    var: &EnvVar,
    defined: &[(String, String)],
) -> Result<Option<String>, String> {
    let Some(from) = &var.value_from else {
        return Ok(Some(expand(var.value.as_deref().unwrap_or(""), defined)));
    };
    if let Some(key) = &from.secret_key_ref {
        let optional = key.optional.unwrap_or(false);
        let data = reader.secret(&key.name, optional).await?;
        return match data.get(&key.key) {
            Some(v) => Ok(Some(lossy(v))),
            None if optional => Ok(None),
            None => Err(format!(
                "couldn't find key {} in Secret {}",
                key.key, key.name
            )),
        };
    }
    if let Some(key) = &from.config_map_key_ref {
        let optional = key.optional.unwrap_or(false);
        let data = reader.config_map(&key.name, optional).await?;
        return match data.get(&key.key) {
            Some(v) => Ok(Some(lossy(v))),
            None if optional => Ok(None),
            None => Err(format!(
                "couldn't find key {} in ConfigMap {}",
                key.key, key.name
            )),
        };
    }
    if let Some(field) = &from.field_ref {
        return field_value(pod, pod_ip, &field.field_path).map(Some);
    }
    Err(format!(
        "env {}: only secretKeyRef, configMapKeyRef and fieldRef are supported by the runner",
        var.name
    ))
}

fn field_value(pod: &Pod, pod_ip: &str, path: &str) -> Result<String, String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let label = |map: &Option<BTreeMap<String, String>>, key: &str| {
        map.as_ref()
            .and_then(|m| m.get(key))
            .cloned()
            .unwrap_or_default()
    };
    let value = match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.podIP" => pod_ip.to_owned(),
        "status.hostIP" => "127.0.0.1".to_owned(),
        other => {
            if let Some(key) = other
                .strip_prefix("metadata.labels['")
                .and_then(|k| k.strip_suffix("']"))
            {
                label(&meta.labels, key)
            } else if let Some(key) = other
                .strip_prefix("metadata.annotations['")
                .and_then(|k| k.strip_suffix("']"))
            {
                label(&meta.annotations, key)
            } else {
                return Err(format!("fieldRef {other} is not supported by the runner"));
            }
        }
    };
    Ok(value)
}

fn http_probe(
    container: &Container,
    probe: Option<&Probe>,
    pod_ip: &str,
) -> Result<Option<HttpProbe>, String> {
    let Some(probe) = probe else {
        return Ok(None);
    };
    let Some(get) = &probe.http_get else {
        return Err("only httpGet probes are supported by the runner".to_owned());
    };
    let port = match &get.port {
        IntOrString::Int(port) => *port,
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port)
            .ok_or_else(|| format!("probe port {name} is not a container port"))?,
    };
    let host = get.host.clone().unwrap_or_else(|| pod_ip.to_owned());
    let path = get.path.clone().unwrap_or_else(|| "/".to_owned());
    let seconds = |v: Option<i32>, default: u64| {
        Duration::from_secs(v.and_then(|s| u64::try_from(s).ok()).unwrap_or(default))
    };
    Ok(Some(HttpProbe {
        url: format!("http://{host}:{port}{path}"),
        period: seconds(probe.period_seconds, 10),
        timeout: seconds(probe.timeout_seconds, 1),
        initial_delay: seconds(probe.initial_delay_seconds, 0),
        failure_threshold: probe
            .failure_threshold
            .and_then(|t| u32::try_from(t).ok())
            .unwrap_or(3),
    }))
}

/// Writes a volume's files into `dir`.
async fn materialize(
    reader: &mut Reader<'_>,
    pod: &Pod,
    volume: &Volume,
    dir: &Path,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    if let Some(cm) = &volume.config_map {
        let data = reader
            .config_map(&cm.name, cm.optional.unwrap_or(false))
            .await?;
        files.extend(pick(&data, cm.items.as_deref(), &cm.name)?);
    } else if let Some(secret) = &volume.secret {
        let name = secret.secret_name.clone().unwrap_or_default();
        let data = reader
            .secret(&name, secret.optional.unwrap_or(false))
            .await?;
        files.extend(pick(&data, secret.items.as_deref(), &name)?);
    } else if let Some(projected) = &volume.projected {
        for source in projected.sources.iter().flatten() {
            if let Some(cm) = &source.config_map {
                let data = reader
                    .config_map(&cm.name, cm.optional.unwrap_or(false))
                    .await?;
                files.extend(pick(&data, cm.items.as_deref(), &cm.name)?);
            } else if let Some(secret) = &source.secret {
                let data = reader
                    .secret(&secret.name, secret.optional.unwrap_or(false))
                    .await?;
                files.extend(pick(&data, secret.items.as_deref(), &secret.name)?);
            } else if let Some(downward) = &source.downward_api {
                for item in downward.items.iter().flatten() {
                    let field = item
                        .field_ref
                        .as_ref()
                        .ok_or("downwardAPI items other than fieldRef are not supported")?;
                    files.push((
                        item.path.clone(),
                        field_value(pod, "", &field.field_path)?.into_bytes(),
                    ));
                }
            } else {
                return Err(format!(
                    "volume {}: projected source not supported by the runner",
                    volume.name
                ));
            }
        }
    } else if volume.empty_dir.is_none() {
        return Err(format!(
            "volume {}: only configMap, secret, projected and emptyDir volumes are supported by the runner",
            volume.name
        ));
    }
    for (path, bytes) in files {
        let target = dir.join(&path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        std::fs::write(&target, bytes).map_err(|e| format!("writing {}: {e}", target.display()))?;
    }
    Ok(())
}

/// The files of one ConfigMap or Secret: the listed `items`, or every key.
fn pick(
    data: &BTreeMap<String, Vec<u8>>,
    items: Option<&[k8s_openapi::api::core::v1::KeyToPath]>,
    source: &str,
) -> Result<Vec<(String, Vec<u8>)>, String> {
    match items {
        None => Ok(data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
        Some(items) => items
            .iter()
            .map(|item| {
                data.get(&item.key)
                    .map(|v| (item.path.clone(), v.clone()))
                    .ok_or_else(|| format!("{source} has no key {}", item.key))
            })
            .collect(),
    }
}

/// Reads ConfigMaps and Secrets once per resolve.
struct Reader<'a> {
    client: &'a kube::Client,
    namespace: &'a str,
}

impl<'a> Reader<'a> {
    fn new(client: &'a kube::Client, namespace: &'a str) -> Self {
        Self { client, namespace }
    }

    async fn config_map(
        &mut self,
        name: &str,
        optional: bool,
    ) -> Result<BTreeMap<String, Vec<u8>>, String> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), self.namespace);
        match api.get_opt(name).await {
            Ok(Some(cm)) => {
                let mut data: BTreeMap<String, Vec<u8>> = cm
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes()))
                    .collect();
                data.extend(
                    cm.binary_data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0)),
                );
                Ok(data)
            }
            Ok(None) if optional => Ok(BTreeMap::new()),
            Ok(None) => Err(format!("configmap \"{name}\" not found")),
            Err(err) => Err(format!("reading ConfigMap {name}: {err}")),
        }
    }

    async fn secret(
        &mut self,
        name: &str,
        optional: bool,
    ) -> Result<BTreeMap<String, Vec<u8>>, String> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), self.namespace);
        match api.get_opt(name).await {
            Ok(Some(secret)) => Ok(secret
                .data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.0))
                .collect()),
            Ok(None) if optional => Ok(BTreeMap::new()),
            Ok(None) => Err(format!("secret \"{name}\" not found")),
            Err(err) => Err(format!("reading Secret {name}: {err}")),
        }
    }
}
