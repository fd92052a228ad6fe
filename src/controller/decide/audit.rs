//! A relay's last in-cluster audit (`kubectl outbox audit`): the verdict its Job's pod
//! left, for `status.lastAudit`. Pure: tested below.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;

use crate::api::AuditStatus;
use crate::report::AuditCounts;
use crate::resources::{Ended, job_failed, pod_ended};

/// The verdict of the audit `job` (its pod `pod`) to write, when it ended and is newer
/// than the one `current` holds; `None` otherwise.
pub fn audit_verdict(
    job: &Job,
    pod: Option<&Pod>,
    current: Option<&AuditStatus>,
) -> Option<AuditStatus> {
    let name = job.metadata.name.clone()?;
    if current.is_some_and(|c| c.job == name) {
        return None;
    }
    let ended = pod.and_then(pod_ended);
    let job_failed = job_failed(job);
    let finished_at = ended
        .as_ref()
        .and_then(|e| e.finished_at.clone())
        .or_else(|| {
            job_failed
                .and_then(|c| c.last_transition_time.as_ref())
                .map(|t| t.0.to_string())
        });
    // An older audit that ended after a newer one was recorded (a restart reads them
    // all, in no order) does not replace it.
    if let (Some(current), Some(at)) =
        (current.and_then(|c| c.finished_at.as_deref()), &finished_at)
        && current > at.as_str()
    {
        return None;
    }
    let ended = match (ended, job_failed) {
        (Some(ended), _) => ended,
        (None, Some(failed)) => Ended {
            exit_code: 2,
            report: format!(
                "{}: {}",
                failed.reason.as_deref().unwrap_or("Failed"),
                failed.message.as_deref().unwrap_or_default()
            ),
            finished_at: None,
        },
        (None, None) => return None,
    };
    let counts = AuditCounts::read(&ended.report).unwrap_or_default();
    let verdict = match ended.exit_code {
        0 => "Passed",
        1 => "Failed",
        _ => "Error",
    };
    Some(AuditStatus {
        job: name,
        finished_at,
        verdict: verdict.to_owned(),
        rows: counts.rows,
        deliveries: counts.deliveries,
        missing: counts.missing,
        out_of_order: counts.out_of_order,
        redeliveries: counts.redeliveries,
        message: ended.last_line(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str) -> Job {
        serde_yaml::from_str(&format!("metadata: {{name: {name}}}")).unwrap()
    }

    fn pod(exit: i32, at: &str, message: &str) -> Pod {
        serde_yaml::from_str(&format!(
            "metadata: {{name: p}}
status:
  phase: Succeeded
  containerStatuses:
  - name: tool
    image: i
    imageID: ''
    ready: false
    restartCount: 0
    state: {{terminated: {{exitCode: {exit}, finishedAt: '{at}', message: {}}}}}",
            serde_json::to_string(message).unwrap()
        ))
        .unwrap()
    }

    fn counts(missing: i64) -> String {
        AuditCounts {
            rows: 33,
            deliveries: 42,
            missing,
            out_of_order: 0,
            redeliveries: 10,
        }
        .line()
    }

    #[test]
    fn the_verdict_and_counts_are_the_audits_own() {
        let report = format!("FAIL  missing  1 of 33\n{}\n", counts(1));
        let status = audit_verdict(
            &job("orders-audit-x"),
            Some(&pod(1, "2026-12-07T12:00:00Z", &report)),
            None,
        )
        .unwrap();
        assert_eq!(
            status,
            AuditStatus {
                job: "orders-audit-x".to_owned(),
                finished_at: Some("2026-12-07T12:00:00Z".to_owned()),
                verdict: "Failed".to_owned(),
                rows: 33,
                deliveries: 42,
                missing: 1,
                out_of_order: 0,
                redeliveries: 10,
                message: counts(1),
            }
        );
        let passed = audit_verdict(
            &job("a"),
            Some(&pod(0, "2026-12-07T12:00:00Z", &counts(0))),
            None,
        )
        .unwrap();
        assert_eq!(passed.verdict, "Passed");
        let error = audit_verdict(
            &job("b"),
            Some(&pod(2, "2026-12-07T12:00:00Z", "cannot connect")),
            None,
        )
        .unwrap();
        assert_eq!(
            (error.verdict.as_str(), error.message.as_str(), error.rows),
            ("Error", "cannot connect", 0)
        );
    }

    #[test]
    fn a_verdict_is_written_once_and_never_replaced_by_an_older_one() {
        let newer = audit_verdict(
            &job("new"),
            Some(&pod(0, "2026-12-07T12:00:00Z", &counts(0))),
            None,
        )
        .unwrap();
        assert_eq!(
            audit_verdict(
                &job("new"),
                Some(&pod(0, "2026-12-07T12:00:00Z", &counts(0))),
                Some(&newer)
            ),
            None
        );
        let older = pod(1, "2026-12-07T11:00:00Z", &counts(1));
        assert_eq!(audit_verdict(&job("old"), Some(&older), Some(&newer)), None);
        let later = pod(1, "2026-12-07T13:00:00Z", &counts(1));
        assert_eq!(
            audit_verdict(&job("later"), Some(&later), Some(&newer))
                .unwrap()
                .verdict,
            "Failed"
        );
    }

    #[test]
    fn a_running_audit_has_no_verdict_and_a_failed_job_says_why() {
        let running: Pod = serde_yaml::from_str(
            "metadata: {name: p}
status: {phase: Running, containerStatuses: [{name: tool, image: i, imageID: '', ready: true, restartCount: 0, state: {running: {}}}]}",
        )
        .unwrap();
        assert_eq!(audit_verdict(&job("a"), Some(&running), None), None);
        let mut failed = job("a");
        failed.status = Some(
            serde_yaml::from_str(
                "conditions: [{type: Failed, status: 'True', reason: DeadlineExceeded, message: too long, lastTransitionTime: '2026-12-07T12:00:00Z'}]",
            )
            .unwrap(),
        );
        let status = audit_verdict(&failed, None, None).unwrap();
        assert_eq!(
            (status.verdict.as_str(), status.message.as_str()),
            ("Error", "DeadlineExceeded: too long")
        );
    }
}
