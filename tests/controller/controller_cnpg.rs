//! `spec.database.databaseRef` to a CloudNativePG `Cluster`: the real Cluster CRD of
//! CloudNativePG (from its Go module, installed in the rig's API server), a Cluster
//! object, and the Secrets and `-rw` Service CloudNativePG would make, pointed at the
//! rig's PostgreSQL (no CloudNativePG operator runs: the test plays its part). The
//! operator connects with the cluster's app Secret over TLS verified against the
//! cluster's CA Secret, creates the slot, and gives the relay pods the same Secrets; a
//! missing Cluster, a missing Service, a `wal_level = replica` Cluster and a Cluster
//! bootstrapped from a Secret of its own each get their reason.

use std::time::Duration;

use crate::common::{self, operator};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::ControllerArgs;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// Installs CloudNativePG's own Cluster CRD (the rig copies it from the project's Go
/// module) and waits until it is served.
async fn install_cnpg_crd(client: &kube::Client) {
    let path = common::Rig::load().get("OUTBOX_RIG_CNPG_CRD").to_owned();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("reading the CloudNativePG CRD {path}: {e} (run make provision)")
    });
    let crd: CustomResourceDefinition =
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    common::apply_crd(client, &crd, "CloudNativePG's Cluster CRD").await;
}

async fn slot_exists(client: &tokio_postgres::Client, slot: &str) -> bool {
    client
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .is_some()
}

fn clusters(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("postgresql.cnpg.io", "v1", "Cluster"),
        "clusters",
    );
    Api::namespaced_with(client.clone(), ns, &resource)
}

/// A Cluster object as a user writes it (validated by CloudNativePG's CRD schema).
async fn create_cluster(client: &kube::Client, ns: &str, name: &str, spec: serde_json::Value) {
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "postgresql.cnpg.io/v1",
        "kind": "Cluster",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }))
    .unwrap();
    clusters(client, ns)
        .patch(
            name,
            &PatchParams::apply("cnpg-test").force(),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("the API server refused Cluster {name}: {e}"));
}

/// The `-rw` Service CloudNativePG makes for a cluster.
async fn create_rw_service(client: &kube::Client, ns: &str, cluster: &str) {
    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": format!("{cluster}-rw"), "namespace": ns},
        "spec": {"ports": [{"name": "postgres", "port": 5432, "targetPort": 5432}],
                 "selector": {"cnpg.io/cluster": cluster, "cnpg.io/instanceRole": "primary"}},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), ns)
        .patch(
            &format!("{cluster}-rw"),
            &PatchParams::apply("cnpg-test").force(),
            &Patch::Apply(&service),
        )
        .await
        .unwrap();
}

fn relay(name: &str, database_ref: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"databaseRef": database_ref},
            "mode": {"logTailing": {}},
            "broker": {"nats": {"url": "nats://nats:4222"}},
            "replicas": 1
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloudnativepg_cluster_is_reached_through_its_secrets_and_checked() {
    let rig = common::Rig::load();
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    install_cnpg_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    // The cluster's application user, as CloudNativePG would create it (here with the
    // replication privilege log tailing needs, which CloudNativePG grants through a
    // managed role).
    let user = format!("app_{}", common::unique_suffix());
    db.client
        .batch_execute(&format!(
            "SET password_encryption = 'scram-sha-256';
             CREATE ROLE {user} LOGIN REPLICATION PASSWORD 'pw-Cnpg_7';
             GRANT SELECT, UPDATE, DELETE ON public.outbox TO {user};
             GRANT CREATE ON DATABASE {} TO {user};
             ALTER TABLE public.outbox OWNER TO {user};",
            db.name
        ))
        .await
        .unwrap();
    let parsed: tokio_postgres::Config = db.url.parse().unwrap();
    let port = parsed.get_ports()[0];
    // CloudNativePG's uri names the -rw Service; here the rig's server, by the name
    // its certificate carries.
    let uri = format!("postgresql://{user}:pw-Cnpg_7@localhost:{port}/{}", db.name);
    let ca = std::fs::read_to_string(rig.get("OUTBOX_RIG_PG_CA")).unwrap();
    let port_text = port.to_string();
    let app = [
        ("username", user.as_str()),
        ("password", "pw-Cnpg_7"),
        ("dbname", db.name.as_str()),
        ("host", "orders-rw"),
        ("port", port_text.as_str()),
        ("uri", uri.as_str()),
    ];
    operator::create_secret(&client, &ns, "orders-app", &app).await;
    operator::create_secret(&client, &ns, "orders-ca", &[("ca.crt", ca.as_str())]).await;
    operator::create_secret(&client, &ns, "owned-owner", &app).await;
    operator::create_secret(&client, &ns, "owned-ca-own", &[("ca.crt", ca.as_str())]).await;
    create_cluster(
        &client,
        &ns,
        "orders",
        json!({"instances": 3, "storage": {"size": "1Gi"},
               "replicationSlots": {"highAvailability": {"synchronizeLogicalDecoding": true}},
               "postgresql": {"parameters": {"hot_standby_feedback": "on", "sync_replication_slots": "on"}}}),
    )
    .await;
    create_rw_service(&client, &ns, "orders").await;
    create_cluster(
        &client,
        &ns,
        "replica",
        json!({"instances": 1, "storage": {"size": "1Gi"},
               "postgresql": {"parameters": {"wal_level": "replica"}}}),
    )
    .await;
    create_rw_service(&client, &ns, "replica").await;
    create_cluster(
        &client,
        &ns,
        "owned",
        json!({"instances": 1, "storage": {"size": "1Gi"},
               "bootstrap": {"initdb": {"database": "app", "owner": "app",
                                        "secret": {"name": "owned-owner"}}},
               "certificates": {"serverCASecret": "owned-ca-own"}}),
    )
    .await;
    create_rw_service(&client, &ns, "owned").await;
    create_cluster(
        &client,
        &ns,
        "unserved",
        json!({"instances": 1, "storage": {"size": "1Gi"}}),
    )
    .await;

    let mut args = ControllerArgs::for_namespace(&ns);
    args.identity = Some("cnpg-test".to_owned());
    args.lease_name = "outbox-operator-cnpg-test".to_owned();
    args.status_interval_seconds = 1;
    let running = operator::InProcess::start(&client, args);
    let api: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    for (name, manifest) in [
        ("orders", relay("orders", json!({"name": "orders"}))),
        ("missing", relay("missing", json!({"name": "nowhere"}))),
        ("replica", relay("replica", json!({"name": "replica"}))),
        ("unserved", relay("unserved", json!({"name": "unserved"}))),
        (
            "owned-default",
            relay("owned-default", json!({"name": "owned"})),
        ),
    ] {
        api.patch(
            name,
            &PatchParams::apply("cnpg-test"),
            &Patch::Apply(&manifest),
        )
        .await
        .unwrap();
    }

    // The cluster that is set up: checked over verified TLS as its app user, slot made.
    let slot = outbox_operator::relay::config::default_slot_name(&ns, "orders");
    let ready = common::wait_for_some("orders: DatabaseReady and SlotReady", WAIT, || async {
        let r = api.get_opt("orders").await.ok().flatten()?;
        let database = operator::condition(&r, "DatabaseReady").filter(|c| c.status == "True")?;
        operator::condition(&r, "SlotReady").filter(|c| c.status == "True")?;
        Some(database)
    })
    .await;
    assert!(ready.message.contains(&user), "{}", ready.message);
    assert!(
        !ready.message.contains("pw-Cnpg_7"),
        "a password in status: {}",
        ready.message
    );
    assert!(
        slot_exists(&db.client, &slot).await,
        "slot {slot} was not created"
    );
    let encrypted: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = $1 AND s.ssl AND a.application_name = 'outbox-operator'",
            &[&user],
        )
        .await
        .unwrap()
        .get(0);
    assert!(encrypted >= 1, "no encrypted operator session as {user}");
    // The relay pods read the same Secrets: the uri from the app Secret, the CA mounted.
    let deployment = common::wait_for_some("orders-relay Deployment", WAIT, || async {
        Api::<Deployment>::namespaced(client.clone(), &ns)
            .get_opt("orders-relay")
            .await
            .ok()
            .flatten()
    })
    .await;
    let value = serde_json::to_value(&deployment).unwrap();
    let url = value
        .pointer("/spec/template/spec/containers/0/env")
        .and_then(|e| e.as_array())
        .and_then(|e| e.iter().find(|v| v["name"] == "OUTBOX_DATABASE_URL"))
        .and_then(|v| v.pointer("/valueFrom/secretKeyRef"))
        .cloned();
    assert_eq!(
        url.as_ref().map(|r| (r["name"].clone(), r["key"].clone())),
        Some((json!("orders-app"), json!("uri"))),
        "the relay's URL does not come from orders-app/uri"
    );
    let text = value.to_string();
    assert!(
        text.contains("orders-ca"),
        "the cluster's CA is not mounted: {text}"
    );

    // Each cluster that cannot be used, with its reason.
    for (name, reason, says) in [
        ("missing", "ClusterNotFound", "nowhere"),
        ("replica", "ClusterWalLevel", "wal_level = replica"),
        ("unserved", "ClusterServiceMissing", "unserved-rw"),
        (
            "owned-default",
            "ClusterSecretMismatch",
            "secretName: owned-owner",
        ),
    ] {
        let cond = common::wait_for_some(&format!("{name}: DatabaseReady=False"), WAIT, || async {
            let r = api.get_opt(name).await.ok().flatten()?;
            operator::condition(&r, "DatabaseReady").filter(|c| c.status == "False")
        })
        .await;
        assert_eq!(cond.reason, reason, "{name}: {cond:?}");
        assert!(cond.message.contains(says), "{name}: {}", cond.message);
    }
    // Named as the Cluster says: accepted (the rig's server over its own CA).
    let mut owned = relay(
        "owned",
        json!({"name": "owned", "secretName": "owned-owner", "caSecretName": "owned-ca-own"}),
    );
    owned["spec"]["mode"] = json!({"polling": {}});
    api.patch(
        "owned",
        &PatchParams::apply("cnpg-test"),
        &Patch::Apply(&owned),
    )
    .await
    .unwrap();
    common::wait_for_some("owned: DatabaseReady=True", WAIT, || async {
        let r = api.get_opt("owned").await.ok().flatten()?;
        operator::condition(&r, "DatabaseReady").filter(|c| c.status == "True")
    })
    .await;

    // A managed role's basic-auth Secret: the relay logs in from parts (the -rw
    // Service, the database, the Secret's username and password). The Service's name
    // does not resolve outside a cluster, so here the operator reports the connection
    // failure (and never the password), and the login the relay composes is checked
    // against the real server under the name its certificate carries.
    let role = format!("relay_{}", common::unique_suffix());
    let password = "p@ss:w/rd% 'x'?#";
    db.client
        .batch_execute(&format!(
            "SET password_encryption = 'scram-sha-256';
             CREATE ROLE {role} LOGIN REPLICATION PASSWORD '{}';
             GRANT SELECT, UPDATE, DELETE ON public.outbox TO {role};",
            password.replace('\'', "''")
        ))
        .await
        .unwrap();
    operator::create_secret(
        &client,
        &ns,
        "relay-role",
        &[("username", role.as_str()), ("password", password)],
    )
    .await;
    let mut by_role = relay(
        "by-role",
        json!({"name": "orders", "userSecretName": "relay-role", "database": db.name}),
    );
    by_role["spec"]["mode"] = json!({"polling": {}});
    api.patch(
        "by-role",
        &PatchParams::apply("cnpg-test"),
        &Patch::Apply(&by_role),
    )
    .await
    .unwrap();
    let failed = common::wait_for_some("by-role: DatabaseReady=False", WAIT, || async {
        let r = api.get_opt("by-role").await.ok().flatten()?;
        operator::condition(&r, "DatabaseReady").filter(|c| c.status == "False")
    })
    .await;
    assert_eq!(failed.reason, "ConnectionFailed", "{failed:?}");
    assert!(
        failed.message.contains("relay-role")
            && !failed.message.contains("w/rd")
            && !failed.message.contains("w%2Frd"),
        "{}",
        failed.message
    );
    let reference: outbox_operator::api::DatabaseRef =
        serde_json::from_value(by_role["spec"]["database"]["databaseRef"].clone()).unwrap();
    let login = outbox_operator::api::Login {
        host: "localhost".to_owned(),
        ..reference.login(&ns).unwrap()
    };
    let login = outbox_operator::api::Login { port, ..login };
    let tls = outbox_operator::postgres::tls::PgTls {
        mode: outbox_operator::api::SslMode::VerifyFull,
        ca_pem: Some(ca.clone()),
        client: None,
    };
    let session = outbox_operator::postgres::connect(&login.url(&role, password), "test", &tls)
        .await
        .unwrap_or_else(|e| panic!("logging in from parts as {role} failed: {e}"));
    let who: String = session
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, role);

    // Deleting the relay drops its slot, through the cluster's Secrets.
    operator::delete_relays(&client, &ns, WAIT).await;
    assert!(
        !slot_exists(&db.client, &slot).await,
        "slot {slot} left behind"
    );
    let _ = running.stop(WAIT).await;
    for name in ["orders", "replica", "owned", "unserved"] {
        let _ = clusters(&client, &ns)
            .delete(name, &Default::default())
            .await;
    }
    common::delete_namespace(&client, &ns).await;
    db.drop_database().await;
    let _ = common::pg_admin()
        .await
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {role}; DROP ROLE IF EXISTS {user}"
        ))
        .await;
}
