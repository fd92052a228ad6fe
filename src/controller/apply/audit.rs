//! An audit Job's pass: once it ended, its verdict into its relay's `status.lastAudit`
//! (as `decide::audit` says), under a field manager of its own.

use std::sync::Arc;

use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::info;

use super::super::decide::audit::audit_verdict;
use super::super::{Context, Error};
use crate::api::OutboxRelay;

/// The field manager of `status.lastAudit`.
pub const AUDITS_MANAGER: &str = "outbox-operator-audits";

/// Reconciles one audit Job.
pub async fn reconcile(job: Arc<Job>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = job.namespace().unwrap_or_default();
    let Some(relay_name) = job.labels().get("app.kubernetes.io/instance").cloned() else {
        return Ok(Action::await_change());
    };
    let ended = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| matches!(c.type_.as_str(), "Complete" | "Failed") && c.status == "True")
        });
    if !ended {
        return Ok(Action::await_change());
    }
    let relays: Api<OutboxRelay> = Api::namespaced(ctx.client.clone(), &namespace);
    let Some(relay) = relays.get_opt(&relay_name).await? else {
        return Ok(Action::await_change());
    };
    // Only the relay's own audits (the plugin makes the relay their owner).
    let owned = job
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| Some(o.uid.as_str()) == relay.meta().uid.as_deref());
    if !owned {
        return Ok(Action::await_change());
    }
    let name = job.name_any();
    let pod = super::job_pod(&ctx.client, &namespace, &name).await?;
    let current = relay.status.as_ref().and_then(|s| s.last_audit.as_ref());
    let Some(verdict) = audit_verdict(&job, pod.as_ref(), current) else {
        return Ok(Action::await_change());
    };
    let body = json!({
        "apiVersion": OutboxRelay::api_version(&()),
        "kind": OutboxRelay::kind(&()),
        "status": {"lastAudit": verdict},
    });
    ctx.metrics.wrote();
    relays
        .patch_status(
            &relay_name,
            &PatchParams::apply(AUDITS_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
    info!(relay = %relay_name, namespace = %namespace, job = %name, verdict = %verdict.verdict, "recorded the relay's last audit");
    Ok(Action::await_change())
}
