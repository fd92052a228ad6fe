//! Why relay pods are not available, from what the kubelet and the scheduler report on
//! them: the reason `Ready=False` gives instead of a bare `RelayUnavailable`, so that
//! `kubectl get obr` says "killed for memory at its 64Mi limit" or "image not pulled"
//! where a user would otherwise have to go through the pods one by one.
//!
//! Pure: the controller lists the relay's pods only while some are unavailable (a
//! healthy relay costs no read), and [`diagnose`] picks the trouble to report. Messages
//! hold no counters or times, so a crash-looping relay does not rewrite its status at
//! every restart; a crash loop's gives the first line of the relay's termination
//! message, which the relay keeps free of them (task ids, backend PIDs and librdkafka's
//! broker names go on later lines, or only to its log).

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use crate::http::BROKER_DOWN_PREFIX;
use k8s_openapi::jiff::Timestamp;

/// The container the operator's relay pods run.
const RELAY_CONTAINER: &str = "relay";

/// What keeps a relay pod from being available, worst first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum PodTrouble {
    /// The cluster refuses to create the pods (Pod Security admission, an OpenShift
    /// SCC, a quota, an admission policy): `message` is its answer.
    Refused { message: String },
    /// The runtime killed the relay for memory (its last termination).
    OomKilled { pod: String, limit: Option<String> },
    /// The image cannot be pulled (or is not a valid name). `pull_secrets` are the
    /// pod's; `missing` those the relay's namespace does not have (filled in by the
    /// caller, which can look).
    ImagePull {
        pod: String,
        image: String,
        pull_secrets: Vec<String>,
        missing: Vec<String>,
    },
    /// The kubelet cannot create the container: a Secret or key it needs is missing, or
    /// the runtime refused it.
    ConfigError { pod: String, message: String },
    /// The relay exits and the kubelet waits before starting it again; `why` is the
    /// first line of what the relay left as its termination message, if anything.
    CrashLooping {
        pod: String,
        exit_code: i32,
        why: Option<String>,
    },
    /// No node takes the pod.
    Unschedulable { pod: String, message: String },
    /// The relay runs but is not ready; `why` is what its `/readyz` answers (the broker
    /// takes no message, the publication gate holds, …).
    NotReady { pod: String, why: String },
}

impl PodTrouble {
    /// The `Ready` condition's reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Refused { .. } => "RelayPodsRefused",
            Self::OomKilled { .. } => "RelayOOMKilled",
            Self::ImagePull { .. } => "RelayImagePullFailed",
            Self::ConfigError { .. } => "RelayConfigError",
            Self::CrashLooping { .. } => "RelayCrashLooping",
            Self::Unschedulable { .. } => "RelayUnschedulable",
            Self::NotReady { why, .. } if why.starts_with(BROKER_DOWN_PREFIX) => {
                "BrokerUnavailable"
            }
            Self::NotReady { .. } => "RelayNotReady",
        }
    }

    /// What happened and what to do, for the condition's message.
    pub fn message(&self) -> String {
        match self {
            Self::Refused { message } => format!(
                "the cluster refuses to create the relay's pods: {message}; \
                 spec.relay sets their user and groups (runAsUser, runAsGroup, fsGroup: \
                 unset, the platform's choice), the namespace's owner the rest"
            ),
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
                missing,
                ..
            } if !missing.is_empty() => format!(
                "pod {pod}: image {image} cannot be pulled, and its pull Secret(s) {} do not exist in the relay's namespace: create them there (the chart's relayPods.imagePullSecrets and spec.relay.imagePullSecrets name Secrets of each relay's own namespace)",
                missing.join(", ")
            ),
            Self::ImagePull { pod, image, .. } => format!(
                "pod {pod}: image {image} cannot be pulled (kubectl describe pod {pod} says why)"
            ),
            Self::ConfigError { pod, message } => {
                format!("pod {pod}: the kubelet cannot create the relay container: {message}")
            }
            Self::CrashLooping {
                pod,
                exit_code,
                why: Some(why),
            } => format!("pod {pod}: the relay keeps exiting (last exit code {exit_code}): {why}"),
            Self::CrashLooping {
                pod,
                exit_code,
                why: None,
            } => format!(
                "pod {pod}: the relay keeps exiting (last exit code {exit_code}); its log says why"
            ),
            Self::Unschedulable { pod, message } => {
                format!("pod {pod}: no node takes it: {message}")
            }
            Self::NotReady { pod, why } => format!("pod {pod}: {why}"),
        }
    }

    fn rank(&self) -> u8 {
        match self {
            Self::Refused { .. } => 0,
            Self::OomKilled { .. } => 0,
            Self::ImagePull { .. } => 1,
            Self::ConfigError { .. } => 2,
            Self::CrashLooping { .. } => 3,
            Self::Unschedulable { .. } => 4,
            Self::NotReady { .. } => 5,
        }
    }
}

/// The refusal the Deployment reports (its `ReplicaFailure` condition, copied from the
/// ReplicaSet that could not create a pod). The pod's generated name is left out of
/// the message, so a retry does not rewrite the status.
pub(super) fn refused(deployment: &Deployment) -> Option<PodTrouble> {
    let failure = deployment
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "ReplicaFailure" && c.status == "True")?;
    let message = failure.message.as_deref().unwrap_or("no reason given");
    let message = message
        .split_once(" is forbidden: ")
        .map_or(message, |(_, why)| why);
    Some(PodTrouble::Refused {
        message: message.trim().to_owned(),
    })
}

/// A container that has run this long since its last termination is no longer taken
/// for crash-looping (the kubelet's back-off tops out at five minutes).
const RECENT_SECONDS: i64 = 600;

/// The worst trouble among `pods` (those being deleted aside) at `now`, if any; ties go
/// to the pod first by name, so the choice is stable.
pub(super) fn diagnose(pods: &[Pod], now: Timestamp) -> Option<PodTrouble> {
    let mut pods: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    pods.into_iter()
        .filter_map(|p| trouble(p, now))
        .min_by_key(PodTrouble::rank)
}

/// The pods whose relay runs but is not ready, by name, with their IPs (those being
/// deleted aside): the ones to ask why.
pub(super) fn running_unready(pods: &[Pod]) -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let status = p.status.as_ref()?;
            let relay = status
                .container_statuses
                .iter()
                .flatten()
                .find(|c| c.name == RELAY_CONTAINER)?;
            let running = relay.state.as_ref().and_then(|s| s.running.as_ref());
            (running.is_some() && !relay.ready).then_some(())?;
            Some((p.metadata.name.clone()?, status.pod_ip.clone()?))
        })
        .collect();
    found.sort();
    found
}

fn trouble(pod: &Pod, now: Timestamp) -> Option<PodTrouble> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let status = pod.status.as_ref()?;
    let relay = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == RELAY_CONTAINER);
    if let Some(relay) = relay.filter(|c| !c.ready)
        && let Some(found) = container_trouble(pod, &name, relay, now)
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
        message: scheduling_causes(unschedulable.message.as_deref().unwrap_or_default()),
    })
}

/// The relay container's trouble. A crash loop alternates between waiting
/// (`CrashLoopBackOff`), running briefly and terminated; all three give the last
/// termination's reason, so the report holds still through the loop. A container
/// running for a while since it last ended (not ready for another reason, which the
/// other conditions tell) has none.
fn container_trouble(
    pod: &Pod,
    name: &str,
    relay: &ContainerStatus,
    now: Timestamp,
) -> Option<PodTrouble> {
    let state = relay.state.as_ref();
    let waiting = state.and_then(|s| s.waiting.as_ref());
    let ended = state
        .and_then(|s| s.terminated.as_ref())
        .or_else(|| relay.last_state.as_ref()?.terminated.as_ref());
    let running_since = state
        .and_then(|s| s.running.as_ref())
        .and_then(|r| r.started_at.as_ref())
        .map(|t| t.0);
    let looping = match running_since {
        Some(since) => {
            relay.restart_count > 0 && now.duration_since(since).as_secs() < RECENT_SECONDS
        }
        None => true,
    };
    if let Some(waiting) = waiting {
        match waiting.reason.as_deref() {
            Some(
                "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull",
            ) => {
                return Some(PodTrouble::ImagePull {
                    pod: name.to_owned(),
                    image: relay.image.clone(),
                    pull_secrets: pod
                        .spec
                        .iter()
                        .flat_map(|s| s.image_pull_secrets.iter().flatten())
                        .map(|r| r.name.clone())
                        .filter(|n| !n.is_empty())
                        .collect(),
                    missing: Vec::new(),
                });
            }
            Some("CreateContainerConfigError" | "CreateContainerError") => {
                return Some(PodTrouble::ConfigError {
                    pod: name.to_owned(),
                    message: waiting.message.clone().unwrap_or_default(),
                });
            }
            _ => {}
        }
    }
    let ended = ended.filter(|_| looping)?;
    if ended.reason.as_deref() == Some("OOMKilled") {
        Some(PodTrouble::OomKilled {
            pod: name.to_owned(),
            limit: memory_limit(pod),
        })
    } else if relay.restart_count > 0 || waiting.is_none() {
        Some(PodTrouble::CrashLooping {
            pod: name.to_owned(),
            exit_code: ended.exit_code,
            why: ended.message.as_deref().and_then(first_line),
        })
    } else {
        None
    }
}

/// The most of a termination message a condition repeats.
const WHY_MAX: usize = 512;

/// The first line of a termination message, cut at [`WHY_MAX`] bytes on a character;
/// `None` when it has no text.
fn first_line(message: &str) -> Option<String> {
    let line = message.lines().map(str::trim).find(|l| !l.is_empty())?;
    if line.len() <= WHY_MAX {
        return Some(line.to_owned());
    }
    Some(format!("{}…", &line[..line.floor_char_boundary(WHY_MAX)]))
}

fn memory_limit(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == RELAY_CONTAINER))
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
        .map(|q| q.0.clone())
}

/// The kinds of cause in the scheduler's message, without its counts (which change as
/// nodes come and go, and would rewrite the status each time): "0/3 nodes are
/// available: 1 node(s) had untolerated taint {a: b}, 2 Insufficient memory.
/// preemption: …" gives "had untolerated taint {a: b}; Insufficient memory".
fn scheduling_causes(message: &str) -> String {
    let causes = message
        .split_once("available: ")
        .map_or(message, |(_, rest)| rest);
    let causes = causes.split(". preemption:").next().unwrap_or(causes);
    let causes: Vec<&str> = causes
        .trim_end_matches('.')
        .split(", ")
        .map(|c| {
            let c = c.trim();
            let c = c
                .trim_start_matches(|ch: char| ch.is_ascii_digit())
                .trim_start();
            c.strip_prefix("node(s) ").unwrap_or(c)
        })
        .filter(|c| !c.is_empty())
        .collect();
    causes.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: &str = "2026-12-05T10:00:00Z";

    fn now() -> Timestamp {
        NOW.parse().unwrap()
    }

    fn pod(name: &str, status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "relay", "image": "relay:1",
                "resources": {"limits": {"memory": "40Mi"}}}]},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn an_image_not_pulled_names_the_pull_secrets_its_namespace_lacks() {
        let mut p = pod(
            "r-1",
            waiting("ImagePullBackOff", "Back-off pulling image", json!({})),
        );
        p.spec.as_mut().unwrap().image_pull_secrets =
            Some(vec![k8s_openapi::api::core::v1::LocalObjectReference {
                name: "regcred".into(),
            }]);
        let Some(PodTrouble::ImagePull {
            pod,
            image,
            pull_secrets,
            ..
        }) = diagnose(&[p], now())
        else {
            panic!("not an image pull trouble");
        };
        assert_eq!(pull_secrets, ["regcred"]);
        let missing = PodTrouble::ImagePull {
            pod: pod.clone(),
            image: image.clone(),
            pull_secrets: pull_secrets.clone(),
            missing: vec!["regcred".into()],
        };
        assert!(
            missing
                .message()
                .contains("pull Secret(s) regcred do not exist in the relay's namespace"),
            "{}",
            missing.message()
        );
        let present = PodTrouble::ImagePull {
            pod,
            image,
            pull_secrets,
            missing: Vec::new(),
        };
        assert!(present.message().contains("kubectl describe pod r-1"));
        assert_eq!(present.reason(), "RelayImagePullFailed");
    }

    fn relay(state: serde_json::Value, last: serde_json::Value, ready: bool) -> serde_json::Value {
        json!({"containerStatuses": [{"name": "relay", "image": "relay:1", "imageID": "",
            "ready": ready, "restartCount": 3, "state": state, "lastState": last}]})
    }

    fn waiting(reason: &str, message: &str, last: serde_json::Value) -> serde_json::Value {
        relay(
            json!({"waiting": {"reason": reason, "message": message}}),
            last,
            false,
        )
    }

    fn oom() -> serde_json::Value {
        json!({"terminated": {"reason": "OOMKilled", "exitCode": 137}})
    }

    fn running_since(at: &str) -> serde_json::Value {
        json!({"running": {"startedAt": at}})
    }

    #[test]
    fn pods_the_cluster_refuses_are_reported_without_their_generated_name() {
        let deployment = |conditions: serde_json::Value| -> Deployment {
            serde_json::from_value(json!({"metadata": {"name": "r"},
                "status": {"conditions": conditions}}))
            .unwrap()
        };
        let refusal = |pod: &str| {
            deployment(json!([{"type": "ReplicaFailure", "status": "True",
                "reason": "FailedCreate",
                "message": format!("pods \"{pod}\" is forbidden: violates PodSecurity \
                    \"restricted:latest\": runAsNonRoot != true")}]))
        };
        let first = refused(&refusal("r-7d9f-abcde")).unwrap();
        assert_eq!(first.reason(), "RelayPodsRefused");
        assert!(
            first.message().contains("violates PodSecurity") && !first.message().contains("abcde"),
            "{}",
            first.message()
        );
        assert_eq!(Some(first), refused(&refusal("r-7d9f-xyz12")));
        let progressing = deployment(json!([{"type": "Progressing", "status": "True"},
            {"type": "ReplicaFailure", "status": "False"}]));
        assert_eq!(refused(&progressing), None);
    }

    #[test]
    fn a_relay_killed_for_memory_says_so_with_its_limit_all_through_its_crash_loop() {
        let states = [
            waiting(
                "CrashLoopBackOff",
                "back-off 40s restarting failed container",
                oom(),
            ),
            // Between back-offs: running again (not ready yet), then killed again.
            relay(running_since("2026-12-05T09:59:55Z"), oom(), false),
            relay(oom(), json!({}), false),
        ];
        for status in states {
            let found = diagnose(&[pod("r-1", status)], now()).unwrap();
            assert_eq!(found.reason(), "RelayOOMKilled");
            let message = found.message();
            assert!(message.contains("at its limit of 40Mi"), "{message}");
            assert!(message.contains("spec.relay.resources.limits.memory"));
        }
        // Running for long since (not ready for another reason): no longer blamed.
        let settled = pod(
            "r-1",
            relay(running_since("2026-12-05T09:00:00Z"), oom(), false),
        );
        assert_eq!(diagnose(&[settled], now()), None);
    }

    #[test]
    fn each_kind_of_trouble_has_its_reason_and_a_message_that_holds_still() {
        let cases = [
            (
                waiting("ImagePullBackOff", "Back-off pulling image", json!({})),
                "RelayImagePullFailed",
            ),
            (
                waiting(
                    "ErrImagePull",
                    "rpc error: dial tcp: i/o timeout",
                    json!({}),
                ),
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
                relay(
                    running_since("2026-12-05T09:59:58Z"),
                    json!({"terminated": {"reason": "Error", "exitCode": 2}}),
                    false,
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
        let mut messages = Vec::new();
        for (status, reason) in cases {
            let found = diagnose(&[pod("r-1", status)], now()).unwrap();
            assert_eq!(found.reason(), reason, "{}", found.message());
            messages.push(found.message());
        }
        // The two pull failures read alike (the kubelet's wording differs between them).
        assert_eq!(messages[0], messages[1]);
        assert!(messages[3].contains("last exit code 2"));
        assert_eq!(messages[3], messages[4]);
    }

    #[test]
    fn a_crash_loop_repeats_the_first_line_of_what_the_relay_left_as_its_termination_message() {
        let why = "broker: the broker client failed permanently (3 Kafka producers in a row \
                   stopped on a fatal error, the last: Cluster authorization failed); restarting";
        let ended = |message: &str| json!({"terminated": {"reason": "Error", "exitCode": 1, "message": message}});
        for status in [
            waiting(
                "CrashLoopBackOff",
                "back-off",
                ended(&format!("\n{why}\nmore\n")),
            ),
            relay(running_since("2026-12-05T09:59:58Z"), ended(why), false),
        ] {
            let found = diagnose(&[pod("r-1", status)], now()).unwrap();
            assert_eq!(found.reason(), "RelayCrashLooping");
            assert_eq!(
                found.message(),
                format!("pod r-1: the relay keeps exiting (last exit code 1): {why}")
            );
        }
        // No text (a relay killed by a signal, or an older one): the log says why.
        let found = diagnose(
            &[pod(
                "r-1",
                waiting("CrashLoopBackOff", "back-off", ended(" \n")),
            )],
            now(),
        )
        .unwrap();
        assert!(
            found.message().ends_with("its log says why"),
            "{}",
            found.message()
        );
        // A long one is cut, on a character.
        let found = diagnose(
            &[pod(
                "r-1",
                waiting("CrashLoopBackOff", "back-off", ended(&"€".repeat(1000))),
            )],
            now(),
        )
        .unwrap();
        let message = found.message();
        assert!(message.ends_with("€…") && message.len() < 600, "{message}");
    }

    #[test]
    fn the_schedulers_counts_are_left_out() {
        let message = "0/3 nodes are available: 1 node(s) had untolerated taint \
                       {outbox.dev/rig-node: true}, 2 Insufficient memory. preemption: 0/3 \
                       nodes are available: 3 Preemption is not helpful for scheduling.";
        assert_eq!(
            scheduling_causes(message),
            "had untolerated taint {outbox.dev/rig-node: true}; Insufficient memory"
        );
        let fewer = message
            .replace("0/3", "0/4")
            .replace("2 Insufficient", "3 Insufficient");
        assert_eq!(scheduling_causes(&fewer), scheduling_causes(message));
        assert_eq!(
            scheduling_causes(
                "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
            ),
            "didn't match Pod's node affinity/selector"
        );
    }

    #[test]
    fn starting_ready_and_deleted_pods_are_no_trouble_and_the_worst_is_reported() {
        let starting = pod("r-1", waiting("ContainerCreating", "", json!({})));
        let ready = pod(
            "r-2",
            relay(running_since("2026-12-05T09:59:00Z"), oom(), true),
        );
        let mut deleted = pod("r-3", waiting("ImagePullBackOff", "", json!({})));
        deleted.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH),
        );
        assert_eq!(diagnose(&[starting.clone(), ready, deleted], now()), None);

        let crash = pod(
            "r-4",
            waiting(
                "CrashLoopBackOff",
                "",
                json!({"terminated": {"reason": "Error", "exitCode": 1}}),
            ),
        );
        let killed = pod("r-5", waiting("CrashLoopBackOff", "", oom()));
        assert_eq!(
            diagnose(&[crash, starting, killed], now()).map(|t| t.reason()),
            Some("RelayOOMKilled")
        );
    }

    #[test]
    fn running_unready_pods_are_asked_and_the_broker_is_named_as_the_reason() {
        let running = |ready: bool, ip: Option<&str>| {
            let mut status = relay(
                json!({"running": {"startedAt": "2026-12-05T09:00:00Z"}}),
                json!({}),
                ready,
            );
            if let Some(ip) = ip {
                status["podIP"] = json!(ip);
            }
            status
        };
        let pods = [
            pod("r-2", running(false, Some("10.0.0.2"))),
            pod("r-1", running(false, Some("10.0.0.1"))),
            pod("r-3", running(true, Some("10.0.0.3"))),
            pod("r-4", running(false, None)),
        ];
        assert_eq!(
            running_unready(&pods),
            [
                ("r-1".to_owned(), "10.0.0.1".to_owned()),
                ("r-2".to_owned(), "10.0.0.2".to_owned())
            ]
        );
        let broker = PodTrouble::NotReady {
            pod: "r-1".into(),
            why: format!("{BROKER_DOWN_PREFIX}RabbitMQ: NOT_FOUND - no exchange 'x'"),
        };
        assert_eq!(broker.reason(), "BrokerUnavailable");
        assert!(broker.message().contains("NOT_FOUND"));
        let held = PodTrouble::NotReady {
            pod: "r-1".into(),
            why: "waiting for the standby slots".into(),
        };
        assert_eq!(held.reason(), "RelayNotReady");
        assert!(
            held.rank()
                > PodTrouble::Unschedulable {
                    pod: String::new(),
                    message: String::new()
                }
                .rank()
        );
    }
}
