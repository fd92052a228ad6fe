//! The retention of published rows — marked rows in the outbox table, moved rows in the
//! archive — deleted in short chunks, by one relay of a table at a time: the one whose
//! session holds the table's retention advisory lock.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_postgres::Client;

use crate::postgres::PgError;
use crate::postgres::polling::{self, RETENTION_KEY};

/// Rows per retention delete statement: short statements, short locks.
pub(crate) const RETENTION_CHUNK: i64 = 1000;

/// When retention runs next, and whether the current session holds the lock.
pub(crate) struct Retention {
    class: i32,
    every: Duration,
    next: Instant,
    holds: bool,
}

impl Retention {
    /// Retention of the outbox table `schema.table` (its lock), every quarter of
    /// `retention` (1 s to 60 s).
    pub(crate) fn new(schema: &str, table: &str, retention: Duration) -> Self {
        let every = (retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
        Self {
            class: polling::lock_class(schema, table),
            every,
            next: Instant::now() + every,
            holds: false,
        }
    }

    /// How long until retention is due (zero when it is).
    pub(crate) fn until_due(&self) -> Duration {
        self.next.saturating_duration_since(Instant::now())
    }

    /// A new session: the lock went with the old one.
    pub(crate) fn new_session(&mut self) {
        self.holds = false;
    }

    /// When due, takes the lock if free and deletes chunk after chunk (`chunk` deletes
    /// at most [`RETENTION_CHUNK`] rows and says how many) until a chunk is short or
    /// shutdown begins. Another relay holding the lock: nothing to do.
    pub(crate) async fn run_if_due<F, Fut>(
        &mut self,
        client: &Client,
        stop: &watch::Receiver<bool>,
        mut chunk: F,
    ) -> Result<(), PgError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<u64, PgError>>,
    {
        if Instant::now() < self.next {
            return Ok(());
        }
        self.next = Instant::now() + self.every;
        if !self.holds {
            self.holds = polling::try_lock(client, self.class, RETENTION_KEY).await?;
        }
        if !self.holds {
            return Ok(());
        }
        loop {
            let deleted = chunk().await?;
            if deleted > 0 {
                tracing::debug!(deleted, "deleted old published rows");
            }
            if deleted < u64::try_from(RETENTION_CHUNK).unwrap_or(0) || *stop.borrow() {
                return Ok(());
            }
        }
    }
}
