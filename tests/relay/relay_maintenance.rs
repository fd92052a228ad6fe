//! The relay's housekeeping and what it exports: retention deletes published rows older
//! than `retention.publishedRows` (more than one delete chunk of them) and never an
//! unpublished or recently published row; `/metrics` carries every documented metric
//! with its type, and labels that stay bounded however many aggregates flow through.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{RelayBroker, RelayOptions, RelayProcess};

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn retention_deletes_old_published_rows_in_chunks_and_never_unpublished_ones() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let c = &db.client;
    // 2500 rows published an hour ago (the relay deletes at most 1000 per statement),
    // 50 published just now, and one unpublishable row written two hours ago (its
    // aggregate type makes an invalid topic, so it stays unpublished: block).
    c.batch_execute(
        "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, created_at, published_at)
           SELECT 'Order', 'old-' || g, 'Happened', '{}', now() - interval '2 hours', now() - interval '1 hour'
           FROM generate_series(1, 2500) g;
         INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, created_at, published_at)
           SELECT 'Order', 'recent-' || g, 'Happened', '{}', now(), now()
           FROM generate_series(1, 50) g;
         INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, created_at)
           VALUES ('Bad Type', 'stuck', 'Happened', '{}', now() - interval '2 hours');",
    )
    .await
    .unwrap();
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: format!("test-{}.{{aggregateType}}", common::unique_suffix()),
    };
    let options = RelayOptions {
        retention: "30s",
        max_attempts: 1,
        ..RelayOptions::default()
    };
    let relay = RelayProcess::start(
        &common::relay_config_yaml(&broker, &options),
        &db.url,
        &broker,
    );
    // Retention runs every quarter of the retention period (here 7.5 s).
    common::wait_for_relays(
        "rows published an hour ago to be deleted",
        Duration::from_secs(40),
        &[&relay],
        || async {
            count(
                c,
                "SELECT count(*) FROM public.outbox WHERE aggregateid LIKE 'old-%'",
            )
            .await
                == 0
        },
    )
    .await;
    assert_eq!(
        count(
            c,
            "SELECT count(*) FROM public.outbox WHERE aggregateid LIKE 'recent-%'"
        )
        .await,
        50,
        "rows published within the retention were deleted"
    );
    assert_eq!(
        count(c, "SELECT count(*) FROM public.outbox WHERE aggregateid = 'stuck' AND published_at IS NULL").await,
        1,
        "an unpublished row was deleted"
    );
}

/// `# TYPE` lines: metric family → type.
/// Retention blocked for as long as a lock is held (here a trigger waits on an advisory
/// lock the test holds) does not hold up publishing: it runs on a connection of its
/// own. (Before, it ran on the publishing session, and the relay published nothing
/// until the lock went.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_retention_does_not_hold_up_publishing() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let c = &db.client;
    let key: i64 = 4_242_000 + i64::from(rand::random::<u16>());
    c.batch_execute(&format!(
        "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, created_at, published_at)
           SELECT 'Order', 'old-' || g, 'Happened', '{{}}', now() - interval '2 hours', now() - interval '1 hour'
           FROM generate_series(1, 20) g;
         CREATE FUNCTION public.hold_delete() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_advisory_xact_lock_shared({key}); RETURN OLD; END $$;
         CREATE TRIGGER hold_delete BEFORE DELETE ON public.outbox
           FOR EACH ROW EXECUTE FUNCTION public.hold_delete();"
    ))
    .await
    .unwrap();
    let holder = common::pg_connect(&db.url).await.unwrap();
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .unwrap();
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let options = RelayOptions {
        retention: "4s",
        ..RelayOptions::default()
    };
    let relay = RelayProcess::start(
        &common::relay_config_yaml(&broker, &options),
        &db.url,
        &broker,
    );
    // Retention runs a second after start (a quarter of 4 s) and blocks on the lock.
    common::wait_for_relays(
        "retention to wait on the lock",
        Duration::from_secs(30),
        &[&relay],
        || async {
            count(
                c,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE 'DELETE%'",
            )
            .await
                >= 1
        },
    )
    .await;
    for i in 0..10 {
        common::insert_row(
            c,
            "order",
            &format!("new-{}", i % 3),
            &serde_json::json!({"i": i}),
        )
        .await;
    }
    common::wait_for_relays(
        "rows written while retention waits to be published",
        Duration::from_secs(20),
        &[&relay],
        || async { common::unpublished_rows(c).await == 0 },
    )
    .await;
    holder
        .execute("SELECT pg_advisory_unlock($1)", &[&key])
        .await
        .unwrap();
    common::wait_for_relays(
        "retention to go on once the lock is gone",
        Duration::from_secs(30),
        &[&relay],
        || async {
            count(
                c,
                "SELECT count(*) FROM public.outbox WHERE aggregateid LIKE 'old-%'",
            )
            .await
                == 0
        },
    )
    .await;
    drop(relay);
    db.drop_database().await;
}

fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_owned(), t.to_owned()))
        .collect()
}

/// Every sample line as (name, label names and values).
fn samples(text: &str) -> Vec<(String, Vec<(String, String)>)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (name, rest) = l
                .split_once('{')
                .unwrap_or_else(|| l.split_once(' ').unwrap_or((l, "")));
            let labels = rest
                .split_once('}')
                .map(|(labels, _)| {
                    labels
                        .split(',')
                        .filter_map(|kv| kv.split_once('='))
                        .map(|(k, v)| (k.to_owned(), v.trim_matches('"').to_owned()))
                        .collect()
                })
                .unwrap_or_default();
            (name.to_owned(), labels)
        })
        .collect()
}

#[tokio::test]
async fn metrics_have_every_documented_name_and_type_and_bounded_labels() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(1).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic,
    };
    let relay = RelayProcess::start(
        &common::relay_config_yaml(&broker, &RelayOptions::default()),
        &db.url,
        &broker,
    );
    let c = &db.client;
    let mut series_counts = Vec::new();
    let mut text = String::new();
    for wave in 0..2 {
        for i in 0..100 {
            let aggregate = format!("metrics-agg-{wave}-{i}");
            common::insert_row(
                c,
                "Order",
                &aggregate,
                &serde_json::json!({"aggregate": aggregate}),
            )
            .await;
        }
        let expected = f64::from(100 * (wave + 1));
        common::wait_for_relays(
            "the relay to count every published row",
            Duration::from_secs(60),
            &[&relay],
            || async { relay.metric("outbox_relay_published_total").await == Some(expected) },
        )
        .await;
        text = relay.metrics().await.unwrap_or_default();
        series_counts.push(samples(&text).len());
    }
    let expected_types = [
        ("outbox_relay_published", "counter"),
        ("outbox_relay_publish_errors", "counter"),
        ("outbox_relay_dead_lettered", "counter"),
        ("outbox_relay_batch_duration_seconds", "histogram"),
        ("outbox_relay_end_to_end_lag_seconds", "histogram"),
        ("outbox_relay_backlog_rows", "gauge"),
        ("outbox_relay_oldest_unpublished_age_seconds", "gauge"),
        ("outbox_relay_partitions_owned", "gauge"),
        ("outbox_relay_partitions_blocked", "gauge"),
        ("outbox_relay_last_success_timestamp_seconds", "gauge"),
    ];
    let found = families(&text);
    for (name, kind) in expected_types {
        assert_eq!(
            found.get(name).map(String::as_str),
            Some(kind),
            "{name}:\n{text}"
        );
    }
    assert!(
        text.trim_end().ends_with("# EOF"),
        "not OpenMetrics:\n{text}"
    );
    let allowed: BTreeSet<&str> = ["relay_namespace", "relay_name", "kind", "le"].into();
    for (name, labels) in samples(&text) {
        assert!(name.starts_with("outbox_relay_"), "{name}");
        for (key, value) in &labels {
            assert!(
                allowed.contains(key.as_str()),
                "{name}: unbounded label {key}"
            );
            if key == "kind" {
                assert!(
                    ["row", "unavailable"].contains(&value.as_str()),
                    "{name}: kind={value}"
                );
            }
        }
        assert!(
            labels
                .iter()
                .any(|(k, v)| k == "relay_name" && v == "relay"),
            "{name}: {labels:?}"
        );
    }
    assert!(
        !text.contains("metrics-agg-"),
        "an aggregate id leaked into /metrics"
    );
    // 100 more aggregates and 100 more rows add no series.
    assert_eq!(
        series_counts[0], series_counts[1],
        "series grew with traffic"
    );
    assert_eq!(
        relay.metric("outbox_relay_partitions_owned").await,
        Some(4.0)
    );
    assert!(
        relay
            .metric("outbox_relay_last_success_timestamp_seconds")
            .await
            .unwrap_or(0.0)
            > 1.0e9
    );
}
