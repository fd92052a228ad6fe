//! Memory under load that would not fit: a 1,000,000-row transaction through log
//! tailing, with the relay held to 128 MiB.
//!
//! A binary of its own because cargo runs test binaries one after another: this test
//! writes gigabytes of WAL and a million Kafka messages, and beside other tests of
//! the shared rig (slots retaining WAL, broker restarts) it would make them slow and
//! flaky. Run it with `cargo test --test memory`.

#[path = "../common/mod.rs"]
mod common;

mod large_transaction;
