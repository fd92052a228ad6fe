//! The scenarios of the matrix (see main.rs) and the one runner they share.

use crate::common;

use std::time::{Duration, Instant};

use common::app_writer::{AppWriter, WriterOptions};
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
}

/// Where the scenario's messages go, and the test's own consumer of them.
enum Sink {
    Kafka(String),
    Nats(Box<common::TestStream>),
    Amqp(Box<common::TestQueue>),
}

impl Sink {
    async fn received(&self) -> Vec<common::Received> {
        match self {
            Sink::Kafka(topic) => {
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || common::consume_kafka(&topic))
                    .await
                    .unwrap_or_else(|e| panic!("Kafka consumer task: {e}"))
            }
            Sink::Nats(stream) => common::consume_nats(stream).await,
            Sink::Amqp(queue) => common::consume_amqp(queue).await,
        }
    }
}

/// `url` with its `host:port` replaced by the proxy's.
fn through(url: &str, proxy: &TcpProxy) -> String {
    url.replacen(common::host_port(url), &proxy.addr.to_string(), 1)
}

async fn run(mode: Mode, broker: Broker, fault: Fault) {
    let started = Instant::now();
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let guard = SlotGuard::new(rig.pg_url(), "faults");
    if mode == Mode::LogTailing {
        common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    }
    let (broker_url, sink) = match broker {
        Broker::Kafka => (
            rig.kafka_bootstrap().to_owned(),
            Sink::Kafka(common::fresh_topic(4).await),
        ),
        Broker::Nats => (
            rig.nats_url().to_owned(),
            Sink::Nats(Box::new(common::fresh_stream().await)),
        ),
        Broker::RabbitMq => (
            rig.amqp_url().to_owned(),
            Sink::Amqp(Box::new(common::fresh_queue().await)),
        ),
    };
    let db_proxy = match fault {
        Fault::DbCut => Some(TcpProxy::start(common::host_port(&db.url)).await),
        _ => None,
    };
    let broker_proxy = match fault {
        Fault::BrokerCut => Some(TcpProxy::start(common::host_port(&broker_url)).await),
        _ => None,
    };
    let broker_url = broker_proxy
        .as_ref()
        .map_or(broker_url.clone(), |p| through(&broker_url, p));
    let relay_broker = match &sink {
        Sink::Kafka(topic) => RelayBroker::Kafka {
            bootstrap: broker_url.clone(),
            topic: topic.clone(),
        },
        Sink::Nats(stream) => RelayBroker::Nats {
            url: broker_url.clone(),
            subject: format!("{}.{{aggregateType}}", stream.subject_prefix),
        },
        Sink::Amqp(queue) => RelayBroker::Amqp {
            url: broker_url.clone(),
            exchange: common::fresh_exchange_for(queue).await,
            routing_key: "outbox.{aggregateType}".to_owned(),
        },
    };
    let relay_db_url = db_proxy
        .as_ref()
        .map_or(db.url.clone(), |p| through(&db.url, p));
    let options = RelayOptions {
        max_attempts: 1000,
        ..RelayOptions::default()
    };
    let mut yaml = common::relay_config_yaml(&relay_broker, &options);
    if mode == Mode::LogTailing {
        yaml = common::with_spec_line(&yaml, "mode", &common::log_tailing_mode(&guard.slot, true));
    }
    let start = || RelayProcess::start(&yaml, &relay_db_url, &relay_broker);
    let mut relay = start();

    let writer = AppWriter::start(
        &db.url,
        WriterOptions {
            aggregates: 50,
            writers: 3,
            rollback_ratio: 0.1,
            pause: Duration::from_millis(15),
            ..WriterOptions::default()
        },
    )
    .await;
    writer.allow(EVENTS);
    let mut injected = 0usize;
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
                proxy.cut();
                tokio::time::sleep(CUT_FOR).await;
                proxy.heal();
                injected += 1;
            }
        }
    }
    let ledger = writer.finish().await;
    let left_sql = match mode {
        Mode::Polling => "SELECT count(*) FROM public.outbox WHERE published_at IS NULL",
        Mode::LogTailing => "SELECT count(*) FROM public.outbox",
    };
    common::wait_for_relays(
        "every committed event published",
        WAIT,
        &[&relay],
        || async {
            db.client
                .query_one(left_sql, &[])
                .await
                .is_ok_and(|r| r.get::<_, i64>(0) == 0)
        },
    )
    .await;
    let received = sink.received().await;
    let report = common::check_delivery(&received, &ledger.committed, &ledger.aborted);
    let status = relay.terminate(Duration::from_secs(30));
    let lost = report.missing.len();
    let reordered = report.order_violations.len();
    println!(
        "| {fault:?} ×{injected} | {mode:?} | {broker:?} | {} events | {lost} lost | \
         {reordered} reordered | {} duplicates | {} rolled-back rows delivered | {:.0}s |",
        ledger.committed.len(),
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
    assert!(
        report.orphans.is_empty(),
        "rolled-back or foreign events delivered"
    );
    if let Sink::Nats(stream) = &sink {
        let _ = stream.jetstream.delete_stream(&stream.name).await;
    }
    drop(guard);
    db.drop_database().await;
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
scenario!(broker_cut_polling_nats, BrokerCut, Polling, Nats);
scenario!(broker_cut_polling_rabbitmq, BrokerCut, Polling, RabbitMq);
scenario!(broker_cut_log_tailing_nats, BrokerCut, LogTailing, Nats);
scenario!(
    broker_cut_log_tailing_rabbitmq,
    BrokerCut,
    LogTailing,
    RabbitMq
);
