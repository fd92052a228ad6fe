//! Running `outbox-operator` subcommands that read a relay manifest (`audit`, `replay`)
//! the way a user does: the manifest in a file, the database URL in the environment.

use std::process::Output;

use serde_json::json;

/// The manifest of the relay a relay config file describes (its `spec`), as
/// OutboxRelay `shop/orders`.
pub fn manifest_of(relay_yaml: &str) -> serde_json::Value {
    let config: serde_json::Value = serde_yaml::from_str(relay_yaml).unwrap();
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "orders", "namespace": "shop"},
        "spec": config["spec"],
    })
}

/// Runs `outbox-operator <args> -f <manifest file>` with `OUTBOX_DATABASE_URL` set.
pub fn run_with_manifest(
    args: &[&str],
    manifest: &serde_json::Value,
    database_url: &str,
) -> Output {
    run_with_manifest_and_env(args, manifest, database_url, &[])
}

/// [`run_with_manifest`] with more variables (a broker URL the relay reads from one).
pub fn run_with_manifest_and_env(
    args: &[&str],
    manifest: &serde_json::Value,
    database_url: &str,
    env: &[(&str, &str)],
) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.yaml");
    std::fs::write(&file, serde_yaml::to_string(manifest).unwrap()).unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_outbox-operator"))
        .args(args)
        .arg("-f")
        .arg(&file)
        .env("OUTBOX_DATABASE_URL", database_url)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}
