//! Applying a relay's children (ConfigMap, Deployment, Service, monitoring objects) with
//! server-side apply, skipping what is already in place, and deleting the ones no
//! longer built.

use std::fmt::Debug;
use std::time::Instant;

use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{debug, info};

use crate::api::OutboxRelay;
use crate::controller::observe;
use crate::controller::triggers::ChildKey;
use crate::controller::{Context, Error};
use crate::resources::{ChildKind, Desired, FIELD_MANAGER, children_selector, relay_object_name};

/// What was last applied for one relay.
pub(in crate::controller) struct Applied {
    /// Hash of every desired child (and whether monitoring objects were included).
    fingerprint: u64,
    /// The Deployment's `metadata.generation` right after the apply.
    deployment_generation: Option<i64>,
    /// The ConfigMap's and the Service's `resourceVersion` right after the apply.
    config_map_version: Option<String>,
    service_version: Option<String>,
    /// When.
    at: Instant,
}

/// A hash of the desired children as they would be sent.
fn fingerprint(desired: &Desired, monitoring: bool) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    monitoring.hash(&mut hasher);
    for kind in ChildKind::ALL {
        serde_json::to_string(&desired.child(kind).ok().flatten())
            .unwrap_or_default()
            .hash(&mut hasher);
    }
    hasher.finish()
}

/// Applies every child unless the same children were applied less than `resync` ago
/// and the ConfigMap, Deployment and Service are still as that apply left them; then
/// three reads (the Deployment for its status, the others' metadata) replace four to
/// six applies and six prune lists.
///
/// Relays are reconciled every status interval to refresh their figures; re-applying
/// and re-listing every child each time cost the API server some 600 requests a second
/// with 500 relays. A changed spec, or a ConfigMap, Deployment or Service edited or
/// deleted by someone else, is applied at once; drift in the PodDisruptionBudget,
/// ServiceMonitor or PrometheusRule is repaired within `resync`.
pub(super) async fn apply_if_changed(
    relay: &OutboxRelay,
    ctx: &Context,
    desired: &Desired,
    observed: &observe::Observed,
) -> Result<bool, Error> {
    let uid = relay.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let monitoring = observed.monitoring;
    let fingerprint = fingerprint(desired, monitoring);
    let seen = &observed.children;
    // The periodic resync (an earlier apply, now older than `resync`) also lists each
    // kind for children by other names (left by an older operator); other passes find
    // children by their names.
    let (up_to_date, full_prune) = ctx
        .applied
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&uid)
        .map_or((false, false), |a| {
            let expired = a.at.elapsed() >= ctx.resync;
            let version = |meta: Option<&kube::api::ObjectMeta>| {
                meta.and_then(|m| m.resource_version.clone())
            };
            let config_map_version = version(seen.config_map.as_ref().map(|c| &c.metadata));
            let service_version = version(seen.service.as_ref().map(|s| &s.metadata));
            let same = a.fingerprint == fingerprint
                && config_map_version.is_some()
                && config_map_version == a.config_map_version
                && service_version.is_some()
                && service_version == a.service_version
                && seen
                    .deployment
                    .as_ref()
                    .is_some_and(|d| d.metadata.generation == a.deployment_generation);
            (same && !expired, expired)
        });
    if up_to_date {
        return Ok(false);
    }
    let before_children = Instant::now();
    let (applied, others_meanwhile) = apply_children(
        relay,
        ctx,
        desired,
        monitoring,
        fingerprint,
        seen,
        full_prune,
    )
    .await?;
    debug!(
        children_ms = before_children.elapsed().as_millis(),
        "children applied"
    );
    ctx.applied
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(uid, applied);
    Ok(others_meanwhile)
}

/// Applies every desired child (whose hash is `fingerprint`) that is not already in
/// place, kind by kind in the catalogue's order, deletes the children no longer built,
/// and returns the versions the apply left, and whether someone else changed a child
/// while it was applied. The Prometheus Operator's kinds are
/// neither applied nor pruned where their CRDs are not served.
///
/// The API server's CPU bounds how fast many relays are reconciled (it used more than
/// one of two cores while 300 relays were created, the controller a fifth of one), so
/// this reads as little as it can: the ConfigMap, Deployment and Service as `seen`
/// already read them; the other kinds by name, and not at all for a relay without a
/// Deployment (a new one). Children no longer built are found by their name (every
/// child is named after the relay); only `full_prune` lists each kind by label, for
/// children an older operator may have named otherwise — a label-selected list walks
/// every object of the kind in the namespace.
#[allow(clippy::too_many_arguments)]
async fn apply_children(
    relay: &OutboxRelay,
    ctx: &Context,
    desired: &Desired,
    monitoring: bool,
    fingerprint: u64,
    seen: &observe::ChildrenSeen,
    full_prune: bool,
) -> Result<(Applied, bool), Error> {
    let namespace = relay.namespace().unwrap_or_default();
    let uid = relay.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let selector = children_selector(relay);
    let mut applied = Applied {
        fingerprint,
        deployment_generation: None,
        config_map_version: None,
        service_version: None,
        at: Instant::now(),
    };
    // Someone else changed a child while it was applied (see `Echoes::wrote`).
    let mut others_meanwhile = false;
    for kind in ChildKind::ALL {
        if kind.needs_monitoring_crds() && !monitoring {
            continue;
        }
        let api: Api<DynamicObject> =
            Api::namespaced_with(ctx.client.clone(), &namespace, &kind.api_resource());
        let wanted = desired.child(kind).map_err(Error::Serialize)?;
        let keep: Vec<String> = wanted
            .as_ref()
            .and_then(|o| o.metadata.name.clone())
            .into_iter()
            .collect();
        if let Some(object) = wanted {
            let object = with_applied_digest(object)?;
            let current = match kind {
                ChildKind::Deployment => dynamic(seen.deployment.as_ref())?,
                ChildKind::ConfigMap => dynamic(seen.config_map.as_ref())?,
                ChildKind::Service => dynamic(seen.service.as_ref())?,
                _ if seen.deployment.is_none() => None,
                _ => api.get_opt(&object.name_any()).await?,
            };
            // Held from before the apply, so that its echo is known even if it comes
            // before the answer; on failure the hold is dropped unanswered.
            let applying = kind.watched().then(|| {
                ctx.echoes
                    .applying(ChildKey::to_apply(kind, &namespace, &object))
            });
            let result = match current {
                Some(current) if in_place(&object, &current) => current,
                _ => apply_child(&api, &object, kind, seen, &uid, ctx).await?,
            };
            if applying.is_some_and(|a| a.wrote(&result)) {
                others_meanwhile = true;
            }
            match kind {
                ChildKind::Deployment => applied.deployment_generation = result.metadata.generation,
                ChildKind::ConfigMap => {
                    applied.config_map_version = result.metadata.resource_version
                }
                ChildKind::Service => applied.service_version = result.metadata.resource_version,
                _ => {}
            }
        }
        if full_prune {
            prune(&api, &selector, &uid, &keep, ctx).await?;
        } else if keep.is_empty() && seen.deployment.is_some() {
            // Built before, not now (a PodDisruptionBudget after scaling to one, a
            // PrometheusRule with alerting turned off): by its name.
            delete_owned(&api, &relay_object_name(relay), &uid, ctx).await?;
        }
    }
    applied.at = Instant::now();
    Ok((applied, others_meanwhile))
}

/// Applies one child; a Service made before relays' Services were headless is made
/// again (its cluster IP cannot be removed).
async fn apply_child(
    api: &Api<DynamicObject>,
    object: &DynamicObject,
    kind: ChildKind,
    seen: &observe::ChildrenSeen,
    uid: &str,
    ctx: &Context,
) -> Result<DynamicObject, Error> {
    match ssa(api, object, ctx).await {
        Err(Error::Kube(kube::Error::Api(status)))
            if kind == ChildKind::Service
                && status.is_invalid()
                && status.message.contains("clusterIP") =>
        {
            // A Service of this relay made before it was headless keeps its
            // cluster IP, which cannot be taken away: made again (only
            // scrapers look at it, through its endpoints). Only the relay's
            // own, exactly as seen; anything else keeps failing the apply.
            let Some(seen) = seen.service.as_ref().filter(|s| owned_by(&s.metadata, uid)) else {
                return Err(Error::Kube(kube::Error::Api(status)));
            };
            info!(child = %object.name_any(), reason = %status.message, "making the relay's Service again: its cluster IP cannot be removed");
            ctx.metrics.wrote();
            let only_as_seen = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: seen.metadata.uid.clone(),
                    resource_version: seen.metadata.resource_version.clone(),
                }),
                ..DeleteParams::background()
            };
            api.delete(&object.name_any(), &only_as_seen).await?;
            ssa(api, object, ctx).await
        }
        other => other,
    }
}

/// A typed object as a [`DynamicObject`], for comparing with what would be applied.
fn dynamic<K: Serialize>(object: Option<&K>) -> Result<Option<DynamicObject>, Error> {
    object
        .map(|o| serde_json::to_value(o).and_then(serde_json::from_value))
        .transpose()
        .map_err(Error::Serialize)
}

/// Deletes child `name` of one kind if the relay (`owner_uid`) owns it.
async fn delete_owned(
    api: &Api<DynamicObject>,
    name: &str,
    owner_uid: &str,
    ctx: &Context,
) -> Result<(), Error> {
    match api.get_opt(name).await? {
        Some(object) if owned_by(&object.metadata, owner_uid) => delete_child(api, name, ctx).await,
        _ => Ok(()),
    }
}

/// Whether the relay with `owner_uid` is the object's controller owner.
fn owned_by(meta: &kube::api::ObjectMeta, owner_uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.uid == owner_uid && o.controller == Some(true))
}

/// Deletes a child the relay no longer needs (already gone is fine).
async fn delete_child<K>(api: &Api<K>, name: &str, ctx: &Context) -> Result<(), Error>
where
    K: Resource + DeserializeOwned + Clone + Debug,
{
    info!(child = %name, "deleting a child the relay no longer needs");
    ctx.metrics.wrote();
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// The annotation on every child holding a digest of the object as last applied, so
/// a controller that has not applied it itself (after a restart, on a resync) can tell
/// an unchanged child from one to apply without writing.
pub const APPLIED_DIGEST_ANNOTATION: &str = "outbox.dev/applied-digest";

/// `object` with [`APPLIED_DIGEST_ANNOTATION`] set to a digest of the rest of it.
fn with_applied_digest(mut object: DynamicObject) -> Result<DynamicObject, Error> {
    use sha2::{Digest, Sha256};
    let text = serde_json::to_vec(&object).map_err(Error::Serialize)?;
    let digest: String = Sha256::digest(&text)
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect();
    object
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(APPLIED_DIGEST_ANNOTATION.to_owned(), digest);
    Ok(object)
}

/// Whether `current` is `desired` as applied and not drifted since: it carries
/// `desired`'s digest (a changed desire, including a field no longer wanted, changes
/// the digest) and still holds every field `desired` sets (someone's edit of a field
/// the operator owns is drift to repair). Fields the API server defaults or other
/// managers own are allowed.
fn in_place(desired: &DynamicObject, current: &DynamicObject) -> bool {
    let digest = |o: &DynamicObject| o.annotations().get(APPLIED_DIGEST_ANNOTATION).cloned();
    if digest(current).is_none() || digest(current) != digest(desired) {
        return false;
    }
    match (serde_json::to_value(desired), serde_json::to_value(current)) {
        (Ok(want), Ok(have)) => crate::resources::holds(&have, &want),
        _ => false,
    }
}

/// Server-side apply under the operator's one field manager. Forced: the operator owns
/// these objects, and a conflicting manual edit is drift to repair.
async fn ssa<K>(api: &Api<K>, object: &K, ctx: &Context) -> Result<K, Error>
where
    K: Resource + Serialize + DeserializeOwned + Clone + Debug,
{
    let name = object
        .meta()
        .name
        .clone()
        .ok_or(Error::MissingField("metadata.name"))?;
    ctx.metrics.wrote();
    let applied = api
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(object),
        )
        .await?;
    Ok(applied)
}

/// Deletes this relay's children of one kind that are not in `keep`. Children are found
/// by label and confirmed by the controller owner reference, so objects someone else
/// labelled alike are never touched.
async fn prune<K>(
    api: &Api<K>,
    selector: &str,
    owner_uid: &str,
    keep: &[String],
    ctx: &Context,
) -> Result<(), Error>
where
    K: Resource + DeserializeOwned + Clone + Debug,
{
    let list = api
        .list_metadata(&ListParams::default().labels(selector))
        .await?;
    for object in list.items {
        let name = object.metadata.name.clone().unwrap_or_default();
        if owned_by(&object.metadata, owner_uid) && !keep.contains(&name) {
            delete_child(api, &name, ctx).await?;
        }
    }
    Ok(())
}
