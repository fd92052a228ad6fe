//! Relay pods on a platform that chooses who they run as (issue #46), on the rig's real
//! node: a namespace at Pod Security level `restricted`, where admission policies do to
//! pods what OpenShift's `restricted-v2` SCC does — a pod that names no user gets one
//! from the namespace's range (`openshift.io/sa.scc.uid-range`), and its `fsGroup` from
//! the supplemental range; a pod that names a user outside the range is refused.
//!
//! A relay pinned to the image's user (65532) is refused: the OutboxRelay says so
//! (`RelayPodsRefused`, with the platform's answer). Unpinned, as the operator builds it
//! by default, it runs as the arbitrary user the platform assigned, reads its config and
//! Secret files, and publishes every committed event in per-aggregate order.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::core::DynamicObject;
use kube::discovery::ApiResource;
use outbox_operator::api::OutboxRelay;
use serde_json::{Value, json};

use common::app_writer::{AppWriter, WriterOptions};
use common::node::RelayPods;
use common::operator;
use common::pod_runner::MANAGED_PODS;

const WAIT: Duration = Duration::from_secs(120);
const NAME: &str = "platform";
/// The namespace's ranges, as OpenShift annotates a project.
const UID_START: i64 = 1_000_680_000;
const RANGE_SIZE: i64 = 10_000;
const RANGE: &str = "1000680000/10000";

/// A cluster-scoped admission object of `kind` (admissionregistration.k8s.io/v1).
fn admission(client: &kube::Client, kind: &str) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "admissionregistration.k8s.io".to_owned(),
        version: "v1".to_owned(),
        api_version: "admissionregistration.k8s.io/v1".to_owned(),
        kind: kind.to_owned(),
        plural: format!("{}s", kind.to_lowercase()).replace("policys", "policies"),
    };
    Api::all_with(client.clone(), &resource)
}

/// The label that puts a namespace under the emulated SCC.
const SCC_LABEL: &str = "outbox.dev/rig-scc";

/// Pods in the namespaces labelled `SCC_LABEL=tag`: CREATE and UPDATE.
fn pods_of_scc_namespaces(tag: &str) -> Value {
    json!({
        "matchConstraints": {
            "namespaceSelector": {"matchLabels": {SCC_LABEL: tag}},
            "resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}]},
        "failurePolicy": "Fail",
    })
}

/// `restricted-v2` for the namespaces labelled `SCC_LABEL=tag` (with the range their
/// annotations give, as OpenShift's would): the mutating policy
/// assigns the range's first user and group to a pod that names none, the validating
/// one refuses a user or fsGroup outside the range. Returns the objects' names.
async fn emulate_restricted_scc(client: &kube::Client, tag: &str) -> String {
    let name = format!("rig-scc-{tag}");
    let (start, size) = (UID_START, RANGE_SIZE);
    let mut mutate = pods_of_scc_namespaces(tag);
    mutate["reinvocationPolicy"] = json!("Never");
    mutate["matchConditions"] = json!([{
        "name": "names-no-user", "expression":
        "!has(object.spec.securityContext) || !has(object.spec.securityContext.runAsUser)"}]);
    mutate["mutations"] = json!([{"patchType": "ApplyConfiguration", "applyConfiguration": {
        "expression": format!("Object{{spec: Object.spec{{securityContext: \
            Object.spec.securityContext{{runAsUser: {start}, fsGroup: {start}}}}}}}")}}]);
    let mut validate = pods_of_scc_namespaces(tag);
    let in_range = |field: &str| {
        format!(
            "!has(object.spec.securityContext) || !has(object.spec.securityContext.{field}) || \
             (object.spec.securityContext.{field} >= {start} && \
              object.spec.securityContext.{field} < {start} + {size})"
        )
    };
    validate["validations"] = json!([
        {"expression": in_range("runAsUser"),
         "message": "unable to validate against any security context constraint: \
             runAsUser: Invalid value: must be in the ranges of the namespace"},
        {"expression": in_range("fsGroup"),
         "message": "unable to validate against any security context constraint: \
             fsGroup: Invalid value: must be in the ranges of the namespace"},
    ]);
    for (kind, spec) in [
        ("MutatingAdmissionPolicy", mutate),
        ("ValidatingAdmissionPolicy", validate),
    ] {
        let mut binding = json!({"policyName": name});
        if kind.starts_with("Validating") {
            binding["validationActions"] = json!(["Deny"]);
        }
        for (kind, spec) in [(kind.to_owned(), spec), (format!("{kind}Binding"), binding)] {
            let object: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
                "metadata": {"name": name}, "spec": spec}))
            .unwrap();
            admission(client, &kind)
                .create(&PostParams::default(), &object)
                .await
                .unwrap_or_else(|e| panic!("creating the rig's {kind} {name}: {e}"));
        }
    }
    name
}

async fn remove_scc(client: &kube::Client, name: &str) {
    for kind in [
        "MutatingAdmissionPolicyBinding",
        "MutatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicy",
    ] {
        let _ = admission(client, kind)
            .delete(name, &DeleteParams::default())
            .await;
    }
}

/// The `Uid:` and `Groups:` lines of a process, as the kernel sees it.
fn ids_of(pid: i64) -> (Vec<i64>, Vec<i64>) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/status: {e}"));
    let numbers = |key: &str| -> Vec<i64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect()
    };
    (numbers("Uid:"), numbers("Groups:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_run_as_the_user_a_restricted_platform_assigns() {
    common::node::name();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            &ns,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {
                "labels": {SCC_LABEL: ns,
                           "pod-security.kubernetes.io/enforce": "restricted",
                           "pod-security.kubernetes.io/enforce-version": "latest"},
                "annotations": {"openshift.io/sa.scc.uid-range": RANGE,
                                "openshift.io/sa.scc.supplemental-groups": RANGE}}})),
        )
        .await
        .unwrap_or_else(|e| panic!("labelling namespace {ns}: {e}"));
    let scc = emulate_restricted_scc(&client, &ns).await;
    let pods = RelayPods::start(&client, &ns).await;
    let mut controller = pods.controller(&ns, &[]);
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &pods.url(&db.url))]).await;
    let stream = common::fresh_stream().await;
    let mut manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": NAME},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"logTailing": {"heartbeatInterval": "5s", "deleteAfterPublish": true}},
            "broker": {"nats": {"url": common::Rig::load().nats_url(),
                "subject": format!("{}.{{aggregateType}}", stream.subject_prefix)}},
            "ordering": {"mode": "perAggregate", "partitions": 4},
            // Pinned to the image's user: outside the namespace's range.
            "relay": {"runAsUser": 65532},
        }
    });
    pods.adapt(&mut manifest);
    operator::apply_relay(&client, &ns, &manifest).await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let refused = common::wait_for_some_or(
        "Ready=False with reason RelayPodsRefused on the OutboxRelay",
        WAIT,
        || pods.log_tails(20),
        || async {
            let relay = relays.get_opt(NAME).await.ok().flatten()?;
            operator::condition(&relay, "Ready")
                .filter(|c| c.status == "False" && c.reason == "RelayPodsRefused")
        },
    )
    .await;
    assert!(
        refused.message.contains("runAsUser: Invalid value"),
        "the platform's answer is not in the condition: {}",
        refused.message
    );
    println!(
        "pinned to 65532: Ready=False RelayPodsRefused: {}",
        refused.message
    );

    // As the operator builds it by default: no user named.
    manifest["spec"]["relay"]
        .as_object_mut()
        .unwrap()
        .remove("runAsUser");
    operator::apply_relay(&client, &ns, &manifest).await;
    let writer = AppWriter::start(
        &db.url,
        WriterOptions {
            aggregates: 50,
            writers: 2,
            pause: Duration::from_millis(10),
            ..WriterOptions::default()
        },
    )
    .await;
    writer.allow(1_000);
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let (pod, container_id) = common::wait_for_some_or(
        "the relay Ready, its pod running as the platform assigned",
        WAIT,
        || pods.log_tails(30),
        || async {
            let relay = relays.get_opt(NAME).await.ok().flatten()?;
            if !operator::is_ready(&relay) {
                return None;
            }
            let list = pod_api
                .list(&ListParams::default().labels(MANAGED_PODS))
                .await
                .ok()?;
            let pod = list
                .items
                .into_iter()
                .find(|p| p.metadata.deletion_timestamp.is_none())?;
            let id = pod
                .status
                .as_ref()?
                .container_statuses
                .as_ref()?
                .iter()
                .find(|c| c.name == "relay" && c.ready)?
                .container_id
                .clone()?;
            Some((pod, id))
        },
    )
    .await;
    let security = pod
        .spec
        .as_ref()
        .and_then(|s| s.security_context.clone())
        .unwrap_or_default();
    assert_eq!(
        (security.run_as_user, security.fs_group),
        (Some(UID_START), Some(UID_START)),
        "the platform's choice is not on the pod: {security:?}"
    );
    let pid = super::e2e_kubelet::container_pid(&container_id);
    let (uids, groups) = ids_of(pid);
    assert!(
        !uids.is_empty() && uids.iter().all(|u| *u == UID_START),
        "the relay process runs as {uids:?}, not the assigned {UID_START}"
    );
    assert!(
        groups.contains(&UID_START),
        "the relay process lacks the fsGroup that owns its files: groups {groups:?}"
    );
    println!("relay process {pid}: uid {uids:?}, groups {groups:?}");

    writer.allow(3_000);
    let ledger = writer.finish().await;
    let want = ledger.committed.len();
    let received = common::wait_for_some_or(
        &format!("all {want} committed events at the consumer"),
        WAIT,
        || pods.log_tails(30),
        || async {
            let received = common::consume_nats(&stream).await;
            let ids: BTreeSet<i64> = received.iter().map(|m| m.id).collect();
            ledger.committed.is_subset(&ids).then_some(received)
        },
    )
    .await;
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    report.assert_complete();
    println!(
        "restricted, arbitrary uid: {want} events committed, {} received, {} duplicates, \
         0 lost, 0 reordered",
        report.received, report.duplicates
    );
    operator::delete_relays(&client, &ns, WAIT).await;
    let stopped = controller.stop(WAIT);
    drop(pods);
    remove_scc(&client, &scc).await;
    common::delete_namespace(&client, &ns).await;
    let _ = stream.jetstream.delete_stream(&stream.name).await;
    db.drop_database().await;
    assert!(stopped.is_ok_and(|s| s.success()), "the controller's exit");
}
