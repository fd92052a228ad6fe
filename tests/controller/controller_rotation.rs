//! Rotating a Secret a relay reads (a new database password, a renewed certificate)
//! rolls its pods, which read Secret values only at start; the relay config, and so
//! nothing else of the relay, changes. Rolling is the path the e2e tests prove
//! lossless (e2e_operator's spec edit rolls the pods under load with no event lost).

use std::time::Duration;

use crate::common::{self, operator};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::Api;
use outbox_operator::controller::ControllerArgs;
use outbox_operator::resources::{CONFIG_HASH_ANNOTATION, SECRETS_VERSION_ANNOTATION};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

fn annotations(d: &Deployment) -> std::collections::BTreeMap<String, String> {
    d.spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_a_referenced_secret_rolls_the_relay_pods() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    operator::create_secret(&client, &ns, "db", &[("uri", db.url.as_str())]).await;

    let mut args = ControllerArgs::for_namespace(&ns);
    args.identity = Some("rotation-test".to_owned());
    args.lease_name = "outbox-operator-rotation-test".to_owned();
    args.status_interval_seconds = 1;
    let running = operator::InProcess::start(&client, args);
    let manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "orders"},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db"}, "sslMode": "disable"}},
            "mode": {"polling": {}},
            "broker": {"nats": {"url": "nats://nats:4222"}},
            "replicas": 1
        }
    });
    operator::apply_relay(&client, &ns, &manifest).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let before = common::wait_for_some("the relay's Deployment", WAIT, || async {
        let d = deployments.get_opt("orders-relay").await.ok().flatten()?;
        annotations(&d)
            .contains_key(SECRETS_VERSION_ANNOTATION)
            .then_some(d)
    })
    .await;
    let before = annotations(&before);

    // The password is rotated: same Secret, new value.
    let rotated = format!("{}?application_name=rotated", db.url);
    operator::set_secret_key(&client, &ns, "db", "uri", &rotated).await;
    let after = common::wait_for_some(
        "the pod template to change after the Secret did",
        WAIT,
        || async {
            let d = deployments.get_opt("orders-relay").await.ok().flatten()?;
            let a = annotations(&d);
            (a.get(SECRETS_VERSION_ANNOTATION) != before.get(SECRETS_VERSION_ANNOTATION))
                .then_some(a)
        },
    )
    .await;
    assert_eq!(
        after.get(CONFIG_HASH_ANNOTATION),
        before.get(CONFIG_HASH_ANNOTATION),
        "the relay config itself did not change"
    );
    let version = &after[SECRETS_VERSION_ANNOTATION];
    assert!(
        !version.contains("rotated") && !db.url.contains(version.as_str()),
        "the annotation holds nothing of the Secret"
    );

    operator::delete_relays(&client, &ns, WAIT).await;
    let _ = running.stop(WAIT).await;
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
}
