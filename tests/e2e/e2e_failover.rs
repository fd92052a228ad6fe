//! A failover on PostgreSQL 15, which has no failover slots: a primary with a physical
//! standby (`pg_basebackup -R`, its own physical slot), reached through an address that
//! moves to the standby when it is promoted (as a DNS name or a virtual IP would). The
//! relay names the standby's slot in `synchronizedStandbySlots`; the application
//! writes throughout; the primary is SIGKILLed mid-stream and the standby promoted. The
//! promoted server has the publication but not the slot: the controller sees the slot
//! lost.
//!
//! - With `deleteAfterPublish`: every commit the promoted server kept arrives, none it
//!   lacks (no phantom: nothing was sent before the standby had it), and every delivery,
//!   redeliveries included, keeps per-aggregate order.
//! - Without it: `SlotLost` names the window; after the choice, the rows that never
//!   arrive are exactly one run of consecutive commits (those between the last
//!   streamed commit and the new slot), and again no phantom and no reorder.
//!
//! What the promoted server kept is read from a witness table the application writes
//! in each transaction; acknowledged commits the standby never received, and commits
//! whose answer was lost with the primary, are written off to it.

use crate::common::{self, proxy::TcpProxy};
use crate::e2e_slot_lost::{Setup, manifest, setup_on};
use common::app_writer::{AppWriter, Ledger, WriterOptions};
use common::operator;
use common::private::PrivatePostgres;

use std::collections::BTreeSet;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use outbox_operator::api::{OutboxRelay, RECREATE_LOST_SLOT_ANNOTATION};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);
const STEP: usize = 600;
const STANDBY_SLOT: &str = "standby_1";

/// A PostgreSQL 15 primary, its streaming standby, and the address that follows the
/// primary.
struct Cluster {
    primary: PrivatePostgres,
    standby: PrivatePostgres,
    /// The standby's replication link to the primary.
    link: TcpProxy,
    proxy: TcpProxy,
}

impl Cluster {
    async fn start() -> (Cluster, common::TestDatabase) {
        let primary =
            PrivatePostgres::start_with(&["max_replication_slots=10", "max_wal_senders=10"]);
        let admin = common::pg_connect(&primary.url()).await.unwrap();
        let version: i32 = admin
            .query_one("SELECT current_setting('server_version_num')::int", &[])
            .await
            .unwrap()
            .get(0);
        assert!(version < 170_000, "a server without failover slots");
        common::create_outbox_table(&admin, 4).await;
        admin
            .batch_execute(&format!(
                "SELECT pg_create_physical_replication_slot('{STANDBY_SLOT}')"
            ))
            .await
            .unwrap();
        let link = TcpProxy::start(&format!("127.0.0.1:{}", primary.port)).await;
        let standby = PrivatePostgres::standby_via(
            &primary,
            link.addr.port(),
            STANDBY_SLOT,
            &["hot_standby_feedback=on"],
        );
        let proxy = TcpProxy::start(&format!("127.0.0.1:{}", primary.port)).await;
        let url = format!("postgres://postgres@{}/postgres", proxy.addr);
        let client = common::pg_connect(&url).await.unwrap();
        let db = common::TestDatabase {
            name: "postgres".to_owned(),
            url,
            client,
        };
        (
            Cluster {
                primary,
                standby,
                link,
                proxy,
            },
            db,
        )
    }

    /// The standby's link stalls (nothing passes, no reset: as a partition begins), the
    /// application commits `more` events on the primary alone, the primary dies; the
    /// standby is promoted and the address moves to it. Whatever the relay sent of
    /// those commits would be a phantom.
    async fn fail_over(&mut self, writer: &AppWriter, more: usize) {
        self.link.hold();
        let target = writer.committed() + more;
        writer.allow(target);
        writer.wait_committed(target, WAIT).await;
        self.primary.crash();
        self.link.cut();
        self.standby.promote();
        self.proxy
            .retarget(&format!("127.0.0.1:{}", self.standby.port));
        self.proxy.cut();
        self.proxy.heal();
    }

    /// Every outbox id the promoted server kept.
    async fn kept(&self) -> BTreeSet<i64> {
        common::pg_connect(&self.standby.url())
            .await
            .unwrap()
            .query("SELECT id FROM public.witness", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }
}

fn failover_manifest(name: &str, topic: &str, delete_after_publish: bool) -> Value {
    let mut m = manifest(name, topic, delete_after_publish);
    m["spec"]["mode"]["logTailing"]["synchronizedStandbySlots"] = json!([STANDBY_SLOT]);
    m
}

/// After a failover the promoted server has no standby of its own yet: the user names
/// its standbys' slots, here none (the promoted server's standby slot does not exist).
async fn forget_standby(s: &Setup, name: &str) {
    let relays: Api<OutboxRelay> = Api::namespaced(s.client.clone(), &s.ns);
    relays
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"mode": {"logTailing": {
                "synchronizedStandbySlots": null}}}})),
        )
        .await
        .unwrap();
}

/// Waits until the controller reports the slot lost, and returns the loss.
async fn wait_lost(s: &Setup, name: &str) -> outbox_operator::api::SlotLoss {
    common::wait_for_some_or(
        "status.slot.lost after the failover",
        WAIT,
        || s.context(),
        || async { s.relay(name).await?.status?.slot?.lost },
    )
    .await
}

async fn received(s: &Setup) -> Vec<common::Received> {
    let topic = s.topic.clone();
    tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap()
}

fn print_report(what: &str, ledger: &Ledger, report: &common::DeliveryReport) {
    println!(
        "{what}: {} events kept by the promoted server, {} written off, {} lost, {} phantoms, {} reordered, {} stale redeliveries, {} duplicates",
        ledger.committed.len(),
        ledger.aborted.len(),
        report.missing.len(),
        report.orphans.len(),
        report.order_violations.len(),
        report.stale_redeliveries.len(),
        report.duplicates
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_on_postgres_15_with_delete_after_publish_loses_nothing_and_sends_no_phantom() {
    let (mut cluster, db) = Cluster::start().await;
    let options = WriterOptions {
        aggregates: 40,
        writers: 2,
        pause: Duration::from_millis(5),
        failover: true,
        ..WriterOptions::default()
    };
    let (mut s, writer) = setup_on(db, options, true).await;
    s.runner
        .apply_relay(&s.client, &s.ns, &failover_manifest("fo", &s.topic, true))
        .await;
    writer.allow(STEP);
    s.wait_tailing("fo").await;
    writer.wait_committed(STEP, WAIT).await;

    // The primary dies while the application writes.
    writer.allow(3 * STEP);
    writer.wait_committed(STEP + STEP / 2, WAIT).await;
    cluster.fail_over(&writer, STEP / 3).await;
    forget_standby(&s, "fo").await;
    let loss = wait_lost(&s, "fo").await;
    assert!(loss.confirmed_flush_lsn.is_some(), "{loss:?}");
    for reason in ["SlotLost", "SlotRecreated"] {
        s.wait_event("fo", reason).await;
    }
    s.wait_tailing("fo").await;
    writer.allow(writer.committed() + STEP);
    writer
        .wait_committed(writer.committed() + STEP / 2, WAIT)
        .await;
    let ledger = writer.finish().await;
    common::wait_for_some_or(
        "every row published and deleted on the promoted server",
        WAIT,
        || s.context(),
        || async {
            let left: i64 = common::pg_connect(&cluster.standby.url())
                .await
                .ok()?
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .ok()?
                .get(0);
            (left == 0).then_some(())
        },
    )
    .await;
    let ledger = ledger.as_kept_by(&cluster.kept().await);
    let got = received(&s).await;
    let report = common::check_delivery(&got, &ledger.committed, &ledger.aborted);
    print_report(
        "PostgreSQL 15 failover, deleteAfterPublish",
        &ledger,
        &report,
    );
    assert!(
        report.missing.is_empty(),
        "{} events the promoted server kept never arrived, first {:?}",
        report.missing.len(),
        &report.missing[..report.missing.len().min(20)]
    );
    report.assert_ordered_without_orphans();
    s.controller.stop(Duration::from_secs(30)).unwrap();
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_on_postgres_15_keeping_rows_names_the_window_and_loses_only_it() {
    let (mut cluster, db) = Cluster::start().await;
    // One writer: outbox ids grow in commit order, so "one run of consecutive commits"
    // is a range of ids.
    let options = WriterOptions {
        aggregates: 40,
        writers: 1,
        pause: Duration::from_millis(3),
        failover: true,
        ..WriterOptions::default()
    };
    let (mut s, writer) = setup_on(db, options, true).await;
    s.runner
        .apply_relay(
            &s.client,
            &s.ns,
            &failover_manifest("keeps", &s.topic, false),
        )
        .await;
    s.wait_tailing("keeps").await;
    writer.allow(STEP);
    writer.wait_committed(STEP, WAIT).await;
    writer.allow(3 * STEP);
    writer.wait_committed(STEP + STEP / 2, WAIT).await;
    cluster.fail_over(&writer, STEP / 3).await;
    forget_standby(&s, "keeps").await;
    let loss = wait_lost(&s, "keeps").await;
    assert_eq!(loss.recovery, "awaitingChoice");
    let position = loss
        .confirmed_flush_lsn
        .clone()
        .expect("the last confirmed position is named");
    // The choice: go on from a new slot.
    let relays: Api<OutboxRelay> = Api::namespaced(s.client.clone(), &s.ns);
    relays
        .patch(
            "keeps",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                RECREATE_LOST_SLOT_ANNOTATION: loss.detected_at.clone()}}})),
        )
        .await
        .unwrap();
    s.wait_event("keeps", "SlotRecreated").await;
    s.wait_tailing("keeps").await;
    let event = operator::relay_events(&s.client, &s.ns, "keeps")
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("SlotRecreated"))
        .unwrap();
    assert!(
        event
            .note
            .as_deref()
            .unwrap_or_default()
            .contains(&position),
        "the Event names the window from {position}: {event:?}"
    );
    let after_choice = writer.committed();
    writer.allow(after_choice + STEP);
    writer.wait_committed(after_choice + STEP, WAIT).await;
    let ledger = writer.finish().await.as_kept_by(&cluster.kept().await);
    // Everything the new slot streams arrives: the last commits on the topic.
    let last: BTreeSet<i64> = ledger
        .committed
        .iter()
        .rev()
        .take(STEP / 2)
        .copied()
        .collect();
    let got = common::wait_for_some_or(
        "the rows written after the new slot on the topic",
        WAIT,
        || s.context(),
        || async {
            let got = received(&s).await;
            let ids: BTreeSet<i64> = got.iter().map(|r| r.id).collect();
            last.is_subset(&ids).then_some(got)
        },
    )
    .await;
    let report = common::check_delivery(&got, &ledger.committed, &ledger.aborted);
    print_report("PostgreSQL 15 failover, keeping rows", &ledger, &report);
    // What never arrived is one run of consecutive commits: no kept row between the
    // first and the last missing one arrived.
    let ids: BTreeSet<i64> = got.iter().map(|r| r.id).collect();
    if let (Some(first), Some(last)) = (report.missing.first(), report.missing.last()) {
        let inside: Vec<i64> = ledger
            .committed
            .range(*first..=*last)
            .filter(|id| ids.contains(id))
            .copied()
            .collect();
        assert!(
            inside.is_empty(),
            "the lost rows {first}..={last} are not one window: {} of them arrived, first {:?}",
            inside.len(),
            &inside[..inside.len().min(10)]
        );
    }
    report.assert_ordered_without_orphans();
    s.controller.stop(Duration::from_secs(30)).unwrap();
    drop(cluster);
}
