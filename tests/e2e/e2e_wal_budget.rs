//! The WAL budget (`spec.mode.logTailing.maxRetainedWal`): the broker goes down, the
//! stuck relay's slot retains WAL past the budget, the operator switches the relay to
//! polling the same table and drops the slot, the broker returns, the backlog drains,
//! and log tailing resumes through a new slot. Through the controller binary, the pod
//! runner, a NATS server of the test's own (stopped and started for real) and a writer
//! that commits throughout; `pg_replication_slots` is checked at each step, and the
//! test's consumer checks every committed event arrived, in per-aggregate order.

use crate::common;

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;
use kube::api::Api;
use outbox_operator::api::OutboxRelay;
use serde_json::json;

use common::Pg;
use common::app_writer::{AppWriter, WriterOptions};
use common::ids::OutboxIds;
use common::node::RelayPods;
use common::operator;
use common::private::PrivateNats;

const WAIT: Duration = Duration::from_secs(120);
const STEP: usize = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_wal_budget_a_relay_polls_drops_its_slot_and_returns_with_nothing_lost() {
    budget_scenario(Pg::V15, OutboxIds::Bigint).await;
}

/// The same on a table whose message ids are random uuids: the fall-back polling
/// relay orders them by `created_at`, so nothing is lost or reordered across the fall
/// back and the return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_budget_hands_over_a_uuid_table_with_nothing_lost_or_reordered() {
    budget_scenario(Pg::V15, OutboxIds::Uuid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_budget_works_the_same_on_postgresql_18() {
    budget_scenario(Pg::V18, OutboxIds::Bigint).await;
}

/// One budget scenario at a time on each server: WAL is the server's, so another
/// scenario's ballast counts against this one's slot too and could push it past its
/// budget before this one means it to (as it would in production: the budget is of the
/// server's WAL the slot holds back).
static ON_PG15: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
static ON_PG18: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn budget_scenario(pg: Pg, ids: OutboxIds) {
    let _alone_on_the_server = match pg {
        Pg::V15 => ON_PG15.lock().await,
        Pg::V18 => ON_PG18.lock().await,
    };
    let db = pg.fresh().await;
    common::ids::create_outbox_table_with(&db.client, 4, ids).await;
    let mut nats = PrivateNats::start_new();
    let stream = common::stream_on(
        async_nats::connect(nats.url())
            .await
            .unwrap_or_else(|e| panic!("connecting to the private NATS: {e}")),
    )
    .await;
    let writer = AppWriter::start(
        &db.url,
        WriterOptions {
            aggregates: 50,
            writers: 2,
            pause: Duration::from_millis(10),
            ..WriterOptions::default()
        },
    )
    .await;

    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    // Status (and with it the budget) checked every second.
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
                "metadata": {"name": "budget"},
                "spec": {
                    "database": {"postgres": {
                        "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                        "sslMode": "disable"}},
                    "table": ids.table_spec(),
                    "mode": {"logTailing": {
                        "heartbeatInterval": "1s",
                        "maxRetainedWal": "16Mi",
                        "returnAfter": "5s"}},
                    "broker": {"nats": {
                        "url": nats.url(),
                        "subject": format!("{}.{{aggregateType}}", stream.subject_prefix)}},
                    "ordering": {"mode": "perAggregate", "partitions": 4},
                    "replicas": 1,
                }
            }),
        )
        .await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let slot = outbox_operator::relay::config::default_slot_name(&ns, "budget");
    let mode = || async {
        deployments
            .get_opt("budget-relay")
            .await
            .ok()
            .flatten()
            .and_then(|d| d.annotations().get("outbox.dev/mode").cloned())
    };
    let relay_now = || async { relays.get_opt("budget").await.ok().flatten() };

    // 1. Log tailing, within the budget.
    writer.allow(STEP);
    common::wait_for_some_or(
        "the relay tailing the log within its budget (slot active, PollingFallback=False)",
        WAIT,
        || runner.log_tails(30),
        || async {
            let relay = relay_now().await?;
            let within = operator::condition(&relay, "PollingFallback")
                .is_some_and(|c| c.status == "False" && c.reason == "WithinBudget");
            let active = common::slot_row(&db.client, &slot)
                .await
                .is_some_and(|(a, _)| a);
            (operator::is_ready(&relay) && within && active && writer.committed() >= STEP)
                .then_some(())
        },
    )
    .await;

    // 2. The broker goes down; the stuck relay confirms nothing, and the database keeps
    //    writing (events, and WAL unrelated to the outbox, as a busy database does).
    nats.stop();
    writer.allow(writer.committed() + STEP);
    db.client
        .batch_execute(
            "CREATE TABLE ballast (b text); \
             INSERT INTO ballast SELECT repeat('x', 1000) FROM generate_series(1, 30000)",
        )
        .await
        .unwrap_or_else(|e| panic!("writing ballast: {e}"));
    let retained = common::slot_row(&db.client, &slot)
        .await
        .map_or(0, |(_, retained)| retained);
    assert!(
        retained > 16 << 20,
        "the slot retains only {retained} bytes after the ballast"
    );

    // 3. Past the budget: polling replaces log tailing, the slot is dropped.
    for reason in ["FellBackToPolling", "SlotDroppedOverBudget"] {
        operator::wait_relay_event(&client, &ns, "budget", reason, WAIT).await;
    }
    let left = common::slot_row(&db.client, &slot).await;
    assert_eq!(
        left,
        None,
        "the slot is dropped; controller log:\n{}\n{}",
        controller.log_tail(80),
        runner.log_tails(30)
    );
    let publication_kept: bool = db
        .client
        .query_one(
            "SELECT count(*) = 1 FROM pg_publication WHERE pubname = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(publication_kept, "the publication (and its marker) stays");
    assert_eq!(mode().await.as_deref(), Some("polling"));
    // The Events go out in the pass that drops the slot, before its status is written:
    // the status is waited for, not read at once.
    let (relay, fallback) = common::wait_for_some_or(
        "status.fallback to record the dropped slot",
        WAIT,
        || runner.log_tails(30),
        || async {
            let relay = relay_now().await?;
            let fallback = relay.status.as_ref()?.fallback.clone()?;
            fallback.slot_dropped.then_some((relay, fallback))
        },
    )
    .await;
    assert!(
        fallback.retained_wal_bytes > 16 << 20,
        "status.fallback: {fallback:?}"
    );
    let cond = operator::condition(&relay, "PollingFallback").unwrap();
    assert_eq!(
        (cond.status.as_str(), cond.reason.as_str()),
        ("True", "WalBudgetExceeded")
    );
    // The broker stays down a little longer: events still commit, nothing retains WAL
    // for the relay any more, and the relay does not return while rows wait.
    writer.allow(writer.committed() + STEP);
    writer
        .wait_committed(writer.committed() + STEP / 2, WAIT)
        .await;
    // A return would be decided by the controller's next passes: wait for two.
    let passes = common::wait_for_some_or(
        "the controller's metrics",
        WAIT,
        || runner.log_tails(30),
        || controller.counter("outbox_operator_reconciles_total"),
    )
    .await;
    common::wait_for_some_or(
        "two more passes of the controller",
        WAIT,
        || runner.log_tails(30),
        || async {
            let now = controller
                .counter("outbox_operator_reconciles_total")
                .await?;
            (now >= passes + 2.0).then_some(())
        },
    )
    .await;
    assert_eq!(
        common::slot_row(&db.client, &slot).await,
        None,
        "no return while the broker is down"
    );

    // 4. The broker returns: the backlog drains, the slot is created again while the
    //    polling relay runs, and log tailing takes over.
    nats.start();
    writer.allow(writer.committed() + STEP);
    for reason in ["ReturningToLogTailing", "LogTailingStarted"] {
        common::wait_for_some_or(
            &format!("a {reason} Event"),
            WAIT,
            || runner.log_tails(30),
            || async {
                operator::relay_events(&client, &ns, "budget")
                    .await
                    .iter()
                    .any(|e| e.reason.as_deref() == Some(reason))
                    .then_some(())
            },
        )
        .await;
    }
    writer.allow(writer.committed() + STEP);
    let ledger = writer.finish().await;
    common::wait_for_some_or(
        "every row published and log tailing back (table empty, logTailing Deployment, slot active, no status.fallback)",
        WAIT,
        || runner.log_tails(30),
        || async {
            let left: i64 = db
                .client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .ok()?
                .get(0);
            let relay = relay_now().await?;
            let back = relay.status.as_ref().is_some_and(|s| s.fallback.is_none())
                && operator::condition(&relay, "PollingFallback")
                    .is_some_and(|c| c.status == "False");
            let active = common::slot_row(&db.client, &slot).await.is_some_and(|(a, _)| a);
            (left == 0 && mode().await.as_deref() == Some("logTailing") && active && back)
                .then_some(())
        },
    )
    .await;
    let switches = controller
        .counter("outbox_operator_wal_budget_switches_total")
        .await;
    assert_eq!(switches, Some(2.0), "one switch to polling, one back");

    let received = common::consume_nats(&stream).await;
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    println!(
        "WAL budget ({pg:?}, {ids:?} ids): {} events, slot retained {} bytes at the fall back, {} lost, {} reordered, {} duplicates",
        ledger.committed.len(),
        fallback.retained_wal_bytes,
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
