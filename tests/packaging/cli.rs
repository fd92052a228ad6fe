//! The command-line surface: every role is a subcommand, and usage errors are reported as such.

use std::process::{Command, Output};

fn outbox_operator(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_outbox-operator"))
        .args(args)
        // `relay --config` falls back to this variable; the tests must not see one.
        .env_remove("OUTBOX_RELAY_CONFIG")
        .output()
        .expect("the outbox-operator binary runs")
}

#[test]
fn help_lists_every_subcommand() {
    let output = outbox_operator(&["--help"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "--help failed: {output:?}");
    for subcommand in [
        "controller",
        "relay",
        "crd",
        "render",
        "check",
        "audit",
        "dead-letters",
        "replay",
        "kubectl",
    ] {
        assert!(
            stdout
                .lines()
                .any(|line| line.trim_start().starts_with(subcommand)),
            "--help does not list `{subcommand}`:\n{stdout}"
        );
    }
}

#[test]
fn relay_without_config_is_a_usage_error() {
    let output = outbox_operator(&["relay"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        stderr.contains("--config"),
        "stderr does not name --config:\n{stderr}"
    );
}

#[test]
fn check_without_a_database_url_names_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("relay.yaml");
    std::fs::copy(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/orders-relay.yaml"),
        &manifest,
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-operator"))
        .args(["check", "-f"])
        .arg(&manifest)
        .env_remove("OUTBOX_DATABASE_URL")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        stderr.contains("set OUTBOX_DATABASE_URL to the database URL"),
        "{stderr}"
    );
}

#[test]
fn check_of_a_missing_manifest_names_it() {
    let output = outbox_operator(&["check", "-f", "/nonexistent/relay.yaml"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(stderr.contains("/nonexistent/relay.yaml"), "{stderr}");
}

#[test]
fn relay_with_a_missing_config_file_names_it() {
    let output = outbox_operator(&["relay", "--config", "/nonexistent/relay.yaml"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        stderr.contains("cannot read relay config /nonexistent/relay.yaml"),
        "{stderr}"
    );
}

#[test]
fn audit_of_a_relay_that_keeps_nothing_says_so_before_connecting() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("relay.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: db}}}
  mode: {polling: {afterPublish: delete}}
  broker: {nats: {url: \"nats://n:4222\"}}
",
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-operator"))
        .args(["audit", "-f"])
        .arg(&manifest)
        // Never reached: the verdict comes before any connection.
        .env("OUTBOX_DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        stderr.contains("OutboxRelay shop/orders") && stderr.contains("keeps no archive"),
        "{stderr}"
    );
}
