//! Smoke test: the rig's helm and promtool accept valid input and reject broken input.

use crate::common;

use std::fs;
use std::path::Path;

const CHART_YAML: &str =
    "apiVersion: v2\nname: smoke\nversion: 0.1.0\ndescription: smoke-test chart\n";
const VALUES_YAML: &str = "greeting: hello\n";
const GOOD_TEMPLATE: &str = "\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-smoke
data:
  greeting: {{ .Values.greeting | quote }}
";
// An unclosed action: the template does not parse.
const BROKEN_TEMPLATE: &str = "\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name
";

fn write_chart(dir: &Path, template: &str) {
    fs::create_dir_all(dir.join("templates")).unwrap();
    fs::write(dir.join("Chart.yaml"), CHART_YAML).unwrap();
    fs::write(dir.join("values.yaml"), VALUES_YAML).unwrap();
    fs::write(dir.join("templates/configmap.yaml"), template).unwrap();
}

#[test]
fn helm_lint_passes_a_valid_chart_and_fails_a_broken_one() {
    let helm = common::Rig::load().helm();
    let tmp = tempfile::tempdir().unwrap();

    let good = tmp.path().join("good");
    write_chart(&good, GOOD_TEMPLATE);
    let output = common::run_tool(helm, &["lint", good.to_str().unwrap()]);
    assert!(
        output.status.success(),
        "helm lint rejected a valid chart:\n{}",
        common::describe_output(&output)
    );

    let broken = tmp.path().join("broken");
    write_chart(&broken, BROKEN_TEMPLATE);
    let output = common::run_tool(helm, &["lint", broken.to_str().unwrap()]);
    let report = common::describe_output(&output);
    assert!(
        !output.status.success(),
        "helm lint accepted a broken chart:\n{report}"
    );
    assert!(
        report.contains("parse error"),
        "helm lint failed for another reason:\n{report}"
    );
}

const GOOD_RULES: &str = "\
groups:
  - name: smoke
    rules:
      - alert: OutboxBacklogHigh
        expr: outbox_backlog_rows > 10000
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: Outbox backlog is high
";
// Invalid PromQL: an unbalanced parenthesis.
const BROKEN_RULES: &str = "\
groups:
  - name: smoke
    rules:
      - alert: OutboxBacklogHigh
        expr: sum(outbox_backlog_rows > 10000
        for: 5m
";

#[test]
fn promtool_checks_rules() {
    let promtool = common::Rig::load().promtool();
    let tmp = tempfile::tempdir().unwrap();

    let good = tmp.path().join("good.yaml");
    fs::write(&good, GOOD_RULES).unwrap();
    let output = common::run_tool(promtool, &["check", "rules", good.to_str().unwrap()]);
    assert!(
        output.status.success(),
        "promtool rejected valid rules:\n{}",
        common::describe_output(&output)
    );

    let broken = tmp.path().join("broken.yaml");
    fs::write(&broken, BROKEN_RULES).unwrap();
    let output = common::run_tool(promtool, &["check", "rules", broken.to_str().unwrap()]);
    let report = common::describe_output(&output);
    assert!(
        !output.status.success(),
        "promtool accepted invalid rules:\n{report}"
    );
    assert!(
        report.contains("parse error"),
        "promtool failed for another reason:\n{report}"
    );
}
