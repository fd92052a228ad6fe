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
