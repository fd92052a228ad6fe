//! `spec.relay`: what a relay's pods may differ in from the operator's defaults.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, ResourceRequirements, Toleration, TopologySpreadConstraint,
};
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Overrides for the relay pods.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RelayPodSpec {
    /// Relay image; default the operator's own image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// When the kubelet pulls the relay image; default the operator's
    /// `--relay-image-pull-policy` (the chart's `image.pullPolicy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<ImagePullPolicy>,
    /// Secrets of the relay's namespace for pulling its image, besides those the
    /// operator gives every relay (the chart's `relayPods.imagePullSecrets`, by default
    /// its `imagePullSecrets`). Each must exist in the relay's namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Container resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Log filter for the relay (`RUST_LOG` syntax), default `info`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub log_level: Option<String>,
    /// Extra pod labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_labels: BTreeMap<String, String>,
    /// Extra pod annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,
    /// Node selector.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// How the relay's pods spread over nodes or zones. A constraint without a
    /// `labelSelector` counts this relay's pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Priority class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Service account the relay pods run as (they need no Kubernetes API access).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// User id of the relay process. Default: the operator's `--relay-run-as-user`, else
    /// none, so the image's user (65532) runs, or the one the platform assigns
    /// (OpenShift's restricted SCC picks one from the namespace's range).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub run_as_user: Option<i64>,
    /// Group id of the relay process; default as `runAsUser`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub run_as_group: Option<i64>,
    /// Group that owns the mounted config and Secret files; default as `runAsUser`.
    /// With one, those files are readable by that group only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub fs_group: Option<i64>,
}

impl RelayPodSpec {
    pub(super) fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// When the kubelet pulls an image (a container's `imagePullPolicy`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImagePullPolicy {
    /// On every container start.
    Always,
    /// Only when the node lacks the image.
    IfNotPresent,
    /// Never: the image must be on the node already.
    Never,
}

impl ImagePullPolicy {
    /// The name Kubernetes uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Always => "Always",
            Self::IfNotPresent => "IfNotPresent",
            Self::Never => "Never",
        }
    }

    /// Parses the name Kubernetes uses (for the operator's flag).
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "Always" => Ok(Self::Always),
            "IfNotPresent" => Ok(Self::IfNotPresent),
            "Never" => Ok(Self::Never),
            other => Err(format!(
                "{other:?} is not an image pull policy: Always, IfNotPresent or Never"
            )),
        }
    }
}
