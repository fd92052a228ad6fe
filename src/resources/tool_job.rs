//! A relay's tool run in the cluster: a Job that runs one of the binary's tools
//! (`check`, `audit`, `replay`, `dead-letters`) as the relay itself would connect — the
//! relay pods' image, identity, service account, Secrets (as the same variables and
//! files), node placement and pull Secrets — so it reaches what the relay reaches
//! (in-cluster Service names included, as a Strimzi `kafkaRef` gives) without a
//! port-forward, and no credential leaves the cluster.
//!
//! The Job is built from the relay's Deployment (what the operator applied, or would):
//! whatever shapes the relay's pods shapes the tool's. The relay's manifest reaches the
//! tool as a file, from an annotation of the pod through the downward API, so nothing
//! else is created for it. The tool's pods carry none of the relay's selector labels:
//! the relay's Service, disruption budget and `/scale` selector never count them.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ContainerState, DownwardAPIProjection, DownwardAPIVolumeFile, ObjectFieldSelector, Pod,
    PodTemplateSpec, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde_json::json;

use super::{MANAGED_BY, RelayRef, namespace, owner_reference};
use crate::api::OutboxRelay;

/// `app.kubernetes.io/name` of a tool run's Job and pod.
pub const TOOL_APP_NAME: &str = "outbox-relay-tool";
/// The label naming the tool a Job runs (`check`, `audit`, `replay`, `dead-letters`).
pub const TOOL_LABEL: &str = "outbox.dev/tool";
/// The pod annotation holding the relay's manifest, projected as [`TOOL_MANIFEST_PATH`].
pub const TOOL_MANIFEST_ANNOTATION: &str = "outbox.dev/relay-manifest";
/// Where the tool reads the relay's manifest (`-f`).
pub const TOOL_MANIFEST_PATH: &str = "/etc/outbox-relay/relay-manifest.yaml";
/// How long a finished tool Job (and its pod, with the report) stays to be read.
pub const TOOL_JOB_KEPT_SECONDS: i32 = 3600;
/// The tool's container.
pub const TOOL_CONTAINER: &str = "tool";

/// One run of a tool against a relay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolRun {
    /// The subcommand (`check`, `audit`, `replay`, `dead-letters`).
    pub tool: String,
    /// Its arguments after `-f <manifest>`.
    pub args: Vec<String>,
    /// How long the run may take before Kubernetes stops it.
    pub deadline: Duration,
}

/// Why no tool Job can be built.
#[derive(Debug, thiserror::Error)]
pub enum ToolJobError {
    /// The relay's Deployment has no container to take the relay's settings from.
    #[error("the relay's Deployment {0} has no pod template with a container")]
    NoTemplate(String),
    /// The manifest could not be written out.
    #[error("cannot write the relay's manifest: {0}")]
    Yaml(#[from] serde_yaml::Error),
}

/// The manifest a tool reads: the relay's name, namespace and spec, nothing of its
/// status or metadata.
pub fn tool_manifest(relay: &OutboxRelay) -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&json!({
        "apiVersion": OutboxRelay::api_version(&()),
        "kind": OutboxRelay::kind(&()),
        "metadata": {"name": relay.relay_name(), "namespace": relay.relay_namespace()},
        "spec": relay.spec,
    }))
}

/// The Job running `run` against `relay`, shaped by the relay's `deployment`.
pub fn tool_job(
    relay: &OutboxRelay,
    deployment: &Deployment,
    run: &ToolRun,
) -> Result<Job, ToolJobError> {
    let no_template =
        || ToolJobError::NoTemplate(deployment.metadata.name.clone().unwrap_or_default());
    let template = deployment
        .spec
        .as_ref()
        .map(|s| s.template.clone())
        .ok_or_else(no_template)?;
    let mut pod = template.spec.ok_or_else(no_template)?;
    let template_meta = template.metadata.unwrap_or_default();
    let mut container = pod.containers.first().cloned().ok_or_else(no_template)?;

    let mut args = vec![
        run.tool.clone(),
        "-f".to_owned(),
        TOOL_MANIFEST_PATH.to_owned(),
    ];
    args.extend(run.args.iter().cloned());
    container.name = TOOL_CONTAINER.to_owned();
    container.command = None;
    container.args = Some(args);
    container.ports = None;
    container.liveness_probe = None;
    container.readiness_probe = None;
    container.startup_probe = None;
    // The report is the termination message; an error before it, the log's tail.
    container.termination_message_policy = Some("FallbackToLogsOnError".to_owned());
    pod.containers = vec![container];
    pod.init_containers = None;
    pod.restart_policy = Some("Never".to_owned());

    // The relay's config file is not the tool's: its manifest takes its place in the
    // projected volume, beside the Secret files, which keep their paths.
    for volume in pod.volumes.iter_mut().flatten() {
        let Some(projected) = volume.projected.as_mut() else {
            continue;
        };
        let sources = projected.sources.get_or_insert_with(Vec::new);
        sources.retain(|s| s.config_map.is_none());
        sources.push(VolumeProjection {
            downward_api: Some(DownwardAPIProjection {
                items: Some(vec![DownwardAPIVolumeFile {
                    path: TOOL_MANIFEST_PATH
                        .rsplit_once('/')
                        .map_or(TOOL_MANIFEST_PATH, |(_, file)| file)
                        .to_owned(),
                    field_ref: Some(ObjectFieldSelector {
                        api_version: Some("v1".to_owned()),
                        field_path: format!("metadata.annotations['{TOOL_MANIFEST_ANNOTATION}']"),
                    }),
                    ..DownwardAPIVolumeFile::default()
                }]),
            }),
            ..VolumeProjection::default()
        });
    }

    let labels = tool_labels(relay, &run.tool);
    // The user's pod labels stay (a NetworkPolicy may let the relay's pods reach the
    // database by them); the relay's selector labels go.
    let mut pod_labels: BTreeMap<String, String> = template_meta
        .labels
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("app.kubernetes.io/"))
        .collect();
    pod_labels.extend(labels.clone());
    let mut annotations: BTreeMap<String, String> = template_meta
        .annotations
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("outbox.dev/"))
        .collect();
    annotations.insert(TOOL_MANIFEST_ANNOTATION.to_owned(), tool_manifest(relay)?);

    let mut owner = owner_reference(relay);
    // Deleted with the relay; it does not control the Job, and creating it asks no
    // permission on the relay's finalizers.
    owner.controller = Some(false);
    owner.block_owner_deletion = None;
    Ok(Job {
        metadata: ObjectMeta {
            generate_name: Some(generate_name(relay.relay_name(), &run.tool)),
            namespace: Some(namespace(relay)),
            labels: Some(labels),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            active_deadline_seconds: Some(
                i64::try_from(run.deadline.as_secs().max(1)).unwrap_or(i64::MAX),
            ),
            ttl_seconds_after_finished: Some(TOOL_JOB_KEPT_SECONDS),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            ..JobSpec::default()
        }),
        status: None,
    })
}

/// How a tool's run ended.
#[derive(Debug, PartialEq, Eq)]
pub struct Ended {
    /// The container's exit code.
    pub exit_code: i32,
    /// Its report (termination message), or why it never ran.
    pub report: String,
    /// When the container ended (RFC 3339), when it ran at all.
    pub finished_at: Option<String>,
}

impl Ended {
    /// The report's last line: the verdict, as the tools end their reports.
    pub fn last_line(&self) -> String {
        self.report
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default()
            .trim()
            .to_owned()
    }
}

/// The `Failed` condition of a Job that gave up (its deadline passed, its pod failed).
pub fn job_failed(job: &Job) -> Option<&k8s_openapi::api::batch::v1::JobCondition> {
    job.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Failed" && c.status == "True")
}

/// Reasons a container waits that it will not get over by itself.
const STUCK: [&str; 5] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
];

/// How the tool's container ended, or why it cannot start; `None` while it may still
/// run.
pub fn pod_ended(pod: &Pod) -> Option<Ended> {
    let status = pod.status.as_ref()?;
    let container = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == TOOL_CONTAINER);
    if let Some(ContainerState {
        terminated: Some(terminated),
        ..
    }) = container.and_then(|c| c.state.as_ref())
    {
        let report = terminated.message.clone().unwrap_or_else(|| {
            format!(
                "the tool ended ({}) and left no report",
                terminated.reason.as_deref().unwrap_or("no reason given")
            )
        });
        return Some(Ended {
            exit_code: terminated.exit_code,
            report,
            finished_at: terminated.finished_at.as_ref().map(|t| t.0.to_string()),
        });
    }
    if let Some(waiting) = container
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref())
        && let Some(reason) = waiting.reason.as_deref()
        && STUCK.contains(&reason)
    {
        return Some(Ended {
            exit_code: 2,
            report: format!(
                "the tool's pod {} cannot start: {reason}: {}",
                pod.metadata.name.as_deref().unwrap_or_default(),
                waiting.message.as_deref().unwrap_or_default()
            ),
            finished_at: None,
        });
    }
    // A pod stopped before its container ran (the Job's deadline, an eviction).
    if status.phase.as_deref() == Some("Failed") {
        return Some(Ended {
            exit_code: 2,
            report: format!(
                "the tool's pod failed before its tool ended: {}: {}",
                status.reason.as_deref().unwrap_or("no reason given"),
                status.message.as_deref().unwrap_or_default()
            ),
            finished_at: None,
        });
    }
    None
}

/// The label selector of a tool Job's pods (the label the Job controller gives them).
pub fn job_pods_selector(job: &str) -> String {
    format!("batch.kubernetes.io/job-name={job}")
}

/// The labels of one relay's tool runs of `tool`.
pub fn tool_labels(relay: &impl RelayRef, tool: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_owned(),
            TOOL_APP_NAME.to_owned(),
        ),
        (
            "app.kubernetes.io/instance".to_owned(),
            relay.relay_name().to_owned(),
        ),
        ("app.kubernetes.io/component".to_owned(), "tool".to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            MANAGED_BY.to_owned(),
        ),
        (TOOL_LABEL.to_owned(), tool.to_owned()),
    ])
}

/// `<relay>-<tool>-`, cut so the generated name (five more characters) stays within the
/// 63 a label value allows (the Job's pods carry it as `job-name`).
fn generate_name(relay: &str, tool: &str) -> String {
    let suffix = format!("-{tool}-");
    let room = 63 - 5 - suffix.len();
    let relay = &relay[..relay.len().min(room)];
    format!("{}{suffix}", relay.trim_end_matches('-'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{BuildOptions, build, pod_selector};

    fn relay(yaml: &str) -> OutboxRelay {
        let mut relay: OutboxRelay = serde_yaml::from_str(yaml).unwrap();
        relay.metadata.uid = Some("u-1".to_owned());
        relay
    }

    const RELAY: &str = "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database:
    postgres:
      connectionSecretRef: {name: db}
      sslMode: verify-full
      caSecretRef: {name: db-ca}
  mode: {polling: {}}
  broker: {nats: {url: \"nats://nats:4222\"}}
  relay:
    serviceAccountName: relay-sa
    podLabels: {team: payments}
    tolerations: [{key: dedicated, value: outbox, effect: NoSchedule}]
";

    fn job(run: &ToolRun) -> (OutboxRelay, Deployment, Job) {
        let relay = relay(RELAY);
        let valid = crate::spec::parse(&relay).unwrap();
        let desired = build(&valid, &BuildOptions::default()).unwrap();
        let job = tool_job(&relay, &desired.deployment, run).unwrap();
        (relay, desired.deployment, job)
    }

    fn audit() -> ToolRun {
        ToolRun {
            tool: "audit".to_owned(),
            args: vec!["--since".to_owned(), "2h".to_owned()],
            deadline: Duration::from_secs(600),
        }
    }

    #[test]
    fn the_tool_runs_as_the_relay_with_the_relays_secrets() {
        let (_, deployment, job) = job(&audit());
        let relay_pod = deployment.spec.unwrap().template.spec.unwrap();
        let spec = job.spec.unwrap();
        let pod = spec.template.spec.unwrap();
        let (relay_c, tool_c) = (&relay_pod.containers[0], &pod.containers[0]);
        assert_eq!(tool_c.image, relay_c.image);
        assert_eq!(tool_c.env, relay_c.env);
        assert_eq!(tool_c.security_context, relay_c.security_context);
        assert_eq!(tool_c.volume_mounts, relay_c.volume_mounts);
        assert_eq!(pod.security_context, relay_pod.security_context);
        assert_eq!(pod.service_account_name.as_deref(), Some("relay-sa"));
        assert_eq!(pod.tolerations, relay_pod.tolerations);
        assert_eq!(
            tool_c.args.as_deref().unwrap(),
            ["audit", "-f", TOOL_MANIFEST_PATH, "--since", "2h"]
        );
        assert!(tool_c.liveness_probe.is_none() && tool_c.ports.is_none());
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            (spec.backoff_limit, spec.active_deadline_seconds),
            (Some(0), Some(600))
        );
        // The Secret files keep their paths; the config file gives way to the manifest.
        let sources = |p: &k8s_openapi::api::core::v1::PodSpec| {
            p.volumes.as_ref().unwrap()[0]
                .projected
                .clone()
                .unwrap()
                .sources
                .unwrap()
        };
        let relay_secrets: Vec<_> = sources(&relay_pod)
            .into_iter()
            .filter(|s| s.secret.is_some())
            .collect();
        let tool_sources = sources(&pod);
        assert!(!relay_secrets.is_empty());
        assert_eq!(
            tool_sources
                .iter()
                .filter(|s| s.secret.is_some())
                .cloned()
                .collect::<Vec<_>>(),
            relay_secrets
        );
        assert!(tool_sources.iter().all(|s| s.config_map.is_none()));
        let file = &tool_sources
            .iter()
            .find_map(|s| s.downward_api.clone())
            .unwrap()
            .items
            .unwrap()[0];
        assert_eq!(file.path, "relay-manifest.yaml");
        assert_eq!(
            file.field_ref.as_ref().unwrap().field_path,
            "metadata.annotations['outbox.dev/relay-manifest']"
        );
    }

    #[test]
    fn the_manifest_the_tool_reads_is_the_relay_it_was_made_for() {
        let (relay, _, job) = job(&audit());
        let template = job.spec.unwrap().template.metadata.unwrap();
        let manifest = &template.annotations.unwrap()[TOOL_MANIFEST_ANNOTATION];
        let read = crate::render::load_relays(manifest, "annotation").unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].spec, relay.spec);
        assert_eq!(read[0].metadata.name.as_deref(), Some("orders"));
        assert_eq!(read[0].metadata.namespace.as_deref(), Some("shop"));
    }

    #[test]
    fn the_relays_selectors_never_count_a_tool_pod() {
        let (relay, _, job) = job(&audit());
        let labels = job.spec.unwrap().template.metadata.unwrap().labels.unwrap();
        let selected = pod_selector(&relay).split(',').all(|pair| {
            pair.split_once('=')
                .is_some_and(|(k, v)| labels.get(k).map(String::as_str) == Some(v))
        });
        assert!(!selected, "{labels:?}");
        assert_eq!(labels["team"], "payments");
        assert_eq!(labels[TOOL_LABEL], "audit");
        let owner = &job.metadata.owner_references.unwrap()[0];
        assert_eq!((owner.name.as_str(), owner.uid.as_str()), ("orders", "u-1"));
        assert_eq!(owner.controller, Some(false));
        assert_eq!(owner.block_owner_deletion, None);
    }

    #[test]
    fn a_long_relay_name_leaves_room_for_the_generated_suffix() {
        let name = generate_name(&"a".repeat(63), "dead-letters");
        assert_eq!(name.len() + 5, 63);
        assert!(name.ends_with("-dead-letters-"));
        assert_eq!(generate_name("orders", "check"), "orders-check-");
    }

    fn pod(yaml: &str) -> Pod {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn the_report_is_the_termination_message_and_the_exit_code_the_tools() {
        let ended = pod_ended(&pod(
            "metadata: {name: p}
status:
  phase: Failed
  containerStatuses:
  - name: tool
    image: i
    imageID: ''
    ready: false
    restartCount: 0
    state: {terminated: {exitCode: 1, reason: Error, message: \"FAIL  table  missing\\n\"}}",
        ));
        assert_eq!(
            ended,
            Some(Ended {
                exit_code: 1,
                report: "FAIL  table  missing\n".to_owned(),
                finished_at: None,
            })
        );
    }

    #[test]
    fn a_pod_that_cannot_start_ends_the_wait_with_why() {
        let ended = pod_ended(&pod(
            "metadata: {name: p}
status:
  phase: Pending
  containerStatuses:
  - name: tool
    image: i
    imageID: ''
    ready: false
    restartCount: 0
    state: {waiting: {reason: CreateContainerConfigError, message: 'secret \"db\" not found'}}",
        ))
        .unwrap();
        assert_eq!(ended.exit_code, 2);
        assert!(
            ended.report.contains("secret \"db\" not found"),
            "{}",
            ended.report
        );
        let running = pod("metadata: {name: p}
status:
  phase: Pending
  containerStatuses:
  - name: tool
    image: i
    imageID: ''
    ready: false
    restartCount: 0
    state: {waiting: {reason: ContainerCreating}}");
        assert_eq!(pod_ended(&running), None);
    }
}
