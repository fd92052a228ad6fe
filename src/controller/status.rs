//! Status conditions: building them, keeping `lastTransitionTime` when nothing changed,
//! and deciding whether the status needs a write at all.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::api::OutboxRelayStatus;

/// The relay is publishing (its pods are available).
pub const CONDITION_READY: &str = "Ready";
/// The spec or its Secrets keep the relay from running as asked.
pub const CONDITION_DEGRADED: &str = "Degraded";
/// The connection Secret exists, the controller connects, and the table has every
/// configured column and the privileges the mode needs.
pub const CONDITION_DATABASE_READY: &str = "DatabaseReady";
/// What the controller can tell about the broker: its Secrets exist.
pub const CONDITION_BROKER_READY: &str = "BrokerReady";
/// Log tailing: wal_level, replication privilege, free slots, and the slot and
/// publication themselves.
pub const CONDITION_SLOT_READY: &str = "SlotReady";
/// Whether the log-tailing slot survives the promotion of a standby.
pub const CONDITION_FAILOVER_READY: &str = "FailoverReady";
/// Log tailing with a WAL budget: whether the relay polls because its slot passed
/// `spec.mode.logTailing.maxRetainedWal`.
pub const CONDITION_POLLING_FALLBACK: &str = "PollingFallback";
/// Whether the ServiceMonitor and PrometheusRule could be created.
pub const CONDITION_MONITORING_READY: &str = "MonitoringReady";

/// A condition as the reconciler decides it; the timestamp is filled in by [`merge`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cond {
    /// Condition type.
    pub type_: &'static str,
    /// `True`, `False` or `Unknown`.
    pub status: bool,
    /// PascalCase reason.
    pub reason: &'static str,
    /// For people; never holds a secret value.
    pub message: String,
}

impl Cond {
    /// A condition with status True.
    pub fn yes(type_: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: true,
            reason,
            message: message.into(),
        }
    }

    /// A condition with status False.
    pub fn no(type_: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: false,
            reason,
            message: message.into(),
        }
    }
}

/// The new condition list: `lastTransitionTime` is kept from `old` for every condition
/// whose status did not change, so that a reconcile that changes nothing writes nothing.
pub fn merge(
    old: &[Condition],
    new: &[Cond],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    new.iter()
        .map(|c| {
            let status = if c.status { "True" } else { "False" }.to_owned();
            let last_transition_time = old
                .iter()
                .find(|o| o.type_ == c.type_ && o.status == status)
                .map_or(Time(now), |o| o.last_transition_time.clone());
            Condition {
                type_: c.type_.to_owned(),
                status,
                reason: c.reason.to_owned(),
                message: c.message.clone(),
                observed_generation: generation,
                last_transition_time,
            }
        })
        .collect()
}

/// Whether the conditions, generation, mode or broker changed: a change worth a write
/// at once. The timestamps are already carried over by [`merge`].
pub fn differs(current: Option<&OutboxRelayStatus>, desired: &OutboxRelayStatus) -> bool {
    let empty = OutboxRelayStatus::default();
    let current = current.unwrap_or(&empty);
    current.observed_generation != desired.observed_generation
        || current.mode != desired.mode
        || current.broker != desired.broker
        || normalized(&current.conditions) != normalized(&desired.conditions)
}

fn normalized(conditions: &[Condition]) -> Vec<(String, String, String, String, Option<i64>)> {
    let mut list: Vec<_> = conditions
        .iter()
        .map(|c| {
            (
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone(),
                c.message.clone(),
                c.observed_generation,
            )
        })
        .collect();
    list.sort();
    list
}

/// The condition of `type_` in a status, if any.
pub fn find<'a>(status: Option<&'a OutboxRelayStatus>, type_: &str) -> Option<&'a Condition> {
    status?.conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).unwrap()
    }

    #[test]
    fn unchanged_conditions_keep_their_transition_time_and_write_nothing() {
        let conds = [Cond::yes(CONDITION_READY, "RelayAvailable", "1 of 1")];
        let first = merge(&[], &conds, Some(1), at(100));
        let second = merge(&first, &conds, Some(1), at(200));
        assert_eq!(first, second);
        let status = |c: Vec<Condition>| OutboxRelayStatus {
            observed_generation: Some(1),
            conditions: c,
            ..OutboxRelayStatus::default()
        };
        assert!(!differs(Some(&status(first)), &status(second)));
    }

    #[test]
    fn a_status_flip_takes_a_new_transition_time() {
        let old = merge(&[], &[Cond::yes(CONDITION_READY, "A", "")], None, at(100));
        let new = merge(&old, &[Cond::no(CONDITION_READY, "B", "")], None, at(200));
        assert_eq!(new[0].last_transition_time, Time(at(200)));
    }

    #[test]
    fn a_new_generation_is_a_change() {
        let a = OutboxRelayStatus {
            observed_generation: Some(1),
            ..OutboxRelayStatus::default()
        };
        let b = OutboxRelayStatus {
            observed_generation: Some(2),
            ..OutboxRelayStatus::default()
        };
        assert!(differs(Some(&a), &b));
        assert!(differs(None, &b));
    }
}
