//! Logging setup shared by every subcommand: JSON lines on stderr, filtered by
//! `RUST_LOG` (default `info`).

use tracing_subscriber::EnvFilter;

/// Installs the global JSON logger. Safe to call more than once (later calls do nothing),
/// so tests that start several components in one process can all call it.
pub fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_current_span(false)
        .with_writer(std::io::stderr)
        .try_init();
}
