//! The scenarios of the matrix (see main.rs) and the one runner they share.

use crate::common;

use std::time::{Duration, Instant};

use common::app_writer::{AppWriter, WriterOptions};
use common::private::{PrivateKafka, PrivateNats, PrivatePostgres, PrivateRabbitMq};
use common::proxy::TcpProxy;
use common::{RelayBroker, RelayOptions, RelayProcess, SlotGuard};
use rand::Rng;

/// Events the application commits during a scenario.
const EVENTS: usize = 3000;
/// SIGKILLs per `kill` scenario.
const KILLS: usize = 20;
/// Network cuts per `*_cut` scenario, and how long each lasts.
const CUTS: usize = 2;
const CUT_FOR: Duration = Duration::from_secs(3);
/// How long a restarted server stays down.
const DOWN_FOR: Duration = Duration::from_secs(3);
const WAIT: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Polling,
    LogTailing,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Broker {
    Kafka,
    Nats,
    RabbitMq,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Kill,
    DbCut,
    BrokerCut,
    DbRestart,
    BrokerRestart,
}

/// Where the scenario's messages go, and the test's own consumer of them.
enum Sink {
    Kafka {
        bootstrap: String,
        topic: String,
    },
    Nats(Box<common::TestStream>),
    /// The queue, and the URL of a private node to read it again from after a restart
    /// (the first connection did not survive it).
    Amqp(Box<common::TestQueue>, Option<String>),
}

impl Sink {
    async fn received(&self) -> Vec<common::Received> {
        match self {
            Sink::Kafka { bootstrap, topic } => {
                let (bootstrap, topic) = (bootstrap.clone(), topic.clone());
                tokio::task::spawn_blocking(move || common::consume_kafka_from(&bootstrap, &topic))
                    .await
                    .unwrap_or_else(|e| panic!("Kafka consumer task: {e}"))
            }
            Sink::Nats(stream) => common::consume_nats(stream).await,
            Sink::Amqp(queue, None) => common::consume_amqp(queue).await,
            Sink::Amqp(queue, Some(url)) => {
                let again = common::queue_on(common::amqp_connect_to(url).await, &queue.name).await;
                common::consume_amqp(&again).await
            }
        }
    }
}

/// A server of the scenario's own that the fault stops and starts again.
enum Private {
    Postgres(PrivatePostgres),
    Kafka(PrivateKafka),
    Nats(PrivateNats),
    RabbitMq(PrivateRabbitMq),
}

impl Private {
    /// The server's own log, for a failure message.
    fn log_tail(&self) -> String {
        match self {
            Private::Postgres(s) => s.log_tail(40),
            Private::Kafka(s) => s.log_tail(40),
            Private::Nats(s) => s.log_tail(40),
            Private::RabbitMq(s) => s.log_tail(40),
        }
    }

    fn restart(&mut self) {
        tokio::task::block_in_place(|| match self {
            Private::Postgres(s) => s.stop(),
            Private::Kafka(s) => s.stop(),
            Private::Nats(s) => s.stop(),
            Private::RabbitMq(s) => s.stop(),
        });
        std::thread::sleep(DOWN_FOR);
        tokio::task::block_in_place(|| match self {
            Private::Postgres(s) => s.start(),
            Private::Kafka(s) => s.start(),
            Private::Nats(s) => s.start(),
            Private::RabbitMq(s) => s.start(),
        });
    }
}

/// `url` with its `host:port` replaced by the proxy's.
fn through(url: &str, proxy: &TcpProxy) -> String {
    url.replacen(common::host_port(url), &proxy.addr.to_string(), 1)
}

fn writer_options() -> WriterOptions {
    WriterOptions {
        aggregates: 50,
        writers: 3,
        rollback_ratio: 0.1,
        pause: Duration::from_millis(15),
        ..WriterOptions::default()
    }
}

async fn run(mode: Mode, broker: Broker, fault: Fault) {
    let started = Instant::now();
    let rig = common::Rig::load();
    // The database: the rig's, or a private one the fault restarts.
    let mut private = None;
    let mut test_db = None;
    let db_url = if fault == Fault::DbRestart {
        let pg = tokio::task::block_in_place(PrivatePostgres::start_new);
        let url = pg.url();
        private = Some(Private::Postgres(pg));
        url
    } else {
        let db = common::fresh_database().await;
        let url = db.url.clone();
        test_db = Some(db);
        url
    };
    let client = common::pg_connect(&db_url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
    common::create_outbox_table(&client, 4).await;
    // A private server goes with its slots; on the rig's, the guard drops the slot.
    let guard = (fault != Fault::DbRestart).then(|| SlotGuard::new(&db_url, "faults"));
    let slot = guard.as_ref().map_or_else(
        || format!("faults_{}", common::unique_suffix()),
        |g| g.slot.clone(),
    );
    if mode == Mode::LogTailing {
        common::create_replication(&client, &slot, &slot).await;
    }
    drop(client);
    // The broker: the rig's, or a private one the fault restarts. A Kafka client
    // connects to the addresses the broker advertises after the bootstrap, so a cut
    // between relay and Kafka needs a private broker that advertises the proxy.
    let mut kafka_proxy = None;
    let (broker_url, sink) = match (broker, fault) {
        (Broker::Kafka, Fault::BrokerCut) => {
            let port = common::private::free_port();
            let proxy = TcpProxy::start(&format!("127.0.0.1:{port}")).await;
            let advertised = proxy.addr.port();
            let kafka =
                tokio::task::block_in_place(|| PrivateKafka::start_advertising(port, advertised));
            let bootstrap = proxy.addr.to_string();
            let topic = format!("test-{}", common::unique_suffix());
            common::create_topic(&bootstrap, &topic, 4, &[]).await;
            private = Some(Private::Kafka(kafka));
            kafka_proxy = Some(proxy);
            (bootstrap.clone(), Sink::Kafka { bootstrap, topic })
        }
        (Broker::Kafka, Fault::BrokerRestart) => {
            let kafka = tokio::task::block_in_place(PrivateKafka::start_new);
            let topic = format!("test-{}", common::unique_suffix());
            common::create_topic(&kafka.bootstrap(), &topic, 4, &[]).await;
            let bootstrap = kafka.bootstrap();
            private = Some(Private::Kafka(kafka));
            (bootstrap.clone(), Sink::Kafka { bootstrap, topic })
        }
        (Broker::Nats, Fault::BrokerRestart) => {
            let nats = tokio::task::block_in_place(PrivateNats::start_new);
            let client = async_nats::connect(nats.url())
                .await
                .unwrap_or_else(|e| panic!("private NATS: {e}"));
            let stream = common::stream_on(client).await;
            let url = nats.url();
            private = Some(Private::Nats(nats));
            (url, Sink::Nats(Box::new(stream)))
        }
        (Broker::RabbitMq, Fault::BrokerRestart) => {
            let node = tokio::task::block_in_place(PrivateRabbitMq::start_new);
            let url = node.url();
            let queue = common::queue_on(
                common::amqp_connect_to(&url).await,
                &format!("test-{}", common::unique_suffix()),
            )
            .await;
            private = Some(Private::RabbitMq(node));
            (url.clone(), Sink::Amqp(Box::new(queue), Some(url)))
        }
        (Broker::Kafka, _) => (
            rig.kafka_bootstrap().to_owned(),
            Sink::Kafka {
                bootstrap: rig.kafka_bootstrap().to_owned(),
                topic: common::fresh_topic(4).await,
            },
        ),
        (Broker::Nats, _) => (
            rig.nats_url().to_owned(),
            Sink::Nats(Box::new(common::fresh_stream().await)),
        ),
        (Broker::RabbitMq, _) => (
            rig.amqp_url().to_owned(),
            Sink::Amqp(Box::new(common::fresh_queue().await), None),
        ),
    };
    let db_proxy = match fault {
        Fault::DbCut => Some(TcpProxy::start(common::host_port(&db_url)).await),
        _ => None,
    };
    let broker_proxy = match (fault, kafka_proxy) {
        (_, Some(proxy)) => Some(proxy),
        (Fault::BrokerCut, None) => Some(TcpProxy::start(common::host_port(&broker_url)).await),
        _ => None,
    };
    let broker_url = match &broker_proxy {
        Some(p) if broker != Broker::Kafka => through(&broker_url, p),
        _ => broker_url.clone(),
    };
    let relay_broker = match &sink {
        Sink::Kafka { topic, .. } => RelayBroker::Kafka {
            bootstrap: broker_url.clone(),
            topic: topic.clone(),
        },
        Sink::Nats(stream) => RelayBroker::Nats {
            url: broker_url.clone(),
            subject: format!("{}.{{aggregateType}}", stream.subject_prefix),
        },
        Sink::Amqp(queue, _) => RelayBroker::Amqp {
            url: broker_url.clone(),
            exchange: common::fresh_exchange_for(queue).await,
            routing_key: "outbox.{aggregateType}".to_owned(),
        },
    };
    let relay_db_url = db_proxy
        .as_ref()
        .map_or(db_url.clone(), |p| through(&db_url, p));
    // Polling to Kafka runs two batch loops, so each fault also meets one worker
    // mid-batch while the other selects or commits; NATS and RabbitMQ keep the default
    // single loop.
    let options = RelayOptions {
        max_attempts: 1000,
        workers: if broker == Broker::Kafka { 2 } else { 1 },
        ..RelayOptions::default()
    };
    let mut yaml = common::relay_config_yaml(&relay_broker, &options);
    if mode == Mode::LogTailing {
        yaml = common::with_spec_line(&yaml, "mode", &common::log_tailing_mode(&slot, true));
    }
    let start = || RelayProcess::start(&yaml, &relay_db_url, &relay_broker);
    let mut relay = start();

    let mut writer = AppWriter::start(&db_url, writer_options()).await;
    if fault != Fault::DbRestart {
        writer.allow(EVENTS);
    }
    let mut injected = 0usize;
    let mut ledgers = Vec::new();
    match fault {
        Fault::Kill => {
            while injected < KILLS {
                let pause = rand::rng().random_range(300..1200);
                tokio::time::sleep(Duration::from_millis(pause)).await;
                relay.kill();
                injected += 1;
                relay = start();
            }
        }
        Fault::DbCut | Fault::BrokerCut => {
            let proxy = db_proxy.as_ref().or(broker_proxy.as_ref());
            let proxy = proxy.unwrap_or_else(|| panic!("no proxy for {fault:?}"));
            while injected < CUTS {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let before = proxy.accepted();
                assert!(
                    before > 0,
                    "{fault:?}: the relay does not go through the proxy"
                );
                proxy.cut();
                tokio::time::sleep(CUT_FOR).await;
                proxy.heal();
                injected += 1;
            }
        }
        Fault::DbRestart => {
            // The application's connections do not survive the restart: half the
            // events before it (the relay still publishing them), half after.
            writer.allow(EVENTS / 2);
            writer.wait_committed(EVENTS / 2, WAIT).await;
            ledgers.push(writer.finish().await);
            if let Some(server) = private.as_mut() {
                server.restart();
            }
            injected = 1;
            writer = AppWriter::start(&db_url, writer_options()).await;
            writer.allow(EVENTS - EVENTS / 2);
        }
        Fault::BrokerRestart => {
            writer.wait_committed(EVENTS / 3, WAIT).await;
            if let Some(server) = private.as_mut() {
                server.restart();
            }
            injected = 1;
        }
    }
    ledgers.push(writer.finish().await);
    let mut committed = std::collections::BTreeSet::new();
    let mut aborted = std::collections::BTreeSet::new();
    for ledger in ledgers {
        committed.extend(ledger.committed);
        aborted.extend(ledger.aborted);
    }
    // Done means published and, log tailing, confirmed: every commit up to the WAL's
    // end now (the writer has finished) is behind the slot's confirmed position. An
    // empty table is not enough: the relays killed before the last one published and
    // deleted rows whose commits they never confirmed, so the last relay is still
    // replaying that window when the table empties; stopped then, its consumer would
    // see the window's older events again after their aggregates' newest ones.
    let (left_sql, end) = match mode {
        Mode::Polling => (
            "SELECT count(*) = 0 FROM public.outbox WHERE published_at IS NULL",
            None,
        ),
        Mode::LogTailing => {
            let client = common::pg_connect(&db_url)
                .await
                .unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
            let end: String = client
                .query_one("SELECT pg_current_wal_lsn()::text", &[])
                .await
                .unwrap_or_else(|e| panic!("PostgreSQL: {e}"))
                .get(0);
            (
                "SELECT (SELECT count(*) = 0 FROM public.outbox) AND coalesce((SELECT \
                 confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots \
                 WHERE slot_name = $1), false)",
                Some(end),
            )
        }
    };
    common::wait_for_some_or(
        "every committed event published (and, log tailing, confirmed)",
        WAIT,
        || {
            format!(
                "\n--- relay log tail ---\n{}\n--- private server log tail ---\n{}",
                relay.log_tail(40),
                private.as_ref().map(Private::log_tail).unwrap_or_default()
            )
        },
        || async {
            let Ok(c) = common::pg_connect(&db_url).await else {
                return None;
            };
            let done = match &end {
                None => c.query_one(left_sql, &[]).await,
                Some(end) => c.query_one(left_sql, &[&slot, end]).await,
            };
            done.is_ok_and(|r| r.get::<_, bool>(0)).then_some(())
        },
    )
    .await;
    // A cut closed the relay's connections and it came back through the proxy (it
    // reconnects when it next has something to send).
    if let Some(proxy) = db_proxy.as_ref().or(broker_proxy.as_ref()) {
        assert!(
            proxy.accepted() >= 2,
            "{fault:?}: the relay never reconnected through the proxy ({} connections)",
            proxy.accepted()
        );
    }
    let received = sink.received().await;
    let report = common::check_delivery(&received, &committed, &aborted);
    assert_audit_agrees(&report, &received, &committed);
    let status = relay.terminate(Duration::from_secs(30));
    let lost = report.missing.len();
    let reordered = report.order_violations.len();
    let stale = report.stale_redeliveries.len();
    println!(
        "| {fault:?} ×{injected} | {mode:?} | {broker:?} | {} events | {lost} lost | \
         {reordered} reordered | {stale} stale redeliveries | {} duplicates | {} rolled-back rows delivered | {:.0}s |",
        committed.len(),
        report.duplicates,
        report.orphans.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        status.success(),
        "relay exit {status}: {}",
        relay.log_tail(30)
    );
    assert_eq!(
        lost,
        0,
        "{fault:?}/{mode:?}/{broker:?}: lost, first {:?}",
        &report.missing[..lost.min(10)]
    );
    assert_eq!(
        reordered,
        0,
        "{fault:?}/{mode:?}/{broker:?}: order broken, first {:?}",
        &report.order_violations[..reordered.min(5)]
    );
    assert_eq!(
        stale,
        0,
        "{fault:?}/{mode:?}/{broker:?}: stale redeliveries, first {:?}",
        &report.stale_redeliveries[..stale.min(5)]
    );
    assert!(
        report.orphans.is_empty(),
        "rolled-back or foreign events delivered"
    );
    if let Sink::Nats(stream) = &sink {
        let _ = stream.jetstream.delete_stream(&stream.name).await;
    }
    drop(guard);
    if let Some(db) = test_db {
        db.drop_database().await;
    }
    drop(private);
}

macro_rules! scenario {
    ($name:ident, $fault:ident, $mode:ident, $broker:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            run(Mode::$mode, Broker::$broker, Fault::$fault).await;
        }
    };
}

scenario!(kill_polling_kafka, Kill, Polling, Kafka);
scenario!(kill_polling_nats, Kill, Polling, Nats);
scenario!(kill_polling_rabbitmq, Kill, Polling, RabbitMq);
scenario!(kill_log_tailing_kafka, Kill, LogTailing, Kafka);
scenario!(kill_log_tailing_nats, Kill, LogTailing, Nats);
scenario!(kill_log_tailing_rabbitmq, Kill, LogTailing, RabbitMq);
scenario!(db_cut_polling_kafka, DbCut, Polling, Kafka);
scenario!(db_cut_polling_nats, DbCut, Polling, Nats);
scenario!(db_cut_polling_rabbitmq, DbCut, Polling, RabbitMq);
scenario!(db_cut_log_tailing_kafka, DbCut, LogTailing, Kafka);
scenario!(db_cut_log_tailing_nats, DbCut, LogTailing, Nats);
scenario!(db_cut_log_tailing_rabbitmq, DbCut, LogTailing, RabbitMq);
scenario!(broker_cut_polling_kafka, BrokerCut, Polling, Kafka);
scenario!(broker_cut_log_tailing_kafka, BrokerCut, LogTailing, Kafka);
scenario!(broker_cut_polling_nats, BrokerCut, Polling, Nats);
scenario!(broker_cut_polling_rabbitmq, BrokerCut, Polling, RabbitMq);
scenario!(broker_cut_log_tailing_nats, BrokerCut, LogTailing, Nats);
scenario!(
    broker_cut_log_tailing_rabbitmq,
    BrokerCut,
    LogTailing,
    RabbitMq
);
scenario!(db_restart_polling_kafka, DbRestart, Polling, Kafka);
scenario!(db_restart_polling_nats, DbRestart, Polling, Nats);
scenario!(db_restart_polling_rabbitmq, DbRestart, Polling, RabbitMq);
scenario!(db_restart_log_tailing_kafka, DbRestart, LogTailing, Kafka);
scenario!(db_restart_log_tailing_nats, DbRestart, LogTailing, Nats);
scenario!(
    db_restart_log_tailing_rabbitmq,
    DbRestart,
    LogTailing,
    RabbitMq
);
scenario!(broker_restart_polling_kafka, BrokerRestart, Polling, Kafka);
scenario!(broker_restart_polling_nats, BrokerRestart, Polling, Nats);
scenario!(
    broker_restart_log_tailing_kafka,
    BrokerRestart,
    LogTailing,
    Kafka
);
scenario!(
    broker_restart_log_tailing_nats,
    BrokerRestart,
    LogTailing,
    Nats
);
scenario!(
    broker_restart_polling_rabbitmq,
    BrokerRestart,
    Polling,
    RabbitMq
);
scenario!(
    broker_restart_log_tailing_rabbitmq,
    BrokerRestart,
    LogTailing,
    RabbitMq
);

/// `outbox-operator audit`'s checker, given this run's committed rows (in id order, the
/// relay's order) and every delivery, finds what this matrix's own checker found: as
/// many rows missing, as many first delivered out of order, as many redeliveries.
fn assert_audit_agrees(
    report: &common::DeliveryReport,
    received: &[common::Received],
    committed: &std::collections::BTreeSet<i64>,
) {
    use outbox_operator::postgres::audit::AuditRow;
    let aggregate: std::collections::HashMap<i64, &str> = received
        .iter()
        .map(|r| (r.id, r.aggregate.as_str()))
        .collect();
    let rows: Vec<AuditRow> = committed
        .iter()
        .map(|id| AuditRow {
            id: id.to_string(),
            aggregate_id: aggregate.get(id).copied().unwrap_or("?").to_owned(),
            aggregate_type: String::new(),
        })
        .collect();
    let ours = |r: &&common::Received| committed.contains(&r.id);
    let delivered = vec![
        received
            .iter()
            .filter(ours)
            .map(|r| r.id.to_string())
            .collect::<Vec<_>>(),
    ];
    let audit = outbox_operator::audit::compare(&rows, &delivered);
    let count = |m: &std::collections::BTreeMap<String, Vec<_>>| m.values().map(Vec::len).sum();
    let missing: usize = count(&audit.missing);
    let reordered: usize = audit.out_of_order.values().map(Vec::len).sum();
    let redelivered = received.iter().filter(ours).count()
        - received
            .iter()
            .filter(ours)
            .map(|r| r.id)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
    assert_eq!(
        (missing, reordered, audit.redeliveries),
        (
            report.missing.len(),
            report.order_violations.len(),
            redelivered
        ),
        "the audit's checker and the matrix's disagree (missing, reordered, redeliveries)"
    );
    assert_eq!(
        audit.passed(),
        report.missing.is_empty() && report.order_violations.is_empty()
    );
}
