//! The operator's own connections to PostgreSQL over TLS: with `verify-full` and the CA
//! from `caSecretRef` its checks pass for a role admitted over TLS only; with a CA that
//! did not sign the server's certificate, `DatabaseReady` says why and nothing is
//! created; with a client certificate (`clientCertSecretRef`) it logs in as the role
//! pg_hba.conf admits by certificate only.

use std::time::Duration;

use crate::common::{self, operator};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, Patch, PatchParams};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::ControllerArgs;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

fn manifest(name: &str, ca_secret: &str) -> serde_json::Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {
                "connectionSecretRef": {"name": "db"},
                "sslMode": "verify-full",
                "caSecretRef": {"name": ca_secret, "key": "ca.crt"}
            }},
            "mode": {"polling": {}},
            "broker": {"nats": {"url": "nats://nats:4222"}},
            "replicas": 1
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_checks_the_database_over_verified_tls() {
    let rig = common::Rig::load();
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let user = format!("operator_tls_{}", common::unique_suffix());
    db.client
        .batch_execute(&format!(
            "DO $$ BEGIN CREATE ROLE outbox_tls_users NOLOGIN; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;
             SET password_encryption = 'scram-sha-256';
             CREATE ROLE {user} LOGIN PASSWORD 'pw-Tls_9' IN ROLE outbox_tls_users;
             GRANT SELECT, UPDATE, DELETE ON public.outbox TO {user};"
        ))
        .await
        .unwrap();
    let parsed: tokio_postgres::Config = db.url.parse().unwrap();
    let url = format!(
        "postgres://{user}:pw-Tls_9@localhost:{}/{}",
        parsed.get_ports()[0],
        parsed.get_dbname().unwrap()
    );
    let ca = std::fs::read_to_string(rig.get("OUTBOX_RIG_PG_CA")).unwrap();
    let other_ca = {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=other",
            ])
            .arg("-keyout")
            .arg(dir.path().join("k"))
            .arg("-out")
            .arg(dir.path().join("c"))
            .output()
            .unwrap();
        assert!(out.status.success());
        std::fs::read_to_string(dir.path().join("c")).unwrap()
    };
    // The role the rig admits by client certificate only (CN=outbox_cert).
    db.client
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE outbox_cert LOGIN REPLICATION; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;
             GRANT SELECT, UPDATE, DELETE ON public.outbox TO outbox_cert;",
        )
        .await
        .unwrap();
    let cert_url = format!(
        "postgres://outbox_cert@localhost:{}/{}",
        parsed.get_ports()[0],
        parsed.get_dbname().unwrap()
    );
    let tls_dir = rig.get("OUTBOX_RIG_TLS_DIR").to_owned();
    let read = |name: &str| std::fs::read_to_string(format!("{tls_dir}/{name}")).unwrap();
    let (client_crt, client_key) = (read("client.crt"), read("client.key"));
    operator::create_secret(&client, &ns, "db-cert", &[("uri", cert_url.as_str())]).await;
    operator::create_secret(
        &client,
        &ns,
        "pg-client",
        &[
            ("ca.crt", ca.as_str()),
            ("tls.crt", client_crt.as_str()),
            ("tls.key", client_key.as_str()),
        ],
    )
    .await;
    operator::create_secret(&client, &ns, "db", &[("uri", url.as_str())]).await;
    operator::create_secret(&client, &ns, "pg-ca", &[("ca.crt", ca.as_str())]).await;
    operator::create_secret(&client, &ns, "other-ca", &[("ca.crt", other_ca.as_str())]).await;

    let mut args = ControllerArgs::for_namespace(&ns);
    args.identity = Some("tls-test".to_owned());
    args.lease_name = "outbox-operator-tls-test".to_owned();
    args.status_interval_seconds = 1;
    let running = operator::InProcess::start(&client, args);
    let api: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    let mut by_cert = manifest("by-cert", "pg-ca");
    let pg = &mut by_cert["spec"]["database"]["postgres"];
    pg["connectionSecretRef"] = json!({"name": "db-cert"});
    // One kubernetes.io/tls Secret, as cert-manager writes it, named without a key:
    // its ca.crt verifies the server, its tls.crt and tls.key log the relay in.
    pg["caSecretRef"] = json!({"name": "pg-client"});
    pg["clientCertSecretRef"] = json!({"name": "pg-client"});
    // The default mode (verify-full) with no CA named: the system's roots do not know
    // the rig's CA.
    let mut no_ca = manifest("no-ca", "pg-ca");
    let pg = no_ca["spec"]["database"]["postgres"]
        .as_object_mut()
        .unwrap();
    pg.remove("caSecretRef");
    pg.remove("sslMode");
    for (name, relay) in [
        ("good", manifest("good", "pg-ca")),
        ("wrong-ca", manifest("wrong-ca", "other-ca")),
        ("by-cert", by_cert),
        ("no-ca", no_ca),
    ] {
        api.patch(name, &PatchParams::apply("tls-test"), &Patch::Apply(&relay))
            .await
            .unwrap();
    }
    let good = common::wait_for_some("DatabaseReady=True over verify-full", WAIT, || async {
        let r = api.get_opt("good").await.ok().flatten()?;
        operator::condition(&r, "DatabaseReady").filter(|c| c.status == "True")
    })
    .await;
    assert!(good.message.contains(&user), "{}", good.message);
    let by_cert = common::wait_for_some(
        "DatabaseReady=True logged in by client certificate",
        WAIT,
        || async {
            let r = api.get_opt("by-cert").await.ok().flatten()?;
            operator::condition(&r, "DatabaseReady").filter(|c| c.status == "True")
        },
    )
    .await;
    assert!(
        by_cert.message.contains("outbox_cert"),
        "{}",
        by_cert.message
    );
    let wrong = common::wait_for_some("DatabaseReady=False with the wrong CA", WAIT, || async {
        let r = api.get_opt("wrong-ca").await.ok().flatten()?;
        operator::condition(&r, "DatabaseReady").filter(|c| c.status == "False")
    })
    .await;
    assert_eq!(wrong.reason, "TLSNotVerified", "{wrong:?}");
    assert!(
        wrong.message.contains("UnknownIssuer")
            && wrong.message.contains("give the CA that signed it")
            && !wrong.message.contains("pw-Tls_9"),
        "{}",
        wrong.message
    );
    let no_ca = common::wait_for_some(
        "DatabaseReady=False under the default verify-full without a CA",
        WAIT,
        || async {
            let r = api.get_opt("no-ca").await.ok().flatten()?;
            operator::condition(&r, "DatabaseReady").filter(|c| c.status == "False")
        },
    )
    .await;
    assert_eq!(no_ca.reason, "TLSNotVerified", "{no_ca:?}");
    assert!(
        no_ca.message.contains("spec.database.postgres.caSecretRef")
            && no_ca.message.contains("sslMode: require"),
        "the condition does not say how to give the CA or choose a weaker mode: {}",
        no_ca.message
    );
    println!("default verify-full without a CA: {}", no_ca.message);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    assert!(deployments.get_opt("good-relay").await.unwrap().is_some());
    assert!(
        deployments
            .get_opt("wrong-ca-relay")
            .await
            .unwrap()
            .is_none()
    );
    // The operator's own session was encrypted.
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
    assert!(encrypted >= 1, "no encrypted operator session");

    operator::delete_relays(&client, &ns, WAIT).await;
    let _ = running.stop(WAIT).await;
    common::delete_namespace(&client, &ns).await;
    db.client
        .batch_execute(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{user}'"
        ))
        .await
        .unwrap();
    db.drop_database().await;
    let _ = common::pg_admin()
        .await
        .batch_execute(&format!("DROP ROLE IF EXISTS {user}"))
        .await;
}
