//! Kafka publisher: two idempotent rdkafka `FutureProducer`s with `acks=all`, one that
//! batches and one that sends at once.
//!
//! # A chain's rest goes out at once
//!
//! A batch's chains (one per aggregate, see `relay::chains`) start together: their first
//! messages arrive in a burst, and `linger.ms` lets librdkafka pack the burst into a few
//! produce requests. Once a chain's first message is acknowledged, and so its partition
//! is known, the rest of the chain goes out at once through the same batching producer,
//! to that partition: one round trip for the lot. (Until then each next message waited
//! for its predecessor's acknowledgement: an aggregate with N events in a batch cost N
//! round trips, and a relay on ten busy aggregates drained at 14,416 events/s where it
//! now drains 96,733; see docs/performance.md.)
//!
//! Kafka writes a partition in the order an idempotent producer sent to it, so waiting
//! is not what keeps order. What must never happen is a gap: a message written behind
//! one of its chain that was given up, which the relay would then publish again after
//! its successors. librdkafka makes gaps in two ways, and the relay closes both:
//!
//! - **It times messages out.** A message still queued when `message.timeout.ms`
//!   expires is dropped and the ones behind it are renumbered and sent. So librdkafka's
//!   timeout is off (`message.timeout.ms=0`, retries unlimited), and the relay keeps the
//!   user's `message.timeout.ms` itself ([`deadline`]): a message not acknowledged by
//!   then fails and its producer is *withdrawn*: nothing more is queued on it, it is
//!   retired (the next send makes a new one) and purged. librdkafka never gave the
//!   message up, so nothing behind it in its partition can be written before it; what
//!   the producer still sends before the purge runs are copies the next producer sends
//!   again (repeats, in order).
//! - **It goes on after a refusal.** A record the broker refuses (a timestamp out of the
//!   topic's bounds, say) fails, and librdkafka renumbers and sends the messages behind
//!   it. With `enable.gapless.guarantee` it stops the producer instead (a fatal error;
//!   the producer is retired). The relay also withdraws the producer itself when a
//!   message of a chain's rest fails with messages queued behind it, and stops queueing
//!   a rest at a message refused before it is queued (larger than `message.max.bytes`).
//!   `tests/relay/relay_partitioning.rs` sends a rest whose fourth message the broker
//!   refuses, each message in a request of its own: without both guards Kafka wrote the
//!   fifth.
//!
//! # Why two producers
//!
//! A chain's lone next message (a rest of one) travels alone: waiting `linger.ms` for
//! company that will not come adds that wait to every such step (one hot aggregate
//! drained at 738 events/s with `linger.ms=1`, when each step waited for the last).
//! `linger.ms=0` for everything removes the wait but sends the bursts in tiny requests
//! (the polling benchmark lost a fifth of its rate and used 80% more CPU). So lone next
//! messages go through a second producer with `linger.ms=0`, unless the step is
//! crowded: while many chains of a batch are still sending, their next messages come in
//! bursts too (as their predecessors' acknowledgements arrive), and sent one by one each
//! was a produce request of its own (chains of two doubled the CPU per event of relay
//! and Kafka), so those go through the batching producer
//! ([`crate::relay::chains::CROWD`]).
//!
//! The second producer is made on the first lone chain step, not with the relay: an
//! idempotent producer connects at once for its producer id, and a relay whose chains
//! are all one message long (`ordering.mode: none`, or every aggregate once per batch)
//! would hold a second connection to every broker for nothing.
//!
//! Order holds across the two: a chain's next messages are produced only after its
//! first one is acknowledged (written with `acks=all`), whichever producer wrote it, and
//! to the partition the first one was written to (the producers' metadata may disagree
//! for a while about a topic's partition count).
//!
//! # A producer whose message timed out is replaced
//!
//! A message that was not acknowledged within `message.timeout.ms` means the producer
//! could not reach the partition's leader for that long. Usually the broker is down and
//! the producer finds it again once it is back, but not always: librdkafka (since 2.10)
//! forgets every broker a metadata response leaves out, and a single broker answers
//! without itself while it shuts down. The producer then knows no broker at all and
//! never asks again (confluentinc/librdkafka#5301, open): the relay would retry into it
//! forever. Withdrawing the producer after a timeout (above) also cures that: the next
//! send makes a fresh one from `bootstrap.servers`. Sends already under way on the old
//! one fail with it, and it is closed when the last of them is done. One thing differs
//! from a retry on the same producer: a broker that stalled with a timed-out message in
//! its buffer and writes it late is not stopped by a newer producer id, so that late
//! copy can land after the message's successors, as copies do after a relay restart.
//! Consumers that drop ids they have seen (at-least-once, the row id as message id)
//! see each aggregate in order either way.

//!
//! # Files
//!
//! This file holds the publisher; beside it: the producers it keeps and replaces
//! (`producer`), the settings of a Kafka relay with its spec rules and Secrets
//! (`settings`), the rules of librdkafka properties and the relay's own message
//! timeout (`properties`), and `check`'s questions to Kafka (`probe`).

mod probe;
mod producer;
mod properties;
pub mod read;
mod settings;

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureRecord, Producer, PurgeConfig};

use super::{Broker, Clearance, Delivered, Message, PublishError, Step};
use producer::{KafkaProducer, Slot};
use properties::deadline;
use settings::{client_config, eager_config};

pub use probe::probe;
pub use properties::partitioner_scatters_keys;
pub(crate) use properties::{deadline_culprits, refused_by_librdkafka};
pub use settings::{KafkaSettings, check, secrets, settings};

/// Publishes to Kafka. The producers reconnect by themselves after an outage, and one
/// whose message timed out is replaced (see the module's notes).
pub struct KafkaBroker {
    /// A batch's burst of chain starts, and the rest of a chain: `linger.ms` as
    /// configured.
    batching: Slot,
    /// A chain's lone next message while few chains send: `linger.ms=0`; made on the
    /// first such step.
    eager: Slot,
    /// How long a message may wait for its acknowledgement (`message.timeout.ms`):
    /// enforced here, not by librdkafka (see the module's notes); `None`: forever.
    deadline: Option<Duration>,
}

/// Producers of one kind (batching, or chain steps) that stop on a fatal error, one
/// after another with no acknowledgement between, before the relay gives up and
/// restarts (a refused producer id, say, fails every producer the same way: a restart
/// loop shows it where retries would not). Counted per kind: a cause that stops both
/// kinds' producers at once is one more in a row for each kind, not two. (With the
/// kinds stopping in turn, up to five producers in all may stop before a restart.)
const FATAL_IN_A_ROW: u32 = 3;

impl KafkaBroker {
    /// Builds the batching producer now, so wrong settings fail the relay's start (the
    /// chain steps' producer comes with the first chain step).
    pub fn new(config: &KafkaSettings) -> Result<Self, PublishError> {
        let broker = Self {
            batching: Slot::new("batching", client_config(config)),
            eager: Slot::new("chain steps", eager_config(config)),
            deadline: deadline(&config.properties)
                .map_err(|err| PublishError::outage(err.to_string()))?,
        };
        broker.batching.get()?;
        Ok(broker)
    }

    /// [`Self::send`] through the batching producer.
    async fn send_batching(
        &self,
        message: &Message,
        partition: Option<i32>,
    ) -> Result<Delivered, PublishError> {
        let producer = self.batching.get()?;
        self.send(&producer, message, partition)
            .await
            .map_err(|failure| self.failed(&self.batching, &producer, failure))
    }

    /// Produces `message` through `producer`, to `partition` when given (else where
    /// the partitioner puts its key), and waits for its acknowledgement.
    async fn send(
        &self,
        producer: &KafkaProducer,
        message: &Message,
        partition: Option<i32>,
    ) -> Result<Delivered, Failure> {
        let room_by = tokio::time::Instant::now() + ROOM_WAIT;
        let future = enqueue(producer, record(message, partition), room_by).await?;
        let delivered = acknowledged(message, self.pending(future)).await?;
        self.clear_fatal_counts();
        Ok(delivered)
    }

    /// A message just queued, to be acknowledged within the deadline.
    fn pending(&self, future: DeliveryFuture) -> Pending {
        Pending {
            deadline: self.deadline.map(|d| tokio::time::Instant::now() + d),
            future,
        }
    }

    /// Sends the rest of a chain through the batching producer, all at once, to
    /// `partition` (see the module's notes on why nothing after a failure is written).
    async fn send_rest(
        &self,
        messages: &[Message],
        partition: Option<i32>,
    ) -> Vec<Result<Delivered, PublishError>> {
        let slot = &self.batching;
        let producer = match slot.get() {
            Ok(producer) => producer,
            Err(err) => return vec![Err(err)],
        };
        // One wait for room for the whole rest, as for a single send: the polling
        // relay's fence was checked before it.
        let room_by = tokio::time::Instant::now() + ROOM_WAIT;
        let mut pending = Vec::with_capacity(messages.len());
        let mut refused = None;
        for message in messages {
            let partition = message.partition.or(partition);
            match enqueue(&producer, record(message, partition), room_by).await {
                Ok(future) => pending.push(self.pending(future)),
                // Refused before it was queued (too large, say; or the producer was
                // withdrawn meanwhile): the ones after it are not queued either.
                Err(failure) => {
                    refused = Some(self.failed(slot, &producer, failure));
                    break;
                }
            }
        }
        let queued = pending.len();
        let mut outcomes = Vec::with_capacity(messages.len());
        for (message, delivery) in messages.iter().zip(pending) {
            match acknowledged(message, delivery).await {
                Ok(delivered) => {
                    self.clear_fatal_counts();
                    outcomes.push(Ok(delivered));
                }
                Err(failure) => {
                    let err = self.failed(slot, &producer, failure);
                    // Those queued after it must not be written before it is retried:
                    // withdraw them with the producer (the next send makes a new one).
                    if outcomes.len() + 1 < queued {
                        self.withdraw(slot, &producer);
                    }
                    outcomes.push(Err(err));
                    return outcomes;
                }
            }
        }
        if let Some(refused) = refused {
            outcomes.push(Err(refused));
        }
        outcomes
    }

    /// Clears both kinds' counts of producers stopped on a fatal error
    /// ([`FATAL_IN_A_ROW`]): an acknowledgement shows the cluster takes this client's
    /// writes.
    fn clear_fatal_counts(&self) {
        for slot in [&self.batching, &self.eager] {
            slot.fatal_in_a_row.store(0, Ordering::Relaxed);
        }
    }

    /// What a failed send through `producer` of `slot` means for the relay. A message
    /// not acknowledged in time withdraws its producer; one that can no longer send (a
    /// fatal error) is retired. The next send makes a new one either way.
    fn failed(&self, slot: &Slot, producer: &Arc<KafkaProducer>, failure: Failure) -> PublishError {
        let err = match failure {
            Failure::Kafka(err) => err,
            Failure::TimedOut => {
                if self.withdraw(slot, producer) {
                    tracing::warn!(
                        producer = slot.name,
                        "a message timed out: the next one goes through a new Kafka producer"
                    );
                }
                return PublishError::outage(described(
                    producer,
                    "message timed out: not acknowledged within message.timeout.ms",
                ));
            }
            Failure::Closed => {
                return PublishError::outage(
                    "Kafka: the producer was replaced before the message was acknowledged",
                );
            }
        };
        let failure = classify(&err, producer);
        let fatal = producer.client.client().fatal_error();
        if let Some((code, _)) = fatal
            && slot.retire(producer)
        {
            slot.stopped_fatally(code);
            tracing::warn!(
                producer = slot.name,
                error = %failure,
                "the Kafka producer stopped on a fatal error: the next message goes through a new one"
            );
        }
        failure
    }

    /// Withdraws `producer`: no message is queued on it any more, it is retired if it
    /// is still `slot`'s (the next send makes a new one), and it is purged: what it has
    /// not sent by then is dropped (it fails as not acknowledged), and of what it has
    /// sent the broker can only have written the oldest of each partition, in order
    /// (idempotence). It never gave the failed message up itself, so nothing of that
    /// message's chain can be written behind it; what goes out before the purge runs
    /// is a late copy of what the next producer sends again. Returns whether it
    /// retired it.
    fn withdraw(&self, slot: &Slot, producer: &Arc<KafkaProducer>) -> bool {
        let already = std::mem::replace(
            &mut *producer
                .withdrawn
                .0
                .write()
                .unwrap_or_else(PoisonError::into_inner),
            true,
        );
        let retired = slot.retire(producer);
        // Nothing is queued on it after the flag, so one purge covers every failure
        // that withdraws it (hundreds of chains time out together in an outage).
        if already {
            return retired;
        }
        // A purge waits for every broker thread of the producer to take it, which can
        // take a while (one resolving a name, say): off the async threads.
        let purged = producer.clone();
        let purge = move || {
            purged
                .client
                .purge(PurgeConfig::default().queue().inflight());
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(purge)),
            Err(_) => purge(),
        }
        retired
    }
}

/// Why a send failed, before it is classified.
#[derive(Debug)]
enum Failure {
    /// librdkafka refused or failed the message.
    Kafka(KafkaError),
    /// Not acknowledged within the deadline.
    TimedOut,
    /// The producer was withdrawn, or dropped with the message in it.
    Closed,
}

/// Waits for a queued message's acknowledgement, at most until its deadline.
async fn acknowledged(message: &Message, delivery: Pending) -> Result<Delivered, Failure> {
    let outcome = match delivery.deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, delivery.future)
            .await
            .map_err(|_| Failure::TimedOut)?,
        None => delivery.future.await,
    };
    match outcome {
        Ok(Ok(delivery)) => Ok(Delivered {
            // Only a partition the partitioner chose carries over to the chain's next
            // message; a placed one was this message's alone.
            partition: message.partition.is_none().then_some(delivery.partition),
        }),
        Ok(Err((err, _))) => Err(Failure::Kafka(err)),
        Err(_) => Err(Failure::Closed),
    }
}

/// A message in librdkafka's queue: its acknowledgement, and until when the relay waits
/// for it.
struct Pending {
    deadline: Option<tokio::time::Instant>,
    future: DeliveryFuture,
}

/// A record of `message`, to `partition` when given.
fn record(message: &Message, partition: Option<i32>) -> FutureRecord<'_, str, [u8]> {
    let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
    for (key, value) in &message.headers {
        headers = headers.insert(Header {
            key,
            value: Some(value.as_bytes()),
        });
    }
    let mut record = FutureRecord::to(&message.destination).headers(headers);
    // No payload: a tombstone (a record with a null value).
    if let Some(payload) = &message.payload {
        record = record.payload(&payload[..]);
    }
    if let Some(key) = &message.key {
        record = record.key(key.as_str());
    }
    if let Some(ms) = message.timestamp_ms {
        record = record.timestamp(ms);
    }
    if let Some(partition) = partition {
        record = record.partition(partition);
    }
    record
}

/// How long a send, or a chain's whole rest, waits for room in the producer's queue.
const ROOM_WAIT: Duration = Duration::from_secs(10);

/// Puts `record` in `producer`'s queue, waiting until `room_by` for room in it; never
/// on a withdrawn producer.
async fn enqueue(
    producer: &KafkaProducer,
    mut record: FutureRecord<'_, str, [u8]>,
    room_by: tokio::time::Instant,
) -> Result<DeliveryFuture, Failure> {
    loop {
        let queued = {
            let withdrawn = producer
                .withdrawn
                .0
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            if *withdrawn {
                return Err(Failure::Closed);
            }
            producer.client.send_result(record)
        };
        match queued {
            Ok(future) => return Ok(future),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                if tokio::time::Instant::now() < room_by =>
            {
                record = back;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err((err, _)) => return Err(Failure::Kafka(err)),
        }
    }
}

/// Errors that say this message will never be accepted as it is: its size, its
/// record, its timestamp, a topic name its own aggregate type makes invalid. Not a
/// topic that does not exist (yet), a partition the topic lacks, or a topic the user
/// may not write: the cluster's configuration, which is fixed without touching the
/// row — as outages they are retried and never count toward `maxAttempts`, so an ACL
/// mistake does not dead-letter every row of a topic.
fn is_row_fault(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidMessage
            | RDKafkaErrorCode::InvalidRecord
            // The record's timestamp (the event's time) is further ahead than the
            // topic's `message.timestamp.after.max.ms` allows.
            | RDKafkaErrorCode::InvalidTimestamp
            | RDKafkaErrorCode::InvalidTopic
    )
}

/// What went wrong, with the last connection error `producer` reported (why it cannot
/// reach a broker, when that is the cause).
fn described(producer: &KafkaProducer, what: impl std::fmt::Display) -> String {
    match producer.last_error.get() {
        Some(cause) => format!("Kafka: {what} (last client error: {cause})"),
        None => format!("Kafka: {what}"),
    }
}

fn classify(err: &KafkaError, producer: &KafkaProducer) -> PublishError {
    let text = described(producer, err);
    match (
        err.rdkafka_error_code(),
        producer.client.client().fatal_error(),
    ) {
        // The message the broker refused: with the gap-less guarantee its refusal also
        // stops the producer (the messages queued behind it fail as fatal, below), but
        // it is still this row's fault.
        (Some(code), _) if is_row_fault(code) => PublishError::refused(text),
        // A fatal error stops the producer; it is retired and the next send makes a
        // new one. Nothing was marked, so nothing is lost.
        (_, Some((code, reason))) => {
            PublishError::outage(format!("Kafka producer fatal error {code:?}: {reason}"))
        }
        _ => PublishError::outage(text),
    }
}

impl Broker for KafkaBroker {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>> {
        Box::pin(self.send_batching(message, message.partition))
    }

    /// Sends to the partition the predecessor went to (the two producers keep their
    /// own topic metadata, and while a topic gains partitions one may know the new
    /// count before the other, so the partitioner alone could put an aggregate's
    /// events on two partitions): through the producer that does not linger, unless
    /// the step is crowded, when the batching producer packs it with the other chains'
    /// steps of that moment (sent alone, each would be a produce request of its own).
    fn publish_next<'a>(
        &'a self,
        message: &'a Message,
        step: Step,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>> {
        Box::pin(async move {
            let partition = message.partition.or(step.after.partition);
            if step.crowded {
                return self.send_batching(message, partition).await;
            }
            let eager = match self.eager.get() {
                Ok(eager) => eager,
                // Its settings are the batching producer's, so this should not happen;
                // if it does, the step waits for company (slower, same order).
                Err(err) => {
                    tracing::warn!(error = %err, "sending a chain step through the batching producer");
                    return self.send_batching(message, partition).await;
                }
            };
            match self.send(&eager, message, partition).await {
                // This producer has not seen the partition yet (its metadata lags the
                // other's); nothing was sent: the batching producer, which wrote the
                // predecessor there, sends it.
                Err(Failure::Kafka(err))
                    if err.rdkafka_error_code() == Some(RDKafkaErrorCode::UnknownPartition) =>
                {
                    self.send_batching(message, partition).await
                }
                sent => sent.map_err(|failure| self.failed(&self.eager, &eager, failure)),
            }
        })
    }

    /// After the chain's first message, the rest all at once through the batching
    /// producer, to where the first one went: a round trip for the lot instead of one
    /// per message (see the module's notes). A single next message goes as
    /// [`Self::publish_next`] sends it.
    fn publish_rest<'a>(
        &'a self,
        messages: &'a [Message],
        after: Delivered,
        crowded: bool,
        // Asked by the caller just before: the lot is queued at once.
        _clearance: &'a dyn Clearance,
    ) -> BoxFuture<'a, Vec<Result<Delivered, PublishError>>> {
        Box::pin(async move {
            match messages {
                [] => Vec::new(),
                [message] => vec![self.publish_next(message, Step { after, crowded }).await],
                _ => self.send_rest(messages, after.partition).await,
            }
        })
    }

    /// A fatal error retires its producer and the next send makes a new one; only
    /// when [`FATAL_IN_A_ROW`] producers of one kind stopped so, with no
    /// acknowledgement between, is the client taken for broken.
    fn broken(&self) -> Option<String> {
        [&self.batching, &self.eager].iter().find_map(|slot| {
            (slot.fatal_in_a_row.load(Ordering::Relaxed) >= FATAL_IN_A_ROW).then(|| {
                let last = slot
                    .last_fatal
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .map(|code| code.to_string())
                    .unwrap_or_default();
                format!(
                    "{FATAL_IN_A_ROW} Kafka producers in a row stopped on a fatal error, \
                     the last: {last}"
                )
            })
        })
    }
}

#[cfg(test)]
mod tests;
