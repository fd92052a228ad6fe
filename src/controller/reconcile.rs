//! One reconcile of one OutboxRelay: finalizer, validate and build, check Secrets, apply
//! the children, delete the ones no longer built, write status and Events.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tracing::{debug, info, warn};

use super::database::{self, Cleanup};
use super::status::{CONDITION_READY, Cond, differs, find, merge};
use super::triggers::ChildKey;
use super::{Context, Error, FINALIZER};
use super::{decide, observe, protect};
use crate::api::{FallbackStatus, OutboxRelay, OutboxRelayStatus, SlotStatus};
use crate::resources::{
    ChildKind, Desired, FIELD_MANAGER, annotate_secret_versions, build, children_selector,
    relay_object_name,
};

/// How soon to look again when a referenced Secret is missing: Secrets are not watched
/// (that would cache every Secret's data in the operator), so this bounds the delay
/// between a user creating the Secret and the relay starting.
const SECRET_RETRY: Duration = Duration::from_secs(15);
/// Back-off after a failed reconcile.
const ERROR_RETRY: Duration = Duration::from_secs(15);
/// How soon the finalizer looks again while the relay's pods are still stopping.
const CLEANUP_POLL: Duration = Duration::from_secs(2);
/// How soon a switch from polling to log tailing looks again whether the polling relay
/// has published what the new slot cannot stream.
const HANDOVER_POLL: Duration = Duration::from_secs(2);
/// How soon a relay is reconciled again after someone else changed one of its children
/// while it was being applied.
const LOOK_AGAIN: Duration = Duration::from_secs(1);

/// The controller's reconcile function: everything runs inside the finalizer helper.
pub(super) async fn reconcile(relay: Arc<OutboxRelay>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Never write without the Lease: the controller stops when it is lost, and this
    // closes the window between losing it and the stop taking effect.
    if !*ctx.leader.borrow() {
        return Ok(Action::await_change());
    }
    let started = Instant::now();
    debug!(generation = ?relay.metadata.generation, "reconcile starts");
    let namespace = relay.namespace().unwrap_or_default();
    let api: Api<OutboxRelay> = Api::namespaced(ctx.client.clone(), &namespace);
    // A new relay gets its finalizer and its children in one pass: kube's helper would
    // add the finalizer and wait for the update to come back before applying anything,
    // a second reconcile of every new relay.
    let relay = match add_finalizer(&api, relay, &ctx).await {
        Ok(relay) => relay,
        Err(err) => {
            ctx.metrics
                .reconciled(started.elapsed(), Some(err.category()));
            return Err(err);
        }
    };
    let result = finalizer(&api, FINALIZER, relay, |event| async {
        match event {
            Finalizer::Apply(relay) => apply(&relay, &ctx).await,
            Finalizer::Cleanup(relay) => cleanup(&relay, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    ctx.metrics.reconciled(
        started.elapsed(),
        result.as_ref().err().map(Error::category),
    );
    result
}

/// `relay` with the cleanup finalizer: as it is when it has it (or is being deleted),
/// else as the API server returns it after the finalizer was added. The patch tests the
/// list it extends, so a concurrent change to the finalizers fails it instead of being
/// overwritten; then the relay is read afresh (the cache may lag behind the API server)
/// and the patch tried once more.
async fn add_finalizer(
    api: &Api<OutboxRelay>,
    mut relay: Arc<OutboxRelay>,
    ctx: &Context,
) -> Result<Arc<OutboxRelay>, Error> {
    let mut attempts = 0;
    loop {
        if relay.metadata.deletion_timestamp.is_some()
            || relay.finalizers().iter().any(|f| f == FINALIZER)
        {
            return Ok(relay);
        }
        // The list extended, as it was (an absent one reads as null).
        let current = relay
            .metadata
            .finalizers
            .as_deref()
            .filter(|f| !f.is_empty());
        let ops = json!([
            {"op": "test", "path": "/metadata/finalizers", "value": current},
            protect::add_finalizer_op(relay.finalizers(), FINALIZER),
        ]);
        ctx.metrics.wrote();
        attempts += 1;
        match protect::json_patch(api, &relay.name_any(), ops).await {
            Ok(updated) => return Ok(Arc::new(updated)),
            Err(kube::Error::Api(status)) if status.is_invalid() && attempts < 2 => {
                relay = Arc::new(api.get(&relay.name_any()).await?);
            }
            Err(err) => return Err(err.into()),
        }
    }
}

/// Logs, counts (in `reconcile`) and retries a failed reconcile.
pub(super) fn error_policy(relay: Arc<OutboxRelay>, error: &Error, _ctx: Arc<Context>) -> Action {
    if error.category() == "cleanup_pending" {
        // Not a failure: the finalizer waits for the relay to stop or the database to
        // come back, and looks again soon.
        info!(
            relay = %relay.name_any(),
            namespace = %relay.namespace().unwrap_or_default(),
            reason = %error,
            "cleanup not finished yet; looking again"
        );
        return Action::requeue(CLEANUP_POLL);
    }
    warn!(
        relay = %relay.name_any(),
        namespace = %relay.namespace().unwrap_or_default(),
        category = error.category(),
        error = %error,
        "reconcile failed; retrying"
    );
    Action::requeue(ERROR_RETRY)
}

/// One reconcile as a pipeline: parse → observe (reads only) → decide (pure) → apply
/// (the SQL the decision planned, then the children) → status.
async fn apply(relay: &OutboxRelay, ctx: &Context) -> Result<Action, Error> {
    let mut last_slot = relay.status.as_ref().and_then(|s| s.slot.clone());
    // Whether the slot existed or was lost, as this controller last wrote it when the
    // cache does not hold that write yet: a loss is recorded once, with one time.
    if let Some(written) = ctx
        .written_status
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&relay.uid().unwrap_or_default())
        .and_then(|s| s.slot.clone())
        && let Some(slot) = last_slot.as_mut().filter(|s| s.name == written.name)
    {
        slot.existed = written.existed;
        slot.lost = written.lost;
        slot.location = written.location;
        slot.left_behind = written.left_behind;
    }
    // The fall back as last recorded: this controller's own last write when the cache
    // does not hold it yet (a pass triggered by a child right after the write).
    let recorded_fallback = ctx
        .written_status
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&relay.uid().unwrap_or_default())
        .map_or_else(
            || relay.status.as_ref().and_then(|s| s.fallback.clone()),
            |s| s.fallback.clone(),
        );
    // Parse, then hold the spec to what this install allows.
    let parsed = crate::spec::parse(relay).and_then(|valid| {
        let refused = ctx.policy.check(relay);
        if refused.is_empty() {
            Ok(valid)
        } else {
            Err(crate::spec::Problems(refused))
        }
    });
    let mut built = match &parsed {
        Ok(valid) => Some(build(valid, &ctx.options)?),
        Err(_) => None,
    };
    // While a relay tails the log (or status shows a slot), the Secrets that reach its
    // database carry the relay's finalizer, so the finalizer below can always connect
    // to drop the slot. Protected before observing: the finalizer changes the Secrets'
    // resourceVersion, which the pod template records (a rotated Secret rolls the pods),
    // and it must not read as a rotation.
    let wants_slot = last_slot.is_some()
        || parsed
            .as_ref()
            .is_ok_and(|v| v.mode.log_tailing().is_some());
    let protected = if wants_slot {
        protect::database_secrets(relay)
    } else {
        Vec::new()
    };
    let recorded: Vec<String> = last_slot
        .as_ref()
        .map(|s| s.protected_secrets.clone())
        .unwrap_or_default();
    if wants_slot && recorded != protected {
        protect::protect(relay, &protected, ctx).await?;
    }
    let observed = match (&parsed, &built) {
        (Ok(valid), Some(desired)) => {
            Some(observe::observe(relay, valid, desired, recorded_fallback.clone(), ctx).await?)
        }
        _ => None,
    };
    // A rotated Secret rolls the pods (they read Secret values only at start).
    if let (Some(desired), Some(observed)) = (built.as_mut(), observed.as_ref()) {
        annotate_secret_versions(&mut desired.deployment, &observed.secrets.versions);
    }
    let owner = database::owner(relay);
    let mut decision = decide::decide(
        parsed.as_ref(),
        &owner,
        last_slot.as_ref(),
        observed.as_ref(),
    );
    // The coverage baseline as decided now, for relays that start from here on.
    if let Some(desired) = built.as_mut() {
        crate::resources::with_coverage_baseline(
            &mut desired.config_map,
            decision
                .slot
                .as_ref()
                .and_then(|s| s.coverage_baseline.as_deref()),
        );
    }

    // Secrets that lost the finalizer (removed by hand) get it back.
    let finalized: Vec<String> = observed
        .as_ref()
        .map(|o| o.secrets.finalized.clone())
        .unwrap_or_default();
    let missing: Vec<String> = protected
        .iter()
        .filter(|n| !finalized.contains(n))
        .cloned()
        .collect();
    if observed.is_some() && !missing.is_empty() {
        protect::protect(relay, &missing, ctx).await?;
    }
    // Secrets protected before but no longer needed (a mode switched to polling, a
    // Secret no longer named) are released.
    let mut no_longer: Vec<String> = recorded
        .iter()
        .chain(finalized.iter())
        .filter(|n| !protected.contains(n))
        .cloned()
        .collect();
    no_longer.sort();
    no_longer.dedup();

    // Apply: the database objects first, so nothing is half-created when they fail;
    // then the children.
    let dropped: Vec<(String, String)> = decision
        .provision
        .iter()
        .filter_map(|a| match a {
            crate::postgres::provision::Action::DropOwned {
                slot, publication, ..
            } => Some((slot.clone(), publication.clone())),
            _ => None,
        })
        .collect();
    let drops_over_budget = decision.provision.iter().any(|a| {
        matches!(
            a,
            crate::postgres::provision::Action::DropSlotOverBudget { .. }
        )
    });
    match database::provision(relay, &decision.provision, ctx).await {
        Err(err) => {
            warn!(relay = %relay.name_any(), error = %err, "creating or dropping the slot or publication failed");
            decision = decide::provisioning_failed(decision, last_slot.as_ref(), &err);
        }
        Ok(()) => {
            if drops_over_budget
                && let decide::FallbackWrite::Set(fallback) = &mut decision.fallback
            {
                fallback.slot_dropped = true;
                let slot = decision
                    .slot
                    .as_ref()
                    .map(|s| s.name.clone())
                    .unwrap_or_default();
                ctx.publish(
                    relay,
                    EventType::Normal,
                    "SlotDroppedOverBudget",
                    format!(
                        "no pod tails the log any more: dropped replication slot {slot}, which retained {} bytes of WAL, past spec.mode.logTailing.maxRetainedWal; the relay polls until it returns to log tailing",
                        fallback.retained_wal_bytes
                    ),
                )
                .await;
            }
            for (slot, publication) in dropped {
                ctx.publish(
                    relay,
                    EventType::Normal,
                    "SlotDropped",
                    format!(
                        "the relay polls now and no pod tails the log: dropped replication slot {slot} and publication {publication} (those the operator created)"
                    ),
                )
                .await;
            }
        }
    }
    if decision.take_snapshot {
        // The slot exists now: every transaction committed before it is visible in a
        // snapshot taken from here on.
        match database::handover_snapshot(relay, ctx).await {
            Ok(snapshot) => {
                let runs_polling = observed.as_ref().is_some_and(|o| o.children.runs_polling);
                if let Some(slot) = decision.slot.as_mut() {
                    if runs_polling {
                        ctx.publish(
                            relay,
                            EventType::Normal,
                            "SwitchingToLogTailing",
                            format!(
                                "replication slot {} exists; the polling relay keeps running until every row committed before it is published, then log tailing takes over",
                                slot.name
                            ),
                        )
                        .await;
                    }
                    slot.handover_snapshot = Some(snapshot);
                }
            }
            Err(err) => {
                warn!(relay = %relay.name_any(), error = %err, "taking the handover snapshot failed; retrying");
            }
        }
    }
    // The fall back to polling past the WAL budget, and the return: an Event each and
    // the switch counted.
    let was_falling_back = recorded_fallback.is_some();
    let tails = parsed
        .as_ref()
        .is_ok_and(|v| v.mode.log_tailing().is_some());
    let (namespace, name) = (relay.namespace().unwrap_or_default(), relay.name_any());
    match &decision.fallback {
        decide::FallbackWrite::Set(fallback) if !was_falling_back => {
            ctx.metrics.switched(&namespace, &name, "polling");
            ctx.publish(
                relay,
                EventType::Warning,
                "FellBackToPolling",
                format!(
                    "the replication slot retained {} bytes of WAL, past spec.mode.logTailing.maxRetainedWal: a polling relay replaces the log-tailing one, and the slot is dropped once no pod tails the log",
                    fallback.retained_wal_bytes
                ),
            )
            .await;
        }
        decide::FallbackWrite::Clear if was_falling_back && tails => {
            ctx.metrics.switched(&namespace, &name, "logTailing");
            let why = if parsed
                .as_ref()
                .is_ok_and(|v| v.mode.log_tailing().is_some_and(|l| l.budget.is_some()))
            {
                "the backlog is drained"
            } else {
                "spec.mode.logTailing.maxRetainedWal was removed"
            };
            ctx.publish(
                relay,
                EventType::Normal,
                "ReturningToLogTailing",
                format!("{why}: the replication slot is created again while the polling relay runs, and log tailing takes over once every row committed before it is published"),
            )
            .await;
        }
        _ => {}
    }
    let falling_back = matches!(decision.fallback, decide::FallbackWrite::Set(_));
    // Rows committed before a new slot are published by the back-fill relay first; the
    // same polling relay runs while a relay falls back past its WAL budget.
    if decision.backfill
        && let (Ok(valid), Some(observed)) = (&parsed, &observed)
        && let Some(fill) = valid.backfill()
    {
        let mut desired = build(&fill, &ctx.options)?;
        annotate_secret_versions(&mut desired.deployment, &observed.secrets.versions);
        if !falling_back {
            ctx.publish(
                relay,
                EventType::Normal,
                "BackfillingBeforeLogTailing",
                "rows committed before the replication slot was created are in the table: a polling relay publishes them first, then log tailing takes over".to_owned(),
            )
            .await;
        }
        built = Some(desired);
    }
    if decision.exclusive_rollout
        && let Some(desired) = built.as_mut()
    {
        crate::resources::roll_out_exclusively(&mut desired.deployment);
    }
    for note in &decision.events {
        let type_ = if note.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        ctx.publish(relay, type_, note.reason, note.message.clone())
            .await;
    }
    let lost = decision.slot.as_ref().is_some_and(|s| s.lost.is_some());
    ctx.metrics.set_slot_lost(&namespace, &name, Some(lost));
    let handing_over = decision.apply_children
        && last_slot
            .as_ref()
            .is_some_and(|s| s.handover_snapshot.is_some())
        && observed.as_ref().is_some_and(|o| o.children.runs_polling);
    let mut others_meanwhile = false;
    if decision.apply_children
        && let (Some(desired), Some(observed)) = (&built, &observed)
    {
        others_meanwhile = apply_if_changed(relay, ctx, desired, observed).await?;
        if handing_over {
            ctx.publish(
                relay,
                EventType::Normal,
                "LogTailingStarted",
                "every row committed before the slot was created is published: the log-tailing relay replaces the polling relay".to_owned(),
            )
            .await;
        }
    }
    if let Some(slot) = decision.slot.as_mut() {
        slot.protected_secrets = protected;
    }
    let before_status = Instant::now();
    let fallback = match decision.fallback {
        decide::FallbackWrite::Keep => recorded_fallback,
        decide::FallbackWrite::Set(fallback) => Some(fallback),
        decide::FallbackWrite::Clear => None,
    };
    update_status(relay, ctx, decision.conditions, decision.slot, fallback).await?;
    debug!(
        status_ms = before_status.elapsed().as_millis(),
        "status updated"
    );
    protect::release(relay, &no_longer, ctx).await?;
    if others_meanwhile {
        // Someone else changed a child while this pass applied it (kube-controller-
        // manager writing a Deployment's status, say): the event that would have
        // reconciled the relay was taken for this pass's own, so look again now.
        debug!("a child changed while it was applied; looking again");
        return Ok(Action::requeue(LOOK_AGAIN));
    }
    Ok(match decision.next {
        decide::Next::AwaitChange => Action::await_change(),
        decide::Next::SecretRetry => Action::requeue(SECRET_RETRY),
        decide::Next::Refresh => Action::requeue(ctx.recheck_after()),
        decide::Next::Soon => Action::requeue(HANDOVER_POLL.min(ctx.status_interval)),
    })
}

/// What was last applied for one relay.
pub(super) struct Applied {
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
async fn apply_if_changed(
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

/// Writes the fields of status a reconcile decides — observed generation, conditions,
/// mode, broker and the slot's and publication's names — when one of them changed
/// (ignoring timestamps), and records an Event when the `Ready` condition changed its
/// status or reason. The measured figures (backlog, oldest age, slot lag) are the
/// figures task's, under a field manager of its own (`figures.rs`); this apply never
/// names them, so server-side apply leaves them alone.
async fn update_status(
    relay: &OutboxRelay,
    ctx: &Context,
    conditions: Vec<Cond>,
    slot: Option<SlotStatus>,
    fallback: Option<FallbackStatus>,
) -> Result<(), Error> {
    // The cache may not hold this controller's last status write yet (a pass triggered
    // by a child right after it): what it wrote last is what the API server holds,
    // unless someone changed it since, which the cache then shows. So both are compared.
    let uid = relay.uid().unwrap_or_default();
    let last = ctx
        .written_status
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&uid)
        .cloned();
    let cached = relay.status.as_ref();
    let current = last.as_ref().or(cached);
    let generation = relay.metadata.generation;
    let merged = merge(
        current.map_or(&[][..], |s| &s.conditions[..]),
        &conditions,
        generation,
        Timestamp::now(),
    );
    let desired = OutboxRelayStatus {
        observed_generation: generation,
        conditions: merged,
        mode: relay.spec.mode.get().map(|m| m.name().to_owned()),
        broker: relay.spec.broker.get().map(|b| b.name().to_owned()),
        slot: slot.map(|s| SlotStatus {
            name: s.name,
            publication: s.publication,
            protected_secrets: s.protected_secrets,
            handover_snapshot: s.handover_snapshot,
            existed: s.existed,
            lost: s.lost,
            coverage_baseline: s.coverage_baseline,
            location: s.location,
            left_behind: s.left_behind,
            ..SlotStatus::default()
        }),
        fallback,
        ..OutboxRelayStatus::default()
    };
    let event = ready_transition(current, &conditions);
    let slot_names = |s: Option<&OutboxRelayStatus>| {
        s.and_then(|s| s.slot.as_ref()).map(|s| {
            (
                s.name.clone(),
                s.publication.clone(),
                s.protected_secrets.clone(),
                s.handover_snapshot.clone(),
                s.existed,
                s.lost.clone(),
                s.coverage_baseline.clone(),
                s.location.clone(),
                s.left_behind.clone(),
            )
        })
    };
    let stale = |s: Option<&OutboxRelayStatus>| {
        differs(s, &desired)
            || slot_names(s) != slot_names(Some(&desired))
            || s.and_then(|s| s.fallback.as_ref()) != desired.fallback.as_ref()
    };
    if stale(current) || stale(cached) {
        let namespace = relay.namespace().unwrap_or_default();
        let api: Api<OutboxRelay> = Api::namespaced(ctx.client.clone(), &namespace);
        let patch = json!({
            "apiVersion": OutboxRelay::api_version(&()),
            "kind": OutboxRelay::kind(&()),
            "status": desired,
        });
        ctx.metrics.wrote();
        api.patch_status(
            &relay.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
        ctx.written_status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(uid, desired);
    }
    if let Some((type_, reason, note)) = event {
        ctx.publish(relay, type_, reason, note).await;
    }
    Ok(())
}

/// An Event for a change of the `Ready` condition's status or reason. Not for a new
/// relay whose pods are starting (no `Ready` before, now `RelayUnavailable`): that is
/// where every relay begins, and an Event for each is a write apiece when many are
/// created at once.
fn ready_transition(
    current: Option<&OutboxRelayStatus>,
    conditions: &[Cond],
) -> Option<(EventType, &'static str, String)> {
    let new = conditions.iter().find(|c| c.type_ == CONDITION_READY)?;
    let status = if new.status { "True" } else { "False" };
    let old = find(current, CONDITION_READY);
    let unchanged = old.is_some_and(|old| old.status == status && old.reason == new.reason);
    if unchanged || (old.is_none() && new.reason == "RelayUnavailable") {
        return None;
    }
    let type_ = if new.status || new.reason == "RelayUnavailable" || new.reason == "ScaledToZero" {
        EventType::Normal
    } else {
        EventType::Warning
    };
    Some((type_, new.reason, new.message.clone()))
}

/// Cleanup before the OutboxRelay goes. Children need nothing (garbage collection
/// removes them through their owner references). For log tailing the relay is stopped
/// first (its Deployment deleted, then waiting until its pods are gone), so that no
/// walsender streams the slot, and then the slot and publication the operator created
/// are dropped. Tolerates apply never having run; never blocks on an invalid spec.
async fn cleanup(relay: &OutboxRelay, ctx: &Context) -> Result<Action, Error> {
    if let Some(target) = database::cleanup_target(relay) {
        stop_relay(relay, ctx).await?;
        let done = if database::abandons_slot(relay) {
            Cleanup::Done(
                EventType::Warning,
                "SlotAbandoned",
                format!(
                    "replication slot {} and publication {} are left behind as annotation {} asks; they retain WAL on the database server until dropped by hand (docs/runbooks.md, orphaned slot)",
                    target.slot,
                    target.publication,
                    database::ABANDON_SLOT_ANNOTATION
                ),
            )
        } else {
            database::drop_external(relay, &target, ctx).await?
        };
        match done {
            Cleanup::Done(type_, reason, note) => {
                info!(relay = %relay.name_any(), reason, note = %note, "cleanup in PostgreSQL done");
                ctx.publish(relay, type_, reason, note).await;
            }
            Cleanup::Retry(message) => {
                ctx.publish(
                    relay,
                    EventType::Warning,
                    "CleanupRetrying",
                    message.clone(),
                )
                .await;
                return Err(Error::CleanupBlocked(message));
            }
        }
    }
    // The slot is gone (or abandoned): its Secrets may go too.
    let mut names = protect::database_secrets(relay);
    names.extend(
        relay
            .status
            .as_ref()
            .and_then(|s| s.slot.as_ref())
            .map(|s| s.protected_secrets.clone())
            .unwrap_or_default(),
    );
    protect::release(relay, &names, ctx).await?;
    // Forget the relay's bookkeeping.
    ctx.metrics.set_slot_lost(
        &relay.namespace().unwrap_or_default(),
        &relay.name_any(),
        None,
    );
    if let Some(uid) = relay.uid() {
        ctx.applied
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
        ctx.written_status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
        ctx.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
    }
    ctx.publish(
        relay,
        EventType::Normal,
        "Deleting",
        "finalizer done; child objects are garbage-collected".to_owned(),
    )
    .await;
    Ok(Action::await_change())
}

/// Deletes the relay's Deployment and returns `CleanupPending` until none of its pods is
/// left: only then can no walsender take the slot again.
async fn stop_relay(relay: &OutboxRelay, ctx: &Context) -> Result<(), Error> {
    let namespace = relay.namespace().unwrap_or_default();
    let uid = relay.uid().unwrap_or_default();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let name = relay_object_name(relay);
    if let Some(deployment) = deployments.get_opt(&name).await? {
        let owned = deployment
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.controller == Some(true));
        if owned && deployment.metadata.deletion_timestamp.is_none() {
            info!(relay = %relay.name_any(), deployment = %name, "stopping the relay before dropping its slot");
            ctx.metrics.wrote();
            match deployments.delete(&name, &DeleteParams::background()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(err) => return Err(err.into()),
            }
        }
    }
    let selector = crate::resources::pod_selector(relay);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let left = pods
        .list_metadata(&ListParams::default().labels(&selector))
        .await?
        .items
        .len();
    if left > 0 {
        return Err(Error::CleanupPending(format!(
            "waiting for {left} relay pod(s) to stop before dropping the replication slot"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(ready: &Cond) -> OutboxRelayStatus {
        serde_json::from_value(json!({"conditions": [{
            "type": CONDITION_READY,
            "status": if ready.status { "True" } else { "False" },
            "reason": ready.reason,
            "message": ready.message,
            "lastTransitionTime": "2026-12-04T00:00:00Z"
        }]}))
        .unwrap()
    }

    #[test]
    fn ready_events_mark_transitions_not_the_start_of_every_relay() {
        let starting = Cond::no(
            CONDITION_READY,
            "RelayUnavailable",
            "0 of 2 relay pods available",
        );
        let up = Cond::yes(
            CONDITION_READY,
            "RelayAvailable",
            "2 of 2 relay pods available",
        );
        let invalid = Cond::no(CONDITION_READY, "InvalidSpec", "spec.table.name is empty");
        // A new relay starting: no Event; a new relay refused: a Warning.
        assert_eq!(
            ready_transition(None, std::slice::from_ref(&starting)),
            None
        );
        assert!(matches!(
            ready_transition(None, std::slice::from_ref(&invalid)),
            Some((EventType::Warning, "InvalidSpec", _))
        ));
        // Up, and down again: both are Events; no change: none.
        assert!(matches!(
            ready_transition(Some(&status(&starting)), std::slice::from_ref(&up)),
            Some((EventType::Normal, "RelayAvailable", _))
        ));
        assert!(matches!(
            ready_transition(Some(&status(&up)), std::slice::from_ref(&starting)),
            Some((EventType::Normal, "RelayUnavailable", _))
        ));
        assert_eq!(
            ready_transition(Some(&status(&up)), std::slice::from_ref(&up)),
            None
        );
    }
}
