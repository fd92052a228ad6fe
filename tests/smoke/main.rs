//! Smoke tests of the test rig itself (tests/rig/): each server and tool the other
//! tests rely on answers and behaves as they assume, plus the pure helpers of
//! tests/common.
//!
//! One test binary per area (smoke, relay, controller, packaging, e2e, memory,
//! faults) instead of one per file: each binary links the whole crate and its heavy
//! dependencies, so fewer binaries link far less. Run one file's tests with e.g.
//! `cargo test --test smoke rig_kafka`.

#[path = "../common/mod.rs"]
mod common;

mod rig_kafka;
mod rig_kubernetes;
mod rig_nats;
mod rig_postgres;
mod rig_prometheus;
mod rig_rabbitmq;
mod rig_support;
mod rig_tools;
