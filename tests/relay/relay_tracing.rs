//! A trace continues from the request that wrote the outbox row: the relay, given an
//! OTLP endpoint, sends a producer span per publish whose parent is the row's
//! `traceparent`. The collector is a small OTLP/HTTP server in this test that keeps
//! every JSON export it receives.

use crate::common::{self, RelayBroker, RelayProcess};

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// An OTLP/HTTP collector on loopback: every body POSTed to `/v1/traces`, as JSON.
struct Collector {
    addr: std::net::SocketAddr,
    exports: Arc<Mutex<Vec<serde_json::Value>>>,
}

impl Collector {
    async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let exports = Arc::new(Mutex::new(Vec::new()));
        let kept = exports.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let kept = kept.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                        let kept = kept.clone();
                        async move {
                            let path = request.uri().path().to_owned();
                            let json = request
                                .headers()
                                .get("content-type")
                                .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
                            let body = request.into_body().collect().await?.to_bytes();
                            let status = if path == "/v1/traces" && json {
                                match serde_json::from_slice(&body) {
                                    Ok(v) => {
                                        kept.lock().unwrap().push(v);
                                        200
                                    }
                                    Err(_) => 400,
                                }
                            } else {
                                415
                            };
                            Ok::<_, hyper::Error>(
                                Response::builder()
                                    .status(status)
                                    .header("content-type", "application/json")
                                    .body(Full::new(bytes::Bytes::from_static(b"{}")))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Collector { addr, exports }
    }

    /// Every span received so far, with its resource's `service.name`.
    fn spans(&self) -> Vec<(String, serde_json::Value)> {
        let exports = self.exports.lock().unwrap();
        let mut out = Vec::new();
        for export in exports.iter() {
            for rs in export["resourceSpans"].as_array().into_iter().flatten() {
                let service = rs["resource"]["attributes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|a| a["key"] == "service.name")
                    .and_then(|a| a["value"]["stringValue"].as_str())
                    .unwrap_or_default()
                    .to_owned();
                for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                    for span in ss["spans"].as_array().into_iter().flatten() {
                        out.push((service.clone(), span.clone()));
                    }
                }
            }
        }
        out
    }
}

fn attribute<'a>(span: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_publish_is_a_producer_span_under_the_rows_traceparent() {
    let collector = Collector::start().await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: common::Rig::load().kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let yaml = common::relay_config_yaml(&broker, &common::RelayOptions::default()).replace(
        "\nlisten:",
        &format!(
            "\n  tracing: {{otlpEndpoint: \"http://{}\", serviceName: orders-relay}}\nlisten:",
            collector.addr
        ),
    );
    // Two rows in one trace (two requests' spans), one row with no trace.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parents = ["00f067aa0ba902b7", "b7ad6b7169203331"];
    let mut ids = Vec::new();
    for (i, parent) in parents.iter().enumerate() {
        let row = db
            .client
            .query_one(
                "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, traceparent) \
                 VALUES ('order', $1, 'Placed', '{}', $2) RETURNING id",
                &[&format!("o-{i}"), &format!("00-{trace}-{parent}-01")],
            )
            .await
            .unwrap();
        ids.push(row.get::<_, i64>(0));
    }
    let untraced: i64 = db
        .client
        .query_one(
            "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) \
             VALUES ('order', 'o-9', 'Placed', '{}') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // A row Kafka refuses (over the producer's message.max.bytes): its failure is
    // logged with the trace it belongs to.
    let refused_trace = "0af7651916cd43dd8448eb211c80319c";
    db.client
        .execute(
            "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload, traceparent) \
             VALUES ('order', 'o-big', 'Placed', jsonb_build_object('x', repeat('x', 1500000)), $1)",
            &[&format!("00-{refused_trace}-b9c7c989f97918e1-01")],
        )
        .await
        .unwrap();
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    let deadline = Instant::now() + Duration::from_secs(60);
    let spans = loop {
        let spans = collector.spans();
        if spans.len() >= 3 {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "{} spans reached the collector in 60 s:\n{}",
            spans.len(),
            relay.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for (i, id) in ids.iter().enumerate() {
        let (service, span) = spans
            .iter()
            .find(|(_, s)| {
                attribute(s, "messaging.message.id").and_then(|v| v["stringValue"].as_str())
                    == Some(&id.to_string())
            })
            .unwrap_or_else(|| panic!("no span for row {id}: {spans:#?}"));
        assert_eq!(service, "orders-relay");
        assert_eq!(span["traceId"], trace, "{span:#}");
        assert_eq!(span["parentSpanId"], parents[i], "{span:#}");
        // SPAN_KIND_PRODUCER.
        assert_eq!(span["kind"], 4, "{span:#}");
        assert_eq!(span["name"], format!("send {topic}"), "{span:#}");
        assert_eq!(
            attribute(span, "messaging.system").and_then(|v| v["stringValue"].as_str()),
            Some("kafka")
        );
        assert_eq!(
            attribute(span, "messaging.destination.name").and_then(|v| v["stringValue"].as_str()),
            Some(topic.as_str())
        );
        assert_ne!(span["spanId"], parents[i]);
    }
    // The records carry the publish span on: a consumer's span is its child.
    let topic_for_consumer = topic.clone();
    let received = tokio::task::spawn_blocking(move || common::consume_kafka(&topic_for_consumer))
        .await
        .unwrap();
    for (i, id) in ids.iter().enumerate() {
        let (_, span) = spans
            .iter()
            .find(|(_, s)| {
                attribute(s, "messaging.message.id").and_then(|v| v["stringValue"].as_str())
                    == Some(&id.to_string())
            })
            .unwrap();
        let record = received.iter().find(|r| r.id == *id).unwrap();
        assert_eq!(
            record.headers.get("traceparent").map(String::as_str),
            Some(format!("00-{trace}-{}-01", span["spanId"].as_str().unwrap()).as_str()),
            "row {id} (parent {})",
            parents[i]
        );
    }
    // A row without a traceparent starts a trace of its own.
    let (_, own) = spans
        .iter()
        .find(|(_, s)| {
            attribute(s, "messaging.message.id").and_then(|v| v["stringValue"].as_str())
                == Some(&untraced.to_string())
        })
        .unwrap_or_else(|| panic!("no span for row {untraced}: {spans:#?}"));
    assert_ne!(own["traceId"], trace);
    assert!(
        own["parentSpanId"].as_str().unwrap_or_default().is_empty(),
        "{own:#}"
    );
    common::wait_for_relays(
        "the refused row's failure to be logged with its trace id",
        Duration::from_secs(60),
        &[&relay],
        || async {
            relay.log().lines().any(|l| {
                l.contains("publish failed")
                    && l.contains(&format!("\"trace_id\":\"{refused_trace}\""))
            })
        },
    )
    .await;
    drop(relay);
    db.drop_database().await;
}
