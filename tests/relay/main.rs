//! The relay process against the rig's real PostgreSQL and brokers: delivery per
//! broker, crashes, poison rows, log tailing, housekeeping, outages and partition
//! ownership.
//!
//! One test binary per area (see tests/smoke/main.rs). Run one file's tests with e.g.
//! `cargo test --test relay relay_log_tailing`.

#[path = "../common/mod.rs"]
mod common;

mod relay_archive;
mod relay_broker_tls;
mod relay_brokers;
mod relay_clean_stop;
mod relay_cloudevents;
mod relay_compression;
mod relay_crash;
mod relay_dead_letters;
mod relay_debezium;
mod relay_deletes;
mod relay_failover;
mod relay_failures;
mod relay_fatal;
mod relay_ids;
mod relay_ids_faults;
mod relay_lock_session;
mod relay_log_tailing;
mod relay_maintenance;
mod relay_outage;
mod relay_ownership;
mod relay_partitioning;
mod relay_payloads;
mod relay_pooler;
mod relay_publication;
mod relay_records;
mod relay_standby;
mod relay_sweep;
mod relay_tls;
mod relay_tracing;
