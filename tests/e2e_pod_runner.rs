//! The pod runner itself (tests/common/pod_runner.rs): it runs what a pod spec says and
//! nothing kinder — a pod whose Secret is missing does not start, as under kubelet —
//! and its text rewriting of mount paths and `$(VAR)` references is exact.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::pod_runner::{MANAGED_PODS, PodRunner, expand, replace_path};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

#[test]
fn mount_paths_are_replaced_only_as_whole_path_components() {
    let out = replace_path(
        "--config /etc/outbox-relay/relay.yaml /etc/outbox-relay-x /etc/outbox-relay",
        "/etc/outbox-relay",
        "/tmp/p",
    );
    assert_eq!(out, "--config /tmp/p/relay.yaml /etc/outbox-relay-x /tmp/p");
}

#[test]
fn dollar_references_expand_like_kubelet() {
    let env = vec![("A".to_owned(), "1".to_owned())];
    assert_eq!(expand("x$(A)y $(B) $$(A) $", &env), "x1y $(B) $(A) $");
}

#[tokio::test]
async fn a_pod_whose_secret_is_missing_does_not_start() {
    let client = common::kube_client().await;
    let ns = common::fresh_namespace(&client).await;
    let runner = PodRunner::start(
        &client,
        &ns,
        Path::new(env!("CARGO_BIN_EXE_outbox-operator")),
    )
    .await;
    let labels = BTreeMap::from([
        ("app".to_owned(), "broken".to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            "outbox-operator".to_owned(),
        ),
    ]);
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "broken", "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "broken"}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{
                    "name": "relay",
                    "image": "ghcr.io/outbox-operator/outbox-operator:test",
                    "args": ["relay", "--config", "/etc/outbox-relay/relay.yaml"],
                    "env": [{"name": "OUTBOX_DATABASE_URL", "valueFrom": {
                        "secretKeyRef": {"name": "no-such-secret", "key": "uri"}}}],
                }]},
            },
        },
    }))
    .unwrap_or_else(|e| panic!("the test Deployment does not parse: {e}"));
    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap_or_else(|e| panic!("creating the Deployment failed: {e}"));

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = common::wait_for_some(
        "the pod to report CreateContainerConfigError",
        WAIT,
        || async {
            let list = pods
                .list(&ListParams::default().labels(MANAGED_PODS))
                .await
                .ok()?;
            list.items.into_iter().find(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .and_then(|c| c.first())
                    .and_then(|c| c.state.as_ref()?.waiting.as_ref()?.reason.clone())
                    .as_deref()
                    == Some("CreateContainerConfigError")
            })
        },
    )
    .await;
    let spec = pod.spec.unwrap_or_default();
    assert_eq!(spec.node_name.as_deref(), Some(runner.node()));
    let message = pod
        .status
        .and_then(|s| s.container_statuses)
        .and_then(|c| c.into_iter().next())
        .and_then(|c| c.state?.waiting?.message)
        .unwrap_or_default();
    assert!(message.contains("no-such-secret"), "{message}");
    assert!(runner.running().is_empty(), "{:?}", runner.running());
    let ready = Api::<Deployment>::namespaced(client.clone(), &ns)
        .get("broken")
        .await
        .ok()
        .and_then(|d| d.status?.available_replicas)
        .unwrap_or(0);
    assert_eq!(ready, 0);

    drop(runner);
    common::delete_namespace(&client, &ns).await;
}
