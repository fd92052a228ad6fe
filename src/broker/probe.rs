//! What `outbox-operator check` asks a broker: can the relay's client connect with the
//! relay's settings, and does the destination exist? Read-only: nothing is created
//! (Kafka's metadata request is made with topic auto-creation off).
//!
//! Credentials that reach a relay pod as mounted files (Kafka CA, NATS credentials) are
//! read from local paths named by environment variables here; values from Secrets
//! (RabbitMQ URI, Kafka SASL) from the same variables the relay reads.

use std::time::Duration;

use super::AGGREGATE_TYPE_PLACEHOLDER;

pub use crate::secrets::{ENV_BROKER_CA_FILE, ENV_NATS_CREDENTIALS_FILE};

/// How long each connection attempt may take.
pub(super) const TIMEOUT: Duration = Duration::from_secs(5);

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Short name: `broker`, `topic`, `stream`, `exchange`.
    pub name: &'static str,
    /// Passed.
    pub ok: bool,
    /// What was found, or what to fix.
    pub message: String,
}

impl Probe {
    pub(super) fn ok(name: &'static str, message: impl Into<String>) -> Self {
        Self {
            name,
            ok: true,
            message: message.into(),
        }
    }

    pub(super) fn fail(name: &'static str, message: impl Into<String>) -> Self {
        Self {
            name,
            ok: false,
            message: message.into(),
        }
    }
}

/// Where a template has `{aggregateType}`, the destination cannot be checked as one.
pub(super) fn templated(template: &str) -> bool {
    template.contains(AGGREGATE_TYPE_PLACEHOLDER)
}
