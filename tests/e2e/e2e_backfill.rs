//! A new log-tailing relay on a table that already holds unpublished rows (a backlog
//! written before the relay existed, as after deleting and recreating a relay, or a
//! rename whose old slot was dropped): the slot streams only what commits after it, so
//! the operator runs a polling relay on the same table first, until every row
//! committed before the slot is published, and then log tailing. Through the
//! controller binary, the pod runner and Kafka, with writes going on throughout; the
//! test's own consumer checks every event arrived in per-aggregate order.

use crate::common;

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;
use kube::api::Api;
use outbox_operator::api::OutboxRelay;
use serde_json::json;

use common::app_writer::{AppWriter, WriterOptions};
use common::ids::OutboxIds;
use common::node::RelayPods;
use common::operator;

const WAIT: Duration = Duration::from_secs(120);
/// Events committed before the relay exists, and at least as many in each phase after.
const BEFORE: usize = 2_000;
const STEP: usize = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_log_tailing_relay_back_fills_the_rows_committed_before_its_slot() {
    backfill_scenario(OutboxIds::Bigint).await;
}

/// The same on a table whose message ids are random uuids: the back-fill relay polls
/// them by `created_at`, the id only breaking ties, so each aggregate's rows still go
/// out in insertion order, before and across the hand-over to log tailing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_log_tailing_relay_back_fills_a_uuid_table_in_order() {
    backfill_scenario(OutboxIds::Uuid).await;
}

async fn backfill_scenario(ids: OutboxIds) {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    let topic = common::fresh_topic(4).await;
    common::ids::create_outbox_table_with(&db.client, 4, ids).await;
    let writer = AppWriter::start(
        &db.url,
        WriterOptions {
            aggregates: 50,
            writers: 3,
            pause: Duration::from_millis(5),
            ..WriterOptions::default()
        },
    )
    .await;
    writer.allow(BEFORE);
    writer.wait_committed(BEFORE, WAIT).await;

    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let runner = RelayPods::start(&client, &ns).await;
    let mut controller = runner.controller(&ns, &[]);
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &runner.url(&db.url))]).await;
    runner.apply_relay(
        &client,
        &ns,
        &json!({
            "apiVersion": "outbox.dev/v1alpha1",
            "kind": "OutboxRelay",
            "metadata": {"name": "backlog"},
            "spec": {
                "database": {"postgres": {
                    "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                    "sslMode": "disable"}},
                "table": ids.table_spec(),
                "mode": {"logTailing": {"heartbeatInterval": "2s"}},
                "broker": {"kafka": {"bootstrapServers": rig.kafka_bootstrap(), "topic": topic}},
                "ordering": {"mode": "perAggregate", "partitions": 4},
                "replicas": 1,
            }
        }),
    )
    .await;
    // Writes go on while the slot is created, while the back-fill relay runs, and
    // after log tailing took over.
    writer.allow(BEFORE + STEP);
    for reason in ["BackfillingBeforeLogTailing", "LogTailingStarted"] {
        common::wait_for_some_or(
            &format!("a {reason} Event"),
            WAIT,
            || runner.log_tails(30),
            || async {
                operator::relay_events(&client, &ns, "backlog")
                    .await
                    .iter()
                    .any(|e| e.reason.as_deref() == Some(reason))
                    .then_some(())
            },
        )
        .await;
        writer.allow(writer.committed() + STEP);
    }
    let ledger = writer.finish().await;

    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let slot = outbox_operator::relay::config::default_slot_name(&ns, "backlog");
    common::wait_for_some_or(
        "every row published and log tailing running (table empty, Deployment in logTailing mode, slot streamed, Ready)",
        WAIT,
        || runner.log_tails(30),
        || async {
            let left: i64 = db
                .client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .ok()?
                .get(0);
            let mode = deployments
                .get_opt("backlog-relay")
                .await
                .ok()
                .flatten()?
                .annotations()
                .get("outbox.dev/mode")
                .cloned();
            let streamed = common::slot_active(&db.client, &slot).await;
            let ready = relays
                .get_opt("backlog")
                .await
                .ok()
                .flatten()
                .is_some_and(|r| operator::is_ready(&r));
            (left == 0 && mode.as_deref() == Some("logTailing") && streamed && ready)
                .then_some(())
        },
    )
    .await;
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    println!(
        "back-fill before log tailing, {ids:?} ids: {} events ({BEFORE} before the relay), {} lost, {} reordered, {} duplicates",
        ledger.committed.len(),
        report.missing.len(),
        report.order_violations.len(),
        report.duplicates
    );
    assert!(
        report.missing.is_empty(),
        "{} committed events never arrived, first {:?}",
        report.missing.len(),
        &report.missing[..report.missing.len().min(20)]
    );
    assert!(
        report.order_violations.is_empty(),
        "per-aggregate order broken, first {:?}",
        &report.order_violations[..report.order_violations.len().min(10)]
    );
    assert!(report.orphans.is_empty(), "rolled-back events arrived");

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
