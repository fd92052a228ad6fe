//! Smoke test: the rig's Kafka broker round-trips a keyed record with headers, seen by rdkafka and by kcat.

use crate::common;

use std::time::Duration;

use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

const KEY: &str = "order-17";
const PAYLOAD: &str = r#"{"orderId":17,"total":"9.99"}"#;
const ID: &str = "4711";
const TYPE: &str = "OrderCreated";

#[tokio::test]
async fn kafka_round_trips_a_record_with_key_and_headers() {
    let rig = common::Rig::load();
    let topic = common::fresh_topic(1).await;

    let producer: FutureProducer = common::kafka_config()
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .create()
        .unwrap();
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "id",
            value: Some(ID),
        })
        .insert(Header {
            key: "type",
            value: Some(TYPE),
        });
    let delivery = producer
        .send(
            FutureRecord::to(&topic)
                .key(KEY)
                .payload(PAYLOAD)
                .headers(headers),
            Duration::from_secs(20),
        )
        .await
        .unwrap_or_else(|(err, _)| panic!("Kafka did not acknowledge the record: {err}"));
    assert_eq!((delivery.partition, delivery.offset), (0, 0));

    let consumer: StreamConsumer = common::kafka_config()
        .set("group.id", format!("test-{}", common::unique_suffix()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[&topic]).unwrap();
    let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
        .await
        .expect("the consumer received nothing within 30s")
        .unwrap();
    assert_eq!(message.key(), Some(KEY.as_bytes()));
    assert_eq!(message.payload(), Some(PAYLOAD.as_bytes()));
    let received: Vec<(String, Option<Vec<u8>>)> = message
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        received,
        vec![
            ("id".to_string(), Some(ID.as_bytes().to_vec())),
            ("type".to_string(), Some(TYPE.as_bytes().to_vec())),
        ]
    );

    // An independent client (kcat, its own librdkafka build) sees the same record.
    let kcat = tokio::process::Command::new(rig.kcat())
        .args([
            "-b",
            rig.kafka_bootstrap(),
            "-C",
            "-t",
            &topic,
            "-o",
            "beginning",
            "-e",
            "-q",
        ])
        .args(["-f", "%k|%s|%h\\n"])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(30), kcat)
        .await
        .expect("kcat did not finish within 30s")
        .unwrap();
    assert!(
        output.status.success(),
        "kcat failed:\n{}",
        common::describe_output(&output)
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("{KEY}|{PAYLOAD}|id={ID},type={TYPE}"),
        "kcat saw something else:\n{}",
        common::describe_output(&output)
    );
}
