//! The controller's PostgreSQL SQL (`outbox_operator::postgres::admin`) against a real
//! PostgreSQL of the test's own (so slot counts are exact): checks read the server
//! right, provisioning is idempotent and marked, a foreign slot is adopted and kept,
//! dropping terminates a walsender first, marked objects are listed, and the backlog is
//! measured.

use crate::common;

use std::time::Duration;

use outbox_operator::postgres::admin::{self, Origin, Owner, Plan, Scope, SlotPlan, first_failure};

fn plan(slot: &str, delete_after_publish: bool) -> Plan {
    Plan {
        schema: "public".to_owned(),
        table: "outbox".to_owned(),
        id: "id".to_owned(),
        columns: vec![
            ("table.columns.id".to_owned(), "id".to_owned()),
            ("table.headers".to_owned(), "traceparent".to_owned()),
        ],
        created_at: "created_at".to_owned(),
        published_at: None,
        marker: "published_at".to_owned(),
        privileges: vec![("SELECT", "reads"), ("DELETE", "deletes")],
        log_tailing: Some(SlotPlan {
            slot: slot.to_owned(),
            publication: slot.to_owned(),
            delete_after_publish,
        }),
        archive: None,
        dead_letter: "outbox_dead_letter".to_owned(),
    }
}

fn owner(name: &str) -> Owner {
    Owner {
        namespace: "shop".to_owned(),
        name: name.to_owned(),
        uid: format!("uid-{name}"),
    }
}

async fn count(client: &tokio_postgres::Client, sql: &str, slot: &str) -> i64 {
    client.query_one(sql, &[&slot]).await.unwrap().get(0)
}

async fn slots(client: &tokio_postgres::Client, slot: &str) -> i64 {
    count(
        client,
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
        slot,
    )
    .await
}

async fn publications(client: &tokio_postgres::Client, name: &str) -> i64 {
    count(
        client,
        "SELECT count(*) FROM pg_publication WHERE pubname = $1",
        name,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provision_checks_adopt_drop_and_measure_against_a_real_server() {
    let pg = common::private::PrivatePostgres::start_with(&["max_replication_slots=3"]);
    let client = common::pg_connect(&pg.url()).await.unwrap();
    common::create_outbox_table(&client, 4).await;

    // The checks read the server as it is.
    let p = plan("orders", true);
    let facts = admin::gather(&client, &p).await.unwrap();
    assert_eq!(facts.server.wal_level, "logical");
    assert_eq!(facts.server.max_replication_slots, 3);
    assert!(facts.table.exists && facts.table.missing_privileges.is_empty());
    let checks = admin::evaluate(&p, &facts);
    assert!(checks.iter().all(|c| c.ok), "{checks:#?}");
    let mut missing = plan("orders", true);
    missing
        .columns
        .push(("table.headers".to_owned(), "tenant".to_owned()));
    let checks = admin::evaluate(&missing, &admin::gather(&client, &missing).await.unwrap());
    assert_eq!(
        first_failure(&checks, Scope::Database).map(|c| c.reason),
        Some("ColumnMissing")
    );

    // Provisioning creates both, marked; again, it changes nothing.
    let made = outbox_operator::postgres::provision::provision(&client, &p, &owner("orders"))
        .await
        .unwrap();
    assert_eq!(
        (made.publication, made.slot),
        (Some(Origin::Created), Some(Origin::Created))
    );
    let again = outbox_operator::postgres::provision::provision(&client, &p, &owner("orders"))
        .await
        .unwrap();
    assert_eq!(made, again);
    assert_eq!(
        (
            slots(&client, "orders").await,
            publications(&client, "orders").await
        ),
        (1, 1)
    );
    let state = admin::slot_state(&client, "orders").await.unwrap().unwrap();
    assert!(!state.active && state.confirmed_flush_lsn.is_some());

    // A foreign slot of the same name is adopted; its publication is the operator's.
    client
        .query_one(
            "SELECT 1 FROM pg_create_logical_replication_slot('foreign_slot', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    let foreign = plan("foreign_slot", true);
    let made =
        outbox_operator::postgres::provision::provision(&client, &foreign, &owner("adopter"))
            .await
            .unwrap();
    assert_eq!(
        (made.publication, made.slot),
        (Some(Origin::Created), Some(Origin::Adopted))
    );

    // Slots are full now (orders, foreign_slot + one more allowed): a third plan still
    // fits, a fourth does not.
    client
        .query_one(
            "SELECT 1 FROM pg_create_logical_replication_slot('filler', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    let full = plan("one_too_many", true);
    let checks = admin::evaluate(&full, &admin::gather(&client, &full).await.unwrap());
    let failed = first_failure(&checks, Scope::Slot).unwrap();
    assert_eq!(failed.reason, "NoFreeSlots", "{}", failed.message);

    // The marked publications are listed, with their owners.
    let marked = admin::list_marked(&client).await.unwrap();
    let owners: Vec<&str> = marked
        .iter()
        .map(|m| m.marker.owner.name.as_str())
        .collect();
    assert_eq!(marked.len(), 2, "{owners:?}");

    // A walsender streams the slot; dropping terminates it and drops both.
    let config = outbox_operator::postgres::replication::replication_config(
        &pg.url(),
        "test",
        pgwire_replication::config::TlsConfig::disabled(),
        "orders",
        "orders",
        Duration::from_secs(1),
    )
    .unwrap();
    let mut stream = pgwire_replication::ReplicationClient::connect(config)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), stream.wait_started())
        .await
        .unwrap()
        .unwrap();
    assert!(
        admin::slot_state(&client, "orders")
            .await
            .unwrap()
            .unwrap()
            .active
    );
    // Someone else's owner drops nothing.
    let nothing = admin::drop_owned(&client, "orders", "orders", &owner("intruder"))
        .await
        .unwrap();
    assert!(!nothing.slot && !nothing.publication, "{nothing:?}");
    let dropped = admin::drop_owned(&client, "orders", "orders", &owner("orders"))
        .await
        .unwrap();
    assert!(dropped.slot && dropped.terminated_walsender && dropped.publication);
    assert_eq!(
        (
            slots(&client, "orders").await,
            publications(&client, "orders").await
        ),
        (0, 0)
    );
    // Idempotent: gone is dropped.
    let twice = admin::drop_owned(&client, "orders", "orders", &owner("orders"))
        .await
        .unwrap();
    assert!(twice.kept.is_empty(), "{twice:?}");

    // The adopted slot is kept; the operator's publication goes.
    let kept = admin::drop_owned(&client, "foreign_slot", "foreign_slot", &owner("adopter"))
        .await
        .unwrap();
    assert!(!kept.slot && kept.publication, "{kept:?}");
    assert_eq!(slots(&client, "foreign_slot").await, 1);

    // Backlog: the table is the backlog with deleteAfterPublish.
    for i in 0..3 {
        common::insert_row(
            &client,
            "Order",
            &format!("o-{i}"),
            &serde_json::json!({"n": i}),
        )
        .await;
    }
    let backlog = admin::backlog(&client, &p).await.unwrap().unwrap();
    assert_eq!(backlog.rows, 3);
    assert!(backlog.oldest_age_seconds.is_some_and(|a| a >= 0.0));
    assert!(
        admin::backlog(&client, &plan("x", false))
            .await
            .unwrap()
            .is_none()
    );
    // The status queries reset the session's statement timeout afterwards.
    let timeout: String = client
        .query_one("SHOW statement_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(timeout, "0");

    // After the drops no publication is left.
    let left: i64 = client
        .query_one("SELECT count(*) FROM pg_publication", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
    drop(pg);
}

/// Debezium's documented outbox table (`id uuid`, no created-at column), a varchar id, a
/// numeric id and an integer id that may be NULL, against a real server: log tailing
/// takes the uuid and varchar ids; polling a uuid id without a created-at column, a
/// numeric id and a nullable id are refused with their fix. The relay's own table check
/// agrees (a uuid id is read as text; a numeric one is refused in one line).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_id_checks_take_uuid_and_text_ids_and_refuse_what_no_relay_can_read() {
    let db = common::fresh_database().await;
    // Log tailing keeping rows (as `render --from-debezium` writes it), or polling.
    let check = |table: &'static str, tailing: bool| {
        let mut p = plan("unused", false);
        p.table = table.to_owned();
        p.columns = vec![("table.columns.id".to_owned(), "id".to_owned())];
        p.privileges = vec![("SELECT", "reads")];
        if !tailing {
            p.log_tailing = None;
        }
        p
    };
    db.client
        .batch_execute(
            "CREATE TABLE public.debezium_outbox (
                id uuid NOT NULL PRIMARY KEY,
                aggregatetype varchar(255) NOT NULL,
                aggregateid varchar(255) NOT NULL,
                type varchar(255) NOT NULL,
                payload jsonb);
             CREATE TABLE public.varchar_outbox (id varchar(64) PRIMARY KEY, payload jsonb,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp());
             CREATE TABLE public.numeric_outbox (id numeric PRIMARY KEY, payload jsonb);
             CREATE TABLE public.nullable_outbox (id bigint, payload jsonb);",
        )
        .await
        .unwrap();
    let failure = |table: &'static str, tailing: bool| {
        let client = &db.client;
        async move {
            let p = check(table, tailing);
            let checks = admin::evaluate(&p, &admin::gather(client, &p).await.unwrap());
            first_failure(&checks, Scope::Database).map(|c| (c.reason, c.message.clone()))
        }
    };
    assert_eq!(failure("debezium_outbox", true).await, None);
    assert_eq!(failure("varchar_outbox", true).await, None);
    assert_eq!(failure("varchar_outbox", false).await, None);
    let (reason, message) = failure("debezium_outbox", false).await.expect("refused");
    assert_eq!(reason, "IdColumnOrder");
    assert!(
        message.contains("ADD COLUMN created_at timestamptz"),
        "{message}"
    );
    let (reason, message) = failure("numeric_outbox", true).await.expect("refused");
    assert_eq!(reason, "IdColumnType");
    assert!(message.contains("is numeric"), "{message}");
    let (reason, message) = failure("nullable_outbox", true).await.expect("refused");
    assert_eq!(reason, "IdColumnNullable");
    assert!(message.contains("SET NOT NULL"), "{message}");
    let inspect = |table: &'static str| {
        let client = &db.client;
        async move {
            let spec = outbox_operator::spec::Table::named("public", table);
            outbox_operator::postgres::table::OutboxTable::inspect(
                client,
                &spec,
                "unused_dead_letter",
                outbox_operator::postgres::table::Columns {
                    id: "id".into(),
                    aggregate_type: "payload".into(),
                    aggregate_id: "payload".into(),
                    event_type: "payload".into(),
                    payload: "payload".into(),
                    created_at: None,
                    published_at: "published_at".into(),
                    timestamp: None,
                    order: None,
                    extra: Vec::new(),
                },
                outbox_operator::api::AfterPublish::Delete,
                1,
            )
            .await
        }
    };
    let table = inspect("debezium_outbox").await.expect("a uuid id is read");
    assert_eq!(
        table.id_kind(),
        outbox_operator::postgres::table::IdKind::Text { cast: "uuid" }
    );
    assert!(
        !table.ordered_by_insertion(),
        "no created-at column to order by"
    );
    let refused = inspect("numeric_outbox")
        .await
        .expect_err("a numeric id is refused");
    assert!(
        refused.to_string().contains("column id is numeric"),
        "{refused}"
    );
}

/// The archive check on a real server: a missing archive, one lacking a column, and a
/// role without the privileges each fail with a statement to run; running it (as the
/// test does, verbatim) makes the check pass. The relay builds its move from the same
/// column rule, so an archive the check passes is one the relay can move rows into.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_archive_check_names_what_to_run_and_passes_once_it_is_run() {
    let db = common::fresh_database().await;
    let client = &db.client;
    common::create_outbox_table(client, 4).await;
    let mut p = plan("unused_archive_slot", true);
    p.archive = Some(admin::ArchivePlan {
        schema: "public".to_owned(),
        name: "outbox_archive".to_owned(),
        moved_at: "published_at".to_owned(),
    });
    let archive_check = |facts: &admin::Facts| {
        admin::evaluate(&p, facts)
            .into_iter()
            .find(|c| c.name == "archive")
            .expect("an archive check")
    };
    // What the message says to run, between `run ` and `end`.
    let statement = |message: &str, end: &str| -> String {
        let from = message.find("run ").expect("a statement to run") + 4;
        let rest = &message[from..];
        rest[..rest.find(end).unwrap_or(rest.len())].to_owned()
    };

    let check = archive_check(&admin::gather(client, &p).await.unwrap());
    assert_eq!(
        (check.ok, check.reason),
        (false, "ArchiveNotFound"),
        "{}",
        check.message
    );
    client
        .batch_execute(&statement(&check.message, " (and"))
        .await
        .unwrap_or_else(|err| panic!("{}: {err}", check.message));
    let check = archive_check(&admin::gather(client, &p).await.unwrap());
    assert_eq!(
        (check.ok, check.reason),
        (true, "ArchiveReady"),
        "{}",
        check.message
    );

    client
        .batch_execute("ALTER TABLE public.outbox_archive DROP COLUMN traceparent")
        .await
        .unwrap();
    let check = archive_check(&admin::gather(client, &p).await.unwrap());
    assert_eq!(
        (check.ok, check.reason),
        (false, "ArchiveColumns"),
        "{}",
        check.message
    );
    assert!(
        check.message.contains("no column traceparent (text)"),
        "{}",
        check.message
    );
    client
        .batch_execute(&statement(&check.message, "\u{0}"))
        .await
        .unwrap_or_else(|err| panic!("{}: {err}", check.message));
    assert!(archive_check(&admin::gather(client, &p).await.unwrap()).ok);

    let role = format!("archive_reader_{}", common::unique_suffix());
    client
        .batch_execute(&format!(
            "CREATE ROLE {role} NOLOGIN;
             GRANT SELECT ON public.outbox, public.outbox_archive TO {role};
             SET ROLE {role};"
        ))
        .await
        .unwrap();
    let facts = admin::gather(client, &p).await.unwrap();
    client.batch_execute("RESET ROLE").await.unwrap();
    let check = archive_check(&facts);
    assert_eq!(
        (check.ok, check.reason),
        (false, "ArchivePermissionDenied"),
        "{}",
        check.message
    );
    assert!(
        check.message.contains("lacks INSERT, DELETE"),
        "{}",
        check.message
    );
    client
        .batch_execute(&format!(
            "{}; SET ROLE {role}",
            statement(&check.message, "\u{0}")
        ))
        .await
        .unwrap_or_else(|err| panic!("{}: {err}", check.message));
    let facts = admin::gather(client, &p).await.unwrap();
    client
        .batch_execute(&format!(
            "RESET ROLE; DROP OWNED BY {role}; DROP ROLE {role}"
        ))
        .await
        .unwrap();
    assert!(
        archive_check(&facts).ok,
        "{}",
        archive_check(&facts).message
    );
    db.drop_database().await;
}
