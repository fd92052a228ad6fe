//! `kubectl outbox check|dead-letters|replay|audit NAME`: the tools run in the cluster,
//! in a Job on the rig's kubelet shaped like the relay's own pods (its image, Secrets,
//! tolerations), started through the rig's real kubectl. A polling relay to NATS
//! dead-letters the rows whose aggregate type makes an invalid subject; from kubectl
//! alone, a user checks the relay, lists the dead letters, redrives them once their
//! data is fixed, replays one
//! aggregate, and audits the window: every report comes back through the API (the pod's
//! termination message) with the tool's exit status, a finding (a row marked published
//! that never reached the broker) fails the audit and the relay's `status.lastAudit`
//! says so, a mistyped option is refused before
//! any Job exists, and no tool pod is ever counted among the relay's pods. The reports
//! are golden-tested (tests/golden/kubectl-outbox-tools.txt; `UPDATE_GOLDEN=1`
//! rewrites it).

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use outbox_operator::api::{OutboxRelay, OutboxReplay, ReplayEvents};
use serde_json::json;

use common::node::RelayPods;
use common::operator;
use common::plugin::{exited, kubectl_outbox};

const WAIT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_outbox_runs_the_tools_in_the_cluster_with_the_relays_secrets() {
    common::node::name();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let stream = common::fresh_stream().await;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let pods = RelayPods::start(&client, &ns).await;
    let controller = pods.controller(&ns, &[]);
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &pods.url(&db.url))]).await;
    let subject = |tail: &str| format!("{}.{tail}", stream.subject_prefix);
    let manifest = |subject: String| {
        json!({
            "apiVersion": "outbox.dev/v1alpha1",
            "kind": "OutboxRelay",
            "metadata": {"name": "orders"},
            "spec": {
                "database": {"postgres": {
                    "connectionSecretRef": {"name": "orders-db"},
                    "sslMode": "disable"}},
                "mode": {"polling": {"interval": "200ms", "afterPublish": "mark"}},
                // The aggregate type is in the subject: `bad type` makes an invalid one.
                "broker": {"nats": {"url": common::Rig::load().nats_url(), "subject": subject}},
                "ordering": {"mode": "perAggregate", "partitions": 4},
                "failure": {"maxAttempts": 1, "onExhausted": "deadLetter"},
                "replicas": 1,
            }
        })
    };
    pods.apply_relay(&client, &ns, &manifest(subject("{aggregateType}")))
        .await;
    let mut bad = BTreeSet::new();
    let mut ids = BTreeMap::<i64, String>::new();
    for i in 0..32 {
        let (kind, aggregate) = if i % 16 == 0 {
            ("bad type", format!("odd-{i}"))
        } else {
            ("order", format!("agg-{}", i % 3))
        };
        let id = common::insert_row(&db.client, kind, &aggregate, &json!({"i": i})).await;
        if kind == "bad type" {
            bad.insert(id);
        }
        ids.insert(id, aggregate);
    }
    let delivered = || async {
        let mut count = BTreeMap::<i64, usize>::new();
        for received in common::consume_nats(&stream).await {
            *count.entry(received.id).or_default() += 1;
        }
        count
    };
    common::wait_for_some_or(
        "30 rows published and 2 dead-lettered",
        WAIT,
        || format!("{}\n{}", pods.log_tails(20), controller.log_tail(20)),
        || async {
            let sent = delivered().await.len();
            (common::unpublished_rows(&db.client).await == 0 && sent == 30).then_some(())
        },
    )
    .await;

    // check: from inside the cluster, with the relay's own Secret.
    let checked = exited(&kubectl_outbox(&["check", "orders", "-n", &ns]), 0);
    assert!(
        checked.contains("OutboxRelay") && checked.contains("ok  ") && !checked.contains("FAIL"),
        "{checked}"
    );

    // dead-letters: the two rows NATS refused, with their reason.
    let listed = exited(&kubectl_outbox(&["dead-letters", "orders", "-n", &ns]), 0);
    assert!(
        listed.contains("2 rows in outbox_dead_letter")
            && bad.iter().all(|id| listed.contains(&format!("  {id}  "))),
        "{listed}"
    );

    // Fixed where it went wrong, in the data (the writer's bug), then redriven.
    db.client
        .execute(
            "UPDATE public.outbox_dead_letter SET aggregatetype = 'order'",
            &[],
        )
        .await
        .unwrap();
    let redriven = exited(
        &kubectl_outbox(&["dead-letters", "orders", "-n", &ns, "--redrive", "all"]),
        0,
    );
    assert!(
        redriven.contains("2 rows moved back") && redriven.contains("0 rows in outbox_dead_letter"),
        "{redriven}"
    );
    common::wait_for_some_or(
        "the redriven rows published",
        WAIT,
        || pods.log_tails(20),
        || async {
            let count = delivered().await;
            bad.iter().all(|id| count.contains_key(id)).then_some(())
        },
    )
    .await;

    // replay: one aggregate again, with the original ids; nothing else.
    let replayed = exited(
        &kubectl_outbox(&[
            "replay",
            "orders",
            "-n",
            &ns,
            "--aggregate-id",
            "agg-1",
            "--name",
            "r1",
        ]),
        0,
    );
    let agg_1: BTreeSet<i64> = ids
        .iter()
        .filter(|(_, a)| a.as_str() == "agg-1")
        .map(|(id, _)| *id)
        .collect();
    let n = agg_1.len();
    assert!(
        replayed.contains(&format!("replayed {n} of {n} events")),
        "{replayed}"
    );
    let count = delivered().await;
    for (id, times) in &count {
        let expected = if agg_1.contains(id) { 2 } else { 1 };
        assert_eq!(
            *times, expected,
            "row {id} delivered {times} times\n{replayed}"
        );
    }
    assert_eq!(count.len(), ids.len());

    // audit: the window passes, the replay's deliveries counted as redeliveries.
    let window = ["--since", "10m", "--until", "0s"];
    let audit = |extra: &[&str]| {
        let mut args = vec!["audit", "orders", "-n", ns.as_str()];
        args.extend_from_slice(&window);
        args.extend_from_slice(extra);
        kubectl_outbox(&args)
    };
    let passed = exited(&audit(&[]), 0);
    assert!(
        passed.contains(&format!("ok    missing       0 of {}", ids.len()))
            && passed.contains(&format!("redeliveries  {}", agg_1.len())),
        "{passed}"
    );
    // A row marked published that never reached the broker: the audit fails, naming it.
    let lost = common::insert_row(&db.client, "order", "lost", &json!({"forged": true})).await;
    db.client
        .execute(
            "UPDATE public.outbox SET published_at = now() WHERE id = $1",
            &[&lost],
        )
        .await
        .unwrap();
    let failed = exited(&audit(&[]), 1);
    assert!(
        failed.contains(&format!("FAIL  missing       1 of {}", ids.len() + 1))
            && failed.contains(&format!("aggregate lost: {lost}")),
        "{failed}"
    );

    // The relay's status keeps the last audit's verdict.
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let last = common::wait_for_some_or(
        "the failed audit recorded in the relay's status",
        WAIT,
        || controller.log_tail(20),
        || async {
            let relay = relays.get_opt("orders").await.ok().flatten()?;
            let last = relay.status?.last_audit?;
            (last.verdict == "Failed").then_some(last)
        },
    )
    .await;
    assert_eq!(
        (
            last.rows,
            last.missing,
            last.out_of_order,
            last.redeliveries
        ),
        (
            i64::try_from(ids.len()).unwrap() + 1,
            1,
            0,
            i64::try_from(agg_1.len()).unwrap()
        ),
        "{last:?}"
    );
    assert!(
        last.job.starts_with("orders-audit-") && last.finished_at.is_some(),
        "{last:?}"
    );

    // A mistake is refused before any Job is made.
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let made = jobs.list(&ListParams::default()).await.unwrap().items.len();
    assert_eq!(made, 6, "one Job per tool run");
    let refused = audit(&["--sinse", "1h"]);
    assert_eq!(
        refused.status.code(),
        Some(2),
        "{}",
        common::describe_output(&refused)
    );
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--sinse"));
    assert_eq!(
        jobs.list(&ListParams::default()).await.unwrap().items.len(),
        made
    );

    // The relay's selector never counted a tool pod.
    let relay = relays.get("orders").await.unwrap();
    let selector = outbox_operator::resources::pod_selector(&relay);
    let relay_pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let selected = relay_pods
        .list(&ListParams::default().labels(&selector))
        .await
        .unwrap();
    assert!(
        selected.items.iter().all(|p| p
            .metadata
            .name
            .as_deref()
            .unwrap_or_default()
            .starts_with("orders-relay-")),
        "{:?}",
        selected
            .items
            .iter()
            .map(|p| &p.metadata.name)
            .collect::<Vec<_>>()
    );
    // Every report as the user reads it, golden-tested (what differs from run to run
    // put in words).
    let reports = [
        ("check orders", &checked),
        ("dead-letters orders", &listed),
        ("dead-letters orders --redrive all", &redriven),
        ("replay orders --aggregate-id agg-1 --name r1", &replayed),
        ("audit orders --since 10m --until 0s", &passed),
        ("audit orders --since 10m --until 0s (a row lost)", &failed),
    ]
    .iter()
    .map(|(command, report)| format!("$ kubectl outbox {command}\n{report}"))
    .collect::<String>();
    println!("kubectl outbox in the cluster:\n{reports}");
    common::plugin::assert_golden(
        "kubectl-outbox-tools.txt",
        &common::plugin::normalized(
            &reports,
            &[
                (&ns, "<namespace>"),
                (&db.name, "<database>"),
                (&stream.name, "<stream>"),
                (&stream.subject_prefix, "<subject-prefix>"),
            ],
        ),
    );

    // An OutboxReplay: the operator runs it once, in a Job, and reports in status.
    let agg_2: BTreeSet<i64> = ids
        .iter()
        .filter(|(_, a)| a.as_str() == "agg-2")
        .map(|(id, _)| *id)
        .collect();
    let replay = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxReplay",
        "metadata": {"name": "incident-812"},
        "spec": {"relayName": "orders", "aggregateIds": ["agg-2"], "rate": 50},
    });
    let replays: Api<OutboxReplay> = Api::namespaced(client.clone(), &ns);
    let apply = |body: serde_json::Value| {
        let replays = replays.clone();
        async move {
            replays
                .patch(
                    body["metadata"]["name"].as_str().unwrap(),
                    &PatchParams::apply("e2e-tools").force(),
                    &Patch::Apply(&body),
                )
                .await
        }
    };
    let finished = |name: &'static str| {
        let replays = replays.clone();
        let controller = &controller;
        async move {
            common::wait_for_some_or(
                &format!("the OutboxReplay {name} finished"),
                WAIT,
                || controller.log_tail(20),
                || async {
                    let replay = replays.get_opt(name).await.ok().flatten()?;
                    let status = replay.status.clone()?;
                    matches!(status.phase.as_deref(), Some("Succeeded" | "Failed"))
                        .then_some(status)
                },
            )
            .await
        }
    };
    apply(replay.clone()).await.unwrap();
    let status = finished("incident-812").await;
    assert_eq!(status.phase.as_deref(), Some("Succeeded"), "{status:?}");
    let n = i64::try_from(agg_2.len()).unwrap();
    assert_eq!(
        status.events,
        Some(ReplayEvents {
            selected: n,
            done: n
        }),
        "{status:?}"
    );
    let finished_cond = &status.conditions[0];
    assert_eq!(
        (
            finished_cond.type_.as_str(),
            finished_cond.status.as_str(),
            finished_cond.reason.as_str()
        ),
        ("Finished", "True", "Succeeded")
    );
    assert!(
        status
            .report
            .as_deref()
            .unwrap_or_default()
            .contains("outbox-replay: incident-812"),
        "{status:?}"
    );
    let count = delivered().await;
    for id in &agg_2 {
        assert_eq!(count[id], 2, "row {id} of agg-2");
    }
    let jobs_after = jobs.list(&ListParams::default()).await.unwrap().items.len();
    assert_eq!(jobs_after, made + 1);
    // Re-applied as it was: nothing runs again. Changed: refused, with the reason.
    apply(replay.clone()).await.unwrap();
    let mut changed = replay.clone();
    changed["spec"]["aggregateIds"] = json!(["agg-0"]);
    let refused = apply(changed).await.expect_err("a changed replay");
    assert!(refused.to_string().contains("runs once"), "{refused}");
    assert_eq!(
        replays.get("incident-812").await.unwrap().status,
        Some(status.clone())
    );
    assert_eq!(
        jobs.list(&ListParams::default()).await.unwrap().items.len(),
        jobs_after
    );
    assert_eq!(delivered().await, count);

    // source: DeadLetters, once a new dead letter is fixed.
    let late = common::insert_row(&db.client, "bad type", "odd-late", &json!({"late": true})).await;
    common::wait_for_some_or(
        "the new bad row dead-lettered",
        WAIT,
        || pods.log_tails(20),
        || async {
            db.client
                .query_opt(
                    "SELECT 1 FROM public.outbox_dead_letter WHERE id = $1",
                    &[&late],
                )
                .await
                .ok()
                .flatten()
                .map(|_| ())
        },
    )
    .await;
    db.client
        .execute(
            "UPDATE public.outbox_dead_letter SET aggregatetype = 'order'",
            &[],
        )
        .await
        .unwrap();
    apply(json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxReplay",
        "metadata": {"name": "redrive-late"},
        "spec": {"relayName": "orders", "source": "DeadLetters"},
    }))
    .await
    .unwrap();
    let status = finished("redrive-late").await;
    assert_eq!(status.phase.as_deref(), Some("Succeeded"), "{status:?}");
    assert_eq!(
        status.events,
        Some(ReplayEvents {
            selected: 1,
            done: 1
        }),
        "{status:?}"
    );
    common::wait_for_some_or(
        "the redriven row published",
        WAIT,
        || pods.log_tails(20),
        || async { delivered().await.contains_key(&late).then_some(()) },
    )
    .await;
    println!("OutboxReplays: incident-812 {n} of {n} events; redrive-late 1 of 1");
}
