//! Test support for the Helm chart: render, lint, install and uninstall
//! `charts/outbox-operator` with the rig's real `helm` and `kubectl`, and ask the real
//! API server what the chart's ServiceAccount may do.
//!
//! Every helper takes the release name and namespace from the caller, so tests running
//! in parallel never share a release. Installs skip the CRDs unless asked: the CRD is
//! cluster-wide and other tests on the same rig may rely on it.

// Compiled only into tests/packaging, which need not use every helper.
#![allow(dead_code)]

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};

use crate::common::{self, Rig};

/// Name of the CRD the chart ships in its `crds/` folder.
pub const CRD_NAME: &str = "outboxrelays.outbox.dev";
/// The chart's name, which is also the default suffix of every object name.
pub const CHART_NAME: &str = "outbox-operator";

/// `charts/outbox-operator` in this checkout.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/outbox-operator")
}

/// A fresh release name, `obr-<random>`: distinct per test, so parallel tests never
/// collide on cluster-scoped names either.
pub fn fresh_release() -> String {
    format!("obr-{}", common::unique_suffix())
}

/// The object-name prefix the chart gives a release (`<release>-outbox-operator`).
pub fn fullname(release: &str) -> String {
    format!("{release}-{CHART_NAME}")
}

/// The name the chart gives cluster-scoped objects of a release.
pub fn cluster_name(namespace: &str, release: &str) -> String {
    format!("{namespace}-{}", fullname(release))
}

/// Runs `helm` with the rig's kubeconfig; returns the output without judging it.
pub fn helm(args: &[&str]) -> std::process::Output {
    let rig = Rig::load();
    let kubeconfig = rig.kubeconfig().to_str().expect("kubeconfig path is UTF-8");
    let mut all = vec!["--kubeconfig", kubeconfig];
    all.extend_from_slice(args);
    common::run_tool(rig.helm(), &all)
}

/// Runs `kubectl` with the rig's kubeconfig; returns the output without judging it.
pub fn kubectl(args: &[&str]) -> std::process::Output {
    let rig = Rig::load();
    let kubeconfig = rig.kubeconfig().to_str().expect("kubeconfig path is UTF-8");
    let mut all = vec!["--kubeconfig", kubeconfig];
    all.extend_from_slice(args);
    common::run_tool(rig.kubectl(), &all)
}

/// Panics with the tool's whole output unless it succeeded; returns its stdout.
pub fn expect_success(what: &str, output: std::process::Output) -> String {
    assert!(
        output.status.success(),
        "{what} failed:\n{}",
        common::describe_output(&output)
    );
    String::from_utf8(output.stdout).expect("tool output is UTF-8")
}

/// `helm template` of the chart for `release` in `namespace` with extra `args`
/// (`--set ...`, `-f ...`, `--include-crds`). Panics when rendering fails.
pub fn template(release: &str, namespace: &str, args: &[&str]) -> String {
    let chart = chart_dir();
    let mut all = vec![
        "template",
        release,
        chart.to_str().expect("chart path is UTF-8"),
        "--namespace",
        namespace,
    ];
    all.extend_from_slice(args);
    expect_success(&format!("helm template {args:?}"), helm(&all))
}

/// Every document of a multi-document YAML stream that is not empty.
pub fn documents(manifest: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(manifest)
        .map(|doc| serde_yaml::Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|doc| !doc.is_null())
        .map(|doc| serde_json::to_value(doc).expect("rendered YAML is JSON-compatible"))
        .collect()
}

/// The `(kind, name)` of every document, for assertions about what a render contains.
pub fn kinds_and_names(manifest: &str) -> Vec<(String, String)> {
    documents(manifest)
        .iter()
        .map(|doc| {
            (
                doc["kind"].as_str().unwrap_or_default().to_string(),
                doc["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

/// `kubectl apply --dry-run=server` of `manifest`: the real API server admits (or
/// rejects) every object, with strict field validation, and stores nothing.
pub fn apply_dry_run_server(manifest: &str) -> std::process::Output {
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temporary manifest file");
    std::fs::write(file.path(), manifest).expect("write temporary manifest");
    kubectl(&[
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "-f",
        file.path().to_str().expect("temp path is UTF-8"),
    ])
}

/// `helm install` of the chart (no `--wait`: the operator's pods do not tolerate the rig
/// node's taint, so they stay Pending).
pub fn install(release: &str, namespace: &str, args: &[&str]) {
    install_from(&chart_dir(), release, namespace, args);
}

/// `helm install` of the chart found at `chart` (a modified copy, say).
pub fn install_from(chart: &Path, release: &str, namespace: &str, args: &[&str]) {
    let mut all = vec![
        "install",
        release,
        chart.to_str().expect("chart path is UTF-8"),
        "--namespace",
        namespace,
        "--timeout",
        "60s",
    ];
    all.extend_from_slice(args);
    expect_success(&format!("helm install {release} {args:?}"), helm(&all));
}

/// A copy of the chart in `into`, for tests that must change it.
pub fn copy_chart(into: &Path) -> PathBuf {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).expect("create chart copy folder");
        for entry in std::fs::read_dir(from).expect("read chart folder") {
            let entry = entry.expect("chart folder entry");
            let target = to.join(entry.file_name());
            if entry.file_type().expect("file type").is_dir() {
                copy(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), &target).expect("copy chart file");
            }
        }
    }
    let target = into.join(CHART_NAME);
    copy(&chart_dir(), &target);
    target
}

/// `helm uninstall` (waits until Helm has deleted what it installed).
pub fn uninstall(release: &str, namespace: &str) {
    expect_success(
        &format!("helm uninstall {release}"),
        helm(&[
            "uninstall",
            release,
            "--namespace",
            namespace,
            "--wait",
            "--timeout",
            "60s",
        ]),
    );
}

/// Best-effort uninstall for cleanup after a failed assertion.
pub fn uninstall_quietly(release: &str, namespace: &str) {
    let _ = helm(&["uninstall", release, "--namespace", namespace]);
}

/// The CRD, if it exists.
pub async fn get_crd(client: &kube::Client) -> Option<CustomResourceDefinition> {
    Api::<CustomResourceDefinition>::all(client.clone())
        .get_opt(CRD_NAME)
        .await
        .unwrap_or_else(|err| panic!("Kubernetes: reading CRD {CRD_NAME} failed: {err}"))
}

/// Runs `body` with a client and `count` fresh namespaces, deleting the namespaces
/// afterwards also when `body` panics.
pub async fn with_namespaces<F, Fut>(count: usize, body: F)
where
    F: FnOnce(kube::Client, Vec<String>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let client = common::kube_client().await;
    let mut namespaces = Vec::new();
    for _ in 0..count {
        namespaces.push(common::fresh_namespace(&client).await);
    }
    let outcome = AssertUnwindSafe(body(client.clone(), namespaces.clone()))
        .catch_unwind()
        .await;
    for namespace in &namespaces {
        common::delete_namespace(&client, namespace).await;
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

// ---------------------------------------------------------------------------------------
// The operator's identity

/// A ServiceAccount, as the API server sees it when a pod runs under it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccountIdentity {
    pub namespace: String,
    pub name: String,
}

/// One request a subject may or may not be allowed to make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access<'a> {
    pub verb: &'a str,
    /// API group; `""` for the core group.
    pub group: &'a str,
    pub resource: &'a str,
    pub subresource: Option<&'a str>,
    /// `None` for cluster-scoped resources, or a request across all namespaces.
    pub namespace: Option<&'a str>,
}

impl<'a> Access<'a> {
    pub fn new(verb: &'a str, group: &'a str, resource: &'a str) -> Self {
        let (resource, subresource) = match resource.split_once('/') {
            Some((resource, sub)) => (resource, Some(sub)),
            None => (resource, None),
        };
        Access {
            verb,
            group,
            resource,
            subresource,
            namespace: None,
        }
    }

    pub fn in_namespace(mut self, namespace: &'a str) -> Self {
        self.namespace = Some(namespace);
        self
    }
}

impl std::fmt::Display for Access<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            self.group
        };
        write!(f, "{} {group}/{}", self.verb, self.resource)?;
        if let Some(sub) = self.subresource {
            write!(f, "/{sub}")?;
        }
        match self.namespace {
            Some(ns) => write!(f, " in namespace {ns}"),
            None => write!(f, " cluster-wide"),
        }
    }
}

impl ServiceAccountIdentity {
    pub fn new(namespace: &str, name: &str) -> Self {
        ServiceAccountIdentity {
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }

    /// The user name the API server authenticates a token of this account as.
    pub fn user(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }

    /// The groups every token of this account carries.
    pub fn groups(&self) -> Vec<String> {
        vec![
            "system:serviceaccounts".to_string(),
            format!("system:serviceaccounts:{}", self.namespace),
            "system:authenticated".to_string(),
        ]
    }

    /// Asks the API server's authorizer (a SubjectAccessReview) whether this account
    /// may make `access`.
    pub async fn can(&self, client: &kube::Client, access: &Access<'_>) -> bool {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(self.user()),
                groups: Some(self.groups()),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(access.verb.to_string()),
                    group: Some(access.group.to_string()),
                    resource: Some(access.resource.to_string()),
                    subresource: access.subresource.map(str::to_string),
                    namespace: access.namespace.map(str::to_string),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = Api::<SubjectAccessReview>::all(client.clone())
            .create(&PostParams::default(), &review)
            .await
            .unwrap_or_else(|err| panic!("SubjectAccessReview for {access} failed: {err}"));
        answer.status.is_some_and(|status| status.allowed)
    }

    /// Waits until the authorizer allows `access` (RBAC objects reach the authorizer's
    /// cache a moment after they are created); panics after `timeout`.
    pub async fn wait_until_allowed(
        &self,
        client: &kube::Client,
        access: &Access<'_>,
        timeout: Duration,
    ) {
        common::wait_for(
            &format!("{} to be allowed to {access}", self.user()),
            timeout,
            || self.can(client, access),
        )
        .await;
    }

    /// Which of `accesses` this account is denied (should be empty) — all checked, so
    /// one failure message lists every gap.
    pub async fn denied<'a>(
        &self,
        client: &kube::Client,
        accesses: &'a [Access<'a>],
    ) -> Vec<&'a Access<'a>> {
        let mut denied = Vec::new();
        for access in accesses {
            if !self.can(client, access).await {
                denied.push(access);
            }
        }
        denied
    }

    /// Which of `accesses` this account is allowed (should be empty).
    pub async fn allowed<'a>(
        &self,
        client: &kube::Client,
        accesses: &'a [Access<'a>],
    ) -> Vec<&'a Access<'a>> {
        let mut allowed = Vec::new();
        for access in accesses {
            if self.can(client, access).await {
                allowed.push(access);
            }
        }
        allowed
    }

    /// A client that authenticates as this account with a short-lived token from the
    /// TokenRequest API: requests made with it are exactly what the operator's pod
    /// could do. `admin` must be allowed to create `serviceaccounts/token`.
    pub async fn client(&self, admin: &kube::Client) -> kube::Client {
        use kube::config::{AuthInfo, KubeConfigOptions, Kubeconfig};

        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(600),
                ..Default::default()
            },
            ..Default::default()
        };
        let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), &self.namespace);
        let issued = accounts
            .create_token_request(&self.name, &PostParams::default(), &request)
            .await
            .unwrap_or_else(|err| panic!("TokenRequest for {} failed: {err}", self.user()));
        let token = issued
            .status
            .map(|status| status.token)
            .unwrap_or_else(|| panic!("TokenRequest for {} returned no token", self.user()));

        let rig = Rig::load();
        let kubeconfig = Kubeconfig::read_from(rig.kubeconfig())
            .unwrap_or_else(|err| panic!("cannot read the rig kubeconfig: {err}"));
        let mut config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .unwrap_or_else(|err| panic!("rig kubeconfig is unusable: {err}"));
        // Keep the cluster (URL, CA); replace who we are.
        config.auth_info =
            serde_json::from_value::<AuthInfo>(serde_json::json!({ "token": token }))
                .expect("an AuthInfo with a token");
        config.connect_timeout = Some(common::CONNECT_TIMEOUT);
        config.read_timeout = Some(Duration::from_secs(60));
        kube::Client::try_from(config)
            .unwrap_or_else(|err| panic!("cannot build a client for {}: {err}", self.user()))
    }
}

/// Everything the controller does in a namespace it watches (DESIGN §3), as the
/// requests the chart's RBAC must allow.
pub fn watched_namespace_accesses(namespace: &str) -> Vec<Access<'_>> {
    let mut accesses = Vec::new();
    for verb in ["get", "list", "watch", "patch", "update"] {
        accesses.push(Access::new(verb, "outbox.dev", "outboxrelays"));
    }
    for verb in ["get", "patch", "update"] {
        accesses.push(Access::new(verb, "outbox.dev", "outboxrelays/status"));
    }
    accesses.push(Access::new(
        "update",
        "outbox.dev",
        "outboxrelays/finalizers",
    ));
    let owned = [
        ("", "configmaps"),
        ("", "services"),
        ("apps", "deployments"),
        ("policy", "poddisruptionbudgets"),
        ("monitoring.coreos.com", "servicemonitors"),
        ("monitoring.coreos.com", "prometheusrules"),
    ];
    for (group, resource) in owned {
        for verb in [
            "get", "list", "watch", "create", "patch", "update", "delete",
        ] {
            accesses.push(Access::new(verb, group, resource));
        }
    }
    // Secrets are read by name only, never listed or watched; patched only for the
    // slot finalizer.
    accesses.push(Access::new("get", "", "secrets"));
    accesses.push(Access::new("patch", "", "secrets"));
    for group in ["events.k8s.io", ""] {
        for verb in ["create", "patch"] {
            accesses.push(Access::new(verb, group, "events"));
        }
    }
    accesses
        .into_iter()
        .map(|access| access.in_namespace(namespace))
        .collect()
}

/// The leader-election Lease requests, in the operator's own namespace.
pub fn lease_accesses(namespace: &str) -> Vec<Access<'_>> {
    ["get", "list", "watch", "create", "update", "patch"]
        .into_iter()
        .map(|verb| Access::new(verb, "coordination.k8s.io", "leases").in_namespace(namespace))
        .collect()
}

/// Cluster-scoped reads: whether the monitoring CRDs exist.
pub fn crd_read_accesses() -> Vec<Access<'static>> {
    ["get", "list", "watch"]
        .into_iter()
        .map(|verb| Access::new(verb, "apiextensions.k8s.io", "customresourcedefinitions"))
        .collect()
}

/// Requests the operator must never be able to make, wherever it runs.
pub fn forbidden_accesses(namespace: &str) -> Vec<Access<'_>> {
    vec![
        Access::new("list", "", "secrets").in_namespace(namespace),
        Access::new("watch", "", "secrets").in_namespace(namespace),
        Access::new("delete", "", "secrets").in_namespace(namespace),
        Access::new("create", "", "secrets").in_namespace(namespace),
        Access::new("update", "", "secrets").in_namespace(namespace),
        Access::new("create", "rbac.authorization.k8s.io", "clusterroles"),
        Access::new("create", "rbac.authorization.k8s.io", "rolebindings").in_namespace(namespace),
        Access::new(
            "create",
            "apiextensions.k8s.io",
            "customresourcedefinitions",
        ),
        Access::new("delete", "outbox.dev", "outboxrelays").in_namespace(namespace),
        Access::new("create", "", "pods").in_namespace(namespace),
        Access::new("create", "", "serviceaccounts/token").in_namespace(namespace),
        Access::new("delete", "coordination.k8s.io", "leases").in_namespace(namespace),
    ]
}
