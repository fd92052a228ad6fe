//! The chart's RBAC is enough for the real controller, and no more: the chart is
//! installed (`helm install --skip-crds`, no operator pod), then the controller runs
//! in-process with a client that authenticates as the chart's ServiceAccount (a
//! TokenRequest token), so every request it makes is judged by the API server's RBAC
//! authorizer exactly as in the operator's pod. It must reconcile an OutboxRelay fully —
//! children, status, Events, finalizer on and off — while the same identity is refused a
//! Secret outside the namespaces it watches.

use crate::chart_common;
use crate::common;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use chart_common::{
    Access, ServiceAccountIdentity, fullname, install, uninstall_quietly, with_namespaces,
};
use futures::FutureExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::{self, ControllerArgs, FINALIZER, Metrics};
use serde_json::json;
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(60);
/// RBAC objects reach the authorizer's cache shortly after they are written.
const RBAC_PROPAGATION: Duration = Duration::from_secs(30);

/// The example's database Secret: the URL and the CA its default verify-full checks
/// the server with.
async fn create_secret(client: &Client, namespace: &str, name: &str, url: &str) {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(
            common::node::db_secret_for_pods(url)
                .into_iter()
                .map(|(k, v)| (k.to_owned(), ByteString(v.into_bytes())))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_or_else(|e| panic!("creating Secret {name} in {namespace} failed: {e}"));
}

fn owned_by(meta: &ObjectMeta, relay: &OutboxRelay) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| Some(&o.uid) == relay.meta().uid.as_ref() && o.controller == Some(true))
}

/// Runs the controller as `identity` on `watch` (Lease in `release_ns`, where the chart
/// grants it) and proves a full reconcile of the polling-nats example and its deletion.
async fn controller_as_service_account_reconciles_fully(
    admin: &Client,
    identity: &ServiceAccountIdentity,
    release: &str,
    release_ns: &str,
    watch: &str,
) {
    common::install_outbox_crd(admin).await;
    identity
        .wait_until_allowed(
            admin,
            &Access::new("watch", "outbox.dev", "outboxrelays").in_namespace(watch),
            RBAC_PROPAGATION,
        )
        .await;
    let as_operator = identity.client(admin).await;

    // A real database with the outbox table: the controller checks it before it builds
    // the relay.
    let database = common::fresh_database().await;
    common::create_outbox_table(&database.client, 4).await;
    create_secret(admin, watch, "orders-db", &database.url).await;
    let relays: Api<OutboxRelay> = Api::namespaced(admin.clone(), watch);
    // polling-nats: three replicas, so a PodDisruptionBudget is built too.
    let manifest: serde_json::Value = serde_yaml::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/polling-nats.yaml"),
        )
        .unwrap_or_else(|e| panic!("examples/polling-nats.yaml: {e}")),
    )
    .unwrap_or_else(|e| panic!("examples/polling-nats.yaml: {e}"));
    relays
        .patch(
            "polling-nats",
            &PatchParams::apply("test-user"),
            &Patch::Apply(&manifest),
        )
        .await
        .unwrap_or_else(|e| panic!("applying the example failed: {e}"));

    outbox_operator::telemetry::init_logging();
    let mut args = ControllerArgs::for_namespace(watch);
    args.identity = Some("rbac-test".to_owned());
    args.lease_name = fullname(release);
    args.lease_namespace = Some(release_ns.to_owned());
    let metrics = Arc::new(Metrics::new());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(controller::run(
        as_operator.clone(),
        args,
        metrics.clone(),
        async move {
            let _ = stopped.await;
        },
    ));

    let outcome = AssertUnwindSafe(async {
        // Status for the current generation, written by the ServiceAccount's client.
        let relay = common::wait_for_some(
            "status written by the controller running as the chart's ServiceAccount",
            WAIT,
            || async {
                let relay = relays.get_opt("polling-nats").await.ok().flatten()?;
                let status = relay.status.as_ref()?;
                (status.observed_generation == relay.metadata.generation
                    && status.conditions.iter().any(|c| c.type_ == "Ready"))
                .then_some(relay)
            },
        )
        .await;
        assert!(
            relay.finalizers().iter().any(|f| f == FINALIZER),
            "no finalizer: {:?}",
            relay.finalizers()
        );
        let database_ready = relay
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "DatabaseReady"))
            .map(|c| c.status.clone());
        // Reading the Secret in the watched namespace is allowed.
        assert_eq!(
            database_ready.as_deref(),
            Some("True"),
            "{:?}",
            relay.status
        );

        let metas = [
            Api::<ConfigMap>::namespaced(admin.clone(), watch)
                .get("polling-nats-relay-config")
                .await
                .map(|o| o.metadata),
            Api::<Deployment>::namespaced(admin.clone(), watch)
                .get("polling-nats-relay")
                .await
                .map(|o| o.metadata),
            Api::<Service>::namespaced(admin.clone(), watch)
                .get("polling-nats-relay")
                .await
                .map(|o| o.metadata),
            Api::<PodDisruptionBudget>::namespaced(admin.clone(), watch)
                .get("polling-nats-relay")
                .await
                .map(|o| o.metadata),
        ];
        for meta in metas {
            let meta = meta.unwrap_or_else(|e| panic!("a child is missing: {e}"));
            assert!(
                owned_by(&meta, &relay),
                "{:?} is not owned by the relay",
                meta.name
            );
        }

        secret_policy_allows_only_the_operators_finalizers(&as_operator, watch).await;

        // Deleting the relay: the controller removes its finalizer, so it goes.
        relays
            .delete("polling-nats", &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("deleting the relay failed: {e}"));
        common::wait_for("the relay to be gone (finalizer removed)", WAIT, || async {
            matches!(relays.get_opt("polling-nats").await, Ok(None))
        })
        .await;
        // The deletion was recorded as an Event by this controller (the chart grants
        // it Events).
        let events: Api<Event> = Api::namespaced(admin.clone(), watch);
        common::wait_for("an Event from the controller", WAIT, || async {
            events.list(&ListParams::default()).await.is_ok_and(|l| {
                l.items.iter().any(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("polling-nats")
                        && e.reporting_controller.as_deref() == Some("outbox-operator")
                })
            })
        })
        .await;

        assert!(metrics.writes_total() > 0);
    })
    .catch_unwind()
    .await;

    let _ = stop.send(());
    let stopped = tokio::time::timeout(WAIT, task).await;
    if outcome.is_err() {
        // Never leave the namespace stuck on the finalizer.
        let _ = relays
            .patch(
                "polling-nats",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
            )
            .await;
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    match stopped {
        Ok(Ok(Ok(()))) => {}
        other => panic!("the controller did not stop cleanly: {other:?}"),
    }
}

/// The chart's ValidatingAdmissionPolicy: RBAC must grant the operator `patch` on
/// Secrets (for its slot-protection finalizer), and the policy holds it to exactly
/// that. As the operator's ServiceAccount: its own finalizer goes on and comes off;
/// a change of the data, a label, or another finalizer is refused.
async fn secret_policy_allows_only_the_operators_finalizers(as_operator: &Client, watch: &str) {
    let secrets: Api<Secret> = Api::namespaced(as_operator.clone(), watch);
    let json = |ops: serde_json::Value| {
        Patch::<()>::Json(serde_json::from_value::<json_patch::Patch>(ops).unwrap())
    };
    // The API server applies a new policy once it has loaded it (a moment after the
    // chart's install): wait until it refuses a change of the data, asked as a dry run
    // so that nothing changes while it does not yet.
    let dry_run = PatchParams {
        dry_run: true,
        ..PatchParams::default()
    };
    common::wait_for("the chart's admission policy in effect", WAIT, || async {
        let data = json!([{"op": "add", "path": "/data/uri", "value": "cG9zdGdyZXM6Ly9ldmls"}]);
        matches!(
            secrets.patch("orders-db", &dry_run, &json(data)).await,
            Err(kube::Error::Api(status)) if status.message.contains("not its data")
        )
    })
    .await;
    let ours = "outbox.dev/slot-of-polling-nats";
    let added = secrets
        .patch(
            "orders-db",
            &PatchParams::default(),
            &json(json!([{"op": "add", "path": "/metadata/finalizers", "value": [ours]}])),
        )
        .await
        .unwrap_or_else(|e| panic!("the operator may put its finalizer on a Secret: {e}"));
    assert_eq!(added.finalizers(), [ours]);
    let refused = [
        (
            json!([{"op": "add", "path": "/data/uri", "value": "cG9zdGdyZXM6Ly9ldmls"}]),
            "not its data",
        ),
        (
            json!([{"op": "add", "path": "/metadata/labels", "value": {"x": "y"}}]),
            "not its labels",
        ),
        (
            // The whole list, so the patch does not depend on what the controller (which
            // drops finalizers a polling relay does not need) left there meanwhile.
            json!([{"op": "add", "path": "/metadata/finalizers", "value": ["example.com/hold"]}]),
            "only its own finalizers",
        ),
    ];
    for (ops, why) in refused {
        match secrets
            .patch("orders-db", &PatchParams::default(), &json(ops.clone()))
            .await
        {
            Err(kube::Error::Api(status)) => assert!(
                status.message.contains(why),
                "{ops}: refused, but not by the chart's policy: {status:?}"
            ),
            other => panic!("{ops}: the operator's ServiceAccount was allowed: {other:?}"),
        }
    }
    let removed = secrets
        .patch(
            "orders-db",
            &PatchParams::default(),
            &json(json!([{"op": "add", "path": "/metadata/finalizers", "value": []}])),
        )
        .await
        .unwrap_or_else(|e| panic!("the operator may take its finalizer off a Secret: {e}"));
    assert!(removed.finalizers().is_empty());
}

#[tokio::test]
async fn controller_with_the_charts_namespaced_rbac_reconciles_and_sees_no_other_secrets() {
    with_namespaces(2, |admin, namespaces| async move {
        let (release_ns, watch) = (namespaces[0].as_str(), namespaces[1].as_str());
        let release = chart_common::fresh_release();
        let watch_value = format!("watchNamespace={watch}");
        install(
            &release,
            release_ns,
            &[
                "--skip-crds",
                "--set",
                &watch_value,
                "--set",
                "replicaCount=0",
            ],
        );
        let identity = ServiceAccountIdentity::new(release_ns, &fullname(&release));
        let outcome = AssertUnwindSafe(async {
            controller_as_service_account_reconciles_fully(
                &admin, &identity, &release, release_ns, watch,
            )
            .await;
            // The same identity reads no Secret outside the watched namespace: not one
            // by name, and no list of them.
            create_secret(
                &admin,
                release_ns,
                "not-yours",
                "postgres://u:p@db:5432/shop",
            )
            .await;
            let as_operator = identity.client(&admin).await;
            let secrets: Api<Secret> = Api::namespaced(as_operator.clone(), release_ns);
            match secrets.get("not-yours").await {
                Err(kube::Error::Api(status)) => assert_eq!(status.code, 403, "{status:?}"),
                Err(other) => panic!("reading a Secret outside the watched namespace: {other}"),
                Ok(_) => panic!("the operator read Secret not-yours outside its namespace"),
            }
            for other in [release_ns, "default"] {
                let secrets: Api<Secret> = Api::namespaced(as_operator.clone(), other);
                match secrets.list(&ListParams::default()).await {
                    Err(kube::Error::Api(status)) => assert_eq!(status.code, 403, "{status:?}"),
                    Err(err) => panic!("listing Secrets in {other}: {err}"),
                    // Never print the list: it holds secret values.
                    Ok(list) => panic!(
                        "the operator listed {} Secrets in {other}, outside its namespace",
                        list.items.len()
                    ),
                }
            }
        })
        .catch_unwind()
        .await;
        uninstall_quietly(&release, release_ns);
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    })
    .await;
}

/// Cluster-wide mode (no watchNamespace): the ClusterRole. The controller itself runs
/// restricted to one namespace here — run cluster-wide on the shared rig it would
/// reconcile every other test's OutboxRelays — but the cluster-wide list and watch it
/// makes in that mode are made for real with the same identity.
#[tokio::test]
async fn controller_with_the_charts_cluster_rbac_reconciles_and_may_watch_all_namespaces() {
    with_namespaces(2, |admin, namespaces| async move {
        let (release_ns, watch) = (namespaces[0].as_str(), namespaces[1].as_str());
        let release = chart_common::fresh_release();
        install(
            &release,
            release_ns,
            &["--skip-crds", "--set", "replicaCount=0"],
        );
        let identity = ServiceAccountIdentity::new(release_ns, &fullname(&release));
        let outcome = AssertUnwindSafe(async {
            controller_as_service_account_reconciles_fully(
                &admin, &identity, &release, release_ns, watch,
            )
            .await;
            let as_operator = identity.client(&admin).await;
            Api::<OutboxRelay>::all(as_operator.clone())
                .list(&ListParams::default().limit(1))
                .await
                .unwrap_or_else(|e| panic!("listing OutboxRelays cluster-wide: {e}"));
            Api::<Deployment>::all(as_operator)
                .list(
                    &ListParams::default()
                        .labels("app.kubernetes.io/managed-by=outbox-operator")
                        .limit(1),
                )
                .await
                .unwrap_or_else(|e| panic!("listing relay Deployments cluster-wide: {e}"));
            // In this mode the ClusterRole lets the operator read Secrets in every
            // namespace (it must: relays anywhere reference them); the chart also grants
            // list/watch on them although the controller only ever gets one by name.
        })
        .catch_unwind()
        .await;
        uninstall_quietly(&release, release_ns);
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    })
    .await;
}
