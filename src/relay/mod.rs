//! The data plane: what runs inside relay pods (`outbox-operator relay --config FILE`).

pub mod config;
