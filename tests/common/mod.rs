//! Test support: finds the running test rig (tests/rig/) and hands each test fresh, uniquely named resources on its real servers.
//!
//! The rig writes a file of `KEY=value` lines; tests find it through `OUTBOX_RIG_ENV`,
//! or at `<crate>/.rig/rig.env`. A missing file or a server that does not answer fails
//! the test at once with one line saying what to start: integration tests never skip.
//!
//! Every helper creates something new under a random name so that tests, which cargo
//! runs in parallel threads, never share state.

// Each test binary (one per area: tests/smoke, relay, controller, packaging, e2e), the
// demo example and the system bench compile this module on their own and use only part
// of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rand::Rng;

pub mod app_writer;
pub mod ids;
pub mod node;
pub mod operator;
pub mod plugin;
pub mod pod_runner;
pub mod private;
pub mod proxy;
pub mod strimzi;

use ids::ledger_number;

/// How long a server may take to accept a TCP connection before we call it down.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a client may take to finish its handshake (TLS, auth, protocol hello).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);

const START_HINT: &str = "start the rig with `make rig-up` (or run everything with `make test`)";

/// The running rig, as described by its env file.
///
/// Values are looked up when a test asks for them, so a rig that lacks one server
/// fails only the tests that need it, each with a line naming the missing key.
#[derive(Debug, Clone)]
pub struct Rig {
    /// The env file this was read from.
    pub env_file: PathBuf,
    values: HashMap<String, String>,
}

impl Rig {
    /// The rig's configuration, read once per test binary. Panics with one clear line
    /// when the rig is not running.
    pub fn load() -> &'static Rig {
        static RIG: OnceLock<Rig> = OnceLock::new();
        RIG.get_or_init(|| Rig::read().unwrap_or_else(|msg| panic!("{msg}")))
    }

    fn env_file_path() -> PathBuf {
        match std::env::var_os("OUTBOX_RIG_ENV") {
            Some(path) if !path.is_empty() => PathBuf::from(path),
            _ => Path::new(env!("CARGO_MANIFEST_DIR")).join(".rig/rig.env"),
        }
    }

    fn read() -> Result<Rig, String> {
        let env_file = Self::env_file_path();
        let text = std::fs::read_to_string(&env_file).map_err(|err| {
            format!(
                "test rig not running: cannot read {} ({err}): {START_HINT}",
                env_file.display()
            )
        })?;
        Ok(Rig {
            values: parse_env(&text),
            env_file,
        })
    }

    /// The value of `key`; panics with one line when the rig did not write it.
    pub fn get(&self, key: &str) -> &str {
        match self.values.get(key) {
            Some(value) if !value.is_empty() => value,
            _ => panic!(
                "test rig env file {} has no value for {key}: restart the rig with `make rig-up`",
                self.env_file.display()
            ),
        }
    }

    /// The value of `key`, or `None` when the rig left it out or empty.
    pub fn get_opt(&self, key: &str) -> Option<&str> {
        self.values
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    /// A binary the rig provides; panics with one line when it is missing.
    fn tool(&self, key: &str) -> &Path {
        let path = Path::new(self.get(key));
        if !path.is_file() {
            panic!(
                "test rig tool {key}={} does not exist: rebuild the rig with `make rig-up`",
                path.display()
            );
        }
        path
    }

    pub fn run_dir(&self) -> &Path {
        Path::new(self.get("OUTBOX_RIG_RUN_DIR"))
    }
    /// Superuser URL of the `postgres` database (trust auth, `wal_level=logical`).
    pub fn pg_url(&self) -> &str {
        self.get("OUTBOX_RIG_PG_URL")
    }
    pub fn kafka_bootstrap(&self) -> &str {
        self.get("OUTBOX_RIG_KAFKA_BOOTSTRAP")
    }
    pub fn nats_url(&self) -> &str {
        self.get("OUTBOX_RIG_NATS_URL")
    }
    pub fn nats_monitor_url(&self) -> &str {
        self.get("OUTBOX_RIG_NATS_MONITOR_URL")
    }
    pub fn amqp_url(&self) -> &str {
        self.get("OUTBOX_RIG_AMQP_URL")
    }
    pub fn rabbitmq_mgmt_url(&self) -> Option<&str> {
        self.get_opt("OUTBOX_RIG_RABBITMQ_MGMT_URL")
    }
    /// The API server's audit log: one JSON line per write request (metadata only).
    pub fn kube_audit_log(&self) -> &Path {
        Path::new(self.get("OUTBOX_RIG_KUBE_AUDIT_LOG"))
    }
    pub fn kubeconfig(&self) -> &Path {
        Path::new(self.get("OUTBOX_RIG_KUBECONFIG"))
    }
    pub fn prometheus_url(&self) -> &str {
        self.get("OUTBOX_RIG_PROMETHEUS_URL")
    }
    pub fn helm(&self) -> &Path {
        self.tool("OUTBOX_RIG_HELM")
    }
    pub fn actionlint(&self) -> &Path {
        self.tool("OUTBOX_RIG_ACTIONLINT")
    }
    pub fn mdbook(&self) -> &Path {
        self.tool("OUTBOX_RIG_MDBOOK")
    }
    pub fn kubectl(&self) -> &Path {
        self.tool("OUTBOX_RIG_KUBECTL")
    }
    pub fn promtool(&self) -> &Path {
        self.tool("OUTBOX_RIG_PROMTOOL")
    }
    pub fn kcat(&self) -> &Path {
        self.tool("OUTBOX_RIG_KCAT")
    }
}

/// Parses `KEY=value` lines; blank lines and `#` comments are ignored, values are taken
/// verbatim (the rig writes no quotes).
pub fn parse_env(text: &str) -> HashMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_once('='))
        .map(|(key, value)| {
            let key = key.trim().trim_start_matches("export ").trim();
            (key.to_string(), value.trim().to_string())
        })
        .collect()
}

/// `host:port` of a URL such as `postgres://user@127.0.0.1:5432/db` or `nats://127.0.0.1:4222`.
pub fn host_port(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    authority.rsplit_once('@').map_or(authority, |(_, hp)| hp)
}

/// Fails the test at once, with one line, unless `server` accepts TCP connections at
/// `addr` within [`CONNECT_TIMEOUT`].
pub async fn require_listening(server: &str, addr: &str) {
    let outcome = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await;
    let why = match outcome {
        Ok(Ok(_)) => return,
        Ok(Err(err)) => err.to_string(),
        Err(_) => format!("no answer within {CONNECT_TIMEOUT:?}"),
    };
    panic!("{server} at {addr} does not answer ({why}): {START_HINT}");
}

/// A fresh lowercase alphanumeric suffix, valid in SQL identifiers, Kubernetes names,
/// Kafka topics, NATS subjects and AMQP queue names.
pub fn unique_suffix() -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..10)
        .map(|_| char::from(CHARS[rng.random_range(0..CHARS.len())]))
        .collect()
}

/// Polls `condition` until it returns true; panics naming `what` after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for_some(what, timeout, || {
        let fut = condition();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Polls `probe` until it returns `Some(value)` and returns that value; panics naming
/// `what` after `timeout`.
pub async fn wait_for_some<T, F, Fut>(what: &str, timeout: Duration, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    wait_for_some_or(what, timeout, String::new, probe).await
}

/// Like [`wait_for`], but on timeout the panic message also carries the log tail of
/// each relay process, so a failed relay test says what the relay was doing.
pub async fn wait_for_relays<F, Fut>(
    what: &str,
    timeout: Duration,
    relays: &[&RelayProcess],
    mut condition: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let logs = || {
        relays
            .iter()
            .enumerate()
            .map(|(i, r)| format!("\n--- relay {i} log tail ---\n{}", r.log_tail(40)))
            .collect::<String>()
    };
    wait_for_some_or(what, timeout, logs, || {
        let fut = condition();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Polls `probe` until it returns `Some(value)`; after `timeout` panics naming `what`,
/// followed by whatever `context` says (logs of the processes involved).
pub async fn wait_for_some_or<T, C, F, Fut>(
    what: &str,
    timeout: Duration,
    context: C,
    mut probe: F,
) -> T
where
    C: FnOnce() -> String,
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    let mut pause = Duration::from_millis(20);
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        if started.elapsed() >= timeout {
            panic!(
                "timed out after {timeout:?} waiting for {what}{}",
                context()
            );
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

// ---------------------------------------------------------------------------------------
// PostgreSQL

/// A database created for one test, with an open connection to it.
pub struct TestDatabase {
    /// Database name, `test_<random>`.
    pub name: String,
    /// Connection string for this database (superuser, like the rig's).
    pub url: String,
    /// An open connection; its connection task runs on the test's runtime.
    pub client: tokio_postgres::Client,
}

impl TestDatabase {
    /// Best-effort cleanup: closes our connection and drops the database, ending any
    /// session still in it. Tests need not call it: the rig's cluster is thrown away.
    pub async fn drop_database(self) {
        let TestDatabase { name, client, url } = self;
        drop(client);
        // The server it lives on (the rig's 15 or its 18).
        if let Ok(admin) = pg_connect(&pg_url_for(&url, "postgres")).await {
            let _ = admin
                .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                .await;
        }
    }
}

/// Connects to PostgreSQL with a short connect timeout; the connection task is spawned.
pub async fn pg_connect(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let mut config: tokio_postgres::Config = url.parse()?;
    config.connect_timeout(CONNECT_TIMEOUT);
    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        // The connection ends when the client is dropped; errors then are expected.
        let _ = connection.await;
    });
    Ok(client)
}

/// `url` with its database (path) replaced by `database`.
pub fn pg_url_for(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let authority_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{database}", &base[..authority_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

/// A superuser connection to the rig's `postgres` database.
pub async fn pg_admin() -> tokio_postgres::Client {
    let rig = Rig::load();
    require_listening("PostgreSQL", host_port(rig.pg_url())).await;
    pg_connect(rig.pg_url()).await.unwrap_or_else(|err| {
        panic!(
            "PostgreSQL at {} refused the test connection ({err}): {START_HINT}",
            host_port(rig.pg_url())
        )
    })
}

/// Creates database `test_<random>` on the rig's PostgreSQL 18 and connects to it.
pub async fn fresh_database_18() -> TestDatabase {
    let rig = Rig::load();
    let server = rig.get("OUTBOX_RIG_PG18_URL").to_owned();
    require_listening("PostgreSQL 18", host_port(&server)).await;
    let admin = pg_connect(&server).await.unwrap_or_else(|err| {
        panic!("PostgreSQL 18 refused the test connection ({err}): {START_HINT}")
    });
    let name = format!("test_{}", unique_suffix());
    admin
        .batch_execute(&format!("CREATE DATABASE \"{name}\""))
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL 18: CREATE DATABASE {name} failed: {err}"));
    let url = pg_url_for(&server, &name);
    let client = pg_connect(&url)
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL 18: connecting to {name} failed: {err}"));
    TestDatabase { name, url, client }
}

/// The rig's PostgreSQL servers: Debian's 15 and 18 (from its PyPI wheel). Log tailing
/// is tested on both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pg {
    V15,
    V18,
}

impl Pg {
    /// A fresh database on this server.
    pub async fn fresh(self) -> TestDatabase {
        match self {
            Pg::V15 => fresh_database().await,
            Pg::V18 => fresh_database_18().await,
        }
    }

    /// The server's admin URL (slots are the server's, not a database's).
    pub fn server_url(self) -> String {
        let rig = Rig::load();
        match self {
            Pg::V15 => rig.pg_url().to_owned(),
            Pg::V18 => rig.get("OUTBOX_RIG_PG18_URL").to_owned(),
        }
    }
}

/// Creates database `test_<random>` and connects to it.
pub async fn fresh_database() -> TestDatabase {
    let rig = Rig::load();
    let admin = pg_admin().await;
    let name = format!("test_{}", unique_suffix());
    admin
        .batch_execute(&format!("CREATE DATABASE \"{name}\""))
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: CREATE DATABASE {name} failed: {err}"));
    let url = pg_url_for(rig.pg_url(), &name);
    let client = pg_connect(&url).await.unwrap_or_else(|err| {
        panic!("PostgreSQL: connecting to fresh database {name} failed: {err}")
    });
    TestDatabase { name, url, client }
}

// ---------------------------------------------------------------------------------------
// Kafka

/// rdkafka settings every test client shares: the rig's bootstrap servers and timeouts
/// short enough that a dead broker shows up in seconds.
pub fn kafka_config() -> rdkafka::ClientConfig {
    kafka_config_for(Rig::load().kafka_bootstrap())
}

/// [`kafka_config`] for another broker (a private one).
pub fn kafka_config_for(bootstrap: &str) -> rdkafka::ClientConfig {
    let mut config = rdkafka::ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("socket.connection.setup.timeout.ms", "5000")
        .set("message.timeout.ms", "30000");
    config
}

/// Creates topic `test-<random>` with `partitions` partitions (replication 1) and waits
/// until every partition has a leader in the cluster metadata. Returns the topic name.
pub async fn fresh_topic(partitions: i32) -> String {
    let topic = format!("test-{}", unique_suffix());
    create_topic(Rig::load().kafka_bootstrap(), &topic, partitions, &[]).await;
    topic
}

/// Creates `topic` on the broker at `bootstrap` with topic `configs` (such as
/// `max.message.bytes`) and waits until every partition has a leader.
pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32, configs: &[(&str, &str)]) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;

    require_listening("Kafka", bootstrap).await;
    let topic = topic.to_owned();
    let admin: AdminClient<DefaultClientContext> = kafka_config_for(bootstrap)
        .create()
        .unwrap_or_else(|err| panic!("Kafka: cannot build an admin client: {err}"));
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(20)));
    let results = admin
        .create_topics(
            &[configs.iter().fold(
                NewTopic::new(&topic, partitions, TopicReplication::Fixed(1)),
                |t, (key, value)| t.set(key, value),
            )],
            &options,
        )
        .await
        .unwrap_or_else(|err| {
            panic!("Kafka at {bootstrap} did not create topic {topic} ({err}): {START_HINT}")
        });
    for result in results {
        if let Err((name, code)) = result {
            panic!("Kafka refused to create topic {name}: {code}");
        }
    }

    let wanted = usize::try_from(partitions).unwrap_or(0);
    let name = topic.clone();
    let bootstrap_owned = bootstrap.to_owned();
    let checked = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let consumer: BaseConsumer = kafka_config_for(&bootstrap_owned)
            .create()
            .map_err(|err| format!("cannot build a metadata client: {err}"))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let metadata = consumer
                .fetch_metadata(Some(&name), Duration::from_secs(5))
                .map_err(|err| format!("metadata request failed: {err}"));
            if let Ok(metadata) = &metadata {
                let ready = metadata.topics().iter().any(|t| {
                    t.name() == name
                        && t.error().is_none()
                        && t.partitions().len() == wanted
                        && t.partitions().iter().all(|p| p.leader() >= 0)
                });
                if ready {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(match metadata {
                    Err(err) => err,
                    Ok(_) => "no leaders for all partitions after 30s".to_string(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await;
    match checked {
        Ok(Ok(())) => {}
        Ok(Err(why)) => panic!("Kafka: topic {topic} not ready: {why}"),
        Err(join) => panic!("Kafka: metadata task for {topic} failed: {join}"),
    }
}

// ---------------------------------------------------------------------------------------
// NATS JetStream

/// A JetStream stream created for one test.
pub struct TestStream {
    pub client: async_nats::Client,
    pub jetstream: async_nats::jetstream::Context,
    /// Stream name, `TEST_<random>`.
    pub name: String,
    /// The stream captures `<subject_prefix>.>`.
    pub subject_prefix: String,
}

/// Connects to the rig's NATS server, failing fast when it is down.
pub async fn nats_connect() -> async_nats::Client {
    let rig = Rig::load();
    let addr = host_port(rig.nats_url());
    require_listening("NATS", addr).await;
    let connecting = async_nats::ConnectOptions::new()
        .connection_timeout(CONNECT_TIMEOUT)
        .connect(rig.nats_url());
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, connecting).await {
        Ok(Ok(client)) => client,
        Ok(Err(err)) => panic!("NATS at {addr} refused the test connection ({err}): {START_HINT}"),
        Err(_) => panic!(
            "NATS at {addr} did not finish the handshake in {HANDSHAKE_TIMEOUT:?}: {START_HINT}"
        ),
    }
}

/// Creates stream `TEST_<random>` capturing subjects `test.<random>.>`.
pub async fn fresh_stream() -> TestStream {
    stream_on(nats_connect().await).await
}

/// Creates stream `TEST_<random>` on the server `client` is connected to.
pub async fn stream_on(client: async_nats::Client) -> TestStream {
    let jetstream = async_nats::jetstream::new(client.clone());
    let suffix = unique_suffix();
    let name = format!("TEST_{suffix}");
    let subject_prefix = format!("test.{suffix}");
    jetstream
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{subject_prefix}.>")],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|err| {
            panic!("NATS: creating JetStream stream {name} failed (is JetStream enabled?): {err}")
        });
    TestStream {
        client,
        jetstream,
        name,
        subject_prefix,
    }
}

// ---------------------------------------------------------------------------------------
// RabbitMQ

/// A queue declared for one test, with the connection and channel that declared it.
pub struct TestQueue {
    pub connection: lapin::Connection,
    pub channel: lapin::Channel,
    /// Queue name, `test-<random>`.
    pub name: String,
}

/// Connects to the rig's RabbitMQ node, failing fast when it is down.
pub async fn amqp_connect() -> lapin::Connection {
    let rig = Rig::load();
    let addr = host_port(rig.amqp_url());
    require_listening("RabbitMQ", addr).await;
    let connecting =
        lapin::Connection::connect(rig.amqp_url(), lapin::ConnectionProperties::default());
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, connecting).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(err)) => {
            panic!("RabbitMQ at {addr} refused the test connection ({err}): {START_HINT}")
        }
        Err(_) => panic!(
            "RabbitMQ at {addr} did not finish the handshake in {HANDSHAKE_TIMEOUT:?}: {START_HINT}"
        ),
    }
}

/// Declares durable queue `test-<random>` on a new connection and channel.
pub async fn fresh_queue() -> TestQueue {
    queue_on(amqp_connect().await, &format!("test-{}", unique_suffix())).await
}

/// Declares durable queue `name` (or finds it) on a new channel of `connection`: a
/// fresh queue, or one read again after its node restarted.
pub async fn queue_on(connection: lapin::Connection, name: &str) -> TestQueue {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;

    let channel = connection
        .create_channel()
        .await
        .unwrap_or_else(|err| panic!("RabbitMQ: opening a channel failed: {err}"));
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|err| panic!("RabbitMQ: declaring queue {name} failed: {err}"));
    TestQueue {
        connection,
        channel,
        name: name.to_owned(),
    }
}

/// Connects to the RabbitMQ node at `url` (a private one).
pub async fn amqp_connect_to(url: &str) -> lapin::Connection {
    let connecting = lapin::Connection::connect(url, lapin::ConnectionProperties::default());
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, connecting).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(err)) => panic!(
            "RabbitMQ at {} refused the test connection: {err}",
            host_port(url)
        ),
        Err(_) => panic!(
            "RabbitMQ at {} did not finish the handshake",
            host_port(url)
        ),
    }
}

// ---------------------------------------------------------------------------------------
// Kubernetes

/// A client for the rig's kube-apiserver (admin credentials from the rig kubeconfig).
///
/// Built per test: a `kube::Client` belongs to the tokio runtime it was made on, and
/// every `#[tokio::test]` has its own.
pub async fn kube_client() -> kube::Client {
    outbox_operator::install_crypto_provider();
    use kube::config::{KubeConfigOptions, Kubeconfig};

    let rig = Rig::load();
    let kubeconfig = Kubeconfig::read_from(rig.kubeconfig()).unwrap_or_else(|err| {
        panic!(
            "cannot read the rig kubeconfig {} ({err}): {START_HINT}",
            rig.kubeconfig().display()
        )
    });
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap_or_else(|err| {
                panic!(
                    "rig kubeconfig {} is unusable ({err}): {START_HINT}",
                    rig.kubeconfig().display()
                )
            });
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.read_timeout = Some(Duration::from_secs(60));
    let authority = config
        .cluster_url
        .authority()
        .map_or_else(|| config.cluster_url.to_string(), |a| a.to_string());
    require_listening("kube-apiserver", &authority).await;
    let client = kube::Client::try_from(config)
        .unwrap_or_else(|err| panic!("cannot build a Kubernetes client: {err}"));
    if let Err(err) = client.apiserver_version().await {
        panic!("kube-apiserver at {authority} does not answer ({err}): {START_HINT}");
    }
    client
}

/// Creates namespace `test-<random>` and returns its name.
pub async fn fresh_namespace(client: &kube::Client) -> String {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{Api, ObjectMeta, PostParams};

    let name = format!("test-{}", unique_suffix());
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([("outbox.dev/test".to_string(), "true".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap_or_else(|err| panic!("Kubernetes: creating namespace {name} failed: {err}"));
    name
}

/// Best-effort deletion of a test namespace (kube-controller-manager finishes it).
pub async fn delete_namespace(client: &kube::Client, name: &str) {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{Api, DeleteParams};

    let _ = Api::<Namespace>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await;
}

// ---------------------------------------------------------------------------------------
// Command-line tools

/// Runs a rig tool with `args` (and no stdin) and returns its output; panics only if it
/// cannot be started at all.
pub fn run_tool(tool: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(tool)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|err| panic!("cannot run {}: {err}", tool.display()))
}

/// Output of a finished tool as one readable block, for assertion messages.
pub fn describe_output(output: &std::process::Output) -> String {
    format!(
        "exit status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

// ---------------------------------------------------------------------------------------
// Relay: outbox tables, config files, the real binary, and what brokers received

/// Creates `public.outbox` (Debezium column names plus a `traceparent` header column)
/// with the partition index for `partitions`, as examples/schema.sql documents it.
pub async fn create_outbox_table(client: &tokio_postgres::Client, partitions: i32) {
    client
        .batch_execute(&format!(
            "CREATE TABLE public.outbox (
                id bigserial PRIMARY KEY,
                aggregatetype text NOT NULL,
                aggregateid text NOT NULL,
                type text NOT NULL,
                payload jsonb,
                traceparent text,
                created_at timestamptz NOT NULL DEFAULT now(),
                published_at timestamptz);
             CREATE INDEX outbox_unpublished_p{partitions} ON public.outbox
                (((hashtextextended(coalesce(\"aggregateid\"::text, ''), 0) & 9223372036854775807) % {partitions}), \"id\")
                WHERE \"published_at\" IS NULL;"
        ))
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: creating the outbox table failed: {err}"));
}

/// Commits `count` outbox rows of type `order`, each in its own statement, over five
/// aggregates `<prefix>0..4`; their ids.
pub async fn commit_rows(client: &tokio_postgres::Client, prefix: &str, count: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(count);
    for i in 0..count {
        let aggregate = format!("{prefix}{}", i % 5);
        ids.push(
            insert_row(
                client,
                "order",
                &aggregate,
                &serde_json::json!({"i": i, "aggregate": aggregate}),
            )
            .await,
        );
    }
    ids
}

/// Inserts one outbox row in its own statement and returns its id.
pub async fn insert_row(
    client: &impl tokio_postgres::GenericClient,
    aggregate_type: &str,
    aggregate_id: &str,
    payload: &serde_json::Value,
) -> i64 {
    client
        .query_one(
            "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, traceparent) \
             VALUES ($1, $2, 'Happened', ($3::text)::jsonb, '00-trace-01') RETURNING id",
            &[&aggregate_type, &aggregate_id, &payload.to_string()],
        )
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: inserting an outbox row failed: {err}"))
        .get(0)
}

/// Number of rows still waiting to be published.
pub async fn unpublished_rows(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM public.outbox WHERE published_at IS NULL",
            &[],
        )
        .await
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

/// Which broker a relay under test publishes to, and where.
#[derive(Clone, Debug)]
pub enum RelayBroker {
    /// Kafka topic (used as a literal topic template).
    Kafka { bootstrap: String, topic: String },
    /// NATS subject (literal) captured by a stream.
    Nats { url: String, subject: String },
    /// RabbitMQ exchange and routing key.
    Amqp {
        url: String,
        exchange: String,
        routing_key: String,
    },
}

/// Options of a relay config file; `Default` is a fast-polling perAggregate relay.
#[derive(Clone, Debug)]
pub struct RelayOptions {
    pub partitions: i32,
    pub batch_size: i32,
    pub interval: &'static str,
    pub ordering: &'static str,
    pub max_attempts: i32,
    pub on_exhausted: &'static str,
    pub retention: &'static str,
    /// Polling's batch loops per process (`spec.mode.polling.workers`).
    pub workers: i32,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            partitions: 4,
            batch_size: 100,
            interval: "50ms",
            ordering: "perAggregate",
            max_attempts: 10,
            on_exhausted: "block",
            retention: "24h",
            workers: 1,
        }
    }
}

/// The YAML of a relay config file for `broker` and `options`: the relay's identity and
/// its spec, one spec field a line (indented two spaces), so tests can swap a line.
pub fn relay_config_yaml(broker: &RelayBroker, options: &RelayOptions) -> String {
    let broker_yaml = match broker {
        RelayBroker::Kafka { bootstrap, topic } => {
            format!("kafka: {{bootstrapServers: \"{bootstrap}\", topic: \"{topic}\"}}")
        }
        RelayBroker::Nats { url, subject } => {
            format!("nats: {{url: \"{url}\", subject: \"{subject}\"}}")
        }
        RelayBroker::Amqp {
            exchange,
            routing_key,
            ..
        } => format!(
            // The rig's plain AMQP port, with the URI's password: allowed explicitly.
            "rabbitmq: {{urlSecretRef: {{name: amqp}}, allowPlaintextCredentials: true, exchange: \"{exchange}\", routingKey: \"{routing_key}\"}}"
        ),
    };
    let RelayOptions {
        partitions,
        batch_size,
        interval,
        ordering,
        max_attempts,
        on_exhausted,
        retention,
        workers,
    } = options;
    format!(
        "relay: {{namespace: test, name: relay}}
spec:
  database: {{postgres: {{connectionSecretRef: {{name: db}}, sslMode: disable}}}}
  table: {{schema: public, name: outbox, headers: [traceparent]}}
  mode: {{polling: {{interval: {interval}, batchSize: {batch_size}, afterPublish: mark, workers: {workers}}}}}
  broker: {{{broker_yaml}}}
  ordering: {{mode: {ordering}, partitions: {partitions}}}
  retention: {{publishedRows: {retention}}}
  failure: {{maxAttempts: {max_attempts}, onExhausted: {on_exhausted}}}
listen: 127.0.0.1:0
"
    )
}

/// `yaml` (a [`relay_config_yaml`], one spec field a line) with the line of spec field
/// `field` replaced by `field: value`.
pub fn with_spec_line(yaml: &str, field: &str, value: &str) -> String {
    let prefix = format!("  {field}:");
    yaml.lines()
        .map(|line| {
            if line.starts_with(&prefix) {
                format!("{prefix} {value}")
            } else {
                line.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `mode` of a log-tailing relay on `slot` (publication of the same name), with
/// 1 s heartbeats.
pub fn log_tailing_mode(slot: &str, delete_after_publish: bool) -> String {
    format!(
        "{{logTailing: {{slotName: {slot}, publicationName: {slot}, heartbeatInterval: 1s, \
         deleteAfterPublish: {delete_after_publish}}}}}"
    )
}

/// A log-tailing relay config: [`relay_config_yaml`] with default options and its mode
/// line replaced by [`log_tailing_mode`].
pub fn log_tailing_yaml(broker: &RelayBroker, slot: &str, delete_after_publish: bool) -> String {
    with_spec_line(
        &relay_config_yaml(broker, &RelayOptions::default()),
        "mode",
        &log_tailing_mode(slot, delete_after_publish),
    )
}

/// What makes publication `publication` publish `public.outbox` now (the identity the
/// relay's publication gate compares, and the operator records as the baseline).
pub async fn publication_identity(client: &tokio_postgres::Client, publication: &str) -> String {
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: server_version_num: {err}"))
        .get(0);
    outbox_operator::postgres::coverage::members(client, version, publication, "public", "outbox")
        .await
        .unwrap_or_else(|err| panic!("{err}"))
        .1
}

/// Waits until `relay` streams `slot` (created beforehand, e.g. by
/// [`create_replication`]): rows committed before that are streamed too, but a test
/// that writes afterwards knows the stream is up.
pub async fn wait_slot_active(client: &tokio_postgres::Client, slot: &str, relay: &RelayProcess) {
    wait_for_relays(
        "the relay to stream its slot",
        Duration::from_secs(60),
        &[relay],
        || slot_active(client, slot),
    )
    .await;
}

/// True while a consumer streams `slot` (false also when the query fails).
pub async fn slot_active(client: &tokio_postgres::Client, slot: &str) -> bool {
    client
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active",
            &[&slot],
        )
        .await
        .ok()
        .flatten()
        .is_some()
}

/// A running `outbox-operator relay` process; SIGKILLed when dropped (also on panic).
pub struct RelayProcess {
    pub child: std::process::Child,
    pub stderr_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl RelayProcess {
    /// Writes `yaml` to a file and starts the real binary on it, with the database URL
    /// (and the AMQP URL for RabbitMQ) in the environment. Logs go to a file.
    pub fn start(yaml: &str, database_url: &str, broker: &RelayBroker) -> RelayProcess {
        Self::start_with_env(yaml, database_url, broker, &[])
    }

    /// [`RelayProcess::start`] with more environment variables (Secret values the
    /// relay reads from its environment, such as SASL credentials).
    pub fn start_with_env(
        yaml: &str,
        database_url: &str,
        broker: &RelayBroker,
        env: &[(&str, &str)],
    ) -> RelayProcess {
        Self::start_with_files(yaml, database_url, broker, env, &[])
    }

    /// [`RelayProcess::start_with_env`] with more files beside the config file, as the
    /// operator's ConfigMap puts them (`coverage-baseline`).
    pub fn start_with_files(
        yaml: &str,
        database_url: &str,
        broker: &RelayBroker,
        env: &[(&str, &str)],
        files: &[(&str, &str)],
    ) -> RelayProcess {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("tempdir: {err}"));
        let config = dir.path().join("relay.yaml");
        std::fs::write(&config, yaml).unwrap_or_else(|err| panic!("write config: {err}"));
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text)
                .unwrap_or_else(|err| panic!("write {name}: {err}"));
        }
        let stderr_path = dir.path().join("relay.log");
        let stderr = std::fs::File::create(&stderr_path)
            .unwrap_or_else(|err| panic!("create log file: {err}"));
        let mut command = std::process::Command::new(operator::operator_binary());
        command
            .arg("relay")
            .arg("--config")
            .arg(&config)
            .env("OUTBOX_DATABASE_URL", database_url)
            // OUTBOX_TEST_RELAY_LOG=debug (RUST_LOG syntax) for a failure's fuller story.
            .env(
                "RUST_LOG",
                std::env::var("OUTBOX_TEST_RELAY_LOG").unwrap_or_else(|_| "info".to_owned()),
            )
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(stderr);
        if let RelayBroker::Amqp { url, .. } = broker {
            command.env("OUTBOX_RABBITMQ_URL", url);
        }
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start the relay binary: {err}"));
        RelayProcess {
            child,
            stderr_path,
            _dir: dir,
        }
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM; returns the exit status once the process has exited (panics after
    /// `timeout`).
    pub fn terminate(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status();
        self.wait_exit(timeout, "of SIGTERM")
    }

    /// The exit status once the process has exited; panics after `timeout`, saying
    /// `within` what it did not exit and its log.
    pub fn wait_exit(&mut self, timeout: Duration, within: &str) -> std::process::ExitStatus {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            if started.elapsed() > timeout {
                panic!(
                    "relay did not exit within {timeout:?} {within}; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Everything the relay logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The last `lines` lines the relay logged.
    pub fn log_tail(&self, lines: usize) -> String {
        private::tail(&self.stderr_path, lines)
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The address the relay's HTTP server bound (it listens on port 0 in tests and
    /// logs the address in its "relay starting" line).
    pub async fn http_addr(&self) -> String {
        wait_for_some_or(
            "the relay to log its listen address",
            Duration::from_secs(30),
            || format!("\n--- relay log tail ---\n{}", self.log_tail(40)),
            || async {
                self.log().lines().find_map(|line| {
                    let v: serde_json::Value = serde_json::from_str(line).ok()?;
                    let fields = v.get("fields")?;
                    (fields.get("message")?.as_str()? == "relay starting")
                        .then(|| fields.get("listen")?.as_str().map(str::to_owned))?
                })
            },
        )
        .await
    }

    /// The relay's `/metrics` text, or `None` when it does not answer.
    pub async fn metrics(&self) -> Option<String> {
        let addr = self.http_addr().await;
        let response = reqwest::Client::new()
            .get(format!("http://{addr}/metrics"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        response.text().await.ok()
    }

    /// The value of the unlabelled-by-test sample `name` (constant labels aside).
    pub async fn metric(&self, name: &str) -> Option<f64> {
        metric_value(&self.metrics().await?, name)
    }
}

/// The sum of every sample of metric `name` (all label sets; `name` may include some
/// labels) in an OpenMetrics text.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The value of the first sample of metric `name` in an OpenMetrics text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            return None;
        }
        line.rsplit(' ').next()?.parse().ok()
    })
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Kafka record as kcat (`-J`) prints it: an independent client's view.
pub struct KcatRecord {
    /// The whole JSON envelope (`partition`, `key`, `payload` (null for a tombstone),
    /// `ts`, `tstype`, …).
    pub json: serde_json::Value,
    /// Headers in order (kcat prints them as a flat name, value list).
    pub headers: Vec<(String, String)>,
}

/// Every record of `topic` read by kcat from the beginning, once there are at least
/// `count` (waiting up to 60 s).
pub fn kcat_records(topic: &str, count: usize) -> Vec<KcatRecord> {
    let rig = Rig::load();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let output = run_tool(
            rig.kcat(),
            &[
                "-C",
                "-b",
                rig.kafka_bootstrap(),
                "-t",
                topic,
                "-o",
                "beginning",
                "-e",
                "-J",
                "-q",
            ],
        );
        assert!(
            output.status.success(),
            "kcat failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let records: Vec<KcatRecord> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|line| {
                let json: serde_json::Value = serde_json::from_str(line)
                    .unwrap_or_else(|err| panic!("kcat printed {line}: {err}"));
                let flat: Vec<String> = json["headers"]
                    .as_array()
                    .map(|h| {
                        h.iter()
                            .map(|x| x.as_str().unwrap_or_default().to_owned())
                            .collect()
                    })
                    .unwrap_or_default();
                let headers = flat
                    .chunks(2)
                    .map(|p| (p[0].clone(), p[1].clone()))
                    .collect();
                KcatRecord { json, headers }
            })
            .collect();
        if records.len() >= count {
            return records;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {count} records in {topic} after 60 s",
            records.len()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// One message as a consumer saw it.
#[derive(Clone, Debug)]
pub struct Received {
    /// The outbox row id (Kafka and NATS header `id`, AMQP `message_id`).
    pub id: i64,
    /// Aggregate id (Kafka key; header-less brokers: from the payload's `aggregate`).
    pub aggregate: String,
    /// Headers, as strings.
    pub headers: HashMap<String, String>,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

/// Runs Kafka's own ACL tool against the rig's broker (its plaintext listener, whose
/// principal is a super user there).
fn kafka_acls(args: &[&str]) {
    let rig = Rig::load();
    let classpath = format!("{}/*", rig.get("OUTBOX_RIG_KAFKA_LIBS"));
    let output = std::process::Command::new("java")
        .args(["-cp", &classpath, "org.apache.kafka.tools.AclCommand"])
        .args(["--bootstrap-server", rig.kafka_bootstrap(), "--add"])
        .args(args)
        .output()
        .unwrap_or_else(|err| panic!("cannot run Kafka's AclCommand (java): {err}"));
    assert!(
        output.status.success(),
        "Kafka's AclCommand {args:?} failed (the rig's Kafka needs its authorizer: restart \
         the rig with `make rig-up`):\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Denies `user` an idempotent producer, and lets everyone else do everything: with an
/// ACL on a resource, a principal no ACL names is refused it, so the allowing ones come
/// first (other tests use the same broker meanwhile). Adding an ACL that exists is a
/// no-op, so each test run may do it again.
pub fn deny_idempotent_writes(user: &str) {
    kafka_acls(&[
        "--allow-principal",
        "User:*",
        "--operation",
        "All",
        "--cluster",
        "--topic",
        "*",
        "--group",
        "*",
        "--transactional-id",
        "*",
    ]);
    let principal = format!("User:{user}");
    kafka_acls(&[
        "--deny-principal",
        &principal,
        "--operation",
        "IdempotentWrite",
        "--cluster",
    ]);
    kafka_acls(&[
        "--deny-principal",
        &principal,
        "--operation",
        "Write",
        "--topic",
        "*",
    ]);
}

/// Reads every message of a Kafka topic from the beginning up to the high watermarks.
pub fn consume_kafka(topic: &str) -> Vec<Received> {
    consume_kafka_from(Rig::load().kafka_bootstrap(), topic)
}

/// [`consume_kafka`] from another broker (a private one).
pub fn consume_kafka_from(bootstrap: &str, topic: &str) -> Vec<Received> {
    kafka_records_from(bootstrap, topic)
        .into_iter()
        .map(|record| {
            let headers: HashMap<String, String> = record.headers.into_iter().collect();
            let id = ledger_number(&headers, &record.payload, "Kafka");
            Received {
                id,
                aggregate: String::from_utf8_lossy(&record.key.unwrap_or_default()).into_owned(),
                headers,
                payload: record.payload,
            }
        })
        .collect()
}

/// One Kafka record as sent: every header (in order, values as text), the key and
/// the payload's bytes.
pub struct KafkaRecord {
    pub headers: Vec<(String, String)>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
}

/// Every record of `topic` on the rig's Kafka, from the beginning up to the high
/// watermarks, each partition in order.
pub fn kafka_records(topic: &str) -> Vec<KafkaRecord> {
    kafka_records_from(Rig::load().kafka_bootstrap(), topic)
}

/// [`kafka_records`] from another broker.
pub fn kafka_records_from(bootstrap: &str, topic: &str) -> Vec<KafkaRecord> {
    use rdkafka::Message;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Headers;

    let consumer: BaseConsumer = kafka_config_for(bootstrap)
        .set("group.id", format!("verify-{}", unique_suffix()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap_or_else(|err| panic!("Kafka consumer: {err}"));
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap_or_else(|err| panic!("Kafka metadata: {err}"));
    let partitions: Vec<i32> = metadata.topics()[0]
        .partitions()
        .iter()
        .map(|p| p.id())
        .collect();
    let mut assignment = rdkafka::TopicPartitionList::new();
    let mut remaining = HashMap::new();
    for p in &partitions {
        let (_, high) = consumer
            .fetch_watermarks(topic, *p, Duration::from_secs(10))
            .unwrap_or_else(|err| panic!("Kafka watermarks: {err}"));
        if high > 0 {
            remaining.insert(*p, high);
        }
        assignment
            .add_partition_offset(topic, *p, rdkafka::Offset::Beginning)
            .unwrap_or_else(|err| panic!("assign: {err}"));
    }
    consumer
        .assign(&assignment)
        .unwrap_or_else(|err| panic!("Kafka assign: {err}"));
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !remaining.is_empty() {
        assert!(
            Instant::now() < deadline,
            "Kafka: consuming {topic} timed out"
        );
        let Some(result) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let message = result.unwrap_or_else(|err| panic!("Kafka consume: {err}"));
        let headers = message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|header| {
                        (
                            header.key.to_owned(),
                            String::from_utf8_lossy(header.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(KafkaRecord {
            headers,
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().unwrap_or_default().to_vec(),
        });
        if let Some(high) = remaining.get(&message.partition()).copied()
            && message.offset() + 1 >= high
        {
            remaining.remove(&message.partition());
        }
    }
    out
}

/// Reads every message of a JetStream stream, in stream order.
pub async fn consume_nats(stream: &TestStream) -> Vec<Received> {
    let mut s = stream
        .jetstream
        .get_stream(&stream.name)
        .await
        .unwrap_or_else(|err| panic!("NATS get_stream: {err}"));
    let info = s
        .info()
        .await
        .unwrap_or_else(|err| panic!("NATS stream info: {err}"));
    let last = info.state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        // Nothing in these streams is ever deleted and a deduplicated publish takes no
        // sequence, so every sequence up to `last` holds a message. A failed fetch (the
        // client may still be reconnecting after a broker restart) is retried, never
        // skipped: a skipped message would read as a lost row.
        let mut attempt = 0;
        let message = loop {
            match s.get_raw_message(seq).await {
                Ok(message) => break message,
                Err(_) if attempt < 50 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(err) => panic!("NATS: fetching stream message {seq} failed: {err}"),
            }
        };
        let mut headers = HashMap::new();
        for (name, values) in message.headers.iter() {
            if let Some(v) = values.first() {
                headers.insert(name.to_string(), v.to_string());
            }
        }
        let payload = message.payload.to_vec();
        let id = ledger_number(&headers, &payload, "NATS");
        out.push(Received {
            id,
            aggregate: aggregate_of(&payload),
            headers,
            payload,
        });
    }
    out
}

/// Drains a RabbitMQ queue (basic.get until empty).
pub async fn consume_amqp(queue: &TestQueue) -> Vec<Received> {
    use lapin::options::BasicGetOptions;
    let mut out = Vec::new();
    loop {
        let got = queue
            .channel
            .basic_get(queue.name.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap_or_else(|err| panic!("RabbitMQ basic_get: {err}"));
        let Some(message) = got else {
            return out;
        };
        let props = &message.delivery.properties;
        let id = props
            .message_id()
            .as_ref()
            .and_then(|v| v.as_str().parse().ok())
            .unwrap_or_else(|| panic!("AMQP message without a numeric message_id"));
        let mut headers = HashMap::new();
        if let Some(table) = props.headers() {
            for (k, v) in table {
                if let lapin::types::AMQPValue::LongString(s) = v {
                    headers.insert(
                        k.as_str().to_owned(),
                        String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    );
                }
            }
        }
        let payload = message.delivery.data.clone();
        out.push(Received {
            id,
            aggregate: aggregate_of(&payload),
            headers,
            payload,
        });
    }
}

/// The `aggregate` field tests put into every payload.
pub fn aggregate_of(payload: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| {
            v.get("aggregate")
                .and_then(|a| a.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

/// Declares a topic exchange `test-x-<random>` bound to `queue` for every routing key.
pub async fn fresh_exchange_for(queue: &TestQueue) -> String {
    let exchange = format!("test-x-{}", unique_suffix());
    bind_queue(queue, &exchange, "#").await;
    exchange
}

/// Declares durable topic exchange `exchange` (when missing) and binds `queue` to it
/// with `routing_key`.
pub async fn bind_queue(queue: &TestQueue, exchange: &str, routing_key: &str) {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use lapin::types::FieldTable;
    queue
        .channel
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|err| panic!("RabbitMQ: declaring exchange {exchange} failed: {err}"));
    queue
        .channel
        .queue_bind(
            queue.name.as_str().into(),
            exchange.into(),
            routing_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|err| {
            panic!(
                "RabbitMQ: binding {} to {exchange} failed: {err}",
                queue.name
            )
        });
}

/// What a delivery check found: counted, then asserted by the caller.
#[derive(Debug, Default)]
pub struct DeliveryReport {
    pub received: usize,
    pub distinct: usize,
    pub duplicates: usize,
    pub missing: Vec<i64>,
    pub orphans: Vec<i64>,
    /// First deliveries after a later row of their aggregate.
    pub order_violations: Vec<String>,
    /// Older rows delivered again after newer ones that did not come again after them
    /// (see [`check_delivery`]).
    pub stale_redeliveries: Vec<String>,
}

impl DeliveryReport {
    /// Asserts that every delivery kept per-aggregate order, redeliveries included, and
    /// that nothing arrived for a row never committed (rolled back, or lost with a
    /// primary that died before its standby had it: a phantom).
    #[track_caller]
    pub fn assert_ordered_without_orphans(&self) {
        assert!(
            self.orphans.is_empty(),
            "events for rows never committed (rolled back, or phantoms of a failover): {:?}",
            self.orphans
        );
        assert!(
            self.order_violations.is_empty(),
            "per-aggregate order broken, first {:?}",
            &self.order_violations[..self.order_violations.len().min(10)]
        );
        assert!(
            self.stale_redeliveries.is_empty(),
            "redeliveries outside a replayed window, first {:?}",
            &self.stale_redeliveries[..self.stale_redeliveries.len().min(10)]
        );
    }

    /// Asserts that no committed row is missing, no rolled-back row arrived, and every
    /// aggregate's rows came in order.
    #[track_caller]
    pub fn assert_complete(&self) {
        assert!(self.missing.is_empty(), "lost: {:?}", self.missing);
        assert!(self.orphans.is_empty(), "orphans: {:?}", self.orphans);
        assert!(
            self.order_violations.is_empty(),
            "order: {:?}",
            self.order_violations
        );
    }
}

/// Compares what a consumer saw with the committed and aborted row ids, looking at every
/// delivery, redeliveries included. Per aggregate:
///
/// - a row's first delivery never comes after a later row of its aggregate;
/// - a redelivery belongs to a replayed window: once an older row is delivered again
///   after newer ones, the aggregate's newest row must be delivered again after it
///   before any new row of the aggregate arrives, and by the end. Otherwise a consumer
///   that applies events as they come (no deduplication) is left with a stale state —
///   the older event after the newer one.
pub fn check_delivery(
    received: &[Received],
    committed: &std::collections::BTreeSet<i64>,
    aborted: &std::collections::BTreeSet<i64>,
) -> DeliveryReport {
    /// An aggregate's deliveries so far: the newest row delivered, and an older row
    /// delivered again after it, while the newest has not come again since.
    #[derive(Default)]
    struct Aggregate {
        newest: i64,
        stale: Option<i64>,
    }
    let stale = |aggregate: &str, a: &Aggregate, before: &str| {
        format!(
            "aggregate {aggregate}: row {} was delivered again after row {}, which was not delivered again after it {before}",
            a.stale.unwrap_or_default(),
            a.newest
        )
    };
    let mut seen = std::collections::HashSet::new();
    let mut aggregates: HashMap<&str, Aggregate> = HashMap::new();
    let mut report = DeliveryReport {
        received: received.len(),
        ..Default::default()
    };
    for message in received {
        let first = seen.insert(message.id);
        let a = aggregates.entry(message.aggregate.as_str()).or_default();
        if first {
            if !committed.contains(&message.id) || aborted.contains(&message.id) {
                report.orphans.push(message.id);
            }
            if message.id < a.newest {
                report.order_violations.push(format!(
                    "aggregate {}: row {} delivered after row {}",
                    message.aggregate, message.id, a.newest
                ));
            } else if a.stale.is_some() {
                report.stale_redeliveries.push(stale(
                    &message.aggregate,
                    a,
                    &format!("before row {} came", message.id),
                ));
            }
            a.stale = None;
        } else {
            report.duplicates += 1;
            a.stale = (message.id < a.newest).then_some(message.id);
        }
        a.newest = a.newest.max(message.id);
    }
    let mut left: Vec<String> = aggregates
        .iter()
        .filter(|(_, a)| a.stale.is_some())
        .map(|(aggregate, a)| stale(aggregate, a, "by the end"))
        .collect();
    left.sort();
    report.stale_redeliveries.extend(left);
    report.distinct = seen.len();
    report.missing = committed
        .iter()
        .filter(|id| !seen.contains(id))
        .copied()
        .collect();
    report
}

/// Applies the OutboxRelay CRD from the code (server-side, forced, so a changed schema
/// replaces an older one) and waits until the API server serves it.
pub async fn install_outbox_crd(client: &kube::Client) {
    use kube::CustomResourceExt;
    apply_crd(
        client,
        &outbox_operator::api::OutboxRelay::crd(),
        "the OutboxRelay CRD",
    )
    .await;
    apply_crd(
        client,
        &outbox_operator::api::OutboxReplay::crd(),
        "the OutboxReplay CRD",
    )
    .await;
}

/// Applies `crd` (server-side) and waits until the API server serves it (Established).
pub async fn apply_crd(
    client: &kube::Client,
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    what: &str,
) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::ResourceExt;
    use kube::api::{Api, Patch, PatchParams};

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.name_any();
    crds.patch(
        &name,
        &PatchParams::apply("outbox-operator-test").force(),
        &Patch::Apply(crd),
    )
    .await
    .unwrap_or_else(|e| panic!("the API server refused {what}: {e}"));
    wait_for(
        &format!("{what} to be Established"),
        Duration::from_secs(60),
        || async {
            crds.get_opt(&name).await.ok().flatten().is_some_and(|c| {
                c.status
                    .and_then(|s| s.conditions)
                    .into_iter()
                    .flatten()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            })
        },
    )
    .await;
}

/// Creates the publication (inserts into `public.outbox`) and the `pgoutput` slot through
/// the operator's own code (`outbox_operator::postgres::provision::provision`), for tests
/// that run a log-tailing relay without the controller: the relay never creates them.
pub async fn create_replication(client: &tokio_postgres::Client, slot: &str, publication: &str) {
    let owner = outbox_operator::postgres::admin::Owner {
        namespace: "test".to_owned(),
        name: slot.replace('_', "-"),
        uid: format!("test-{slot}"),
    };
    create_replication_for(client, slot, publication, &owner).await;
}

/// [`create_replication`] marked as made for the OutboxRelay `owner`.
pub async fn create_replication_for(
    client: &tokio_postgres::Client,
    slot: &str,
    publication: &str,
    owner: &outbox_operator::postgres::admin::Owner,
) {
    use outbox_operator::postgres::admin::{Plan, SlotPlan};

    let plan = Plan {
        schema: "public".to_owned(),
        table: "outbox".to_owned(),
        id: "id".to_owned(),
        columns: Vec::new(),
        created_at: "created_at".to_owned(),
        published_at: None,
        marker: "published_at".to_owned(),
        privileges: Vec::new(),
        log_tailing: Some(SlotPlan {
            slot: slot.to_owned(),
            publication: publication.to_owned(),
            delete_after_publish: true,
        }),
        archive: None,
        dead_letter: "outbox_dead_letter".to_owned(),
    };
    outbox_operator::postgres::provision::provision(client, &plan, owner)
        .await
        .unwrap_or_else(|err| panic!("creating slot {slot} and publication {publication}: {err}"));
}

// ---------------------------------------------------------------------------------------
// Replication slots

/// Drops replication slot `slot`, terminating a walsender still streaming it (it takes
/// a moment to let go), and returns whether it is gone. Best effort, for cleanups.
pub async fn drop_slot(client: &tokio_postgres::Client, slot: &str) -> bool {
    for _ in 0..100 {
        let _ = client
            .execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
                &[&slot],
            )
            .await;
        let _ = client
            .query_one(
                "SELECT count(pg_drop_replication_slot(slot_name)) \
                 FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
                &[&slot],
            )
            .await;
        let gone = client
            .query_one(
                "SELECT count(*) = 0 FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .is_ok_and(|r| r.get::<_, bool>(0));
        if gone {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A slot name `<prefix>_<random>` whose slot is dropped when the guard goes (pass or
/// fail): a leaked slot would retain the shared cluster's WAL.
pub struct SlotGuard {
    admin_url: String,
    pub slot: String,
}

impl SlotGuard {
    pub fn new(admin_url: &str, prefix: &str) -> Self {
        Self {
            admin_url: admin_url.to_owned(),
            slot: format!("{prefix}_{}", unique_suffix()),
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let (url, slot) = (self.admin_url.clone(), self.slot.clone());
        // Drop may run inside a runtime: use a thread with its own.
        let dropped = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return false;
            };
            rt.block_on(async move {
                match pg_connect(&url).await {
                    Ok(client) => drop_slot(&client, &slot).await,
                    Err(_) => false,
                }
            })
        })
        .join()
        .unwrap_or(false);
        if !dropped {
            eprintln!(
                "WARNING: replication slot {} could not be dropped",
                self.slot
            );
        }
    }
}

/// A replication slot's row: (active, WAL it retains in bytes), `None` when there is no
/// slot of that name.
pub async fn slot_row(client: &tokio_postgres::Client, slot: &str) -> Option<(bool, i64)> {
    client
        .query_opt(
            "SELECT active, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap_or_else(|e| panic!("reading pg_replication_slots: {e}"))
        .map(|r| (r.get(0), r.get(1)))
}
