//! Pure functions from an `OutboxRelay` to the Kubernetes objects it needs: the relay's
//! ConfigMap, Deployment, metrics Service, ServiceMonitor, PrometheusRule and
//! PodDisruptionBudget.
//!
//! Nothing here talks to the API server, so the controller and `outbox-operator render`
//! build exactly the same objects and the whole set is unit- and golden-file tested.

mod monitoring;
mod tool_job;
mod workload;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Resource;
use kube::api::DynamicObject;
use serde::Serialize;

use crate::api::{ImagePullPolicy, OutboxRelay};
use crate::spec::ValidRelay;

pub use monitoring::{
    PROMETHEUS_RULE_KIND, PROMETHEUS_RULE_PLURAL, SERVICE_MONITOR_KIND, SERVICE_MONITOR_PLURAL,
    default_runbook_base_url, prometheus_rule, runbook_url, service, service_monitor,
};
pub use tool_job::{
    Ended, TOOL_APP_NAME, TOOL_CONTAINER, TOOL_JOB_KEPT_SECONDS, TOOL_LABEL,
    TOOL_MANIFEST_ANNOTATION, TOOL_MANIFEST_PATH, ToolJobError, ToolRun, job_failed,
    job_pods_selector, pod_ended, tool_job, tool_labels, tool_manifest,
};
pub use workload::{
    METRICS_PORT_NAME, annotate_secret_versions, config_hash, config_map, deployment,
    pod_disruption_budget, roll_out_exclusively, with_coverage_baseline,
};

/// The field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "outbox-operator";
/// `app.kubernetes.io/name` of every relay object.
pub const APP_NAME: &str = "outbox-relay";
/// `app.kubernetes.io/managed-by` and `part-of` of every object the operator creates;
/// together with `instance` it selects the children of one OutboxRelay.
pub const MANAGED_BY: &str = "outbox-operator";
/// Pod-template annotation holding a hash of the relay config, so that any change to the
/// config file rolls the pods (a mounted ConfigMap alone would not restart the relay).
pub const CONFIG_HASH_ANNOTATION: &str = "outbox.dev/config-hash";
/// Pod-template annotation holding a hash of the referenced Secrets' names and
/// `resourceVersion`s: a rotated Secret rolls the pods.
pub const SECRETS_VERSION_ANNOTATION: &str = "outbox.dev/secrets-version";
/// Deployment annotation naming the mode its pods run (`polling` or `logTailing`):
/// the operator hands a switch from polling to log tailing over only once the polling
/// pods have published what the new slot cannot stream.
pub const MODE_ANNOTATION: &str = "outbox.dev/mode";
/// The values of [`MODE_ANNOTATION`].
pub const MODE_POLLING: &str = "polling";
pub const MODE_LOG_TAILING: &str = "logTailing";
/// The key of the config file in the ConfigMap.
pub const CONFIG_KEY: &str = "relay.yaml";
/// Key (and file, beside the config file) of the publication's coverage baseline
/// (`status.slot.coverageBaseline`): read by the relay at start, left out of the config
/// hash so that recording it never restarts the pods.
pub const COVERAGE_BASELINE_KEY: &str = "coverage-baseline";
/// The API group and version of the Prometheus operator's CRDs.
pub const MONITORING_API_VERSION: &str = "monitoring.coreos.com/v1";

/// The image relays run when the spec names none: the operator's own image, same version.
pub fn default_relay_image() -> String {
    format!(
        "ghcr.io/outbox-operator/outbox-operator:{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// Settings of the operator that shape the objects, as opposed to the spec: the
/// defaults of every relay's pods. `controller` and `render` take them as the same flags.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct BuildOptions {
    /// Image for relays whose spec names none (default: the operator's own image).
    #[arg(long, env = "OUTBOX_RELAY_IMAGE", default_value_t = default_relay_image())]
    pub relay_image: String,
    /// Pull policy of relay images whose spec names none (Always, IfNotPresent, Never;
    /// default: Kubernetes' own, by the image's tag).
    #[arg(long, env = "OUTBOX_RELAY_IMAGE_PULL_POLICY", value_parser = ImagePullPolicy::parse)]
    pub relay_image_pull_policy: Option<ImagePullPolicy>,
    /// Secrets every relay pod pulls its image with, by name in the relay's namespace
    /// (repeat the flag, or separate with commas); a relay's spec may add more.
    #[arg(
        long = "relay-image-pull-secret",
        env = "OUTBOX_RELAY_IMAGE_PULL_SECRETS",
        value_delimiter = ','
    )]
    pub relay_image_pull_secrets: Vec<String>,
    /// User id of relay processes whose spec names none (default: none, so the image's
    /// user, or the one the platform assigns, runs).
    #[arg(long, env = "OUTBOX_RELAY_RUN_AS_USER", value_parser = clap::value_parser!(i64).range(1..))]
    pub relay_run_as_user: Option<i64>,
    /// Group id of relay processes whose spec names none.
    #[arg(long, env = "OUTBOX_RELAY_RUN_AS_GROUP", value_parser = clap::value_parser!(i64).range(0..))]
    pub relay_run_as_group: Option<i64>,
    /// Group owning relay pods' mounted files, when their spec names none.
    #[arg(long, env = "OUTBOX_RELAY_FS_GROUP", value_parser = clap::value_parser!(i64).range(0..))]
    pub relay_fs_group: Option<i64>,
    /// A label (KEY=VALUE) on every relay's ServiceMonitor and PrometheusRule: the one
    /// your Prometheus selects them by (kube-prometheus-stack: release=<its release>).
    /// Repeat the flag, or separate with commas.
    #[arg(
        long = "monitoring-label",
        env = "OUTBOX_MONITORING_LABELS",
        value_delimiter = ',',
        value_parser = crate::rules::parse_label
    )]
    pub monitoring_labels: Vec<(String, String)>,
    /// Where the alerts' `runbook_url` points: `<base>#<alert name, lower case>`.
    #[arg(long, env = "OUTBOX_RUNBOOK_BASE_URL", default_value_t = default_runbook_base_url())]
    pub runbook_base_url: String,
}

impl Default for BuildOptions {
    fn default() -> Self {
        Self {
            relay_image: default_relay_image(),
            relay_image_pull_policy: None,
            relay_image_pull_secrets: Vec::new(),
            relay_run_as_user: None,
            relay_run_as_group: None,
            relay_fs_group: None,
            monitoring_labels: Vec::new(),
            runbook_base_url: default_runbook_base_url(),
        }
    }
}

/// Why the objects for a relay cannot be built: only a serialisation failure, a bug
/// rather than a user error, since a [`ValidRelay`] passed every rule.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The relay config could not be serialised.
    #[error("cannot serialise the relay config: {0}")]
    Yaml(#[from] serde_yaml::Error),
}

/// Every object one OutboxRelay needs, in apply order.
#[derive(Clone, Debug)]
pub struct Desired {
    /// The relay config file.
    pub config_map: ConfigMap,
    /// The relay pods.
    pub deployment: Deployment,
    /// The metrics Service.
    pub service: Service,
    /// Present when the relay runs more than one pod.
    pub pod_disruption_budget: Option<PodDisruptionBudget>,
    /// Prometheus scrape config (`monitoring.coreos.com/v1`).
    pub service_monitor: DynamicObject,
    /// Alerting rules (`monitoring.coreos.com/v1`), present when `spec.alerting.enabled`.
    pub prometheus_rule: Option<DynamicObject>,
}

/// Builds every object for a parsed relay.
pub fn build(relay: &ValidRelay, options: &BuildOptions) -> Result<Desired, BuildError> {
    let config_map = config_map(relay)?;
    let deployment = deployment(relay, options, &config_map);
    Ok(Desired {
        service: service(relay),
        pod_disruption_budget: pod_disruption_budget(relay),
        service_monitor: service_monitor(relay, options),
        prometheus_rule: prometheus_rule(relay, options),
        deployment,
        config_map,
    })
}

/// The kinds of child object a relay has, in apply order: the one list the controller
/// applies, prunes and fingerprints, and `render` prints. Adding a kind is a variant
/// here, its arm in [`ChildKind::api_resource`] and [`Desired::child`], and a field of
/// [`Desired`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChildKind {
    /// The relay's config file.
    ConfigMap,
    /// The relay pods.
    Deployment,
    /// The metrics Service.
    Service,
    /// Voluntary-disruption budget (more than one pod).
    PodDisruptionBudget,
    /// Prometheus Operator scrape config.
    ServiceMonitor,
    /// Prometheus Operator alerting rules.
    PrometheusRule,
}

impl ChildKind {
    /// Every kind, in apply order (the ConfigMap first: the Deployment's pods mount it).
    pub const ALL: [ChildKind; 6] = [
        ChildKind::ConfigMap,
        ChildKind::Deployment,
        ChildKind::Service,
        ChildKind::PodDisruptionBudget,
        ChildKind::ServiceMonitor,
        ChildKind::PrometheusRule,
    ];

    /// Group, version, kind and plural, for dynamic API access.
    pub fn api_resource(self) -> kube::api::ApiResource {
        let (group, version, kind, plural) = match self {
            ChildKind::ConfigMap => ("", "v1", "ConfigMap", "configmaps"),
            ChildKind::Deployment => ("apps", "v1", "Deployment", "deployments"),
            ChildKind::Service => ("", "v1", "Service", "services"),
            ChildKind::PodDisruptionBudget => (
                "policy",
                "v1",
                "PodDisruptionBudget",
                "poddisruptionbudgets",
            ),
            ChildKind::ServiceMonitor => (
                "monitoring.coreos.com",
                "v1",
                SERVICE_MONITOR_KIND,
                SERVICE_MONITOR_PLURAL,
            ),
            ChildKind::PrometheusRule => (
                "monitoring.coreos.com",
                "v1",
                PROMETHEUS_RULE_KIND,
                PROMETHEUS_RULE_PLURAL,
            ),
        };
        kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(group, version, kind),
            plural,
        )
    }

    /// Whether the controller watches this kind (changes to it reconcile the relay).
    pub fn watched(self) -> bool {
        matches!(
            self,
            ChildKind::ConfigMap
                | ChildKind::Deployment
                | ChildKind::Service
                | ChildKind::PodDisruptionBudget
        )
    }

    /// Served only where the Prometheus Operator's CRDs are installed.
    pub fn needs_monitoring_crds(self) -> bool {
        matches!(self, ChildKind::ServiceMonitor | ChildKind::PrometheusRule)
    }
}

impl Desired {
    /// The child of `kind` as a dynamic object; `None` when the relay has none of that
    /// kind (it is pruned).
    pub fn child(&self, kind: ChildKind) -> Result<Option<DynamicObject>, serde_json::Error> {
        fn dynamic(object: &impl Serialize) -> Result<Option<DynamicObject>, serde_json::Error> {
            serde_json::from_value(serde_json::to_value(object)?).map(Some)
        }
        match kind {
            ChildKind::ConfigMap => dynamic(&self.config_map),
            ChildKind::Deployment => dynamic(&self.deployment),
            ChildKind::Service => dynamic(&self.service),
            ChildKind::PodDisruptionBudget => self
                .pod_disruption_budget
                .as_ref()
                .map_or(Ok(None), dynamic),
            ChildKind::ServiceMonitor => dynamic(&self.service_monitor),
            ChildKind::PrometheusRule => self.prometheus_rule.as_ref().map_or(Ok(None), dynamic),
        }
    }

    /// Every child the relay has, in apply order.
    pub fn children(&self) -> Result<Vec<(ChildKind, DynamicObject)>, serde_json::Error> {
        let mut out = Vec::new();
        for kind in ChildKind::ALL {
            if let Some(object) = self.child(kind)? {
                out.push((kind, object));
            }
        }
        Ok(out)
    }

    /// The objects as one multi-document YAML stream, in apply order.
    pub fn to_yaml(&self) -> Result<String, serde_yaml::Error> {
        let mut out = String::new();
        for kind in ChildKind::ALL {
            let doc = match kind {
                ChildKind::ConfigMap => Some(to_value(&self.config_map)?),
                ChildKind::Deployment => Some(to_value(&self.deployment)?),
                ChildKind::Service => Some(to_value(&self.service)?),
                ChildKind::PodDisruptionBudget => self
                    .pod_disruption_budget
                    .as_ref()
                    .map(to_value)
                    .transpose()?,
                ChildKind::ServiceMonitor => Some(to_value(&self.service_monitor)?),
                ChildKind::PrometheusRule => {
                    self.prometheus_rule.as_ref().map(to_value).transpose()?
                }
            };
            if let Some(doc) = doc {
                out.push_str("---\n");
                out.push_str(&serde_yaml::to_string(&doc)?);
            }
        }
        Ok(out)
    }
}

fn to_value(object: &impl Serialize) -> Result<serde_yaml::Value, serde_yaml::Error> {
    serde_yaml::to_value(object)
}

/// Name of the relay's Deployment, Service, PDB, ServiceMonitor and PrometheusRule.
/// The CRD limits OutboxRelay names so that this stays a valid DNS label.
pub fn relay_object_name(relay: &impl RelayRef) -> String {
    format!("{}-relay", relay.relay_name())
}

/// Name of the relay's ConfigMap.
pub fn config_map_name(relay: &impl RelayRef) -> String {
    format!("{}-relay-config", relay.relay_name())
}

/// The labels that select one relay's pods. A Deployment's selector is immutable, so
/// this set never grows.
pub fn selector_labels(relay: &impl RelayRef) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), APP_NAME.to_owned()),
        (
            "app.kubernetes.io/instance".to_owned(),
            relay.relay_name().to_owned(),
        ),
    ])
}

/// [`selector_labels`] as a label selector (`k=v,k=v`), to list the relay's pods.
pub fn pod_selector(relay: &impl RelayRef) -> String {
    selector_labels(relay)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The labels of every child object, `component` saying which part it is.
pub fn labels(relay: &impl RelayRef, component: &str) -> BTreeMap<String, String> {
    let mut labels = selector_labels(relay);
    labels.insert(
        "app.kubernetes.io/component".to_owned(),
        component.to_owned(),
    );
    labels.insert(
        "app.kubernetes.io/managed-by".to_owned(),
        MANAGED_BY.to_owned(),
    );
    labels.insert(
        "app.kubernetes.io/part-of".to_owned(),
        MANAGED_BY.to_owned(),
    );
    labels
}

/// The label selector that finds every child of one relay (to delete the ones no longer
/// built); ownership is then confirmed through the controller owner reference.
pub fn children_selector(relay: &impl RelayRef) -> String {
    format!(
        "app.kubernetes.io/managed-by={MANAGED_BY},app.kubernetes.io/instance={}",
        relay.relay_name()
    )
}

/// The owner reference (controller=true) that ties a child to its relay, so that garbage
/// collection removes it with the relay and `.owns()` maps its events back.
pub fn owner_reference(relay: &impl RelayRef) -> OwnerReference {
    // Without a uid (`render`, offline) the reference is still rendered, with an empty
    // uid, so the output shows it.
    OwnerReference {
        api_version: OutboxRelay::api_version(&()).into_owned(),
        kind: OutboxRelay::kind(&()).into_owned(),
        name: relay.relay_name().to_owned(),
        uid: relay.relay_uid().unwrap_or_default().to_owned(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// Whether `have` (an object as the API server returns it) holds every field of `want`
/// with the same value: objects key by key (the server adds defaults, other managers
/// their fields), lists element by element in the same order and of the same length
/// (an element added, removed or moved is drift: the operator's lists are its own),
/// numbers by value. An empty or null wanted value is held by an absent one, as the
/// server drops those.
pub fn holds(have: &serde_json::Value, want: &serde_json::Value) -> bool {
    use serde_json::Value;
    let empty = |v: &Value| match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    };
    match (want, have) {
        (Value::Object(w), Value::Object(h)) => w.iter().all(|(k, wv)| match h.get(k) {
            Some(hv) => holds(hv, wv),
            None => empty(wv),
        }),
        (Value::Array(w), Value::Array(h)) => {
            w.len() == h.len() && w.iter().zip(h).all(|(wv, hv)| holds(hv, wv))
        }
        (Value::Number(w), Value::Number(h)) => w.as_f64() == h.as_f64(),
        (w, h) if empty(w) => empty(h),
        (w, h) => w == h,
    }
}

/// Metadata of a child: name, namespace, labels and the owner reference.
pub fn child_meta(relay: &impl RelayRef, name: String, component: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(namespace(relay)),
        labels: Some(labels(relay, component)),
        owner_references: Some(vec![owner_reference(relay)]),
        ..ObjectMeta::default()
    }
}

/// The relay's namespace; `default` for a manifest without one, as kubectl would do.
pub fn namespace(relay: &impl RelayRef) -> String {
    relay.relay_namespace()
}

/// The relay a child object belongs to: an `OutboxRelay` as read, or one parsed.
pub trait RelayRef {
    /// `metadata.name`.
    fn relay_name(&self) -> &str;
    /// `metadata.namespace`; `default` for a manifest without one, as kubectl would do.
    fn relay_namespace(&self) -> String;
    /// `metadata.uid` (none offline).
    fn relay_uid(&self) -> Option<&str>;
}

impl RelayRef for OutboxRelay {
    fn relay_name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }
    fn relay_namespace(&self) -> String {
        self.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned())
    }
    fn relay_uid(&self) -> Option<&str> {
        self.metadata.uid.as_deref()
    }
}

impl RelayRef for ValidRelay {
    fn relay_name(&self) -> &str {
        &self.name
    }
    fn relay_namespace(&self) -> String {
        self.namespace.clone()
    }
    fn relay_uid(&self) -> Option<&str> {
        self.uid()
    }
}

#[cfg(test)]
mod tests;
