//! Smoke test: the rig's Prometheus server scrapes for real and answers queries.

use crate::common;

use std::time::Duration;

use serde_json::Value;

#[tokio::test]
async fn prometheus_scrapes_itself_and_answers_queries() {
    let rig = common::Rig::load();
    let base = rig.prometheus_url();
    common::require_listening("Prometheus", common::host_port(base)).await;
    let http = reqwest::Client::new();
    // A scrape target shows up a few seconds after start: wait on the query, never sleep.
    let value = common::wait_for_some(
        "Prometheus to report up{job=\"prometheus\"} == 1",
        Duration::from_secs(30),
        || {
            let http = http.clone();
            async move {
                let body: Value = http
                    .get(format!("{base}/api/v1/query"))
                    .query(&[("query", "up{job=\"prometheus\"}")])
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                let sample = body["data"]["result"].get(0)?;
                let value = sample["value"][1].as_str()?.to_owned();
                (value == "1").then_some(value)
            }
        },
    )
    .await;
    assert_eq!(value, "1");

    // A real PromQL engine: a malformed query is rejected with an error.
    let bad: Value = http
        .get(format!("{base}/api/v1/query"))
        .query(&[("query", "sum(")])
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(bad["status"], "error", "{bad}");
}
