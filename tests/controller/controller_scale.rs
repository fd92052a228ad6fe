//! The `/scale` subresource: `kubectl scale` (and an autoscaler, which reads the same
//! subresource and lists pods by its selector) sets a polling relay's pod count; the
//! subresource reports the pods running and their selector; `spec.suspend` takes every
//! pod away and gives them back. A log-tailing relay refuses a count above one at
//! admission, with the reason.

use crate::common;

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::ControllerArgs;
use serde_json::{Value, json};

use common::operator;

const WAIT: Duration = Duration::from_secs(60);

fn manifest(name: &str, mode: Value) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db"},
                                      "sslMode": "disable"}},
            "mode": mode,
            "broker": {"nats": {"url": common::Rig::load().nats_url()}},
        }
    })
}

/// `kubectl scale --replicas=n`: a merge patch of the scale subresource.
async fn scale(relays: &Api<OutboxRelay>, name: &str, n: i32) -> Result<(), kube::Error> {
    relays
        .patch_scale(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": n}})),
        )
        .await
        .map(|_| ())
}

/// Waits until the scale subresource reports `n` pods, the Deployment asks for `n`,
/// and the scale's selector finds `n` pods; returns the selector.
async fn wait_scaled(client: &kube::Client, ns: &str, name: &str, n: i32) -> String {
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    common::wait_for_some(
        &format!("{name} scaled to {n}: the subresource, the Deployment, the pods"),
        WAIT,
        || async {
            let scale = relays.get_scale(name).await.ok()?;
            let status = scale.status?;
            let selector = status.selector?;
            let wanted = deployments
                .get_opt(&format!("{name}-relay"))
                .await
                .ok()
                .flatten()?
                .spec?
                .replicas;
            let listed = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .ok()?
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .count();
            (status.replicas == n && wanted == Some(n) && listed == usize::try_from(n).ok()?)
                .then_some(selector)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_scale_sets_a_polling_relays_pods_and_log_tailing_refuses_more_than_one() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    operator::create_secret(&client, &ns, "db", &[("uri", db.url.as_str())]).await;
    let mut args = ControllerArgs::for_namespace(&ns);
    args.identity = Some("scale-test".to_owned());
    args.lease_name = "outbox-operator-scale-test".to_owned();
    let running = operator::InProcess::start(&client, args);
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);

    // A polling relay: 2 pods by default, then what kubectl scale says.
    operator::apply_relay(&client, &ns, &manifest("orders", json!({"polling": {}}))).await;
    let selector = wait_scaled(&client, &ns, "orders", 2).await;
    assert!(selector.contains("orders"), "{selector}");
    scale(&relays, "orders", 4)
        .await
        .unwrap_or_else(|e| panic!("kubectl scale --replicas=4: {e}"));
    wait_scaled(&client, &ns, "orders", 4).await;
    let spec = relays.get("orders").await.unwrap().spec;
    assert_eq!(spec.replicas, 4);

    // Suspended: no pod, whatever the count; resumed: the count again.
    operator::set_suspend(&relays, "orders", true).await;
    wait_scaled(&client, &ns, "orders", 0).await;
    let suspended = common::wait_for_some("Ready=False Suspended", WAIT, || async {
        let relay = relays.get_opt("orders").await.ok().flatten()?;
        operator::condition(&relay, "Ready").filter(|c| c.reason == "Suspended")
    })
    .await;
    assert!(
        suspended.message.contains("spec.suspend"),
        "{}",
        suspended.message
    );
    operator::set_suspend(&relays, "orders", false).await;
    wait_scaled(&client, &ns, "orders", 4).await;

    // Status counts the dead-letter table once it exists (the relay makes it when a row
    // is first dead-lettered; here two rows as it would leave them).
    db.client
        .batch_execute(
            "CREATE TABLE public.outbox_dead_letter (LIKE public.outbox INCLUDING DEFAULTS);
             INSERT INTO public.outbox_dead_letter (id, aggregatetype, aggregateid, type, payload)
             VALUES (901, 'order', 'a', 'T', '{}'), (902, 'order', 'b', 'T', '{}');",
        )
        .await
        .unwrap();
    common::wait_for_some("status.deadLetterRows = 2", WAIT, || async {
        let relay = relays.get_opt("orders").await.ok().flatten()?;
        (relay.status?.dead_letter_rows == Some(2)).then_some(())
    })
    .await;

    // A log-tailing relay (in a namespace no controller watches: admission alone).
    let other = common::fresh_namespace(&client).await;
    let tailing: Api<OutboxRelay> = Api::namespaced(client.clone(), &other);
    operator::apply_relay(
        &client,
        &other,
        &manifest("tail", json!({"logTailing": {}})),
    )
    .await;
    let refused = scale(&tailing, "tail", 3)
        .await
        .expect_err("a log-tailing relay scaled to 3");
    assert!(
        refused
            .to_string()
            .contains("a log-tailing relay runs one pod"),
        "{refused}"
    );
    for n in [0, 1] {
        scale(&tailing, "tail", n)
            .await
            .unwrap_or_else(|e| panic!("kubectl scale --replicas={n}: {e}"));
    }
    assert_eq!(tailing.get("tail").await.unwrap().spec.replicas, 1);
    println!(
        "scaled 2 -> 4 -> suspended 0 -> 4 (selector {selector}); log tailing to 3: {refused}"
    );

    operator::delete_relays(&client, &ns, WAIT).await;
    let stopped = running.stop(WAIT).await;
    common::delete_namespace(&client, &other).await;
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
    if let Err(err) = stopped {
        panic!("{err}");
    }
}
