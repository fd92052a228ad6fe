//! The effects of a reconcile, carried out as `decide` planned them: no choice is made
//! here. What an effect returns that matters to the rest of the pass (the SQL's outcome,
//! the hand-over snapshot) goes back through `decide` before anything else runs.

pub(super) mod audit;
mod children;
pub(super) mod deletion;
pub(super) mod replay;
mod status;

pub(super) use children::Applied;

use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use tracing::{debug, warn};

use super::decide::{self, Children, Effects, Next, Note};
use super::observe::Observed;
use super::{Context, Error, database, protect};
use crate::api::{OutboxRelay, SlotStatus};
use crate::resources::{Desired, annotate_secret_versions, build};
use crate::spec::ValidRelay;

/// How soon to look again when a referenced Secret is missing: Secrets are not watched
/// (that would cache every Secret's data in the operator), so this bounds the delay
/// between a user creating the Secret and the relay starting.
const SECRET_RETRY: Duration = Duration::from_secs(15);
/// How soon a switch from polling to log tailing looks again whether the polling relay
/// has published what the new slot cannot stream.
const HANDOVER_POLL: Duration = Duration::from_secs(2);
/// How soon a relay is reconciled again after someone else changed one of its children
/// while it was being applied.
const LOOK_AGAIN: Duration = Duration::from_secs(1);

/// Records each note as an Event.
pub(super) async fn publish(relay: &OutboxRelay, ctx: &Context, notes: &[Note]) {
    for note in notes {
        let type_ = if note.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        ctx.publish(relay, type_, note.reason, note.message.clone())
            .await;
    }
}

/// What a pass carries out: its plan, and what it reads it against.
pub(super) struct Pass<'a> {
    pub relay: &'a OutboxRelay,
    pub valid: Option<&'a ValidRelay>,
    pub observed: Option<&'a Observed>,
    /// The relay's children as its spec builds them.
    pub built: Option<Desired>,
    pub last_slot: Option<&'a SlotStatus>,
}

/// Carries out `plan` (decided from `decision`, which a failed SQL decides again) in
/// order: Secrets, SQL, snapshot, Events, children, status, releases; returns when to
/// look again.
pub(super) async fn carry_out(
    pass: Pass<'_>,
    decision: decide::Decision,
    seen: &decide::Seen<'_>,
    ctx: &Context,
) -> Result<Action, Error> {
    let relay = pass.relay;
    let mut plan = decide::plan(decision.clone(), seen);
    if !plan.restore.is_empty() {
        protect::protect(relay, &plan.restore, ctx).await?;
    }
    let conn = pass.observed.and_then(|o| o.connection.as_ref());
    let outcome = match conn {
        _ if plan.provision.is_empty() => Ok(()),
        Some(conn) => database::provision(relay, conn, &plan.provision, ctx)
            .await
            .map_err(|e| e.to_string()),
        None => Err("the Secrets hold no usable connection".to_owned()),
    };
    plan = match outcome {
        Ok(()) => decide::provisioned(plan),
        Err(err) => {
            warn!(relay = %relay.name_any(), error = %err, "creating or dropping the slot or publication failed");
            decide::plan(
                decide::provisioning_failed(decision, pass.last_slot, &err),
                seen,
            )
        }
    };
    publish(relay, ctx, &plan.provisioned).await;
    if plan.snapshot.is_some() {
        // The slot exists now: every transaction committed before it is visible in a
        // snapshot taken from here on.
        let snapshot = match conn {
            Some(conn) => database::handover_snapshot(relay, conn, ctx)
                .await
                .map_err(|e| e.to_string()),
            None => Err("the Secrets hold no usable connection".to_owned()),
        };
        if let Err(err) = &snapshot {
            warn!(relay = %relay.name_any(), error = %err, "taking the handover snapshot failed; retrying");
        }
        plan = decide::snapshot_taken(plan, snapshot.ok());
        if let Some(Some(note)) = &plan.snapshot {
            publish(relay, ctx, std::slice::from_ref(note)).await;
        }
    }
    let (namespace, name) = (relay.namespace().unwrap_or_default(), relay.name_any());
    if let Some(mode) = plan.switched {
        ctx.metrics.switched(&namespace, &name, mode);
    }
    publish(relay, ctx, &plan.notes).await;
    ctx.metrics
        .set_slot_lost(&namespace, &name, Some(plan.slot_lost));
    let others_meanwhile = apply_children(&pass, &plan, ctx).await?;
    let before_status = Instant::now();
    status::update_status(relay, ctx, &plan).await?;
    debug!(
        status_ms = before_status.elapsed().as_millis(),
        "status updated"
    );
    protect::release(relay, &plan.release, ctx).await?;
    if others_meanwhile {
        // Someone else changed a child while this pass applied it (kube-controller-
        // manager writing a Deployment's status, say): the event that would have
        // reconciled the relay was taken for this pass's own, so look again now.
        debug!("a child changed while it was applied; looking again");
        return Ok(Action::requeue(LOOK_AGAIN));
    }
    Ok(match plan.next {
        Next::AwaitChange => Action::await_change(),
        Next::SecretRetry => Action::requeue(SECRET_RETRY),
        Next::Refresh => Action::requeue(ctx.recheck_after()),
        Next::Soon => Action::requeue(HANDOVER_POLL.min(ctx.status_interval)),
    })
}

/// The children the plan names, built with the coverage baseline it decided, the
/// Secret versions observed and the rollout it asks for, applied unless in place;
/// their Events once applied. Whether someone else changed one meanwhile.
async fn apply_children(pass: &Pass<'_>, plan: &Effects, ctx: &Context) -> Result<bool, Error> {
    let (Some(valid), Some(observed)) = (pass.valid, pass.observed) else {
        return Ok(false);
    };
    let mut desired = match (plan.children, &pass.built) {
        (Children::Keep, _) | (_, None) => return Ok(false),
        (Children::Relay, Some(built)) => built.clone(),
        (Children::Backfill, Some(_)) => match valid.backfill() {
            Some(fill) => build(&fill, &ctx.options)?,
            None => return Ok(false),
        },
    };
    if plan.children == Children::Relay {
        // The coverage baseline as decided now, for relays that start from here on.
        crate::resources::with_coverage_baseline(
            &mut desired.config_map,
            plan.slot
                .as_ref()
                .and_then(|s| s.coverage_baseline.as_deref()),
        );
    }
    // A rotated Secret rolls the pods (they read Secret values only at start).
    annotate_secret_versions(&mut desired.deployment, &observed.secrets.versions);
    if plan.exclusive_rollout {
        crate::resources::roll_out_exclusively(&mut desired.deployment);
    }
    let others_meanwhile = children::apply_if_changed(pass.relay, ctx, &desired, observed).await?;
    publish(pass.relay, ctx, &plan.applied).await;
    Ok(others_meanwhile)
}

/// The newest pod of the tool Job `job` (a Job that gave up keeps its pod).
pub(super) async fn job_pod(
    client: &kube::Client,
    namespace: &str,
    job: &str,
) -> Result<Option<k8s_openapi::api::core::v1::Pod>, kube::Error> {
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(client.clone(), namespace);
    let list = kube::api::ListParams::default().labels(&crate::resources::job_pods_selector(job));
    Ok(pods
        .list(&list)
        .await?
        .items
        .into_iter()
        .max_by_key(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0)))
}
