//! The producers the Kafka publisher keeps: one per kind (batching, chain steps), each
//! made when first needed and made again after it is retired, with the client context
//! that keeps the last connection error librdkafka reported.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::FutureProducer;

use crate::broker::PublishError;

/// librdkafka reports why it cannot reach a broker (TLS, SASL, DNS) only through the
/// client's error callback, while a send just times out. This context logs each such
/// error and keeps the last one, so a failed publish or `check` says why.
#[derive(Default)]
pub(super) struct Context {
    pub(super) last_error: LastError,
    /// Set once the producer is withdrawn: what it reports after that is expected.
    pub(super) withdrawn: Withdrawn,
    /// `check`'s probe: the idempotent producer's state (`eos.idemp_state`) from the
    /// client's last statistics. `None` for the relay's producers, whose statistics
    /// (only with a user's `statistics.interval.ms`) are logged.
    pub(super) idempotence: Option<Arc<Mutex<Option<String>>>>,
}

/// Whether a producer was withdrawn (see `KafkaBroker::withdraw`): no message is
/// queued on it after that. Queueing holds the read lock, withdrawing the write lock,
/// so a purge never lands between a rest's check and its queueing.
#[derive(Clone, Default)]
pub(super) struct Withdrawn(pub(super) Arc<std::sync::RwLock<bool>>);

impl Withdrawn {
    fn is_set(&self) -> bool {
        *self.0.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The last connection-level error librdkafka reported, shared with the producer's
/// owner.
#[derive(Clone, Default)]
pub(super) struct LastError(Arc<Mutex<Option<String>>>);

impl LastError {
    pub(super) fn get(&self) -> Option<String> {
        self.0.lock().ok().and_then(|e| e.clone())
    }
}

/// A producer and the last connection error it reported (each its own: a retired
/// producer's errors say nothing of its successor).
pub(super) struct KafkaProducer {
    pub(super) client: FutureProducer<Context>,
    pub(super) last_error: LastError,
    pub(super) withdrawn: Withdrawn,
}

/// One of the relay's two producers: made when first needed, and made again after
/// [`Slot::retire`].
pub(super) struct Slot {
    /// For the log.
    pub(super) name: &'static str,
    config: ClientConfig,
    current: Mutex<Option<Arc<KafkaProducer>>>,
    /// Producers of this slot retired on a fatal error since the last acknowledgement
    /// (of either slot).
    pub(super) fatal_in_a_row: AtomicU32,
    /// The last such error's code: what the relay gives as the reason it stops. Not
    /// librdkafka's whole reason, which names a broker picked at random and may hold
    /// sequence numbers and times (each retirement logs it): the reason reaches the
    /// pod's status, which should read the same at every restart.
    pub(super) last_fatal: Mutex<Option<RDKafkaErrorCode>>,
}

impl Slot {
    pub(super) fn new(name: &'static str, config: ClientConfig) -> Self {
        Self {
            name,
            config,
            current: Mutex::new(None),
            fatal_in_a_row: AtomicU32::new(0),
            last_fatal: Mutex::new(None),
        }
    }

    /// The current producer, made now if there is none.
    pub(super) fn get(&self) -> Result<Arc<KafkaProducer>, PublishError> {
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
    pub(super) fn existing(&self) -> Option<Arc<KafkaProducer>> {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Counts a producer of this slot retired on a fatal error `code`. A record the
    /// broker refused stops the producer by the gap-less guarantee: that is the row's
    /// fault (counted against its attempts), not the client's, and is not counted here.
    pub(super) fn stopped_fatally(&self, code: RDKafkaErrorCode) {
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
    pub(super) fn retire(&self, used: &Arc<KafkaProducer>) -> bool {
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
            // The relay sets it on purpose (see `broker::kafka`'s notes); librdkafka warns
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
