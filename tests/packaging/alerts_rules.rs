//! The PrometheusRule the controller renders, checked by the real `promtool`: the rules
//! of every mode parse, each alert fires on the series that should fire it and stays
//! silent on healthy ones (fixtures in tests/alerts/), and each links to its runbook.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use outbox_operator::api::OutboxRelay;
use outbox_operator::resources::{default_runbook_base_url, prometheus_rule};
use serde_json::Value;

/// The relays the fixtures in tests/alerts/ were written for (their header says so).
const POLLING: &str = r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: orders-db}}}
  mode: {polling: {}}
  broker: {nats: {url: "nats://nats:4222"}}
  ordering: {mode: perAggregate, partitions: 4}
  alerting: {oldestUnpublishedAge: 5m, backlogRows: 1000}
  replicas: 2
"#;

const LOG_TAILING: &str = r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: orders-db}}}
  mode: {logTailing: {sweep: {}}}
  broker: {kafka: {bootstrapServers: "kafka:9092"}}
  alerting: {slotRetainedWal: 1Gi}
"#;

/// Polling without per-aggregate order: no partition ownership, so no partition alerts.
const POLLING_UNORDERED: &str = r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: orders-db}}}
  mode: {polling: {}}
  broker: {rabbitmq: {urlSecretRef: {name: amqp, key: url}}}
  ordering: {mode: none}
"#;

fn relay(yaml: &str) -> outbox_operator::spec::ValidRelay {
    let relay: OutboxRelay = serde_yaml::from_str(yaml).unwrap();
    outbox_operator::spec::parse(&relay).unwrap_or_else(|e| panic!("{e}"))
}

/// The `spec` of the rendered PrometheusRule: a Prometheus rules file as it stands.
fn rule_spec(yaml: &str) -> Value {
    let rule = prometheus_rule(
        &relay(yaml),
        &outbox_operator::resources::BuildOptions::default(),
    )
    .expect("alerting is on by default");
    rule.data["spec"].clone()
}

fn rules_of(spec: &Value) -> Vec<Value> {
    spec["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().clone())
        .collect()
}

fn alert_names(spec: &Value) -> BTreeSet<String> {
    rules_of(spec)
        .iter()
        .map(|r| r["alert"].as_str().unwrap().to_owned())
        .collect()
}

fn write_rules(dir: &Path, file: &str, spec: &Value) -> PathBuf {
    let path = dir.join(file);
    std::fs::write(&path, serde_yaml::to_string(spec).unwrap()).unwrap();
    path
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/alerts")
}

/// A temp dir holding the rules of both modes under the names the fixtures load.
fn rules_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_rules(dir.path(), "polling.rules.yml", &rule_spec(POLLING));
    write_rules(dir.path(), "log_tailing.rules.yml", &rule_spec(LOG_TAILING));
    dir
}

/// Runs `promtool test rules` on a fixture copied next to the rendered rules (promtool
/// resolves `rule_files` relative to the test file).
fn promtool_test(fixture: &Path) -> std::process::Output {
    let dir = rules_dir();
    let copy = dir.path().join(fixture.file_name().unwrap());
    // The fixtures name the runbooks by placeholder: the base follows the release.
    let text = std::fs::read_to_string(fixture)
        .unwrap()
        .replace("RUNBOOK_BASE_URL", &default_runbook_base_url());
    std::fs::write(&copy, text).unwrap();
    common::run_tool(
        common::Rig::load().promtool(),
        &["test", "rules", copy.to_str().unwrap()],
    )
}

#[test]
fn rules_of_every_mode_pass_promtool_check() {
    for (mode, yaml) in [
        ("polling", POLLING),
        ("log-tailing", LOG_TAILING),
        ("polling-unordered", POLLING_UNORDERED),
    ] {
        let spec = rule_spec(yaml);
        let dir = tempfile::tempdir().unwrap();
        let path = write_rules(dir.path(), &format!("{mode}.yml"), &spec);
        let output = common::run_tool(
            common::Rig::load().promtool(),
            &["check", "rules", path.to_str().unwrap()],
        );
        let described = common::describe_output(&output);
        assert!(output.status.success(), "{mode}: {described}");
        let count = rules_of(&spec).len();
        assert!(
            described.contains(&format!("SUCCESS: {count} rules found")),
            "{mode}: promtool saw a different number of rules than the {count} rendered: {described}"
        );
    }
}

#[test]
fn each_mode_renders_the_alerts_that_apply_to_it() {
    let common_alerts = [
        "OutboxRelayDown",
        "OutboxRelayOldestUnpublishedTooOld",
        "OutboxRelayBacklogHigh",
        "OutboxRelayPublishErrors",
        "OutboxRelayBrokerUnavailable",
    ];
    let partitions = [
        "OutboxRelayPartitionsUnowned",
        "OutboxRelayPartitionsBlocked",
    ];
    let slot = [
        "OutboxRelaySlotRetainedWalHigh",
        "OutboxRelaySlotInactive",
        "OutboxRelaySlotWalAtRisk",
        "OutboxRelaySweepFoundRows",
    ];
    let set = |names: &[&[&str]]| -> BTreeSet<String> {
        names
            .iter()
            .flat_map(|n| n.iter().map(|s| (*s).to_owned()))
            .collect()
    };
    assert_eq!(
        alert_names(&rule_spec(POLLING)),
        set(&[&common_alerts, &partitions])
    );
    assert_eq!(
        alert_names(&rule_spec(LOG_TAILING)),
        set(&[&common_alerts, &slot])
    );
    assert_eq!(
        alert_names(&rule_spec(POLLING_UNORDERED)),
        set(&[&common_alerts])
    );
}

#[test]
fn every_alert_fires_on_its_failure_and_is_silent_when_healthy() {
    let mut fired = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for name in ["polling.test.yml", "log_tailing.test.yml"] {
        let fixture = fixtures_dir().join(name);
        let output = promtool_test(&fixture);
        assert!(
            output.status.success(),
            "promtool test rules {name}: {}",
            common::describe_output(&output)
        );
        // Which alerts the fixture proves firing and proves silent.
        let doc: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
        for test in doc["tests"].as_sequence().unwrap() {
            for case in test["alert_rule_test"].as_sequence().unwrap() {
                let alert = case["alertname"].as_str().unwrap().to_owned();
                if case["exp_alerts"].as_sequence().unwrap().is_empty() {
                    silent.insert(alert);
                } else {
                    fired.insert(alert);
                }
            }
        }
    }
    let mut all = alert_names(&rule_spec(POLLING));
    all.extend(alert_names(&rule_spec(LOG_TAILING)));
    assert_eq!(fired, all, "every alert needs a fixture where it fires");
    assert_eq!(
        silent, all,
        "every alert needs a fixture where it stays silent"
    );
}

#[test]
fn a_fixture_expecting_an_alert_on_healthy_series_makes_promtool_fail() {
    let output =
        promtool_test(&fixtures_dir().join("negative/healthy_expects_backlog_alert.test.yml"));
    let described = common::describe_output(&output);
    assert!(
        !output.status.success(),
        "promtool accepted it: {described}"
    );
    // Failing for the right reason: the expected alert is missing, not a broken file.
    assert!(
        described.contains("OutboxRelayBacklogHigh") && described.contains("FAILED"),
        "{described}"
    );
}

/// GitHub's anchor of a Markdown heading: lowercase, spaces to dashes, punctuation gone.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_alert_has_for_severity_annotations_and_a_runbook_section() {
    let runbooks =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/runbooks.md"))
            .unwrap();
    let anchors: BTreeSet<String> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(anchor)
        .collect();
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md"))
            .unwrap();
    for yaml in [POLLING, LOG_TAILING] {
        for rule in rules_of(&rule_spec(yaml)) {
            let alert = rule["alert"].as_str().unwrap();
            assert!(rule["for"].is_string(), "{rule}");
            let severity = rule["labels"]["severity"].as_str().unwrap();
            assert!(["critical", "warning"].contains(&severity), "{rule}");
            assert_eq!(rule["labels"]["relay_namespace"], "shop", "{rule}");
            assert_eq!(rule["labels"]["relay_name"], "orders", "{rule}");
            for key in ["summary", "description"] {
                let text = rule["annotations"][key].as_str().unwrap();
                assert!(text.contains("shop/orders"), "{key} of {alert}: {text}");
            }
            let url = rule["annotations"]["runbook_url"].as_str().unwrap();
            let fragment = url
                .strip_prefix(&format!("{}#", default_runbook_base_url()))
                .unwrap_or_else(|| panic!("{alert}: runbook_url {url} is not in docs/runbooks.md"));
            assert!(
                anchors.contains(fragment),
                "{alert}: docs/runbooks.md has no section #{fragment} (sections: {anchors:?})"
            );
            assert!(
                readme.contains(alert),
                "docs/metrics.md does not list {alert}"
            );
        }
    }
}
