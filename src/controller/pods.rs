//! Why relay pods are not available, from what the kubelet and the scheduler report on
//! them: the reason `Ready=False` gives instead of a bare `RelayUnavailable`, so that
//! `kubectl get obr` says "killed for memory at its 64Mi limit" or "image not pulled"
//! where a user would otherwise have to go through the pods one by one.
//!
//! Pure: the controller lists the relay's pods only while some are unavailable (a
//! healthy relay costs no read), and [`diagnose`] picks the trouble to report. Messages
//! hold no counters or times, so a crash-looping relay does not rewrite its status at
//! every restart.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

/// The container the operator's relay pods run.
const RELAY_CONTAINER: &str = "relay";

/// What keeps a relay pod from being available, worst first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum PodTrouble {
    /// The runtime killed the relay for memory (its last termination).
    OomKilled { pod: String, limit: Option<String> },
    /// The image cannot be pulled (or is not a valid name).
    ImagePull {
        pod: String,
        image: String,
        message: String,
    },
    /// The kubelet cannot build the container: a Secret or key it needs is missing.
    ConfigError { pod: String, message: String },
    /// The relay exits and the kubelet waits before starting it again.
    CrashLooping { pod: String, exit_code: i32 },
    /// No node takes the pod.
    Unschedulable { pod: String, message: String },
}

impl PodTrouble {
    /// The `Ready` condition's reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::OomKilled { .. } => "RelayOOMKilled",
            Self::ImagePull { .. } => "RelayImagePullFailed",
            Self::ConfigError { .. } => "RelayConfigError",
            Self::CrashLooping { .. } => "RelayCrashLooping",
            Self::Unschedulable { .. } => "RelayUnschedulable",
        }
    }

    /// What happened and what to do, for the condition's message.
    pub fn message(&self) -> String {
        match self {
            Self::OomKilled { pod, limit } => format!(
                "pod {pod}: the relay was killed for memory{}; raise \
                 spec.relay.resources.limits.memory (a single outbox row must fit in it \
                 several times over)",
                limit
                    .as_deref()
                    .map(|l| format!(" at its limit of {l}"))
                    .unwrap_or_default()
            ),
            Self::ImagePull {
                pod,
                image,
                message,
            } => format!("pod {pod}: image {image} cannot be pulled: {message}"),
            Self::ConfigError { pod, message } => {
                format!("pod {pod}: the kubelet cannot create the relay container: {message}")
            }
            Self::CrashLooping { pod, exit_code } => format!(
                "pod {pod}: the relay keeps exiting (last exit code {exit_code}); its log says why"
            ),
            Self::Unschedulable { pod, message } => {
                format!("pod {pod}: no node takes it: {message}")
            }
        }
    }

    fn rank(&self) -> u8 {
        match self {
            Self::OomKilled { .. } => 0,
            Self::ImagePull { .. } => 1,
            Self::ConfigError { .. } => 2,
            Self::CrashLooping { .. } => 3,
            Self::Unschedulable { .. } => 4,
        }
    }
}

/// The worst trouble among `pods` (those being deleted aside), if any; ties go to the
/// pod first by name, so the choice is stable.
pub(super) fn diagnose(pods: &[Pod]) -> Option<PodTrouble> {
    let mut pods: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    pods.into_iter()
        .filter_map(trouble)
        .min_by_key(PodTrouble::rank)
}

fn trouble(pod: &Pod) -> Option<PodTrouble> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let status = pod.status.as_ref()?;
    let relay = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == RELAY_CONTAINER);
    if let Some(relay) = relay.filter(|c| !c.ready)
        && let Some(found) = container_trouble(pod, &name, relay)
    {
        return Some(found);
    }
    let unschedulable = status.conditions.iter().flatten().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    })?;
    Some(PodTrouble::Unschedulable {
        pod: name,
        message: unschedulable.message.clone().unwrap_or_default(),
    })
}

fn container_trouble(pod: &Pod, name: &str, relay: &ContainerStatus) -> Option<PodTrouble> {
    let last = relay
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref());
    let current = relay.state.as_ref().and_then(|s| s.terminated.as_ref());
    let oom = |t: Option<&k8s_openapi::api::core::v1::ContainerStateTerminated>| {
        t.is_some_and(|t| t.reason.as_deref() == Some("OOMKilled"))
    };
    if oom(current) || oom(last) {
        let limit = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.iter().find(|c| c.name == RELAY_CONTAINER))
            .and_then(|c| c.resources.as_ref())
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("memory"))
            .map(|q| q.0.clone());
        return Some(PodTrouble::OomKilled {
            pod: name.to_owned(),
            limit,
        });
    }
    let waiting = relay.state.as_ref().and_then(|s| s.waiting.as_ref())?;
    let message = waiting.message.clone().unwrap_or_default();
    match waiting.reason.as_deref()? {
        "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull" => {
            Some(PodTrouble::ImagePull {
                pod: name.to_owned(),
                image: relay.image.clone(),
                message,
            })
        }
        "CreateContainerConfigError" | "CreateContainerError" => Some(PodTrouble::ConfigError {
            pod: name.to_owned(),
            message,
        }),
        "CrashLoopBackOff" => Some(PodTrouble::CrashLooping {
            pod: name.to_owned(),
            exit_code: last.map_or(0, |t| t.exit_code),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "relay", "image": "relay:1",
                "resources": {"limits": {"memory": "40Mi"}}}]},
            "status": status,
        }))
        .unwrap()
    }

    fn waiting(reason: &str, message: &str, last: serde_json::Value) -> serde_json::Value {
        json!({"containerStatuses": [{"name": "relay", "image": "relay:1", "imageID": "",
            "ready": false, "restartCount": 3,
            "state": {"waiting": {"reason": reason, "message": message}},
            "lastState": last}]})
    }

    #[test]
    fn a_relay_killed_for_memory_says_so_with_its_limit() {
        let killed = pod(
            "r-1",
            waiting(
                "CrashLoopBackOff",
                "back-off 40s restarting failed container",
                json!({"terminated": {"reason": "OOMKilled", "exitCode": 137}}),
            ),
        );
        let found = diagnose(&[killed]).unwrap();
        assert_eq!(found.reason(), "RelayOOMKilled");
        assert!(
            found.message().contains("at its limit of 40Mi"),
            "{}",
            found.message()
        );
        assert!(
            found
                .message()
                .contains("spec.relay.resources.limits.memory")
        );
    }

    #[test]
    fn each_kind_of_trouble_has_its_reason() {
        let cases = [
            (
                waiting("ImagePullBackOff", "Back-off pulling image", json!({})),
                "RelayImagePullFailed",
            ),
            (
                waiting(
                    "CreateContainerConfigError",
                    "secret \"db\" not found",
                    json!({}),
                ),
                "RelayConfigError",
            ),
            (
                waiting(
                    "CrashLoopBackOff",
                    "back-off",
                    json!({"terminated": {"reason": "Error", "exitCode": 2}}),
                ),
                "RelayCrashLooping",
            ),
            (
                json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
                    "status": "False", "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 node(s) had untolerated taint"}]}),
                "RelayUnschedulable",
            ),
        ];
        for (status, reason) in cases {
            let found = diagnose(&[pod("r-1", status)]).unwrap();
            assert_eq!(found.reason(), reason, "{}", found.message());
        }
        let crash = diagnose(&[pod(
            "r-1",
            waiting(
                "CrashLoopBackOff",
                "",
                json!({"terminated": {"reason": "Error", "exitCode": 2}}),
            ),
        )])
        .unwrap();
        assert!(crash.message().contains("last exit code 2"));
    }

    #[test]
    fn starting_ready_and_deleted_pods_are_no_trouble_and_the_worst_is_reported() {
        let starting = pod("r-1", waiting("ContainerCreating", "", json!({})));
        let ready = pod(
            "r-2",
            json!({"containerStatuses": [{"name": "relay", "image": "relay:1", "imageID": "",
                "ready": true, "restartCount": 1, "state": {"running": {}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]}),
        );
        let mut deleted = pod("r-3", waiting("ImagePullBackOff", "", json!({})));
        deleted.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(diagnose(&[starting.clone(), ready, deleted]), None);

        let crash = pod(
            "r-4",
            waiting(
                "CrashLoopBackOff",
                "",
                json!({"terminated": {"reason": "Error", "exitCode": 1}}),
            ),
        );
        let oom = pod(
            "r-5",
            waiting(
                "CrashLoopBackOff",
                "",
                json!({"terminated": {"reason": "OOMKilled", "exitCode": 137}}),
            ),
        );
        assert_eq!(
            diagnose(&[crash, starting, oom]).map(|t| t.reason()),
            Some("RelayOOMKilled")
        );
    }
}
