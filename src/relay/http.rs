//! What the relay reports over HTTP (served by [`crate::http`]): its metrics, and ready
//! while it has a working PostgreSQL session.

use std::sync::atomic::{AtomicBool, Ordering};

use super::metrics::Metrics;

/// Shared state the relay's HTTP server reports.
pub struct Health {
    /// Metrics to expose.
    pub metrics: Metrics,
    /// True while the relay has a working database session.
    pub ready: AtomicBool,
    /// Log tailing: the publication no longer publishes the outbox table, so nothing
    /// past that point is confirmed (and the relay is not ready).
    pub uncovered: AtomicBool,
}

impl crate::http::Probe for Health {
    fn metrics(&self) -> String {
        self.metrics.encode()
    }

    fn readiness(&self) -> Result<(), &'static str> {
        if self.uncovered.load(Ordering::Relaxed) {
            Err("the publication no longer publishes the outbox table")
        } else if self.ready.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err("not connected to PostgreSQL")
        }
    }
}
