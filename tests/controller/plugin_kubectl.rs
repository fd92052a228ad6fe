//! `kubectl outbox` as kubectl runs it: the binary linked as `kubectl-outbox` on the
//! `PATH`, the rig's real kubectl and API server, the rig's kubeconfig in `KUBECONFIG`.
//! `status` prints what the relays' status says (golden: tests/golden/
//! kubectl-outbox-status.txt; `UPDATE_GOLDEN=1` rewrites it); `suspend`, `resume` and
//! `scale` change the relay as they say, and the API server's refusal of a second
//! log-tailing pod reaches the user in its own words, with a failed exit status.

use std::process::Output;
use std::time::Duration;

use crate::common::{self, operator};
use kube::api::{Api, Patch, PatchParams};
use outbox_operator::api::OutboxRelay;
use serde_json::{Value, json};

use common::plugin::kubectl_outbox;

fn succeeded(output: &Output) -> String {
    assert!(
        output.status.success(),
        "{}",
        common::describe_output(output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn relay(name: &str, mode: Value, broker: Value) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db"}}},
            "mode": mode,
            "broker": broker,
            "replicas": 1
        }
    })
}

fn ready(status: &str, reason: &str) -> Value {
    json!([{"type": "Ready", "status": status, "reason": reason, "message": reason,
            "lastTransitionTime": "2026-12-07T10:00:00Z"}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_outbox_shows_and_changes_relays() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let ns = common::fresh_namespace(&client).await;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &ns);
    // No controller runs here: the test writes the status a controller would.
    for (name, manifest, status) in [
        (
            "orders",
            relay(
                "orders",
                json!({"polling": {}}),
                json!({"nats": {"url": "nats://nats:4222"}}),
            ),
            json!({"conditions": ready("True", "Publishing"), "mode": "polling",
                   "broker": "nats", "backlogRows": 12, "oldestUnpublishedAge": "3s",
                   "oldestUnpublishedAgeSeconds": 3.2, "replicas": 1,
                   "partitions": {"desired": 4, "owned": 3}}),
        ),
        (
            "payments",
            relay(
                "payments",
                json!({"logTailing": {}}),
                json!({"kafka": {"bootstrapServers": "kafka:9092"}}),
            ),
            json!({"conditions": ready("False", "BrokerUnavailable"), "mode": "logTailing",
                   "broker": "kafka", "backlogRows": 48211, "oldestUnpublishedAge": "4m12s",
                   "oldestUnpublishedAgeSeconds": 252.0, "replicas": 1, "deadLetterRows": 2,
                   "slot": {"name": "outbox_payments", "retainedWalBytes": 3_355_443_i64},
                   "lastAudit": {"job": "payments-audit-x1", "verdict": "Failed", "rows": 40,
                                 "deliveries": 39, "missing": 1, "message": "audit FAILED"}}),
        ),
    ] {
        relays
            .patch(
                name,
                &PatchParams::apply("plugin-test"),
                &Patch::Apply(&manifest),
            )
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        relays
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await
            .unwrap_or_else(|e| panic!("{name} status: {e}"));
    }

    let status = succeeded(&kubectl_outbox(&["status", "-n", &ns]));
    let golden = format!(
        "{}/tests/golden/kubectl-outbox-status.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, &status).unwrap();
    }
    let want = std::fs::read_to_string(&golden)
        .unwrap_or_else(|e| panic!("{golden}: {e} (UPDATE_GOLDEN=1 writes it)"));
    assert_eq!(status, want, "kubectl outbox status differs from {golden}");
    let all = succeeded(&kubectl_outbox(&["status", "-A"]));
    assert!(
        all.starts_with("NAMESPACE ")
            && all
                .lines()
                .any(|l| l.starts_with(&ns) && l.contains("payments")),
        "{all}"
    );

    let spec_of = |relay: OutboxRelay| serde_json::to_value(relay.spec).unwrap();
    assert_eq!(
        succeeded(&kubectl_outbox(&["suspend", "orders", "-n", &ns])),
        "outboxrelay.outbox.dev/orders suspended\n"
    );
    assert_eq!(
        spec_of(relays.get("orders").await.unwrap())["suspend"],
        json!(true)
    );
    succeeded(&kubectl_outbox(&["resume", "orders", "-n", &ns]));
    assert_ne!(
        spec_of(relays.get("orders").await.unwrap())["suspend"],
        json!(true)
    );
    assert_eq!(
        succeeded(&kubectl_outbox(&[
            "scale",
            "orders",
            "--replicas",
            "3",
            "-n",
            &ns
        ])),
        "outboxrelay.outbox.dev/orders scaled to 3\n"
    );
    assert_eq!(
        spec_of(relays.get("orders").await.unwrap())["replicas"],
        json!(3)
    );
    // Log tailing: one pod reads the slot; the API server refuses more.
    let refused = kubectl_outbox(&["scale", "payments", "--replicas", "2", "-n", &ns]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success()
            && stderr.contains("a log-tailing relay runs one pod")
            && !stderr.contains("Status {"),
        "{}",
        common::describe_output(&refused)
    );
    assert_eq!(
        spec_of(relays.get("payments").await.unwrap())["replicas"],
        json!(1)
    );
    operator::delete_relays(&client, &ns, Duration::from_secs(30)).await;
    common::delete_namespace(&client, &ns).await;
}
