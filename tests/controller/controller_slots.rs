//! The controller's work in PostgreSQL, against the rig's real kube-apiserver and real
//! PostgreSQL (plus a private PostgreSQL with `wal_level=replica`): preflight checks as
//! conditions, slot and publication created before the relay and dropped by the
//! finalizer after it stopped (also while a walsender holds the slot), a foreign slot
//! adopted but kept, orphaned slots reported but never dropped, and the backlog in
//! status.

use crate::common;

use common::operator;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::{ControllerArgs, Metrics};
use outbox_operator::postgres::admin::{Marker, Origin, Owner};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------
// Helpers

fn start_controller(client: &Client, namespace: &str) -> operator::InProcess {
    let mut args = ControllerArgs::for_namespace(namespace);
    args.identity = Some("slots-test".to_owned());
    args.lease_name = "outbox-operator-slots-test".to_owned();
    // Status follows the database quickly in tests.
    args.status_interval_seconds = 1;
    operator::InProcess::start(client, args)
}

/// A relay reading Secret `db`, publishing to a NATS URL nobody needs to reach (the rig
/// runs no pods): log tailing with `mode`, or polling.
fn manifest(name: &str, mode: Value) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db"}, "sslMode": "disable"}},
            "mode": mode,
            "broker": {"nats": {"url": "nats://nats:4222"}},
            "replicas": 1
        }
    })
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

fn describe(relay: &OutboxRelay) -> String {
    serde_json::to_string_pretty(&relay.status).unwrap_or_default()
}

async fn wait_relay(
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

async fn delete_and_wait_gone(api: &Api<OutboxRelay>, name: &str) {
    api.delete(name, &DeleteParams::default()).await.unwrap();
    common::wait_for(
        &format!("{name} to be finalized and gone"),
        WAIT,
        || async { matches!(api.get_opt(name).await, Ok(None)) },
    )
    .await;
}

/// Removes the finalizer of every relay left (after a failure), so the namespace can go.
async fn release_relays(client: &Client, namespace: &str) {
    let api: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    let _ = api
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    for relay in api
        .list(&ListParams::default())
        .await
        .into_iter()
        .flat_map(|l| l.items)
    {
        let _ = api
            .patch(
                &relay.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
            )
            .await;
    }
}

async fn slot_count(client: &tokio_postgres::Client, slot: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
}

async fn publication_comment(
    client: &tokio_postgres::Client,
    publication: &str,
) -> Option<Option<String>> {
    client
        .query_opt(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

async fn wait_event(client: &Client, namespace: &str, relay: &str, reason: &str) -> Event {
    operator::wait_relay_event(client, namespace, relay, reason, WAIT).await
}

/// A fresh database with the tests' outbox table.
async fn outbox_database() -> common::TestDatabase {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    db
}

/// Runs `body` with a namespace and a controller; afterwards (also on panic) releases
/// leftover relays, stops the controller and deletes the namespace.
async fn with_controller<F, Fut>(body: F)
where
    F: FnOnce(Client, String, Arc<Metrics>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    use futures::FutureExt;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let running = start_controller(&client, &ns);
    let outcome =
        std::panic::AssertUnwindSafe(body(client.clone(), ns.clone(), running.metrics.clone()))
            .catch_unwind()
            .await;
    if outcome.is_err() {
        release_relays(&client, &ns).await;
    }
    running.stop(WAIT).await.unwrap_or_else(|e| panic!("{e}"));
    common::delete_namespace(&client, &ns).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

// ---------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_log_tailing_relay_drops_its_slot_even_while_streamed_and_recreating_starts_clean()
 {
    with_controller(|client, ns, metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
        let slot = format!("outbox_{}_orders", ns.replace('-', "_"));

        let created =
            operator::apply_relay(&client, &ns, &manifest("orders", json!({"logTailing": {}})))
                .await;
        // The slot's figures and the backlog come from the figures task, a status
        // interval after the slot itself.
        let relay = wait_relay(
            &relays,
            "orders",
            "SlotReady=True with the slot's figures and the backlog in status",
            |r| {
                condition(r, "SlotReady").is_some_and(|c| c.status == "True")
                    && r.status.as_ref().is_some_and(|s| {
                        s.backlog_rows.is_some()
                            && s.slot
                                .as_ref()
                                .is_some_and(|slot| slot.confirmed_flush_lsn.is_some())
                    })
            },
        )
        .await;
        let status = relay.status.clone().unwrap();
        let slot_status = status.slot.clone().unwrap();
        assert_eq!(slot_status.name, slot, "{}", describe(&relay));
        assert_eq!(slot_status.publication.as_deref(), Some(slot.as_str()));
        assert!(
            slot_status.confirmed_flush_lsn.is_some(),
            "{}",
            describe(&relay)
        );
        assert!(slot_status.retained_wal_bytes.is_some());
        assert_eq!(slot_status.wal_status.as_deref(), Some("reserved"));
        assert_eq!(slot_status.active, Some(false));
        assert_eq!(
            condition(&relay, "DatabaseReady").map(|c| c.status),
            Some("True".to_owned())
        );
        // The table is the backlog (deleteAfterPublish): empty.
        assert_eq!(status.backlog_rows, Some(0), "{}", describe(&relay));
        assert!(matches!(
            deployments.get_opt("orders-relay").await,
            Ok(Some(_))
        ));

        // In PostgreSQL: the slot, and the publication marked as the operator's.
        assert_eq!(slot_count(&db.client, &slot).await, 1);
        let comment = publication_comment(&db.client, &slot)
            .await
            .expect("publication exists")
            .expect("publication carries the operator's marker");
        let marker = Marker::from_comment(&comment).expect("a marker");
        assert_eq!(marker.owner.uid, created.uid().unwrap());
        assert_eq!(
            (marker.publication, marker.slot_origin),
            (Origin::Created, Origin::Created)
        );

        // What publishes the table is recorded once for the slot (status, and the
        // file beside the relay's config), and kept when the publication changes: a
        // relay that starts after a DROP and ADD compares with it and sees the change.
        let baseline = common::publication_identity(&db.client, &slot).await;
        let relay = wait_relay(&relays, "orders", "status.slot.coverageBaseline", |r| {
            r.status
                .as_ref()
                .and_then(|s| s.slot.as_ref())
                .is_some_and(|s| s.coverage_baseline.is_some())
        })
        .await;
        let recorded = relay.status.unwrap().slot.unwrap().coverage_baseline;
        assert_eq!(recorded.as_deref(), Some(baseline.as_str()));
        let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
        let file = || async {
            config_maps
                .get("orders-relay-config")
                .await
                .unwrap()
                .data
                .unwrap_or_default()
                .get("coverage-baseline")
                .cloned()
        };
        common::wait_for_some("the baseline in the relay's ConfigMap", WAIT, || async {
            (file().await.as_deref() == Some(baseline.as_str())).then_some(())
        })
        .await;
        let hash = |d: &Deployment| {
            d.spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.as_ref())
                .and_then(|a| a.get("outbox.dev/config-hash").cloned())
        };
        let hash_before = hash(&deployments.get("orders-relay").await.unwrap());
        db.client
            .batch_execute(&format!(
                "ALTER PUBLICATION {slot} DROP TABLE public.outbox; \
                 ALTER PUBLICATION {slot} ADD TABLE public.outbox"
            ))
            .await
            .unwrap();
        assert_ne!(
            common::publication_identity(&db.client, &slot).await,
            baseline
        );
        // Two more passes of the controller (a change of the relay's labels makes one).
        let passes = metrics.reconciles_total();
        relays
            .patch(
                "orders",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
            )
            .await
            .unwrap();
        common::wait_for_some("two more passes of the controller", WAIT, || async {
            (metrics.reconciles_total() >= passes + 2).then_some(())
        })
        .await;
        let relay = relays.get("orders").await.unwrap();
        assert_eq!(
            relay
                .status
                .unwrap()
                .slot
                .unwrap()
                .coverage_baseline
                .as_deref(),
            Some(baseline.as_str())
        );
        assert_eq!(file().await.as_deref(), Some(baseline.as_str()));
        // Recording it never rolled the pods.
        assert_eq!(
            hash(&deployments.get("orders-relay").await.unwrap()),
            hash_before
        );

        // A consumer streams the slot while the relay is deleted: the finalizer stops
        // the relay, terminates the walsender and still drops the slot.
        let config = outbox_operator::postgres::replication::replication_config(
            &db.url,
            "test",
            pgwire_replication::config::TlsConfig::disabled(),
            &slot,
            &slot,
            Duration::from_secs(1),
        )
        .unwrap();
        let mut stream = pgwire_replication::ReplicationClient::connect(config)
            .await
            .unwrap_or_else(|e| panic!("streaming slot {slot}: {e}"));
        tokio::time::timeout(WAIT, stream.wait_started())
            .await
            .expect("START_REPLICATION within 60s")
            .unwrap();
        common::wait_for("the slot to be active", WAIT, || {
            common::slot_active(&db.client, &slot)
        })
        .await;
        delete_and_wait_gone(&relays, "orders").await;
        assert_eq!(slot_count(&db.client, &slot).await, 0, "slot left behind");
        assert_eq!(publication_comment(&db.client, &slot).await, None);
        assert!(matches!(
            deployments.get_opt("orders-relay").await,
            Ok(None)
        ));
        let dropped = wait_event(&client, &ns, "orders", "SlotDropped").await;
        let note = dropped.note.unwrap_or_default();
        assert!(
            note.contains(&format!("dropped replication slot {slot}"))
                && note.contains("terminated the walsender"),
            "{note}"
        );
        drop(stream);

        // Recreated: a fresh slot and publication, marked for the new uid.
        let again =
            operator::apply_relay(&client, &ns, &manifest("orders", json!({"logTailing": {}})))
                .await;
        wait_relay(&relays, "orders", "SlotReady=True again", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "True")
        })
        .await;
        let comment = publication_comment(&db.client, &slot)
            .await
            .flatten()
            .unwrap();
        let marker = Marker::from_comment(&comment).unwrap();
        assert_eq!(marker.owner.uid, again.uid().unwrap());
        assert_eq!(marker.slot_origin, Origin::Created);
        delete_and_wait_gone(&relays, "orders").await;
        assert_eq!(slot_count(&db.client, &slot).await, 0);
        db.drop_database().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_replica_names_the_setting_and_creates_nothing() {
    let pg = common::private::PrivatePostgres::start_with(&["wal_level=replica"]);
    let url = pg.url();
    let admin_client = common::pg_connect(&url).await.unwrap();
    common::create_outbox_table(&admin_client, 4).await;

    // `check` says the same, one line per check, and fails. A document before it that
    // the CRD's schema refuses (a typo) is reported, and checking goes on.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.yaml");
    let mut typo = manifest("typo", json!({"logTailing": {}}));
    typo["spec"]["partitionz"] = json!(4);
    std::fs::write(
        &file,
        format!(
            "{}---\n{}",
            serde_yaml::to_string(&typo).unwrap(),
            serde_yaml::to_string(&manifest("orders", json!({"logTailing": {}}))).unwrap()
        ),
    )
    .unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-operator"))
        .args(["check", "-f"])
        .arg(&file)
        .env("OUTBOX_DATABASE_URL", &url)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(1),
        "{}",
        common::describe_output(&output)
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("FAIL  wal_level") && l.contains("set wal_level = logical")),
        "{stdout}"
    );
    assert!(
        stdout.contains("OutboxRelay default/typo: does not fit the CRD's schema")
            && stdout
                .lines()
                .any(|l| l.starts_with("FAIL  schema")
                    && l.contains("spec.partitionz: unknown field")),
        "{stdout}"
    );
    assert!(
        stdout.lines().any(|l| l.starts_with("ok    columns")),
        "{stdout}"
    );

    with_controller(|client, ns, _metrics| async move {
        operator::create_secret(&client, &ns, "db", &[("uri", &url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        operator::apply_relay(&client, &ns, &manifest("orders", json!({"logTailing": {}}))).await;
        let relay = wait_relay(&relays, "orders", "SlotReady=False", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "False")
        })
        .await;
        let slot = condition(&relay, "SlotReady").unwrap();
        assert_eq!(slot.reason, "WalLevelNotLogical", "{}", describe(&relay));
        assert!(
            slot.message.contains("wal_level is replica; set wal_level = logical"),
            "{}",
            slot.message
        );
        let ready = condition(&relay, "Ready").unwrap();
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "WalLevelNotLogical"));
        assert_eq!(condition(&relay, "DatabaseReady").unwrap().status, "True");
        // Nothing half-created: no slot, no publication, no Deployment, no ConfigMap.
        let counts: (i64, i64) = admin_client
            .query_one(
                "SELECT (SELECT count(*) FROM pg_replication_slots), (SELECT count(*) FROM pg_publication)",
                &[],
            )
            .await
            .map(|r| (r.get(0), r.get(1)))
            .unwrap();
        assert_eq!(counts, (0, 0));
        assert!(matches!(
            Api::<Deployment>::namespaced(client.clone(), &ns).get_opt("orders-relay").await,
            Ok(None)
        ));
        assert!(matches!(
            Api::<ConfigMap>::namespaced(client.clone(), &ns)
                .get_opt("orders-relay-config")
                .await,
            Ok(None)
        ));
        // Deleting it needs nothing from the database.
        delete_and_wait_gone(&relays, "orders").await;
    })
    .await;
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_column_and_a_role_without_replication_are_conditions() {
    let db = outbox_database().await;
    let role = format!("norepl_{}", common::unique_suffix());
    db.client
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN PASSWORD 'pw' NOREPLICATION; \
             GRANT SELECT, UPDATE, DELETE ON public.outbox TO \"{role}\";"
        ))
        .await
        .unwrap();
    let rig = common::Rig::load();
    let host = common::host_port(rig.pg_url()).to_owned();
    let role_url = format!("postgres://{role}:pw@{host}/{}", db.name);
    let url = db.url.clone();
    let role_name = role.clone();

    with_controller(|client, ns, _metrics| async move {
        let role = role_name;
        operator::create_secret(&client, &ns, "db", &[("uri", &url)]).await;
        operator::create_secret(&client, &ns, "db-norepl", &[("uri", &role_url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);

        let mut missing = manifest("missing-column", json!({"polling": {}}));
        missing["spec"]["table"] = json!({"headers": ["tenant_id"]});
        operator::apply_relay(&client, &ns, &missing).await;
        let relay = wait_relay(&relays, "missing-column", "DatabaseReady=False", |r| {
            condition(r, "DatabaseReady").is_some_and(|c| c.status == "False")
        })
        .await;
        let cond = condition(&relay, "DatabaseReady").unwrap();
        assert_eq!(cond.reason, "ColumnMissing", "{}", describe(&relay));
        assert!(
            cond.message
                .contains("has no column tenant_id (table.headers)"),
            "{}",
            cond.message
        );
        assert!(matches!(
            Api::<Deployment>::namespaced(client.clone(), &ns)
                .get_opt("missing-column-relay")
                .await,
            Ok(None)
        ));

        let mut norepl = manifest("norepl", json!({"logTailing": {}}));
        norepl["spec"]["database"]["postgres"]["connectionSecretRef"]["name"] = json!("db-norepl");
        operator::apply_relay(&client, &ns, &norepl).await;
        let relay = wait_relay(&relays, "norepl", "SlotReady=False", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "False")
        })
        .await;
        let cond = condition(&relay, "SlotReady").unwrap();
        assert_eq!(cond.reason, "ReplicationNotAllowed", "{}", describe(&relay));
        assert!(
            cond.message
                .contains(&format!("ALTER ROLE \"{role}\" REPLICATION")),
            "{}",
            cond.message
        );
        // The password never shows.
        assert!(
            !serde_json::to_string(&relay.status)
                .unwrap()
                .contains(":pw@")
        );
        delete_and_wait_gone(&relays, "missing-column").await;
        delete_and_wait_gone(&relays, "norepl").await;
    })
    .await;
    let name = db.name.clone();
    db.drop_database().await;
    let admin_client = common::pg_admin().await;
    let _ = admin_client
        .batch_execute(&format!(
            "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE); DROP ROLE IF EXISTS \"{role}\""
        ))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_slot_of_the_same_name_is_adopted_and_kept() {
    let db = outbox_database().await;
    let slot = format!("foreign_{}", common::unique_suffix());
    db.client
        .query_one(
            "SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();
    let url = db.url.clone();
    let slot_name = slot.clone();
    {
        let db_client = &db.client;
        with_controller(|client, ns, _metrics| async move {
            operator::create_secret(&client, &ns, "db", &[("uri", &url)]).await;
            let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
            operator::apply_relay(
                &client,
                &ns,
                &manifest("orders", json!({"logTailing": {"slotName": slot_name}})),
            )
            .await;
            let relay = wait_relay(&relays, "orders", "SlotReady=True", |r| {
                condition(r, "SlotReady").is_some_and(|c| c.status == "True")
            })
            .await;
            let message = condition(&relay, "SlotReady").unwrap().message;
            assert!(
                message.contains(&format!(
                    "replication slot {slot_name} (existed before, kept when the OutboxRelay is deleted)"
                )),
                "{message}"
            );
            delete_and_wait_gone(&relays, "orders").await;
            // The slot is still there; the publication the operator made is gone.
            assert_eq!(slot_count(db_client, &slot_name).await, 1);
            assert_eq!(publication_comment(db_client, &slot_name).await, None);
            let event = wait_event(&client, &ns, "orders", "SlotDropped").await;
            let note = event.note.unwrap_or_default();
            assert!(
                note.contains(&format!("kept replication slot {slot_name}")),
                "{note}"
            );
        })
        .await;
    }
    common::drop_slot(&db.client, &slot).await;
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphaned_slot_is_reported_never_dropped_and_polling_backlog_is_in_status() {
    let db = outbox_database().await;
    let slot = format!("ghost_{}", common::unique_suffix());
    let url = db.url.clone();
    let slot_name = slot.clone();
    {
        let db_client = &db.client;
        with_controller(|client, ns, metrics| async move {
            // What the operator would have left for a relay deleted while its Secret
            // was gone: a marked publication and a slot it created.
            let ghost = Owner {
                namespace: ns.clone(),
                name: "ghost".to_owned(),
                uid: "00000000-0000-0000-0000-000000000000".to_owned(),
            };
            common::create_replication_for(db_client, &slot_name, &slot_name, &ghost).await;

            operator::create_secret(&client, &ns, "db", &[("uri", &url)]).await;
            for i in 0..3 {
                common::insert_row(db_client, "Order", &format!("o-{i}"), &json!({"n": i})).await;
            }
            let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
            operator::apply_relay(&client, &ns, &manifest("live", json!({"polling": {}}))).await;
            // No pods run in the rig: the rows wait, and status says so.
            let relay = wait_relay(&relays, "live", "status.backlogRows 3", |r| {
                r.status.as_ref().and_then(|s| s.backlog_rows) == Some(3)
            })
            .await;
            let status = relay.status.clone().unwrap();
            assert!(
                status.oldest_unpublished_age_seconds.is_some(),
                "{}",
                describe(&relay)
            );
            assert!(
                status
                    .oldest_unpublished_age
                    .as_deref()
                    .is_some_and(|a| a.ends_with('s') || a.ends_with('m')),
                "{}",
                describe(&relay)
            );
            assert!(status.slot.is_none());
            assert!(condition(&relay, "SlotReady").is_none());

            common::wait_for("the orphaned-slot gauge", WAIT, || async {
                metrics.orphaned_slots() == 1
            })
            .await;
            assert!(
                metrics
                    .encode()
                    .lines()
                    .any(|l| l == "outbox_operator_orphaned_slots 1"),
                "{}",
                metrics.encode()
            );
            let event = wait_event(&client, &ns, "live", "OrphanedSlot").await;
            assert_eq!(event.type_.as_deref(), Some("Warning"));
            let note = event.note.unwrap_or_default();
            assert!(
                note.contains(&format!("replication slot {slot_name}"))
                    && note.contains(&format!("OutboxRelay {ns}/ghost")),
                "{note}"
            );
            // Never dropped by the operator.
            assert_eq!(slot_count(db_client, &slot_name).await, 1);

            // Published rows leave the backlog.
            db_client
                .batch_execute("UPDATE public.outbox SET published_at = now()")
                .await
                .unwrap();
            wait_relay(&relays, "live", "status.backlogRows 0", |r| {
                r.status.as_ref().and_then(|s| s.backlog_rows) == Some(0)
            })
            .await;
            delete_and_wait_gone(&relays, "live").await;
            assert_eq!(slot_count(db_client, &slot_name).await, 1);
            let marker = publication_comment(db_client, &slot_name)
                .await
                .flatten()
                .and_then(|c| Marker::from_comment(&c))
                .expect("the orphan's marker is untouched");
            assert_eq!(marker.owner, ghost);
        })
        .await;
    }
    common::drop_slot(&db.client, &slot).await;
    db.drop_database().await;
}

/// The relay stops before its slot goes: while one of its pods is still there (held by
/// a finalizer of the test's), the OutboxRelay stays and so does the slot; once the pod
/// is gone, the finalizer drops the slot and lets the relay go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_finalizer_keeps_the_slot_until_the_relay_pods_are_gone() {
    use k8s_openapi::api::core::v1::Pod;
    const HOLD: &str = "outbox.dev/test-hold";

    with_controller(|client, ns, metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let slot = format!("outbox_{}_held", ns.replace('-', "_"));
        operator::apply_relay(&client, &ns, &manifest("held", json!({"logTailing": {}}))).await;
        wait_relay(&relays, "held", "SlotReady=True", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "True")
        })
        .await;
        // kube-controller-manager makes the Deployment's pod (Pending: it does not tolerate
        // the rig node's taint).
        let selector = ListParams::default().labels("app.kubernetes.io/instance=held");
        let pod = common::wait_for_some("the relay's pod", WAIT, || async {
            pods.list(&selector).await.ok()?.items.into_iter().next()
        })
        .await;
        let pod_name = pod.name_any();
        pods.patch(
            &pod_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": [HOLD]}})),
        )
        .await
        .unwrap();

        relays
            .delete("held", &DeleteParams::default())
            .await
            .unwrap();
        // The Deployment goes and the pod is being deleted, but it is still there.
        common::wait_for("the pod to be terminating", WAIT, || async {
            pods.get_opt(&pod_name)
                .await
                .ok()
                .flatten()
                .is_some_and(|p| p.metadata.deletion_timestamp.is_some())
        })
        .await;
        // The controller's next passes would drop the slot too early: two of them.
        let passes = metrics.reconciles_total();
        common::wait_for("two more passes of the controller", WAIT, || async {
            metrics.reconciles_total() >= passes + 2
        })
        .await;
        assert!(
            matches!(relays.get_opt("held").await, Ok(Some(_))),
            "the OutboxRelay went while its pod was still there"
        );
        assert_eq!(
            slot_count(&db.client, &slot).await,
            1,
            "slot dropped too early"
        );

        // The pod goes: the slot is dropped and the relay released.
        pods.patch(
            &pod_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
        common::wait_for("the OutboxRelay to be gone", WAIT, || async {
            matches!(relays.get_opt("held").await, Ok(None))
        })
        .await;
        assert_eq!(slot_count(&db.client, &slot).await, 0);
        db.drop_database().await;
    })
    .await;
}

/// A relay's database Secret deleted first (a namespace deletion, a GitOps prune in any
/// order) outlives the relay: it carries the relay's finalizer while the slot exists,
/// so the relay's finalizer can still connect and drop the slot, and then the Secret
/// goes. (Before, the finalizer found no Secret and left the slot behind.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_deleted_before_its_relay_stays_until_the_slot_is_dropped() {
    with_controller(|client, ns, _metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
        let slot = format!("outbox_{}_first", ns.replace('-', "_"));
        operator::apply_relay(&client, &ns, &manifest("first", json!({"logTailing": {}}))).await;
        wait_relay(
            &relays,
            "first",
            "SlotReady=True and the Secret protected",
            |r| {
                condition(r, "SlotReady").is_some_and(|c| c.status == "True")
                    && r.status
                        .as_ref()
                        .and_then(|s| s.slot.as_ref())
                        .is_some_and(|s| s.protected_secrets == ["db"])
            },
        )
        .await;
        let secret = secrets.get("db").await.unwrap();
        assert!(
            secret
                .metadata
                .finalizers
                .unwrap_or_default()
                .contains(&"outbox.dev/slot-of-first".to_owned())
        );
        secrets
            .delete("db", &DeleteParams::default())
            .await
            .unwrap();
        let terminating = secrets.get("db").await.expect("the Secret went at once");
        assert!(terminating.metadata.deletion_timestamp.is_some());
        delete_and_wait_gone(&relays, "first").await;
        let event = wait_event(&client, &ns, "first", "SlotDropped").await;
        assert!(event.note.unwrap_or_default().contains(&slot));
        assert_eq!(slot_count(&db.client, &slot).await, 0);
        common::wait_for("the Secret to go once released", WAIT, || async {
            matches!(secrets.get_opt("db").await, Ok(None))
        })
        .await;
        db.drop_database().await;
    })
    .await;
}

/// A database host that does not resolve is an outage, not a deletion: the finalizer
/// keeps retrying (Warning `CleanupRetrying`) with the slot in place, and drops it once
/// the Secret points at the database again. (Before, a DNS failure read as "database
/// gone" and the relay went with its slot left behind.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unresolvable_database_host_blocks_the_delete_until_it_resolves() {
    with_controller(|client, ns, metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let slot = format!("outbox_{}_dns", ns.replace('-', "_"));
        operator::apply_relay(&client, &ns, &manifest("dns", json!({"logTailing": {}}))).await;
        wait_relay(&relays, "dns", "SlotReady=True", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "True")
        })
        .await;
        let unresolvable = operator::unresolvable(&db.url);
        operator::set_secret_key(&client, &ns, "db", "uri", &unresolvable).await;
        relays
            .delete("dns", &DeleteParams::default())
            .await
            .unwrap();
        let event = wait_event(&client, &ns, "dns", "CleanupRetrying").await;
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert!(
            event.note.unwrap_or_default().contains("abandon-slot"),
            "the Warning names the way out"
        );
        // The finalizer's next passes would let the relay go: two of them.
        let passes = metrics.reconciles_total();
        common::wait_for("two more passes of the controller", WAIT, || async {
            metrics.reconciles_total() >= passes + 2
        })
        .await;
        assert!(
            relays.get_opt("dns").await.unwrap().is_some(),
            "the relay went"
        );
        assert_eq!(slot_count(&db.client, &slot).await, 1);
        operator::set_secret_key(&client, &ns, "db", "uri", &db.url).await;
        common::wait_for("the OutboxRelay to be gone", WAIT, || async {
            matches!(relays.get_opt("dns").await, Ok(None))
        })
        .await;
        assert_eq!(slot_count(&db.client, &slot).await, 0);
        db.drop_database().await;
    })
    .await;
}

/// `outbox.dev/abandon-slot: "true"` lets a relay go without dropping its slot (a
/// database gone for good): a Warning names the slot left behind, and orphan detection
/// then reports it from a relay that shares the database; nobody drops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_slot_is_left_with_a_warning_and_reported_as_an_orphan() {
    with_controller(|client, ns, metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let slot = format!("outbox_{}_lost", ns.replace('-', "_"));
        operator::apply_relay(&client, &ns, &manifest("lost", json!({"logTailing": {}}))).await;
        wait_relay(&relays, "lost", "SlotReady=True and status.slot", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "True")
                && r.status.as_ref().is_some_and(|s| s.slot.is_some())
        })
        .await;
        relays
            .patch(
                "lost",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"outbox.dev/abandon-slot": "true"}}}),
                ),
            )
            .await
            .unwrap();
        delete_and_wait_gone(&relays, "lost").await;
        let event = wait_event(&client, &ns, "lost", "SlotAbandoned").await;
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        let note = event.note.unwrap_or_default();
        assert!(note.contains(&format!("replication slot {slot}")), "{note}");
        assert_eq!(slot_count(&db.client, &slot).await, 1);
        // The Secret was released with the relay.
        let secret = Api::<Secret>::namespaced(client.clone(), &ns)
            .get("db")
            .await
            .unwrap();
        assert!(secret.metadata.finalizers.unwrap_or_default().is_empty());

        // Another relay on the same database sees the orphan.
        let other = manifest("other", json!({"polling": {}}));
        operator::apply_relay(&client, &ns, &other).await;
        common::wait_for("the orphaned-slot gauge", WAIT, || async {
            metrics.orphaned_slots() == 1
        })
        .await;
        let event = wait_event(&client, &ns, "other", "OrphanedSlot").await;
        let note = event.note.unwrap_or_default();
        assert!(note.contains(&format!("OutboxRelay {ns}/lost")), "{note}");
        delete_and_wait_gone(&relays, "other").await;
        assert_eq!(
            slot_count(&db.client, &slot).await,
            1,
            "the operator dropped an orphan"
        );
        common::drop_slot(&db.client, &slot).await;
        db.drop_database().await;
    })
    .await;
}

/// A database dropped before its relay counts as cleaned: the finalizer gets
/// `database does not exist` (3D000) and lets the relay go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_database_is_gone_is_released() {
    with_controller(|client, ns, _metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let slot = format!("outbox_{}_gone", ns.replace('-', "_"));
        operator::apply_relay(&client, &ns, &manifest("gone", json!({"logTailing": {}}))).await;
        wait_relay(&relays, "gone", "SlotReady=True", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "True")
        })
        .await;
        // A database with a slot cannot be dropped: the slot goes first, as a DBA would
        // (again if the controller re-created it in between: it still owns it).
        let admin_client = common::pg_admin().await;
        let name = db.name.clone();
        drop(db);
        let mut exists = true;
        for _ in 0..20 {
            common::drop_slot(&admin_client, &slot).await;
            let _ = admin_client
                .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                .await;
            exists = admin_client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)",
                    &[&name],
                )
                .await
                .unwrap()
                .get(0);
            if !exists {
                break;
            }
        }
        assert!(!exists, "database {name} still exists");
        delete_and_wait_gone(&relays, "gone").await;
        let event = wait_event(&client, &ns, "gone", "DatabaseGone").await;
        assert!(
            event.note.unwrap_or_default().contains(&slot),
            "the Event names the slot"
        );
    })
    .await;
}

/// A migration holding the outbox table's `ACCESS EXCLUSIVE` lock cannot hold the
/// operator: creating the publication gives up after the operator's `lock_timeout`,
/// `SlotReady=False` says why, and once the lock is released the slot is created.
/// (Before, the operator's session waited on the lock for as long as it was held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_lock_times_out_into_a_condition_instead_of_holding_the_operator() {
    with_controller(|client, ns, _metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let locker = common::pg_connect(&db.url).await.unwrap();
        locker
            .batch_execute("BEGIN; LOCK TABLE public.outbox IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        operator::apply_relay(&client, &ns, &manifest("locked", json!({"logTailing": {}}))).await;
        let relay = wait_relay(
            &relays,
            "locked",
            "a condition naming the lock timeout",
            |r| {
                r.status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.status == "False" && c.message.contains("lock timeout"))
                })
            },
        )
        .await;
        assert!(
            relay
                .status
                .as_ref()
                .and_then(|s| s.slot.as_ref())
                .is_none()
        );
        locker.batch_execute("ROLLBACK").await.unwrap();
        wait_relay(
            &relays,
            "locked",
            "SlotReady=True once the lock is gone",
            |r| condition(r, "SlotReady").is_some_and(|c| c.status == "True"),
        )
        .await;
        delete_and_wait_gone(&relays, "locked").await;
        db.drop_database().await;
    })
    .await;
}

/// A relay switched from log tailing to polling drops its slot and publication once no
/// pod tails the log any more (the Deployment rolled out to the polling config), and
/// releases its Secrets: an abandoned slot would retain WAL until the relay is deleted.
/// (Before, the slot stayed for the relay's whole life.) Scaled to zero here, so the
/// rollout completes without pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_to_polling_drops_the_slot_once_no_pod_tails_the_log() {
    with_controller(|client, ns, _metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
        let slot = format!("outbox_{}_switch", ns.replace('-', "_"));
        let mut tailing = manifest("switch", json!({"logTailing": {}}));
        tailing["spec"]["replicas"] = json!(0);
        operator::apply_relay(&client, &ns, &tailing).await;
        wait_relay(&relays, "switch", "SlotReady=True", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "True")
        })
        .await;
        assert_eq!(slot_count(&db.client, &slot).await, 1);
        let mut polling = tailing.clone();
        polling["spec"]["mode"] = json!({"polling": {}});
        operator::apply_relay(&client, &ns, &polling).await;
        wait_relay(
            &relays,
            "switch",
            "status.slot gone after the switch",
            |r| r.status.as_ref().is_some_and(|s| s.slot.is_none()),
        )
        .await;
        assert_eq!(
            slot_count(&db.client, &slot).await,
            0,
            "the slot is dropped"
        );
        let event = wait_event(&client, &ns, "switch", "SlotDropped").await;
        assert!(event.note.unwrap_or_default().contains(&slot));
        common::wait_for("the Secret to be released", WAIT, || async {
            secrets
                .get("db")
                .await
                .is_ok_and(|s| s.metadata.finalizers.unwrap_or_default().is_empty())
        })
        .await;
        delete_and_wait_gone(&relays, "switch").await;
        db.drop_database().await;
    })
    .await;
}

/// `kubectl delete namespace` (or a GitOps prune of the whole app): the relay, its
/// Secret and everything else go at once, in no particular order. The Secret's slot
/// finalizer keeps it until the relay's finalizer has dropped the slot; then the
/// namespace goes, and PostgreSQL holds no slot or publication of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_namespace_drops_the_slot_and_leaves_nothing() {
    with_controller(|client, ns, _metrics| async move {
        let db = outbox_database().await;
        operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let slot = format!("outbox_{}_doomed", ns.replace('-', "_"));
        let mut tailing = manifest("doomed", json!({"logTailing": {}}));
        tailing["spec"]["replicas"] = json!(0);
        operator::apply_relay(&client, &ns, &tailing).await;
        wait_relay(&relays, "doomed", "SlotReady=True", |r| {
            condition(r, "SlotReady").is_some_and(|c| c.status == "True")
                && r.status
                    .as_ref()
                    .and_then(|s| s.slot.as_ref())
                    .is_some_and(|s| s.protected_secrets == ["db"])
        })
        .await;
        assert_eq!(slot_count(&db.client, &slot).await, 1);
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
        namespaces
            .delete(&ns, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("deleting namespace {ns}: {e}"));
        // The cleanup drops the slot, then the publication: both are waited for.
        let publications = || async {
            db.client
                .query_one(
                    "SELECT count(*) FROM pg_publication WHERE pubname = $1",
                    &[&slot],
                )
                .await
                .map(|r| r.get::<_, i64>(0))
                .unwrap_or(-1)
        };
        common::wait_for(
            "the slot and the publication to be dropped",
            WAIT,
            || async { slot_count(&db.client, &slot).await == 0 && publications().await == 0 },
        )
        .await;
        common::wait_for("the namespace to go", Duration::from_secs(120), || async {
            matches!(namespaces.get_opt(&ns).await, Ok(None))
        })
        .await;
        db.drop_database().await;
    })
    .await;
}

/// A database URL that reaches PgBouncer in transaction pooling: session advisory locks
/// would neither hold nor fence there, so the relay is refused with a condition that
/// says so and no Deployment is made; pointed at a session-mode pool, it goes ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_pooling_pgbouncer_is_refused_with_a_condition() {
    use common::private::PrivatePgBouncer;
    with_controller(|client, ns, _metrics| async move {
        let db = outbox_database().await;
        let transaction = PrivatePgBouncer::start("transaction");
        let session = PrivatePgBouncer::start("session");
        operator::create_secret(
            &client,
            &ns,
            "db",
            &[("uri", &transaction.url_for(&db.url))],
        )
        .await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
        operator::apply_relay(&client, &ns, &manifest("pooled", json!({"polling": {}}))).await;
        let relay = wait_relay(
            &relays,
            "pooled",
            "DatabaseReady=False/TransactionPooling",
            |r| {
                condition(r, "DatabaseReady")
                    .is_some_and(|c| c.status == "False" && c.reason == "TransactionPooling")
            },
        )
        .await;
        let ready = condition(&relay, "Ready").unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "TransactionPooling"),
            "{}",
            describe(&relay)
        );
        assert!(ready.message.contains("session mode"), "{}", ready.message);
        assert!(
            !ready.message.contains("postgres://"),
            "no URL in status: {}",
            ready.message
        );
        assert!(matches!(
            deployments.get_opt("pooled-relay").await,
            Ok(None)
        ));
        operator::set_secret_key(&client, &ns, "db", "uri", &session.url_for(&db.url)).await;
        wait_relay(
            &relays,
            "pooled",
            "DatabaseReady=True behind session pooling",
            |r| condition(r, "DatabaseReady").is_some_and(|c| c.status == "True"),
        )
        .await;
        assert!(matches!(
            deployments.get_opt("pooled-relay").await,
            Ok(Some(_))
        ));
        delete_and_wait_gone(&relays, "pooled").await;
        drop((transaction, session));
        db.drop_database().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_are_failover_slots_on_postgresql_18_and_the_condition_says_what_protects_them() {
    let db18 = common::fresh_database_18().await;
    common::create_outbox_table(&db18.client, 4).await;
    let db15 = outbox_database().await;
    let standby_slot = format!("standby_{}", common::unique_suffix());
    let (url18, url15) = (db18.url.clone(), db15.url.clone());
    {
        let (c18, c15, standby) = (&db18.client, &db15.client, standby_slot.clone());
        with_controller(|client, ns, _metrics| async move {
            operator::create_secret(&client, &ns, "db", &[("uri", &url18)]).await;
            operator::create_secret(&client, &ns, "db15", &[("uri", &url15)]).await;
            let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
            operator::apply_relay(&client, &ns, &manifest("orders", json!({"logTailing": {}})))
                .await;
            let mut old = manifest("legacy", json!({"logTailing": {}}));
            old["spec"]["database"]["postgres"]["connectionSecretRef"]["name"] = json!("db15");
            operator::apply_relay(&client, &ns, &old).await;
            let failover = |r: &OutboxRelay| condition(r, "FailoverReady");
            let relay = wait_relay(&relays, "orders", "FailoverReady on 18", |r| {
                failover(r).is_some_and(|c| c.reason == "StandbySyncNotConfigured")
            })
            .await;
            let slot = relay
                .status
                .as_ref()
                .unwrap()
                .slot
                .as_ref()
                .unwrap()
                .name
                .clone();
            let made: bool = c18
                .query_one(
                    "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .unwrap()
                .get(0);
            assert!(made, "the slot on PostgreSQL 18 is not a failover slot");
            assert!(
                failover(&relay)
                    .unwrap()
                    .message
                    .contains("synchronized_standby_slots is empty"),
                "{}",
                describe(&relay)
            );
            // A standby's physical slot named in synchronized_standby_slots: protected.
            for sql in [
                format!("SELECT pg_create_physical_replication_slot('{standby}')"),
                format!("ALTER SYSTEM SET synchronized_standby_slots = '{standby}'"),
                "SELECT pg_reload_conf()".to_owned(),
            ] {
                c18.batch_execute(&sql).await.unwrap();
            }
            // Named, but no standby streams from it: changes wait for it.
            let relay = wait_relay(&relays, "orders", "FailoverReady on a named slot", |r| {
                failover(r).is_some_and(|c| c.reason == "StandbyNotStreaming")
            })
            .await;
            let cond = failover(&relay).unwrap();
            assert!(cond.message.contains(&standby), "{}", cond.message);
            // PostgreSQL 15 has no failover slots: the condition says so.
            let legacy = wait_relay(&relays, "legacy", "FailoverReady on 15", |r| {
                failover(r).is_some()
                    && condition(r, "SlotReady").is_some_and(|c| c.status == "True")
            })
            .await;
            let cond = failover(&legacy).unwrap();
            assert_eq!(
                (cond.status.as_str(), cond.reason.as_str()),
                ("False", "FailoverSlotsUnsupported")
            );
            assert!(cond.message.contains("PostgreSQL 15"), "{}", cond.message);
            let legacy_slot = legacy
                .status
                .as_ref()
                .unwrap()
                .slot
                .as_ref()
                .unwrap()
                .name
                .clone();
            assert_eq!(slot_count(c15, &legacy_slot).await, 1);
            for sql in [
                "ALTER SYSTEM RESET synchronized_standby_slots",
                "SELECT pg_reload_conf()",
            ] {
                c18.batch_execute(sql).await.unwrap();
            }
            delete_and_wait_gone(&relays, "orders").await;
            delete_and_wait_gone(&relays, "legacy").await;
            assert_eq!(slot_count(c18, &slot).await, 0);
        })
        .await;
    }
    for sql in [
        "ALTER SYSTEM RESET synchronized_standby_slots".to_owned(),
        "SELECT pg_reload_conf()".to_owned(),
        format!("SELECT pg_drop_replication_slot('{standby_slot}')"),
    ] {
        let _ = db18.client.batch_execute(&sql).await;
    }
    db18.drop_database().await;
    db15.drop_database().await;
}

/// The connection Secret pointed at another database while the relay tails the log: the
/// slot there is made as for a new relay (no `SlotLost`), the old one is reported where
/// it lives until the user says it is dropped, and the finalizer neither reads a Secret
/// leading nowhere as "database gone" nor forgets the slot left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_pointed_at_another_database_leaves_no_slot_unreported() {
    with_controller(|client, ns, _metrics| async move {
        // Another server: slot names are a server's, so the second database is on the
        // rig's other PostgreSQL.
        let first = outbox_database().await;
        let second = common::fresh_database_18().await;
        common::create_outbox_table(&second.client, 4).await;
        operator::create_secret(&client, &ns, "db", &[("uri", &first.url)]).await;
        let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
        let slot = outbox_operator::relay::config::default_slot_name(&ns, "moved");
        let repoint = |url: String| {
            let secrets = secrets.clone();
            async move {
                secrets
                    .patch(
                        "db",
                        &PatchParams::default(),
                        &Patch::Merge(json!({"stringData": {"uri": url}})),
                    )
                    .await
                    .unwrap();
            }
        };
        operator::apply_relay(&client, &ns, &manifest("moved", json!({"logTailing": {}}))).await;
        let location = |r: &OutboxRelay| {
            r.status
                .as_ref()
                .and_then(|s| s.slot.as_ref())
                .and_then(|s| s.location.clone())
        };
        // host:port/database, as status records it.
        let first_key = format!(
            "{}/{}",
            first
                .url
                .split('@')
                .nth(1)
                .unwrap()
                .split('/')
                .next()
                .unwrap(),
            first.name
        );
        wait_relay(
            &relays,
            "moved",
            "the slot made where the Secret leads",
            |r| {
                condition(r, "SlotReady").is_some_and(|c| c.status == "True")
                    && r.status
                        .as_ref()
                        .and_then(|s| s.slot.as_ref())
                        .is_some_and(|s| s.existed)
                    && location(r).as_deref() == Some(first_key.as_str())
            },
        )
        .await;
        assert_eq!(slot_count(&first.client, &slot).await, 1);

        repoint(second.url.clone()).await;
        let relay = wait_relay(
            &relays,
            "moved",
            "Degraded=True SlotLeftBehind and a slot in the second database",
            |r| {
                condition(r, "Degraded")
                    .is_some_and(|c| c.status == "True" && c.reason == "SlotLeftBehind")
                    && condition(r, "SlotReady").is_some_and(|c| c.status == "True")
            },
        )
        .await;
        assert_ne!(
            condition(&relay, "Ready").map(|c| c.reason),
            Some("SlotLost".to_owned()),
            "{}",
            describe(&relay)
        );
        let left = relay
            .status
            .clone()
            .unwrap()
            .slot
            .unwrap()
            .left_behind
            .expect("recorded");
        assert_eq!(
            (left.slot.as_str(), left.location.as_str()),
            (slot.as_str(), first_key.as_str())
        );
        let message = condition(&relay, "Degraded").unwrap().message;
        assert!(
            message.contains(&first_key) && message.contains("pg_drop_replication_slot"),
            "{message}"
        );
        wait_event(&client, &ns, "moved", "SlotLeftBehind").await;
        // The operator cannot drop it there: it is still in the first database.
        assert_eq!(slot_count(&first.client, &slot).await, 1);
        assert_eq!(slot_count(&second.client, &slot).await, 1);

        // A Secret leading to a database that does not exist is no "database gone" for
        // the finalizer: the slot lives elsewhere.
        let nowhere = second.url.replace(&second.name, "no_such_database");
        repoint(nowhere).await;
        relays
            .delete("moved", &DeleteParams::default())
            .await
            .unwrap();
        let retrying = wait_event(&client, &ns, "moved", "CleanupRetrying").await;
        let note = retrying.note.unwrap_or_default();
        assert!(
            note.contains("lives in") && note.contains(&second.name),
            "{note}"
        );
        assert!(
            relays.get_opt("moved").await.unwrap().is_some(),
            "deleted with its slot"
        );
        // Back where the slot lives: dropped there, and the one left behind is named.
        repoint(second.url.clone()).await;
        common::wait_for_some("the relay gone", WAIT, || async {
            relays.get_opt("moved").await.ok()?.is_none().then_some(())
        })
        .await;
        let dropped = wait_event(&client, &ns, "moved", "SlotDropped").await;
        assert_eq!(dropped.type_.as_deref(), Some("Warning"));
        assert!(dropped.note.unwrap_or_default().contains(&first_key));
        assert_eq!(slot_count(&second.client, &slot).await, 0);
        assert_eq!(slot_count(&first.client, &slot).await, 1);
        assert!(common::drop_slot(&first.client, &slot).await);
    })
    .await;
}
