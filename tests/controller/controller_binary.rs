//! `outbox-operator controller` as a process: JSON logs, its own /healthz and /metrics,
//! leadership shown in metrics, and a clean exit on SIGTERM.

use crate::common;

use std::process::{Command, Stdio};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn controller_serves_health_and_metrics_and_stops_on_sigterm() {
    let rig = common::Rig::load();
    let client = common::kube_client().await;
    let ns = common::fresh_namespace(&client).await;
    let port = common::private::free_port();
    // Logs go to a file: a pipe nobody reads while waiting would fill and block the child.
    let log_dir = tempfile::tempdir().unwrap();
    let log_path = log_dir.path().join("controller.log");
    let log_file = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-operator"))
        .args([
            "controller",
            "--namespace",
            &ns,
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--identity",
            "binary-test",
        ])
        .env("KUBECONFIG", rig.kubeconfig())
        .env_remove("POD_NAMESPACE")
        .env_remove("POD_NAME")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log_file))
        .spawn()
        .unwrap();

    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    common::wait_for("/healthz to answer 200", WAIT, || async {
        http.get(format!("{base}/healthz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
    common::wait_for("/metrics to report leadership", WAIT, || async {
        match http.get(format!("{base}/metrics")).send().await {
            Ok(r) => r
                .text()
                .await
                .is_ok_and(|t| t.lines().any(|l| l == "outbox_operator_leader 1")),
            Err(_) => false,
        }
    })
    .await;

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
    let stderr = std::fs::read_to_string(&log_path).unwrap();
    let status = exit.unwrap_or_else(|| {
        panic!("the controller did not exit within 60s of SIGTERM; log:\n{stderr}")
    });
    assert!(status.success(), "exit {status}; stderr:\n{stderr}");
    assert!(
        !stderr.contains("did not finish in time") && !stderr.contains("did not stop in time"),
        "a shutdown step ran into its limit:\n{stderr}"
    );
    // Every log line is a JSON object.
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        let parsed: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
        assert!(parsed["level"].is_string(), "{line}");
    }
    assert!(
        stderr.contains("outbox-operator controller stopped"),
        "{stderr}"
    );
    common::delete_namespace(&client, &ns).await;
}
