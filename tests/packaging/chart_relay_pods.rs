//! The chart's relay-pod defaults reach the relay pods: the operator's flags, as the
//! chart renders them, parsed by the controller's own argument parser and turned into a
//! relay Deployment by the builders the controller uses. No fixed user unless asked, the
//! operator's pull Secrets inherited, the pull policy the chart's.

use crate::chart_common;

use chart_common::{documents, template};
use clap::Parser;
use outbox_operator::controller::ControllerArgs;
use serde_json::Value;

/// `outbox-operator controller`'s flags, parsed as the binary parses them.
#[derive(Parser)]
struct Controller {
    #[command(flatten)]
    args: ControllerArgs,
}

/// Everything the chart renders for `values`, and every object its controller (the
/// operator Deployment's flags, parsed by the controller's own parser) builds for the
/// example manifest `example`.
pub(crate) fn chart_and_relay(values: &[&str], example: &str) -> (Vec<Value>, Vec<Value>) {
    let rendered = template("ops", "operators", values);
    let chart = documents(&rendered);
    let operator = chart
        .iter()
        .find(|doc| doc["kind"] == "Deployment")
        .expect("the operator's Deployment");
    let args: Vec<String> = operator["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("the operator's args")
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    let parsed = Controller::try_parse_from(&args)
        .unwrap_or_else(|e| panic!("the controller refuses the chart's flags {args:?}: {e}"));
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(example);
    let objects =
        outbox_operator::render::render_file(&example, &parsed.args.build).expect("render");
    (chart, documents(&objects))
}

/// The chart's operator Deployment for `values`, and the relay Deployment its
/// controller would build for the polling Kafka example.
fn operator_and_relay(values: &[&str]) -> (Value, Value) {
    let (chart, relay) = chart_and_relay(values, "polling-kafka.yaml");
    let deployment = |docs: Vec<Value>| {
        docs.into_iter()
            .find(|doc| doc["kind"] == "Deployment")
            .expect("a Deployment")
    };
    (deployment(chart), deployment(relay))
}

fn pod(deployment: &Value) -> &Value {
    &deployment["spec"]["template"]["spec"]
}

fn projected_mode(relay: &Value) -> i64 {
    pod(relay)["volumes"][0]["projected"]["defaultMode"]
        .as_i64()
        .expect("the projected volume's mode")
}

#[test]
fn by_default_no_user_is_fixed_and_mounted_files_are_readable_by_any() {
    let (operator, relay) = operator_and_relay(&[]);
    for (what, deployment) in [("operator", &operator), ("relay", &relay)] {
        let security = &pod(deployment)["securityContext"];
        assert_eq!(security["runAsNonRoot"], true, "{what}: {security}");
        for field in ["runAsUser", "runAsGroup", "fsGroup"] {
            assert!(
                security.get(field).is_none(),
                "{what} pods fix {field}, which OpenShift's restricted SCC refuses: {security}"
            );
        }
    }
    // Without fsGroup the files belong to root: whatever user runs must read them.
    assert_eq!(projected_mode(&relay), 0o444);
    let container = &pod(&relay)["containers"][0];
    assert_eq!(container["imagePullPolicy"], "IfNotPresent");
    assert!(pod(&relay).get("imagePullSecrets").is_none());
}

#[test]
fn operator_pull_secrets_and_chosen_ids_reach_the_relay_pods() {
    let (operator, relay) = operator_and_relay(&[
        "--set",
        "imagePullSecrets[0].name=regcred",
        "--set",
        "image.pullPolicy=Always",
        "--set",
        "relayPods.runAsUser=1000680000",
        "--set",
        "relayPods.runAsGroup=0",
        "--set",
        "relayPods.fsGroup=1000680000",
    ]);
    assert_eq!(pod(&operator)["imagePullSecrets"][0]["name"], "regcred");
    let relay_pod = pod(&relay);
    assert_eq!(
        relay_pod["imagePullSecrets"],
        serde_json::json!([{"name": "regcred"}])
    );
    assert_eq!(relay_pod["containers"][0]["imagePullPolicy"], "Always");
    let security = &relay_pod["securityContext"];
    assert_eq!(security["runAsUser"], 1_000_680_000, "{security}");
    assert_eq!(security["runAsGroup"], 0, "{security}");
    assert_eq!(security["fsGroup"], 1_000_680_000, "{security}");
    // A group owns the files: readable by it only.
    assert_eq!(projected_mode(&relay), 0o440);

    // relayPods.imagePullSecrets replaces the operator's own for the relays.
    let (_, relay) = operator_and_relay(&[
        "--set",
        "imagePullSecrets[0].name=regcred",
        "--set",
        "relayPods.imagePullSecrets[0].name=relays-pull",
        "--set",
        "relayPods.imagePullPolicy=Never",
    ]);
    assert_eq!(
        pod(&relay)["imagePullSecrets"],
        serde_json::json!([{"name": "relays-pull"}])
    );
    assert_eq!(pod(&relay)["containers"][0]["imagePullPolicy"], "Never");
}
