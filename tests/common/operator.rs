//! The operator as a user runs it: the `outbox-operator controller` binary as a process
//! against the rig's API server, plus what a user does with kubectl (Secrets, applying
//! manifests, reading conditions). Shared by the end-to-end tests and the demo.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Client;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use outbox_operator::api::OutboxRelay;
use serde_json::{Value, json};

use super::Rig;

/// The `outbox-operator` binary under test. Integration tests get its path from cargo;
/// the demo (a cargo example, for which cargo sets no such variable) finds it next to
/// its own folder: examples are built into `<target>/<profile>/examples/`.
pub fn operator_binary() -> PathBuf {
    if let Some(path) = option_env!("CARGO_BIN_EXE_outbox-operator") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .unwrap_or_else(|| panic!("{} has no parent folder", exe.display()));
    let binary = profile_dir.join("outbox-operator");
    assert!(
        binary.is_file(),
        "{} is missing: build it with `cargo build --bin outbox-operator`",
        binary.display()
    );
    binary
}

/// `outbox-operator controller` running as a process with the rig's kubeconfig; logs go
/// to a file (a pipe nobody reads would fill and block it). SIGKILLed when dropped.
pub struct ControllerProcess {
    child: Child,
    log_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl ControllerProcess {
    /// Starts the controller watching `namespace` (all namespaces with `None`), with a
    /// Lease of its own (`lease`) in `lease_namespace`, so that it never competes with
    /// another test's controller.
    pub fn start(namespace: Option<&str>, lease: &str, lease_namespace: &str) -> Self {
        Self::start_with_env(namespace, lease, lease_namespace, &[])
    }

    /// [`Self::start`] with extra environment (`OUTBOX_STATUS_INTERVAL`, …).
    pub fn start_with_env(
        namespace: Option<&str>,
        lease: &str,
        lease_namespace: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let rig = Rig::load();
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let log_path = dir.path().join("controller.log");
        let log = std::fs::File::create(&log_path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log_path.display()));
        let mut command = Command::new(operator_binary());
        command
            .arg("controller")
            .args(["--listen", "127.0.0.1:0"])
            .args(["--lease-name", lease])
            .args(["--lease-namespace", lease_namespace])
            .args(["--identity", lease])
            .env("KUBECONFIG", rig.kubeconfig())
            .env("RUST_LOG", "info")
            .env_remove("POD_NAMESPACE")
            .env_remove("POD_NAME")
            .env_remove("OUTBOX_WATCH_NAMESPACE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            // Its own process group: a Ctrl-C in the terminal of an interactive run
            // (make demo) must not stop the operator before it has cleaned up.
            .process_group(0);
        if let Some(namespace) = namespace {
            command.args(["--namespace", namespace]);
        }
        command.envs(env.iter().copied());
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the controller binary: {e}"));
        Self {
            child,
            log_path,
            _dir: dir,
        }
    }

    /// The process id, for messages.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The last `lines` lines it logged.
    pub fn log_tail(&self, lines: usize) -> String {
        super::private::tail(&self.log_path, lines)
    }

    /// The address its HTTP server (health, `/metrics`) listens on, from its log.
    pub async fn http_addr(&self) -> String {
        super::wait_for_some_or(
            "the controller to log its listen address",
            Duration::from_secs(30),
            || format!("\n--- controller log tail ---\n{}", self.log_tail(40)),
            || async {
                std::fs::read_to_string(&self.log_path)
                    .ok()?
                    .lines()
                    .find_map(|line| {
                        let v: Value = serde_json::from_str(line).ok()?;
                        let fields = v.get("fields")?;
                        (fields.get("message")?.as_str()? == "outbox-operator controller starting")
                            .then(|| fields.get("listen")?.as_str().map(str::to_owned))?
                    })
            },
        )
        .await
    }

    /// The sum of the series of counter `name` (all label sets) on its `/metrics`, or
    /// `None` while it does not answer.
    pub async fn counter(&self, name: &str) -> Option<f64> {
        let addr = self.http_addr().await;
        let text = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        Some(super::metric_sum(&text, name))
    }

    /// SIGKILL, as a node failure or the OOM killer would: no shutdown step runs.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits (up to `timeout`) for a clean exit; returns the exit status,
    /// or an error with the log tail when it had to be SIGKILLed.
    pub fn stop(&mut self, timeout: Duration) -> Result<std::process::ExitStatus, String> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .stdin(Stdio::null())
            .status();
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err(format!(
                    "the controller did not exit within {timeout:?} of SIGTERM; log tail:\n{}",
                    self.log_tail(30)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        if self.is_running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// An example manifest from `examples/`, parsed.
pub fn example_manifest(file: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()))
}

/// A database made from examples/schema.sql, as a user would create it.
pub async fn example_database() -> super::TestDatabase {
    let db = super::fresh_database().await;
    let schema =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/schema.sql"))
            .unwrap_or_else(|e| panic!("cannot read examples/schema.sql: {e}"));
    db.client
        .batch_execute(&schema)
        .await
        .unwrap_or_else(|e| panic!("examples/schema.sql failed: {e}"));
    db
}

/// Server-side applies an OutboxRelay manifest, as `kubectl apply --server-side` would.
pub async fn apply_relay(client: &Client, namespace: &str, manifest: &Value) -> OutboxRelay {
    let api: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    let name = manifest["metadata"]["name"].as_str().unwrap_or_default();
    api.patch(
        name,
        &PatchParams::apply("e2e-user"),
        &Patch::Apply(manifest),
    )
    .await
    .unwrap_or_else(|e| panic!("applying OutboxRelay {name} failed: {e}"))
}

/// Deletes every OutboxRelay of `namespace` and waits up to `wait` for them to go (the
/// operator's finalizer runs meanwhile); then removes the finalizer from any left, so
/// the namespace can never get stuck on it. For test cleanups.
pub async fn delete_relays(client: &Client, namespace: &str, wait: Duration) {
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    let _ = relays
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let gone = tokio::time::timeout(wait, async {
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
}

/// Creates an Opaque Secret with string `data`.
pub async fn create_secret(client: &Client, namespace: &str, name: &str, data: &[(&str, &str)]) {
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

/// Secret `orders-kafka` as the Kafka examples name it: the rig's CA (`ca.crt`) and a
/// SCRAM user (`username`, `password`).
pub async fn create_kafka_secret(client: &Client, namespace: &str, user: &str, password: &str) {
    let ca = std::fs::read_to_string(format!(
        "{}/ca.crt",
        crate::common::Rig::load().get("OUTBOX_RIG_TLS_DIR")
    ))
    .unwrap_or_else(|e| panic!("the rig's CA: {e}"));
    create_secret(
        client,
        namespace,
        "orders-kafka",
        &[
            ("ca.crt", ca.as_str()),
            ("username", user),
            ("password", password),
        ],
    )
    .await;
}

/// Sets `key` of Secret `name` to `value` (a merge patch of `stringData`), as a user
/// rotating or repointing it would.
pub async fn set_secret_key(client: &Client, namespace: &str, name: &str, key: &str, value: &str) {
    Api::<Secret>::namespaced(client.clone(), namespace)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {key: value}})),
        )
        .await
        .unwrap_or_else(|e| panic!("patching Secret {name} failed: {e}"));
}

/// `url` with its host replaced by one that never resolves (a DNS outage).
pub fn unresolvable(url: &str) -> String {
    let config: tokio_postgres::Config = url
        .parse()
        .unwrap_or_else(|e| panic!("not a PostgreSQL URL: {e}"));
    let Some(tokio_postgres::config::Host::Tcp(host)) = config.get_hosts().first() else {
        panic!("the URL names no TCP host");
    };
    url.replacen(host, "outbox-no-such-host.invalid", 1)
}

/// The Events about OutboxRelay `relay`.
pub async fn relay_events(
    client: &Client,
    namespace: &str,
    relay: &str,
) -> Vec<k8s_openapi::api::events::v1::Event> {
    Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(relay))
        .collect()
}

/// Waits (up to `wait`) for an Event with `reason` about OutboxRelay `relay`.
pub async fn wait_relay_event(
    client: &Client,
    namespace: &str,
    relay: &str,
    reason: &str,
    wait: Duration,
) -> k8s_openapi::api::events::v1::Event {
    super::wait_for_some(&format!("a {reason} Event for {relay}"), wait, || async {
        relay_events(client, namespace, relay)
            .await
            .into_iter()
            .find(|e| e.reason.as_deref() == Some(reason))
    })
    .await
}

/// The condition `type_` of a relay's status.
pub fn condition(relay: &OutboxRelay, type_: &str) -> Option<Condition> {
    relay
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .cloned()
}

/// A relay's status as pretty JSON, for failure messages.
pub fn describe(relay: Option<&OutboxRelay>) -> String {
    relay.and_then(|r| r.status.as_ref()).map_or_else(
        || "no status".to_owned(),
        |s| serde_json::to_string_pretty(s).unwrap_or_default(),
    )
}

/// True when the relay reports `Ready=True` for its current generation.
pub fn is_ready(relay: &OutboxRelay) -> bool {
    condition(relay, "Ready")
        .is_some_and(|c| c.status == "True" && c.observed_generation == relay.metadata.generation)
}

/// Drops the slot (ending a walsender still holding it) and the publication, and
/// checks both are gone.
pub async fn drop_slot_and_publication(
    slot: &str,
    publication: &str,
    database_url: &str,
) -> Result<(), String> {
    let admin = super::pg_connect(super::Rig::load().pg_url())
        .await
        .map_err(|e| format!("cannot connect to drop slot {slot}: {e}"))?;
    let slot_gone = super::drop_slot(&admin, slot).await;
    if !slot_gone {
        return Err(format!("replication slot {slot} could not be dropped"));
    }
    let db = super::pg_connect(database_url)
        .await
        .map_err(|e| format!("cannot connect to drop publication {publication}: {e}"))?;
    db.batch_execute(&format!("DROP PUBLICATION IF EXISTS \"{publication}\""))
        .await
        .map_err(|e| format!("dropping publication {publication} failed: {e}"))?;
    let left = db
        .query_one(
            "SELECT count(*) FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(|e| format!("looking up publication {publication} failed: {e}"))?;
    if left.get::<_, i64>(0) != 0 {
        return Err(format!("publication {publication} is still there"));
    }
    Ok(())
}

/// One write request as the API server's audit log records it.
#[derive(Clone, Debug)]
pub struct AuditedWrite {
    pub verb: String,
    pub resource: String,
    pub subresource: String,
    pub name: String,
    pub request_uri: String,
    pub user_agent: String,
    pub code: i64,
}

impl AuditedWrite {
    /// Written by the rig's kube-controller-manager (ReplicaSets, Deployment status,
    /// EndpointSlices: its answers to the writes of others).
    pub fn by_kube_controller_manager(&self) -> bool {
        self.user_agent.starts_with("kube-controller-manager")
    }
}

impl std::fmt::Display for AuditedWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} ({}, by {})",
            self.verb, self.request_uri, self.code, self.user_agent
        )
    }
}

/// A position in the API server's audit log (its length in bytes now).
pub fn audit_mark() -> u64 {
    let path = Rig::load().kube_audit_log();
    std::fs::metadata(path)
        .unwrap_or_else(|e| {
            panic!(
                "the API server's audit log {} cannot be read ({e}): restart the rig with `make rig-up`",
                path.display()
            )
        })
        .len()
}

/// The write requests on objects of `namespace` audited after `mark`.
pub fn audited_writes_since(mark: u64, namespace: &str) -> Vec<AuditedWrite> {
    use std::io::{Read, Seek, SeekFrom};
    let path = Rig::load().kube_audit_log();
    let mut file = std::fs::File::open(path)
        .unwrap_or_else(|e| panic!("opening the audit log {}: {e}", path.display()));
    let length = file.metadata().map(|m| m.len()).unwrap_or_default();
    assert!(
        length >= mark,
        "the audit log {} is shorter than at the mark (rotated?): restart the rig",
        path.display()
    );
    let mut text = String::new();
    file.seek(SeekFrom::Start(mark))
        .and_then(|_| file.read_to_string(&mut text))
        .unwrap_or_else(|e| panic!("reading the audit log {}: {e}", path.display()));
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|e| e["objectRef"]["namespace"].as_str() == Some(namespace))
        .map(|e| {
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            AuditedWrite {
                verb: text(&e["verb"]),
                resource: text(&e["objectRef"]["resource"]),
                subresource: text(&e["objectRef"]["subresource"]),
                name: text(&e["objectRef"]["name"]),
                request_uri: text(&e["requestURI"]),
                user_agent: text(&e["userAgent"]),
                code: e["responseStatus"]["code"].as_i64().unwrap_or_default(),
            }
        })
        .collect()
}

/// A controller replica in the test's own runtime, as the controller tests run it (its
/// metrics read as numbers, no process to start).
pub struct InProcess {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), outbox_operator::controller::Error>>,
    /// Its metrics.
    pub metrics: std::sync::Arc<outbox_operator::controller::Metrics>,
}

impl InProcess {
    /// Starts one with `args` (identity, Lease name and intervals as the test sets them).
    pub fn start(client: &Client, args: outbox_operator::controller::ControllerArgs) -> Self {
        outbox_operator::telemetry::init_logging();
        let metrics = std::sync::Arc::new(outbox_operator::controller::Metrics::new());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(outbox_operator::controller::run(
            client.clone(),
            args,
            metrics.clone(),
            async move {
                let _ = rx.await;
            },
        ));
        Self {
            stop: Some(tx),
            task,
            metrics,
        }
    }

    /// Signals shutdown and waits up to `wait`; `Err` says how it did not stop cleanly.
    pub async fn stop(mut self, wait: Duration) -> Result<(), String> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match tokio::time::timeout(wait, &mut self.task).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(err))) => Err(format!("the controller returned an error: {err}")),
            Ok(Err(err)) => Err(format!("the controller task panicked: {err}")),
            Err(_) => Err(format!(
                "the controller did not stop within {wait:?} of its shutdown signal"
            )),
        }
    }
}

/// Sets `spec.suspend` of relay `name`, as `kubectl patch` would.
pub async fn set_suspend(relays: &Api<OutboxRelay>, name: &str, on: bool) {
    relays
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": on}})),
        )
        .await
        .unwrap_or_else(|e| panic!("setting spec.suspend of {name}: {e}"));
}
