//! The rendered alerts in the rig's real Prometheus, scraping a real relay process that
//! publishes to the rig's NATS while rows keep arriving: silent while the relay is
//! healthy; OutboxRelayDown goes pending then firing once the relay is stopped; it
//! resolves once a relay runs again.
//!
//! The rig's Prometheus is shared with other tests: everything here (rules file, target
//! file, relay labels) is named after this test's random suffix and removed at the end.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{RelayBroker, RelayOptions, RelayProcess};
use outbox_operator::api::OutboxRelay;
use outbox_operator::resources::prometheus_rule;
use serde_json::{Value, json};

/// `for:` of every rule in this test: the rendered minutes, shortened so that the test
/// runs in seconds; several 1 s evaluations long, so the pending state is observable.
const FOR: &str = "4s";

/// Files this test dropped into the rig's Prometheus; removed (and Prometheus reloaded)
/// on drop, also when the test panics.
pub(crate) struct PrometheusFiles {
    base: String,
    pub(crate) rules: PathBuf,
    targets: PathBuf,
}

impl PrometheusFiles {
    /// Points the `tests` job at `addr`, with the target labels a ServiceMonitor scrape
    /// gives (`namespace`, `service`). Written aside and renamed so that Prometheus never
    /// reads half a file.
    pub(crate) fn set_target(&self, addr: &str, namespace: &str, service: &str) {
        let body =
            json!([{"targets": [addr], "labels": {"namespace": namespace, "service": service}}]);
        let tmp = self.targets.with_extension("tmp");
        std::fs::write(&tmp, body.to_string()).unwrap();
        std::fs::rename(&tmp, &self.targets).unwrap();
    }
}

impl Drop for PrometheusFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.rules);
        let _ = std::fs::remove_file(&self.targets);
        // Blocking client: Drop cannot await, and this may run during a panic.
        let base = self.base.clone();
        let _ = std::thread::spawn(move || reload_blocking(&base)).join();
    }
}

/// The rig's Prometheus (its URL, once it answers), an HTTP client for its API, and
/// the rule and target files of a test named by a fresh suffix (also returned).
pub(crate) async fn prometheus() -> (String, reqwest::Client, PrometheusFiles, String) {
    let rig = common::Rig::load();
    let base = rig.prometheus_url().to_owned();
    common::require_listening("Prometheus", common::host_port(&base)).await;
    let prometheus_dir = PathBuf::from(rig.get("OUTBOX_RIG_PROMETHEUS_DIR"));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let suffix = common::unique_suffix();
    let files = PrometheusFiles {
        base: base.clone(),
        rules: prometheus_dir.join(format!("rules/alerts-{suffix}.yml")),
        targets: prometheus_dir.join(format!("targets/alerts-{suffix}.json")),
    };
    (base, http, files, suffix)
}

fn reload_blocking(base: &str) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    runtime.block_on(async {
        let _ = reqwest::Client::new()
            .post(format!("{base}/-/reload"))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
    });
}

pub(crate) async fn reload(http: &reqwest::Client, base: &str) {
    let response = http
        .post(format!("{base}/-/reload"))
        .send()
        .await
        .unwrap_or_else(|err| panic!("POST {base}/-/reload: {err}"));
    assert!(
        response.status().is_success(),
        "Prometheus refused to reload: {} {}",
        response.status(),
        response.text().await.unwrap_or_default()
    );
}

/// An instant query's result vector (empty on any error: callers wait on it).
async fn query(http: &reqwest::Client, base: &str, promql: &str) -> Vec<Value> {
    let Ok(response) = http
        .get(format!("{base}/api/v1/query"))
        .query(&[("query", promql)])
        .send()
        .await
    else {
        return Vec::new();
    };
    let body: Value = response.json().await.unwrap_or_default();
    body["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn scalar(result: &[Value]) -> Option<f64> {
    result.first()?["value"][1].as_str()?.parse().ok()
}

/// Active (pending or firing) alerts of this relay, from `/api/v1/alerts`.
async fn alerts_of(http: &reqwest::Client, base: &str, ns: &str, name: &str) -> Vec<Value> {
    let body: Value = match http.get(format!("{base}/api/v1/alerts")).send().await {
        Ok(response) => response.json().await.unwrap_or_default(),
        Err(_) => return Vec::new(),
    };
    body["data"]["alerts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a["labels"]["relay_namespace"] == ns && a["labels"]["relay_name"] == name)
        .collect()
}

fn state_of(alerts: &[Value], alertname: &str) -> Option<String> {
    alerts
        .iter()
        .find(|a| a["labels"]["alertname"] == alertname)
        .and_then(|a| a["state"].as_str().map(str::to_owned))
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[tokio::test]
async fn relay_down_alert_fires_when_the_relay_stops_and_resolves_when_it_returns() {
    let rig = common::Rig::load();
    let (base, http, files, suffix) = prometheus().await;
    let ns = format!("alerts-{suffix}");
    let name = format!("relay-{suffix}");
    let service = format!("{name}-relay");

    // The rules exactly as the controller renders them for this relay, `for:` aside.
    let relay_yaml = format!(
        "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {{name: {name}, namespace: {ns}}}
spec:
  database: {{postgres: {{connectionSecretRef: {{name: db}}}}}}
  mode: {{polling: {{}}}}
  broker: {{nats: {{url: \"nats://nats:4222\"}}}}
  ordering: {{partitions: 4}}
  replicas: 1
  alerting: {{oldestUnpublishedAge: 30s, backlogRows: 1000}}
"
    );
    let relay_object: OutboxRelay = serde_yaml::from_str(&relay_yaml).unwrap();
    let valid = outbox_operator::spec::parse(&relay_object).unwrap_or_else(|e| panic!("{e}"));
    let mut spec = prometheus_rule(&valid, &outbox_operator::resources::BuildOptions::default())
        .unwrap()
        .data["spec"]
        .clone();
    let mut alert_names = Vec::new();
    for group in spec["groups"].as_array_mut().unwrap() {
        for rule in group["rules"].as_array_mut().unwrap() {
            rule["for"] = json!(FOR);
            alert_names.push(rule["alert"].as_str().unwrap().to_owned());
        }
    }

    // A relay publishing to NATS, with rows arriving all along.
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let stream = common::fresh_stream().await;
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("{}.orders", stream.subject_prefix),
    };
    let config = common::relay_config_yaml(&broker, &RelayOptions::default()).replace(
        "relay: {namespace: test, name: relay}",
        &format!("relay: {{namespace: {ns}, name: {name}}}"),
    );
    assert!(config.contains(&name), "relay identity not set: {config}");
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let writing = writing.clone();
        let url = db.url.clone();
        tokio::spawn(async move {
            let client = common::pg_connect(&url).await.unwrap();
            let mut i = 0u64;
            while writing.load(Ordering::Relaxed) {
                let aggregate = format!("agg-{}", i % 8);
                common::insert_row(&client, "Order", &aggregate, &json!({"seq": i})).await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            i
        })
    };
    let mut relay = RelayProcess::start(&config, &db.url, &broker);
    files.set_target(&relay.http_addr().await, &ns, &service);

    // Healthy first, as Prometheus sees it: scraped up, all partitions owned, rows
    // published. Only then the rules, so that no alert can be left over from start-up.
    let own = format!(r#"relay_namespace="{ns}",relay_name="{name}""#);
    let up = format!(r#"up{{namespace="{ns}",service="{service}"}}"#);
    common::wait_for_relays(
        "Prometheus to scrape a healthy relay",
        Duration::from_secs(60),
        &[&relay],
        || async {
            scalar(&query(&http, &base, &format!("max({up})")).await) == Some(1.0)
                && scalar(
                    &query(
                        &http,
                        &base,
                        &format!("sum(outbox_relay_partitions_owned{{{own}}})"),
                    )
                    .await,
                ) == Some(4.0)
                && scalar(
                    &query(
                        &http,
                        &base,
                        &format!("max(outbox_relay_published_total{{{own}}})"),
                    )
                    .await,
                )
                .is_some_and(|v| v > 0.0)
        },
    )
    .await;
    // Every metric the relay exports is documented (docs/metrics.md).
    let exposition = relay.metrics().await.expect("the relay serves /metrics");
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md")).unwrap();
    for family in exposition.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let metric = family.split(' ').next().unwrap();
        assert!(
            readme.contains(metric),
            "docs/metrics.md does not document {metric}"
        );
    }

    std::fs::write(&files.rules, serde_yaml::to_string(&spec).unwrap()).unwrap();
    reload(&http, &base).await;
    let group = format!("outbox-relay.{ns}.{name}");
    let loaded_at = now_unix();
    // Silent while healthy: the group is evaluated for well past `for:` (its last
    // evaluation, from Prometheus's own metrics, is 10 s after loading), and no alert of
    // this relay was active at any evaluation in between (ALERTS keeps the history,
    // pending included, so a blip between two polls is caught too).
    let evaluated = format!(
        r#"max(prometheus_rule_group_last_evaluation_timestamp_seconds{{rule_group=~".*;{group}"}})"#
    );
    common::wait_for_relays(
        "Prometheus to evaluate the relay's rules for 10 s",
        Duration::from_secs(60),
        &[&relay],
        || async {
            scalar(&query(&http, &base, &evaluated).await).is_some_and(|t| t >= loaded_at + 10.0)
        },
    )
    .await;
    let history = query(
        &http,
        &base,
        &format!("count_over_time(ALERTS{{{own}}}[1m])"),
    )
    .await;
    assert!(
        history.is_empty(),
        "alerts active on a healthy relay: {history:#?}"
    );
    let rules: Value = http
        .get(format!("{base}/api/v1/rules"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ours = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == group.as_str())
        .unwrap_or_else(|| panic!("group {group} not loaded: {rules}"));
    for rule in ours["rules"].as_array().unwrap() {
        assert_eq!(rule["health"], "ok", "{rule}");
        assert_eq!(rule["state"], "inactive", "{rule}");
    }
    assert_eq!(ours["rules"].as_array().unwrap().len(), alert_names.len());

    // Stop the relay; rows keep arriving. Down goes pending, then firing.
    let stopped_at = now_unix();
    relay.kill();
    let pending_seen = common::wait_for_some(
        "OutboxRelayDown to fire",
        Duration::from_secs(60),
        || async {
            let alerts = alerts_of(&http, &base, &ns, &name).await;
            match state_of(&alerts, "OutboxRelayDown").as_deref() {
                Some("firing") => Some(alerts),
                _ => None,
            }
        },
    )
    .await;
    let firing = pending_seen
        .iter()
        .find(|a| a["labels"]["alertname"] == "OutboxRelayDown")
        .unwrap();
    assert_eq!(firing["labels"]["severity"], "critical", "{firing}");
    assert!(
        firing["annotations"]["runbook_url"]
            .as_str()
            .unwrap()
            .ends_with("#outboxrelaydown"),
        "{firing}"
    );
    // It was pending before it fired (ALERTS history since the stop).
    let window = (now_unix() - stopped_at).ceil() as u64 + 2;
    let pending = query(
        &http,
        &base,
        &format!(
            r#"count_over_time(ALERTS{{{own},alertname="OutboxRelayDown",alertstate="pending"}}[{window}s])"#
        ),
    )
    .await;
    assert!(
        !pending.is_empty(),
        "OutboxRelayDown fired without being pending first"
    );
    let backlog = common::unpublished_rows(&db.client).await;
    assert!(backlog > 0, "rows kept arriving while the relay was down");

    // A relay again (new process, new address, as a new pod would be): Down resolves
    // and the rows written meanwhile are published.
    let relay = RelayProcess::start(&config, &db.url, &broker);
    files.set_target(&relay.http_addr().await, &ns, &service);
    common::wait_for_relays(
        "OutboxRelayDown to resolve",
        Duration::from_secs(60),
        &[&relay],
        || async {
            state_of(
                &alerts_of(&http, &base, &ns, &name).await,
                "OutboxRelayDown",
            )
            .is_none()
        },
    )
    .await;
    writing.store(false, Ordering::Relaxed);
    let written = writer.await.unwrap();
    let client = &db.client;
    common::wait_for_relays(
        "the rows written while the relay was down to be published",
        Duration::from_secs(60),
        &[&relay],
        || async { common::unpublished_rows(client).await == 0 },
    )
    .await;
    let still_active = alerts_of(&http, &base, &ns, &name).await;
    assert!(
        still_active.is_empty(),
        "alerts after recovery: {still_active:#?}"
    );
    println!("rows written: {written}; unpublished while down (at firing): {backlog}");
    drop(relay);
    drop(files);
    db.drop_database().await;
}

/// A log-tailing relay stalled on its broker (no JetStream stream captures its subject)
/// exports its backlog: keeping rows, the unacknowledged rows of its batch and their
/// commit age; deleting rows, the table's rows and their age — and the shipped
/// OutboxRelayOldestUnpublishedTooOld fires for it in the rig's Prometheus. (Before,
/// only polling relays set these metrics, so the alert could never fire for log
/// tailing.)
#[tokio::test]
async fn the_oldest_unpublished_alert_fires_for_a_stalled_log_tailing_relay() {
    let rig = common::Rig::load();
    let (base, http, files, suffix) = prometheus().await;
    let ns = format!("alerts-{suffix}");
    let name = format!("tail-{suffix}");
    let service = format!("{name}-relay");
    let relay_yaml = format!(
        "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {{name: {name}, namespace: {ns}}}
spec:
  database: {{postgres: {{connectionSecretRef: {{name: db}}}}}}
  mode: {{logTailing: {{deleteAfterPublish: true}}}}
  broker: {{nats: {{url: \"nats://nats:4222\"}}}}
  alerting: {{oldestUnpublishedAge: 5s}}
"
    );
    let relay_object: OutboxRelay = serde_yaml::from_str(&relay_yaml).unwrap();
    let valid = outbox_operator::spec::parse(&relay_object).unwrap_or_else(|e| panic!("{e}"));
    let mut spec = prometheus_rule(&valid, &outbox_operator::resources::BuildOptions::default())
        .unwrap()
        .data["spec"]
        .clone();
    for group in spec["groups"].as_array_mut().unwrap() {
        for rule in group["rules"].as_array_mut().unwrap() {
            rule["for"] = json!(FOR);
        }
    }

    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    for i in 0..5 {
        common::insert_row(&db.client, "Order", &format!("agg-{i}"), &json!({"seq": i})).await;
    }
    // Nothing captures this subject: every publish is refused as an outage and retried.
    let broker = RelayBroker::Nats {
        url: rig.nats_url().to_owned(),
        subject: format!("nowhere.{suffix}"),
    };
    let config_for = |slot: &str, delete: bool| {
        let yaml = common::relay_config_yaml(&broker, &RelayOptions::default()).replace(
            "relay: {namespace: test, name: relay}",
            &format!("relay: {{namespace: {ns}, name: {name}}}"),
        );
        common::with_spec_line(&yaml, "mode", &common::log_tailing_mode(slot, delete))
    };
    let metric = |text: &str, family: &str| common::metric_value(text, family).unwrap_or(-1.0);

    // Keeping rows: the batch in flight. The slot starts now, so write after it.
    let guard = common::SlotGuard::new(rig.pg_url(), "stallkeep");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let relay = RelayProcess::start(&config_for(&guard.slot, false), &db.url, &broker);
    for i in 0..5 {
        common::insert_row(
            &db.client,
            "Order",
            &format!("keep-{i}"),
            &json!({"seq": i}),
        )
        .await;
    }
    let (rows, age) = common::wait_for_some_or(
        "the in-flight backlog in the relay's metrics",
        Duration::from_secs(60),
        || relay.log_tail(30),
        || async {
            let text = relay.metrics().await?;
            let rows = metric(&text, "outbox_relay_backlog_rows");
            let age = metric(&text, "outbox_relay_oldest_unpublished_age_seconds");
            // The stream stops at the first refused batch: it may hold one row (its
            // own commit) or all five, as the commits arrived.
            (rows >= 1.0 && age >= 2.0).then_some((rows, age))
        },
    )
    .await;
    println!("keeping rows, stalled: backlog {rows} rows, oldest {age:.1}s");
    drop(relay);
    drop(guard);

    // Deleting rows: the table, and the alert.
    let guard = common::SlotGuard::new(rig.pg_url(), "stalldel");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let relay = RelayProcess::start(&config_for(&guard.slot, true), &db.url, &broker);
    files.set_target(&relay.http_addr().await, &ns, &service);
    std::fs::write(&files.rules, serde_yaml::to_string(&spec).unwrap()).unwrap();
    reload(&http, &base).await;
    let alerts = common::wait_for_some(
        "OutboxRelayOldestUnpublishedTooOld to fire",
        Duration::from_secs(90),
        || async {
            let alerts = alerts_of(&http, &base, &ns, &name).await;
            (state_of(&alerts, "OutboxRelayOldestUnpublishedTooOld").as_deref() == Some("firing"))
                .then_some(alerts)
        },
    )
    .await;
    let text = relay.metrics().await.expect("the relay serves /metrics");
    let rows = metric(&text, "outbox_relay_backlog_rows");
    assert!(rows >= 10.0, "the table's 10 waiting rows, got {rows}");
    println!(
        "deleting rows, stalled: backlog {rows} rows; firing: {:?}",
        alerts
            .iter()
            .map(|a| a["labels"]["alertname"].as_str().unwrap_or_default())
            .collect::<Vec<_>>()
    );
    drop(relay);
    drop(guard);
    drop(files);
    db.drop_database().await;
}
