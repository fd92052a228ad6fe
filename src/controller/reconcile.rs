//! One reconcile of one OutboxRelay: finalizer, validate and build, check Secrets, apply
//! the children, delete the ones no longer built, write status and Events.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use super::database;
use super::{Context, Error, FINALIZER};
use super::{apply, decide, observe, protect};
use crate::api::OutboxRelay;
use crate::resources::build;

/// Back-off after a failed reconcile.
const ERROR_RETRY: Duration = Duration::from_secs(15);
/// How soon the finalizer looks again while the relay's pods are still stopping.
const CLEANUP_POLL: Duration = Duration::from_secs(2);

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
            Finalizer::Cleanup(relay) => apply::deletion::cleanup(&relay, &ctx).await,
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

/// One reconcile as a pipeline: parse → guard the Secrets → observe (reads only) →
/// decide (pure) → carry out what decide planned.
async fn apply(relay: &OutboxRelay, ctx: &Context) -> Result<Action, Error> {
    let (last_slot, recorded_fallback) = observe::remembered(relay, ctx);
    // Parse, then hold the spec to what this install allows.
    let parsed = crate::spec::parse(relay).and_then(|valid| {
        let refused = ctx.policy.check(relay);
        if refused.is_empty() {
            Ok(valid)
        } else {
            Err(crate::spec::Problems(refused))
        }
    });
    let built = match &parsed {
        Ok(valid) => Some(build(valid, &ctx.options)?),
        Err(_) => None,
    };
    let guard = decide::guard(
        parsed.as_ref(),
        last_slot.as_ref(),
        protect::database_secrets(relay),
    );
    if !guard.protect_now.is_empty() {
        protect::protect(relay, &guard.protect_now, ctx).await?;
    }
    let observed = match (&parsed, &built) {
        (Ok(valid), Some(desired)) => {
            Some(observe::observe(relay, valid, desired, recorded_fallback.clone(), ctx).await?)
        }
        _ => None,
    };
    let owner = database::owner(relay);
    let decision = decide::decide(
        parsed.as_ref(),
        &owner,
        last_slot.as_ref(),
        observed.as_ref(),
    );
    let seen = decide::Seen {
        parsed: parsed.as_ref(),
        last_slot: last_slot.as_ref(),
        recorded_fallback: recorded_fallback.as_ref(),
        observed: observed.as_ref(),
        guard: &guard,
    };
    let pass = apply::Pass {
        relay,
        valid: parsed.as_ref().ok(),
        observed: observed.as_ref(),
        built,
        last_slot: last_slot.as_ref(),
    };
    apply::carry_out(pass, decision, &seen, ctx).await
}
