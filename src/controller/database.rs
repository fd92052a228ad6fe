//! The controller's side of PostgreSQL: reads the connection Secret, connects with a
//! short timeout, runs the preflight checks, creates or adopts the slot and publication,
//! reads the figures status shows, drops what the operator created on delete and
//! reports orphaned slots. The SQL is `crate::postgres::admin`'s; this module turns its
//! results into conditions, Events and metrics. Nothing secret leaves it: the URL is
//! only ever handed to the driver.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};

use k8s_openapi::api::core::v1::Secret;
use kube::api::ListParams;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use tokio_postgres::Client;
use tracing::{debug, warn};

use super::Context;
use super::status::Cond;
use crate::api::OutboxRelay;
use crate::postgres::admin::SlotPlan;
use crate::postgres::admin::{self, Backlog, Check, Facts, Origin, Owner, Plan};
use crate::postgres::tls::PgTls;
use crate::postgres::{self, PgError};
use crate::spec::ValidRelay;

/// What the database looked like to one reconcile.
#[derive(Clone, Debug)]
pub(super) enum DatabaseSeen {
    /// Not looked at: a Secret is missing or holds nothing usable.
    NotLooked,
    /// Could not be looked at: a PascalCase reason and a message saying what to check.
    Unusable {
        /// Reason for `DatabaseReady=False`.
        reason: &'static str,
        /// For people.
        message: String,
    },
    /// Its settings, the role, the table, and the slot and publication of that name.
    Seen(Box<Facts>),
}

/// Where the connection URL comes from, for messages (never the URL itself).
fn secret_name(relay: &OutboxRelay) -> String {
    let r = relay.spec.database.postgres().connection_secret_ref;
    format!("Secret {} key {}", r.name, r.key)
}

/// How the operator connects to a relay's database: the URL (secret, so no `Debug`)
/// and TLS as the spec says.
#[derive(Clone)]
pub(super) struct Conn {
    /// The connection URL.
    pub url: String,
    /// TLS mode and CA.
    pub tls: PgTls,
}

/// A key's value in a Secret, trimmed; `Ok(None)` when the Secret or key is missing or
/// the value empty.
async fn read_key(
    relay: &OutboxRelay,
    r: &crate::api::SecretKeyRef,
    ctx: &Context,
) -> Result<Option<String>, kube::Error> {
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &relay.namespace().unwrap_or_default());
    let Some(secret) = secrets.get_opt(&r.name).await? else {
        return Ok(None);
    };
    let from_data = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|b| String::from_utf8_lossy(&b.0).trim().to_owned());
    let from_string = secret
        .string_data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|s| s.trim().to_owned());
    Ok(from_data.or(from_string).filter(|u| !u.is_empty()))
}

/// The connection URL and TLS from the Secrets the raw spec names (cleanup reads them
/// without a parse): `Ok(None)` when the URL or a named CA, certificate or key is
/// missing.
pub(super) async fn read_connection(
    relay: &OutboxRelay,
    ctx: &Context,
) -> Result<Option<Conn>, kube::Error> {
    let pg = relay.spec.database.postgres();
    let login = relay
        .spec
        .database
        .database_ref
        .as_ref()
        .and_then(|r| r.login(&relay.namespace().unwrap_or_default()));
    let url = match &login {
        None => read_key(relay, &pg.connection_secret_ref, ctx).await?,
        Some(login) => match (
            read_key(relay, &login.user, ctx).await?,
            read_key(relay, &login.password, ctx).await?,
        ) {
            (Some(user), Some(password)) => Some(login.url(&user, &password)),
            _ => None,
        },
    };
    let Some(url) = url else {
        return Ok(None);
    };
    let mut pems = Vec::new();
    for reference in [
        &pg.ca_secret_ref,
        &pg.client_cert_secret_ref,
        &pg.client_key_secret_ref,
    ] {
        pems.push(match reference {
            Some(r) => match read_key(relay, r, ctx).await? {
                Some(pem) => Some(pem),
                None => return Ok(None),
            },
            None => None,
        });
    }
    let [ca_pem, cert, key] = <[Option<String>; 3]>::try_from(pems).unwrap_or_default();
    Ok(Some(Conn {
        url,
        tls: PgTls {
            mode: pg.ssl_mode,
            ca_pem,
            client: cert
                .zip(key)
                .map(|(cert_pem, key_pem)| crate::postgres::tls::ClientPem { cert_pem, key_pem }),
        },
    }))
}

/// Connects like the relay does (same driver settings, same TLS).
async fn connect(relay: &OutboxRelay, conn: &Conn) -> Result<Client, PgError> {
    postgres::connect_operator(&conn.url, &secret_name(relay), &conn.tls).await
}

/// Orphan scans of one database are this many status intervals apart (a minute by
/// default).
const ORPHAN_SCAN_EVERY: u32 = 6;

/// Connections per database the controller keeps at most.
const POOL_SIZE: usize = 4;
/// A pooled connection unused this long is closed; a pool unused this long is dropped.
const POOL_IDLE_LIMIT: Duration = Duration::from_secs(60);

/// The controller's database connections: a small pool per connection URL.
///
/// Every relay's database is checked and measured each status interval. Connecting
/// each time cost PostgreSQL a backend start and an authentication per relay and
/// interval (50 a second with 500 relays on one database); relays sharing a database
/// now share up to [`POOL_SIZE`] connections. Idle connections close after
/// [`POOL_IDLE_LIMIT`], so the operator holds none to a database it no longer checks.
/// Each checkout resets the session (`RecyclingMethod::Clean`), so a statement timeout
/// set for the status queries never leaks into the next user. The URLs are keys in
/// memory only.
#[derive(Default)]
pub(crate) struct Pools {
    by_url: Mutex<HashMap<String, (Pool, Instant)>>,
    /// The last pooler probe per URL (`Some(why)`: sessions are lent per transaction),
    /// and when it ran.
    probed: Mutex<HashMap<String, (Option<String>, Instant)>>,
}

/// How long a pooler probe's verdict is reused for a URL.
const POOLER_PROBE_EVERY: Duration = Duration::from_secs(300);

/// The key of a URL with its TLS settings (in memory only).
fn url_key(conn: &Conn) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    conn.tls.hash(&mut hasher);
    format!("{:x} {}", hasher.finish(), conn.url)
}

impl Pools {
    /// Whether the URL reaches a pooler that lends sessions per transaction
    /// ([`postgres::pooling`]): `client` (pooled) and a connection of its own are probed
    /// together, at most every [`POOLER_PROBE_EVERY`] per URL. The second connection is
    /// not taken from the pool, where waiting for it could starve other reconciles.
    pub(super) async fn pooled_sessions(
        &self,
        relay: &OutboxRelay,
        conn: &Conn,
        client: &Client,
    ) -> Result<Option<String>, PgError> {
        let key = url_key(conn);
        if let Some((verdict, at)) = self
            .probed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&key)
            && at.elapsed() < POOLER_PROBE_EVERY
        {
            return Ok(verdict.clone());
        }
        let other = connect(relay, conn).await?;
        let verdict = postgres::pooling::pooled_sessions(client, &other).await?;
        let mut probed = self
            .probed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        probed.retain(|_, (_, at)| at.elapsed() < POOLER_PROBE_EVERY);
        probed.insert(key, (verdict.clone(), Instant::now()));
        Ok(verdict)
    }

    pub(super) async fn get(
        &self,
        relay: &OutboxRelay,
        conn: &Conn,
    ) -> Result<deadpool_postgres::Object, PgError> {
        let url = &conn.url;
        let key = url_key(conn);
        let pool = {
            let mut pools = self
                .by_url
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            pools.retain(|_, (pool, used)| {
                pool.retain(|_, metrics| metrics.last_used() < POOL_IDLE_LIMIT);
                used.elapsed() < POOL_IDLE_LIMIT
            });
            if let Some((pool, used)) = pools.get_mut(&key) {
                *used = Instant::now();
                pool.clone()
            } else {
                let config = postgres::operator_client_config(url, &secret_name(relay), &conn.tls)?;
                let manager = Manager::from_config(
                    config,
                    postgres::tls::connector(&conn.tls)?,
                    ManagerConfig {
                        recycling_method: RecyclingMethod::Clean,
                    },
                );
                let pool = Pool::builder(manager)
                    .max_size(POOL_SIZE)
                    .runtime(Runtime::Tokio1)
                    .wait_timeout(Some(Duration::from_secs(30)))
                    .create_timeout(Some(Duration::from_secs(10)))
                    .recycle_timeout(Some(Duration::from_secs(5)))
                    .build()
                    .map_err(|err| PgError::Pool(err.to_string()))?;
                pools.insert(key, (pool.clone(), Instant::now()));
                pool
            }
        };
        pool.get().await.map_err(|err| match err {
            PoolError::Backend(source) => PgError::Db {
                what: "connect",
                source,
            },
            PoolError::Timeout(_) => PgError::Pool(
                "timed out waiting for one of the operator's connections to this database"
                    .to_owned(),
            ),
            other => PgError::Pool(other.to_string()),
        })
    }
}

/// A stable key for a database, without credentials: `host:port/database`.
/// Where `url` leads, `host:port/database`, without credentials.
pub(super) fn database_key(url: &str) -> String {
    let Ok(config) = url.parse::<tokio_postgres::Config>() else {
        return "<unparseable>".to_owned();
    };
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config
        .get_dbname()
        .or(config.get_user())
        .unwrap_or("postgres");
    format!("{host}:{port}/{db}")
}

pub(super) fn owner(relay: &OutboxRelay) -> Owner {
    Owner {
        namespace: relay.namespace().unwrap_or_default(),
        name: relay.name_any(),
        uid: relay.uid().unwrap_or_default(),
    }
}

pub(super) fn cond_of(type_: &'static str, check: &Check) -> Cond {
    if check.ok {
        Cond::yes(type_, check.reason, check.message.clone())
    } else {
        Cond::no(type_, check.reason, check.message.clone())
    }
}

/// Connects with the URL from the Secret and reads the facts the checks and the
/// provisioning plan need (and the backlog while the relay `falls_back` past its WAL
/// budget). Read-only; failures become [`DatabaseSeen::Unusable`].
pub(super) async fn observe(
    relay: &OutboxRelay,
    valid: &ValidRelay,
    conn: &Conn,
    falls_back: bool,
    ctx: &Context,
) -> DatabaseSeen {
    let plan = Plan::for_relay(valid);
    let client = match ctx.pools.get(relay, conn).await {
        Ok(client) => client,
        Err(PgError::Url { .. }) => {
            return DatabaseSeen::Unusable {
                reason: "InvalidURL",
                message: format!(
                    "{} does not hold a valid postgres:// URL or key=value connection string",
                    secret_name(relay)
                ),
            };
        }
        Err(err) => {
            return DatabaseSeen::Unusable {
                reason: "ConnectionFailed",
                message: format!(
                    "cannot connect to PostgreSQL with the URL in {}: {err}; check the URL, the network path from the operator and pg_hba.conf",
                    secret_name(relay)
                ),
            };
        }
    };
    match ctx.pools.pooled_sessions(relay, conn, &client).await {
        Ok(None) => {}
        Ok(Some(why)) => {
            return DatabaseSeen::Unusable {
                reason: "TransactionPooling",
                message: postgres::pooling::refusal(&why),
            };
        }
        Err(err) => {
            return DatabaseSeen::Unusable {
                reason: "ConnectionFailed",
                message: format!(
                    "cannot check whether the URL in {} gives sessions of their own: {err}",
                    secret_name(relay)
                ),
            };
        }
    }
    match admin::gather(&client, &plan).await {
        Ok(mut facts) => {
            let snapshot = relay
                .status
                .as_ref()
                .and_then(|s| s.slot.as_ref())
                .and_then(|s| s.handover_snapshot.as_deref());
            if let (Some(snapshot), Some(_)) = (snapshot, &plan.log_tailing) {
                facts.unpublished_before_slot = match admin::unpublished_before(
                    &client, &plan, snapshot,
                )
                .await
                {
                    Ok(n) => Some(n),
                    Err(err) => {
                        warn!(relay = %relay.name_any(), error = %err, "counting the rows committed before the slot failed");
                        None
                    }
                };
            }
            if falls_back && plan.log_tailing.is_some() {
                facts.backlog =
                    measure_backlog(&client, &plan)
                        .await
                        .map(|b| admin::BacklogFacts {
                            rows: b.rows,
                            oldest_age_seconds: b.oldest_age_seconds.map(|s| s.max(0.0) as u64),
                        });
            }
            DatabaseSeen::Seen(Box::new(facts))
        }
        Err(err) => DatabaseSeen::Unusable {
            reason: "QueryFailed",
            message: format!("checking the database failed: {err}"),
        },
    }
}

/// Runs the provisioning the decision planned, on a pooled connection (the URL is read
/// from the Secret again rather than carried around).
pub(super) async fn provision(
    relay: &OutboxRelay,
    actions: &[crate::postgres::provision::Action],
    ctx: &Context,
) -> Result<(), String> {
    if actions.is_empty() {
        return Ok(());
    }
    let conn = read_connection(relay, ctx)
        .await
        .map_err(|e| format!("reading {}: {e}", secret_name(relay)))?
        .ok_or_else(|| format!("{} is missing or empty", secret_name(relay)))?;
    let client = ctx
        .pools
        .get(relay, &conn)
        .await
        .map_err(|e| e.to_string())?;
    crate::postgres::provision::execute(&client, actions)
        .await
        .map_err(|e| e.to_string())
}

/// The snapshot a switch from polling to log tailing hands over at, read right after
/// the slot was created.
pub(super) async fn handover_snapshot(
    relay: &OutboxRelay,
    ctx: &Context,
) -> Result<String, String> {
    let conn = read_connection(relay, ctx)
        .await
        .map_err(|e| format!("reading {}: {e}", secret_name(relay)))?
        .ok_or_else(|| format!("{} is missing or empty", secret_name(relay)))?;
    let client = ctx
        .pools
        .get(relay, &conn)
        .await
        .map_err(|e| e.to_string())?;
    admin::handover_snapshot(&client)
        .await
        .map_err(|e| e.to_string())
}

/// The backlog, or `None` when it cannot be measured cheaply right now (a statement
/// timeout on a huge table): status then leaves it out rather than blocking.
pub(super) async fn measure_backlog(client: &Client, plan: &Plan) -> Option<Backlog> {
    match admin::backlog(client, plan).await {
        Ok(backlog) => backlog,
        Err(err) => {
            debug!(error = %err, "measuring the backlog failed; leaving it out of status");
            None
        }
    }
}

/// Orphaned replication objects, per database, as last scanned.
#[derive(Default)]
pub(crate) struct Orphans {
    by_database: Mutex<BTreeMap<String, BTreeSet<String>>>,
    reported: Mutex<BTreeSet<String>>,
    /// When each database was last scanned.
    scanned: Mutex<HashMap<String, Instant>>,
}

impl Orphans {
    /// True when `database` is due for a scan (not scanned within `every`); marks it
    /// scanned now. One relay per database scans; the others skip.
    fn claim_scan(&self, database: &str, every: Duration) -> bool {
        let mut scanned = self
            .scanned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if scanned.get(database).is_some_and(|at| at.elapsed() < every) {
            return false;
        }
        scanned.insert(database.to_owned(), Instant::now());
        true
    }

    /// Records a database's orphans; returns the total and the ones not reported yet.
    fn record(&self, database: &str, found: BTreeSet<String>) -> (usize, Vec<String>) {
        let mut by_db = self
            .by_database
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        by_db.insert(database.to_owned(), found.clone());
        let total = by_db.values().map(BTreeSet::len).sum();
        let mut reported = self
            .reported
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let new = found
            .into_iter()
            .filter(|k| reported.insert(format!("{database}|{k}")))
            .collect();
        (total, new)
    }
}

/// Finds publications (and their slots) the operator marked for an OutboxRelay that no
/// longer exists, in this relay's database: counts them in a gauge and reports each once
/// in a Warning Event. Never drops them: only a person can tell whether a consumer
/// still needs the position. Failures are logged, not fatal.
///
/// A database is scanned at most once per [`ORPHAN_SCAN_EVERY`] status intervals, by
/// whichever of its relays comes first: every relay scanning on every refresh would
/// cost one API read per marked publication per relay, quadratic in the relays sharing
/// a database.
pub(super) async fn scan_orphans(relay: &OutboxRelay, ctx: &Context, client: &Client, url: &str) {
    let key = database_key(url);
    if !ctx
        .orphans
        .claim_scan(&key, ctx.status_interval * ORPHAN_SCAN_EVERY)
    {
        return;
    }
    let marked = match admin::list_marked(client).await {
        Ok(m) => m,
        Err(err) => {
            debug!(error = %err, "listing the operator's publications failed");
            return;
        }
    };
    let me = owner(relay);
    let mut found = BTreeMap::new();
    for m in marked {
        let o = &m.marker.owner;
        if *o == me {
            continue;
        }
        if ctx
            .watch_namespace
            .as_deref()
            .is_some_and(|ns| ns != o.namespace)
        {
            // Relays outside the watched namespace are not ours to judge.
            continue;
        }
        let api: Api<OutboxRelay> = Api::namespaced(ctx.client.clone(), &o.namespace);
        let alive = match api.get_opt(&o.name).await {
            Ok(found) => found.is_some_and(|r| r.uid().as_deref() == Some(o.uid.as_str())),
            Err(err) => {
                debug!(error = %err, "cannot look up the owner of a marked publication");
                continue;
            }
        };
        if alive {
            continue;
        }
        let slot_note = if m.slot_exists && m.marker.slot_origin == Origin::Created {
            format!(
                "replication slot {} (retains WAL until dropped) and ",
                m.marker.slot
            )
        } else {
            String::new()
        };
        let note = format!(
            "{slot_note}publication {} in database {key} were created for OutboxRelay {}/{} (uid {}), which no longer exists. The operator never drops them on its own: recreate OutboxRelay {}/{} to adopt them, or drop them after checking nothing consumes the slot (docs/runbooks.md, orphaned slot)",
            m.publication, o.namespace, o.name, o.uid, o.namespace, o.name
        );
        found.insert(format!("{}/{}", m.publication, m.marker.slot), note);
    }
    let (total, new) = ctx.orphans.record(&key, found.keys().cloned().collect());
    ctx.metrics.set_orphaned_slots(total);
    for k in new {
        if let Some(note) = found.get(&k) {
            warn!(database = %key, orphan = %k, "replication objects whose OutboxRelay is gone");
            ctx.publish(relay, EventType::Warning, "OrphanedSlot", note.clone())
                .await;
        }
    }
}

/// What the finalizer did in PostgreSQL, for its Event.
pub(super) enum Cleanup {
    /// Dropped / kept, as a sentence.
    Done(EventType, &'static str, String),
    /// Cannot be done now; retry.
    Retry(String),
}

/// The slot and publication the finalizer has to look after: the ones status last
/// showed (what was created, whatever the spec says now), else the ones a log-tailing
/// spec names. `None` when neither says there is any (polling, or a spec that never
/// parsed, for which nothing was ever created). Never blocks on an invalid spec.
pub(super) fn cleanup_target(relay: &OutboxRelay) -> Option<SlotPlan> {
    if let Some(slot) = relay.status.as_ref().and_then(|s| s.slot.as_ref()) {
        return Some(SlotPlan {
            slot: slot.name.clone(),
            publication: slot
                .publication
                .clone()
                .unwrap_or_else(|| slot.name.clone()),
            delete_after_publish: false,
        });
    }
    let valid = crate::spec::parse(relay).ok()?;
    Plan::for_relay(&valid).log_tailing
}

/// The relay that takes this one's slot over: not being deleted, its spec names the
/// same slot and publication, and its Secret the same database (`host:port/database`).
/// That is a rename keeping `slotName`, applied before or after the old name was
/// deleted: decided from the specs alone, so it does not matter whether the new relay
/// has been reconciled yet.
async fn successor(
    relay: &OutboxRelay,
    lt: &SlotPlan,
    conn: &Conn,
    ctx: &Context,
) -> Result<Option<Owner>, kube::Error> {
    let api: Api<OutboxRelay> = match &ctx.watch_namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let database = database_key(&conn.url);
    for candidate in api.list(&ListParams::default()).await?.items {
        let namespace = relay.namespace().unwrap_or_default();
        let same_slot = candidate.uid() != relay.uid()
            && candidate.metadata.deletion_timestamp.is_none()
            && crate::spec::parse(&candidate)
                .ok()
                .filter(|v| v.may_take_over(&namespace))
                .and_then(|v| Plan::for_relay(&v).log_tailing)
                .is_some_and(|p| p.slot == lt.slot && p.publication == lt.publication);
        if !same_slot {
            continue;
        }
        if let Some(theirs) = read_connection(&candidate, ctx).await?
            && database_key(&theirs.url) == database
        {
            return Ok(Some(owner(&candidate)));
        }
    }
    Ok(None)
}

/// The annotation that lets a relay go while its slot cannot be dropped (the database
/// host is gone for good): the slot and publication are left behind with a Warning.
pub const ABANDON_SLOT_ANNOTATION: &str = "outbox.dev/abandon-slot";

/// Whether the relay carries `outbox.dev/abandon-slot: "true"`.
pub(super) fn abandons_slot(relay: &OutboxRelay) -> bool {
    relay
        .annotations()
        .get(ABANDON_SLOT_ANNOTATION)
        .is_some_and(|v| v == "true")
}

/// Drops the slot and publication the operator created for this relay (the relay's pods
/// are gone by now). A database that no longer exists counts as cleaned. Anything else
/// that stops the drop — the Secret missing, the host unreachable or unknown to DNS —
/// is retried with a Warning that says how to fix it; nothing is left behind silently
/// (`outbox.dev/abandon-slot: "true"` lets the relay go without the drop).
pub(super) async fn drop_external(
    relay: &OutboxRelay,
    lt: &SlotPlan,
    ctx: &Context,
) -> Result<Cleanup, kube::Error> {
    // A CloudNativePG cluster deleted with the relay (a namespace going away) takes its
    // databases, and with them the slot: waiting for it would hold the namespace.
    if let Some(reference) = &relay.spec.database.database_ref
        && super::observe::cluster_gone(relay, reference, ctx).await?
    {
        return Ok(Cleanup::Done(
            EventType::Normal,
            "DatabaseGone",
            format!(
                "CloudNativePG Cluster {} is gone or being deleted; replication slot {} and publication {} go with its databases",
                reference.name, lt.slot, lt.publication
            ),
        ));
    }
    let Some(conn) = read_connection(relay, ctx).await? else {
        if relay.status.as_ref().is_none_or(|s| s.slot.is_none()) {
            // Status never showed a slot: the checks never passed, nothing was created.
            return Ok(Cleanup::Done(
                EventType::Normal,
                "Deleted",
                format!(
                    "{} is gone and status shows no replication slot: nothing to drop",
                    secret_name(relay)
                ),
            ));
        }
        return Ok(Cleanup::Retry(format!(
            "{} (or a CA or client certificate Secret it needs) is gone, so replication slot {} and publication {} cannot be dropped: restore the Secret, or annotate the OutboxRelay {ABANDON_SLOT_ANNOTATION}=true to leave them behind (they retain WAL until dropped by hand)",
            secret_name(relay),
            lt.slot,
            lt.publication
        )));
    };
    if let Some(why) = super::location::drop_elsewhere(
        relay,
        &lt.slot,
        &database_key(&conn.url),
        ABANDON_SLOT_ANNOTATION,
    ) {
        return Ok(Cleanup::Retry(why));
    }
    let client = match connect(relay, &conn).await {
        Ok(c) => c,
        Err(err) if admin::database_is_gone(&err) => {
            return Ok(Cleanup::Done(
                EventType::Normal,
                "DatabaseGone",
                format!(
                    "the database is gone ({err}); replication slot {} and publication {} went with it",
                    lt.slot, lt.publication
                ),
            ));
        }
        Err(PgError::Url { .. }) if relay.status.as_ref().is_none_or(|s| s.slot.is_none()) => {
            // The Secret never held a URL the operator could connect with, and status
            // never showed a slot: nothing was created, so nothing blocks the delete.
            return Ok(Cleanup::Done(
                EventType::Normal,
                "Deleted",
                format!(
                    "{} holds no usable URL and status shows no replication slot: nothing to drop",
                    secret_name(relay)
                ),
            ));
        }
        Err(err) => {
            return Ok(Cleanup::Retry(format!(
                "cannot connect to drop replication slot {}: {err}; retrying (if the database is gone for good, annotate the OutboxRelay {ABANDON_SLOT_ANNOTATION}=true)",
                lt.slot
            )));
        }
    };
    if let Some(next) = successor(relay, lt, &conn, ctx).await? {
        match admin::hand_over(&client, &lt.slot, &lt.publication, &owner(relay), &next).await {
            Ok(true) => {
                return Ok(Cleanup::Done(
                    EventType::Normal,
                    "SlotHandedOver",
                    format!(
                        "replication slot {} and publication {} handed over to OutboxRelay {}/{}, which claims them: they keep their position and are dropped with that relay",
                        lt.slot, lt.publication, next.namespace, next.name
                    ),
                ));
            }
            // Not this relay's any more: nothing to drop either.
            Ok(false) => {}
            Err(err) => {
                return Ok(Cleanup::Retry(format!(
                    "handing replication slot {} over to OutboxRelay {}/{} failed: {err}",
                    lt.slot, next.namespace, next.name
                )));
            }
        }
    }
    match admin::drop_owned(&client, &lt.slot, &lt.publication, &owner(relay)).await {
        Ok(d) => {
            let mut parts = Vec::new();
            if d.slot {
                parts.push(format!(
                    "dropped replication slot {}{}",
                    lt.slot,
                    if d.terminated_walsender {
                        " (terminated the walsender still streaming it)"
                    } else {
                        ""
                    }
                ));
            }
            if d.publication {
                parts.push(format!("dropped publication {}", lt.publication));
            }
            if !d.kept.is_empty() {
                parts.push(format!(
                    "kept {} (not created by the operator)",
                    d.kept.join(" and ")
                ));
            }
            if parts.is_empty() {
                return Ok(Cleanup::Done(
                    EventType::Normal,
                    "Deleted",
                    "no replication slot or publication of this relay was left to drop".to_owned(),
                ));
            }
            match super::location::still_left_behind(relay) {
                Some(left) => {
                    parts.push(left);
                    Ok(Cleanup::Done(
                        EventType::Warning,
                        "SlotDropped",
                        parts.join("; "),
                    ))
                }
                None => Ok(Cleanup::Done(
                    EventType::Normal,
                    "SlotDropped",
                    parts.join("; "),
                )),
            }
        }
        Err(err) => Ok(Cleanup::Retry(format!(
            "dropping replication slot {} failed: {err}",
            lt.slot
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_keys_carry_no_credentials() {
        let key = database_key("postgres://app:s3cret@db.example:6543/shop?sslmode=disable");
        assert_eq!(key, "db.example:6543/shop");
        assert!(!database_key("host=h user=u password=s3cret dbname=d").contains("s3cret"));
    }

    #[test]
    fn each_database_is_scanned_for_orphans_once_per_period() {
        let orphans = Orphans::default();
        let every = Duration::from_secs(60);
        assert!(orphans.claim_scan("a", every));
        assert!(!orphans.claim_scan("a", every), "a second relay skips");
        assert!(
            orphans.claim_scan("b", every),
            "another database is its own"
        );
        assert!(
            orphans.claim_scan("a", Duration::ZERO),
            "due again after the period"
        );
    }

    #[test]
    fn orphans_are_reported_once_and_counted_per_database() {
        let orphans = Orphans::default();
        let set = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect();
        let (total, new) = orphans.record("a", set(&["p/s"]));
        assert_eq!((total, new.len()), (1, 1));
        let (total, new) = orphans.record("b", set(&["p/s", "q/t"]));
        assert_eq!((total, new.len()), (3, 2));
        let (total, new) = orphans.record("a", set(&["p/s"]));
        assert_eq!((total, new.len()), (3, 0));
        let (total, _) = orphans.record("b", BTreeSet::new());
        assert_eq!(total, 1);
    }
}
