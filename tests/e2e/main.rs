//! End to end, as a user runs the operator: the example manifests and both modes
//! through the controller and the pod runner, the pod runner itself, and `make demo`'s
//! program for a bounded time.
//!
//! One test binary per area (see tests/smoke/main.rs). Run one file's tests with e.g.
//! `cargo test --test e2e e2e_operator`.

#[path = "../common/mod.rs"]
mod common;

mod demo_run;
mod e2e_backfill;
mod e2e_broker_down;
mod e2e_examples;
mod e2e_failover;
mod e2e_kubelet;
mod e2e_node;
mod e2e_operator;
mod e2e_platform;
mod e2e_pod_runner;
mod e2e_slot_lost;
mod e2e_suspend;
mod e2e_tools;
mod e2e_wal_budget;
