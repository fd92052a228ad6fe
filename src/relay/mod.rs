//! The data plane: what runs inside relay pods (`outbox-operator relay --config FILE`).
//!
//! # A row's path
//!
//! Polling (`polling/`): each worker runs one transaction per batch, on the session
//! that holds its partition locks.
//!
//! ```text
//!   outbox table
//!     | select batch: the oldest unpublished rows    polling/worker.rs
//!     | of the owned partitions, locked              postgres/table.rs
//!     v
//!   chains, one per aggregate                        chains.rs
//!     | a chain's first message with the batch's,
//!     | the rest once it is acknowledged; nothing
//!     | after the fence
//!     v
//!   broker: row -> message, publish, wait for        broker/message.rs,
//!   the acknowledgement                              broker/{kafka,nats,amqp}
//!     | refused: counted, paused, blocked or         polling/shared.rs
//!     | dead-lettered; outage: back off
//!     v
//!   mark or delete the published rows                postgres/table.rs
//!     v
//!   commit                                           polling/worker.rs
//! ```
//!
//! Log tailing (`log_tailing/`): whole committed transactions from the slot, confirmed
//! only once the broker acknowledged them.
//!
//! ```text
//!   replication slot (pgoutput): the stream          log_tailing/mod.rs,
//!   of committed inserts                             postgres/replication.rs
//!     | a tuple becomes a row                        log_tailing/layout.rs
//!     v
//!   batch of whole transactions (a large one         log_tailing/batch.rs
//!   in chunks)
//!     v
//!   chains, one per aggregate                        chains.rs
//!     v
//!   broker: row -> message, publish, wait for        broker/message.rs,
//!   the acknowledgements, retry until all are in     broker/{kafka,nats,amqp}
//!     v
//!   confirm the last commit to the slot              log_tailing/batch.rs
//!     or, with deleteAfterPublish:
//!   deleter: delete the rows by id, then confirm     log_tailing/deleter.rs
//! ```
//!
//! Beside the stream, log tailing also publishes rows from the table itself, through
//! the same chains, as polling does: the sweep for rows the stream missed
//! (`log_tailing/sweep.rs`) and the back-fill after a publication change
//! (`log_tailing/gap.rs`). With `spec.tracing`, each publish is a span
//! (`traces.rs` wraps the broker).

mod backoff;
pub mod chains;
pub mod config;
pub mod http;
mod log_tailing;
pub mod metrics;
pub mod ownership;
mod polling;
mod retention;
pub mod traces;

use std::path::Path;
use std::sync::Arc;

use tokio::sync::watch;

use config::{ConfigError, RelayConfig, Settings};

/// Leaves why the relay stopped where the kubelet reads it, so that the pod's status
/// (`lastState.terminated.message`) and the OutboxRelay's `Ready` condition say it, not
/// only the log. Only in a pod: outside one the file does not exist and none is made.
pub fn leave_termination_message(err: &RelayError) {
    leave_termination_message_at(Path::new(crate::report::TERMINATION_MESSAGE_PATH), err);
}

fn leave_termination_message_at(path: &Path, err: &RelayError) {
    crate::report::leave_at(path, &err.to_string());
}

/// Why the relay stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The configuration file is unreadable or invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The HTTP server cannot listen.
    #[error("cannot serve /metrics on {addr}: {source}")]
    Listen {
        /// The configured address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The broker client cannot be built.
    #[error("broker: {0}")]
    Broker(String),
    /// The broker client can never publish again ([`crate::broker::Broker::broken`]
    /// says why); both modes end with it.
    #[error("broker: the broker client failed permanently ({0}); restarting")]
    BrokerBroken(String),
    /// Signal handlers cannot be installed.
    #[error("cannot install the SIGTERM handler: {0}")]
    Signal(std::io::Error),
    /// The database URL reaches a pooler that lends sessions per transaction.
    #[error("{0}")]
    PooledSessions(String),
    /// A polling worker ended unexpectedly (it panicked).
    #[error("{0}")]
    Worker(String),
}

/// Runs the relay until SIGTERM or SIGINT; returns once the in-flight batch is finished
/// or rolled back and every lock is released.
pub async fn run(path: &Path) -> Result<(), RelayError> {
    crate::telemetry::init_logging();
    // First of all: a SIGTERM while the relay is still starting (the broker slow to
    // answer, a pod deleted as it comes up) ends it cleanly rather than by the signal.
    let mut stop_rx = stop_on_signal()?;
    let config = RelayConfig::load(path)?;
    let mut settings = Settings::from_config(&config)?;
    // Beside the config file, where the operator's ConfigMap puts it (absent or empty:
    // none recorded).
    settings.coverage_baseline =
        std::fs::read_to_string(path.with_file_name(crate::resources::COVERAGE_BASELINE_KEY))
            .ok()
            .map(|text| text.trim().to_owned())
            .filter(|text| !text.is_empty());
    let identity = config.relay.clone();
    let health = Arc::new(http::Health::with_loops(
        metrics::Metrics::new(
            &identity.namespace,
            &identity.name,
            settings.log_tailing.is_some(),
        ),
        settings.workers,
    ));
    let addr = crate::http::serve(settings.listen, health.clone(), std::future::pending())
        .await
        .map_err(|source| RelayError::Listen {
            addr: settings.listen,
            source,
        })?;
    let connected = tokio::select! {
        connected = settings.broker.connect() => connected,
        _ = stop_rx.wait_for(|stop| *stop) => {
            tracing::info!("relay stopped before it connected to the broker");
            return Ok(());
        }
    };
    let broker = connected.map_err(|e| RelayError::Broker(e.message().into_owned()))?;
    let kind = settings.broker.kind();
    let shape = settings.valid.shape();
    let (broker, traces) = match settings.valid.tracing.clone() {
        Some(t) => {
            let (ns, name) = (identity.namespace.clone(), identity.name.clone());
            let started =
                tokio::task::spawn_blocking(move || traces::Traces::start(&t, &ns, &name))
                    .await
                    .map_err(|e| RelayError::Broker(format!("starting the span exporter: {e}")))?
                    .map_err(|e| RelayError::Broker(e.to_string()))?;
            let (traces, tracer) = started;
            let traced: Arc<dyn crate::broker::Broker> =
                Arc::new(traces::TracedBroker::new(broker, tracer, kind));
            (traced, Some(traces))
        }
        None => (broker, None),
    };
    tracing::info!(
        relay_namespace = %identity.namespace,
        relay_name = %identity.name,
        database = %crate::postgres::redact_url(&settings.database_url),
        listen = %addr,
        broker = ?kind,
        partitions = settings.valid.partitions,
        "relay starting"
    );
    if let Some(refusal) = pooled_sessions(&settings, &stop_rx, &health).await {
        tracing::error!(error = %refusal, "refusing to run");
        return Err(RelayError::PooledSessions(refusal));
    }
    let result = match settings.log_tailing.clone() {
        Some(lt) => {
            log_tailing::LogTailer::new(settings, lt, broker, shape, health, stop_rx)
                .run()
                .await
        }
        None => {
            polling::Publisher::new(settings, broker, shape, health, stop_rx)
                .run()
                .await
        }
    };
    if let Some(traces) = traces {
        let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
    }
    tracing::info!("relay stopped");
    result
}

/// Installs the SIGTERM and SIGINT handlers; the receiver turns `true` on either.
fn stop_on_signal() -> Result<watch::Receiver<bool>, RelayError> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(RelayError::Signal)?;
    tokio::spawn(async move {
        tokio::select! {
            _ = sigterm.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("shutdown requested: finishing the in-flight batch");
        let _ = stop_tx.send(true);
    });
    Ok(stop_rx)
}

/// Probes the database URL for a pooler that lends sessions per transaction before
/// anything relies on a session ([`crate::postgres::pooling`]); `Some(refusal)` when it
/// does. A database that cannot be reached yet is waited for (the work loops would
/// wait too); a shutdown meanwhile ends the wait with `None`.
async fn pooled_sessions(
    settings: &Settings,
    stop: &watch::Receiver<bool>,
    health: &http::Health,
) -> Option<String> {
    use crate::postgres;
    let connect = || postgres::connect(&settings.database_url, &settings.url_env, &settings.pg_tls);
    loop {
        let probed = async {
            let (a, b) = (connect().await?, connect().await?);
            postgres::pooling::pooled_sessions(&a, &b).await
        };
        match probed.await {
            Ok(verdict) => return verdict.map(|why| postgres::pooling::refusal(&why)),
            Err(err) => {
                tracing::warn!(error = %err, "cannot reach the database yet; retrying");
                nap(stop, health, std::time::Duration::from_secs(2)).await;
                if *stop.borrow() {
                    return None;
                }
            }
        }
    }
}

/// Sleeps for `pause`, waking early on shutdown, and counts as the work loop turning
/// at least every [`TURN_EVERY`] meanwhile (a long poll interval is not a stuck loop).
pub(crate) async fn nap(
    stop: &watch::Receiver<bool>,
    health: &http::Health,
    pause: std::time::Duration,
) {
    nap_as(stop, health, 0, pause).await;
}

/// [`nap`] for work loop `index` (a polling worker).
pub(crate) async fn nap_as(
    stop: &watch::Receiver<bool>,
    health: &http::Health,
    index: usize,
    pause: std::time::Duration,
) {
    let mut stop = stop.clone();
    let until = tokio::time::Instant::now() + pause;
    loop {
        health.turned_by(index);
        let now = tokio::time::Instant::now();
        if now >= until {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep_until(until.min(now + TURN_EVERY)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The messages of one round of publishing that failed for no fault of their own (the
/// broker unreachable, or refusing the client: an outage, retried without counting
/// against the rows), logged as one line for the round rather than one a row: an outage
/// under a 1,000-row batch made a thousand lines a retry.
#[derive(Default)]
pub(crate) struct Outage {
    rows: usize,
    first: Option<(crate::postgres::RowId, crate::broker::PublishError)>,
}

impl Outage {
    /// Counts a chain whose first message failed with `err`: its rows wait for the next
    /// try. Keeps the first failure's row and error, preferring one the broker gave to
    /// the relay's own "not sent" (a message held back behind another's failure, or by
    /// the fence), which says nothing of the cause.
    pub(crate) fn add(
        &mut self,
        rows: &[crate::postgres::OutboxRow],
        err: &crate::broker::PublishError,
    ) {
        let Some(first) = rows.first() else {
            return;
        };
        self.rows += rows.len();
        if self
            .first
            .as_ref()
            .is_none_or(|(_, kept)| kept.is_held_back() && !err.is_held_back())
        {
            self.first = Some((first.id.clone(), err.clone()));
        }
    }

    /// One warning for the round, if anything failed; `health` hears whether the
    /// broker took anything this round (`published` rows) or failed all of it.
    pub(crate) fn report(&self, health: &http::Health, published: usize) {
        if published > 0 {
            health.broker_took();
        }
        if let Some((row, error)) = &self.first {
            if published == 0 && !error.is_held_back() {
                health.broker_failed(&error.message());
            }
            tracing::warn!(
                rows = self.rows,
                first_row = %row,
                error = %error,
                "rows not published this round, not for a fault of their own; will retry"
            );
        }
    }
}

/// Payload bytes a batch holds at most (log tailing ends a batch there; polling sizes
/// its next batch to it): rows are held as rows, as messages and as the producer's
/// copies at once, so 16 KiB payloads in batches of 1,000 rows made a 164 MiB relay.
pub(crate) const MAX_BATCH_BYTES: usize = 2 * 1024 * 1024;

/// How often a waiting loop still counts as turning (well below
/// [`http::STUCK_AFTER_SECONDS`]).
pub(crate) const TURN_EVERY: std::time::Duration = std::time::Duration::from_secs(20);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_counts_every_waiting_row_and_keeps_the_first_failure() {
        let row = |id: i64| crate::postgres::OutboxRow {
            id: id.into(),
            aggregate_type: "order".to_owned(),
            aggregate_id: None,
            event_type: None,
            payload: None,
            extra: Vec::new(),
            partition: 0,
            created_at: None,
            timestamp: None,
        };
        let mut outage = Outage::default();
        outage.add(
            &[],
            &crate::broker::PublishError::outage("nothing to count"),
        );
        assert!(outage.first.is_none());
        outage.add(
            &[row(7), row(9)],
            &crate::broker::PublishError::outage("timed out"),
        );
        outage.add(&[row(8)], &crate::broker::PublishError::outage("later"));
        assert_eq!(outage.rows, 3);
        let (first, error) = outage.first.clone().expect("a first failure");
        assert_eq!(first, 7.into());
        assert_eq!(error.message(), "timed out");
        // The relay's own "not sent" gives way to the broker's reason.
        let mut outage = Outage::default();
        let held = crate::broker::PublishError::held_back("behind another");
        outage.add(&[row(3)], &held);
        outage.add(&[row(4)], &crate::broker::PublishError::outage("refused"));
        outage.add(&[row(5)], &held);
        let (first, error) = outage.first.clone().expect("a first failure");
        assert_eq!((first, &*error.message()), (4.into(), "refused"));
    }

    #[test]
    fn the_termination_message_goes_only_to_a_file_the_kubelet_provides() {
        let dir = tempfile::tempdir().expect("tempdir");
        let provided = dir.path().join("termination-log");
        std::fs::write(&provided, "an older message, longer than the new one").expect("write");
        let err = RelayError::Broker("the broker client failed permanently (why)".to_owned());
        leave_termination_message_at(&provided, &err);
        assert_eq!(
            std::fs::read_to_string(&provided).expect("read"),
            "broker: the broker client failed permanently (why)"
        );
        // Outside a pod: nothing is made.
        let missing = dir.path().join("none");
        leave_termination_message_at(&missing, &err);
        assert!(!missing.exists());
        // The kubelet keeps 4 KiB: a longer message is cut there, on a character.
        let long = RelayError::Broker("€".repeat(3000));
        leave_termination_message_at(&provided, &long);
        let kept = std::fs::read_to_string(&provided).expect("read");
        assert!(kept.len() <= crate::report::TERMINATION_MESSAGE_MAX && kept.len() > 4000);
        assert!(kept.ends_with('€'));
    }
}
