//! The operator: watches OutboxRelays (one namespace or all), reconciles each into its
//! child objects and status, and does so only while it holds the leader Lease.
//!
//! One reconcile is a pipeline (`reconcile.rs`): parse the spec once
//! (`crate::spec::parse`) and build the children (pure, `crate::resources`) → observe
//! the Secrets, the database and the children (`observe.rs`, reads only) → decide
//! (`decide.rs`, a pure function: conditions, the SQL to run, whether to apply) → apply
//! (the planned SQL, then the children with server-side apply, pruning the ones no
//! longer built) → status (conditions and the slot's name). The figures in status
//! (backlog, oldest age, slot lag) are sampled apart, by `figures.rs`, while this
//! replica holds the Lease. The finalizer stops a log-tailing relay and then drops the
//! slot and publication the operator created.

mod apply;
mod connection;
mod database;
mod decide;
mod figures;
mod metrics;
mod observe;
mod pods;
mod protect;
mod readyz;
mod reconcile;
mod referenced;
mod status;
mod tools;
mod triggers;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::controller::Controller;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::watcher::{self, watcher};
use kube::{Api, Client};
use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::watch;
use tracing::{Instrument, info, warn};

use crate::api::OutboxRelay;
use crate::resources::{BuildError, BuildOptions, MANAGED_BY};

pub use metrics::Metrics;
pub use status::{
    CONDITION_BROKER_READY, CONDITION_DATABASE_READY, CONDITION_DEGRADED,
    CONDITION_MONITORING_READY, CONDITION_READY, CONDITION_SLOT_READY,
};

/// The finalizer the operator puts on every OutboxRelay, so that it can drop what lives
/// outside Kubernetes (the replication slot) before the object goes.
pub const FINALIZER: &str = "outbox.dev/cleanup";

/// Everything that can go wrong in the controller, `crd` and `render`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Adding or removing the finalizer, or the apply/cleanup inside it, failed.
    #[error("{0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// The objects could not be built from the spec.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// YAML output could not be produced.
    #[error("cannot write YAML: {0}")]
    Yaml(#[source] serde_yaml::Error),
    /// A manifest file could not be read.
    #[error("cannot read {path}: {source}")]
    ReadManifest {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A manifest could not be used.
    #[error("{origin}: document {document}: {message}")]
    Manifest {
        /// The file.
        origin: String,
        /// 1-based document number in the YAML stream (0: the file as a whole).
        document: usize,
        /// What is wrong.
        message: String,
    },
    /// The metrics/health listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Leader election failed.
    #[error("leader election: {0}")]
    Lease(#[from] kube_lease_manager::LeaseManagerError),
    /// The finalizer waits: for the relay's pods to stop, or for the database to drop
    /// the slot in. Retried soon; not a failure.
    #[error("cleanup pending: {0}")]
    CleanupPending(String),
    /// The finalizer cannot drop the slot now (database unreachable, slot kept in use);
    /// retried with the usual back-off, the OutboxRelay stays until it succeeds.
    #[error("cleanup blocked: {0}")]
    CleanupBlocked(String),
    /// A child object could not be turned into its API form (a bug, not a user error).
    #[error("cannot serialise a child object: {0}")]
    Serialize(#[source] serde_json::Error),
    /// An object the API server returned lacks a field it always sets.
    #[error("the API server returned an object without {0}")]
    MissingField(&'static str),
}

impl Error {
    /// A fixed, low-cardinality name for this error, safe as a metric label.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube_api",
            Error::Finalizer(inner) => match inner.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.category(),
                _ => "finalizer",
            },
            Error::Build(_) => "invalid_spec",
            Error::Yaml(_) => "yaml",
            Error::ReadManifest { .. } | Error::Manifest { .. } => "manifest",
            Error::Listen { .. } => "listen",
            Error::Lease(_) => "leader_election",
            Error::MissingField(_) => "api_response",
            Error::Serialize(_) => "serialize",
            Error::CleanupPending(_) => "cleanup_pending",
            Error::CleanupBlocked(_) => "cleanup_blocked",
        }
    }
}

/// Command-line settings of `outbox-operator controller`.
#[derive(Clone, Debug, clap::Args)]
pub struct ControllerArgs {
    /// Watch OutboxRelays in this namespace only (default: all namespaces).
    #[arg(long, env = "OUTBOX_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Defaults of every relay's pods (image, pull policy and Secrets, user and groups).
    #[command(flatten)]
    pub build: BuildOptions,
    /// Address of the operator's own `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, env = "OUTBOX_OPERATOR_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Take part in leader election; only the holder of the Lease reconciles. Turn off
    /// only for a single replica in development.
    #[arg(long, env = "OUTBOX_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the leader-election Lease.
    #[arg(long, env = "OUTBOX_LEASE_NAME", default_value = "outbox-operator")]
    pub lease_name: String,
    /// Namespace of the Lease (default: the operator's namespace from POD_NAMESPACE, else
    /// the watched namespace, else `default`).
    #[arg(long, env = "POD_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// This replica's identity in the Lease and in Events (default: POD_NAME, else host
    /// name plus a random suffix).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Seconds a Lease stays valid without renewal; another replica takes over after it.
    #[arg(long, default_value_t = 15)]
    pub lease_duration_seconds: u64,
    /// Seconds between periodic reconciles of an unchanged OutboxRelay (drift repair).
    #[arg(long, default_value_t = 300)]
    pub resync_seconds: u64,
    /// Seconds between database checks of a running relay, which refresh status
    /// (backlog, oldest unpublished age, slot lag).
    #[arg(long, env = "OUTBOX_STATUS_INTERVAL", default_value_t = 10)]
    pub status_interval_seconds: u64,
    /// Rechecks of unchanged relays (Secrets and database looked at again, as every
    /// status interval) allowed per second over all relays, and as many samples of
    /// their status figures: with more relays than the status interval allows at this
    /// rate, each is rechecked and sampled less often (1,000 relays at 20 a second:
    /// every 50 s), so the API server's and the databases' load stays flat as relays
    /// are added. 0: every status interval, however many.
    #[arg(long, env = "OUTBOX_MAX_RECHECKS_PER_SECOND", default_value_t = 20.0)]
    pub max_rechecks_per_second: f64,
    /// OutboxRelays reconciled at the same time. Each holds a database connection and a
    /// few API requests while it runs, so this bounds both (and the operator's memory)
    /// when many relays change at once.
    #[arg(long, env = "OUTBOX_MAX_CONCURRENT_RECONCILES", default_value_t = 32)]
    pub max_concurrent_reconciles: u16,
    /// Let an OutboxRelay choose its relay image (`spec.relay.image`). Off by default:
    /// whoever may create an OutboxRelay could otherwise run any image with the
    /// Secrets it names.
    #[arg(long, env = "OUTBOX_ALLOW_RELAY_IMAGE", default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_relay_image: bool,
    /// Let an OutboxRelay choose its pods' ServiceAccount (`spec.relay.serviceAccountName`).
    /// Off by default: a ServiceAccount may carry API rights its author does not have.
    #[arg(long, env = "OUTBOX_ALLOW_RELAY_SERVICE_ACCOUNT", default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_relay_service_account: bool,
    /// Let relays use only the Secrets that carry this label (KEY=VALUE): the owner of
    /// a namespace opts each Secret in. Unset: any Secret of the relay's namespace.
    #[arg(long, env = "OUTBOX_RELAY_SECRET_LABEL", value_parser = crate::rules::parse_label)]
    pub relay_secret_label: Option<(String, String)>,
}

impl ControllerArgs {
    /// The defaults, as the CLI would give them, for a namespace (tests, embedding).
    pub fn for_namespace(namespace: &str) -> Self {
        Self {
            namespace: Some(namespace.to_owned()),
            build: BuildOptions::default(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            leader_elect: true,
            lease_name: "outbox-operator".to_owned(),
            lease_namespace: Some(namespace.to_owned()),
            identity: None,
            lease_duration_seconds: 15,
            resync_seconds: 300,
            status_interval_seconds: 10,
            max_concurrent_reconciles: 32,
            max_rechecks_per_second: 20.0,
            allow_relay_image: false,
            allow_relay_service_account: false,
            relay_secret_label: None,
        }
    }

    fn identity(&self) -> String {
        self.identity.clone().unwrap_or_else(|| {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "outbox-operator".to_owned());
            format!("{host}-{}", std::process::id())
        })
    }
}

/// What every reconcile shares.
pub(crate) struct Context {
    client: Client,
    options: BuildOptions,
    /// What this install lets an OutboxRelay choose for its pods.
    policy: crate::spec::Policy,
    reporter: Reporter,
    metrics: Arc<Metrics>,
    leader: watch::Receiver<bool>,
    resync: Duration,
    /// How often a running relay's database is checked and its status refreshed.
    status_interval: Duration,
    /// The namespace watched (`None`: all).
    watch_namespace: Option<String>,
    /// Orphaned slots found so far.
    orphans: database::Orphans,
    /// Database connections for checks and status.
    pools: connection::Pools,
    /// The connection each relay's (by uid) last reconcile read from its Secrets, with
    /// the generation it reconciled, for the status figures: sampling them reads no
    /// Secret from the API server.
    connections:
        std::sync::Mutex<std::collections::HashMap<String, (Option<i64>, connection::Conn)>>,
    /// What was last applied for each relay (by uid), so a status refresh with nothing
    /// changed does not re-apply and re-list every child.
    applied: std::sync::Mutex<std::collections::HashMap<String, apply::Applied>>,
    /// The status each relay (by uid) was last given by this controller.
    written_status:
        std::sync::Mutex<std::collections::HashMap<String, crate::api::OutboxRelayStatus>>,
    /// Whether the Prometheus Operator's CRDs are served, and when that was looked up.
    monitoring: std::sync::Mutex<Option<(bool, std::time::Instant)>>,
    /// Reconciles running now; shutdown waits for this to reach zero.
    in_flight: AtomicUsize,
    /// The versions of the children the controller's own applies left, so their watch
    /// events do not reconcile again.
    echoes: Arc<triggers::Echoes>,
    /// OutboxRelays in the controller's cache, for the recheck budget.
    known_relays: AtomicUsize,
    /// Rechecks of unchanged relays allowed per second, over all of them.
    rechecks_per_second: f64,
    /// When each relay's (by uid) backlog is next counted for status, and the last
    /// count: a count that takes long is repeated less often (see [`figures`]).
    backlog_counts: figures::BacklogCounts,
}

/// Counts a reconcile as in flight for as long as it lives.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long each shutdown step (in-flight reconciles, Lease hand-over) may take.
const SHUTDOWN_STEP_LIMIT: Duration = Duration::from_secs(10);

/// Resolves on SIGTERM or Ctrl-C, whichever comes first.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                warn!(error = %err, "cannot listen for SIGTERM; stopping on Ctrl-C only");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Runs the operator until `shutdown` resolves: serves `/metrics` and `/healthz`, takes
/// part in leader election and reconciles while it holds the Lease. Returns after the
/// in-flight reconciles finished and the Lease was released.
pub async fn run(
    client: Client,
    args: ControllerArgs,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    crate::tls::install_crypto_provider();
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let mut http_stop = stop_rx.clone();
    let bound = crate::http::serve(args.listen, metrics.clone(), async move {
        let _ = http_stop.wait_for(|s| *s).await;
    })
    .await
    .map_err(|source| Error::Listen {
        addr: args.listen,
        source,
    })?;
    let identity = args.identity();
    info!(listen = %bound, identity = %identity, namespace = ?args.namespace, "outbox-operator controller starting");

    let lease_namespace = args
        .lease_namespace
        .clone()
        .or_else(|| args.namespace.clone())
        .unwrap_or_else(|| "default".to_owned());
    let (leader, lease_task) = if args.leader_elect {
        let manager = LeaseManagerBuilder::new(client.clone(), &args.lease_name)
            .with_namespace(&lease_namespace)
            .with_identity(&identity)
            .with_duration(args.lease_duration_seconds)
            .with_grace(args.lease_duration_seconds.div_ceil(3).max(1))
            .build()
            .await?;
        let (rx, task) = manager.watch().await;
        (rx, Some(task))
    } else {
        let (tx, rx) = watch::channel(true);
        // Keep the sender alive for the whole run: a dropped sender would read as a
        // closed channel, not as "still leader".
        tokio::spawn(async move {
            tx.closed().await;
        });
        (rx, None)
    };

    let ctx = Arc::new(Context {
        client: client.clone(),
        options: args.build.clone(),
        policy: crate::spec::Policy {
            allow_image: args.allow_relay_image,
            allow_service_account: args.allow_relay_service_account,
            secret_label: args.relay_secret_label.clone(),
        },
        reporter: Reporter {
            controller: MANAGED_BY.to_owned(),
            instance: Some(identity.clone()),
        },
        metrics: metrics.clone(),
        leader: leader.clone(),
        resync: Duration::from_secs(args.resync_seconds.max(1)),
        status_interval: Duration::from_secs(args.status_interval_seconds.max(1)),
        watch_namespace: args.namespace.clone(),
        orphans: database::Orphans::default(),
        pools: connection::Pools::default(),
        connections: std::sync::Mutex::new(std::collections::HashMap::new()),
        applied: std::sync::Mutex::new(std::collections::HashMap::new()),
        monitoring: std::sync::Mutex::new(None),
        written_status: std::sync::Mutex::new(std::collections::HashMap::new()),
        in_flight: AtomicUsize::new(0),
        echoes: Arc::default(),
        known_relays: AtomicUsize::new(0),
        rechecks_per_second: args.max_rechecks_per_second.max(0.0),
        backlog_counts: figures::BacklogCounts::default(),
    });

    let mut leader_rx = leader;
    let mut stop = stop_rx.clone();
    loop {
        // Wait to become leader (or to be told to stop).
        while !*leader_rx.borrow_and_update() {
            tokio::select! {
                changed = leader_rx.changed() => if changed.is_err() { break; },
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        if *stop.borrow() || !*leader_rx.borrow() {
            break;
        }
        info!(identity = %identity, "acquired the leader Lease; reconciling");
        metrics.set_leader(true);
        let mut lost = leader_rx.clone();
        let mut stopping = stop_rx.clone();
        let trigger = async move {
            tokio::select! {
                _ = lost.wait_for(|l| !*l) => {}
                _ = stopping.wait_for(|s| *s) => {}
            }
        };
        let controller = run_controller(
            ctx.clone(),
            args.namespace.as_deref(),
            args.max_concurrent_reconciles,
            trigger,
        );
        tokio::pin!(controller);
        let mut stopped = stop_rx.clone();
        tokio::select! {
            () = &mut controller => {}
            // The borrow guard `wait_for` returns is not Send: drop it before awaiting.
            () = async { let _ = stopped.wait_for(|s| *s).await; } => {
                // kube's graceful shutdown waits for in-flight reconciles, but when the
                // stop comes before its watchers' first list it can wait forever (seen
                // in CI). So wait for our own count of running reconciles to reach zero
                // (or the controller to end), bounded: Kubernetes kills the pod after
                // its grace period anyway.
                info!(identity = %identity, "stopping: finishing in-flight reconciles");
                let idle = async {
                    while ctx.in_flight.load(Ordering::SeqCst) > 0 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                };
                let finished = tokio::time::timeout(SHUTDOWN_STEP_LIMIT, async {
                    tokio::select! {
                        () = &mut controller => {}
                        () = idle => {}
                    }
                });
                if finished.await.is_err() {
                    warn!(limit = ?SHUTDOWN_STEP_LIMIT, "in-flight reconciles did not finish in time; stopping anyway");
                }
            }
        }
        metrics.set_leader(false);
        if *stop.borrow() {
            break;
        }
        warn!(identity = %identity, "lost the leader Lease; stopped reconciling");
    }

    drop(ctx);
    drop(leader_rx);
    if let Some(task) = lease_task {
        // The lease task ends once every receiver is gone; then hand the Lease over at
        // once instead of making the next replica wait for it to expire.
        info!(identity = %identity, "stopping: releasing the leader Lease");
        match tokio::time::timeout(SHUTDOWN_STEP_LIMIT, task).await {
            Ok(Ok(Ok(manager))) => {
                if let Err(err) = manager.release().await {
                    warn!(error = %err, "could not release the leader Lease");
                }
            }
            Ok(Ok(Err(err))) => warn!(error = %err, "leader election ended with an error"),
            Ok(Err(err)) => warn!(error = %err, "leader election task failed"),
            Err(_) => warn!(
                limit = ?SHUTDOWN_STEP_LIMIT,
                "leader election did not stop in time; the Lease expires on its own"
            ),
        }
    }
    info!(identity = %identity, "outbox-operator controller stopped");
    Ok(())
}

fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    <K as kube::Resource>::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

async fn run_controller(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    concurrency: u16,
    stop: impl Future<Output = ()> + Send + Sync + 'static,
) {
    use kube::runtime::{PredicateConfig, WatchStreamExt, reflector};
    let client = &ctx.client;
    let children =
        watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGED_BY}"));
    // Every change reaches the cache; only those a reconcile acts on trigger one (see
    // `triggers.rs`).
    let (relays, writer) = reflector::store();
    let relay_triggers = watcher(
        scoped::<OutboxRelay>(client, namespace),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(writer)
    .applied_objects()
    .predicate_filter(triggers::relay_trigger, PredicateConfig::default());
    let controller = Controller::for_stream(relay_triggers, relays.clone());
    // The figures task reads the relays from the controller's own cache and lives as
    // long as this leadership term: it is aborted when this future ends or is dropped
    // (shutdown drops it once no reconcile runs), so it never outlives the Lease and
    // never keeps the Context (and its Lease receiver) alive.
    let _figures = AbortOnDrop(tokio::spawn(figures::run(ctx.clone(), relays.clone())));
    let echoes = &ctx.echoes;
    let stop = futures::FutureExt::shared(stop);
    let tool_jobs = tools::run(ctx.clone(), namespace, stop.clone());
    let relays_done = controller
        .owns_stream(triggers::child_triggers(
            scoped::<ConfigMap>(client, namespace),
            children.clone(),
            echoes.clone(),
        ))
        .owns_stream(triggers::child_triggers(
            scoped::<Deployment>(client, namespace),
            children.clone(),
            echoes.clone(),
        ))
        .owns_stream(triggers::child_triggers(
            scoped::<Service>(client, namespace),
            children.clone(),
            echoes.clone(),
        ))
        .owns_stream(triggers::child_triggers(
            scoped::<PodDisruptionBudget>(client, namespace),
            children,
            echoes.clone(),
        ))
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency.max(1)))
        .graceful_shutdown_on(stop.clone())
        .run(
            move |relay, ctx| {
                ctx.known_relays.store(relays.len(), Ordering::Relaxed);
                // kube enters its "reconciling object" span (object and reason) only
                // while this closure runs: carry it into the future so the reconcile's
                // logs say which relay and why.
                let span = tracing::Span::current();
                async move {
                    let _counted = InFlight::enter(&ctx.in_flight);
                    reconcile::reconcile(relay, ctx.clone()).await
                }
                .instrument(span)
            },
            reconcile::error_policy,
            ctx.clone(),
        )
        .for_each(|result| async move {
            if let Err(err) = result {
                // Reconcile errors are logged by error_policy; these are watch/queue errors.
                tracing::debug!(error = %err, "controller event");
            }
        });
    futures::future::join(relays_done, tool_jobs).await;
}

/// Aborts a spawned task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Context {
    /// When an unchanged relay is looked at again (see [`triggers::recheck_after`]).
    fn recheck_after(&self) -> Duration {
        triggers::recheck_after(
            self.status_interval.min(self.resync),
            self.known_relays.load(Ordering::Relaxed),
            self.rechecks_per_second,
            triggers::jitter(),
        )
    }

    /// Publishes an Event about `relay`; a failure is logged, not fatal (Events are
    /// advisory).
    async fn publish(
        &self,
        relay: &OutboxRelay,
        type_: kube::runtime::events::EventType,
        reason: &str,
        note: String,
    ) {
        let event = kube::runtime::events::Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        self.metrics.wrote();
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(err) = recorder
            .publish(&event, &kube::Resource::object_ref(relay, &()))
            .await
        {
            warn!(relay = %kube::ResourceExt::name_any(relay), error = %err, "could not record an Event");
        }
    }
}
