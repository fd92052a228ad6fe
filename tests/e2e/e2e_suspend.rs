//! `spec.suspend` through the controller binary and the relay pods: a log-tailing relay
//! suspended under a writer runs no pod and publishes nothing, keeps its replication
//! slot (inactive, its position kept) while the WAL it retains stays watched — status,
//! `Degraded=True SlotRetainingWal` and the operator's own metric, which the relay's
//! retained-WAL alert reads while no relay pod runs — and, resumed, publishes every
//! event committed meanwhile from where it stopped: nothing lost, nothing reordered.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::Api;
use outbox_operator::api::OutboxRelay;
use serde_json::json;

use common::app_writer::{AppWriter, WriterOptions};
use common::node::RelayPods;
use common::operator;

const WAIT: Duration = Duration::from_secs(120);
/// `spec.alerting.slotRetainedWal` of the test's relay.
const ALERT_BYTES: i64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_relay_keeps_its_slot_publishes_nothing_and_resumes_where_it_stopped() {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let stream = common::fresh_stream().await;
    let writer = AppWriter::start(
        &db.url,
        WriterOptions {
            aggregates: 20,
            writers: 2,
            pause: Duration::from_millis(10),
            ..WriterOptions::default()
        },
    )
    .await;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let runner = RelayPods::start(&client, &ns).await;
    let mut controller = runner.controller(&ns, &[("OUTBOX_STATUS_INTERVAL", "1")]);
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &runner.url(&db.url))]).await;
    runner
        .apply_relay(
            &client,
            &ns,
            &json!({
                "apiVersion": "outbox.dev/v1alpha1",
                "kind": "OutboxRelay",
                "metadata": {"name": "orders"},
                "spec": {
                    "database": {"postgres": {
                        "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                        "sslMode": "disable"}},
                    "mode": {"logTailing": {"heartbeatInterval": "1s"}},
                    "broker": {"nats": {
                        "url": common::Rig::load().nats_url(),
                        "subject": format!("{}.{{aggregateType}}", stream.subject_prefix)}},
                    "ordering": {"mode": "perAggregate", "partitions": 4},
                    "alerting": {"slotRetainedWal": "1Mi"},
                    "replicas": 1,
                }
            }),
        )
        .await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let slot = outbox_operator::relay::config::default_slot_name(&ns, "orders");
    let relay_now = || async { relays.get_opt("orders").await.ok().flatten() };
    let delivered = || async {
        common::consume_nats(&stream)
            .await
            .iter()
            .map(|r| r.id)
            .collect::<BTreeSet<i64>>()
    };

    // 1. Publishing.
    writer.allow(300);
    writer.wait_committed(300, WAIT).await;
    common::wait_for_some_or(
        "the relay ready, streaming its slot",
        WAIT,
        || runner.log_tails(30),
        || async {
            let relay = relay_now().await?;
            let active = common::slot_row(&db.client, &slot)
                .await
                .is_some_and(|(a, _)| a);
            (operator::is_ready(&relay) && active).then_some(())
        },
    )
    .await;

    // 2. Suspended: no pod, the slot kept but no longer streamed, Ready says why.
    operator::set_suspend(&relays, "orders", true).await;
    common::wait_for_some_or(
        "Ready=False Suspended, no relay pod, the slot inactive",
        WAIT,
        || format!("{}\n{}", runner.log_tails(30), controller.log_tail(30)),
        || async {
            let relay = relay_now().await?;
            let ready = operator::condition(&relay, "Ready")?;
            let pods = deployments
                .get_opt("orders-relay")
                .await
                .ok()
                .flatten()?
                .status?
                .replicas
                .unwrap_or(0);
            let inactive = common::slot_row(&db.client, &slot)
                .await
                .is_some_and(|(active, _)| !active);
            (ready.status == "False"
                && ready.reason == "Suspended"
                && ready.message.contains(&slot)
                && pods == 0
                && relay.status.as_ref()?.replicas == Some(0)
                && inactive)
                .then_some(())
        },
    )
    .await;
    operator::wait_relay_event(&client, &ns, "orders", "Suspended", WAIT).await;
    let at_suspend = delivered().await;

    // 3. The application writes on, and the database with it (WAL the slot keeps).
    let before = writer.committed();
    writer.allow(before + 500);
    writer.wait_committed(before + 500, WAIT).await;
    db.client
        .batch_execute(
            "CREATE TABLE ballast (b text); \
             INSERT INTO ballast SELECT repeat('x', 1000) FROM generate_series(1, 3000)",
        )
        .await
        .unwrap_or_else(|e| panic!("writing ballast: {e}"));
    let retained = common::slot_row(&db.client, &slot)
        .await
        .map_or(0, |(_, retained)| retained);
    assert!(retained > ALERT_BYTES, "the slot retains {retained} bytes");
    // The operator sees it (status, Degraded, its metric): the pass that would have
    // started a relay had suspend not held it.
    let (status_bytes, metric) = common::wait_for_some_or(
        "Degraded=True SlotRetainingWal, status and the operator's metric past 1Mi",
        WAIT,
        || controller.log_tail(30),
        || async {
            let relay = relay_now().await?;
            let degraded = operator::condition(&relay, "Degraded")?;
            let bytes = relay.status.as_ref()?.slot.as_ref()?.retained_wal_bytes?;
            let metric = controller
                .counter("outbox_operator_slot_retained_wal_bytes")
                .await?;
            (degraded.status == "True"
                && degraded.reason == "SlotRetainingWal"
                && bytes > ALERT_BYTES
                && metric > ALERT_BYTES as f64
                && operator::condition(&relay, "Ready")?.reason == "Suspended")
                .then_some((bytes, metric))
        },
    )
    .await;
    let ledger_so_far = writer.committed();
    let while_suspended: Vec<i64> = delivered().await.difference(&at_suspend).copied().collect();
    assert!(
        while_suspended.is_empty(),
        "published while suspended: {while_suspended:?}"
    );
    assert!(
        common::slot_row(&db.client, &slot).await.is_some(),
        "the slot was dropped while suspended"
    );

    // 4. Resumed: every event committed meanwhile goes out, in order.
    operator::set_suspend(&relays, "orders", false).await;
    writer.allow(ledger_so_far + 300);
    let ledger = writer.finish().await;
    common::wait_for_some_or(
        "every committed event delivered after the resume",
        WAIT,
        || runner.log_tails(30),
        || async {
            let got = delivered().await;
            ledger.committed.is_subset(&got).then_some(())
        },
    )
    .await;
    let received = common::consume_nats(&stream).await;
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    println!(
        "suspend: {} events, {} delivered before the suspension, none while suspended, slot retained {status_bytes} bytes (operator metric {metric}), {} lost, {} reordered, {} duplicates",
        ledger.committed.len(),
        at_suspend.len(),
        report.missing.len(),
        report.order_violations.len(),
        report.duplicates
    );
    report.assert_complete();
    assert!(
        report.stale_redeliveries.is_empty(),
        "{:?}",
        report.stale_redeliveries
    );
    common::wait_for_some_or("Ready=True after the resume", WAIT, String::new, || async {
        operator::is_ready(&relay_now().await?).then_some(())
    })
    .await;

    operator::delete_relays(&client, &ns, WAIT).await;
    let stopped = controller.stop(WAIT);
    drop(runner);
    let _ = operator::drop_slot_and_publication(&slot, &slot, &db.url).await;
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
    if let Err(err) = stopped {
        panic!("{err}");
    }
}
