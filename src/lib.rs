//! outbox-operator: a Kubernetes operator that runs transactional-outbox relays from PostgreSQL to Kafka, NATS JetStream and RabbitMQ.
#![forbid(unsafe_code)]

pub mod api;
pub mod broker;
pub mod check;
pub mod controller;
pub mod error;
pub mod http;
pub mod postgres;
pub mod relay;
pub mod render;
pub mod resources;
pub mod rules;
pub mod secrets;
pub mod spec;
pub mod telemetry;

pub use error::{Error, Result};
