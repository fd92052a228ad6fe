//! Smoke test: the rig's control plane is a modern kube-apiserver (CEL validation, server-side apply, watches) with garbage collection.

use crate::common;

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher;
use serde_json::json;

const FIELD_MANAGER: &str = "outbox-operator-test";
const CEL_MESSAGE: &str = "replicas must not exceed maxReplicas";

fn widget_crd(group: &str) -> serde_json::Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("widgets.{group}")},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [{
                "name": "v1",
                "served": true,
                "storage": true,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {
                            "type": "object",
                            "required": ["replicas", "maxReplicas"],
                            "properties": {
                                "replicas": {"type": "integer", "minimum": 0},
                                "maxReplicas": {"type": "integer", "minimum": 0}
                            },
                            "x-kubernetes-validations": [{
                                "rule": "self.replicas <= self.maxReplicas",
                                "message": CEL_MESSAGE
                            }]
                        }
                    }
                }}
            }]
        }
    })
}

fn widget(group: &str, name: &str, replicas: i64, max_replicas: i64) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": format!("{group}/v1"),
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "maxReplicas": max_replicas}
    }))
    .unwrap()
}

fn is_established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conds| {
            conds
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

#[tokio::test]
async fn apiserver_validates_cel_watches_and_collects_garbage() {
    let client = common::kube_client().await;
    let namespace = common::fresh_namespace(&client).await;
    // A group of its own per run, so reruns never meet a CRD still being deleted.
    let group = format!("s{}.smoke.outbox.dev", common::unique_suffix());
    let crd_name = format!("widgets.{group}");

    // Clean up the cluster-wide CRD and the namespace also when an assertion fails.
    let outcome = AssertUnwindSafe(exercise(&client, &namespace, &group))
        .catch_unwind()
        .await;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let _ = crds.delete(&crd_name, &DeleteParams::default()).await;
    common::delete_namespace(&client, &namespace).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn exercise(client: &kube::Client, namespace: &str, group: &str) {
    let crd_name = format!("widgets.{group}");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        &crd_name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(widget_crd(group)),
    )
    .await
    .unwrap();
    common::wait_for(
        "the Widget CRD to be Established",
        Duration::from_secs(30),
        || async {
            crds.get_opt(&crd_name)
                .await
                .ok()
                .flatten()
                .is_some_and(|crd| is_established(&crd))
        },
    )
    .await;
    let applied = crds.get(&crd_name).await.unwrap();
    let managers: Vec<_> = applied
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|f| f.manager.as_deref())
        .collect();
    assert!(
        managers.contains(&FIELD_MANAGER),
        "field managers: {managers:?}"
    );

    let gvk = GroupVersionKind::gvk(group, "v1", "Widget");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "widgets");
    let widgets: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource);

    // The API server itself rejects what the CEL rule forbids.
    let rejected = widgets
        .create(&PostParams::default(), &widget(group, "too-many", 5, 3))
        .await
        .expect_err("a Widget violating the CEL rule was accepted");
    match &rejected {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 422, "{status:?}");
            assert!(status.message.contains(CEL_MESSAGE), "{status:?}");
        }
        other => panic!("expected a 422 from the API server, got {other}"),
    }

    // A watch established before the create (initial list done) reports the new object.
    let mut events = watcher(widgets.clone(), watcher::Config::default()).boxed();
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(event) = events.next().await {
            if matches!(event, Ok(watcher::Event::InitDone)) {
                return;
            }
        }
        panic!("the watch stream ended before its initial list");
    })
    .await
    .expect("the watcher did not finish its initial list within 30s");
    let created = widgets
        .create(&PostParams::default(), &widget(group, "gadget", 1, 3))
        .await
        .unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(event) = events.next().await {
            if let Ok(watcher::Event::Apply(object)) = event
                && object.metadata.name.as_deref() == Some("gadget")
            {
                return object;
            }
        }
        panic!("the watch stream ended");
    })
    .await
    .expect("the watcher did not observe the Widget within 30s");
    assert_eq!(seen.metadata.uid, created.metadata.uid);
    drop(events);

    // A ConfigMap owned by the Widget goes away with it (kube-controller-manager's GC).
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let owned: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "gadget-config",
            "ownerReferences": [{
                "apiVersion": format!("{group}/v1"),
                "kind": "Widget",
                "name": "gadget",
                "uid": created.metadata.uid.clone().unwrap(),
                "controller": true,
                "blockOwnerDeletion": true
            }]
        },
        "data": {"relay.yaml": "x: 1"}
    }))
    .unwrap();
    configmaps
        .create(&PostParams::default(), &owned)
        .await
        .unwrap();
    widgets
        .delete("gadget", &DeleteParams::default())
        .await
        .unwrap();
    // kube-controller-manager's garbage collector rediscovers resource types every 30 s,
    // so for a CRD this new it may take that long before it watches Widgets at all.
    common::wait_for(
        "the owned ConfigMap to be garbage-collected",
        Duration::from_secs(90),
        || async { matches!(configmaps.get_opt("gadget-config").await, Ok(None)) },
    )
    .await;
}
