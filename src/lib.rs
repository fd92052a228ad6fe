//! outbox-operator: a Kubernetes operator that runs transactional-outbox relays from PostgreSQL to Kafka, NATS JetStream and RabbitMQ.
#![forbid(unsafe_code)]

pub mod api;
pub mod audit;
pub mod broker;
pub mod check;
pub mod cnpg;
pub mod controller;
pub mod dead_letters;
pub mod debezium;
pub mod error;
pub mod http;
pub mod plugin;
pub mod postgres;
pub mod relay;
pub mod render;
pub mod replay;
pub mod report;
pub mod resources;
pub mod rules;
pub mod schema;
pub mod secrets;
pub mod spec;
pub mod strimzi;
pub mod telemetry;
pub mod tls;

pub use error::{Error, Result};
pub use tls::install_crypto_provider;
