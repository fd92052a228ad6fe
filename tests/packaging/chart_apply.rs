//! Everything the chart renders is admitted by the real kube-apiserver
//! (`kubectl apply --dry-run=server --validate=strict`): default values with the CRD,
//! one-namespace mode, and with the ServiceMonitor and Grafana dashboard turned on.

use crate::chart_common;
use crate::common;

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use chart_common::{
    apply_dry_run_server, documents, expect_success, kinds_and_names, template, with_namespaces,
};
use futures::FutureExt;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

#[tokio::test]
async fn default_render_with_crd_is_admitted_by_the_apiserver() {
    with_namespaces(1, |_, namespaces| async move {
        let namespace = &namespaces[0];
        let release = chart_common::fresh_release();
        let rendered = template(&release, namespace, &["--include-crds"]);
        let kinds: Vec<String> = kinds_and_names(&rendered)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        for kind in [
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "Service",
            "Deployment",
        ] {
            assert!(kinds.iter().any(|k| k == kind), "no {kind} in {kinds:?}");
        }
        let output = apply_dry_run_server(&rendered);
        let stdout = expect_success("kubectl apply --dry-run=server (default values)", output);
        // kubectl reports one line per object it sent; none may be missing.
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.contains("(server dry run)"))
                .count(),
            kinds.len(),
            "{stdout}"
        );
    })
    .await;
}

#[tokio::test]
async fn one_namespace_render_is_admitted_by_the_apiserver() {
    with_namespaces(2, |_, namespaces| async move {
        let (operator_ns, watched_ns) = (&namespaces[0], &namespaces[1]);
        let release = chart_common::fresh_release();
        let rendered = template(
            &release,
            operator_ns,
            &[
                "--set",
                &format!("watchNamespace={watched_ns}"),
                "--set",
                "replicaCount=2",
            ],
        );
        let docs = documents(&rendered);
        // The watch rules land in the watched namespace, not cluster-wide.
        let role = docs
            .iter()
            .find(|d| d["kind"] == "Role" && d["metadata"]["namespace"] == watched_ns.as_str())
            .expect("a Role in the watched namespace");
        assert!(role["rules"].to_string().contains("outboxrelays"));
        let cluster_role = docs.iter().find(|d| d["kind"] == "ClusterRole").unwrap();
        assert!(
            !cluster_role["rules"].to_string().contains("secrets"),
            "one-namespace mode must not grant Secrets cluster-wide: {cluster_role}"
        );
        let output = apply_dry_run_server(&rendered);
        expect_success("kubectl apply --dry-run=server (one namespace)", output);
    })
    .await;
}

/// The ServiceMonitor schema of the Prometheus operator, cut down to the fields the
/// chart sets (their names, types and the Duration pattern are copied from
/// monitoring.coreos.com/v1). Anything else is pruned, which strict validation reports.
fn service_monitor_crd(group: &str) -> serde_json::Value {
    let duration = "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$";
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("servicemonitors.{group}")},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "servicemonitors", "singular": "servicemonitor",
                      "kind": "ServiceMonitor", "listKind": "ServiceMonitorList"},
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": {
                            "type": "object",
                            "required": ["selector"],
                            "properties": {
                                "selector": {"type": "object", "properties": {
                                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                                    "matchExpressions": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
                                }},
                                "namespaceSelector": {"type": "object", "properties": {
                                    "any": {"type": "boolean"},
                                    "matchNames": {"type": "array", "items": {"type": "string"}}
                                }},
                                "endpoints": {"type": "array", "items": {"type": "object", "properties": {
                                    "port": {"type": "string"},
                                    "path": {"type": "string"},
                                    "interval": {"type": "string", "pattern": duration},
                                    "scrapeTimeout": {"type": "string", "pattern": duration}
                                }}}
                            }
                        }
                    }
                }}
            }]
        }
    })
}

/// The ServiceMonitor needs its CRD. The real `servicemonitors.monitoring.coreos.com`
/// is not installed here: it is cluster-wide, and other tests on the shared rig prove
/// what the operator does when that CRD is absent. Instead the same schema subset is
/// served under a group of this test's own, and the rendered ServiceMonitor is moved to
/// that group for the dry run. The dashboard ConfigMap needs nothing special.
#[tokio::test]
async fn monitoring_render_is_admitted_by_the_apiserver() {
    with_namespaces(1, |client, namespaces| async move {
        let namespace = &namespaces[0];
        let group = format!("m{}.test.outbox.dev", common::unique_suffix());
        let crd_name = format!("servicemonitors.{group}");
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        let outcome = AssertUnwindSafe(async {
            crds.patch(
                &crd_name,
                &PatchParams::apply("outbox-operator-chart-test").force(),
                &Patch::Apply(service_monitor_crd(&group)),
            )
            .await
            .unwrap();
            common::wait_for(
                "the ServiceMonitor fixture CRD to be Established",
                Duration::from_secs(30),
                || async {
                    crds.get_opt(&crd_name)
                        .await
                        .ok()
                        .flatten()
                        .is_some_and(|crd| {
                            crd.status
                                .and_then(|s| s.conditions)
                                .unwrap_or_default()
                                .iter()
                                .any(|c| c.type_ == "Established" && c.status == "True")
                        })
                },
            )
            .await;

            let release = chart_common::fresh_release();
            let rendered = template(
                &release,
                namespace,
                &[
                    "--set",
                    "metrics.serviceMonitor.enabled=true",
                    "--set",
                    "metrics.serviceMonitor.labels.release=prometheus",
                    "--set",
                    "grafanaDashboard.enabled=true",
                ],
            );
            let kinds: Vec<String> = kinds_and_names(&rendered)
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            assert!(kinds.iter().any(|k| k == "ServiceMonitor"), "{kinds:?}");
            assert!(kinds.iter().any(|k| k == "ConfigMap"), "{kinds:?}");
            let moved = rendered.replace(
                "apiVersion: monitoring.coreos.com/v1",
                &format!("apiVersion: {group}/v1"),
            );
            assert_ne!(
                moved, rendered,
                "the ServiceMonitor's apiVersion was not found"
            );
            let output = apply_dry_run_server(&moved);
            expect_success(
                "kubectl apply --dry-run=server (ServiceMonitor and dashboard)",
                output,
            );
        })
        .catch_unwind()
        .await;
        let _ = crds.delete(&crd_name, &DeleteParams::default()).await;
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    })
    .await;
}
