//! The relay workload: its config file (ConfigMap), its pods (Deployment) and their
//! disruption budget.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapProjection, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, KeyToPath, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ProjectedVolumeSource, ResourceRequirements, SeccompProfile, SecretKeySelector,
    SecretProjection, SecurityContext, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};

use super::{
    BuildError, BuildOptions, CONFIG_HASH_ANNOTATION, CONFIG_KEY, child_meta, config_map_name,
    labels, relay_object_name, selector_labels,
};
use crate::api::{Broker, Mode, OutboxRelay, SecretKeyRef};
use crate::relay::config::{
    CONFIG_PATH, ENV_DATABASE_URL, ENV_KAFKA_SASL_PASSWORD, ENV_KAFKA_SASL_USERNAME,
    ENV_RABBITMQ_URL, HTTP_PORT, KAFKA_CA_PATH, NATS_CREDENTIALS_PATH, RelayConfig,
};

/// The name of the container port, used by probes, the Service and the ServiceMonitor.
pub const METRICS_PORT_NAME: &str = "metrics";
/// The UID/GID relays run as: distroless `nonroot`, so any image built like ours works
/// under `runAsNonRoot` even when it does not declare a numeric user.
const RUN_AS: i64 = 65_532;
/// Directory that holds the config file and the mounted Secret files.
fn config_dir() -> &'static str {
    CONFIG_PATH
        .rsplit_once('/')
        .map_or("/etc/outbox-relay", |(dir, _)| dir)
}

/// The ConfigMap holding the relay config file. It holds no secret: Secret references
/// become environment variable names and file paths (see `RelayConfig`).
pub fn config_map(relay: &OutboxRelay) -> Result<ConfigMap, BuildError> {
    let text = RelayConfig::for_relay(relay)?.to_yaml()?;
    Ok(ConfigMap {
        metadata: child_meta(relay, config_map_name(relay), "relay"),
        data: Some(BTreeMap::from([(CONFIG_KEY.to_owned(), text)])),
        ..ConfigMap::default()
    })
}

/// The Secret a mounted file comes from, and the path below the config directory.
struct SecretFile<'a> {
    secret: &'a SecretKeyRef,
    path: &'static str,
}

/// Environment variables filled from Secrets, by the names the relay config refers to.
fn secret_env(relay: &OutboxRelay) -> Vec<(&'static str, &SecretKeyRef)> {
    let mut env = vec![(
        ENV_DATABASE_URL,
        &relay.spec.database.postgres.connection_secret_ref,
    )];
    match relay.spec.broker.get() {
        Some(Broker::Kafka(k)) => {
            if let Some(sasl) = &k.sasl {
                env.push((ENV_KAFKA_SASL_USERNAME, &sasl.username_secret_ref));
                env.push((ENV_KAFKA_SASL_PASSWORD, &sasl.password_secret_ref));
            }
        }
        Some(Broker::RabbitMq(r)) => env.push((ENV_RABBITMQ_URL, &r.url_secret_ref)),
        Some(Broker::Nats(_)) | None => {}
    }
    env
}

/// Files mounted from Secrets, at the paths the relay config names.
fn secret_files(relay: &OutboxRelay) -> Vec<SecretFile<'_>> {
    let mut files = Vec::new();
    match relay.spec.broker.get() {
        Some(Broker::Kafka(k)) => {
            if let Some(ca) = k.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
                files.push(SecretFile {
                    secret: ca,
                    path: KAFKA_CA_PATH,
                });
            }
        }
        Some(Broker::Nats(n)) => {
            if let Some(creds) = &n.credentials_secret_ref {
                files.push(SecretFile {
                    secret: creds,
                    path: NATS_CREDENTIALS_PATH,
                });
            }
        }
        Some(Broker::RabbitMq(_)) | None => {}
    }
    files
}

/// Every Secret key the relay pods need, with what it is for; the controller checks each
/// exists before it creates pods that would otherwise crash-loop.
pub fn required_secrets(relay: &OutboxRelay) -> Vec<(SecretUse, &SecretKeyRef)> {
    let mut all: Vec<(SecretUse, &SecretKeyRef)> = secret_env(relay)
        .into_iter()
        .map(|(env, secret)| {
            let purpose = if env == ENV_DATABASE_URL {
                SecretUse::Database
            } else {
                SecretUse::Broker
            };
            (purpose, secret)
        })
        .collect();
    all.extend(
        secret_files(relay)
            .into_iter()
            .map(|f| (SecretUse::Broker, f.secret)),
    );
    all
}

/// What a Secret is needed for, which decides the condition that reports it missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecretUse {
    /// The database connection (`DatabaseReady`).
    Database,
    /// The broker connection (`BrokerReady`).
    Broker,
}

/// A stable hash of the config file text, for the pod-template annotation.
pub fn config_hash(config_map: &ConfigMap) -> String {
    let mut hasher = Sha256::new();
    for (key, value) in config_map.data.iter().flatten() {
        hasher.update(key.as_bytes());
        hasher.update([0]);
        hasher.update(value.as_bytes());
        hasher.update([0]);
    }
    let digest = hasher.finalize();
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Whether the mode admits a single active consumer only (a replication slot streams to
/// one connection), so the relay runs one pod and never overlaps two during updates.
fn single_consumer(relay: &OutboxRelay) -> bool {
    matches!(relay.spec.mode.get(), Some(Mode::LogTailing(_)))
}

/// Pods the Deployment runs: the spec's count, at most one for log tailing.
pub fn effective_replicas(relay: &OutboxRelay) -> i32 {
    if single_consumer(relay) {
        relay.spec.replicas.min(1)
    } else {
        relay.spec.replicas
    }
}

/// The relay Deployment, running `outbox-operator relay --config <CONFIG_PATH>` under the
/// restricted Pod Security Standard.
pub fn deployment(
    relay: &OutboxRelay,
    options: &BuildOptions,
    config_map: &ConfigMap,
) -> Deployment {
    let pod = &relay.spec.relay;
    let image = pod
        .image
        .clone()
        .filter(|i| !i.is_empty())
        .unwrap_or_else(|| options.relay_image.clone());

    let mut env = vec![EnvVar {
        name: "RUST_LOG".to_owned(),
        value: Some(pod.log_level.clone().unwrap_or_else(|| "info".to_owned())),
        ..EnvVar::default()
    }];
    env.extend(secret_env(relay).into_iter().map(|(name, secret)| EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.name.clone(),
                key: secret.key.clone(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }));

    // One projected volume holds the config file and the Secret files side by side, so
    // no mount point nests inside another read-only volume.
    let dir = config_dir();
    let mut sources = vec![VolumeProjection {
        config_map: Some(ConfigMapProjection {
            name: config_map_name(relay),
            items: Some(vec![KeyToPath {
                key: CONFIG_KEY.to_owned(),
                path: relative(CONFIG_PATH, dir),
                mode: None,
            }]),
            optional: Some(false),
        }),
        ..VolumeProjection::default()
    }];
    sources.extend(secret_files(relay).into_iter().map(|f| VolumeProjection {
        secret: Some(SecretProjection {
            name: f.secret.name.clone(),
            items: Some(vec![KeyToPath {
                key: f.secret.key.clone(),
                path: relative(f.path, dir),
                mode: None,
            }]),
            optional: Some(false),
        }),
        ..VolumeProjection::default()
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
        liveness_probe: Some(probe("/healthz", 10)),
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

    let strategy = if single_consumer(relay) {
        // Recreate: the old pod is gone before the new one starts, so two pods never
        // stream one slot (the second would fail and crash-loop until the first exits).
        DeploymentStrategy {
            type_: Some("Recreate".to_owned()),
            rolling_update: None,
        }
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

    Deployment {
        metadata: child_meta(relay, relay_object_name(relay), "relay"),
        spec: Some(DeploymentSpec {
            replicas: Some(effective_replicas(relay)),
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
                        run_as_user: Some(RUN_AS),
                        run_as_group: Some(RUN_AS),
                        fs_group: Some(RUN_AS),
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
                            default_mode: Some(0o440),
                        }),
                        ..Volume::default()
                    }]),
                    node_selector: non_empty(pod.node_selector.clone()),
                    tolerations: (!pod.tolerations.is_empty()).then(|| pod.tolerations.clone()),
                    affinity: pod.affinity.clone(),
                    priority_class_name: pod.priority_class_name.clone(),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

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
pub fn pod_disruption_budget(relay: &OutboxRelay) -> Option<PodDisruptionBudget> {
    (effective_replicas(relay) > 1).then(|| PodDisruptionBudget {
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
