//! The monitoring objects as kube-prometheus-stack picks them up. Its Prometheus selects
//! ServiceMonitors and PrometheusRules by label (`release: <its release>` by default);
//! here the chart is rendered with `monitoring.labels.release` and the operator's own
//! PrometheusRule on, the relay objects are built from the operator's flags as the chart
//! renders them, and the rig's real Prometheus is given the rule groups of exactly the
//! PrometheusRules that selector matches, as the Prometheus operator would. Without the
//! label nothing is selected (the silent failure users met); with it the operator's
//! and the relay's alerts load (their PromQL is valid), link their runbooks, and the
//! operator-down alert fires for an operator target that does not answer.

use crate::alerts_prometheus::{prometheus, reload};
use crate::chart_relay_pods::chart_and_relay;
use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};

/// kube-prometheus-stack's default selector, for a release named `kps`.
const SELECTOR: (&str, &str) = ("release", "kps");

fn kinds<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// Whether the Prometheus operator's `matchLabels` selector picks `object`.
fn selected(object: &Value) -> bool {
    object["metadata"]["labels"][SELECTOR.0] == SELECTOR.1
}

fn alert_names(rule: &Value) -> BTreeSet<String> {
    rule["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

/// The JSON body of a GET of Prometheus's API (`None` on any error: callers wait on it).
async fn api_json(http: &reqwest::Client, url: &str) -> Option<Value> {
    http.get(url).send().await.ok()?.json().await.ok()
}

#[test]
fn without_the_selectors_label_nothing_is_picked_up() {
    let (chart, relay) = chart_and_relay(
        &[
            "--set",
            "metrics.prometheusRule.enabled=true",
            "--set",
            "metrics.serviceMonitor.enabled=true",
        ],
        "polling-nats.yaml",
    );
    let all: Vec<&Value> = ["PrometheusRule", "ServiceMonitor"]
        .iter()
        .flat_map(|k| kinds(&chart, k).into_iter().chain(kinds(&relay, k)))
        .collect();
    assert_eq!(all.len(), 4, "{all:?}");
    assert!(all.iter().all(|o| !selected(o)));
}

#[tokio::test]
async fn the_stacks_prometheus_loads_the_selected_rules_and_the_operator_down_alert_fires() {
    let (chart, relay) = chart_and_relay(
        &[
            "--set",
            &format!("monitoring.labels.{}={}", SELECTOR.0, SELECTOR.1),
            "--set",
            "metrics.prometheusRule.enabled=true",
            "--set",
            "metrics.serviceMonitor.enabled=true",
        ],
        "polling-nats.yaml",
    );
    for kind in ["ServiceMonitor", "PrometheusRule"] {
        for object in kinds(&chart, kind).into_iter().chain(kinds(&relay, kind)) {
            assert!(
                selected(object),
                "a {kind} the stack's Prometheus would not select: {}",
                object["metadata"]
            );
        }
    }
    let operator_rule = kinds(&chart, "PrometheusRule")[0].clone();
    let relay_rule = kinds(&relay, "PrometheusRule")[0].clone();
    let operator_alerts = alert_names(&operator_rule);
    assert_eq!(
        operator_alerts,
        [
            "OutboxOperatorDown",
            "OutboxOperatorReconcileErrors",
            "OutboxOrphanedReplicationSlots"
        ]
        .map(str::to_owned)
        .into()
    );
    // Every alert links a section of the runbooks (the same base for both).
    let runbooks = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/runbooks.md"),
    )
    .unwrap();
    let base = outbox_operator::resources::default_runbook_base_url();
    for rule in [&operator_rule, &relay_rule] {
        for group in rule["spec"]["groups"].as_array().unwrap() {
            for r in group["rules"].as_array().unwrap() {
                let url = r["annotations"]["runbook_url"].as_str().unwrap();
                let anchor = url
                    .strip_prefix(&format!("{base}#"))
                    .unwrap_or_else(|| panic!("{url} is not under {base}"));
                assert!(
                    runbooks.lines().any(|l| l
                        .strip_prefix("## ")
                        .is_some_and(|h| h.to_ascii_lowercase() == anchor)),
                    "docs/runbooks.md has no section for #{anchor}"
                );
            }
        }
    }

    // The Prometheus operator's part: the selected rules' groups into a rule file.
    let (prom, http, files, suffix) = prometheus().await;
    let mut groups = Vec::new();
    for rule in [&operator_rule, &relay_rule] {
        for group in rule["spec"]["groups"].as_array().unwrap() {
            let mut group = group.clone();
            group["name"] = json!(format!("{}-{suffix}", group["name"].as_str().unwrap()));
            // The test cannot wait out minutes: the same rules, shorter `for`.
            for r in group["rules"].as_array_mut().unwrap() {
                r["for"] = json!("4s");
            }
            groups.push(group);
        }
    }
    std::fs::write(
        &files.rules,
        serde_yaml::to_string(&json!({"groups": groups})).unwrap(),
    )
    .unwrap();
    // An operator target that does not answer, labelled as its ServiceMonitor's scrape
    // labels it (the chart's metrics Service in the release namespace).
    files.set_target("127.0.0.1:1", "operators", "ops-outbox-operator-metrics");
    reload(&http, &prom).await;

    let loaded = common::wait_for_some(
        "the rule groups loaded by Prometheus",
        Duration::from_secs(30),
        || async {
            let body = api_json(&http, &format!("{prom}/api/v1/rules")).await?;
            let names: BTreeSet<String> = body["data"]["groups"]
                .as_array()?
                .iter()
                .filter(|g| g["name"].as_str().is_some_and(|n| n.ends_with(&suffix)))
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .filter(|r| r["health"] != "err")
                .filter_map(|r| r["name"].as_str().map(str::to_owned))
                .collect();
            (names.len() == operator_alerts.len() + alert_names(&relay_rule).len()).then_some(names)
        },
    )
    .await;
    assert!(loaded.is_superset(&operator_alerts), "{loaded:?}");

    let firing = common::wait_for_some(
        "OutboxOperatorDown firing",
        Duration::from_secs(60),
        || async {
            let body = api_json(&http, &format!("{prom}/api/v1/alerts")).await?;
            body["data"]["alerts"]
                .as_array()?
                .iter()
                .find(|a| {
                    a["labels"]["alertname"] == "OutboxOperatorDown" && a["state"] == "firing"
                })
                .cloned()
        },
    )
    .await;
    assert_eq!(firing["labels"]["severity"], "critical", "{firing}");
    println!(
        "selected by release=kps: {} operator and {} relay alerts loaded; OutboxOperatorDown firing",
        operator_alerts.len(),
        loaded.len() - operator_alerts.len()
    );
    drop(files);
}
