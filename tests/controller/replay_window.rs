//! `outbox-operator replay -f relay.yaml` against the rig's PostgreSQL, NATS and Kafka:
//! after a real relay published its rows, a replay by aggregate and one by time window
//! each publish again exactly the events of their window, in the relay's order, with
//! their original ids and payloads and the `outbox-replay` header, and nothing else;
//! the same replay run again lands nothing twice on JetStream; a dry run publishes
//! nothing; the rate limit spaces the events.

use crate::common;

use std::process::Output;
use std::time::{Duration, Instant};

use common::{Received, RelayBroker, RelayOptions, RelayProcess};
use serde_json::json;

fn replay(manifest: &serde_json::Value, database_url: &str, args: &[&str]) -> Output {
    let all: Vec<&str> = std::iter::once("replay")
        .chain(args.iter().copied())
        .collect();
    let output = crate::cli::run_with_manifest(&all, manifest, database_url);
    assert_eq!(
        output.status.code(),
        Some(0),
        "replay {args:?}: {}",
        common::describe_output(&output)
    );
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// 30 rows of aggregates agg-0..2 created now and 6 of `old` created two hours ago,
/// published by a real relay; returns the relay's manifest and the ids, oldest first.
async fn published(
    db: &common::TestDatabase,
    broker: &RelayBroker,
) -> (serde_json::Value, Vec<i64>) {
    common::create_outbox_table(&db.client, 4).await;
    let mut ids = Vec::new();
    for i in 0..36 {
        let aggregate = if i < 30 {
            format!("agg-{}", i % 3)
        } else {
            "old".to_owned()
        };
        ids.push(common::insert_row(&db.client, "order", &aggregate, &json!({"i": i})).await);
    }
    db.client
        .execute(
            "UPDATE public.outbox SET created_at = now() - interval '2 hours' WHERE aggregateid = 'old'",
            &[],
        )
        .await
        .unwrap();
    let yaml = common::relay_config_yaml(broker, &RelayOptions::default());
    let relay = RelayProcess::start(&yaml, &db.url, broker);
    common::wait_for_relays(
        "the relay publishing every row",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    drop(relay);
    (crate::cli::manifest_of(&yaml), ids)
}

/// The deliveries after the first `from`: ids in order, each a replay named `name`
/// whose payload is the first delivery's.
fn replayed(all: &[Received], from: usize, name: &str) -> Vec<i64> {
    all[from..]
        .iter()
        .map(|r| {
            assert_eq!(
                r.headers.get("outbox-replay").map(String::as_str),
                Some(name),
                "delivery of {} without the replay header: {:?}",
                r.id,
                r.headers
            );
            let first = all[..from]
                .iter()
                .find(|f| f.id == r.id)
                .unwrap_or_else(|| panic!("{} replayed but never published first", r.id));
            assert_eq!(first.payload, r.payload, "{}: another payload", r.id);
            assert_eq!(first.aggregate, r.aggregate, "{}: another aggregate", r.id);
            r.id
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jetstream_replay_sends_its_window_again_with_ids_and_header_once() {
    let db = common::fresh_database().await;
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: common::Rig::load().nats_url().to_owned(),
        subject: format!("{}.events", stream.subject_prefix),
    };
    let (manifest, ids) = published(&db, &broker).await;
    let first = common::consume_nats(&stream).await;
    assert_eq!(first.len(), 36, "the first deliveries");
    assert!(
        first
            .iter()
            .all(|r| !r.headers.contains_key("outbox-replay"))
    );

    // By aggregate, within the last hour, at 20 a second.
    let started = Instant::now();
    let output = replay(
        &manifest,
        &db.url,
        &[
            "--aggregate-id",
            "agg-1",
            "--since",
            "1h",
            "--name",
            "r1",
            "--rate",
            "20",
        ],
    );
    let took = started.elapsed();
    assert!(
        stdout(&output).contains("replayed 10 of 10"),
        "{}",
        stdout(&output)
    );
    let all = common::consume_nats(&stream).await;
    let agg1: Vec<i64> = ids.iter().copied().skip(1).step_by(3).take(10).collect();
    assert_eq!(replayed(&all, 36, "r1"), agg1);
    // Ten events at 20 a second: the last leaves 450 ms after the first.
    assert!(
        took >= Duration::from_millis(450),
        "10 events at 20/s in {took:?}"
    );

    // By time window: the rows created two hours ago, and nothing else.
    replay(
        &manifest,
        &db.url,
        &[
            "--since", "3h", "--until", "1h", "--name", "r2", "--rate", "1000",
        ],
    );
    let all = common::consume_nats(&stream).await;
    assert_eq!(replayed(&all, 46, "r2"), ids[30..].to_vec());

    // The same replay again: JetStream drops every event as a duplicate of r1's.
    let again = replay(
        &manifest,
        &db.url,
        &[
            "--aggregate-id",
            "agg-1",
            "--since",
            "1h",
            "--name",
            "r1",
            "--rate",
            "1000",
        ],
    );
    assert!(
        stdout(&again).contains("replayed 10 of 10"),
        "{}",
        stdout(&again)
    );
    assert_eq!(
        common::consume_nats(&stream).await.len(),
        52,
        "r1 landed twice"
    );

    // A dry run lists and sends nothing.
    let dry = replay(
        &manifest,
        &db.url,
        &["--ids", &format!("{},{}", ids[0], ids[5]), "--dry-run"],
    );
    let text = stdout(&dry);
    assert!(
        text.contains("2 rows marked published in the window: dry run")
            && text.contains(&format!("  {}  aggregate agg-0", ids[0])),
        "{text}"
    );
    assert_eq!(
        common::consume_nats(&stream).await.len(),
        52,
        "a dry run published"
    );
    let _ = stream.jetstream.delete_stream(&stream.name).await;
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_replay_sends_the_ids_given_with_the_replay_header() {
    let db = common::fresh_database().await;
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let (manifest, ids) = published(&db, &broker).await;
    let chosen = [ids[3], ids[4], ids[33]];
    let list = chosen.map(|id| id.to_string()).join(",");
    replay(&manifest, &db.url, &["--ids", &list, "--name", "k1"]);
    let all = tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
        .await
        .unwrap();
    assert_eq!(all.len(), 39, "36 first deliveries and 3 replays");
    let (mut first, mut again): (Vec<Received>, Vec<Received>) = all
        .into_iter()
        .partition(|r| !r.headers.contains_key("outbox-replay"));
    assert_eq!(first.len(), 36);
    again.sort_by_key(|r| r.id);
    first.sort_by_key(|r| r.id);
    let mut ordered = first;
    let n = ordered.len();
    ordered.extend(again);
    assert_eq!(replayed(&ordered, n, "k1"), chosen.to_vec());
    db.drop_database().await;
}
