//! Kafka compression: `compression.type` reaches the broker with each codec the relay's
//! librdkafka build offers, as the broker's own log segments show, and consumers read
//! the same records back.

use crate::common;
use crate::relay_partitioning::relay_broker_with;

use outbox_operator::broker::{Broker, BrokerKind, Shape};
use outbox_operator::postgres::OutboxRow;

/// The codec of every record batch in partition 0 of `topic`, as the broker stored it:
/// the low three bits of each batch's attributes (Kafka's record batch format v2:
/// base offset, length, leader epoch, magic, CRC, then the attributes), read from the
/// rig's Kafka log segment, not through a client, which would decompress silently.
fn stored_codecs(topic: &str) -> Vec<u16> {
    let dir = common::Rig::load()
        .run_dir()
        .join("kafka/data")
        .join(format!("{topic}-0"));
    let mut codecs = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display())) {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let log = std::fs::read(&path).unwrap();
        let mut at = 0;
        while at + 23 <= log.len() {
            let length = u32::from_be_bytes(log[at + 8..at + 12].try_into().unwrap()) as usize;
            assert_eq!(log[at + 16], 2, "record batch format v2");
            codecs.push(u16::from_be_bytes(log[at + 21..at + 23].try_into().unwrap()) & 0x7);
            at += 12 + length;
        }
    }
    codecs
}

/// `compression.type` reaches the broker: with each codec librdkafka offers (zstd
/// included), the relay's producer writes batches the broker stores with that codec,
/// and a consumer reads back the same payloads, in order, with their ids. (The payloads
/// repeat themselves, as JSON events do: librdkafka sends a batch uncompressed when the
/// codec would not make it smaller.)
#[tokio::test]
async fn each_codec_is_stored_as_set_and_read_back_whole() {
    // Kafka's codec numbers in a batch's attributes.
    for (codec, stored) in [("gzip", 1), ("snappy", 2), ("lz4", 3), ("zstd", 4)] {
        let topic = common::fresh_topic(1).await;
        let broker = relay_broker_with(&topic, &[("compression.type", codec)]);
        let shape = Shape::new(BrokerKind::Kafka, &topic);
        let payloads: Vec<String> = (1..=50)
            .map(|i| {
                format!(
                    r#"{{"order":{i},"customer":"c-{}","items":[{}]}}"#,
                    i % 7,
                    (0..20)
                        .map(|n| format!(r#"{{"sku":"SKU-{n:04}","qty":{}}}"#, (i + n) % 5))
                        .collect::<Vec<_>>()
                        .join(",")
                )
            })
            .collect();
        let messages: Vec<_> = payloads
            .iter()
            .zip(1..)
            .map(|(payload, id)| {
                let row = OutboxRow {
                    id: outbox_operator::broker::RowId::Int(id),
                    aggregate_type: "order".into(),
                    aggregate_id: Some("order-1".into()),
                    event_type: Some("Placed".into()),
                    payload: Some(bytes::Bytes::from(payload.clone())),
                    extra: Vec::new(),
                    partition: 0,
                    created_at: None,
                    timestamp: None,
                };
                shape.build(&row).unwrap()
            })
            .collect();
        // A chain: the first alone, the rest together once it is acknowledged.
        let after = broker.publish(&messages[0]).await.unwrap();
        for outcome in broker
            .publish_rest(&messages[1..], after, true, &outbox_operator::broker::Clear)
            .await
        {
            outcome.unwrap();
        }
        let read: Vec<(i64, String)> = tokio::task::spawn_blocking({
            let topic = topic.clone();
            move || common::consume_kafka(&topic)
        })
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.id, String::from_utf8_lossy(&r.payload).into_owned()))
        .collect();
        let written: Vec<(i64, String)> = (1..).zip(payloads.iter().cloned()).collect();
        assert_eq!(read, written, "{codec}: the records as written, in order");
        let codecs = stored_codecs(&topic);
        assert!(!codecs.is_empty(), "{codec}: no batch stored");
        assert!(
            codecs.iter().all(|c| *c == stored),
            "{codec}: the broker stored batches with codecs {codecs:?}, not {stored}"
        );
    }
}
