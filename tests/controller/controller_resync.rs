//! A resync of unchanged relays writes nothing. A freshly started controller reconciles
//! every relay it finds (the same full pass a periodic resync or a leader change makes);
//! when nothing changed since the last controller left, that pass must not write to the
//! API server — checked in the API server's own audit log, not by the controller's
//! account of itself — nor to PostgreSQL, checked in the catalog rows' versions.

use crate::common;

use common::operator::{self, ControllerProcess};

use std::time::Duration;

use k8s_openapi::api::apps::v1::ReplicaSet;
use kube::api::{Api, ListParams};
use outbox_operator::api::OutboxRelay;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);
/// Relays of each mode.
const EACH: usize = 5;

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

/// Every catalog row the operator could write for its relays, with its row version
/// (`xmin` changes on any UPDATE), the slots' positions and the publications' markers.
async fn catalog(db: &tokio_postgres::Client) -> Vec<String> {
    db.query(
        "SELECT 'publication ' || pubname || ' xmin ' || xmin::text || ' ' \
                || coalesce(obj_description(oid, 'pg_publication'), '') FROM pg_publication \
         UNION ALL SELECT 'publication table ' || prpubid::text || '/' || prrelid::text \
                || ' xmin ' || xmin::text FROM pg_publication_rel \
         UNION ALL SELECT 'comment ' || objoid::text || ' xmin ' || xmin::text FROM pg_description \
                WHERE classoid = 'pg_publication'::regclass \
         UNION ALL SELECT 'slot ' || slot_name || ' ' || coalesce(restart_lsn::text, '-') || ' ' \
                || coalesce(confirmed_flush_lsn::text, '-') FROM pg_replication_slots \
                WHERE database = current_database() \
         UNION ALL SELECT 'relation ' || relname || ' xmin ' || xmin::text || ' ' \
                || coalesce(relacl::text, '') FROM pg_class \
                WHERE relnamespace = 'public'::regnamespace \
         ORDER BY 1",
        &[],
    )
    .await
    .unwrap_or_else(|e| panic!("reading the catalogs: {e}"))
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Writes of the reconciler: the Lease is the controller's own, the status figures
/// (backlog, slot lag) are sampled on their own timer and written only when a figure
/// moved, which a slot's retained WAL does whenever any database writes, and
/// kube-controller-manager answers writes of others (and catches up slowly on a busy
/// rig).
fn reconcile_writes(writes: Vec<operator::AuditedWrite>) -> Vec<operator::AuditedWrite> {
    writes
        .into_iter()
        .filter(|w| w.resource != "leases" && !w.by_kube_controller_manager())
        .filter(|w| {
            !w.request_uri
                .contains("fieldManager=outbox-operator-figures")
        })
        .collect()
}

/// Each relay's name and `resourceVersion`.
async fn versions(relays: &Api<OutboxRelay>) -> Vec<(Option<String>, Option<String>)> {
    relays
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|r| (r.metadata.name, r.metadata.resource_version))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_writes_nothing_for_unchanged_relays() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let lease = format!("outbox-operator-resync-{}", common::unique_suffix());
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    operator::create_secret(&client, &ns, "db", &[("uri", &db.url)]).await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);

    let mut first = ControllerProcess::start(Some(&ns), &lease, &ns);
    let mut names = Vec::new();
    for i in 0..EACH {
        for (kind, mode) in [
            ("poll", json!({"polling": {"afterPublish": "delete"}})),
            ("tail", json!({"logTailing": {}})),
        ] {
            let name = format!("{kind}-{i}");
            operator::apply_relay(&client, &ns, &manifest(&name, mode)).await;
            names.push(name);
        }
    }
    // Settled: every relay reconciled at its generation (slots made, Secret protected)
    // with its figures sampled once, then a quiet spell with no write from the
    // reconciler.
    common::wait_for_some_or(
        "every relay reconciled by the first controller",
        WAIT,
        || format!("\n--- controller log ---\n{}", first.log_tail(40)),
        || async {
            let list = relays.list(&ListParams::default()).await.ok()?;
            let done = list.items.iter().filter(|r| {
                let observed = r.status.as_ref().and_then(|s| s.observed_generation);
                let tailing = r.spec.mode.log_tailing.is_some();
                observed == r.metadata.generation
                    && r.status.as_ref().is_some_and(|s| s.backlog_rows.is_some())
                    && (!tailing
                        || operator::condition(r, "SlotReady").is_some_and(|c| c.status == "True"))
            });
            (done.count() == names.len()).then_some(())
        },
    )
    .await;
    common::wait_for("the first controller to go quiet", WAIT, || async {
        let mark = operator::audit_mark();
        tokio::time::sleep(Duration::from_secs(3)).await;
        reconcile_writes(operator::audited_writes_since(mark, &ns)).is_empty()
    })
    .await;
    // Each relay's pod template was written once: the log-tailing relays putting their
    // finalizers on the shared Secret changed its metadata, not the values the relays
    // read, and must not roll anyone's pods.
    let replica_sets: Api<ReplicaSet> = Api::namespaced(client.clone(), &ns);
    let mut templates = std::collections::BTreeMap::<String, usize>::new();
    for rs in replica_sets
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
    {
        let owner = rs
            .metadata
            .owner_references
            .iter()
            .flatten()
            .map(|o| o.name.clone())
            .next()
            .unwrap_or_default();
        *templates.entry(owner).or_default() += 1;
    }
    assert!(
        templates.len() == names.len() && templates.values().all(|n| *n == 1),
        "ReplicaSets per relay Deployment (a pod template written more than once rolls the relay): {templates:?}"
    );
    first
        .stop(Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}"));

    let catalog_before = catalog(&db.client).await;
    let statuses_before = versions(&relays).await;
    let mark = operator::audit_mark();

    // The resync: a new controller takes the Lease and reconciles all of them.
    let second = ControllerProcess::start(Some(&ns), &lease, &ns);
    let tail = || format!("\n--- controller log ---\n{}", second.log_tail(40));
    common::wait_for_some_or(
        "the second controller to lead and reconcile every relay",
        WAIT,
        tail,
        || async {
            let leader = second.counter("outbox_operator_leader").await?;
            let reconciles = second
                .counter("outbox_operator_reconciles_total{result=\"ok\"}")
                .await?;
            (leader == 1.0 && reconciles >= names.len() as f64).then_some(())
        },
    )
    .await;
    // As many successes as relays need not be one per relay (a relay can be
    // reconciled twice); but each relay is reconciled again one status interval (10 s)
    // after its first pass, so after that long every relay has had a pass, and a
    // straggling write has had time to show.
    tokio::time::sleep(Duration::from_secs(12)).await;

    let writes = reconcile_writes(operator::audited_writes_since(mark, &ns));
    assert!(
        writes.is_empty(),
        "a resync of {} unchanged relays wrote to the API server:\n{}{}",
        names.len(),
        writes
            .iter()
            .map(|w| format!("  {w}\n"))
            .collect::<String>(),
        tail()
    );
    let statuses_after = versions(&relays).await;
    // Only the figures may have moved a relay (its retained WAL grows with any write).
    let moved: Vec<_> = statuses_before
        .iter()
        .filter(|b| !statuses_after.contains(b))
        .collect();
    for (name, _) in &moved {
        let name = name.as_deref().unwrap_or_default();
        assert!(
            name.starts_with("tail-"),
            "relay {name} changed without a write the audit log shows"
        );
    }
    assert_eq!(
        catalog_before,
        catalog(&db.client).await,
        "a resync of unchanged relays wrote to PostgreSQL"
    );

    // Cleaned up while the second controller still runs, so its finalizer drops the slots.
    operator::delete_relays(&client, &ns, WAIT).await;
    drop(second);
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
}
