//! outbox-operator: a Kubernetes operator that runs transactional-outbox relays from PostgreSQL to Kafka, NATS JetStream and RabbitMQ.
#![forbid(unsafe_code)]

pub mod api;
pub mod broker;
pub mod check;
pub mod cnpg;
pub mod controller;
pub mod debezium;
pub mod error;
pub mod http;
pub mod postgres;
pub mod relay;
pub mod render;
pub mod resources;
pub mod rules;
pub mod schema;
pub mod secrets;
pub mod spec;
pub mod telemetry;
pub mod tls;

pub use error::{Error, Result};

/// Makes rustls's ring provider the process default. Every TLS client of the binary
/// (kube, lapin, async-nats, tokio-postgres) is built on ring, but pgwire-replication
/// enables tokio-rustls's default features, which compile aws-lc-rs in as well; with two
/// providers rustls no longer picks one by itself. Idempotent; call before any client
/// is built.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
