//! The controllers of the tool Jobs, beside the relays' own: each OutboxReplay's one
//! Job and its status (`apply::replay`), and each relay's in-cluster audits, whose last
//! verdict goes into the relay's `status.lastAudit` (`apply::audit`). Both run only
//! while this replica leads, and stop with the relays' controller.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use tracing::warn;

use super::{Context, InFlight, apply, scoped};
use crate::api::OutboxReplay;
use crate::resources::{TOOL_APP_NAME, TOOL_LABEL};

/// How soon a failed pass is tried again.
const RETRY: Duration = Duration::from_secs(15);

/// Runs both until `stop`.
pub(super) async fn run(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    stop: impl Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    futures::future::join(
        replays(ctx.clone(), namespace, stop.clone()),
        audits(ctx, namespace, stop),
    )
    .await;
}

/// The OutboxReplays: each one's Job, and its status from the Job's pod. Without the
/// OutboxReplay CRD installed (an upgrade that kept the old CRDs) its watch fails and
/// retries with backoff; the relays are reconciled all the same.
async fn replays(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    stop: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let client = &ctx.client;
    let tools =
        watcher::Config::default().labels(&format!("app.kubernetes.io/name={TOOL_APP_NAME}"));
    Controller::new(
        scoped::<OutboxReplay>(client, namespace),
        watcher::Config::default(),
    )
    .owns(scoped::<Job>(client, namespace), tools)
    .graceful_shutdown_on(stop)
    .run(
        |replay, ctx| async move {
            let _counted = InFlight::enter(&ctx.in_flight);
            apply::replay::reconcile(replay, ctx.clone()).await
        },
        |replay, err, _| {
            warn!(replay = %kube::ResourceExt::name_any(replay.as_ref()), error = %err, "replay reconcile failed; retrying");
            Action::requeue(RETRY)
        },
        ctx.clone(),
    )
    .for_each(|result| async move {
        if let Err(err) = result {
            tracing::debug!(error = %err, "replay controller event");
        }
    })
    .await;
}

/// The relays' audit Jobs (`kubectl outbox audit`): once one ends, its verdict.
async fn audits(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    stop: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let client = &ctx.client;
    let audits = watcher::Config::default().labels(&format!(
        "app.kubernetes.io/name={TOOL_APP_NAME},{TOOL_LABEL}=audit"
    ));
    Controller::new(scoped::<Job>(client, namespace), audits)
        .graceful_shutdown_on(stop)
        .run(
            |job, ctx| async move {
                let _counted = InFlight::enter(&ctx.in_flight);
                apply::audit::reconcile(job, ctx.clone()).await
            },
            |job, err, _| {
                warn!(job = %kube::ResourceExt::name_any(job.as_ref()), error = %err, "audit verdict not recorded; retrying");
                Action::requeue(RETRY)
            },
            ctx.clone(),
        )
        .for_each(|result| async move {
            if let Err(err) = result {
                tracing::debug!(error = %err, "audit controller event");
            }
        })
        .await;
}
