//! `Ready` from the relay's pods, and `MonitoringReady`.

use super::*;

/// `Ready` from the Deployment's available pods.
pub(super) fn availability(valid: &ValidRelay, observed: &Observed) -> Cond {
    let wanted = valid.effective_replicas();
    let available = observed
        .children
        .deployment
        .as_ref()
        .and_then(|d| d.status.as_ref())
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    if valid.suspended() {
        Cond::no(
            CONDITION_READY,
            "Suspended",
            match valid.mode.log_tailing() {
                Some(lt) => format!(
                    "spec.suspend is true: no relay runs and nothing is published; replication slot {} keeps its position and retains WAL until publishing resumes from it (spec.suspend: false)",
                    lt.slot
                ),
                None => "spec.suspend is true: no relay runs and nothing is published; the rows wait in the table until publishing resumes (spec.suspend: false)".to_owned(),
            },
        )
    } else if wanted == 0 {
        Cond::no(
            CONDITION_READY,
            "ScaledToZero",
            "spec.replicas is 0: no relay runs and nothing is published",
        )
    } else if available > 0 {
        let trouble = observed
            .children
            .pod_trouble
            .as_ref()
            .map(|t| format!("; {}", t.message()))
            .unwrap_or_default();
        Cond::yes(
            CONDITION_READY,
            "RelayAvailable",
            format!("{available} of {wanted} relay pods available{trouble}"),
        )
    } else if let Some(trouble) = &observed.children.pod_trouble {
        Cond::no(
            CONDITION_READY,
            trouble.reason(),
            format!("0 of {wanted} relay pods available; {}", trouble.message()),
        )
    } else {
        Cond::no(
            CONDITION_READY,
            "RelayUnavailable",
            format!(
                "0 of {wanted} relay pods available (Deployment {}-relay)",
                valid.name
            ),
        )
    }
}

/// `MonitoringReady`.
pub(super) fn monitoring_cond(valid: &ValidRelay, observed: &Observed) -> Cond {
    if observed.monitoring {
        let what = if valid.alerting.enabled {
            "ServiceMonitor and PrometheusRule applied"
        } else {
            "ServiceMonitor applied; alerting is disabled in spec.alerting"
        };
        Cond::yes(CONDITION_MONITORING_READY, "Applied", what)
    } else {
        Cond::no(
            CONDITION_MONITORING_READY,
            "PrometheusOperatorNotInstalled",
            format!(
                "the {MONITORING_API_VERSION} ServiceMonitor and PrometheusRule CRDs are not installed: no scrape config or alerts were created (`outbox-operator render` prints them)"
            ),
        )
    }
}
