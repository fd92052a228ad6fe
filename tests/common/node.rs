//! Relay pods on the rig's real node (kubelet + containerd + runc, see tests/rig/up.sh),
//! or on the pod runner where the rig has no node.
//!
//! On the node, the relay pods the operator's Deployment asks for are placed by the rig's
//! kube-scheduler (they tolerate the node's taint, `spec.relay.tolerations`, as a user's
//! would), run by the kubelet from the operator's image (`tests/rig/image.sh`, assembled
//! from this checkout's release binary, imported into containerd, never pulled), and reach the
//! servers through their bridge's gateway. [`RelayPods`] watches those pods and tells the
//! tests what the pod runner tells them: which pods run, the order containers started and
//! ended in, and the tails of their logs (read from the kubelet's pod-log folder).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::pod_runner::{MANAGED_PODS, PodRunner, ProcessEvent};
use super::{Rig, operator};

/// Whether the rig runs a node (tests/rig/up.sh starts one unless `OUTBOX_RIG_NODE=0`).
pub fn available() -> bool {
    Rig::load()
        .get_opt("OUTBOX_RIG_NODE")
        .is_some_and(|n| !n.is_empty())
}

/// The node's name; panics with how to start it when the rig has none.
pub fn name() -> &'static str {
    Rig::load().get_opt("OUTBOX_RIG_NODE").unwrap_or_else(|| {
        panic!(
            "the rig runs no node: start the rig with it (make rig-up, without OUTBOX_RIG_NODE=0)"
        )
    })
}

/// The operator's image, built once per test process and imported into the node's
/// containerd: (reference, `buildah inspect` of it). It carries the release binary
/// `OUTBOX_IMAGE_BINARY` names (what `make test` builds, as the Dockerfile does), else
/// the debug binary under test.
pub fn operator_image() -> &'static (String, Value) {
    static IMAGE: OnceLock<(String, Value)> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let rig = Rig::load();
        name();
        let binary = match std::env::var_os("OUTBOX_IMAGE_BINARY") {
            Some(path) => {
                let path = std::path::PathBuf::from(path);
                assert!(
                    path.is_file(),
                    "OUTBOX_IMAGE_BINARY names {}, which is not there (make test builds it)",
                    path.display()
                );
                path
            }
            None => operator::operator_binary(),
        };
        let tag = format!("test-{}", super::unique_suffix());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rig/image.sh");
        let out = std::process::Command::new(&script)
            .arg(&binary)
            .arg(&tag)
            .env("OUTBOX_RIG_DIR", rig.run_dir())
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed (is the rig's node up? make rig-up): {}",
            script.display(),
            super::describe_output(&out)
        );
        let reference = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let inspect = rig.run_dir().join(format!("node/image-{tag}.json"));
        let config: Value = serde_json::from_str(
            &std::fs::read_to_string(&inspect)
                .unwrap_or_else(|e| panic!("{}: {e}", inspect.display())),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", inspect.display()));
        (reference, config)
    })
}

/// The address pods reach a rig server at: `url` (which names 127.0.0.1) with the pods'
/// gateway instead. The host reaches it there too, so one URL serves the controller and
/// its relay pods.
pub fn pod_url(url: &str) -> String {
    url.replace("127.0.0.1", Rig::load().get("OUTBOX_RIG_POD_GATEWAY"))
}

/// `url` as relay pods reach it: through the pods' gateway when the rig runs a node
/// (where [`RelayPods::start`] puts them), unchanged otherwise.
pub fn for_pods(url: &str) -> String {
    if available() {
        pod_url(url)
    } else {
        url.to_owned()
    }
}

/// Secret `orders-db` as the examples' headers ask for it: `uri`, the URL relay pods
/// (and the controller) reach the database at, by a name the rig's server certificate
/// carries (the pods' gateway on the node, else `localhost`); and `ca.crt`, the rig's
/// CA, so the examples' default `sslMode: verify-full` holds.
pub fn db_secret_for_pods(url: &str) -> Vec<(&'static str, String)> {
    let uri = if available() {
        pod_url(url)
    } else {
        url.replace("127.0.0.1", "localhost")
    };
    let rig = Rig::load();
    let ca = std::fs::read_to_string(rig.get("OUTBOX_RIG_PG_CA"))
        .unwrap_or_else(|e| panic!("the rig's PostgreSQL CA: {e}"));
    vec![("uri", uri), ("ca.crt", ca)]
}

/// The rig's AMQP URL as relay pods use it (on the node, a user that may log in from
/// the pod network; guest may not).
pub fn amqp_for_pods() -> String {
    let rig = Rig::load();
    if available() {
        rig.get("OUTBOX_RIG_POD_AMQP_URL").to_owned()
    } else {
        rig.amqp_url().to_owned()
    }
}

/// `crictl` on the node's containerd: the containers it runs, as `crictl ps -o json`.
pub fn crictl_ps() -> Value {
    let rig = Rig::load();
    let out = std::process::Command::new(rig.get("OUTBOX_RIG_CRICTL"))
        .args([
            "--runtime-endpoint",
            &format!("unix://{}", rig.get("OUTBOX_RIG_CONTAINERD_SOCK")),
            "ps",
            "-o",
            "json",
        ])
        .output()
        .unwrap_or_else(|e| panic!("crictl: {e}"));
    assert!(
        out.status.success(),
        "crictl ps: {}",
        super::describe_output(&out)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("crictl ps output: {e}"))
}

/// The pod names `crictl ps` shows running containers for, in `namespace`.
pub fn crictl_pods(namespace: &str) -> Vec<String> {
    let ps = crictl_ps();
    let mut pods: Vec<String> = ps["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["state"] == "CONTAINER_RUNNING")
        .filter(|c| c["labels"]["io.kubernetes.pod.namespace"] == namespace)
        .filter_map(|c| {
            c["labels"]["io.kubernetes.pod.name"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    pods.sort();
    pods
}

/// Where the relay pods of a test run, and what the test must tell the operator for it.
pub enum RelayPods {
    /// The test pod runner: local processes (tests/common/pod_runner.rs).
    Runner(PodRunner),
    /// The rig's node.
    Node(NodePods),
}

impl RelayPods {
    /// On the node when the rig runs one, else on a pod runner for `namespace`.
    pub async fn start(client: &kube::Client, namespace: &str) -> Self {
        if available() {
            operator_image();
            Self::Node(NodePods::start(client, namespace))
        } else {
            Self::Runner(PodRunner::start(client, namespace, &operator::operator_binary()).await)
        }
    }

    /// `outbox-operator controller` for `namespace` (see [`operator::ControllerProcess`]),
    /// with `env` and what running here needs.
    pub fn controller(&self, namespace: &str, env: &[(&str, &str)]) -> operator::ControllerProcess {
        let own = self.controller_env();
        let mut all: Vec<(&str, &str)> = own.iter().map(|(k, v)| (*k, v.as_str())).collect();
        all.extend_from_slice(env);
        operator::ControllerProcess::start_with_env(
            Some(namespace),
            &format!("e2e-{namespace}"),
            namespace,
            &all,
        )
    }

    /// Applies `manifest`, [adapted](Self::adapt) to run here.
    pub async fn apply_relay(
        &self,
        client: &kube::Client,
        namespace: &str,
        manifest: &Value,
    ) -> outbox_operator::api::OutboxRelay {
        let mut manifest = manifest.clone();
        self.adapt(&mut manifest);
        operator::apply_relay(client, namespace, &manifest).await
    }

    pub fn on_node(&self) -> bool {
        matches!(self, Self::Node(_))
    }

    /// Environment for the controller: on the node, the relay image is the rig's.
    pub fn controller_env(&self) -> Vec<(&'static str, String)> {
        match self {
            Self::Runner(_) => Vec::new(),
            Self::Node(_) => vec![("OUTBOX_RELAY_IMAGE", operator_image().0.clone())],
        }
    }

    /// A relay manifest made ready to run here. On the node its pods tolerate the node's
    /// taint, and its broker addresses are those pods reach (the rig's, translated).
    pub fn adapt(&self, manifest: &mut Value) {
        if let Self::Node(_) = self {
            let taint = Rig::load().get("OUTBOX_RIG_NODE_TAINT");
            manifest["spec"]["relay"]["tolerations"] =
                json!([{"key": taint, "operator": "Exists", "effect": "NoSchedule"}]);
            let broker = &mut manifest["spec"]["broker"];
            let rig = Rig::load();
            if let Some(kafka) = broker
                .get_mut("kafka")
                .and_then(|k| k.get_mut("bootstrapServers"))
            {
                if *kafka == json!(rig.kafka_bootstrap()) {
                    *kafka = json!(rig.get("OUTBOX_RIG_POD_KAFKA_BOOTSTRAP"));
                } else if *kafka == json!(rig.get("OUTBOX_RIG_KAFKA_SASL_SSL_BOOTSTRAP")) {
                    *kafka = json!(rig.get("OUTBOX_RIG_POD_KAFKA_SASL_SSL_BOOTSTRAP"));
                }
            }
            // RabbitMQ's URL comes from a Secret: see [`amqp_for_pods`].
            if let Some(url) = broker["nats"]["url"].as_str() {
                broker["nats"]["url"] = json!(pod_url(url));
            }
        }
    }

    /// `url` as the relay pods reach it.
    pub fn url(&self, url: &str) -> String {
        match self {
            Self::Runner(_) => url.to_owned(),
            Self::Node(_) => pod_url(url),
        }
    }

    /// The Kafka bootstrap address the relay pods use.
    pub fn kafka_bootstrap(&self) -> String {
        match self {
            Self::Runner(_) => Rig::load().kafka_bootstrap().to_owned(),
            Self::Node(_) => Rig::load().get("OUTBOX_RIG_POD_KAFKA_BOOTSTRAP").to_owned(),
        }
    }

    /// The AMQP URL the relay pods use (a user that may log in from the pod network).
    pub fn amqp_url(&self) -> String {
        match self {
            Self::Runner(_) => Rig::load().amqp_url().to_owned(),
            Self::Node(_) => Rig::load().get("OUTBOX_RIG_POD_AMQP_URL").to_owned(),
        }
    }

    /// Names of the pods whose relay container runs now.
    pub fn running(&self) -> Vec<String> {
        match self {
            Self::Runner(r) => r.running(),
            Self::Node(n) => n.running(),
        }
    }

    /// Containers started and ended, in the order the API server saw it.
    pub fn history(&self) -> Vec<ProcessEvent> {
        match self {
            Self::Runner(r) => r.history(),
            Self::Node(n) => n.history(),
        }
    }

    /// The last `lines` log lines of every relay pod, for failure messages.
    pub fn log_tails(&self, lines: usize) -> String {
        match self {
            Self::Runner(r) => r.log_tails(lines),
            Self::Node(n) => n.log_tails(lines),
        }
    }
}

#[derive(Default)]
struct Seen {
    /// By pod name.
    pods: BTreeMap<String, PodSeen>,
    history: Vec<ProcessEvent>,
}

#[derive(Clone, Default)]
struct PodSeen {
    uid: String,
    running: Option<String>,
    node: Option<String>,
}

/// Watches the operator's relay pods of one namespace on the node.
pub struct NodePods {
    namespace: String,
    seen: Arc<Mutex<Seen>>,
    task: JoinHandle<()>,
}

impl NodePods {
    pub fn start(client: &kube::Client, namespace: &str) -> Self {
        name();
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let seen = Arc::new(Mutex::new(Seen::default()));
        let shared = seen.clone();
        let task = tokio::spawn(async move {
            let mut events =
                watcher::watcher(pods, watcher::Config::default().labels(MANAGED_PODS))
                    .default_backoff()
                    .boxed();
            // The pods of a relist (after a watch expired): those missing from it went
            // meanwhile.
            let mut relisted: Option<std::collections::BTreeSet<String>> = None;
            while let Some(event) = events.next().await {
                let mut seen = lock(&shared);
                match event {
                    Ok(Event::Apply(pod)) => observe(&mut seen, &pod),
                    Ok(Event::InitApply(pod)) => {
                        if let Some(names) = relisted.as_mut() {
                            names.insert(pod.metadata.name.clone().unwrap_or_default());
                        }
                        observe(&mut seen, &pod);
                    }
                    Ok(Event::Delete(pod)) => {
                        gone(&mut seen, &pod.metadata.name.clone().unwrap_or_default());
                    }
                    Ok(Event::Init) => relisted = Some(Default::default()),
                    Ok(Event::InitDone) => {
                        let names = relisted.take().unwrap_or_default();
                        let left: Vec<String> = seen
                            .pods
                            .keys()
                            .filter(|n| !names.contains(*n))
                            .cloned()
                            .collect();
                        for name in left {
                            gone(&mut seen, &name);
                        }
                    }
                    Err(_) => {}
                }
            }
        });
        Self {
            namespace: namespace.to_owned(),
            seen,
            task,
        }
    }

    pub fn running(&self) -> Vec<String> {
        let node = name();
        lock(&self.seen)
            .pods
            .iter()
            .filter(|(_, p)| p.running.is_some() && p.node.as_deref() == Some(node))
            .map(|(name, _)| name.clone())
            .collect()
    }

    pub fn history(&self) -> Vec<ProcessEvent> {
        lock(&self.seen).history.clone()
    }

    pub fn log_tails(&self, lines: usize) -> String {
        let pods: Vec<(String, String)> = lock(&self.seen)
            .pods
            .iter()
            .map(|(n, p)| (n.clone(), p.uid.clone()))
            .collect();
        pods.into_iter()
            .map(|(pod, uid)| {
                format!(
                    "\n--- pod {pod} (node) log tail ---\n{}",
                    pod_log_tail(&self.namespace, &pod, &uid, lines)
                )
            })
            .collect()
    }
}

impl Drop for NodePods {
    /// The pods run on after the test unless something stops them: deleting the
    /// namespace (without waiting; a test that ends well has deleted it already) has the
    /// kubelet stop them also when a test fails half-way.
    fn drop(&mut self) {
        self.task.abort();
        let rig = Rig::load();
        let _ = std::process::Command::new(rig.get("OUTBOX_RIG_KUBECTL"))
            .args(["--kubeconfig", rig.kubeconfig().to_string_lossy().as_ref()])
            .args(["delete", "namespace", &self.namespace, "--wait=false"])
            .arg("--ignore-not-found")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// A pod is gone: its container ended, if it ran.
fn gone(seen: &mut Seen, name: &str) {
    if let Some(was) = seen.pods.remove(name)
        && was.running.is_some()
    {
        seen.history.push(ProcessEvent::Ended(name.to_owned()));
    }
}

fn observe(seen: &mut Seen, pod: &Pod) {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == "relay"));
    let running = status
        .filter(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
        .and_then(|c| c.container_id.clone());
    let entry = seen.pods.entry(name.clone()).or_default().clone();
    let mut events = Vec::new();
    if entry.running.is_some() && entry.running != running {
        events.push(ProcessEvent::Ended(name.clone()));
    }
    if running.is_some() && entry.running != running {
        events.push(ProcessEvent::Started(name.clone()));
    }
    seen.pods.insert(
        name,
        PodSeen {
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            running,
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        },
    );
    seen.history.extend(events);
}

/// The relay container's log as the kubelet keeps it: its last `lines` lines (of every
/// restart, in order).
pub fn pod_log_tail(namespace: &str, pod: &str, uid: &str, lines: usize) -> String {
    let text = pod_log(namespace, pod, uid);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The relay container's whole log, every restart in order.
pub fn pod_log(namespace: &str, pod: &str, uid: &str) -> String {
    let dir = PathBuf::from(Rig::load().get("OUTBOX_RIG_POD_LOGS"))
        .join(format!("{namespace}_{pod}_{uid}"))
        .join("relay");
    let mut files: Vec<(u32, PathBuf)> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let path = e.ok()?.path();
            let restart = path.file_stem()?.to_str()?.parse().ok()?;
            Some((restart, path))
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .filter_map(|(_, p)| std::fs::read_to_string(p).ok())
        .collect()
}

/// The pods of `namespace` on the node, as `kubectl get pods -o wide` shows them: name →
/// (phase, node).
pub async fn pods_wide(
    client: &kube::Client,
    namespace: &str,
) -> BTreeMap<String, (String, String)> {
    Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(MANAGED_PODS))
        .await
        .unwrap_or_else(|e| panic!("listing pods: {e}"))
        .items
        .into_iter()
        .map(|p| {
            (
                p.metadata.name.clone().unwrap_or_default(),
                (
                    p.status
                        .as_ref()
                        .and_then(|s| s.phase.clone())
                        .unwrap_or_default(),
                    p.spec
                        .as_ref()
                        .and_then(|s| s.node_name.clone())
                        .unwrap_or_default(),
                ),
            )
        })
        .collect()
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
