use super::*;
use crate::resources::{BuildOptions, build};

fn replay(yaml: &str) -> OutboxReplay {
    let mut replay: OutboxReplay = serde_yaml::from_str(yaml).unwrap();
    replay.metadata.uid = Some("replay-uid".to_owned());
    replay.metadata.generation = Some(1);
    replay
}

const BY_AGGREGATE: &str = "apiVersion: outbox.dev/v1alpha1
kind: OutboxReplay
metadata: {name: incident-812, namespace: shop}
spec:
  relayName: orders
  from: '2026-12-07T10:00:00Z'
  aggregateIds: ['4711', '4712']
  rate: 20
";

fn relay() -> (OutboxRelay, Deployment) {
    let mut relay: OutboxRelay = serde_yaml::from_str(
        "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: db}, sslMode: disable}}
  mode: {polling: {afterPublish: mark}}
  broker: {nats: {url: \"nats://nats:4222\"}}
",
    )
    .unwrap();
    relay.metadata.uid = Some("relay-uid".to_owned());
    let valid = crate::spec::parse(&relay).unwrap();
    let deployment = build(&valid, &BuildOptions::default()).unwrap().deployment;
    (relay, deployment)
}

fn now() -> Timestamp {
    Timestamp::from_second(1_800_000_000).unwrap()
}

fn pod(state: &str) -> Pod {
    serde_yaml::from_str(&format!(
        "metadata: {{name: incident-812-x1}}
status:
  phase: Running
  startTime: '2026-12-07T12:00:00Z'
  containerStatuses:
  - {{name: tool, image: i, imageID: '', ready: false, restartCount: 0, state: {state}}}"
    ))
    .unwrap()
}

fn reason(plan: &ReplayPlan) -> (&str, &str, &str) {
    let cond = &plan.status.conditions[0];
    (
        plan.status.phase.as_deref().unwrap_or_default(),
        cond.status.as_str(),
        cond.reason.as_str(),
    )
}

#[test]
fn the_job_runs_the_replay_tool_once_owned_by_the_replay() {
    let (relay, deployment) = relay();
    let replay = replay(BY_AGGREGATE);
    let seen = ReplaySeen {
        relay: Some(relay),
        deployment: Some(deployment),
        ..ReplaySeen::default()
    };
    let plan = decide_replay(&replay, &seen, now());
    assert_eq!(reason(&plan), ("Running", "False", "Started"));
    let job = plan.create.expect("a Job");
    assert_eq!(job.metadata.name.as_deref(), Some("incident-812"));
    assert_eq!(job.metadata.generate_name, None);
    let owner = &job.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("OutboxReplay", "replay-uid", Some(true))
    );
    assert_eq!(
        job.metadata.labels.as_ref().unwrap()[REPLAY_LABEL],
        "incident-812"
    );
    let args = job.spec.unwrap().template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap();
    assert_eq!(
        args[3..],
        [
            "--name",
            "incident-812",
            "--rate",
            "20",
            "--limit",
            "100000",
            "--from",
            "2026-12-07T10:00:00Z",
            "--aggregate-id",
            "4711,4712"
        ]
    );
    assert_eq!(args[0], "replay");
    assert_eq!(plan.requeue, Some(RECHECK));
}

#[test]
fn dead_letters_are_redriven_by_the_relay() {
    let replay = replay(
        "apiVersion: outbox.dev/v1alpha1
kind: OutboxReplay
metadata: {name: redrive-1, namespace: shop}
spec: {relayName: orders, source: DeadLetters}
",
    );
    let run = tool_run(&replay).unwrap();
    assert_eq!(run.tool, "dead-letters");
    assert_eq!(run.args, ["--redrive", "all"]);
    assert_eq!(run.deadline, Duration::from_secs(3600));
}

#[test]
fn without_the_relay_or_its_deployment_it_waits_and_says_why() {
    let replay = replay(BY_AGGREGATE);
    let plan = decide_replay(&replay, &ReplaySeen::default(), now());
    assert_eq!(reason(&plan), ("Pending", "False", "RelayNotFound"));
    assert!(plan.create.is_none() && plan.requeue.is_some());
    let (relay, _) = relay();
    let seen = ReplaySeen {
        relay: Some(relay),
        ..ReplaySeen::default()
    };
    let plan = decide_replay(&replay, &seen, now());
    assert_eq!(reason(&plan), ("Pending", "False", "RelayNotRunnable"));
    assert!(plan.create.is_none());
}

fn ours(replay: &OutboxReplay) -> Job {
    let (relay, deployment) = relay();
    job_for(replay, &relay, &deployment).unwrap()
}

#[test]
fn a_running_job_is_reported_and_not_created_again() {
    let replay = replay(BY_AGGREGATE);
    let seen = ReplaySeen {
        job: Some(ours(&replay)),
        pod: Some(pod("{running: {startedAt: '2026-12-07T12:00:01Z'}}")),
        ..ReplaySeen::default()
    };
    let plan = decide_replay(&replay, &seen, now());
    assert_eq!(reason(&plan), ("Running", "False", "Running"));
    assert!(plan.create.is_none());
    assert_eq!(
        plan.status.started_at.as_deref(),
        Some("2026-12-07T12:00:00Z")
    );
}

#[test]
fn how_the_tool_ended_is_the_verdict_with_its_counts() {
    let replay = replay(BY_AGGREGATE);
    for (code, phase, why) in [
        (0, "Succeeded", "Succeeded"),
        (1, "Failed", "EventsNotSent"),
        (2, "Failed", "ReplayError"),
    ] {
        let report = format!(
            "OutboxRelay shop/orders: 12 rows marked published in the window\n{}  {} in 0.6s\n",
            if code == 0 { "ok  " } else { "FAIL" },
            crate::report::replayed(if code == 0 { 12 } else { 5 }, 12)
        );
        let state = format!(
            "{{terminated: {{exitCode: {code}, finishedAt: '2026-12-07T12:00:09Z', message: {}}}}}",
            serde_json::to_string(&report).unwrap()
        );
        let seen = ReplaySeen {
            job: Some(ours(&replay)),
            pod: Some(pod(&state)),
            ..ReplaySeen::default()
        };
        let plan = decide_replay(&replay, &seen, now());
        assert_eq!(reason(&plan), (phase, "True", why));
        let done = if code == 0 { 12 } else { 5 };
        assert_eq!(
            plan.status.events,
            Some(ReplayEvents { selected: 12, done })
        );
        assert_eq!(plan.status.report.as_deref(), Some(report.as_str()));
        assert_eq!(
            plan.status.finished_at.as_deref(),
            Some("2026-12-07T12:00:09Z")
        );
        assert!(plan.status.conditions[0].message.contains("of 12 events"));
        assert_eq!(plan.requeue, None);
        // Finished is final: nothing is created again, whatever is seen later.
        let mut finished = replay.clone();
        finished.status = Some(plan.status.clone());
        let (relay, deployment) = relay();
        let later = decide_replay(
            &finished,
            &ReplaySeen {
                relay: Some(relay),
                deployment: Some(deployment),
                ..ReplaySeen::default()
            },
            now(),
        );
        assert!(later.create.is_none());
        assert_eq!(later.status, plan.status);
    }
}

#[test]
fn a_job_of_that_name_that_is_not_ours_is_never_taken_for_the_replay() {
    let replay = replay(BY_AGGREGATE);
    let mut theirs = ours(&replay);
    theirs.metadata.owner_references = None;
    let seen = ReplaySeen {
        job: Some(theirs),
        pod: Some(pod(
            "{terminated: {exitCode: 0, message: 'replayed 3 of 3 events'}}",
        )),
        ..ReplaySeen::default()
    };
    let plan = decide_replay(&replay, &seen, now());
    assert_eq!(reason(&plan), ("Failed", "True", "JobNameTaken"));
    assert_eq!(plan.status.events, None);
}

#[test]
fn a_job_that_failed_without_an_ended_pod_fails_the_replay() {
    let replay = replay(BY_AGGREGATE);
    let mut job = ours(&replay);
    job.status = Some(
        serde_yaml::from_str(
            "conditions: [{type: Failed, status: 'True', reason: DeadlineExceeded, message: Job was active longer than specified deadline}]",
        )
        .unwrap(),
    );
    let seen = ReplaySeen {
        job: Some(job),
        ..ReplaySeen::default()
    };
    let plan = decide_replay(&replay, &seen, now());
    assert_eq!(reason(&plan), ("Failed", "True", "JobFailed"));
    assert!(
        plan.status.conditions[0]
            .message
            .contains("DeadlineExceeded")
    );
}
