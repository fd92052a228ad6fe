//! What to do for one OutboxReplay, from what was observed: create its Job (once), or
//! report how it runs and how it ended. Pure: table-tested below.
//!
//! The Job is the one run: named after the OutboxReplay and owned by it, so a re-apply,
//! a second operator replica or a restart finds it instead of starting another; once the
//! status says the run finished, nothing is created again even if the Job was deleted
//! (a finished Job is kept an hour). The Job runs the binary's own `replay` (or
//! `dead-letters --redrive`) against the relay's manifest, shaped like the relay's pods.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;

use crate::api::{OutboxRelay, OutboxReplay, OutboxReplayStatus, ReplayEvents, ReplaySource};
use crate::controller::status::{Cond, merge};
use crate::resources::{ToolRun, job_failed, pod_ended, tool_job};

/// The condition that says whether the run ended, and how.
pub const CONDITION_FINISHED: &str = "Finished";
/// The label naming the OutboxReplay a Job runs.
pub const REPLAY_LABEL: &str = "outbox.dev/replay";

/// What was read for one OutboxReplay.
#[derive(Debug, Default)]
pub struct ReplaySeen {
    /// The relay it names.
    pub relay: Option<OutboxRelay>,
    /// That relay's Deployment: the shape of the Job's pod.
    pub deployment: Option<Deployment>,
    /// The Job named after the OutboxReplay.
    pub job: Option<Job>,
    /// That Job's pod (the newest).
    pub pod: Option<Pod>,
}

/// What to do.
#[derive(Debug, PartialEq)]
pub struct ReplayPlan {
    /// Create this Job.
    pub create: Option<Job>,
    /// Write this status (when it differs from the current one).
    pub status: OutboxReplayStatus,
    /// Look again after this long (while the run has not ended).
    pub requeue: Option<Duration>,
}

/// How often a running or waiting replay is looked at: a pod that cannot start changes
/// no Job, so no watch event would say it.
const RECHECK: Duration = Duration::from_secs(10);

/// Whether a replay's run ended (its status says so): nothing is done for it again.
pub fn finished(status: Option<&OutboxReplayStatus>) -> bool {
    ended(status.and_then(|s| s.phase.as_deref()).unwrap_or_default())
}

fn ended(phase: &str) -> bool {
    matches!(phase, "Succeeded" | "Failed")
}

/// Decides for `replay` from what was `seen`, at `now`.
pub fn decide_replay(replay: &OutboxReplay, seen: &ReplaySeen, now: Timestamp) -> ReplayPlan {
    let current = replay.status.clone().unwrap_or_default();
    if finished(Some(&current)) {
        return ReplayPlan {
            create: None,
            status: current,
            requeue: None,
        };
    }
    let name = replay.metadata.name.clone().unwrap_or_default();
    let mut status = OutboxReplayStatus {
        job: Some(name.clone()),
        ..current.clone()
    };
    let mut create = None;
    let (phase, cond) = match (&seen.job, &seen.relay, &seen.deployment) {
        (Some(job), ..) if !owned_by(job, replay) => (
            "Failed",
            Cond::yes(
                CONDITION_FINISHED,
                "JobNameTaken",
                format!(
                    "a Job named {name} exists and is not this replay's: delete it, or create the replay under another name"
                ),
            ),
        ),
        (Some(job), ..) => running_or_ended(job, seen.pod.as_ref(), &mut status),
        (None, None, _) => (
            "Pending",
            Cond::no(
                CONDITION_FINISHED,
                "RelayNotFound",
                format!(
                    "no OutboxRelay {} in this namespace",
                    replay.spec.relay_name
                ),
            ),
        ),
        (None, Some(_), None) => (
            "Pending",
            Cond::no(
                CONDITION_FINISHED,
                "RelayNotRunnable",
                format!(
                    "the OutboxRelay {} has no Deployment to take its pods' settings from yet: its status says why",
                    replay.spec.relay_name
                ),
            ),
        ),
        (None, Some(relay), Some(deployment)) => match job_for(replay, relay, deployment) {
            Ok(job) => {
                create = Some(job);
                (
                    "Running",
                    Cond::no(CONDITION_FINISHED, "Started", format!("job {name} created")),
                )
            }
            Err(why) => ("Failed", Cond::yes(CONDITION_FINISHED, "InvalidSpec", why)),
        },
    };
    status.phase = Some(phase.to_owned());
    status.conditions = merge(
        &current.conditions,
        &[cond],
        replay.metadata.generation,
        now,
    );
    ReplayPlan {
        create,
        status,
        requeue: (!ended(phase)).then_some(RECHECK),
    }
}

fn owned_by(job: &Job, replay: &OutboxReplay) -> bool {
    let uid = replay.metadata.uid.as_deref();
    job.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "OutboxReplay" && Some(o.uid.as_str()) == uid)
}

/// Phase and condition of a replay whose Job exists; fills in times, counts, report.
fn running_or_ended(
    job: &Job,
    pod: Option<&Pod>,
    status: &mut OutboxReplayStatus,
) -> (&'static str, Cond) {
    let pod_status = pod.and_then(|p| p.status.as_ref());
    if let Some(started) = pod_status.and_then(|s| s.start_time.as_ref()) {
        status.started_at = Some(started.0.to_string());
    }
    if let Some(ended) = pod.and_then(pod_ended) {
        status.finished_at.clone_from(&ended.finished_at);
        status.events = crate::report::events_in(&ended.report)
            .map(|(selected, done)| ReplayEvents { selected, done });
        let verdict = ended.last_line();
        status.report = Some(ended.report);
        return match ended.exit_code {
            0 => (
                "Succeeded",
                Cond::yes(CONDITION_FINISHED, "Succeeded", verdict),
            ),
            1 => (
                "Failed",
                Cond::yes(CONDITION_FINISHED, "EventsNotSent", verdict),
            ),
            _ => (
                "Failed",
                Cond::yes(CONDITION_FINISHED, "ReplayError", verdict),
            ),
        };
    }
    // The Job gave up without a pod that ended (its deadline passed, say).
    if let Some(failed) = job_failed(job) {
        return (
            "Failed",
            Cond::yes(
                CONDITION_FINISHED,
                "JobFailed",
                format!(
                    "{}: {}",
                    failed.reason.as_deref().unwrap_or("Failed"),
                    failed.message.as_deref().unwrap_or_default()
                ),
            ),
        );
    }
    (
        "Running",
        Cond::no(
            CONDITION_FINISHED,
            "Running",
            match pod.and_then(|p| p.metadata.name.as_deref()) {
                Some(pod) => format!("pod {pod} runs the replay"),
                None => "waiting for the Job's pod".to_owned(),
            },
        ),
    )
}

/// The tool's command line for `replay`'s spec.
pub fn tool_run(replay: &OutboxReplay) -> Result<ToolRun, String> {
    let spec = &replay.spec;
    let deadline =
        crate::api::parse_duration(&spec.timeout).map_err(|e| format!("spec.timeout: {e}"))?;
    let joined = |list: &[String]| list.join(",");
    let (tool, args) = match spec.source {
        ReplaySource::DeadLetters => (
            "dead-letters",
            vec![
                "--redrive".to_owned(),
                if spec.ids.is_empty() {
                    "all".to_owned()
                } else {
                    joined(&spec.ids)
                },
            ],
        ),
        ReplaySource::Published => {
            let mut args = vec![
                "--name".to_owned(),
                replay.metadata.name.clone().unwrap_or_default(),
                "--rate".to_owned(),
                spec.rate.to_string(),
                "--limit".to_owned(),
                spec.limit.to_string(),
            ];
            let mut add = |flag: &str, value: String| {
                args.push(flag.to_owned());
                args.push(value);
            };
            if let Some(from) = &spec.from {
                add("--from", from.clone());
            }
            if let Some(to) = &spec.to {
                add("--to", to.clone());
            }
            if !spec.ids.is_empty() {
                add("--ids", joined(&spec.ids));
            }
            if !spec.aggregate_ids.is_empty() {
                add("--aggregate-id", joined(&spec.aggregate_ids));
            }
            if !spec.types.is_empty() {
                add("--type", joined(&spec.types));
            }
            ("replay", args)
        }
    };
    Ok(ToolRun {
        tool: tool.to_owned(),
        args,
        deadline,
    })
}

/// The Job of `replay`: the relay's tool Job, named after the replay and owned by it.
fn job_for(
    replay: &OutboxReplay,
    relay: &OutboxRelay,
    deployment: &Deployment,
) -> Result<Job, String> {
    let run = tool_run(replay)?;
    let mut job = tool_job(relay, deployment, &run).map_err(|e| e.to_string())?;
    let name = replay.metadata.name.clone().unwrap_or_default();
    job.metadata.generate_name = None;
    job.metadata.name = Some(name.clone());
    job.metadata.owner_references = replay.controller_owner_ref(&()).map(|o| vec![o]);
    job.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert(REPLAY_LABEL.to_owned(), name);
    Ok(job)
}

#[cfg(test)]
#[path = "replay_tests.rs"]
mod tests;
