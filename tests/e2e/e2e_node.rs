//! The rig's real node: kubelet 1.37 (from the API server's release) on containerd 2 with
//! runc, and the operator's image assembled from the binary under test
//! (`tests/rig/image.sh`, buildah from scratch, nothing pulled). A first step of running
//! relay pods on a kubelet: the image agrees with the Dockerfile's runtime stage, and a
//! pod of it runs on the node under the relay pods' restricted security context.

use crate::common;

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);

/// The runtime stage of the Dockerfile: its `USER`, `ENTRYPOINT`, `CMD` and `EXPOSE`,
/// and the title label.
fn dockerfile_runtime() -> (String, Value, Value, String, String) {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile"))
        .unwrap_or_else(|e| panic!("Dockerfile: {e}"));
    let stage = text
        .rsplit_once("\nFROM ")
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("no runtime stage in the Dockerfile"));
    let directive = |name: &str| {
        stage
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {name} in the Dockerfile's runtime stage"))
            .to_owned()
    };
    let title = stage
        .split("org.opencontainers.image.title=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or_else(|| panic!("no title label in the Dockerfile"))
        .to_owned();
    (
        directive("USER"),
        serde_json::from_str(&directive("ENTRYPOINT")).unwrap(),
        serde_json::from_str(&directive("CMD")).unwrap(),
        directive("EXPOSE"),
        title,
    )
}

#[test]
fn the_rig_image_agrees_with_the_dockerfile() {
    let (_, inspect) = common::node::operator_image();
    let config = &inspect["OCIv1"]["config"];
    let (user, entrypoint, cmd, expose, title) = dockerfile_runtime();
    assert_eq!(config["User"], json!(user), "user: {config}");
    assert_eq!(config["Entrypoint"], entrypoint, "entrypoint: {config}");
    assert_eq!(config["Cmd"], cmd, "cmd: {config}");
    assert!(
        config["ExposedPorts"]
            .as_object()
            .is_some_and(|p| p.contains_key(&format!("{expose}/tcp"))),
        "exposed ports: {config}"
    );
    assert_eq!(
        config["Labels"]["org.opencontainers.image.title"],
        json!(title)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_of_the_operator_image_runs_on_the_kubelet_as_relay_pods_do() {
    let rig = common::Rig::load();
    let (reference, _) = common::node::operator_image();
    let client = common::kube_client().await;
    let ns = common::fresh_namespace(&client).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    // The relay pods' security context (src/resources/workload.rs), on the rig's node
    // (no scheduler runs: the pod names its node, and tolerates its taint).
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "image-check"},
        "spec": {
            "nodeName": rig.get("OUTBOX_RIG_NODE"),
            "tolerations": [{"key": rig.get("OUTBOX_RIG_NODE_TAINT"), "operator": "Exists"}],
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "relay",
                "image": reference,
                "imagePullPolicy": "Never",
                "args": ["crd"],
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "readOnlyRootFilesystem": true,
                    "capabilities": {"drop": ["ALL"]}
                },
                "resources": {"limits": {"memory": "256Mi"}}
            }]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let done = common::wait_for_some("the pod to run to completion on the node", WAIT, || async {
        let p = pods.get_opt("image-check").await.ok().flatten()?;
        let phase = p.status.as_ref()?.phase.clone()?;
        (phase == "Succeeded" || phase == "Failed").then_some(p)
    })
    .await;
    let status = done.status.clone().unwrap_or_default();
    let terminated = status
        .container_statuses
        .as_ref()
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.clone());
    assert_eq!(
        status.phase.as_deref(),
        Some("Succeeded"),
        "{:?} {terminated:?}",
        status.conditions
    );
    assert_eq!(terminated.map(|t| t.exit_code), Some(0));
    // What the container printed, from the kubelet's own log of it: the CRD.
    let uid = done.metadata.uid.clone().unwrap_or_default();
    let log_dir = Path::new(rig.get("OUTBOX_RIG_POD_LOGS"))
        .join(format!("{ns}_image-check_{uid}"))
        .join("relay");
    let log = std::fs::read_dir(&log_dir)
        .unwrap_or_else(|e| panic!("{}: {e}", log_dir.display()))
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
        .collect::<String>();
    assert!(
        log.contains("kind: CustomResourceDefinition") && log.contains("outboxrelays.outbox.dev"),
        "the container did not print the CRD: {}",
        &log[..log.len().min(500)]
    );
    pods.delete("image-check", &DeleteParams::default())
        .await
        .unwrap();
    common::delete_namespace(&client, &ns).await;
}
