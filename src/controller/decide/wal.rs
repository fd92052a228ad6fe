//! Retained WAL past the alert threshold (`spec.alerting.slotRetainedWal`, default 1Gi)
//! is not a relay that "runs as specified": whatever holds the slot back (a row that
//! blocks the stream, a stalled broker, a relay scaled to zero), the server's disk pays
//! for it. So `Degraded` turns `True` (`SlotRetainingWal`) with the figure, beside the
//! alert, whether or not a WAL budget (`maxRetainedWal`) would act on it later.

use super::{CONDITION_DEGRADED, Cond, Decision};
use crate::api::SlotStatus;
use crate::spec::ValidRelay;

/// Finishes `decision` with what status last showed of the slot's retained WAL.
pub(super) fn settle(decision: &mut Decision, valid: &ValidRelay, last_slot: Option<&SlotStatus>) {
    let Some(lt) = valid.mode.log_tailing() else {
        return;
    };
    let threshold = valid.alerting.slot_retained_wal_bytes;
    let Some(retained) = last_slot
        .filter(|s| s.name == lt.slot)
        .and_then(|s| s.retained_wal_bytes)
        .and_then(|b| u64::try_from(b).ok())
        .filter(|b| threshold > 0 && *b > threshold)
    else {
        return;
    };
    if let Some(degraded) = decision
        .conditions
        .iter_mut()
        .find(|c| c.type_ == CONDITION_DEGRADED && !c.status)
    {
        *degraded = Cond::yes(
            CONDITION_DEGRADED,
            "SlotRetainingWal",
            format!(
                "replication slot {} retains {} of WAL on the database server, above {} (spec.alerting.slotRetainedWal): the relay is not keeping up or is held back (its pods' readiness says why); the server's disk fills if it keeps growing{}",
                lt.slot,
                super::bytes_for_people(retained),
                super::bytes_for_people(threshold),
                if lt.budget.is_some() {
                    ""
                } else {
                    "; spec.mode.logTailing.maxRetainedWal would switch the relay to polling and drop the slot past a budget"
                }
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{facts, observed, our_marker, relay, run, secrets_ok};
    use super::super::*;

    #[test]
    fn retained_wal_past_the_alert_threshold_is_degraded_with_the_figure() {
        let o = observed(
            secrets_ok(),
            facts("logical", Some(Some(our_marker())), true),
            1,
        );
        let with = |bytes: i64| SlotStatus {
            name: "outbox_shop_orders".into(),
            publication: Some("outbox_shop_orders".into()),
            existed: true,
            retained_wal_bytes: Some(bytes),
            ..SlotStatus::default()
        };
        let degraded = |d: &Decision| {
            d.conditions
                .iter()
                .find(|c| c.type_ == CONDITION_DEGRADED)
                .cloned()
                .unwrap()
        };
        let r = relay("logTailing", 1);
        let d = run(&r, Some(&with(512 << 20)), Some(&o));
        assert!(!degraded(&d).status, "{:?}", degraded(&d));
        let d = run(&r, Some(&with(3 << 30)), Some(&o));
        let c = degraded(&d);
        assert!(c.status && c.reason == "SlotRetainingWal", "{c:?}");
        assert!(
            c.message.contains("3.0 GiB")
                && c.message.contains("1.0 GiB")
                && c.message.contains("maxRetainedWal"),
            "{}",
            c.message
        );
    }
}
