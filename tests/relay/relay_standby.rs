//! `synchronizedStandbySlots` on PostgreSQL 15, which has no failover slots: the relay
//! publishes a commit only once the named standby has flushed it, so a promotion of
//! that standby can never leave an event out for a commit the new primary lacks.
//! Proven directly: with the standby stopped the primary goes on committing, the relay
//! receives those commits (its wait gauge says so) and sends none of them; once the
//! standby is back and has flushed them, all go out, in order.

use crate::common::{self, RelayBroker, RelayProcess};
use common::private::PrivatePostgres;

use std::collections::BTreeSet;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

fn ids_on(topic: &str) -> BTreeSet<i64> {
    common::consume_kafka(topic).iter().map(|r| r.id).collect()
}

async fn insert(client: &tokio_postgres::Client, n: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    for i in 0..n {
        let aggregate = format!("agg-{}", i % 4);
        ids.push(
            common::insert_row(client, "order", &aggregate, &serde_json::json!({"i": i})).await,
        );
    }
    ids
}

async fn wait_on_topic(topic: &str, ids: &[i64], relay: &RelayProcess) {
    let want: BTreeSet<i64> = ids.iter().copied().collect();
    common::wait_for_relays("the rows on the topic", WAIT, &[relay], || {
        let topic = topic.to_owned();
        let want = want.clone();
        async move {
            let got = tokio::task::spawn_blocking(move || ids_on(&topic))
                .await
                .unwrap_or_default();
            want.is_subset(&got)
        }
    })
    .await;
}

/// A PostgreSQL 15 primary with one streaming standby (physical slot `standby_1`), an
/// outbox table and its slot, and a log-tailing relay to a fresh Kafka topic that waits
/// for `standby_1`, streaming.
struct Guarded {
    primary: PrivatePostgres,
    admin: tokio_postgres::Client,
    standby: PrivatePostgres,
    slot: String,
    topic: String,
    relay: RelayProcess,
}

async fn guarded(delete_after_publish: bool) -> Guarded {
    let primary = PrivatePostgres::start_with(&["max_replication_slots=10", "max_wal_senders=10"]);
    let admin = common::pg_connect(&primary.url()).await.unwrap();
    let version: i32 = admin
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        version < 170_000,
        "the rig's first server is the one without failover slots"
    );
    common::create_outbox_table(&admin, 4).await;
    admin
        .batch_execute("SELECT pg_create_physical_replication_slot('standby_1')")
        .await
        .unwrap();
    let standby = PrivatePostgres::standby_of(&primary, "standby_1", &["hot_standby_feedback=on"]);
    let slot = format!("standby_{}", common::unique_suffix());
    common::create_replication(&admin, &slot, &slot).await;
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let yaml = common::with_spec_line(
        &common::relay_config_yaml(&broker, &common::RelayOptions::default()),
        "mode",
        &format!(
            "{{logTailing: {{slotName: {slot}, publicationName: {slot}, heartbeatInterval: 1s, \
             deleteAfterPublish: {delete_after_publish}, synchronizedStandbySlots: [standby_1]}}}}"
        ),
    );
    let relay = RelayProcess::start(&yaml, &primary.url(), &broker);
    common::wait_slot_active(&admin, &slot, &relay).await;
    Guarded {
        primary,
        admin,
        standby,
        slot,
        topic,
        relay,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_published_before_the_named_standby_has_flushed_it() {
    let Guarded {
        primary: _primary,
        admin,
        mut standby,
        topic,
        relay,
        ..
    } = guarded(false).await;

    // With the standby streaming, rows go out.
    let first = insert(&admin, 20).await;
    wait_on_topic(&topic, &first, &relay).await;

    // The standby stops: the primary commits on, the standby has none of it.
    standby.stop();
    let held = insert(&admin, 20).await;
    // The relay has received them and waits for the standby (its gauge moves) …
    common::wait_for_relays(
        "the relay waiting for the standby",
        WAIT,
        &[&relay],
        || async {
            relay
                .metric("outbox_relay_standby_wait_bytes")
                .await
                .is_some_and(|bytes| bytes > 0.0)
        },
    )
    .await;
    // … and has sent none of them.
    let got = {
        let topic = topic.clone();
        tokio::task::spawn_blocking(move || ids_on(&topic))
            .await
            .unwrap()
    };
    let early: Vec<i64> = held.iter().filter(|id| got.contains(id)).copied().collect();
    assert!(
        early.is_empty(),
        "published before the standby had them: {early:?}"
    );
    // The wait is reported after a while: not ready, with the reason in the log.
    common::wait_for_relays(
        "the relay reporting the wait in its log",
        WAIT,
        &[&relay],
        || async { relay.log_tail(50).contains("waiting for the standbys") },
    )
    .await;

    // The standby comes back and catches up: everything goes out, in order.
    standby.start();
    wait_on_topic(&topic, &held, &relay).await;
    common::wait_for_relays("the wait gauge back at 0", WAIT, &[&relay], || async {
        relay.metric("outbox_relay_standby_wait_bytes").await == Some(0.0)
    })
    .await;
    let received = {
        let topic = topic.clone();
        tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
            .await
            .unwrap()
    };
    let mut last: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
    for r in &received {
        if let Some(before) = last.insert(r.aggregate.clone(), r.id) {
            assert!(before < r.id, "{}: {} after {before}", r.aggregate, r.id);
        }
    }
    drop(relay);
}

/// A URL naming several hosts, the standby first (as after a switchover): the relay's
/// sessions and its replication stream reach the primary, and rows go out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_streams_from_the_primary_whichever_host_comes_first() {
    let primary = PrivatePostgres::start_with(&["max_replication_slots=10", "max_wal_senders=10"]);
    let admin = common::pg_connect(&primary.url()).await.unwrap();
    common::create_outbox_table(&admin, 4).await;
    admin
        .batch_execute("SELECT pg_create_physical_replication_slot('standby_1')")
        .await
        .unwrap();
    let standby = PrivatePostgres::standby_of(&primary, "standby_1", &["hot_standby_feedback=on"]);
    let slot = format!("multihost_{}", common::unique_suffix());
    common::create_replication(&admin, &slot, &slot).await;
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres",
        standby.port, primary.port
    );
    let relay = RelayProcess::start(
        &common::log_tailing_yaml(&broker, &slot, false),
        &url,
        &broker,
    );
    common::wait_slot_active(&admin, &slot, &relay).await;
    let ids = insert(&admin, 12).await;
    wait_on_topic(&topic, &ids, &relay).await;
    drop(relay);
    drop(standby);
}

/// Rows the relay reads from the table rather than the stream wait for the standbys
/// too: the publication gate's back-fill after a DROP/ADD of the table (deleteAfterPublish)
/// sends none of the rows written in the gap while the standby is stopped, and all of
/// them, in order, once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_back_fill_waits_for_the_named_standby_too() {
    let Guarded {
        primary: _primary,
        admin,
        mut standby,
        slot,
        topic,
        relay,
    } = guarded(true).await;
    let mut written = insert(&admin, 8).await;
    wait_on_topic(&topic, &written, &relay).await;

    // The standby stops; the table leaves the publication and comes back with rows
    // written in between, which only the back-fill can publish.
    standby.stop();
    let alter = |change: &str| format!("ALTER PUBLICATION {slot} {change} TABLE public.outbox");
    admin.batch_execute(&alter("DROP")).await.unwrap();
    let gap = insert(&admin, 12).await;
    admin.batch_execute(&alter("ADD")).await.unwrap();
    let after = insert(&admin, 4).await;
    // The back-fill has begun; it either waits for the standby (its gauge moves) or,
    // wrongly, publishes the gap's rows.
    let on_topic = || {
        let topic = topic.clone();
        async move {
            tokio::task::spawn_blocking(move || ids_on(&topic))
                .await
                .unwrap_or_default()
        }
    };
    common::wait_for_relays(
        "the back-fill waiting for the standby (or publishing)",
        WAIT,
        &[&relay],
        || async {
            relay
                .log()
                .contains("publishing every row left in the table first")
                && (relay
                    .metric("outbox_relay_standby_wait_bytes")
                    .await
                    .is_some_and(|bytes| bytes > 0.0)
                    || on_topic().await.contains(&gap[0]))
        },
    )
    .await;
    let got = on_topic().await;
    let early: Vec<i64> = gap
        .iter()
        .chain(&after)
        .filter(|id| got.contains(id))
        .copied()
        .collect();
    assert!(
        early.is_empty(),
        "published before the standby had them: {early:?}"
    );

    standby.start();
    written.extend(gap);
    written.extend(after);
    wait_on_topic(&topic, &written, &relay).await;
    let received = {
        let topic = topic.clone();
        tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
            .await
            .unwrap()
    };
    let committed = written.iter().copied().collect();
    let report = common::check_delivery(&received, &committed, &BTreeSet::new());
    assert!(
        report.missing.is_empty()
            && report.order_violations.is_empty()
            && report.stale_redeliveries.is_empty(),
        "{report:?}"
    );
    drop(relay);
}
