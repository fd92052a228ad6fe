//! The controller against the rig's real kube-apiserver and PostgreSQL (in-process and
//! as a process), its PostgreSQL administration, and `outbox-operator check` and
//! `audit` against the real brokers.
//!
//! One test binary per area (see tests/smoke/main.rs). Run one file's tests with e.g.
//! `cargo test --test controller controller_slots`.

mod audit_window;
#[path = "../common/mod.rs"]
mod common;

mod check_brokers;
mod cli;
mod controller_binary;
mod controller_cnpg;
mod controller_invalid_specs;
mod controller_reconcile;
mod controller_resync;
mod controller_rotation;
mod controller_scale;
mod controller_secret_opt_in;
mod controller_slots;
mod controller_strimzi;
mod controller_tls;
mod plugin_kubectl;
mod postgres_admin;
mod replay_window;
mod slot_leak_matrix;
