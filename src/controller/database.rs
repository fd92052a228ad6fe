//! The controller's side of PostgreSQL, over the connection `connection.rs` makes: runs
//! the preflight checks, creates or adopts the slot and publication,
//! reads the figures status shows, drops what the operator created on delete and
//! reports orphaned slots. The SQL is `crate::postgres::admin`'s; this module turns its
//! results into conditions, Events and metrics. Nothing secret leaves it: the URL is
//! only ever handed to the driver.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use tokio_postgres::Client;
use tracing::{debug, warn};

use super::Context;
use super::connection::{Conn, database_key, secret_name};
use super::status::Cond;
use crate::api::OutboxRelay;
use crate::postgres::admin::{self, Backlog, Check, Facts, Origin, Owner, Plan};
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

/// Orphan scans of one database are this many status intervals apart (a minute by
/// default).
const ORPHAN_SCAN_EVERY: u32 = 6;

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
            let text = err.to_string();
            let pg = relay.spec.database.postgres();
            if let Some((reason, advice)) =
                postgres::tls::diagnose(valid.ssl_mode, pg.ca_secret_ref.is_some(), &text)
            {
                return DatabaseSeen::Unusable {
                    reason,
                    message: format!(
                        "cannot connect to PostgreSQL with the URL in {}: {text}; {advice}",
                        secret_name(relay)
                    ),
                };
            }
            return DatabaseSeen::Unusable {
                reason: "ConnectionFailed",
                message: format!(
                    "cannot connect to PostgreSQL with the URL in {}: {text}; check the URL, the network path from the operator and pg_hba.conf",
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

/// Runs the provisioning the decision planned, on a pooled connection to the database
/// observe looked at.
pub(super) async fn provision(
    relay: &OutboxRelay,
    conn: &Conn,
    actions: &[crate::postgres::provision::Action],
    ctx: &Context,
) -> Result<(), PgError> {
    if actions.is_empty() {
        return Ok(());
    }
    let client = ctx.pools.get(relay, conn).await?;
    crate::postgres::provision::execute(&client, actions).await
}

/// The snapshot a switch from polling to log tailing hands over at, read right after
/// the slot was created.
pub(super) async fn handover_snapshot(
    relay: &OutboxRelay,
    conn: &Conn,
    ctx: &Context,
) -> Result<String, PgError> {
    let client = ctx.pools.get(relay, conn).await?;
    admin::handover_snapshot(&client).await
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

/// Rows in the relay's dead-letter table; `None` when it does not exist, or could not be
/// counted (left out of status then).
pub(super) async fn count_dead_letters(client: &Client, plan: &Plan) -> Option<i64> {
    admin::dead_letter_rows(client, plan)
        .await
        .unwrap_or_else(|err| {
            debug!(error = %err, "counting the dead letters failed; leaving them out of status");
            None
        })
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
            "{slot_note}publication {} in database {key} were created for OutboxRelay {}/{} (uid {}), which no longer exists. The operator never drops them on its own: recreate OutboxRelay {}/{} to adopt them, or drop them after checking nothing consumes the slot (docs/runbooks.md, OutboxOrphanedReplicationSlots)",
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

#[cfg(test)]
mod tests {
    use super::*;

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
