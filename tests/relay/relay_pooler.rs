//! A relay behind PgBouncer (Debian's, private to the test, in front of the rig's
//! PostgreSQL): in transaction pooling, where session advisory locks neither hold nor
//! fence, the relay refuses to start and says why; behind a session-mode pool it works.

use crate::common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::private::PrivatePgBouncer;
use common::{RelayBroker, RelayOptions, RelayProcess};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_behind_transaction_pooling_refuses_and_session_pooling_works() {
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let mut ids = BTreeSet::new();
    for i in 0..20 {
        let aggregate = format!("order-{}", i % 4);
        let payload = serde_json::json!({"aggregate": aggregate, "seq": i});
        ids.insert(common::insert_row(&db.client, "Order", &aggregate, &payload).await);
    }
    let yaml = common::relay_config_yaml(&broker, &RelayOptions::default());

    let transaction = PrivatePgBouncer::start("transaction");
    let mut refused = RelayProcess::start(&yaml, &transaction.url_for(&db.url), &broker);
    let started = Instant::now();
    while refused.is_running() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the relay behind transaction pooling still runs after 30 s; log:\n{}\npgbouncer:\n{}",
            refused.log_tail(30),
            transaction.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = refused.terminate(Duration::from_secs(5));
    assert!(!status.success(), "it exited with {status}");
    let log = refused.log();
    assert!(
        log.contains("pool_mode=transaction") && log.contains("advisory locks"),
        "the log does not say why:\n{log}"
    );
    assert_eq!(
        common::unpublished_rows(&db.client).await,
        20,
        "nothing may be published"
    );
    drop(transaction);

    let session = PrivatePgBouncer::start("session");
    let relay = RelayProcess::start(&yaml, &session.url_for(&db.url), &broker);
    common::wait_for_relays(
        "the relay behind session pooling to publish every row",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(&db.client).await == 0 },
    )
    .await;
    let received: BTreeSet<i64> = common::consume_nats(&stream)
        .await
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(received, ids);
    drop(relay);
    drop(session);
    db.drop_database().await;
}
