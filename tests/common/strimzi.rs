//! Strimzi's own Kafka and KafkaUser CRDs (the rig generates them with Strimzi's CRD
//! generator from its Maven artifacts) and objects of those kinds with the status
//! Strimzi's operators would write. No Strimzi operator runs: a test plays its part.

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const GROUP_VERSION: &str = "kafka.strimzi.io/v1beta2";

/// The plurals of the kinds installed.
pub const PLURALS: [&str; 2] = ["kafkas", "kafkausers"];

fn crd(plural: &str) -> CustomResourceDefinition {
    let dir = super::Rig::load().get("OUTBOX_RIG_STRIMZI_CRDS").to_owned();
    let path = format!("{dir}/{plural}.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading Strimzi's CRD {path}: {e} (run make provision)"));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Installs Strimzi's Kafka and KafkaUser CRDs and waits until they are served.
pub async fn install(client: &kube::Client) {
    for plural in PLURALS {
        super::apply_crd(client, &crd(plural), &format!("Strimzi's {plural} CRD")).await;
    }
}

/// Removes Strimzi's CRDs if an earlier run left them, and waits until the kinds are no
/// longer served.
pub async fn uninstall(client: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for plural in PLURALS {
        let _ = crds
            .delete(&format!("{plural}.kafka.strimzi.io"), &Default::default())
            .await;
    }
    super::wait_for("Strimzi's kinds no longer served", WAIT, || async {
        client
            .list_api_group_resources(GROUP_VERSION)
            .await
            .is_err()
    })
    .await;
}

/// The objects of `kind` in `ns`.
pub fn api(client: &kube::Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let plural = format!("{}s", kind.to_lowercase());
    let (group, version) = GROUP_VERSION.split_once('/').unwrap_or_default();
    let resource =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), &plural);
    Api::namespaced_with(client.clone(), ns, &resource)
}

/// An object of `kind` as a user writes it (validated by Strimzi's CRD schema), then
/// its `status`, if it has one, as Strimzi's operators would write it.
pub async fn create(client: &kube::Client, ns: &str, kind: &str, object: Value) {
    let name = object["metadata"]["name"].as_str().unwrap().to_owned();
    let mut object = object;
    let status = object.as_object_mut().unwrap().remove("status");
    object["apiVersion"] = json!(GROUP_VERSION);
    object["kind"] = json!(kind);
    let typed: DynamicObject = serde_json::from_value(object).unwrap();
    let objects = api(client, ns, kind);
    objects
        .patch(
            &name,
            &PatchParams::apply("strimzi-test").force(),
            &Patch::Apply(&typed),
        )
        .await
        .unwrap_or_else(|e| panic!("the API server refused {kind} {name}: {e}"));
    if let Some(status) = status {
        set_status(&objects, &name, status).await;
    }
}

/// Writes an object's status.
pub async fn set_status(objects: &Api<DynamicObject>, name: &str, status: Value) {
    objects
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status})),
        )
        .await
        .unwrap_or_else(|e| panic!("status of {name}: {e}"));
}

/// A Kafka named `name` with `listeners` (`spec.kafka.listeners`).
pub fn kafka(name: &str, listeners: Value) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {
            "kafka": {
                "version": "3.9.0",
                "replicas": 3,
                "storage": {"type": "ephemeral"},
                "listeners": listeners
            },
            "zookeeper": {"replicas": 3, "storage": {"type": "ephemeral"}}
        }
    })
}

/// A KafkaUser of `cluster` authenticating by `auth`, Ready with its Secret (named
/// after it) when `ready`.
pub fn user(name: &str, cluster: &str, auth: &str, ready: bool) -> Value {
    let mut user = json!({
        "metadata": {"name": name, "labels": {"strimzi.io/cluster": cluster}},
        "spec": {"authentication": {"type": auth}},
    });
    if ready {
        user["status"] = ready_status(name);
    }
    user
}

/// The status the User Operator writes once a user's Secret `name` exists.
pub fn ready_status(name: &str) -> Value {
    json!({"secret": name, "username": name, "observedGeneration": 1,
           "conditions": [{"type": "Ready", "status": "True",
                           "lastTransitionTime": "2026-12-07T10:00:00Z"}]})
}
