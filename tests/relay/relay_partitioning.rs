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
    use rdkafka::Message;
    use rdkafka::consumer::{BaseConsumer, Consumer};
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
    let mut found: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    let mut count = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while count < expected {
        assert!(
            Instant::now() < deadline,
            "only {count} of {expected} records arrived"
        );
        let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let key = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        found.entry(key).or_default().push(message.partition());
        count += 1;
    }
    found
}

/// The relay's Kafka publisher for `topic`, with the relay's default settings.
fn relay_broker(topic: &str) -> KafkaBroker {
    KafkaBroker::new(&KafkaSettings {
        bootstrap_servers: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.to_owned(),
        tls: false,
        tls_files: Default::default(),
        sasl: None,
        properties: Default::default(),
    })
    .unwrap()
}

/// The message the relay builds for row `id` of aggregate `key` (no placed partition).
fn keyed_message(topic: &str, id: i64, key: &str) -> outbox_operator::broker::Message {
    let row = OutboxRow {
        id,
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
