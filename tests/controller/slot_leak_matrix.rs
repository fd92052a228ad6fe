//! The slot-leak matrix: one database, the controller binary as a process, and a
//! sequence of the ways relays come and go — create and delete, mode switches both
//! ways, renames (a new default slot, and one keeping `slotName`), the database Secret
//! deleted first, the database unreachable during the delete, and the controller
//! SIGKILLed mid-cleanup. After every step `pg_replication_slots` and `pg_publication`
//! hold exactly the objects of the live log-tailing relays, plus a slot and a
//! publication made by hand that the operator must never touch.

use crate::common;

use common::operator::{self, ControllerProcess};

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams};
use outbox_operator::api::OutboxRelay;
use outbox_operator::postgres::admin::{Marker, Origin};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// A relay reading Secret `db-<name>`, scaled to zero (no pod runner here: the
/// operator's work in PostgreSQL is what is under test).
fn manifest(name: &str, mode: Value) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": format!("db-{name}")}, "sslMode": "disable"}},
            "mode": mode,
            "broker": {"nats": {"url": "nats://nats:4222"}},
            "replicas": 0
        }
    })
}

/// What the database holds: slot names of this database, and publication names.
async fn objects(db: &tokio_postgres::Client) -> (BTreeSet<String>, BTreeSet<String>) {
    let slots = db
        .query(
            "SELECT slot_name::text FROM pg_replication_slots WHERE database = current_database()",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let publications = db
        .query("SELECT pubname::text FROM pg_publication", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    (slots, publications)
}

/// The marker the publication carries.
async fn marker(db: &tokio_postgres::Client, publication: &str) -> Marker {
    let comment: Option<String> = db
        .query_one(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .unwrap_or_else(|e| panic!("publication {publication}: {e}"))
        .get(0);
    comment
        .as_deref()
        .and_then(Marker::from_comment)
        .unwrap_or_else(|| panic!("publication {publication} carries no marker: {comment:?}"))
}

/// The sequence's state: the live log-tailing relays' slots (publication = slot name),
/// what was made by hand, and one report row per step.
struct Matrix {
    client: Client,
    ns: String,
    db: common::TestDatabase,
    relays: Api<OutboxRelay>,
    secrets: Api<Secret>,
    live: BTreeMap<String, String>,
    foreign: String,
    rows: Vec<String>,
}

impl Matrix {
    fn slot_of(&self, name: &str) -> String {
        format!(
            "outbox_{}_{}",
            self.ns.replace('-', "_"),
            name.replace('-', "_")
        )
    }

    async fn secret_for(&self, name: &str) {
        operator::create_secret(
            &self.client,
            &self.ns,
            &format!("db-{name}"),
            &[("uri", &self.db.url)],
        )
        .await;
    }

    async fn wait_relay(&self, name: &str, what: &str, check: impl Fn(&OutboxRelay) -> bool) {
        common::wait_for_some(&format!("{name}: {what}"), WAIT, || async {
            let relay = self.relays.get_opt(name).await.ok().flatten()?;
            let observed = relay.status.as_ref().and_then(|s| s.observed_generation);
            (observed == relay.metadata.generation && check(&relay)).then_some(())
        })
        .await;
    }

    /// Waits until the relay's slot is ready and its Secret protected (so a delete in
    /// any order finds what it needs).
    async fn wait_tailing(&self, name: &str) {
        let secret = format!("db-{name}");
        self.wait_relay(name, "SlotReady=True and its Secret protected", |r| {
            operator::condition(r, "SlotReady").is_some_and(|c| c.status == "True")
                && r.status
                    .as_ref()
                    .and_then(|s| s.slot.as_ref())
                    .is_some_and(|s| s.protected_secrets.contains(&secret))
        })
        .await;
    }

    async fn create(&mut self, name: &str, mode: Value) {
        self.secret_for(name).await;
        let tailing = mode.get("logTailing").is_some();
        let slot = mode["logTailing"]["slotName"]
            .as_str()
            .map_or_else(|| self.slot_of(name), str::to_owned);
        operator::apply_relay(&self.client, &self.ns, &manifest(name, mode)).await;
        if tailing {
            self.wait_tailing(name).await;
            self.live.insert(name.to_owned(), slot);
        } else {
            self.wait_relay(name, "DatabaseReady=True", |r| {
                operator::condition(r, "DatabaseReady").is_some_and(|c| c.status == "True")
            })
            .await;
        }
    }

    async fn switch(&mut self, name: &str, mode: Value) {
        let tailing = mode.get("logTailing").is_some();
        operator::apply_relay(&self.client, &self.ns, &manifest(name, mode)).await;
        if tailing {
            self.wait_tailing(name).await;
            let slot = self.slot_of(name);
            self.live.insert(name.to_owned(), slot);
        } else {
            self.live.remove(name);
        }
    }

    async fn delete(&mut self, name: &str) {
        self.relays
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("deleting {name}: {e}"));
        self.wait_gone(name).await;
    }

    async fn wait_gone(&mut self, name: &str) {
        common::wait_for(
            &format!("{name} to be finalized and gone"),
            WAIT,
            || async { matches!(self.relays.get_opt(name).await, Ok(None)) },
        )
        .await;
        self.live.remove(name);
    }

    /// Waits until the database holds exactly the live relays' objects and the foreign
    /// ones, and records the step.
    async fn check(&mut self, step: &str) {
        let mut want: BTreeSet<String> = self.live.values().cloned().collect();
        want.insert(self.foreign.clone());
        let deadline = std::time::Instant::now() + WAIT;
        let last = loop {
            let last = objects(&self.db.client).await;
            if last.0 == want && last.1 == want {
                break last;
            }
            if std::time::Instant::now() > deadline {
                panic!(
                    "after \"{step}\": want slots = publications = {want:?}\nslots: {:?}\npublications: {:?}\nsteps so far:\n{}",
                    last.0,
                    last.1,
                    self.rows.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let relays = self
            .relays
            .list(&ListParams::default())
            .await
            .map(|l| l.items.len())
            .unwrap_or(0);
        self.rows.push(format!(
            "| {step} | {relays} | {} | {} | 0 | 0 |",
            last.0.len() - 1,
            last.1.len() - 1
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_leak_matrix_leaves_exactly_the_live_relays_objects() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let lease = format!("outbox-operator-leak-{}", common::unique_suffix());
    let mut controller = ControllerProcess::start(Some(&ns), &lease, &ns);
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    // Made by hand, beside the operator's: never to be touched.
    let foreign = format!("by_hand_{}", common::unique_suffix().replace('-', "_"));
    db.client
        .batch_execute(&format!("CREATE PUBLICATION {foreign} FOR TABLE outbox"))
        .await
        .unwrap();
    db.client
        .batch_execute(&format!(
            "SELECT pg_create_logical_replication_slot('{foreign}', 'pgoutput')"
        ))
        .await
        .unwrap();
    let mut m = Matrix {
        relays: Api::namespaced(client.clone(), &ns),
        secrets: Api::namespaced(client.clone(), &ns),
        client: client.clone(),
        ns: ns.clone(),
        db,
        live: BTreeMap::new(),
        foreign: foreign.clone(),
        rows: Vec::new(),
    };
    let tailing = || json!({"logTailing": {}});
    let polling = || json!({"polling": {}});

    m.create("a", tailing()).await;
    m.create("b", tailing()).await;
    m.create("p", polling()).await;
    m.check("create a, b (log tailing) and p (polling)").await;

    m.delete("a").await;
    m.check("delete a").await;

    m.switch("b", polling()).await;
    m.check("switch b to polling").await;
    m.switch("p", tailing()).await;
    m.check("switch p to log tailing").await;
    m.switch("b", tailing()).await;
    m.check("switch b back to log tailing").await;

    // Rename, apply then prune: a new name gets its own default slot.
    m.create("p-renamed", tailing()).await;
    m.delete("p").await;
    m.check("rename p to p-renamed (own slot)").await;

    // Rename keeping slotName: refused while the old name lives, taken over (with the
    // slot's position) once it is deleted, and dropped with the new name.
    let slot_b = m.slot_of("b");
    m.secret_for("b-renamed").await;
    operator::apply_relay(
        &client,
        &ns,
        &manifest("b-renamed", json!({"logTailing": {"slotName": slot_b}})),
    )
    .await;
    m.wait_relay("b-renamed", "SlotReady=False SlotClaimed", |r| {
        operator::condition(r, "SlotReady")
            .is_some_and(|c| c.status == "False" && c.reason == "SlotClaimed")
    })
    .await;
    assert_eq!(marker(&m.db.client, &slot_b).await.owner.name, "b");
    m.check("b-renamed keeping b's slotName, while b lives")
        .await;
    let before = slot_created(&m.db.client, &slot_b).await;
    m.delete("b").await;
    m.wait_tailing("b-renamed").await;
    m.live.insert("b-renamed".into(), slot_b.clone());
    let taken = marker(&m.db.client, &slot_b).await;
    assert_eq!(taken.owner.name, "b-renamed");
    assert_eq!(
        (taken.publication, taken.slot_origin),
        (Origin::Created, Origin::Created)
    );
    assert_eq!(
        slot_created(&m.db.client, &slot_b).await,
        before,
        "the slot was recreated, not taken over"
    );
    m.check("delete b: b-renamed takes its slot over").await;

    // The database Secret deleted before the relay (GitOps prune order).
    m.secrets
        .delete("db-b-renamed", &DeleteParams::default())
        .await
        .unwrap();
    m.delete("b-renamed").await;
    m.check("Secret deleted first, then b-renamed").await;
    common::wait_for("Secret db-b-renamed to go", WAIT, || async {
        matches!(m.secrets.get_opt("db-b-renamed").await, Ok(None))
    })
    .await;

    // The database unreachable during the delete, then back.
    m.create("u", tailing()).await;
    let unresolvable = operator::unresolvable(&m.db.url);
    operator::set_secret_key(&client, &ns, "db-u", "uri", &unresolvable).await;
    m.relays
        .delete("u", &DeleteParams::default())
        .await
        .unwrap();
    operator::wait_relay_event(&client, &ns, "u", "CleanupRetrying", WAIT).await;
    m.check("delete u while its database is unreachable").await;
    operator::set_secret_key(&client, &ns, "db-u", "uri", &m.db.url).await;
    m.wait_gone("u").await;
    m.check("database back: u's delete completes").await;

    // The controller SIGKILLed in the middle of a cleanup: the finalizer is held inside
    // the drop (this session holds the publication's marker lock, which the drop
    // takes), the controller is killed there, and a restarted one finishes the job.
    m.create("held", tailing()).await;
    let held = m.slot_of("held");
    let blocker = common::pg_connect(&m.db.url).await.unwrap();
    blocker
        .query_one(
            "SELECT pg_advisory_lock(hashtextextended('outbox.dev/publication/' || $1, 0))",
            &[&held],
        )
        .await
        .unwrap();
    m.relays
        .delete("held", &DeleteParams::default())
        .await
        .unwrap();
    common::wait_for("the finalizer to wait inside the drop", WAIT, || async {
        m.db.client
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                &[],
            )
            .await
            .is_ok_and(|r| r.get::<_, i64>(0) > 0)
    })
    .await;
    controller.kill();
    assert!(m.relays.get_opt("held").await.unwrap().is_some());
    m.check("controller SIGKILLed inside the drop of held's slot (relay and slot left)")
        .await;
    drop(blocker);
    controller = ControllerProcess::start(Some(&ns), &lease, &ns);
    m.wait_gone("held").await;
    m.check("restarted: held's delete completes").await;

    // And at arbitrary points of create-then-delete.
    for (round, delay_ms) in [0u64, 10, 20, 40, 80].into_iter().enumerate() {
        let name = format!("k{round}");
        m.create(&name, tailing()).await;
        m.relays
            .delete(&name, &DeleteParams::default())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        controller.kill();
        let relay_left = m.relays.get_opt(&name).await.unwrap().is_some();
        let slot_left = objects(&m.db.client).await.0.contains(&m.slot_of(&name));
        let secret_left = m
            .secrets
            .get_opt(&format!("db-{name}"))
            .await
            .unwrap()
            .is_some_and(|s| s.metadata.finalizers.is_some_and(|f| !f.is_empty()));
        controller = ControllerProcess::start(Some(&ns), &lease, &ns);
        m.wait_gone(&name).await;
        m.check(&format!(
            "controller SIGKILLed {delay_ms} ms into deleting {name} (relay {}, slot {}, Secret {}), restarted",
            if relay_left { "left" } else { "gone" },
            if slot_left { "left" } else { "dropped" },
            if secret_left { "protected" } else { "released" },
        ))
        .await;
    }

    m.delete("p-renamed").await;
    m.check("delete p-renamed: no relay left").await;

    // The hand-made objects are as they were.
    let (slots, publications) = objects(&m.db.client).await;
    assert_eq!(slots, BTreeSet::from([foreign.clone()]));
    assert_eq!(publications, BTreeSet::from([foreign.clone()]));
    eprintln!(
        "slot-leak matrix (slots and publications beside the hand-made pair):\n| step | relays | slots | publications | leaked | missing |\n|---|---|---|---|---|---|\n{}",
        m.rows.join("\n")
    );
    if let Err(e) = controller.stop(Duration::from_secs(30)) {
        eprintln!("{e}");
    }
    let _ =
        m.db.client
            .batch_execute(&format!("SELECT pg_drop_replication_slot('{foreign}')"))
            .await;
    m.db.drop_database().await;
    operator::delete_relays(&client, &ns, Duration::from_secs(5)).await;
    common::delete_namespace(&client, &ns).await;
}

/// When the slot was made: its `restart_lsn` cannot move without a consumer, and a
/// recreated slot starts at a later one.
async fn slot_created(db: &tokio_postgres::Client, slot: &str) -> String {
    db.query_one(
        "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        &[&slot],
    )
    .await
    .unwrap_or_else(|e| panic!("slot {slot}: {e}"))
    .get(0)
}
