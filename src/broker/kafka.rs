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
//! now drains 96,733; see the README's Performance section.)
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

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{
    BaseProducer, DeliveryFuture, FutureProducer, FutureRecord, Producer, PurgeConfig,
};

use super::probe::{Probe, TIMEOUT, templated};
use super::tls::{self, TlsFiles};
use super::{Broker, Clearance, Delivered, Message, PublishError, Step};
use crate::api::{KafkaSpec, SaslMechanism};
use crate::rules::{
    BrokerKind, Problems, check_secret_ref, check_template_into, is_fixed_kafka_property,
};
use crate::secrets::{
    Content, Delivery, ENV_KAFKA_SASL_PASSWORD, ENV_KAFKA_SASL_USERNAME, SecretSlot, SecretUse,
};

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
            deadline: deadline(&config.properties).map_err(PublishError::outage)?,
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

/// librdkafka reports why it cannot reach a broker (TLS, SASL, DNS) only through the
/// client's error callback, while a send just times out. This context logs each such
/// error and keeps the last one, so a failed publish or `check` says why.
#[derive(Default)]
pub struct Context {
    last_error: LastError,
    /// Set once the producer is withdrawn: what it reports after that is expected.
    withdrawn: Withdrawn,
    /// `check`'s probe: the idempotent producer's state (`eos.idemp_state`) from the
    /// client's last statistics. `None` for the relay's producers, whose statistics
    /// (only with a user's `statistics.interval.ms`) are logged.
    idempotence: Option<Arc<Mutex<Option<String>>>>,
}

/// Whether a producer was withdrawn (see [`KafkaBroker::withdraw`]): no message is
/// queued on it after that. Queueing holds the read lock, withdrawing the write lock,
/// so a purge never lands between a rest's check and its queueing.
#[derive(Clone, Default)]
struct Withdrawn(Arc<std::sync::RwLock<bool>>);

impl Withdrawn {
    fn is_set(&self) -> bool {
        *self.0.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The last connection-level error librdkafka reported, shared with the producer's
/// owner.
#[derive(Clone, Default)]
struct LastError(Arc<Mutex<Option<String>>>);

impl LastError {
    fn get(&self) -> Option<String> {
        self.0.lock().ok().and_then(|e| e.clone())
    }
}

/// A producer and the last connection error it reported (each its own: a retired
/// producer's errors say nothing of its successor).
struct KafkaProducer {
    client: FutureProducer<Context>,
    last_error: LastError,
    withdrawn: Withdrawn,
}

/// One of the relay's two producers: made when first needed, and made again after
/// [`Slot::retire`].
struct Slot {
    /// For the log.
    name: &'static str,
    config: ClientConfig,
    current: Mutex<Option<Arc<KafkaProducer>>>,
    /// Producers of this slot retired on a fatal error since the last acknowledgement
    /// (of either slot).
    fatal_in_a_row: AtomicU32,
    /// The last such error's code: what the relay gives as the reason it stops. Not
    /// librdkafka's whole reason, which names a broker picked at random and may hold
    /// sequence numbers and times (each retirement logs it): the reason reaches the
    /// pod's status, which should read the same at every restart.
    last_fatal: Mutex<Option<RDKafkaErrorCode>>,
}

impl Slot {
    fn new(name: &'static str, config: ClientConfig) -> Self {
        Self {
            name,
            config,
            current: Mutex::new(None),
            fatal_in_a_row: AtomicU32::new(0),
            last_fatal: Mutex::new(None),
        }
    }

    /// The current producer, made now if there is none.
    fn get(&self) -> Result<Arc<KafkaProducer>, PublishError> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(producer) = current.as_ref() {
            return Ok(producer.clone());
        }
        let made = Arc::new(create(&self.config)?);
        *current = Some(made.clone());
        Ok(made)
    }

    /// The current producer, if one was made.
    #[cfg(test)]
    fn existing(&self) -> Option<Arc<KafkaProducer>> {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Counts a producer of this slot retired on a fatal error `code`. A record the
    /// broker refused stops the producer by the gap-less guarantee: that is the row's
    /// fault (counted against its attempts), not the client's, and is not counted here.
    fn stopped_fatally(&self, code: RDKafkaErrorCode) {
        if code != RDKafkaErrorCode::GaplessGuarantee {
            *self
                .last_fatal
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(code);
            self.fatal_in_a_row.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Retires `used` if it is still the current producer (of the many sends that fail
    /// together, the first retires it); the next [`Slot::get`] makes a new one. Returns
    /// whether it did.
    fn retire(&self, used: &Arc<KafkaProducer>) -> bool {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        match current.take() {
            Some(retired) if Arc::ptr_eq(&retired, used) => {
                close_when_unused(retired);
                true
            }
            other => {
                *current = other;
                false
            }
        }
    }
}

/// Closes a retired producer once the sends still using it are done (they hold the
/// other references, and no new one can be taken), off the async threads: closing
/// purges its queue and joins its threads, which blocks for up to half a second.
fn close_when_unused(producer: Arc<KafkaProducer>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        while Arc::strong_count(&producer) > 1 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = tokio::task::spawn_blocking(move || drop(producer)).await;
    });
}

impl rdkafka::producer::ProducerContext for Context {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: ()) {}
}

impl rdkafka::ClientContext for Context {
    /// Connection failures (TLS, SASL) arrive as log lines of level error with
    /// facility FAIL; they are kept like errors.
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        match level {
            L::Emerg | L::Alert | L::Critical | L::Error => {
                tracing::warn!(facility = fac, "Kafka client: {message}");
                if let Ok(mut last) = self.last_error.0.lock() {
                    *last = Some(message.to_owned());
                }
            }
            // The relay sets it on purpose (see the module's notes); librdkafka warns
            // on every producer it makes.
            L::Warning if fac == "CONFWARN" && message.contains("enable.gapless.guarantee") => {
                tracing::debug!(facility = fac, "Kafka client: {message}");
            }
            L::Warning => tracing::warn!(facility = fac, "Kafka client: {message}"),
            L::Notice | L::Info => tracing::info!(facility = fac, "Kafka client: {message}"),
            L::Debug => tracing::debug!(facility = fac, "Kafka client: {message}"),
        }
    }

    /// Statistics come only where `statistics.interval.ms` is set: a user's
    /// `properties` (logged, as rdkafka does by default, but whole), or `check`'s probe
    /// (the idempotent producer's state is kept, nothing logged).
    fn stats_raw(&self, statistics: &[u8]) {
        let Some(idempotence) = &self.idempotence else {
            tracing::info!(
                statistics = %String::from_utf8_lossy(statistics),
                "Kafka client statistics"
            );
            return;
        };
        #[derive(serde::Deserialize)]
        struct Stats {
            eos: Option<Eos>,
        }
        #[derive(serde::Deserialize)]
        struct Eos {
            idemp_state: String,
        }
        if let Ok(Stats { eos: Some(eos) }) = serde_json::from_slice::<Stats>(statistics)
            && let Ok(mut state) = idempotence.lock()
        {
            *state = Some(eos.idemp_state);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if self.withdrawn.is_set() {
            // Purging a withdrawn producer fails what it had in flight (with the
            // gap-less guarantee, as a fatal error): the relay already said why.
            tracing::debug!(error = %error, reason, "Kafka client error on a withdrawn producer");
            return;
        }
        tracing::warn!(error = %error, reason, "Kafka client error");
        if let Ok(mut last) = self.last_error.0.lock() {
            *last = Some(reason.to_owned());
        }
    }
}

/// The producer settings the relay uses: the user's `properties` first, then what
/// correctness needs, then TLS and SASL. `check` connects with the same.
pub(super) fn client_config(config: &KafkaSettings) -> ClientConfig {
    let mut client = ClientConfig::new();
    // Defaults a user may tune through `properties`.
    client
        .set("socket.connection.setup.timeout.ms", "5000")
        .set("linger.ms", "1")
        // The Java client's partitioning (murmur2 of the key): an aggregate's events land
        // on the partition Kafka Connect, Debezium and Java producers put them on, so
        // consumers migrating from them keep each aggregate on one partition, in order.
        // librdkafka's own default (CRC32) would not.
        .set("partitioner", "murmur2_random");
    for (key, value) in &config.properties {
        client.set(canonical(key), value);
    }
    for (key, value) in GAPLESS {
        client.set(key, value);
    }
    // Fixed, after the user's properties: idempotence keeps each Kafka partition in
    // send order without duplicates from internal retries (it requires
    // max.in.flight <= 5), and acks=all means "acknowledged" survives a broker loss.
    client
        .set("bootstrap.servers", &config.bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5");
    let protocol = match (config.tls, config.sasl.is_some()) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    client.set("security.protocol", protocol);
    if config.tls {
        // The broker's certificate is verified, host name included (librdkafka's
        // default since 1.9, set so no property can turn it off).
        client.set("ssl.endpoint.identification.algorithm", "https");
        if let Some(ca) = &config.tls_files.ca {
            client.set("ssl.ca.location", ca);
        }
        if let Some((cert, key)) = &config.tls_files.client {
            client
                .set("ssl.certificate.location", cert)
                .set("ssl.key.location", key);
        }
    }
    if let Some((mechanism, user, password)) = &config.sasl {
        let mechanism = serde_json::to_value(mechanism)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        client
            .set("sasl.mechanism", mechanism)
            .set("sasl.username", user)
            .set("sasl.password", password);
    }
    client
}

/// How long the relay waits for a message's acknowledgement before it gives the
/// message and its producer up: `message.timeout.ms` (or its alias
/// `delivery.timeout.ms`) from `properties`, 20 s by default; 0 waits for ever. Like
/// librdkafka, which no longer sees it, it must be longer than `linger.ms`.
pub(super) fn deadline(
    properties: &std::collections::BTreeMap<String, String>,
) -> Result<Option<Duration>, String> {
    let (key, ms) = match timeout_setting(properties) {
        None => ("message.timeout.ms (by default)", 20_000),
        Some((key, value)) => match value.trim().parse::<u32>() {
            Ok(0) => return Ok(None),
            Ok(ms) if ms <= 2_147_483_647 => (key.as_str(), ms),
            _ => {
                return Err(format!(
                    "Kafka property {key} = {value:?}: not a number of milliseconds from 0 to 2147483647"
                ));
            }
        },
    };
    let linger = properties
        .iter()
        .rfind(|(key, _)| canonical(key) == "linger.ms")
        .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        .unwrap_or(1.0);
    if f64::from(ms) <= linger {
        return Err(format!(
            "Kafka property {key} = {ms} is not longer than linger.ms ({linger}): every message would time out"
        ));
    }
    Ok(Some(Duration::from_millis(u64::from(ms))))
}

/// The properties to give up when [`deadline`] refuses `properties`: the timeout
/// setting it read, when one is set (a value out of range, or not longer than
/// `linger.ms`); otherwise `linger.ms` under each of its names, which reached the
/// default timeout (a Java producer's own default is six times as long).
pub(crate) fn deadline_culprits(
    properties: &std::collections::BTreeMap<String, String>,
) -> Vec<String> {
    match timeout_setting(properties) {
        Some((timeout, _)) => vec![timeout.clone()],
        None => properties
            .keys()
            .filter(|key| canonical(key) == "linger.ms")
            .cloned()
            .collect(),
    }
}

/// A producer of `client`'s settings that keeps its last connection error.
fn create(client: &ClientConfig) -> Result<KafkaProducer, PublishError> {
    let last_error = LastError::default();
    let withdrawn = Withdrawn::default();
    let producer = client
        .create_with_context(Context {
            last_error: last_error.clone(),
            withdrawn: withdrawn.clone(),
            idempotence: None,
        })
        .map_err(|err| PublishError::outage(format!("cannot create the Kafka producer: {err}")))?;
    Ok(KafkaProducer {
        client: producer,
        last_error,
        withdrawn,
    })
}

/// The settings of the producer that sends a chain's next message: the relay's, with
/// no lingering (see the module's notes).
fn eager_config(config: &KafkaSettings) -> ClientConfig {
    let mut client = client_config(config);
    client.set("linger.ms", "0");
    client
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

// ---------------------------------------------------------------------------------------
// The spec's rules, Secrets and settings of a Kafka relay, and `check`'s probe.

/// Every problem of a Kafka spec.
pub fn check(k: &KafkaSpec, p: &mut Problems) {
    if k.bootstrap_servers.trim().is_empty() {
        p.push(
            "spec.broker.kafka.bootstrapServers",
            "is empty",
            "name at least one host:port",
        );
    }
    check_template_into(p, BrokerKind::Kafka, "spec.broker.kafka.topic", &k.topic);
    if let Err(why) = deadline(&k.properties) {
        p.push(
            "spec.broker.kafka.properties",
            why,
            "give a whole number of milliseconds (0: wait for ever)",
        );
    }
    // What librdkafka takes one by one, for the rules between settings.
    let mut accepted = std::collections::BTreeMap::new();
    for (key, value) in &k.properties {
        if is_fixed_kafka_property(key) {
            p.push(
                format!("spec.broker.kafka.properties.{key}"),
                "is fixed by the relay (delivery guarantees) or set through tls and sasl",
                "remove it; acks=all and idempotence are always on",
            );
        } else if let Some(why) = refused_by_librdkafka(key, value) {
            p.push(
                format!("spec.broker.kafka.properties.{key}"),
                why,
                "use a librdkafka producer property and a value it takes (librdkafka's CONFIGURATION.md lists them)",
            );
        } else {
            accepted.insert(key.clone(), value.clone());
        }
    }
    for (key, why) in refused_together(&accepted) {
        p.push(
            format!("spec.broker.kafka.properties.{key}"),
            why,
            "remove it or give a value the relay's idempotent producer takes",
        );
    }
    if let Some(sasl) = &k.sasl {
        check_secret_ref(
            p,
            "spec.broker.kafka.sasl.usernameSecretRef",
            &sasl.username_secret_ref.name,
            &sasl.username_secret_ref.key,
        );
        check_secret_ref(
            p,
            "spec.broker.kafka.sasl.passwordSecretRef",
            &sasl.password_secret_ref.name,
            &sasl.password_secret_ref.key,
        );
    }
    tls::check(k.tls.as_ref(), tls::KAFKA, p);
}

/// `message.timeout.ms` and its alias: the relay keeps that timeout itself and never
/// hands the value to librdkafka; [`deadline`] checks it.
fn is_relay_timeout(key: &str) -> bool {
    canonical(key) == "message.timeout.ms"
}

/// The relay's timeout setting in effect, if `properties` set one: the last of its
/// names in key order, as librdkafka would apply them. [`deadline`] reads it and
/// [`deadline_culprits`] gives it up, so the two always agree on which name wins.
fn timeout_setting(
    properties: &std::collections::BTreeMap<String, String>,
) -> Option<(&String, &String)> {
    properties.iter().rfind(|(key, _)| is_relay_timeout(key))
}

/// Why librdkafka refuses the property `key` = `value`, if it does: an unknown name (a
/// Java client's, say), a value not of its type or range, a codec librdkafka does not have.
/// Asked of librdkafka's own configuration parser, which makes no client: otherwise such
/// a setting is found only when the relay starts, and its pod restarts over and over.
/// The relay's own timeout ([`is_relay_timeout`]) is [`deadline`]'s to check, and the
/// [`GAPLESS`] settings never reach librdkafka, so neither is asked about.
/// `plugin.*` is refused without asking: setting it makes librdkafka load the libraries
/// named, in whichever process checks the spec (the controller's, say). So are its test
/// settings (`test.*`), which librdkafka takes.
pub(crate) fn refused_by_librdkafka(key: &str, value: &str) -> Option<String> {
    if GAPLESS.iter().any(|(fixed, _)| *fixed == canonical(key)) {
        return None;
    }
    if key.starts_with("plugin.") {
        return Some("librdkafka plugins are not supported: the relay's image has none".to_owned());
    }
    if key.starts_with("test.") || key.starts_with("ut_") {
        // librdkafka takes `test.mock.num.brokers` (a hidden setting): the producer
        // would then write to a mock cluster inside the relay, which acknowledges every
        // event, and the rows would be marked or deleted with nothing published.
        return Some(
            "librdkafka's test settings are not supported: a mock cluster would acknowledge events no broker received".to_owned(),
        );
    }
    match ClientConfig::new().set(key, value).create_native_config() {
        // librdkafka ends some of its reasons with a line break.
        Err(KafkaError::ClientConfig(_, why, _, _)) => Some(why.trim_end().to_owned()),
        Err(err) => Some(err.to_string()),
        Ok(_) => None,
    }
}

/// Properties librdkafka takes one by one (so [`refused_by_librdkafka`] lets them
/// pass) but refuses when it creates a producer with the relay's settings
/// (idempotence) or with one another, and so would be found only when the relay
/// starts, its pod restarting over and over; and `delivery.report.only.error`, which
/// would stall it. These are the checks of librdkafka's
/// `rd_kafka_conf_finalize` and `rd_kafka_topic_conf_finalize` (2.12) that such a
/// producer can meet; asking librdkafka itself would mean creating a client, with its
/// threads, in whichever process checks the spec. Values librdkafka does not take at
/// all are left to [`refused_by_librdkafka`].
fn refused_together(
    properties: &std::collections::BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let mut refused = Vec::new();
    let mut refuse = |key: &str, why: String| refused.push((key.to_owned(), why));
    let int = |key: &str| properties.get(key).and_then(|v| c_int(v));
    let text = |key: &str| properties.get(key).map(|v| c_trim_start(v));
    let boolean = |key: &str| properties.get(key).and_then(|v| c_bool(v));
    if text("queuing.strategy").is_some_and(|v| v.eq_ignore_ascii_case("lifo")) {
        refuse(
            "queuing.strategy",
            "must be fifo: the relay's producer is idempotent, and librdkafka refuses lifo with enable.idempotence".to_owned(),
        );
    }
    // Not a librdkafka refusal, but a stall: the relay completes an event on its
    // delivery report, so without reports for successes every event would time out.
    if boolean("delivery.report.only.error") == Some(true) {
        refuse(
            "delivery.report.only.error",
            "must be false: the relay learns that an event was written from its delivery report; without one each event would time out and be written again, without end (or, with message.timeout.ms 0, waited for without end)".to_owned(),
        );
    }
    if int("queue.buffering.backpressure.threshold").is_some_and(|t| t > 1) {
        refuse(
            "queue.buffering.backpressure.threshold",
            "must be 1: the relay's producer is idempotent, and librdkafka refuses more with enable.idempotence".to_owned(),
        );
    }
    // librdkafka's defaults: 100 and 10000.
    let (min, max) = (
        int("reconnect.backoff.ms").unwrap_or(100),
        int("reconnect.backoff.max.ms").unwrap_or(10_000),
    );
    if max < min {
        let key = if properties.contains_key("reconnect.backoff.max.ms") {
            "reconnect.backoff.max.ms"
        } else {
            "reconnect.backoff.ms"
        };
        refuse(
            key,
            format!(
                "reconnect.backoff.max.ms ({max}) must not be less than reconnect.backoff.ms ({min}): librdkafka refuses it"
            ),
        );
    }
    // A consumer's setting, but librdkafka checks its value in a producer too, and any
    // value but its default can fail the producer's creation.
    if properties.contains_key("partition.assignment.strategy") {
        refuse(
            "partition.assignment.strategy",
            "is a consumer setting the relay's producer has no use for (librdkafka may refuse to create the producer over it)".to_owned(),
        );
    }
    // librdkafka installs a handler for this signal whenever it creates a producer
    // (replacing the relay's for SIGTERM, so a pod would stop without draining) and
    // sends it to its threads when it destroys one.
    if int("internal.termination.signal").is_some_and(|signal| signal != 0) {
        refuse(
            "internal.termination.signal",
            "must be 0: librdkafka would take the signal over from the relay (SIGTERM: pods would stop without draining) and raise it whenever the relay replaces a producer".to_owned(),
        );
    }
    // Without the broker's API versions the idempotent producer fails at run time
    // with brokers older than 0.10's protocol.
    if boolean("api.version.request") == Some(false) {
        refuse(
            "api.version.request",
            "must be true: the relay's idempotent producer needs the broker's API versions"
                .to_owned(),
        );
    }
    refused
}

/// Whether `properties` choose a partitioner that does not keep a key on one partition:
/// `random` ignores keys, `consistent_random` scatters empty ones (an empty aggregate
/// id). Per-aggregate order needs every event of an aggregate on one partition.
pub fn partitioner_scatters_keys(
    properties: &std::collections::BTreeMap<String, String>,
) -> Option<&'static str> {
    match properties.get("partitioner").map(|v| c_trim_start(v)) {
        Some("random") => Some("random ignores the key"),
        Some("consistent_random") => {
            Some("consistent_random sends an empty key (an empty aggregate id) to any partition")
        }
        _ => None,
    }
}

/// `value` without its leading blanks, as C's `isspace` counts them (librdkafka skips
/// them in numbers, enumerations and strings).
fn c_trim_start(value: &str) -> &str {
    value.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r'])
}

/// A boolean property as librdkafka reads it: `true` or `t` (any case) or `1`, and
/// `false` or `f` or `0`, as written; `None` for anything else, which librdkafka
/// refuses (and [`refused_by_librdkafka`] reports).
fn c_bool(value: &str) -> Option<bool> {
    if value.eq_ignore_ascii_case("true") || value.eq_ignore_ascii_case("t") || value == "1" {
        Some(true)
    } else if value.eq_ignore_ascii_case("false") || value.eq_ignore_ascii_case("f") || value == "0"
    {
        Some(false)
    } else {
        None
    }
}

/// An integer property as librdkafka reads it: C's `strtol(value, &end, 0)` (leading
/// blanks, a sign, `0x` for hexadecimal and `0` for octal, then as many digits as
/// there are, whatever follows) cast to `int`; `None` when no digit begins it, which
/// librdkafka refuses (and [`refused_by_librdkafka`] reports).
fn c_int(value: &str) -> Option<i64> {
    let rest = c_trim_start(value);
    let (negative, rest) = match rest.as_bytes().first() {
        Some(b'-') => (true, &rest[1..]),
        Some(b'+') => (false, &rest[1..]),
        _ => (false, rest),
    };
    let (radix, digits) = if let Some(hex) = rest
        .strip_prefix("0x")
        .or_else(|| rest.strip_prefix("0X"))
        .filter(|h| h.starts_with(|c: char| c.is_ascii_hexdigit()))
    {
        (16, hex)
    } else if rest.starts_with('0') {
        (8, rest)
    } else {
        (10, rest)
    };
    let run = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    if run == 0 {
        return None;
    }
    // strtol saturates at the long's bounds; the cast to int keeps the low 32 bits.
    let magnitude = i64::from_str_radix(&digits[..run], radix).unwrap_or(i64::MAX);
    let long = if negative {
        magnitude.saturating_neg()
    } else {
        magnitude
    };
    Some(i64::from(long as i32))
}

/// Settings [`client_config`] sets after the user's properties, so that no message is
/// ever written behind one of its chain that librdkafka gave up on (see the module's
/// notes): librdkafka never times a message out (the relay does, see [`deadline`]),
/// retries it for as long as it waits, and stops on any refusal that would leave a gap.
/// A user may name them (under either name, see [`canonical`]), but their values never
/// reach librdkafka.
const GAPLESS: [(&str, &str); 3] = [
    ("message.timeout.ms", "0"),
    ("message.send.max.retries", "2147483647"),
    ("enable.gapless.guarantee", "true"),
];

/// The one name the relay uses for a setting librdkafka knows under two, for the
/// settings the relay sets itself (`linger.ms` by default, the [`GAPLESS`] ones after
/// the user's): a user's value is set under that name, so the config never holds both
/// (which one wins would depend on the order librdkafka applies them in).
fn canonical(key: &str) -> &str {
    match key {
        "queue.buffering.max.ms" => "linger.ms",
        "retries" => "message.send.max.retries",
        "delivery.timeout.ms" => "message.timeout.ms",
        key => key,
    }
}

/// The Secret references of a Kafka spec: SASL credentials as variables, the TLS files
/// mounted.
pub fn secrets(k: &KafkaSpec) -> Vec<SecretSlot> {
    let slot = |field, reference: &crate::api::SecretKeyRef, delivery| SecretSlot {
        field,
        purpose: SecretUse::Broker,
        reference: reference.clone(),
        delivery,
        content: Content::Text,
    };
    let mut all = Vec::new();
    if let Some(sasl) = &k.sasl {
        all.push(slot(
            "spec.broker.kafka.sasl.usernameSecretRef",
            &sasl.username_secret_ref,
            Delivery::Env(ENV_KAFKA_SASL_USERNAME),
        ));
        all.push(slot(
            "spec.broker.kafka.sasl.passwordSecretRef",
            &sasl.password_secret_ref,
            Delivery::Env(ENV_KAFKA_SASL_PASSWORD),
        ));
    }
    all.extend(tls::secrets(k.tls.as_ref(), tls::KAFKA));
    all
}

/// Kafka producer settings with credentials resolved. No `Debug`: it holds secrets.
#[derive(Clone)]
pub struct KafkaSettings {
    /// `host:port` list.
    pub bootstrap_servers: String,
    /// Topic template.
    pub topic: String,
    /// TLS on (with the system roots when no CA file is given).
    pub tls: bool,
    /// CA and client certificate files.
    pub tls_files: TlsFiles,
    /// SASL mechanism, user name and password.
    pub sasl: Option<(SaslMechanism, String, String)>,
    /// Extra librdkafka producer settings.
    pub properties: std::collections::BTreeMap<String, String>,
}

/// The settings of a Kafka spec, with Secret values (`value`, by field) and mounted
/// files (`file`, by field) resolved.
pub fn settings(
    k: &KafkaSpec,
    value: &dyn Fn(&str) -> String,
    file: &dyn Fn(&str) -> Option<String>,
) -> KafkaSettings {
    KafkaSettings {
        bootstrap_servers: k.bootstrap_servers.clone(),
        topic: k.topic.clone(),
        tls: k.tls.is_some(),
        tls_files: TlsFiles::locate(tls::KAFKA, file),
        sasl: k.sasl.as_ref().map(|s| {
            (
                s.mechanism,
                value("spec.broker.kafka.sasl.usernameSecretRef"),
                value("spec.broker.kafka.sasl.passwordSecretRef"),
            )
        }),
        properties: k.properties.clone(),
    }
}

/// How often the probe's client reports its statistics (the idempotent producer's state).
const STATS_EVERY_MS: &str = "100";

/// Whether the cluster grants the probe's idempotent producer an id, as it must the
/// relay's: only to a principal allowed IDEMPOTENT_WRITE on the cluster or WRITE on a
/// topic. Refused, it is a fatal error for every producer the relay makes, so the relay
/// would crash-loop (`tests/relay/relay_fatal.rs`); the probe says so first. Waits,
/// polling the client, until its statistics show the id assigned or a fatal error
/// stops it, at most [`TIMEOUT`].
fn producer_id(producer: &BaseProducer<Context>, idempotence: &Mutex<Option<String>>) -> Probe {
    let until = std::time::Instant::now() + TIMEOUT;
    loop {
        producer.poll(Duration::from_millis(50));
        if let Some((code, _)) = producer.client().fatal_error() {
            return Probe::fail(
                "producer id",
                format!(
                    "Kafka refuses these credentials an idempotent producer ({code}): \
                     every send would fail for good; grant the user IDEMPOTENT_WRITE on \
                     the cluster, or (Kafka 2.8 and later) WRITE on the topic"
                ),
            );
        }
        let state = idempotence.lock().map(|s| s.clone()).unwrap_or_default();
        if state.as_deref() == Some("Assigned") {
            return Probe::ok("producer id", "Kafka grants an idempotent producer id");
        }
        if std::time::Instant::now() >= until {
            return Probe::fail(
                "producer id",
                format!(
                    "Kafka granted no idempotent producer id within {TIMEOUT:?} (state: {})",
                    state.as_deref().unwrap_or("unknown")
                ),
            );
        }
    }
}

/// `check`'s questions to Kafka: does it answer with these settings, does it grant an
/// idempotent producer id, and does the topic exist (metadata request with topic
/// auto-creation off)?
pub async fn probe(k: &KafkaSettings) -> Vec<Probe> {
    let mut client = super::kafka::client_config(k);
    client
        .set("allow.auto.create.topics", "false")
        .set("statistics.interval.ms", STATS_EVERY_MS);
    let idempotence: Arc<Mutex<Option<String>>> = Arc::default();
    let context = Context {
        idempotence: Some(idempotence.clone()),
        ..Context::default()
    };
    let last_error = context.last_error.clone();
    let producer: BaseProducer<Context> = match client.create_with_context(context) {
        Ok(p) => p,
        Err(err) => {
            return vec![Probe::fail(
                "broker",
                format!("cannot create a Kafka client with these settings: {err}"),
            )];
        }
    };
    let topic = (!templated(&k.topic)).then(|| k.topic.clone());
    let wanted = topic.clone();
    let metadata = tokio::task::spawn_blocking(move || {
        let result = producer.client().fetch_metadata(wanted.as_deref(), TIMEOUT);
        // A BaseProducer serves its error callbacks only when polled, one event per
        // poll: serve every one waiting (the connection's error need not be first).
        for _ in 0..64 {
            producer.poll(Duration::ZERO);
        }
        let result = result.map_err(|err| (err, last_error.get()))?;
        Ok((result, producer_id(&producer, &idempotence)))
    })
    .await;
    let (metadata, producer_id) = match metadata {
        Ok(Ok(found)) => found,
        Ok(Err((err, cause))) => {
            let cause = cause.map(|c| format!(" ({c})")).unwrap_or_default();
            return vec![Probe::fail(
                "broker",
                format!(
                    "cannot reach Kafka at {} within {TIMEOUT:?}: {err}{cause}; check bootstrapServers, the network, TLS and SASL",
                    k.bootstrap_servers
                ),
            )];
        }
        Err(err) => {
            return vec![Probe::fail(
                "broker",
                format!("metadata request failed: {err}"),
            )];
        }
    };
    let mut probes = vec![
        Probe::ok(
            "broker",
            format!(
                "Kafka at {} answers ({} broker(s))",
                k.bootstrap_servers,
                metadata.brokers().len()
            ),
        ),
        producer_id,
    ];
    match topic {
        Some(name) => {
            let found = metadata
                .topics()
                .iter()
                .find(|t| t.name() == name)
                .filter(|t| t.error().is_none() && !t.partitions().is_empty());
            probes.push(match found {
                Some(t) => Probe::ok(
                    "topic",
                    format!(
                        "topic {name} exists with {} partition(s)",
                        t.partitions().len()
                    ),
                ),
                None => Probe::fail(
                    "topic",
                    format!(
                        "topic {name} does not exist: create it (the relay never creates topics)"
                    ),
                ),
            });
        }
        None => probes.push(Probe::ok(
            "topic",
            format!(
                "topics follow the template {}: one per aggregate type, not checked here",
                k.topic
            ),
        )),
    }
    probes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(properties: &[(&str, &str)]) -> KafkaSettings {
        KafkaSettings {
            bootstrap_servers: "kafka:9092".to_owned(),
            topic: "outbox".to_owned(),
            tls: false,
            tls_files: Default::default(),
            sasl: None,
            properties: properties
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn keys_are_partitioned_as_the_java_client_does_unless_the_user_says_otherwise() {
        let config = client_config(&settings(&[]));
        assert_eq!(config.get("partitioner"), Some("murmur2_random"));
        let config = client_config(&settings(&[("partitioner", "consistent_random")]));
        assert_eq!(config.get("partitioner"), Some("consistent_random"));
        // What correctness needs is not the user's to change.
        let config = client_config(&settings(&[("acks", "1")]));
        assert_eq!(config.get("acks"), Some("all"));
    }

    /// Settings of a relay whose broker is a closed local port: the clients fail to
    /// connect at once, with no name to resolve.
    fn unreachable(properties: &[(&str, &str)]) -> KafkaSettings {
        KafkaSettings {
            bootstrap_servers: "127.0.0.1:9".to_owned(),
            ..settings(properties)
        }
    }

    #[tokio::test]
    async fn the_chain_steps_producer_comes_with_the_first_chain_step() {
        let broker = KafkaBroker::new(&unreachable(&[])).expect("a producer");
        assert!(broker.batching.existing().is_some());
        // Chains of one message never need it, nor its connections.
        assert!(broker.eager.existing().is_none());
        broker.eager.get().expect("made");
        assert!(broker.eager.existing().is_some());
    }

    #[test]
    fn integers_are_read_as_librdkafka_reads_them() {
        for (value, read) in [
            ("42", Some(42)),
            ("  +7", Some(7)),
            ("-3", Some(-3)),
            ("0200", Some(128)),
            ("0x1F", Some(31)),
            ("0x", Some(0)),
            ("09", Some(0)),
            ("2.5", Some(2)),
            ("5ms", Some(5)),
            ("4294967297", Some(1)),
            ("", None),
            ("ms", None),
            ("-", None),
        ] {
            assert_eq!(c_int(value), read, "{value:?}");
        }
    }

    #[test]
    fn booleans_are_read_as_librdkafka_reads_them() {
        for (value, read) in [
            ("true", Some(true)),
            ("T", Some(true)),
            ("1", Some(true)),
            ("False", Some(false)),
            ("f", Some(false)),
            ("0", Some(false)),
            (" true", None),
            ("yes", None),
        ] {
            assert_eq!(c_bool(value), read, "{value:?}");
        }
    }

    /// The fields `problems` name, in order.
    fn fields(problems: &[crate::rules::Problem]) -> Vec<&str> {
        problems.iter().map(|p| p.field.as_str()).collect()
    }

    /// What [`check`] finds in a Kafka spec with these `properties`.
    fn problems(properties: serde_json::Value) -> Vec<crate::rules::Problem> {
        let spec: KafkaSpec = serde_json::from_value(serde_json::json!({
            "bootstrapServers": "kafka:9092",
            "topic": "orders",
            "properties": properties,
        }))
        .expect("a Kafka spec");
        let mut p = Problems(Vec::new());
        check(&spec, &mut p);
        p.0
    }

    #[test]
    fn settings_librdkafka_refuses_together_are_spec_problems() {
        // Settings librdkafka takes alone but refuses with idempotence or together.
        let together = problems(serde_json::json!({
            "queuing.strategy": "LIFO",
            "delivery.report.only.error": "T",
            "queue.buffering.backpressure.threshold": " 2",
            "reconnect.backoff.ms": "20000",
        }));
        assert_eq!(
            fields(&together),
            [
                "spec.broker.kafka.properties.queuing.strategy",
                "spec.broker.kafka.properties.delivery.report.only.error",
                "spec.broker.kafka.properties.queue.buffering.backpressure.threshold",
                "spec.broker.kafka.properties.reconnect.backoff.ms",
            ],
            "{together:?}"
        );
        assert!(together[3].message.contains("10000"), "{together:?}");
        // As librdkafka reads them: leading blanks, octal, trailing text.
        let read = problems(serde_json::json!({
            "queuing.strategy": " lifo",
            "queue.buffering.backpressure.threshold": "2ms",
            "reconnect.backoff.ms": "0200",
            "reconnect.backoff.max.ms": "150",
            "partition.assignment.strategy": "range",
            "internal.termination.signal": "15",
            "api.version.request": "false",
        }));
        assert_eq!(
            fields(&read),
            [
                "spec.broker.kafka.properties.queuing.strategy",
                "spec.broker.kafka.properties.queue.buffering.backpressure.threshold",
                "spec.broker.kafka.properties.partition.assignment.strategy",
                "spec.broker.kafka.properties.internal.termination.signal",
                "spec.broker.kafka.properties.api.version.request",
            ],
            "{read:?}"
        );
        // A value librdkafka refuses alone is reported once, by its own reason.
        let once = problems(serde_json::json!({"reconnect.backoff.max.ms": "-1"}));
        assert_eq!(once.len(), 1, "{once:?}");
        let fine = problems(serde_json::json!({
            "internal.termination.signal": "0",
            "api.version.request": "true",
            "delivery.report.only.error": "false",
            "queuing.strategy": "fifo",
            "queue.buffering.backpressure.threshold": "1",
            "reconnect.backoff.ms": "500",
            "reconnect.backoff.max.ms": "500",
        }));
        assert!(fine.is_empty(), "{fine:?}");
    }

    #[test]
    fn properties_librdkafka_refuses_are_spec_problems() {
        let fine = problems(serde_json::json!({
            "linger.ms": "5",
            "compression.type": "lz4",
            "batch.num.messages": "5000",
            "message.timeout.ms": "30000",
            // Overridden by the relay, never handed to librdkafka.
            "retries": "-1",
            "enable.gapless.guarantee": "maybe",
        }));
        assert!(fine.is_empty(), "{fine:?}");
        // The relay's timeout is deadline()'s to report, once.
        let timeout = problems(serde_json::json!({"message.timeout.ms": "soon"}));
        assert_eq!(timeout.len(), 1, "{timeout:?}");
        assert_eq!(timeout[0].field, "spec.broker.kafka.properties");
        // Never handed to librdkafka, which would load the library.
        let plugin = problems(serde_json::json!({"plugin.library.paths": "/tmp/evil.so"}));
        assert_eq!(plugin.len(), 1, "{plugin:?}");
        assert!(plugin[0].message.contains("plugins"), "{plugin:?}");
        // librdkafka takes its mock cluster's setting; the relay does not.
        assert!(
            ClientConfig::new()
                .set("test.mock.num.brokers", "3")
                .create_native_config()
                .is_ok()
        );
        let mock = problems(serde_json::json!({"test.mock.num.brokers": "3"}));
        assert_eq!(mock.len(), 1, "{mock:?}");
        assert!(mock[0].message.contains("mock cluster"), "{mock:?}");
        // Out of range, without librdkafka's trailing line break.
        let range =
            problems(serde_json::json!({"linger.ms": "1000000", "message.timeout.ms": "0"}));
        assert_eq!(range.len(), 1, "{range:?}");
        assert!(range[0].message.contains("range"), "{range:?}");
        assert_eq!(range[0].message.trim_end(), range[0].message);
        let refused = problems(serde_json::json!({
            "linger.msec": "5",
            "compression.type": "brotli",
            "batch.num.messages": "lots",
        }));
        assert_eq!(
            fields(&refused),
            [
                "spec.broker.kafka.properties.batch.num.messages",
                "spec.broker.kafka.properties.compression.type",
                "spec.broker.kafka.properties.linger.msec",
            ]
        );
        assert!(
            refused[2]
                .message
                .contains("No such configuration property"),
            "{:?}",
            refused[2]
        );
        assert!(refused[1].message.contains("brotli"), "{:?}", refused[1]);
        // The codecs this build has, as the field's reference says (zstd built in).
        for codec in ["none", "gzip", "snappy", "lz4", "zstd"] {
            assert_eq!(
                refused_by_librdkafka("compression.type", codec),
                None,
                "{codec}"
            );
        }
    }

    #[tokio::test]
    async fn only_three_fatal_producers_of_one_kind_in_a_row_break_the_client() {
        let broker = KafkaBroker::new(&unreachable(&[])).expect("a producer");
        let stop = |slot: &Slot, code| slot.stopped_fatally(code);
        // One cause stopping both kinds' producers, round after round: two rounds are
        // two producers of each kind in a row, not four.
        for _ in 0..2 {
            stop(&broker.batching, RDKafkaErrorCode::InvalidProducerEpoch);
            stop(&broker.eager, RDKafkaErrorCode::InvalidProducerEpoch);
        }
        assert_eq!(broker.broken(), None);
        // A record the broker refused is the row's fault, not the client's.
        broker
            .eager
            .stopped_fatally(RDKafkaErrorCode::GaplessGuarantee);
        assert_eq!(broker.broken(), None, "a gap-less stop counted");
        stop(&broker.eager, RDKafkaErrorCode::ClusterAuthorizationFailed);
        // The reason given is the last producer's, not the refused record's.
        assert_eq!(
            broker.broken().as_deref(),
            Some(
                "3 Kafka producers in a row stopped on a fatal error, the last: \
                 ClusterAuthorizationFailed (Broker: Cluster authorization failed)"
            ),
            "the third chain-step producer in a row"
        );
        // An acknowledgement clears both counts (batching stood at 2).
        broker.clear_fatal_counts();
        assert_eq!(broker.broken(), None);
        stop(&broker.batching, RDKafkaErrorCode::InvalidProducerEpoch);
        assert_eq!(
            broker.broken(),
            None,
            "the acknowledgement left the batching count"
        );
        stop(&broker.batching, RDKafkaErrorCode::InvalidProducerEpoch);
        stop(&broker.batching, RDKafkaErrorCode::InvalidProducerEpoch);
        assert!(
            broker
                .broken()
                .is_some_and(|why| why.ends_with("the last: InvalidProducerEpoch (Broker: Producer attempted an operation with an old epoch)")),
            "three batching producers in a row"
        );
    }

    fn message(payload: &'static [u8]) -> Message {
        Message {
            destination: "orders".to_owned(),
            key: Some("order-1".to_owned()),
            id: "1".to_owned(),
            headers: Vec::new(),
            payload: Some(bytes::Bytes::from_static(payload)),
            timestamp_ms: None,
            partition: None,
            content_type: None,
        }
    }

    #[tokio::test]
    async fn a_producer_whose_message_timed_out_is_replaced_by_the_next_send() {
        let broker = KafkaBroker::new(&unreachable(&[
            ("message.timeout.ms", "200"),
            ("message.max.bytes", "1000"),
        ]))
        .expect("a producer");
        let broker = &broker;
        for (slot, next) in [(&broker.batching, false), (&broker.eager, true)] {
            let send = |payload| {
                let message = message(payload);
                async move {
                    if next {
                        broker.publish_next(&message, Step::default()).await
                    } else {
                        broker.publish(&message).await
                    }
                }
            };
            let before = slot.get().expect("made");
            // Refused at once (larger than message.max.bytes): the producer is fine.
            let err = send(&[b'x'; 2000]).await.expect_err("too large");
            assert!(err.is_refused(), "{err:?}");
            assert!(Arc::ptr_eq(&before, &slot.get().expect("kept")));

            let err = send(b"{}").await.expect_err("nothing listens on port 9");
            assert!(
                !err.is_refused(),
                "an outage, retried without counting: {err:?}"
            );
            assert!(err.message().contains("timed out"), "{}", err.message());
            let after = slot.get().expect("made again");
            assert!(
                !Arc::ptr_eq(&before, &after),
                "the {} producer was kept after a timeout",
                slot.name
            );
            // A send that fails late, on a producer already retired, leaves the new one.
            assert!(!slot.retire(&before));
            assert!(Arc::ptr_eq(&after, &slot.existing().expect("kept")));
            // The retired producer is closed once nothing uses it.
            let retired = Arc::downgrade(&before);
            drop(before);
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while retired.upgrade().is_some() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the retired {} producer is still open",
                    slot.name
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    #[test]
    fn a_chains_next_message_never_lingers_and_lands_where_the_batch_would_put_it() {
        let user = settings(&[("linger.ms", "20"), ("partitioner", "consistent")]);
        let batching = client_config(&user);
        let eager = eager_config(&user);
        assert_eq!(batching.get("linger.ms"), Some("20"));
        assert_eq!(eager.get("linger.ms"), Some("0"));
        // Under librdkafka's other name for it, too.
        let alias = settings(&[("queue.buffering.max.ms", "20")]);
        assert_eq!(client_config(&alias).get("linger.ms"), Some("20"));
        assert_eq!(eager_config(&alias).get("linger.ms"), Some("0"));
        assert_eq!(eager_config(&alias).get("queue.buffering.max.ms"), None);
        // Everything else is the same: a key maps to the same partition through both,
        // with the same delivery guarantees.
        let rest = |c: &ClientConfig| {
            let mut all: Vec<(String, String)> = c
                .config_map()
                .iter()
                .filter(|(k, _)| k.to_string() != "linger.ms")
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            all.sort();
            all
        };
        assert_eq!(rest(&batching), rest(&eager));
        assert_eq!(eager.get("enable.idempotence"), Some("true"));
    }

    #[test]
    fn librdkafka_never_gives_a_message_up_on_its_own_and_the_relay_waits_message_timeout_ms() {
        // Whatever the user sets, librdkafka neither times out nor stops retrying a
        // message, and stops on a refusal that would leave a gap.
        let user = settings(&[
            ("message.timeout.ms", "5000"),
            ("retries", "3"),
            ("enable.gapless.guarantee", "false"),
        ]);
        for config in [client_config(&user), eager_config(&user)] {
            assert_eq!(config.get("message.timeout.ms"), Some("0"));
            assert_eq!(config.get("message.send.max.retries"), Some("2147483647"));
            assert_eq!(config.get("retries"), None);
            assert_eq!(config.get("enable.gapless.guarantee"), Some("true"));
        }
        let alias = client_config(&settings(&[("delivery.timeout.ms", "7000")]));
        assert_eq!(alias.get("message.timeout.ms"), Some("0"));
        assert_eq!(alias.get("delivery.timeout.ms"), None);
        // The relay's own deadline takes the user's value.
        let of = |properties: &[(&str, &str)]| deadline(&settings(properties).properties);
        assert_eq!(of(&[]), Ok(Some(Duration::from_secs(20))));
        assert_eq!(
            of(&[("message.timeout.ms", "5000")]),
            Ok(Some(Duration::from_secs(5)))
        );
        assert_eq!(
            of(&[("delivery.timeout.ms", "7000")]),
            Ok(Some(Duration::from_secs(7)))
        );
        assert_eq!(of(&[("message.timeout.ms", "0")]), Ok(None));
        for bad in ["soon", "-1", "2147483648", "1"] {
            let err = of(&[("message.timeout.ms", bad)]).expect_err(bad);
            assert!(err.contains("message.timeout.ms"), "{err}");
        }
        let err = of(&[("delivery.timeout.ms", "50"), ("linger.ms", "50")]).expect_err("linger");
        assert!(err.contains("linger.ms"), "{err}");
        // The default too.
        let err = of(&[("linger.ms", "30000")]).expect_err("linger over the default");
        assert!(err.contains("20000"), "{err}");
        // `check` says so before any relay starts.
        let found = problems(serde_json::json!({"delivery.timeout.ms": "soon"}));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].field, "spec.broker.kafka.properties");
    }

    #[tokio::test]
    async fn nothing_is_queued_on_a_withdrawn_producer() {
        let broker = KafkaBroker::new(&unreachable(&[])).expect("a producer");
        let old = broker.batching.get().expect("made");
        let room_by = tokio::time::Instant::now() + ROOM_WAIT;
        let message = message(b"{}");
        enqueue(&old, record(&message, Some(0)), room_by)
            .await
            .expect("queued");
        assert!(broker.withdraw(&broker.batching, &old));
        // A rest that took the producer before it was withdrawn queues no more on it.
        let refused = enqueue(&old, record(&message, Some(0)), room_by).await;
        assert!(matches!(refused, Err(Failure::Closed)));
        // The next send goes through a new one.
        let new = broker.batching.get().expect("made again");
        assert!(!Arc::ptr_eq(&old, &new));
        enqueue(&new, record(&message, Some(0)), room_by)
            .await
            .expect("queued on the new one");
    }

    #[tokio::test]
    async fn a_chains_rest_stops_at_its_first_unacknowledged_message_and_withdraws_the_producer() {
        let broker = KafkaBroker::new(&unreachable(&[
            ("message.timeout.ms", "300"),
            ("message.max.bytes", "1000"),
        ]))
        .expect("a producer");
        let before = broker.batching.get().expect("made");
        let rest: Vec<Message> = (0..5).map(|_| message(b"{}")).collect();
        let outcomes = broker
            .publish_rest(&rest, Delivered::default(), false, &crate::broker::Clear)
            .await;
        assert_eq!(outcomes.len(), 1, "the rest ends with its first failure");
        let err = outcomes[0].as_ref().expect_err("nothing listens on port 9");
        assert!(
            !err.is_refused() && err.message().contains("timed out"),
            "{err:?}"
        );
        let after = broker.batching.get().expect("made again");
        assert!(!Arc::ptr_eq(&before, &after), "the producer was kept");
        // A rest whose first message is too large for the producer fails at once
        // (tests/relay/relay_partitioning.rs sends one refused in the middle to Kafka).
        let rest = [message(&[b'x'; 2000]), message(b"{}")];
        let outcomes = broker
            .publish_rest(&rest, Delivered::default(), false, &crate::broker::Clear)
            .await;
        assert_eq!(outcomes.len(), 1, "{outcomes:?}");
        let err = outcomes[0].as_ref().expect_err("too large");
        assert!(err.is_refused(), "{err:?}");
    }

    #[test]
    fn the_clusters_configuration_is_no_rows_fault() {
        for code in [
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::UnknownTopic,
            RDKafkaErrorCode::UnknownPartition,
            RDKafkaErrorCode::ClusterAuthorizationFailed,
        ] {
            assert!(!is_row_fault(code), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::InvalidTopic,
            RDKafkaErrorCode::InvalidTimestamp,
        ] {
            assert!(is_row_fault(code), "{code:?}");
        }
    }
}
