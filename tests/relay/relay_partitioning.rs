//! Keyed records land on the partition the Java client would choose (murmur2 of the
//! key, as Kafka Connect and Debezium produce them), so a consumer group migrating from
//! Debezium's outbox router sees each aggregate on the partition it saw it on before.
//! The expected partitions come from Kafka's own `Utils.murmur2`, run from the rig's
//! Kafka jars, not from our code.

use crate::common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use outbox_operator::broker::kafka::{KafkaBroker, KafkaSettings};
use outbox_operator::broker::{Broker, BrokerKind, Shape, Step};
use outbox_operator::postgres::OutboxRow;

const PARTITIONS: i32 = 12;

/// Partition of each key by Java's `Utils.toPositive(Utils.murmur2(key)) % partitions`,
/// the Java producer's choice for a keyed record.
pub(crate) fn java_partitions(keys: &[String], partitions: i32) -> BTreeMap<String, i32> {
    let rig = common::Rig::load();
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("Murmur.java");
    std::fs::write(
        &source,
        // Keys go in as hex: Java decodes command-line arguments in the locale's
        // charset, which need not be UTF-8.
        r#"import org.apache.kafka.common.utils.Utils;
import java.util.HexFormat;
public class Murmur {
    public static void main(String[] args) {
        int partitions = Integer.parseInt(args[0]);
        for (int i = 1; i < args.length; i++) {
            byte[] key = HexFormat.of().parseHex(args[i]);
            System.out.println(args[i] + " " + Utils.toPositive(Utils.murmur2(key)) % partitions);
        }
    }
}
"#,
    )
    .unwrap();
    let output = std::process::Command::new("java")
        .arg("-cp")
        .arg(format!("{}/*", rig.get("OUTBOX_RIG_KAFKA_LIBS")))
        .arg(&source)
        .arg(partitions.to_string())
        .args(keys.iter().map(|k| hex(k)))
        .output()
        .unwrap_or_else(|err| panic!("cannot run java (the rig's Kafka needs it): {err}"));
    assert!(
        output.status.success(),
        "Kafka's murmur2 via java failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, p)| {
            let key = keys
                .iter()
                .find(|key| hex(key) == k)
                .unwrap_or_else(|| panic!("java answered for a key not asked: {k}"));
            (key.clone(), p.parse().unwrap())
        })
        .collect()
}

fn hex(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

/// Reads every record of `topic` and returns each key's partitions.
fn partitions_by_key(topic: &str, expected: usize) -> BTreeMap<String, Vec<i32>> {
    let mut found: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    for (key, partition, _) in records(topic, expected, Duration::ZERO) {
        found.entry(key).or_default().push(partition);
    }
    found
}

/// Reads `expected` records of `topic`, then goes on reading for `more` and fails if
/// any other arrives: each record's key, partition and `id` header, every partition's
/// in offset order.
fn records(topic: &str, expected: usize, more: Duration) -> Vec<(String, i32, String)> {
    use rdkafka::Message;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Headers;
    let consumer: BaseConsumer = common::kafka_config()
        .set("group.id", format!("verify-{}", common::unique_suffix()))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut assignment = rdkafka::TopicPartitionList::new();
    for p in 0..PARTITIONS {
        assignment
            .add_partition_offset(topic, p, rdkafka::Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut found = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut settled = None;
    loop {
        if found.len() >= expected {
            let until = *settled.get_or_insert_with(|| Instant::now() + more);
            if Instant::now() >= until {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {expected} records arrived",
            found.len()
        );
        let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let key = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        let id = message
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "id"))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        found.push((key, message.partition(), id));
        assert!(
            found.len() <= expected,
            "more records than the {expected} expected: {found:?}"
        );
    }
    found
}

/// The relay's Kafka publisher for `topic`, with the relay's default settings.
fn relay_broker(topic: &str) -> KafkaBroker {
    relay_broker_with(topic, &[])
}

/// The relay's Kafka publisher for `topic`, with `properties`.
pub(crate) fn relay_broker_with(topic: &str, properties: &[(&str, &str)]) -> KafkaBroker {
    KafkaBroker::new(&KafkaSettings {
        bootstrap_servers: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.to_owned(),
        tls: false,
        tls_files: Default::default(),
        sasl: None,
        properties: properties
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    })
    .unwrap()
}

/// The message the relay builds for row `id` of aggregate `key` (no placed partition).
fn keyed_message(topic: &str, id: i64, key: &str) -> outbox_operator::broker::Message {
    let row = OutboxRow {
        id: id.into(),
        aggregate_type: "order".into(),
        aggregate_id: Some(key.to_owned()),
        event_type: Some("Placed".into()),
        payload: Some(bytes::Bytes::from_static(b"{}")),
        extra: Vec::new(),
        partition: 0,
        created_at: None,
        timestamp: None,
    };
    Shape::new(BrokerKind::Kafka, topic).build(&row).unwrap()
}

#[tokio::test]
async fn keyed_records_land_where_the_java_client_puts_them() {
    let topic = common::fresh_topic(PARTITIONS).await;
    let broker = relay_broker(&topic);
    // Keys of several shapes: numeric, UUID-like, non-ASCII, long.
    let mut keys: Vec<String> = (0..40).map(|i| format!("order-{i}")).collect();
    keys.extend(
        [
            "42",
            "0b6f3c1e-9d2a-4f4e-8a51-3c1f2b9e7d10",
            "Ölfaß-Überweisung",
            "a-rather-long-aggregate-identifier-that-spans-more-than-one-murmur-block",
        ]
        .map(str::to_owned),
    );
    let mut id = 0;
    for (n, key) in keys.iter().enumerate() {
        // A chain of two: the second goes the way a chain's next message goes, alone
        // (the producer that does not linger) or crowded (the batching one).
        let mut previous = None;
        for _ in 0..2 {
            id += 1;
            let message = keyed_message(&topic, id, key);
            previous = Some(match previous {
                None => broker.publish(&message).await.unwrap(),
                Some(after) => {
                    let step = Step {
                        after,
                        crowded: n % 2 == 0,
                    };
                    broker.publish_next(&message, step).await.unwrap()
                }
            });
        }
    }
    let found = partitions_by_key(&topic, keys.len() * 2);
    let expected = java_partitions(&keys, PARTITIONS);
    assert_eq!(expected.len(), keys.len(), "java answered for every key");
    for key in &keys {
        let want = expected[key];
        assert_eq!(
            found.get(key),
            Some(&vec![want, want]),
            "key {key}: Java's murmur2 puts it on partition {want}"
        );
    }
    // Not every key on one partition (the check above would then prove little).
    let used: std::collections::BTreeSet<i32> = expected.values().copied().collect();
    assert!(used.len() > PARTITIONS as usize / 2, "{used:?}");
}

/// A chain's next message goes to the partition its predecessor was written to, not
/// where the partitioner would put its key: the relay's two producers keep their own
/// topic metadata, and while a topic gains partitions they may disagree on the count.
#[tokio::test]
async fn a_chains_next_message_follows_its_predecessor_to_its_partition() {
    let topic = common::fresh_topic(PARTITIONS).await;
    let broker = relay_broker(&topic);
    let key = "order-7".to_owned();
    let natural = java_partitions(std::slice::from_ref(&key), PARTITIONS)[&key];
    let elsewhere = (natural + 1) % PARTITIONS;
    let message = keyed_message(&topic, 1, &key);
    let first = broker.publish(&message).await.unwrap();
    assert_eq!(first.partition, Some(natural));
    // As if the predecessor had been written elsewhere (a producer that saw another
    // partition count): the next message follows it there.
    // Alone and crowded alike.
    let after = outbox_operator::broker::Delivered {
        partition: Some(elsewhere),
    };
    for crowded in [false, true] {
        let next = broker
            .publish_next(&message, Step { after, crowded })
            .await
            .unwrap();
        assert_eq!(next.partition, Some(elsewhere), "crowded: {crowded}");
    }
    let mut found = partitions_by_key(&topic, 3)
        .remove(&key)
        .unwrap_or_default();
    found.sort_unstable();
    let mut want = vec![natural, elsewhere, elsewhere];
    want.sort_unstable();
    assert_eq!(found, want, "where the two records of {key} landed");
}

/// The rest of a chain goes out at once, once its first message is acknowledged: every
/// message to the partition the first one was written to, in order.
#[tokio::test]
async fn a_chains_rest_goes_out_at_once_in_order_to_its_first_messages_partition() {
    let topic = common::fresh_topic(PARTITIONS).await;
    let broker = relay_broker(&topic);
    let key = "order-11".to_owned();
    let natural = java_partitions(std::slice::from_ref(&key), PARTITIONS)[&key];
    let first = broker
        .publish(&keyed_message(&topic, 1, &key))
        .await
        .unwrap();
    assert_eq!(first.partition, Some(natural));
    let rest: Vec<_> = (2..=300)
        .map(|id| keyed_message(&topic, id, &key))
        .collect();
    let outcomes = broker
        .publish_rest(&rest, first, false, &outbox_operator::broker::Clear)
        .await;
    assert_eq!(outcomes.len(), rest.len());
    for outcome in &outcomes {
        assert_eq!(outcome.as_ref().unwrap().partition, Some(natural));
    }
    // As if the first one had been written elsewhere (a producer that saw another
    // partition count): the rest follows it there.
    let elsewhere = (natural + 1) % PARTITIONS;
    let rest: Vec<_> = (301..=310)
        .map(|id| keyed_message(&topic, id, &key))
        .collect();
    let after = outbox_operator::broker::Delivered {
        partition: Some(elsewhere),
    };
    let outcomes = broker
        .publish_rest(&rest, after, false, &outbox_operator::broker::Clear)
        .await;
    assert!(
        outcomes
            .iter()
            .all(|o| o.as_ref().unwrap().partition == Some(elsewhere))
    );

    let found = records(&topic, 310, Duration::ZERO);
    let on = |partition: i32| -> Vec<i64> {
        found
            .iter()
            .filter(|(_, p, _)| *p == partition)
            .map(|(_, _, id)| id.parse().unwrap())
            .collect()
    };
    assert_eq!(on(natural), (1..=300).collect::<Vec<_>>());
    assert_eq!(on(elsewhere), (301..=310).collect::<Vec<_>>());
}

/// A message of a chain's rest that the broker refuses stops the producer (the
/// gap-less guarantee): none of the messages queued behind it is written, so the chain
/// can be published again from the refused one and keep its order. Each message
/// travels in a request of its own here (`batch.num.messages: 1`), so without the
/// guarantee librdkafka would write the ones after the refused one.
#[tokio::test]
async fn nothing_queued_behind_a_refused_message_of_a_chains_rest_is_written() {
    let topic = format!("test-{}", common::unique_suffix());
    // The broker refuses records stamped more than an hour ahead.
    common::create_topic(
        common::Rig::load().kafka_bootstrap(),
        &topic,
        PARTITIONS,
        &[("message.timestamp.after.max.ms", "3600000")],
    )
    .await;
    let broker = relay_broker_with(&topic, &[("batch.num.messages", "1")]);
    let key = "order-12".to_owned();
    let first = broker
        .publish(&keyed_message(&topic, 1, &key))
        .await
        .unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let rest: Vec<_> = (2..=40)
        .map(|id| {
            let mut message = keyed_message(&topic, id, &key);
            if id == 5 {
                message.timestamp_ms = Some(now_ms + 86_400_000);
            }
            message
        })
        .collect();
    let outcomes = broker
        .publish_rest(&rest, first, false, &outbox_operator::broker::Clear)
        .await;
    // 2, 3 and 4 written; 5 refused as the row's fault; nothing after it.
    assert_refused_after(&topic, &outcomes, 3);
    // The relay goes on with a new producer: the chain again from the refused message,
    // now acceptable.
    let rest: Vec<_> = (5..=40).map(|id| keyed_message(&topic, id, &key)).collect();
    let outcomes = broker
        .publish_rest(&rest, first, false, &outbox_operator::broker::Clear)
        .await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(broker.broken(), None);
    let found = records(&topic, 40, Duration::ZERO);
    let ids: Vec<i64> = found.iter().map(|(_, _, id)| id.parse().unwrap()).collect();
    assert_eq!(ids, (1..=40).collect::<Vec<_>>());
}

/// A message of a chain's rest that the producer refuses before queueing it (larger
/// than `message.max.bytes`) ends the rest: the ones after it are not queued, so none
/// is written ahead of it.
#[tokio::test]
async fn a_chains_rest_stops_queueing_at_a_message_the_producer_refuses() {
    let topic = common::fresh_topic(PARTITIONS).await;
    let broker = relay_broker_with(&topic, &[("message.max.bytes", "1000")]);
    let key = "order-13".to_owned();
    let first = broker
        .publish(&keyed_message(&topic, 1, &key))
        .await
        .unwrap();
    let mut rest: Vec<_> = (2..=6).map(|id| keyed_message(&topic, id, &key)).collect();
    rest[2].payload = Some(bytes::Bytes::from(vec![b'x'; 2000]));
    let outcomes = broker
        .publish_rest(&rest, first, false, &outbox_operator::broker::Clear)
        .await;
    // 2 and 3 written; 4 refused as the row's fault; 5 and 6 never queued.
    assert_refused_after(&topic, &outcomes, 2);
}

/// Asserts that a chain's rest (after its first message, id 1) was acknowledged for
/// `acknowledged` messages and then refused as the row's fault, and that `topic`
/// holds ids 1 to `acknowledged` + 1 in order and nothing else, 3 s on.
fn assert_refused_after(
    topic: &str,
    outcomes: &[Result<
        outbox_operator::broker::Delivered,
        outbox_operator::broker::PublishError,
    >],
    acknowledged: usize,
) {
    assert_eq!(outcomes.len(), acknowledged + 1, "{outcomes:?}");
    assert!(
        outcomes[..acknowledged].iter().all(Result::is_ok),
        "{outcomes:?}"
    );
    let err = outcomes[acknowledged].as_ref().expect_err("refused");
    assert!(err.is_refused(), "{err:?}");
    let found = records(topic, acknowledged + 1, Duration::from_secs(3));
    let ids: Vec<String> = found.into_iter().map(|(_, _, id)| id).collect();
    let expected: Vec<String> = (1..=acknowledged + 1).map(|id| id.to_string()).collect();
    assert_eq!(ids, expected);
}
