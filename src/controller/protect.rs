//! While a relay owns a replication slot, the Secrets that reach its database (the
//! connection URL, the CA, the client certificate and key) carry a finalizer of the
//! relay's, `outbox.dev/slot-of-<relay>`. So a Secret deleted first — `kubectl delete
//! namespace`, a GitOps prune in any order, a hand-made mistake — stays readable until
//! the relay's finalizer has dropped the slot, and only then goes. The operator never
//! changes anything else of a Secret; the finalizer is added and removed with JSON
//! patches guarded by a test, so no other writer's change is lost.

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use super::Context;
use crate::api::OutboxRelay;

/// The finalizer a relay puts on the Secrets of its slot's database.
pub(super) fn finalizer(relay: &OutboxRelay) -> String {
    finalizer_of(&relay.name_any())
}

/// [`finalizer`] by the relay's name (relay names are DNS labels of at most 50
/// characters, so the name part stays within 63).
pub(super) fn finalizer_of(name: &str) -> String {
    format!("outbox.dev/slot-of-{name}")
}

/// The names of the Secrets the raw spec reads to reach the database, sorted (cleanup
/// reads them without a parse).
pub(super) fn database_secrets(relay: &OutboxRelay) -> Vec<String> {
    let pg = relay.spec.database.postgres();
    let mut names: Vec<String> = std::iter::once(pg.connection_secret_ref.name.clone())
        .chain(pg.tls_refs().into_iter().flatten().map(|r| r.name))
        .collect();
    // A CloudNativePG Cluster's own Secrets are garbage-collected with it and made
    // again by it: a finalizer there would hold them (and a new Cluster of that name)
    // after the Cluster goes, while the slot goes with the Cluster's databases anyway.
    if let Some(reference) = &relay.spec.database.database_ref {
        let cluster = &reference.name;
        let owned = [
            format!("{cluster}-app"),
            format!("{cluster}-superuser"),
            format!("{cluster}-ca"),
        ];
        names.retain(|n| !owned.contains(n));
    }
    names.sort();
    names.dedup();
    names
}

fn api(relay: &OutboxRelay, ctx: &Context) -> Api<Secret> {
    Api::namespaced(ctx.client.clone(), &relay.namespace().unwrap_or_default())
}

/// Puts the relay's finalizer on each named Secret that exists and lacks it.
pub(super) async fn protect(
    relay: &OutboxRelay,
    names: &[String],
    ctx: &Context,
) -> Result<(), kube::Error> {
    let api = api(relay, ctx);
    let ours = finalizer(relay);
    for name in names {
        let Some(secret) = api.get_opt(name).await? else {
            continue;
        };
        let finalizers = secret.finalizers();
        if finalizers.contains(&ours) || secret.metadata.deletion_timestamp.is_some() {
            // A Secret being deleted takes no new finalizer; one it has keeps it.
            continue;
        }
        let version = secret.resource_version().unwrap_or_default();
        let ops = json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": version},
            add_finalizer_op(finalizers, &ours),
        ]);
        json_patch(&api, name, ops).await?;
    }
    Ok(())
}

/// Takes the relay's finalizer off each named Secret that has it.
pub(super) async fn release(
    relay: &OutboxRelay,
    names: &[String],
    ctx: &Context,
) -> Result<(), kube::Error> {
    let api = api(relay, ctx);
    let ours = finalizer(relay);
    for name in names {
        let Some(secret) = api.get_opt(name).await? else {
            continue;
        };
        let Some(index) = secret.finalizers().iter().position(|f| *f == ours) else {
            continue;
        };
        let path = format!("/metadata/finalizers/{index}");
        let ops = json!([
            {"op": "test", "path": path, "value": ours},
            {"op": "remove", "path": path},
        ]);
        json_patch(&api, name, ops).await?;
    }
    Ok(())
}

/// The JSON-patch operation that appends finalizer `name` to an object whose
/// finalizers are `current` (an empty list is not stored, so it is created).
pub(super) fn add_finalizer_op(current: &[String], name: &str) -> serde_json::Value {
    if current.is_empty() {
        json!({"op": "add", "path": "/metadata/finalizers", "value": [name]})
    } else {
        json!({"op": "add", "path": "/metadata/finalizers/-", "value": name})
    }
}

/// Sends JSON-patch `ops` to object `name`; returns the object as patched.
pub(super) async fn json_patch<K>(
    api: &Api<K>,
    name: &str,
    ops: serde_json::Value,
) -> Result<K, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let ops: json_patch::Patch = serde_json::from_value(ops).map_err(kube::Error::SerdeError)?;
    api.patch(name, &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_database_secret_is_protected_once_and_the_finalizer_is_a_valid_name() {
        let relay: OutboxRelay = serde_yaml::from_str(
            "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: a-relay-name-of-fifty-characters-xxxxxxxxxxxxxxxxx, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: db}, sslMode: verify-full, caSecretRef: {name: pg-tls, key: ca.crt}, clientCertSecretRef: {name: pg-tls, key: tls.crt}, clientKeySecretRef: {name: pg-tls, key: tls.key}}}
  mode: {logTailing: {}}
  broker: {nats: {url: \"nats://n:4222\", credentialsSecretRef: {name: nats}}}
",
        )
        .unwrap();
        assert_eq!(database_secrets(&relay), vec!["db", "pg-tls"]);
        let name = finalizer(&relay);
        let (prefix, rest) = name.split_once('/').unwrap();
        assert_eq!(prefix, "outbox.dev");
        assert!(rest.len() <= 63, "{rest}");
    }

    #[test]
    fn a_cloudnativepg_clusters_own_secrets_are_not_held() {
        let relay = |database_ref: &str| -> OutboxRelay {
            serde_yaml::from_str(&format!(
                "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {{name: r, namespace: shop}}
spec:
  database: {{databaseRef: {database_ref}}}
  mode: {{logTailing: {{}}}}
  broker: {{nats: {{url: \"nats://n:4222\"}}}}
"
            ))
            .unwrap()
        };
        assert!(database_secrets(&relay("{name: pg}")).is_empty());
        assert_eq!(
            database_secrets(&relay(
                "{name: pg, userSecretName: relay-role, caSecretName: my-ca}"
            )),
            vec!["my-ca", "relay-role"]
        );
    }
}
