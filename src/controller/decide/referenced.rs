//! Clusters of other operators a relay names (a CloudNativePG `Cluster`, a Strimzi
//! `Kafka` and `KafkaUser`): one that cannot be used as named says so first, with the
//! field to change. Its Secrets are that operator's, so a missing one follows from it.

use super::{Decision, Next, not_ready};
use crate::api::SlotStatus;
use crate::controller::observe::Observed;
use crate::controller::status::{
    CONDITION_BROKER_READY, CONDITION_DATABASE_READY, CONDITION_SLOT_READY, Cond,
};
use crate::spec::ValidRelay;

/// The decision when a referenced cluster cannot be used (`None`: every one can).
pub(super) fn unusable(
    valid: &ValidRelay,
    observed: &Observed,
    kept_slot: Option<&SlotStatus>,
) -> Option<Decision> {
    let tailing = valid.mode.log_tailing().is_some();
    if let (Some(reference), Some(seen)) = (valid.database_ref(), observed.cluster.as_ref())
        && let Some(problem) = crate::cnpg::problem(reference, seen, tailing)
    {
        let mut conds = vec![
            Cond::no(
                CONDITION_DATABASE_READY,
                problem.reason,
                problem.message.clone(),
            ),
            observed.secrets.broker.clone(),
        ];
        if tailing {
            conds.push(Cond::no(
                CONDITION_SLOT_READY,
                "DatabaseNotReady",
                format!("not checked: {}", problem.message),
            ));
        }
        return Some(not_ready(
            problem.reason,
            problem.message,
            conds,
            kept_slot.cloned(),
            Next::Refresh,
        ));
    }
    if let (Some(reference), Some(seen)) = (valid.kafka_ref(), observed.strimzi.as_ref())
        && let Some(problem) = crate::strimzi::problem(reference, seen)
    {
        let conds = vec![
            observed.secrets.database.clone(),
            Cond::no(
                CONDITION_BROKER_READY,
                problem.reason,
                problem.message.clone(),
            ),
        ];
        return Some(not_ready(
            problem.reason,
            problem.message,
            conds,
            kept_slot.cloned(),
            Next::Refresh,
        ));
    }
    None
}
