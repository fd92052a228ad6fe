//! A replication slot lost under a running log-tailing relay (as a promotion of a standby
//! without it leaves the new primary, or a drop by hand): through the controller
//! binary, the pod runner and Kafka, with the application writing throughout.
//!
//! - With `deleteAfterPublish` the table holds every unpublished row: the polling relay
//!   replaces the log-tailing pods alone, a new slot is created only once no pod tails
//!   the log, and log tailing resumes after the hand-over. Every committed event
//!   arrives, and every delivery, redeliveries included, keeps per-aggregate order.
//! - Without it the relay stops with `SlotLost`, naming the window, and no slot is
//!   created — checked after two more passes of the controller — until the annotation
//!   chooses to go on; then exactly the rows committed while no slot existed are the
//!   ones that never arrive.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use outbox_operator::api::{OutboxRelay, RECREATE_LOST_SLOT_ANNOTATION};
use serde_json::{Value, json};

use common::app_writer::{AppWriter, WriterOptions};
use common::node::RelayPods;
use common::operator;

const WAIT: Duration = Duration::from_secs(120);
const STEP: usize = 600;

pub(crate) fn manifest(name: &str, topic: &str, delete_after_publish: bool) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "orders-db", "key": "uri"},
                "sslMode": "disable"}},
            "mode": {"logTailing": {
                "heartbeatInterval": "2s",
                "deleteAfterPublish": delete_after_publish}},
            "broker": {"kafka": {
                "bootstrapServers": common::Rig::load().kafka_bootstrap(),
                "topic": topic}},
            "ordering": {"mode": "perAggregate", "partitions": 4},
            "replicas": 1,
        }
    })
}

/// What a test needs beside its writer: database, topic, namespace, pods and controller.
pub(crate) struct Setup {
    pub(crate) db: common::TestDatabase,
    pub(crate) topic: String,
    pub(crate) client: kube::Client,
    pub(crate) ns: String,
    pub(crate) runner: RelayPods,
    pub(crate) controller: operator::ControllerProcess,
}

async fn setup() -> (Setup, AppWriter) {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let options = WriterOptions {
        aggregates: 40,
        writers: 2,
        pause: Duration::from_millis(5),
        ..WriterOptions::default()
    };
    setup_on(db, options, false).await
}

/// The setup on `db` (its outbox table created), with the application writing as
/// `options` say; `runner_only`: relay pods are local processes even when the rig has
/// a node (for servers only this host reaches).
pub(crate) async fn setup_on(
    db: common::TestDatabase,
    options: WriterOptions,
    runner_only: bool,
) -> (Setup, AppWriter) {
    let topic = common::fresh_topic(4).await;
    let writer = AppWriter::start(&db.url, options).await;
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let runner = if runner_only {
        RelayPods::Runner(
            common::pod_runner::PodRunner::start(&client, &ns, &operator::operator_binary()).await,
        )
    } else {
        RelayPods::start(&client, &ns).await
    };
    // Figures every second: status shows the slot's confirmed position soon.
    let controller = runner.controller(&ns, &[("OUTBOX_STATUS_INTERVAL", "1")]);
    operator::create_secret(&client, &ns, "orders-db", &[("uri", &runner.url(&db.url))]).await;
    let setup = Setup {
        db,
        topic,
        client,
        ns,
        runner,
        controller,
    };
    (setup, writer)
}

impl Setup {
    pub(crate) fn context(&self) -> String {
        format!(
            "{}\n--- controller ---\n{}",
            self.runner.log_tails(30),
            self.controller.log_tail(30)
        )
    }

    pub(crate) async fn relay(&self, name: &str) -> Option<OutboxRelay> {
        let relays: Api<OutboxRelay> = Api::namespaced(self.client.clone(), &self.ns);
        relays.get_opt(name).await.ok().flatten()
    }

    /// Waits until the relay tails the log: Ready, its slot streamed, and status shows
    /// the slot existed with a confirmed position.
    pub(crate) async fn wait_tailing(&self, name: &str) {
        let slot = outbox_operator::relay::config::default_slot_name(&self.ns, name);
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &self.ns);
        common::wait_for_some_or(
            "the relay tailing the log (Ready, slot streamed, status.slot.existed and confirmedFlushLsn)",
            WAIT,
            || self.context(),
            || async {
                let relay = self.relay(name).await?;
                let shown = relay.status.as_ref()?.slot.as_ref()?;
                let mode = deployments
                    .get_opt(&format!("{name}-relay"))
                    .await
                    .ok()
                    .flatten()?
                    .annotations()
                    .get("outbox.dev/mode")
                    .cloned();
                (operator::is_ready(&relay)
                    && shown.existed
                    && shown.confirmed_flush_lsn.is_some()
                    && mode.as_deref() == Some("logTailing")
                    && common::slot_active(&common::pg_connect(&self.db.url).await.ok()?, &slot)
                        .await)
                    .then_some(())
            },
        )
        .await;
    }

    pub(crate) async fn wait_event(&self, name: &str, reason: &str) {
        common::wait_for_some_or(
            &format!("a {reason} Event"),
            WAIT,
            || self.context(),
            || async {
                operator::relay_events(&self.client, &self.ns, name)
                    .await
                    .iter()
                    .any(|e| e.reason.as_deref() == Some(reason))
                    .then_some(())
            },
        )
        .await;
    }

    /// Drops the relay's slot as a promotion would leave it: gone, walsender and all.
    async fn lose_slot(&self, name: &str) {
        let slot = outbox_operator::relay::config::default_slot_name(&self.ns, name);
        let admin = common::pg_connect(common::Rig::load().pg_url())
            .await
            .unwrap();
        assert!(
            common::drop_slot(&admin, &slot).await,
            "replication slot {slot} could not be dropped"
        );
    }

    pub(crate) async fn slot_exists(&self, name: &str) -> bool {
        let slot = outbox_operator::relay::config::default_slot_name(&self.ns, name);
        common::pg_connect(&self.db.url)
            .await
            .unwrap()
            .query_one(
                "SELECT count(*) > 0 FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// Completed reconciles so far, from the controller's own metrics.
    pub(crate) async fn passes(&self) -> f64 {
        common::wait_for_some_or(
            "the controller's metrics",
            WAIT,
            || self.context(),
            || self.controller.counter("outbox_operator_reconciles_total"),
        )
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_back_filled_alone_then_tailed_again_with_nothing_lost_or_reordered() {
    let (mut s, writer) = setup().await;
    s.runner
        .apply_relay(&s.client, &s.ns, &manifest("lost", &s.topic, true))
        .await;
    writer.allow(STEP);
    s.wait_tailing("lost").await;
    writer.wait_committed(STEP, WAIT).await;

    // Lost while the application writes on: those rows are in no slot.
    writer.allow(4 * STEP);
    s.lose_slot("lost").await;
    for reason in ["SlotLost", "SlotRecreated", "LogTailingStarted"] {
        s.wait_event("lost", reason).await;
    }
    s.wait_tailing("lost").await;
    writer.allow(writer.committed() + STEP);
    writer.wait_committed(5 * STEP, WAIT).await;
    let ledger = writer.finish().await;
    common::wait_for_some_or(
        "every row published and deleted",
        WAIT,
        || s.context(),
        || async {
            let left: i64 =
                s.db.client
                    .query_one("SELECT count(*) FROM public.outbox", &[])
                    .await
                    .ok()?
                    .get(0);
            (left == 0).then_some(())
        },
    )
    .await;
    let relay = s.relay("lost").await.unwrap();
    let shown = relay.status.as_ref().unwrap().slot.as_ref().unwrap();
    assert!(shown.lost.is_none(), "the loss is over: {shown:?}");

    let topic = s.topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    println!(
        "slot lost with deleteAfterPublish: {} events, {} lost, {} reordered, {} duplicates",
        ledger.committed.len(),
        report.missing.len(),
        report.order_violations.len(),
        report.duplicates
    );
    if !(report.missing.is_empty() && report.order_violations.is_empty()) {
        let events: Vec<String> = operator::relay_events(&s.client, &s.ns, "lost")
            .await
            .iter()
            .map(|e| {
                format!(
                    "{:?} {:?}: {:?}",
                    e.event_time.as_ref().map(|t| t.0.to_string()),
                    e.reason,
                    e.note
                )
            })
            .collect();
        println!(
            "events:\n{}\n{}\n--- controller ---\n{}",
            events.join("\n"),
            s.runner.log_tails(80),
            s.controller.log_tail(120)
        );
    }
    assert!(
        report.missing.is_empty(),
        "{} committed events never arrived, first {:?}",
        report.missing.len(),
        &report.missing[..report.missing.len().min(20)]
    );
    report.assert_ordered_without_orphans();
    s.controller.stop(Duration::from_secs(30)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_without_delete_after_publish_waits_for_the_choice_and_names_the_window() {
    let (mut s, writer) = setup().await;
    s.runner
        .apply_relay(&s.client, &s.ns, &manifest("keeps", &s.topic, false))
        .await;
    // Without deleteAfterPublish only what commits after the slot is published: the
    // application starts once the relay tails.
    s.wait_tailing("keeps").await;
    writer.allow(STEP);
    writer.wait_committed(STEP, WAIT).await;
    // Every row so far on the wire before the slot goes, so the window holds exactly
    // what is written while it is gone.
    let topic = s.topic.clone();
    common::wait_for_some_or(
        "the first rows on the topic",
        WAIT,
        || s.context(),
        || {
            let topic = topic.clone();
            async move {
                let got = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                    .await
                    .ok()?;
                let ids: BTreeSet<i64> = got.iter().map(|m| m.id).collect();
                (ids.len() >= STEP).then_some(())
            }
        },
    )
    .await;
    s.lose_slot("keeps").await;
    let before_loss = writer.committed();
    writer.allow(before_loss + STEP);
    writer.wait_committed(before_loss + STEP, WAIT).await;

    let lost = common::wait_for_some_or(
        "Ready=False SlotLost with status.slot.lost",
        WAIT,
        || s.context(),
        || async {
            let relay = s.relay("keeps").await?;
            let ready = operator::condition(&relay, "Ready")?;
            let lost = relay.status.as_ref()?.slot.as_ref()?.lost.clone()?;
            (ready.reason == "SlotLost").then_some((ready.message, lost))
        },
    )
    .await;
    let (message, loss) = lost;
    assert_eq!(loss.recovery, "awaitingChoice");
    assert!(
        message.contains(&format!(
            "{RECREATE_LOST_SLOT_ANNOTATION}={}",
            loss.detected_at
        )),
        "{message}"
    );
    let position = loss
        .confirmed_flush_lsn
        .clone()
        .expect("the last confirmed position is named");
    assert!(message.contains(&position), "{message}");

    // Not created in silence: an annotation of another loss makes the controller pass
    // again, and two passes later there is still no slot.
    let relays: Api<OutboxRelay> = Api::namespaced(s.client.clone(), &s.ns);
    let annotate = |value: String| {
        let relays = relays.clone();
        async move {
            relays
                .patch(
                    "keeps",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"annotations": {
                        RECREATE_LOST_SLOT_ANNOTATION: value}}})),
                )
                .await
                .unwrap();
        }
    };
    let passes = s.passes().await;
    annotate("2000-01-01T00:00:00Z".into()).await;
    common::wait_for_some_or(
        "two more passes of the controller",
        WAIT,
        || s.context(),
        || async {
            let now = s
                .controller
                .counter("outbox_operator_reconciles_total")
                .await?;
            (now >= passes + 2.0).then_some(())
        },
    )
    .await;
    assert!(
        !s.slot_exists("keeps").await,
        "a lost slot was created again without the choice"
    );
    let relay = s.relay("keeps").await.unwrap();
    assert_eq!(
        operator::condition(&relay, "Ready").map(|c| c.reason),
        Some("SlotLost".to_owned())
    );

    // The choice: a new slot, a Warning naming the window, and the relay goes on.
    let window_end = writer.committed();
    annotate(loss.detected_at.clone()).await;
    s.wait_event("keeps", "SlotRecreated").await;
    s.wait_tailing("keeps").await;
    let event = operator::relay_events(&s.client, &s.ns, "keeps")
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("SlotRecreated"))
        .unwrap();
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert!(
        event
            .note
            .as_deref()
            .unwrap_or_default()
            .contains(&position),
        "{event:?}"
    );
    writer.allow(window_end + STEP);
    writer.wait_committed(window_end + STEP, WAIT).await;
    let ledger = writer.finish().await;
    // Everything written after the new slot arrives.
    let committed: Vec<i64> = ledger.committed.iter().copied().collect();
    let after: BTreeSet<i64> = committed[window_end..].iter().copied().collect();
    let topic = s.topic.clone();
    let received = common::wait_for_some_or(
        "the rows written after the new slot on the topic",
        WAIT,
        || s.context(),
        || {
            let topic = topic.clone();
            let after = after.clone();
            async move {
                let got = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                    .await
                    .ok()?;
                let ids: BTreeSet<i64> = got.iter().map(|m| m.id).collect();
                after.is_subset(&ids).then_some(got)
            }
        },
    )
    .await;
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    // What never arrived is exactly inside the window: committed after the rows on the
    // wire before the loss, before the choice.
    let window: BTreeSet<i64> = committed[before_loss..window_end].iter().copied().collect();
    let outside: Vec<i64> = report
        .missing
        .iter()
        .filter(|id| !window.contains(id))
        .copied()
        .collect();
    println!(
        "slot lost without deleteAfterPublish: {} events, {} in the window, {} never arrived (all in the window), {} reordered, {} duplicates",
        ledger.committed.len(),
        window.len(),
        report.missing.len(),
        report.order_violations.len(),
        report.duplicates
    );
    assert!(outside.is_empty(), "lost outside the window: {outside:?}");
    assert_eq!(
        report.missing.len(),
        window.len(),
        "the rows committed while no slot existed are the ones lost, all of them"
    );
    report.assert_ordered_without_orphans();
    s.controller.stop(Duration::from_secs(30)).unwrap();
}
