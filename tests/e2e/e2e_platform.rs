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
//!
//! And Secrets as cert-manager and Strimzi write them, referenced by name only: each
//! reference reads the key its role has in those Secrets.
//!
//! And a pull Secret the relay's namespace lacks: named in the relay's status.

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

/// Waits for the API server to enforce the emulated SCC in `ns` (its admission-policy
/// cache syncs after the policies are created): a dry-run pod that names no user comes
/// back with the range's first, and one pinned to 65532 is refused.
async fn wait_enforced(client: &kube::Client, ns: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let probe = |user: Option<i64>| -> Pod {
        let mut security = json!({"runAsNonRoot": true,
            "seccompProfile": {"type": "RuntimeDefault"}});
        if let Some(user) = user {
            security["runAsUser"] = json!(user);
        }
        serde_json::from_value(json!({
            "metadata": {"generateName": "scc-probe-"},
            "spec": {"securityContext": security, "containers": [{
                "name": "probe", "image": "probe",
                "securityContext": {"allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"]}}}]}}))
        .unwrap()
    };
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    common::wait_for_some(
        "the emulated SCC enforced in the namespace",
        WAIT,
        || async {
            let assigned = pods.create(&dry_run, &probe(None)).await.ok()?;
            let user = assigned.spec?.security_context?.run_as_user;
            let pinned = pods.create(&dry_run, &probe(Some(65_532))).await;
            let refused =
                matches!(&pinned, Err(e) if e.to_string().contains("security context constraint"));
            (user == Some(UID_START) && refused).then_some(())
        },
    )
    .await;
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
    wait_enforced(&client, &ns).await;
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

/// A Secret of `type_` with `data`, as cert-manager or Strimzi would leave it.
async fn typed_secret(
    client: &kube::Client,
    ns: &str,
    name: &str,
    type_: &str,
    data: &[(&str, &[u8])],
) {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        type_: Some(type_.to_owned()),
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.to_vec())))
                .collect(),
        ),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_or_else(|e| panic!("creating Secret {name}: {e}"));
}

/// Secrets laid out as the ecosystem writes them, named without a single key: a
/// cert-manager `kubernetes.io/tls` Secret (`ca.crt`, `tls.crt`, `tls.key`) gives the
/// database's CA and the client certificate that logs the relay in (sslMode
/// verify-full, no password anywhere); for Kafka the relay names only a Strimzi
/// `Kafka` and `KafkaUser` (`kafkaRef`, Strimzi's own CRDs): its cluster-CA Secret
/// (`ca.crt`) verifies the broker, and the user's Secret (`password`,
/// `sasl.jaas.config`, no user name) logs in over SCRAM as the user. The operator's
/// checks and the relay on the node read the same keys, and every committed row
/// arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_as_cert_manager_and_strimzi_write_them_need_no_key_names() {
    const RELAY: &str = "ecosystem";
    const ROWS: usize = 200;
    common::node::name();
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    db.client
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE outbox_cert LOGIN REPLICATION; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;
             GRANT SELECT, UPDATE, DELETE ON public.outbox TO outbox_cert;",
        )
        .await
        .unwrap_or_else(|e| panic!("granting outbox_cert: {e}"));
    let parsed: tokio_postgres::Config = db.url.parse().unwrap();
    let topic = common::fresh_topic(4).await;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let pods = RelayPods::start(&client, &ns).await;
    let mut controller = pods.controller(&ns, &[]);

    let tls_dir = rig.get("OUTBOX_RIG_TLS_DIR").to_owned();
    let read = |name: &str| {
        std::fs::read(format!("{tls_dir}/{name}"))
            .unwrap_or_else(|e| panic!("the rig's {name}: {e}"))
    };
    let (ca, crt, key) = (read("ca.crt"), read("client.crt"), read("client.key"));
    typed_secret(
        &client,
        &ns,
        "relay-db-tls",
        "kubernetes.io/tls",
        &[("ca.crt", &ca), ("tls.crt", &crt), ("tls.key", &key)],
    )
    .await;
    let cert_url = pods.url(&format!(
        "postgres://outbox_cert@127.0.0.1:{}/{}",
        parsed.get_ports()[0],
        parsed.get_dbname().unwrap()
    ));
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &cert_url)]).await;
    typed_secret(
        &client,
        &ns,
        "my-cluster-cluster-ca-cert",
        "Opaque",
        &[
            ("ca.crt", &ca),
            ("ca.p12", b"\x30\x82binary"),
            ("ca.password", b"x"),
        ],
    )
    .await;
    let user = rig.get("OUTBOX_RIG_KAFKA_USER").to_owned();
    let password = rig.get("OUTBOX_RIG_KAFKA_PASSWORD").to_owned();
    let jaas = format!(
        "org.apache.kafka.common.security.scram.ScramLoginModule required \
         username=\"{user}\" password=\"{password}\";"
    );
    typed_secret(
        &client,
        &ns,
        &user,
        "Opaque",
        &[
            ("password", password.as_bytes()),
            ("sasl.jaas.config", jaas.as_bytes()),
        ],
    )
    .await;
    // The Strimzi cluster and user those Secrets belong to, as Strimzi's CRDs take them.
    common::strimzi::install(&client).await;
    common::strimzi::create(
        &client,
        &ns,
        "Kafka",
        common::strimzi::kafka(
            "my-cluster",
            json!([{"name": "scram", "port": 9094, "type": "internal", "tls": true,
                    "authentication": {"type": "scram-sha-512"}}]),
        ),
    )
    .await;
    common::strimzi::create(
        &client,
        &ns,
        "KafkaUser",
        common::strimzi::user(&user, "my-cluster", "scram-sha-512", true),
    )
    .await;
    let mut manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": RELAY},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "orders-db"},
                "sslMode": "verify-full",
                "caSecretRef": {"name": "relay-db-tls"},
                "clientCertSecretRef": {"name": "relay-db-tls"}}},
            "mode": {"polling": {"interval": "200ms"}},
            "broker": {"kafka": {
                // The cluster's listener reached at the rig's address (the bootstrap
                // Service's name resolves in a cluster only).
                "bootstrapServers": rig.get("OUTBOX_RIG_KAFKA_SASL_SSL_BOOTSTRAP"),
                "kafkaRef": {"name": "my-cluster", "port": 9094, "user": user,
                             "authentication": "scram-sha-512"},
                "topic": topic}},
            "ordering": {"mode": "perAggregate", "partitions": 4},
        }
    });
    pods.adapt(&mut manifest);
    operator::apply_relay(&client, &ns, &manifest).await;
    let ids: BTreeSet<i64> = common::commit_rows(&db.client, "ecosystem", ROWS)
        .await
        .into_iter()
        .collect();
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let ready = common::wait_for_some_or(
        "the relay Ready with every row published",
        WAIT,
        || pods.log_tails(20),
        || async {
            let relay = relays.get_opt(RELAY).await.ok().flatten()?;
            (operator::is_ready(&relay) && common::unpublished_rows(&db.client).await == 0)
                .then_some(relay)
        },
    )
    .await;
    let database = operator::condition(&ready, "DatabaseReady")
        .unwrap_or_else(|| panic!("no DatabaseReady condition: {:?}", ready.status));
    assert!(
        database.status == "True" && database.message.contains("outbox_cert"),
        "the operator did not log in by the certificate: {database:?}"
    );
    let received = tokio::task::spawn_blocking({
        let topic = topic.clone();
        move || common::consume_kafka(&topic)
    })
    .await
    .unwrap();
    let got: BTreeSet<i64> = received.iter().map(|r| r.id).collect();
    assert!(
        ids.is_subset(&got),
        "committed rows never arrived: {:?}",
        ids.difference(&got).collect::<Vec<_>>()
    );
    println!(
        "ecosystem Secrets, no key named: {} rows committed, {} deliveries",
        ids.len(),
        received.len()
    );
    // `check` from inside the cluster, as the relay connects: its certificate login,
    // the cluster CA and the KafkaUser's password, all from kafkaRef and the Secrets.
    let checked = common::plugin::exited(
        &common::plugin::kubectl_outbox(&["check", RELAY, "-n", &ns]),
        0,
    );
    assert!(
        checked.contains("as outbox_cert")
            && checked.contains("ok    broker")
            && !checked.contains("FAIL"),
        "{checked}"
    );
    println!("{checked}");
    operator::delete_relays(&client, &ns, WAIT).await;
    let stopped = controller.stop(WAIT);
    drop(pods);
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
    assert!(stopped.is_ok_and(|s| s.success()), "the controller's exit");
}

/// A private registry's pull Secret named for every relay (the chart's
/// `relayPods.imagePullSecrets`) but missing from the relay's namespace: the kubelet
/// cannot pull, and the relay says which Secret to create where; once it exists, the
/// message no longer blames it (the image itself is still not there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_secret_missing_from_the_relays_namespace_is_named() {
    common::node::name();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let pods = RelayPods::start(&client, &ns).await;
    let mut controller = pods.controller(
        &ns,
        &[
            (
                "OUTBOX_RELAY_IMAGE",
                "registry.invalid/outbox-operator:absent",
            ),
            ("OUTBOX_RELAY_IMAGE_PULL_SECRETS", "regcred"),
        ],
    );
    operator::create_secret(&client, &ns, "db", &[("uri", &pods.url(&db.url))]).await;
    let mut manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "pulled"},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db"}, "sslMode": "disable"}},
            "mode": {"polling": {}},
            "broker": {"nats": {"url": common::Rig::load().nats_url()}},
            "replicas": 1
        }
    });
    pods.adapt(&mut manifest);
    operator::apply_relay(&client, &ns, &manifest).await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let ready = |missing: bool| {
        let relays = relays.clone();
        async move {
            let relay = relays.get_opt("pulled").await.ok().flatten()?;
            operator::condition(&relay, "Ready").filter(|c| {
                c.reason == "RelayImagePullFailed"
                    && c.message.contains("regcred do not exist") == missing
            })
        }
    };
    let blamed = common::wait_for_some_or(
        "Ready=False RelayImagePullFailed naming the missing pull Secret",
        WAIT,
        || pods.log_tails(10),
        || ready(true),
    )
    .await;
    assert!(
        blamed
            .message
            .contains("registry.invalid/outbox-operator:absent"),
        "{}",
        blamed.message
    );
    let config = br#"{"auths":{"registry.invalid":{"auth":"dTpw"}}}"#;
    typed_secret(
        &client,
        &ns,
        "regcred",
        "kubernetes.io/dockerconfigjson",
        &[(".dockerconfigjson", config)],
    )
    .await;
    common::wait_for_some_or(
        "the message no longer blaming the pull Secret once it exists",
        WAIT,
        || pods.log_tails(10),
        || ready(false),
    )
    .await;
    operator::delete_relays(&client, &ns, WAIT).await;
    let stopped = controller.stop(WAIT);
    drop(pods);
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
    assert!(stopped.is_ok_and(|s| s.success()), "the controller's exit");
}
