//! A database failover under load with failover slots (PostgreSQL 18): a primary and a
//! physical standby that synchronises slots (`pg_basebackup -R`, `sync_replication_slots`,
//! `synchronized_standby_slots` on the primary). The relay tails the primary's slot
//! through an address that is moved to the standby when it is promoted, as a DNS name
//! or a virtual IP would be. The primary is killed mid-stream: every row the promoted
//! server holds arrives, in per-aggregate order, and no event arrives for a row it
//! lacks (a commit the standby never received was never sent).

use crate::common::{self, RelayBroker, RelayProcess, proxy::TcpProxy};
use common::private::PrivatePostgres;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const AGGREGATES: i64 = 20;

/// Inserts a row every few milliseconds into `url` until `stop`; errors (the server
/// going away) end the writer.
fn start_writer(url: String, stop: Arc<AtomicBool>, first: i64) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let Ok(client) = common::pg_connect(&url).await else {
            return 0;
        };
        let mut seq = first;
        while !stop.load(Ordering::Relaxed) {
            let aggregate = format!("agg-{}", seq % AGGREGATES);
            let written = client
                .execute(
                    "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
                     VALUES ('order', $1, 'Happened', jsonb_build_object('seq', $2::int8))",
                    &[&aggregate, &seq],
                )
                .await;
            if written.is_err() {
                break;
            }
            seq += 1;
            tokio::time::sleep(Duration::from_millis(4)).await;
        }
        seq - first
    })
}

/// Every row of the table: id → aggregate.
async fn rows(url: &str) -> BTreeMap<i64, String> {
    let client = common::pg_connect(url).await.unwrap();
    client
        .query("SELECT id, aggregateid FROM public.outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_continues_from_the_synchronised_slot_with_nothing_lost() {
    let mut primary =
        PrivatePostgres::start_18_with(&["max_replication_slots=10", "max_wal_senders=10"]);
    let admin = common::pg_connect(&primary.url()).await.unwrap();
    common::create_outbox_table(&admin, 4).await;
    admin
        .batch_execute("SELECT pg_create_physical_replication_slot('standby_1')")
        .await
        .unwrap();
    for sql in [
        "ALTER SYSTEM SET synchronized_standby_slots = 'standby_1'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let slot = format!("failover_{}", common::unique_suffix());
    // The operator's own provisioning: a failover slot on 18.
    common::create_replication(&admin, &slot, &slot).await;
    let failover: bool = admin
        .query_one(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(failover, "the operator's slot is not a failover slot");
    let standby = PrivatePostgres::standby_of(
        &primary,
        "standby_1",
        &["sync_replication_slots=on", "hot_standby_feedback=on"],
    );
    // The relay reaches "the database" through an address that follows the primary.
    let proxy = TcpProxy::start(&format!("127.0.0.1:{}", primary.port)).await;
    let relay_url = format!("postgres://postgres@{}/postgres", proxy.addr);
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let relay = RelayProcess::start(
        &common::log_tailing_yaml(&broker, &slot, false),
        &relay_url,
        &broker,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let writer = start_writer(primary.url(), stop.clone(), 0);
    // The standby keeps a synchronised copy of the slot once the slot has moved past
    // the standby's oldest WAL, that is once the relay confirmed something; until then
    // the copy is temporary and would not survive a promotion.
    let standby_admin = common::pg_connect(&standby.url()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let synced = standby_admin
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND synced \
                 AND NOT temporary",
                &[&slot],
            )
            .await
            .ok()
            .flatten()
            .is_some();
        if synced {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the standby did not synchronise the slot in 120 s:\n{}\nrelay:\n{}",
            standby.log_tail(20),
            relay.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The primary dies mid-stream; the writer's last commits may never reach the standby.
    primary.crash();
    let before = writer.await.unwrap();
    standby.promote();
    // The promoted server inherited synchronized_standby_slots = standby_1 from the
    // base backup, a slot it does not have: its logical decoding would wait for it
    // forever (FailoverReady says StandbySlotMissing). It has no standby of its own.
    let promoted = common::pg_connect(&standby.url()).await.unwrap();
    for sql in [
        "ALTER SYSTEM RESET synchronized_standby_slots",
        "SELECT pg_reload_conf()",
    ] {
        promoted.batch_execute(sql).await.unwrap();
    }
    proxy.retarget(&format!("127.0.0.1:{}", standby.port));
    proxy.cut();
    proxy.heal();
    let writer = start_writer(standby.url(), stop.clone(), 1_000_000);
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let after = writer.await.unwrap();
    assert!(
        before > 100 && after > 100,
        "{before} rows before, {after} after"
    );

    let kept = rows(&standby.url()).await;
    let deadline = Instant::now() + Duration::from_secs(90);
    let received = loop {
        let topic = topic.clone();
        let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
            .await
            .unwrap();
        let ids: std::collections::BTreeSet<i64> = received.iter().map(|r| r.id).collect();
        if kept.keys().all(|id| ids.contains(id)) {
            break received;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} rows of the promoted server arrived in 90 s\n{}",
            kept.keys().filter(|id| ids.contains(id)).count(),
            kept.len(),
            relay.log_tail(40)
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    // Nothing the promoted server lacks was sent: with synchronized_standby_slots the
    // primary sent the relay only what the standby had.
    let phantoms: Vec<i64> = received
        .iter()
        .map(|r| r.id)
        .filter(|id| !kept.contains_key(id))
        .collect();
    assert!(
        phantoms.is_empty(),
        "events for rows the promoted server lacks: {phantoms:?}"
    );
    // Per-aggregate order: one writer at a time, so ids grow with commits; first
    // deliveries of each aggregate arrive in id order (repeats after the failover are
    // duplicates of earlier events, allowed).
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for r in &received {
        if !seen.insert(r.id) {
            continue;
        }
        let aggregate = &kept[&r.id];
        if let Some(previous) = last.insert(aggregate.clone(), r.id) {
            assert!(
                previous < r.id,
                "{aggregate}: {} arrived after {previous}",
                r.id
            );
        }
    }
    let duplicates = received.len() - seen.len();
    eprintln!(
        "failover: {} rows kept by the promoted server ({before} written before the crash, {after} after), {} events, {duplicates} duplicates",
        kept.len(),
        received.len()
    );
    drop(relay);
    drop(proxy);
}
