//! The relay workload: its config file (ConfigMap), its pods (Deployment) and their
//! disruption budget.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapProjection, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, KeyToPath, LocalObjectReference, PodSecurityContext, PodSpec, PodTemplateSpec,
    Probe, ProjectedVolumeSource, ResourceRequirements, SeccompProfile, SecretKeySelector,
    SecretProjection, SecurityContext, TopologySpreadConstraint, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};

use super::{
    BuildError, BuildOptions, CONFIG_HASH_ANNOTATION, CONFIG_KEY, COVERAGE_BASELINE_KEY,
    MODE_ANNOTATION, MODE_LOG_TAILING, MODE_POLLING, SECRETS_VERSION_ANNOTATION, child_meta,
    config_map_name, labels, relay_object_name, selector_labels,
};
use crate::api::RelayPodSpec;
use crate::secrets::Delivery;
use crate::spec::config::{CONFIG_PATH, HTTP_PORT, RelayConfig};
use crate::spec::{ValidMode, ValidRelay};

/// The name of the container port, used by probes, the Service and the ServiceMonitor.
pub const METRICS_PORT_NAME: &str = "metrics";
/// Mode of the mounted config and Secret files when a group owns them (`fsGroup`):
/// readable by that group. Without one they belong to root, so they must be readable
/// by every user, whichever the image or the platform runs the relay as.
const FILE_MODE_GROUP: i32 = 0o440;
const FILE_MODE_ANY_USER: i32 = 0o444;
/// Directory that holds the config file and the mounted Secret files.
fn config_dir() -> &'static str {
    CONFIG_PATH
        .rsplit_once('/')
        .map_or("/etc/outbox-relay", |(dir, _)| dir)
}

/// The ConfigMap holding the relay config file. It holds no secret: Secrets are named,
/// and their values reach the pod as the variables and files of the catalogue.
pub fn config_map(valid: &ValidRelay) -> Result<ConfigMap, BuildError> {
    let relay = valid;
    let text = RelayConfig::for_relay(valid).to_yaml()?;
    let baseline = valid.coverage_baseline().unwrap_or_default().to_owned();
    Ok(ConfigMap {
        metadata: child_meta(relay, config_map_name(relay), "relay"),
        data: Some(BTreeMap::from([
            (CONFIG_KEY.to_owned(), text),
            (COVERAGE_BASELINE_KEY.to_owned(), baseline),
        ])),
        ..ConfigMap::default()
    })
}

/// Marks the relay pods with the versions of the Secret values they read (`name/key`
/// and a salted digest of the value, see the controller's `observe`), so a rotated
/// password or certificate rolls them (the relay reads Secret values only at start).
/// The annotation holds a truncated hash over those pairs.
pub fn annotate_secret_versions(deployment: &mut Deployment, versions: &[(String, String)]) {
    let mut hasher = Sha256::new();
    for (name, version) in versions {
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update(version.as_bytes());
        hasher.update([0]);
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    if let Some(meta) = deployment
        .spec
        .as_mut()
        .and_then(|s| s.template.metadata.as_mut())
    {
        meta.annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(SECRETS_VERSION_ANNOTATION.to_owned(), digest);
    }
}

/// The coverage baseline the decision recorded (`None`: none), into the ConfigMap.
pub fn with_coverage_baseline(config_map: &mut ConfigMap, baseline: Option<&str>) {
    config_map.data.get_or_insert_with(BTreeMap::new).insert(
        COVERAGE_BASELINE_KEY.to_owned(),
        baseline.unwrap_or_default().to_owned(),
    );
}

/// A stable hash of the config file text, for the pod-template annotation (the coverage
/// baseline aside: the relay reads it only when it starts).
pub fn config_hash(config_map: &ConfigMap) -> String {
    let mut hasher = Sha256::new();
    for (key, value) in config_map
        .data
        .iter()
        .flatten()
        .filter(|(key, _)| key.as_str() != COVERAGE_BASELINE_KEY)
    {
        hasher.update(key.as_bytes());
        hasher.update([0]);
        hasher.update(value.as_bytes());
        hasher.update([0]);
    }
    let digest = hasher.finalize();
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The relay Deployment, running `outbox-operator relay --config <CONFIG_PATH>` under the
/// restricted Pod Security Standard.
pub fn deployment(
    valid: &ValidRelay,
    options: &BuildOptions,
    config_map: &ConfigMap,
) -> Deployment {
    let relay = valid;
    let pod = valid.pod();
    let image = pod
        .image
        .clone()
        .filter(|i| !i.is_empty())
        .unwrap_or_else(|| options.relay_image.clone());
    let identity = Identity::of(pod, options);

    let mut env = vec![EnvVar {
        name: "RUST_LOG".to_owned(),
        value: Some(pod.log_level.clone().unwrap_or_else(|| "info".to_owned())),
        ..EnvVar::default()
    }];
    let secrets = valid.secrets();
    env.extend(secrets.iter().filter_map(|s| match s.delivery {
        Delivery::Env(name) => Some(EnvVar {
            name: name.to_owned(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: s.reference.name.clone(),
                    key: s.reference.key.clone(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        }),
        Delivery::File { .. } => None,
    }));

    // One projected volume holds the config file and the Secret files side by side, so
    // no mount point nests inside another read-only volume.
    let dir = config_dir();
    let mut sources = vec![VolumeProjection {
        config_map: Some(ConfigMapProjection {
            name: config_map_name(relay),
            items: Some(vec![
                KeyToPath {
                    key: CONFIG_KEY.to_owned(),
                    path: relative(CONFIG_PATH, dir),
                    mode: None,
                },
                KeyToPath {
                    key: COVERAGE_BASELINE_KEY.to_owned(),
                    path: COVERAGE_BASELINE_KEY.to_owned(),
                    mode: None,
                },
            ]),
            optional: Some(false),
        }),
        ..VolumeProjection::default()
    }];
    sources.extend(secrets.iter().filter_map(|s| match s.delivery {
        Delivery::File { path, .. } => Some(VolumeProjection {
            secret: Some(SecretProjection {
                name: s.reference.name.clone(),
                items: Some(vec![KeyToPath {
                    key: s.reference.key.clone(),
                    path: relative(path, dir),
                    mode: None,
                }]),
                optional: Some(false),
            }),
            ..VolumeProjection::default()
        }),
        Delivery::Env(_) => None,
    }));

    let probe = |path: &str, period: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String(METRICS_PORT_NAME.to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(2),
        failure_threshold: Some(3),
        ..Probe::default()
    };

    let container = Container {
        name: "relay".to_owned(),
        image: Some(image),
        image_pull_policy: pod
            .image_pull_policy
            .or(options.relay_image_pull_policy)
            .map(|p| p.as_str().to_owned()),
        args: Some(vec![
            "relay".to_owned(),
            "--config".to_owned(),
            CONFIG_PATH.to_owned(),
        ]),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some(METRICS_PORT_NAME.to_owned()),
            container_port: i32::from(HTTP_PORT),
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        // A relay that fails its liveness probe is stuck (its loop stopped turning, or it
        // stopped answering): waiting out the pod's 30 s grace period for it would only
        // delay the restart. What it had in flight is published again from the slot's
        // confirmed position or the unmarked rows.
        liveness_probe: Some(Probe {
            termination_grace_period_seconds: Some(LIVENESS_KILL_GRACE_SECONDS),
            ..probe("/healthz", 10)
        }),
        readiness_probe: Some(probe("/readyz", 5)),
        resources: Some(pod.resources.clone().unwrap_or_else(default_resources)),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                add: None,
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: "config".to_owned(),
            mount_path: dir.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        }]),
        ..Container::default()
    };

    let mut pod_labels = pod.pod_labels.clone();
    // Ours win: the selector labels must stay on every pod.
    pod_labels.extend(labels(relay, "relay"));
    let mut annotations = pod.pod_annotations.clone();
    annotations.insert(CONFIG_HASH_ANNOTATION.to_owned(), config_hash(config_map));

    let strategy = if let ValidMode::LogTailing(_) = valid.mode {
        // Recreate: the old pod is gone before the new one starts, so two pods never
        // stream one slot (the second would fail and crash-loop until the first exits).
        recreate()
    } else {
        // Polling partitions are owned through advisory locks, so old and new pods may
        // overlap; surge first so the backlog keeps draining during an update.
        DeploymentStrategy {
            type_: Some("RollingUpdate".to_owned()),
            rolling_update: Some(RollingUpdateDeployment {
                max_surge: Some(IntOrString::Int(1)),
                max_unavailable: Some(IntOrString::Int(0)),
            }),
        }
    };

    let mut metadata = child_meta(relay, relay_object_name(relay), "relay");
    let mode = match valid.mode {
        ValidMode::LogTailing(_) => MODE_LOG_TAILING,
        ValidMode::Polling(_) => MODE_POLLING,
    };
    metadata.annotations = Some(BTreeMap::from([(
        MODE_ANNOTATION.to_owned(),
        mode.to_owned(),
    )]));
    Deployment {
        metadata,
        spec: Some(DeploymentSpec {
            replicas: Some(valid.effective_replicas()),
            selector: LabelSelector {
                match_labels: Some(selector_labels(relay)),
                match_expressions: None,
            },
            strategy: Some(strategy),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    // The relay needs no Kubernetes API access.
                    automount_service_account_token: Some(false),
                    service_account_name: pod.service_account_name.clone(),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: identity.user,
                        run_as_group: identity.group,
                        fs_group: identity.fs_group,
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".to_owned(),
                            localhost_profile: None,
                        }),
                        ..PodSecurityContext::default()
                    }),
                    termination_grace_period_seconds: Some(30),
                    volumes: Some(vec![Volume {
                        name: "config".to_owned(),
                        projected: Some(ProjectedVolumeSource {
                            sources: Some(sources),
                            default_mode: Some(if identity.fs_group.is_some() {
                                FILE_MODE_GROUP
                            } else {
                                FILE_MODE_ANY_USER
                            }),
                        }),
                        ..Volume::default()
                    }]),
                    node_selector: non_empty(pod.node_selector.clone()),
                    tolerations: (!pod.tolerations.is_empty()).then(|| pod.tolerations.clone()),
                    affinity: pod.affinity.clone(),
                    topology_spread_constraints: spread(valid),
                    image_pull_secrets: pull_secrets(pod, options),
                    priority_class_name: pod.priority_class_name.clone(),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

/// Who the relay process runs as: the spec's choice, else the operator's, else nothing
/// (the image's numeric user; or the platform's, as OpenShift assigns one).
struct Identity {
    user: Option<i64>,
    group: Option<i64>,
    fs_group: Option<i64>,
}

impl Identity {
    fn of(pod: &RelayPodSpec, options: &BuildOptions) -> Self {
        Self {
            user: pod.run_as_user.or(options.relay_run_as_user),
            group: pod.run_as_group.or(options.relay_run_as_group),
            fs_group: pod.fs_group.or(options.relay_fs_group),
        }
    }
}

/// The operator's pull Secrets, then the spec's, each once.
fn pull_secrets(pod: &RelayPodSpec, options: &BuildOptions) -> Option<Vec<LocalObjectReference>> {
    let mut names: Vec<LocalObjectReference> = Vec::new();
    let all = options
        .relay_image_pull_secrets
        .iter()
        .map(|name| LocalObjectReference { name: name.clone() })
        .chain(pod.image_pull_secrets.iter().cloned());
    for reference in all {
        if !reference.name.is_empty() && !names.contains(&reference) {
            names.push(reference);
        }
    }
    (!names.is_empty()).then_some(names)
}

/// The spec's spread constraints; one without a selector counts this relay's pods.
fn spread(valid: &ValidRelay) -> Option<Vec<TopologySpreadConstraint>> {
    let constraints = &valid.pod().topology_spread_constraints;
    (!constraints.is_empty()).then(|| {
        constraints
            .iter()
            .map(|c| TopologySpreadConstraint {
                label_selector: c.label_selector.clone().or_else(|| {
                    Some(LabelSelector {
                        match_labels: Some(selector_labels(valid)),
                        match_expressions: None,
                    })
                }),
                ..c.clone()
            })
            .collect()
    })
}

/// Seconds a relay judged stuck by its liveness probe gets between SIGTERM and SIGKILL.
pub const LIVENESS_KILL_GRACE_SECONDS: i64 = 5;

/// Requests that let a relay schedule on a small node, and a memory limit that stops a
/// runaway batch from taking the node down.
fn default_resources() -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity("50m".to_owned())),
            ("memory".to_owned(), Quantity("64Mi".to_owned())),
        ])),
        limits: Some(BTreeMap::from([(
            "memory".to_owned(),
            Quantity("256Mi".to_owned()),
        )])),
        ..ResourceRequirements::default()
    }
}

fn non_empty(map: BTreeMap<String, String>) -> Option<BTreeMap<String, String>> {
    (!map.is_empty()).then_some(map)
}

/// `path` relative to `dir` (the constants are absolute paths below the config dir).
fn relative(path: &str, dir: &str) -> String {
    path.strip_prefix(dir)
        .map_or(path, |p| p.trim_start_matches('/'))
        .to_owned()
}

/// A budget that lets voluntary disruptions (node drains) take one pod at a time, when
/// the relay runs more than one; with one pod a budget would block drains forever.
pub fn pod_disruption_budget(valid: &ValidRelay) -> Option<PodDisruptionBudget> {
    let relay = valid;
    (valid.effective_replicas() > 1).then(|| PodDisruptionBudget {
        metadata: child_meta(relay, relay_object_name(relay), "relay"),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(relay)),
                match_expressions: None,
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    })
}

/// The `Recreate` strategy: every old pod is gone before a new one starts.
fn recreate() -> DeploymentStrategy {
    DeploymentStrategy {
        type_: Some("Recreate".to_owned()),
        rolling_update: None,
    }
}

/// Makes `deployment` roll out with [`recreate`], whatever its mode: the controller asks
/// for it while the pods it replaces tail the log, so a polling relay never starts
/// beside them.
pub fn roll_out_exclusively(deployment: &mut Deployment) {
    if let Some(spec) = deployment.spec.as_mut() {
        spec.strategy = Some(recreate());
    }
}
