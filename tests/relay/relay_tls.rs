//! TLS to PostgreSQL, against the rig's PostgreSQL (`ssl=on`, a CA made per run, a
//! server certificate for `localhost` only) and a role of `outbox_tls_users`, whom
//! pg_hba.conf admits over TLS with SCRAM only: the polling and the log-tailing relay
//! publish with `verify-full`, every backend they open (the walsender included) is
//! encrypted, and each wrong setting is refused with a clear error, never a plaintext
//! fallback.

use std::time::Duration;

use crate::common::{self, RelayBroker, RelayOptions, RelayProcess, SlotGuard};
use outbox_operator::api::SslMode;
use outbox_operator::postgres::tls::PgTls;

const PASSWORD: &str = "Tls-s3cret_1";

/// A role that may only log in over TLS, with a password, on `db`.
async fn tls_user(db: &common::TestDatabase) -> String {
    let user = format!("relay_tls_{}", common::unique_suffix());
    db.client
        .batch_execute(&format!(
            "DO $$ BEGIN CREATE ROLE outbox_tls_users NOLOGIN; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;
             SET password_encryption = 'scram-sha-256';
             CREATE ROLE {user} LOGIN REPLICATION PASSWORD '{PASSWORD}' IN ROLE outbox_tls_users;
             GRANT SELECT, UPDATE, DELETE ON public.outbox TO {user};"
        ))
        .await
        .unwrap_or_else(|e| panic!("creating {user}: {e}"));
    user
}

/// The database's URL for `user` through host `host` (`localhost` matches the server
/// certificate, `127.0.0.1` does not).
fn url_for(db: &common::TestDatabase, user: &str, host: &str) -> String {
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    format!(
        "postgres://{user}:{PASSWORD}@{host}:{}/{}",
        config.get_ports()[0],
        config.get_dbname().unwrap()
    )
}

/// A relay config with `sslMode` and the rig's CA as the mounted CA file.
fn tls_yaml(broker: &RelayBroker, mode: &str, log_tailing_slot: Option<&str>) -> String {
    let ca = common::Rig::load().get("OUTBOX_RIG_PG_CA").to_owned();
    let mut yaml = common::with_spec_line(
        &common::relay_config_yaml(broker, &RelayOptions::default()),
        "database",
        &format!(
            "{{postgres: {{connectionSecretRef: {{name: db}}, sslMode: {mode}, caSecretRef: {{name: pg-ca, key: ca.crt}}}}}}"
        ),
    );
    if let Some(slot) = log_tailing_slot {
        yaml = common::with_spec_line(&yaml, "mode", &common::log_tailing_mode(slot, true));
    }
    let mut lines = vec![yaml];
    lines.push(format!(
        "secretFiles: {{spec.database.postgres.caSecretRef: \"{ca}\"}}"
    ));
    lines.join("\n")
}

/// An error and every cause under it, as one line.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// `(encrypted, all)` sessions of `user`, optionally only walsenders.
async fn sessions(db: &common::TestDatabase, user: &str, walsender: bool) -> (i64, i64) {
    let row = db
        .client
        .query_one(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*) FROM pg_stat_activity a \
             JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = $1 AND ($2 = false OR a.backend_type = 'walsender')",
            &[&user, &walsender],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_publish_over_verified_tls_and_every_session_is_encrypted() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let user = tls_user(&db).await;
    let url = url_for(&db, &user, "localhost");
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };

    // Polling, verify-full.
    let relay = RelayProcess::start(&tls_yaml(&broker, "verify-full", None), &url, &broker);
    for i in 0..20 {
        common::insert_row(
            &db.client,
            "order",
            &format!("a{}", i % 3),
            &serde_json::json!({"i": i}),
        )
        .await;
    }
    common::wait_for_relays(
        "the polling relay to publish every row over TLS",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    let (encrypted, all) = sessions(&db, &user, false).await;
    assert!(
        all >= 1 && encrypted == all,
        "{encrypted} of {all} sessions encrypted"
    );
    drop(relay);

    // Log tailing, verify-full: the query connection, the deleter and the walsender.
    db.client
        .batch_execute("DELETE FROM public.outbox")
        .await
        .unwrap();
    let guard = SlotGuard::new(rig.pg_url(), "tls");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let relay = RelayProcess::start(
        &tls_yaml(&broker, "verify-full", Some(&guard.slot)),
        &url,
        &broker,
    );
    common::wait_for_relays(
        "the log-tailing relay's walsender",
        Duration::from_secs(60),
        &[&relay],
        || async { sessions(&db, &user, true).await.1 >= 1 },
    )
    .await;
    for i in 0..20 {
        common::insert_row(
            &db.client,
            "order",
            &format!("b{}", i % 3),
            &serde_json::json!({"i": i}),
        )
        .await;
    }
    common::wait_for_relays(
        "the log-tailing relay to publish and delete every row over TLS",
        Duration::from_secs(60),
        &[&relay],
        || async {
            db.client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .map(|r| r.get::<_, i64>(0) == 0)
                .unwrap_or(false)
        },
    )
    .await;
    let (encrypted, all) = sessions(&db, &user, true).await;
    assert!(
        all >= 1 && encrypted == all,
        "walsender: {encrypted} of {all} encrypted"
    );
    let (encrypted, all) = sessions(&db, &user, false).await;
    assert!(
        all >= 2 && encrypted == all,
        "{encrypted} of {all} sessions encrypted"
    );
    drop(relay);
    db.client
        .batch_execute(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{user}'"
        ))
        .await
        .unwrap();
    drop(guard);
    db.drop_database().await;
    let _ = common::pg_admin()
        .await
        .batch_execute(&format!("DROP ROLE IF EXISTS {user}"))
        .await;
}

/// A CA that did not sign the rig's server certificate.
fn foreign_ca() -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=someone-else"])
        .arg("-keyout")
        .arg(dir.path().join("k"))
        .arg("-out")
        .arg(dir.path().join("c"))
        .output()
        .unwrap_or_else(|e| panic!("openssl: {e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(dir.path().join("c")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tls_settings_are_refused_clearly_and_never_fall_back_to_plaintext() {
    let rig = common::Rig::load();
    let ca = std::fs::read_to_string(rig.get("OUTBOX_RIG_PG_CA")).unwrap();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 1).await;
    let user = tls_user(&db).await;
    let connect = |url: String, mode: SslMode, ca_pem: Option<String>| async move {
        outbox_operator::postgres::connect_as(
            &url,
            "OUTBOX_DATABASE_URL",
            &PgTls {
                mode,
                ca_pem,
                client: None,
            },
            "tls-test",
        )
        .await
        .map(|_| ())
        .map_err(|e| error_chain(&e))
    };
    let localhost = url_for(&db, &user, "localhost");
    let by_ip = url_for(&db, &user, "127.0.0.1");

    let mut report = Vec::new();
    let mut expect_ok = |what: &str, r: Result<(), String>| {
        assert!(r.is_ok(), "{what}: {r:?}");
        report.push(format!("{what:<60} connected"));
    };
    expect_ok(
        "verify-full, the rig's CA, host localhost",
        connect(localhost.clone(), SslMode::VerifyFull, Some(ca.clone())).await,
    );
    expect_ok(
        "verify-ca, the rig's CA, host 127.0.0.1 (name not checked)",
        connect(by_ip.clone(), SslMode::VerifyCa, Some(ca.clone())).await,
    );
    expect_ok(
        "require, no CA (encrypted, not verified)",
        connect(by_ip.clone(), SslMode::Require, None).await,
    );
    let refused: Vec<(&str, Result<(), String>, &[&str])> = vec![
        (
            "verify-full, host 127.0.0.1 (certificate is for localhost)",
            connect(by_ip.clone(), SslMode::VerifyFull, Some(ca.clone())).await,
            &["certificate", "not valid for name"],
        ),
        (
            "verify-full, a CA that did not sign the server certificate",
            connect(localhost.clone(), SslMode::VerifyFull, Some(foreign_ca())).await,
            &["certificate", "UnknownIssuer"],
        ),
        (
            "verify-full, the wrong password",
            connect(
                localhost.replace(PASSWORD, "wrong-password"),
                SslMode::VerifyFull,
                Some(ca.clone()),
            )
            .await,
            &["password authentication failed"],
        ),
        (
            "disable, a role admitted over TLS only",
            connect(localhost.clone(), SslMode::Disable, None).await,
            &["no encryption"],
        ),
    ];
    for (what, result, needles) in refused {
        let Err(message) = result else {
            panic!("{what}: connected");
        };
        for needle in needles {
            assert!(
                message.to_lowercase().contains(&needle.to_lowercase()),
                "{what}: `{needle}` not in {message}"
            );
        }
        assert!(
            !message.contains(PASSWORD),
            "{what}: the password leaked: {message}"
        );
        report.push(format!("{what:<60} refused: {message}"));
    }

    // A server that offers no TLS at all: require is refused, prefer goes on in plain.
    let plain = common::private::PrivatePostgres::start_new();
    let result = connect(plain.url(), SslMode::Require, None).await;
    let Err(message) = result else {
        panic!("require against a server without TLS connected");
    };
    assert!(
        message.to_lowercase().contains("tls") || message.to_lowercase().contains("ssl"),
        "{message}"
    );
    report.push(format!(
        "{:<60} refused: {message}",
        "require, a server without TLS"
    ));
    assert!(connect(plain.url(), SslMode::Prefer, None).await.is_ok());
    println!("{}", report.join("\n"));
    db.drop_database().await;
    let _ = common::pg_admin()
        .await
        .batch_execute(&format!("DROP ROLE IF EXISTS {user}"))
        .await;
}

/// A relay logs in with a client certificate (pg_hba.conf `cert` for the role
/// outbox_cert, whose name is the certificate's CN) on every connection: polling, and
/// log tailing's query, deleter and replication connections. Without the certificate
/// the same role is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_log_in_with_a_client_certificate_on_every_connection() {
    let rig = common::Rig::load();
    let tls_dir = rig.get("OUTBOX_RIG_TLS_DIR").to_owned();
    let file = |name: &str| format!("{tls_dir}/{name}");
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    db.client
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE outbox_cert LOGIN REPLICATION; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;
             GRANT SELECT, UPDATE, DELETE ON public.outbox TO outbox_cert;",
        )
        .await
        .unwrap();
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let url = format!(
        "postgres://outbox_cert@localhost:{}/{}",
        config.get_ports()[0],
        config.get_dbname().unwrap()
    );
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let yaml = |slot: Option<&str>| {
        let mut yaml = common::with_spec_line(
            &common::relay_config_yaml(&broker, &RelayOptions::default()),
            "database",
            "{postgres: {connectionSecretRef: {name: db}, sslMode: verify-full, caSecretRef: {name: pg, key: ca.crt}, clientCertSecretRef: {name: pg, key: tls.crt}, clientKeySecretRef: {name: pg, key: tls.key}}}",
        );
        if let Some(slot) = slot {
            yaml = common::with_spec_line(&yaml, "mode", &common::log_tailing_mode(slot, true));
        }
        format!(
            "{yaml}\nsecretFiles: {{spec.database.postgres.caSecretRef: \"{}\", spec.database.postgres.clientCertSecretRef: \"{}\", spec.database.postgres.clientKeySecretRef: \"{}\"}}",
            file("ca.crt"),
            file("client.crt"),
            file("client.key")
        )
    };
    // Sessions of outbox_cert that presented the rig's client certificate.
    let by_cert = |walsender: bool| {
        let db = &db;
        async move {
            let row = db
                .client
                .query_one(
                    "SELECT count(*) FILTER (WHERE s.ssl AND s.client_dn = '/CN=outbox_cert'), count(*) \
                     FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                     WHERE a.usename = 'outbox_cert' AND a.datname = current_database() \
                       AND ($1 = false OR a.backend_type = 'walsender')",
                    &[&walsender],
                )
                .await
                .unwrap();
            (row.get::<_, i64>(0), row.get::<_, i64>(1))
        }
    };

    let relay = RelayProcess::start(&yaml(None), &url, &broker);
    for i in 0..10 {
        common::insert_row(
            &db.client,
            "order",
            &format!("c{}", i % 3),
            &serde_json::json!({"i": i}),
        )
        .await;
    }
    common::wait_for_relays(
        "the polling relay to publish as outbox_cert",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    let (cert, all) = by_cert(false).await;
    assert!(
        all >= 1 && cert == all,
        "{cert} of {all} sessions by certificate"
    );
    drop(relay);

    db.client
        .batch_execute("DELETE FROM public.outbox")
        .await
        .unwrap();
    let guard = SlotGuard::new(rig.pg_url(), "certlogin");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let relay = RelayProcess::start(&yaml(Some(&guard.slot)), &url, &broker);
    for i in 0..10 {
        common::insert_row(
            &db.client,
            "order",
            &format!("d{}", i % 3),
            &serde_json::json!({"i": i}),
        )
        .await;
    }
    common::wait_for_relays(
        "the log-tailing relay to publish and delete as outbox_cert",
        Duration::from_secs(60),
        &[&relay],
        || async {
            db.client
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .map(|r| r.get::<_, i64>(0) == 0)
                .unwrap_or(false)
        },
    )
    .await;
    // The walsender is not in a database: count it apart.
    let walsenders: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = 'outbox_cert' AND a.backend_type = 'walsender' \
               AND s.client_dn = '/CN=outbox_cert'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(walsenders >= 1, "no walsender logged in by certificate");
    let (cert, all) = by_cert(false).await;
    assert!(
        all >= 2 && cert == all,
        "{cert} of {all} sessions by certificate"
    );
    drop(relay);
    drop(guard);

    // Without the certificate, the same role is refused.
    let ca = std::fs::read_to_string(file("ca.crt")).unwrap();
    let refused = outbox_operator::postgres::connect_as(
        &url,
        "OUTBOX_DATABASE_URL",
        &PgTls {
            mode: SslMode::VerifyFull,
            ca_pem: Some(ca),
            client: None,
        },
        "tls-test",
    )
    .await;
    let Err(err) = refused else {
        panic!("outbox_cert logged in without a certificate");
    };
    let text = error_chain(&err);
    assert!(text.contains("certificate"), "{text}");
    println!("without the client certificate: {text}");
    db.client
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'outbox_cert' AND datname = current_database()",
        )
        .await
        .unwrap();
    db.drop_database().await;
}
