//! Secrets a relay may use, limited by an opt-in the namespace's owner controls
//! (`--relay-secret-label`, the chart's `relayPolicy.secretLabel`): an OutboxRelay that
//! names a Secret without the label gets `Ready=False InvalidSpec` saying which label
//! opens it, and nothing is built from it (the controller does not even read its
//! value); once the namespace's owner labels the Secret, the relay is built.

use crate::common;

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::ControllerArgs;
use serde_json::json;

use common::operator;

const WAIT: Duration = Duration::from_secs(60);
const LABEL: (&str, &str) = ("outbox.dev/relays", "allowed");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_uses_only_secrets_the_namespace_owner_opted_in() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    // As CloudNativePG leaves its superuser Secret: nobody opted it in.
    operator::create_secret(&client, &ns, "pg-superuser", &[("uri", db.url.as_str())]).await;

    let mut args = ControllerArgs::for_namespace(&ns);
    args.identity = Some("secret-opt-in-test".to_owned());
    args.lease_name = "outbox-operator-secret-opt-in-test".to_owned();
    args.status_interval_seconds = 1;
    args.relay_secret_label = Some((LABEL.0.to_owned(), LABEL.1.to_owned()));
    let running = operator::InProcess::start(&client, args);

    let manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "orders"},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "pg-superuser"},
                                      "sslMode": "disable"}},
            "mode": {"polling": {}},
            "broker": {"nats": {"url": common::Rig::load().nats_url()}},
        }
    });
    operator::apply_relay(&client, &ns, &manifest).await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let refused =
        common::wait_for_some("Ready=False InvalidSpec naming the label", WAIT, || async {
            let relay = relays.get_opt("orders").await.ok().flatten()?;
            operator::condition(&relay, "Ready")
                .filter(|c| c.reason == "InvalidSpec" && c.status == "False")
        })
        .await;
    assert!(
        refused
            .message
            .contains("pg-superuser is not open to relays")
            && refused.message.contains("outbox.dev/relays=allowed"),
        "{}",
        refused.message
    );
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    assert!(
        deployments.get_opt("orders-relay").await.unwrap().is_none(),
        "a relay was built from a Secret nobody opted in"
    );

    // The namespace's owner opts the Secret in.
    Api::<Secret>::namespaced(client.clone(), &ns)
        .patch(
            "pg-superuser",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {LABEL.0: LABEL.1}}})),
        )
        .await
        .unwrap();
    common::wait_for(
        "the relay built once its Secret is opted in",
        WAIT,
        || async {
            deployments
                .get_opt("orders-relay")
                .await
                .ok()
                .flatten()
                .is_some()
        },
    )
    .await;
    println!("refused until opted in: {}", refused.message);

    operator::delete_relays(&client, &ns, WAIT).await;
    let stopped = running.stop(WAIT).await;
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
    if let Err(err) = stopped {
        panic!("{err}");
    }
}
