//! `helm install` of the chart creates the operator's objects on the real API server,
//! `helm uninstall` removes them and keeps the CRD, and the operator's ServiceAccount
//! may do exactly what the controller needs: everything it does, in the namespaces it
//! watches, and nothing more.

use crate::chart_common;
use crate::common;

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use chart_common::{
    Access, CRD_NAME, ServiceAccountIdentity, cluster_name, crd_read_accesses, forbidden_accesses,
    fullname, install, install_from, lease_accesses, uninstall, uninstall_quietly,
    watched_namespace_accesses, with_namespaces,
};
use futures::FutureExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

/// RBAC changes reach the authorizer's cache shortly after they are written.
const RBAC_PROPAGATION: Duration = Duration::from_secs(30);

/// Installs `release`, runs `body`, and uninstalls also when `body` panics.
async fn with_release<Fut>(release: &str, namespace: &str, args: &[&str], body: Fut)
where
    Fut: std::future::Future<Output = ()>,
{
    install(release, namespace, args);
    let outcome = AssertUnwindSafe(body).catch_unwind().await;
    uninstall_quietly(release, namespace);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

fn is_established(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conds| {
            conds
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

/// The one test that lets Helm install a CRD from the chart's `crds/` folder (the
/// others pass `--skip-crds`).
///
/// `outboxrelays.outbox.dev` itself is cluster-wide and shared with every other test
/// on the rig: this test must neither change it (Helm 4 server-side applies `crds/`,
/// so an older or newer schema from another branch's tests conflicts or gets
/// overwritten) nor delete it (that deletes every OutboxRelay in the cluster). So it
/// installs a copy of the chart whose CRD is the shipped one under a group of its
/// own: a CRD that certainly did not exist before, which Helm must create, the API
/// server must accept with the shipped schema, and `helm uninstall` must leave behind.
#[tokio::test]
async fn install_creates_the_operator_and_uninstall_removes_it_but_keeps_the_crd() {
    with_namespaces(1, |client, namespaces| async move {
        let namespace = namespaces[0].as_str();
        let release = chart_common::fresh_release();
        let name = fullname(&release);
        let cluster = cluster_name(namespace, &release);

        let dir = tempfile::tempdir().unwrap();
        let chart = chart_common::copy_chart(dir.path());
        let crd_file = chart.join("crds/outboxrelay.yaml");
        let mut crd: serde_json::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&crd_file).unwrap()).unwrap();
        assert_eq!(crd["metadata"]["name"], CRD_NAME);
        let group = format!("c{}.test.outbox.dev", common::unique_suffix());
        let crd_name = format!("outboxrelays.{group}");
        crd["metadata"]["name"] = crd_name.clone().into();
        crd["spec"]["group"] = group.clone().into();
        std::fs::write(&crd_file, serde_yaml::to_string(&crd).unwrap()).unwrap();
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        assert!(crds.get_opt(&crd_name).await.unwrap().is_none());

        let outcome = AssertUnwindSafe(async {
            install_from(&chart, &release, namespace, &[]);
            common::wait_for(
                "the chart's CRD to be Established",
                Duration::from_secs(30),
                || async {
                    crds.get_opt(&crd_name)
                        .await
                        .ok()
                        .flatten()
                        .is_some_and(|crd| is_established(&crd))
                },
            )
            .await;

            let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
            let deployment = deployments
                .get(&name)
                .await
                .expect("the operator Deployment");
            let pod = deployment.spec.unwrap().template.spec.unwrap();
            assert_eq!(pod.service_account_name.as_deref(), Some(name.as_str()));
            Api::<ServiceAccount>::namespaced(client.clone(), namespace)
                .get(&name)
                .await
                .expect("the ServiceAccount");
            Api::<Service>::namespaced(client.clone(), namespace)
                .get(&format!("{name}-metrics"))
                .await
                .expect("the metrics Service");
            Api::<ClusterRole>::all(client.clone())
                .get(&cluster)
                .await
                .expect("the ClusterRole");
            Api::<ClusterRoleBinding>::all(client.clone())
                .get(&cluster)
                .await
                .expect("the ClusterRoleBinding");
            let lease_role = format!("{name}-leader-election");
            Api::<Role>::namespaced(client.clone(), namespace)
                .get(&lease_role)
                .await
                .expect("the Lease Role");
            Api::<RoleBinding>::namespaced(client.clone(), namespace)
                .get(&lease_role)
                .await
                .expect("the Lease RoleBinding");

            uninstall(&release, namespace);
            common::wait_for(
                "helm uninstall to remove the operator's objects",
                Duration::from_secs(60),
                || async {
                    let gone = |found: Result<Option<()>, kube::Error>| matches!(found, Ok(None));
                    gone(
                        Api::<Deployment>::namespaced(client.clone(), namespace)
                            .get_opt(&name)
                            .await
                            .map(|o| o.map(drop)),
                    ) && gone(
                        Api::<ServiceAccount>::namespaced(client.clone(), namespace)
                            .get_opt(&name)
                            .await
                            .map(|o| o.map(drop)),
                    ) && gone(
                        Api::<Service>::namespaced(client.clone(), namespace)
                            .get_opt(&format!("{name}-metrics"))
                            .await
                            .map(|o| o.map(drop)),
                    ) && gone(
                        Api::<ClusterRole>::all(client.clone())
                            .get_opt(&cluster)
                            .await
                            .map(|o| o.map(drop)),
                    ) && gone(
                        Api::<ClusterRoleBinding>::all(client.clone())
                            .get_opt(&cluster)
                            .await
                            .map(|o| o.map(drop)),
                    ) && gone(
                        Api::<Role>::namespaced(client.clone(), namespace)
                            .get_opt(&lease_role)
                            .await
                            .map(|o| o.map(drop)),
                    ) && gone(
                        Api::<RoleBinding>::namespaced(client.clone(), namespace)
                            .get_opt(&lease_role)
                            .await
                            .map(|o| o.map(drop)),
                    )
                },
            )
            .await;
            let kept = crds.get_opt(&crd_name).await.unwrap();
            assert!(
                kept.is_some_and(|crd| crd.metadata.deletion_timestamp.is_none()),
                "helm uninstall removed the chart's CRD"
            );
        })
        .catch_unwind()
        .await;
        uninstall_quietly(&release, namespace);
        // This CRD belongs to this test alone.
        let _ = crds.delete(&crd_name, &DeleteParams::default()).await;
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    })
    .await;
}

/// Asserts `identity` may make every request in `allowed` and none in `denied`,
/// listing every mismatch at once.
async fn assert_access(
    client: &kube::Client,
    identity: &ServiceAccountIdentity,
    allowed: &[Access<'_>],
    denied: &[Access<'_>],
) {
    let missing = identity.denied(client, allowed).await;
    let excess = identity.allowed(client, denied).await;
    let show = |list: &[&Access<'_>]| list.iter().map(|a| format!("\n  {a}")).collect::<String>();
    assert!(
        missing.is_empty() && excess.is_empty(),
        "{} RBAC is wrong.\nmissing:{}\nexcess:{}",
        identity.user(),
        show(&missing),
        show(&excess)
    );
}

#[tokio::test]
async fn cluster_wide_rbac_allows_what_the_controller_does_and_nothing_more() {
    with_namespaces(2, |client, namespaces| async move {
        let (operator_ns, app_ns) = (namespaces[0].as_str(), namespaces[1].as_str());
        let release = chart_common::fresh_release();
        with_release(&release, operator_ns, &["--skip-crds"], async {
            let identity = ServiceAccountIdentity::new(operator_ns, &fullname(&release));
            let probe = Access::new("list", "outbox.dev", "outboxrelays");
            identity
                .wait_until_allowed(&client, &probe, RBAC_PROPAGATION)
                .await;
            identity
                .wait_until_allowed(&client, &lease_accesses(operator_ns)[0], RBAC_PROPAGATION)
                .await;

            let mut allowed = watched_namespace_accesses(app_ns);
            allowed.extend(lease_accesses(operator_ns));
            allowed.extend(crd_read_accesses());
            // All namespaces: the controller lists and watches across the cluster.
            allowed.push(probe);
            let mut denied = forbidden_accesses(app_ns);
            // Secrets are read by name only: never listed or watched across the cluster.
            denied.push(Access::new("list", "", "secrets"));
            denied.push(Access::new("watch", "", "secrets"));
            // The Lease is confined to the operator's namespace.
            denied.extend(lease_accesses(app_ns));
            assert_access(&client, &identity, &allowed, &denied).await;

            // The same answers for real requests made with the account's own token.
            let operator = identity.client(&client).await;
            let secrets: Api<Secret> = Api::namespaced(operator.clone(), app_ns);
            let err = secrets
                .list(&ListParams::default())
                .await
                .expect_err("the operator could list Secrets");
            assert!(
                matches!(&err, kube::Error::Api(s) if s.code == 403),
                "{err}"
            );
            let err = secrets
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(serde_json::json!({"metadata": {"name": "nope"}}))
                        .unwrap(),
                )
                .await
                .expect_err("the operator could create a Secret");
            assert!(
                matches!(&err, kube::Error::Api(s) if s.code == 403),
                "{err}"
            );
        })
        .await;
    })
    .await;
}

#[tokio::test]
async fn one_namespace_rbac_is_confined_to_the_watched_namespace() {
    with_namespaces(3, |client, namespaces| async move {
        let (operator_ns, watched_ns, other_ns) = (
            namespaces[0].as_str(),
            namespaces[1].as_str(),
            namespaces[2].as_str(),
        );
        let release = chart_common::fresh_release();
        let watch = format!("watchNamespace={watched_ns}");
        with_release(
            &release,
            operator_ns,
            &["--skip-crds", "--set", &watch],
            async {
                let identity = ServiceAccountIdentity::new(operator_ns, &fullname(&release));
                let probe =
                    Access::new("list", "outbox.dev", "outboxrelays").in_namespace(watched_ns);
                identity
                    .wait_until_allowed(&client, &probe, RBAC_PROPAGATION)
                    .await;
                identity
                    .wait_until_allowed(&client, &lease_accesses(operator_ns)[0], RBAC_PROPAGATION)
                    .await;
                identity
                    .wait_until_allowed(&client, &crd_read_accesses()[0], RBAC_PROPAGATION)
                    .await;

                let mut allowed = watched_namespace_accesses(watched_ns);
                allowed.extend(lease_accesses(operator_ns));
                allowed.extend(crd_read_accesses());
                let mut denied = forbidden_accesses(watched_ns);
                // Nothing in any other namespace, and nothing across all namespaces.
                denied.extend(watched_namespace_accesses(other_ns));
                denied.extend(
                    watched_namespace_accesses(operator_ns)
                        .into_iter()
                        .filter(|a| a.resource == "secrets"),
                );
                denied.push(Access::new("list", "outbox.dev", "outboxrelays"));
                denied.push(Access::new("list", "", "secrets"));
                denied.extend(lease_accesses(watched_ns));
                assert_access(&client, &identity, &allowed, &denied).await;

                // Real requests with the account's own token.
                let admin_secrets: Api<Secret> = Api::namespaced(client.clone(), other_ns);
                let secret: Secret = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": "db"}, "stringData": {"uri": "postgres://x"}
                }))
                .unwrap();
                admin_secrets
                    .create(&PostParams::default(), &secret)
                    .await
                    .unwrap();
                Api::<Secret>::namespaced(client.clone(), watched_ns)
                    .create(&PostParams::default(), &secret)
                    .await
                    .unwrap();
                let operator = identity.client(&client).await;
                Api::<Secret>::namespaced(operator.clone(), watched_ns)
                    .get("db")
                    .await
                    .expect("the operator can read a Secret in its namespace");
                let err = Api::<Secret>::namespaced(operator.clone(), other_ns)
                    .get("db")
                    .await
                    .expect_err("the operator read a Secret in another namespace");
                assert!(
                    matches!(&err, kube::Error::Api(s) if s.code == 403),
                    "{err}"
                );
                let _ = admin_secrets.delete("db", &DeleteParams::default()).await;
            },
        )
        .await;
    })
    .await;
}
