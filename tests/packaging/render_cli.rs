//! `outbox-operator crd` and `render` as a user runs them: offline, YAML on stdout, a
//! clear line and a failing exit status for a bad manifest.

use std::process::{Command, Output};

fn outbox_operator(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_outbox-operator"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("OUTBOX_RELAY_IMAGE")
        .output()
        .expect("the outbox-operator binary runs")
}

#[test]
fn crd_prints_what_crds_holds() {
    let mut all = Vec::new();
    for (kind, file) in [
        ("OutboxRelay", "crds/outboxrelay.yaml"),
        ("OutboxReplay", "crds/outboxreplay.yaml"),
    ] {
        let output = outbox_operator(&["crd", "--kind", kind]);
        assert!(output.status.success(), "{output:?}");
        let committed =
            std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
                .unwrap();
        assert!(
            String::from_utf8_lossy(&output.stdout) == committed,
            "{file} is out of date: run make crds"
        );
        all.push(committed);
    }
    // Without --kind: every one, as one stream `kubectl apply -f -` takes.
    let output = outbox_operator(&["crd"]);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), all.join("---\n"));
}

#[test]
fn render_prints_every_object_with_the_operators_image() {
    let output = outbox_operator(&["render", "-f", "examples/orders-relay.yaml"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let kinds: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("kind: "))
        .collect();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "ServiceMonitor",
            "PrometheusRule"
        ]
    );
    let image = format!(
        "image: ghcr.io/outbox-operator/outbox-operator:{}",
        env!("CARGO_PKG_VERSION")
    );
    assert!(stdout.contains(&image), "{stdout}");
}

#[test]
fn render_of_a_bad_manifest_names_the_problem_and_prints_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    std::fs::write(
        &path,
        "apiVersion: outbox.dev/v1alpha1\nkind: OutboxRelay\nmetadata: {name: x}\nspec:\n  database: {postgres: {connectionSecretRef: {name: db}}}\n  mode: {polling: {interval: 0s}}\n  broker: {nats: {url: 'nats://n:4222'}}\n",
    )
    .unwrap();
    let output = outbox_operator(&["render", "-f", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(output.stdout.is_empty());
    assert!(
        stderr.contains("spec.mode.polling.interval") && stderr.contains("longer than zero"),
        "{stderr}"
    );
}

#[test]
fn a_debezium_connector_translates_to_a_relay_that_renders() {
    let output = outbox_operator(&[
        "render",
        "--from-debezium",
        "examples/debezium-outbox-connector.json",
        "--bootstrap-servers",
        "kafka.shop.svc:9092",
        "--namespace",
        "shop",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    for line in [
        "  name: orders-outbox",
        "      slotName: orders_outbox",
        "      topic: orders.{aggregateType}",
        "    tombstoneOnEmptyPayload: true",
        "      as: eventType",
    ] {
        assert!(
            stdout.lines().any(|l| l == line),
            "no line `{line}` in:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("# - create Secret orders-outbox-db with key uri = postgres://debezium:<password>@orders-db.shop.svc:5432/orders "),
        "{stdout}"
    );
    assert!(!stdout.contains("secrets/orders-db"), "{stdout}");
    // What it prints is a manifest `render` takes.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.yaml");
    std::fs::write(&path, stdout.as_bytes()).unwrap();
    let rendered = outbox_operator(&["render", "-f", path.to_str().unwrap()]);
    assert!(rendered.status.success(), "{rendered:?}");
    assert!(String::from_utf8_lossy(&rendered.stdout).contains("kind: Deployment"));
    // Kafka Connect keeps the brokers in the worker: without the flag, the reason.
    let output = outbox_operator(&[
        "render",
        "--from-debezium",
        "examples/debezium-outbox-connector.json",
    ]);
    assert!(!output.status.success() && output.stdout.is_empty());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--bootstrap-servers"));
}
