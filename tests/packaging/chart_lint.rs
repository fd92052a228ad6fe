//! The Helm chart renders and lints cleanly, its values schema rejects bad values, its
//! CRD is the one the API types generate, and its Grafana dashboard queries valid PromQL.

use crate::chart_common;
use crate::common;

use std::fs;

use chart_common::{chart_dir, documents, expect_success, helm, template};
use kube::CustomResourceExt;
use outbox_operator::api::OutboxRelay;

fn lint(args: &[&str]) -> std::process::Output {
    let chart = chart_dir();
    let mut all = vec!["lint", "--strict", chart.to_str().unwrap()];
    all.extend_from_slice(args);
    helm(&all)
}

fn values_file(dir: &tempfile::TempDir, name: &str, yaml: &str) -> String {
    let path = dir.path().join(name);
    fs::write(&path, yaml).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn chart_lints_strictly_in_every_mode() {
    expect_success("helm lint --strict (default values)", lint(&[]));
    expect_success(
        "helm lint --strict (one namespace, ServiceMonitor, dashboard, two replicas)",
        lint(&[
            "--set",
            "watchNamespace=apps",
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--set",
            "grafanaDashboard.enabled=true",
            "--set",
            "replicaCount=2",
        ]),
    );
}

#[test]
fn values_schema_rejects_bad_values() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        // A string where a number belongs.
        ("replicas.yaml", "replicaCount: \"two\"\n", "/replicaCount"),
        // A typo in a key is an error, not a silently ignored value.
        ("typo.yaml", "watchNamespaces: apps\n", "watchNamespaces"),
        // Two operators without a Lease would reconcile the same relays twice.
        (
            "no-lease.yaml",
            "replicaCount: 2\nleaderElection:\n  enabled: false\n",
            "/replicaCount",
        ),
        // Not a namespace name.
        (
            "namespace.yaml",
            "watchNamespace: Apps_1\n",
            "/watchNamespace",
        ),
        (
            "pull-policy.yaml",
            "image:\n  pullPolicy: Sometimes\n",
            "/image/pullPolicy",
        ),
    ];
    for (file, yaml, complaint) in cases {
        let path = values_file(&dir, file, yaml);
        let output = lint(&["-f", &path]);
        let report = common::describe_output(&output);
        assert!(
            !output.status.success(),
            "helm lint accepted bad values {yaml:?}:\n{report}"
        );
        assert!(
            report.contains("schema") && report.contains(complaint),
            "helm lint rejected {yaml:?} but not through the values schema at {complaint}:\n{report}"
        );
    }
}

/// The chart ships the CRDs generated from `src/api`; `make crds` keeps them equal.
#[test]
fn chart_crds_are_the_ones_the_api_types_generate() {
    for (file, crd) in [
        ("outboxrelay.yaml", OutboxRelay::crd()),
        (
            "outboxreplay.yaml",
            outbox_operator::api::OutboxReplay::crd(),
        ),
    ] {
        let expected = serde_json::to_value(&crd).unwrap();
        let generated = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(file);
        fs::write(&generated, serde_yaml::to_string(&crd).unwrap()).unwrap();
        let shipped_path = chart_dir().join("crds").join(file);
        let shipped = fs::read_to_string(&shipped_path)
            .unwrap_or_else(|err| panic!("cannot read {}: {err}", shipped_path.display()));
        let shipped: serde_json::Value = serde_yaml::from_str(&shipped).unwrap();
        assert!(
            shipped == expected,
            "{} differs from the API types: run `make crds` (or copy {})",
            shipped_path.display(),
            generated.display()
        );
    }
}

/// The panels the DESIGN promises, each on a metric the relay exports.
const DASHBOARD_METRICS: [&str; 7] = [
    "outbox_relay_published_total",
    "outbox_relay_backlog_rows",
    "outbox_relay_oldest_unpublished_age_seconds",
    "outbox_relay_publish_errors_total",
    "outbox_relay_slot_retained_wal_bytes",
    "outbox_relay_end_to_end_lag_seconds_bucket",
    "outbox_relay_dead_lettered_total",
];

#[test]
fn dashboard_configmap_is_labelled_and_its_queries_are_valid_promql() {
    let rendered = template(
        "dash",
        "monitoring",
        &[
            "--set",
            "grafanaDashboard.enabled=true",
            "--set",
            "grafanaDashboard.annotations.grafana_folder=Outbox",
        ],
    );
    let configmap = documents(&rendered)
        .into_iter()
        .find(|doc| doc["kind"] == "ConfigMap")
        .expect("grafanaDashboard.enabled renders a ConfigMap");
    assert_eq!(
        configmap["metadata"]["labels"]["grafana_dashboard"], "1",
        "the Grafana sidecar finds dashboards by this label"
    );
    assert_eq!(
        configmap["metadata"]["annotations"]["grafana_folder"],
        "Outbox"
    );
    let json = configmap["data"]["outbox-relays.json"]
        .as_str()
        .expect("the dashboard is a string in the ConfigMap");
    let dashboard: serde_json::Value = serde_json::from_str(json).expect("dashboard is JSON");

    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .expect("dashboard has panels")
        .iter()
        .flat_map(|panel| panel["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|target| target["expr"].as_str().map(str::to_string))
        .collect();
    // Every query selects and groups by the relay's own constant labels, which survive
    // any scrape config, never by the target labels a ServiceMonitor happens to add.
    for expr in &exprs {
        assert!(
            expr.contains(r#"relay_namespace=~"$namespace", relay_name=~"$relay""#)
                && !expr.contains("service")
                && !expr.contains("by (namespace"),
            "a panel on unstable target labels: {expr}"
        );
    }
    for metric in DASHBOARD_METRICS {
        assert!(
            exprs.iter().any(|expr| expr.contains(metric)),
            "no dashboard panel queries {metric}: {exprs:#?}"
        );
    }

    // promtool parses each query the way Prometheus will, once Grafana has replaced
    // its variables.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in exprs.iter().enumerate() {
        let concrete = expr
            .replace("$__rate_interval", "5m")
            .replace("$namespace", ".*")
            .replace("$relay", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:panel{i}\n        expr: {}\n",
            serde_json::to_string(&concrete).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = values_file(&dir, "rules.yaml", &rules);
    let output = common::run_tool(common::Rig::load().promtool(), &["check", "rules", &path]);
    expect_success(&format!("promtool check rules\n{rules}"), output);
}

#[test]
fn operator_pod_is_restricted_and_configured_from_values() {
    let rendered = template(
        "ops",
        "operators",
        &[
            "--set",
            "logLevel=debug",
            "--set",
            "replicaCount=2",
            "--set",
            "image.repository=registry.example/outbox",
            "--set",
            "image.tag=9.9.9",
        ],
    );
    let deployment = documents(&rendered)
        .into_iter()
        .find(|doc| doc["kind"] == "Deployment")
        .expect("a Deployment");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let container = &pod["containers"][0];
    let security = &container["securityContext"];
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["image"], "registry.example/outbox:9.9.9");

    let env = container["env"].as_array().unwrap();
    let rust_log = env.iter().find(|var| var["name"] == "RUST_LOG").unwrap();
    assert_eq!(rust_log["value"], "debug");

    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|arg| arg.as_str())
        .collect();
    assert_eq!(args.first(), Some(&"controller"));
    // Relays follow the operator's image unless told otherwise.
    assert!(
        args.contains(&"--relay-image=registry.example/outbox:9.9.9"),
        "{args:?}"
    );
    assert!(args.contains(&"--leader-elect=true"), "{args:?}");
    // Least privilege by default: a relay may not pick its image or ServiceAccount.
    assert!(args.contains(&"--allow-relay-image=false"), "{args:?}");
    assert!(
        args.contains(&"--allow-relay-service-account=false"),
        "{args:?}"
    );
    assert!(
        args.contains(&"--lease-name=ops-outbox-operator"),
        "{args:?}"
    );
    // All namespaces by default: no --namespace flag.
    assert!(
        !args.iter().any(|arg| arg.starts_with("--namespace")),
        "{args:?}"
    );
}
