//! The pod runner itself (tests/common/pod_runner.rs): it runs what a pod spec says and
//! nothing kinder — a pod whose Secret is missing does not start, as under kubelet —
//! and its text rewriting of mount paths and `$(VAR)` references is exact; rollouts
//! follow the Deployment's strategy because the real deployment controller drives them.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::pod_runner::{MANAGED_PODS, PodRunner, ProcessEvent, expand, replace_path};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
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

/// Creates a one-replica relay Deployment with `strategy` (config from a ConfigMap
/// volume, database URL as a plain env value), waits for its process, changes the pod
/// template and returns the old and new pod names with the runner's process history.
async fn roll(strategy: serde_json::Value) -> (String, String, Vec<ProcessEvent>) {
    let client = common::kube_client().await;
    let ns = common::fresh_namespace(&client).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let stream = common::fresh_stream().await;
    let broker = common::RelayBroker::Nats {
        url: common::Rig::load().nats_url().to_owned(),
        subject: format!("{}.events", stream.subject_prefix),
    };
    let config = common::relay_config_yaml(&broker, &common::RelayOptions::default());
    let config_map: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "relay-config"},
        "data": {"relay.yaml": config},
    }))
    .unwrap_or_else(|e| panic!("ConfigMap: {e}"));
    Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &config_map)
        .await
        .unwrap_or_else(|e| panic!("creating the ConfigMap failed: {e}"));
    let runner = PodRunner::start(
        &client,
        &ns,
        Path::new(env!("CARGO_BIN_EXE_outbox-operator")),
    )
    .await;
    let labels = json!({"app": "roll", "app.kubernetes.io/managed-by": "outbox-operator"});
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "roll", "labels": labels},
        "spec": {
            "replicas": 1,
            "strategy": strategy,
            "selector": {"matchLabels": {"app": "roll"}},
            "template": {
                "metadata": {"labels": labels, "annotations": {"rev": "1"}},
                "spec": {
                    "containers": [{
                        "name": "relay",
                        "image": "ghcr.io/outbox-operator/outbox-operator:test",
                        "args": ["relay", "--config", "/etc/cfg/relay.yaml"],
                        "env": [{"name": "OUTBOX_DATABASE_URL", "value": db.url}],
                        "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}],
                    }],
                    "volumes": [{"name": "cfg", "configMap": {"name": "relay-config"}}],
                },
            },
        },
    }))
    .unwrap_or_else(|e| panic!("the test Deployment does not parse: {e}"));
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap_or_else(|e| panic!("creating the Deployment failed: {e}"));
    let old = common::wait_for_some_or(
        "the first relay process",
        WAIT,
        || runner.log_tails(20),
        || async {
            let running = runner.running();
            (running.len() == 1).then(|| running[0].clone())
        },
    )
    .await;
    deployments
        .patch(
            "roll",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}}),
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("changing the pod template failed: {e}"));
    let new = common::wait_for_some_or(
        "the old process replaced by a new one",
        WAIT,
        || format!("history: {:?}{}", runner.history(), runner.log_tails(20)),
        || async {
            let running = runner.running();
            (running.len() == 1 && running[0] != old).then(|| running[0].clone())
        },
    )
    .await;
    let history = runner.history();
    drop(runner);
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
    (old, new, history)
}

fn position(history: &[ProcessEvent], event: &ProcessEvent) -> usize {
    history
        .iter()
        .position(|e| e == event)
        .unwrap_or_else(|| panic!("{event:?} is not in {history:?}"))
}

#[tokio::test]
async fn recreate_stops_the_old_process_before_the_new_one_starts() {
    let (old, new, history) = roll(json!({"type": "Recreate"})).await;
    assert!(
        position(&history, &ProcessEvent::Ended(old.clone()))
            < position(&history, &ProcessEvent::Started(new.clone())),
        "{history:?}"
    );
}

#[tokio::test]
async fn rolling_update_without_unavailability_starts_the_new_process_first() {
    let strategy = json!({"type": "RollingUpdate",
                          "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}});
    let (old, new, history) = roll(strategy).await;
    assert!(
        position(&history, &ProcessEvent::Started(new.clone()))
            < position(&history, &ProcessEvent::Ended(old.clone())),
        "{history:?}"
    );
}
