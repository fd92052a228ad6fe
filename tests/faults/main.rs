//! The fault matrix: each mode (polling, log tailing) × each broker (Kafka, NATS
//! JetStream, RabbitMQ) under a steady application load, through one fault:
//!
//! - `kill`: the relay SIGKILLed 20 times at random points and started again;
//! - `db_cut`: the network between relay and PostgreSQL cut (every connection closed,
//!   new ones refused) for 3 s, twice, through a TCP proxy (tests/common/proxy.rs);
//! - `broker_cut`: the same between relay and broker (for Kafka, whose clients connect
//!   to the addresses the broker advertises, a private broker that advertises the
//!   proxy);
//! - `db_restart`: a private PostgreSQL stopped and started again (3 s down) between
//!   two halves of the load;
//! - `broker_restart`: a private Kafka, NATS or RabbitMQ server stopped and started
//!   again (3 s down) under the load.
//!
//! An independent consumer (the test's own client of each broker) then reads every
//! message: every committed event must have arrived, each aggregate's events in commit
//! order (first deliveries), none of a rolled-back transaction; duplicates are counted
//! and reported. Each scenario prints one row of the matrix.
//!
//! A binary of its own so the faults do not slow the other relay tests; cargo runs its
//! scenarios two at a time. Run one with `cargo test --test faults kill_log_tailing_nats`.

#[path = "../common/mod.rs"]
mod common;

mod matrix;
