//! `audit`'s reading of Kafka: the ids of the records a topic received from a time on,
//! in each partition's order, read with the relay's own client settings (and so its
//! credentials), as a consumer that joins no group and commits nothing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::Offset;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};

use super::settings::{KafkaSettings, client_config};
use crate::broker::ReadError;

/// How long one metadata, offset or poll request may take.
const REQUEST: Duration = Duration::from_secs(10);

/// The `id` header of every record `topic` received at or after `since_ms` (Unix
/// milliseconds) up to its end when the read began, partition by partition, each in
/// offset order (an aggregate's records share a partition, so its order is kept). A
/// record without an `id` header (not the relay's) is left out.
pub fn ids_since(k: &KafkaSettings, topic: &str, since_ms: i64) -> Result<Vec<String>, ReadError> {
    let failed =
        |what: String| move |e: rdkafka::error::KafkaError| ReadError::failed("Kafka", what, e);
    let mut config = client_config(k);
    config
        .set(
            "group.id",
            format!("outbox-operator-audit-{}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest");
    let consumer: BaseConsumer = config
        .create()
        .map_err(failed("making a consumer".to_owned()))?;
    let metadata = consumer
        .fetch_metadata(Some(topic), REQUEST)
        .map_err(failed(format!("metadata of {topic}")))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic)
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        return Err(ReadError::Missing {
            broker: "Kafka",
            destination: topic.to_owned(),
        });
    }
    let mut at_time = TopicPartitionList::new();
    for p in &partitions {
        at_time
            .add_partition_offset(topic, *p, Offset::Offset(since_ms))
            .map_err(failed(format!("offsets of {topic}")))?;
    }
    let starts = consumer
        .offsets_for_times(at_time, REQUEST)
        .map_err(failed(format!("offsets of {topic} at the window's start")))?;
    // Per partition: where to start and the end to read up to (exclusive).
    let mut assign = TopicPartitionList::new();
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for element in starts.elements() {
        let partition = element.partition();
        let (_, high) = consumer
            .fetch_watermarks(topic, partition, REQUEST)
            .map_err(failed(format!("end of {topic}/{partition}")))?;
        let Offset::Offset(start) = element.offset() else {
            // No record at or after the time: nothing to read there.
            continue;
        };
        if start < high {
            assign
                .add_partition_offset(topic, partition, Offset::Offset(start))
                .map_err(failed(format!("offsets of {topic}")))?;
            ends.insert(partition, high);
        }
    }
    let mut read: HashMap<i32, Vec<String>> = HashMap::new();
    if !ends.is_empty() {
        consumer
            .assign(&assign)
            .map_err(failed(format!("assigning {topic}")))?;
    }
    let mut quiet_since = Instant::now();
    while !ends.is_empty() {
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(record)) => {
                quiet_since = Instant::now();
                let partition = record.partition();
                let id = record.headers().and_then(|headers| {
                    headers
                        .iter()
                        .find(|h| h.key == "id")
                        .and_then(|h| h.value)
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                });
                if let Some(id) = id {
                    read.entry(partition).or_default().push(id);
                }
                if ends
                    .get(&partition)
                    .is_some_and(|end| record.offset() + 1 >= *end)
                {
                    ends.remove(&partition);
                }
            }
            Some(Err(e)) => return Err(failed(format!("reading {topic}"))(e)),
            None if quiet_since.elapsed() > REQUEST => {
                return Err(ReadError::failed(
                    "Kafka",
                    format!("reading {topic}"),
                    format!("nothing for {REQUEST:?} before its end was reached"),
                ));
            }
            None => {}
        }
    }
    let mut by_partition: Vec<(i32, Vec<String>)> = read.into_iter().collect();
    by_partition.sort_by_key(|(p, _)| *p);
    Ok(by_partition.into_iter().flat_map(|(_, ids)| ids).collect())
}
