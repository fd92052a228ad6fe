//! One OutboxReplay's pass: read the relay, its Deployment, the replay's Job and pod;
//! carry out what `decide::replay` planned (create the Job, write the status).

use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Client, ResourceExt};
use serde_json::json;
use tracing::info;

use super::super::decide::replay::{ReplaySeen, decide_replay, finished};
use super::super::{Context, Error};
use crate::api::{OutboxRelay, OutboxReplay};

/// Reconciles one OutboxReplay.
pub async fn reconcile(replay: Arc<OutboxReplay>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = replay.namespace().unwrap_or_default();
    let name = replay.name_any();
    let seen = observe(&ctx.client, &namespace, &name, &replay).await?;
    let plan = decide_replay(&replay, &seen, Timestamp::now());
    if let Some(job) = &plan.create {
        let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
        ctx.metrics.wrote();
        match jobs.create(&PostParams::default(), job).await {
            Ok(_) => info!(replay = %name, namespace = %namespace, "created the replay's Job"),
            // Another pass (or replica) made it first: the next pass reads it.
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(err) => return Err(err.into()),
        }
    }
    if replay.status.as_ref() != Some(&plan.status) {
        let replays: Api<OutboxReplay> = Api::namespaced(ctx.client.clone(), &namespace);
        ctx.metrics.wrote();
        replays
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": plan.status})),
            )
            .await?;
    }
    Ok(plan
        .requeue
        .map_or_else(Action::await_change, Action::requeue))
}

/// What the decision needs; the relay and its Deployment only while no Job exists.
async fn observe(
    client: &Client,
    namespace: &str,
    name: &str,
    replay: &OutboxReplay,
) -> Result<ReplaySeen, Error> {
    if finished(replay.status.as_ref()) {
        return Ok(ReplaySeen::default());
    }
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let job = jobs.get_opt(name).await?;
    if job.is_some() {
        let pod = super::job_pod(client, namespace, name).await?;
        return Ok(ReplaySeen {
            job,
            pod,
            ..ReplaySeen::default()
        });
    }
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    let relay = relays.get_opt(&replay.spec.relay_name).await?;
    let deployment = match &relay {
        Some(relay) => {
            let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
            deployments
                .get_opt(&crate::resources::relay_object_name(relay))
                .await?
        }
        None => None,
    };
    Ok(ReplaySeen {
        relay,
        deployment,
        ..ReplaySeen::default()
    })
}
