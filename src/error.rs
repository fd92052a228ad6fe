//! The crate-wide error type, with a bounded category for metric labels.

/// Everything that can go wrong in the operator, the relay and the CLI.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `outbox-operator check` cannot run (its input is incomplete).
    #[error("check: {0}")]
    Check(String),
    /// `outbox-operator audit` cannot run (its input is incomplete, or a server cannot
    /// be read).
    #[error("audit: {0}")]
    Audit(String),
    /// `outbox-operator dead-letters` cannot run.
    #[error("dead-letters: {0}")]
    DeadLetters(String),
    /// `outbox-operator replay` cannot run.
    #[error("replay: {0}")]
    Replay(String),
    /// A `kubectl outbox` command failed.
    #[error("kubectl outbox: {0}")]
    Plugin(String),
    /// The relay (`outbox-operator relay`) failed.
    #[error(transparent)]
    Relay(#[from] crate::relay::RelayError),
    /// The controller, `crd` or `render` failed.
    #[error(transparent)]
    Controller(#[from] crate::controller::Error),
}

impl Error {
    /// A fixed, low-cardinality name for this error, safe to use as a metric label.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Check(_) => "check",
            Error::Audit(_) => "audit",
            Error::DeadLetters(_) => "dead_letters",
            Error::Replay(_) => "replay",
            Error::Plugin(_) => "plugin",
            Error::Relay(_) => "relay",
            Error::Controller(err) => err.category(),
        }
    }
}

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
