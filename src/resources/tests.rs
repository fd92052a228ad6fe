//! Unit tests of the pure object builders, from inline manifests.

use k8s_openapi::api::core::v1::ConfigMap;

use super::*;

fn relay(yaml: &str) -> OutboxRelay {
    let mut relay: OutboxRelay = serde_yaml::from_str(yaml).unwrap();
    relay.metadata.uid = Some("0000-uid".to_owned());
    relay
}

/// Parses as the controller does, then builds; a parse failure is the error.
fn build(relay: &OutboxRelay, options: &BuildOptions) -> Result<Desired, String> {
    let valid = crate::spec::parse(relay).map_err(|p| p.to_string())?;
    super::build(&valid, options).map_err(|e| e.to_string())
}

fn valid(yaml: &str) -> ValidRelay {
    crate::spec::parse(&relay(yaml)).unwrap_or_else(|e| panic!("{e}"))
}

const POLLING_RABBIT: &str = r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: orders-db}}}
  mode: {polling: {}}
  broker: {rabbitmq: {urlSecretRef: {name: amqp, key: url}}}
  replicas: 3
"#;

const LOG_TAILING_KAFKA: &str = r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: orders-db}}}
  mode: {logTailing: {}}
  broker: {kafka: {bootstrapServers: "kafka:9092", tls: {caSecretRef: {name: kafka-ca, key: ca.crt}}}}
  replicas: 3
"#;

#[test]
fn every_child_is_owned_by_the_relay_and_labelled() {
    let desired = build(&relay(POLLING_RABBIT), &BuildOptions::default()).unwrap();
    let metas = [
        &desired.config_map.metadata,
        &desired.deployment.metadata,
        &desired.service.metadata,
        &desired.pod_disruption_budget.as_ref().unwrap().metadata,
        &desired.service_monitor.metadata,
        &desired.prometheus_rule.as_ref().unwrap().metadata,
    ];
    for meta in metas {
        let owner = &meta.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.kind, "OutboxRelay");
        assert_eq!(owner.uid, "0000-uid");
        assert_eq!(owner.controller, Some(true));
        let labels = meta.labels.as_ref().unwrap();
        for key in ["name", "instance", "component", "managed-by", "part-of"] {
            assert!(
                labels.contains_key(&format!("app.kubernetes.io/{key}")),
                "{key} missing on {:?}",
                meta.name
            );
        }
        assert_eq!(meta.namespace.as_deref(), Some("shop"));
    }
}

#[test]
fn secrets_reach_the_pod_only_by_reference() {
    let desired = build(&relay(POLLING_RABBIT), &BuildOptions::default()).unwrap();
    let pod = desired.deployment.spec.unwrap().template.spec.unwrap();
    let env = pod.containers[0].env.clone().unwrap();
    let db = env
        .iter()
        .find(|e| e.name == "OUTBOX_DATABASE_URL")
        .unwrap();
    assert!(db.value.is_none());
    let selector = db
        .value_from
        .as_ref()
        .unwrap()
        .secret_key_ref
        .as_ref()
        .unwrap();
    assert_eq!(
        (selector.name.as_str(), selector.key.as_str()),
        ("orders-db", "uri")
    );
    assert!(env.iter().any(|e| e.name == "OUTBOX_RABBITMQ_URL"));
}

#[test]
fn a_cloudnativepg_login_reaches_the_pod_as_two_secret_references() {
    let desired = build(
        &relay(
            r#"
apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {databaseRef: {name: pg, userSecretName: relay-role}}
  mode: {logTailing: {}}
  broker: {nats: {url: "nats://n:4222"}}
"#,
        ),
        &BuildOptions::default(),
    )
    .unwrap();
    let pod = desired.deployment.spec.unwrap().template.spec.unwrap();
    let env = pod.containers[0].env.clone().unwrap();
    let from = |name: &str| {
        let e = env.iter().find(|e| e.name == name)?;
        let r = e.value_from.as_ref()?.secret_key_ref.as_ref()?;
        Some((r.name.clone(), r.key.clone()))
    };
    assert_eq!(
        from("OUTBOX_DATABASE_USER"),
        Some(("relay-role".into(), "username".into()))
    );
    assert_eq!(
        from("OUTBOX_DATABASE_PASSWORD"),
        Some(("relay-role".into(), "password".into()))
    );
    assert!(!env.iter().any(|e| e.name == "OUTBOX_DATABASE_URL"));
    let volumes = serde_json::to_string(&pod.volumes).unwrap();
    assert!(volumes.contains("\"pg-ca\""), "{volumes}");
}

#[test]
fn pods_run_restricted() {
    let desired = build(&relay(POLLING_RABBIT), &BuildOptions::default()).unwrap();
    let pod = desired.deployment.spec.unwrap().template.spec.unwrap();
    let sc = pod.containers[0].security_context.clone().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.capabilities.unwrap().drop, Some(vec!["ALL".to_owned()]));
    let psc = pod.security_context.unwrap();
    assert_eq!(psc.seccomp_profile.unwrap().type_, "RuntimeDefault");
    assert_eq!(
        pod.containers[0].args.clone().unwrap(),
        ["relay", "--config", "/etc/outbox-relay/relay.yaml"]
    );
}

#[test]
fn log_tailing_runs_one_pod_recreated_and_no_budget() {
    let desired = build(&relay(LOG_TAILING_KAFKA), &BuildOptions::default()).unwrap();
    let spec = desired.deployment.spec.unwrap();
    assert_eq!(spec.replicas, Some(1));
    assert_eq!(spec.strategy.unwrap().type_.as_deref(), Some("Recreate"));
    assert!(desired.pod_disruption_budget.is_none());
    // The CA file lands where the relay config says it is.
    let volume = &spec.template.spec.unwrap().volumes.unwrap()[0];
    let sources = volume.projected.as_ref().unwrap().sources.clone().unwrap();
    let ca = sources[1].secret.as_ref().unwrap();
    assert_eq!(ca.name, "kafka-ca");
    assert_eq!(ca.items.as_ref().unwrap()[0].path, "broker-tls/ca.crt");
}

#[test]
fn a_spec_change_changes_the_config_hash() {
    let hash = |r: &OutboxRelay| {
        build(r, &BuildOptions::default())
            .unwrap()
            .deployment
            .spec
            .unwrap()
            .template
            .metadata
            .unwrap()
            .annotations
            .unwrap()[CONFIG_HASH_ANNOTATION]
            .clone()
    };
    let a = relay(POLLING_RABBIT);
    let mut b = a.clone();
    b.spec.ordering.partitions = 8;
    assert_eq!(hash(&a), hash(&a.clone()));
    assert_ne!(hash(&a), hash(&b));
    // What the relay process does not read does not roll its pods.
    let mut c = a.clone();
    c.spec.replicas = 5;
    c.spec.alerting.backlog_rows = 7;
    c.spec.relay.log_level = Some("debug".to_owned());
    assert_eq!(hash(&a), hash(&c));
}

#[test]
fn one_replica_has_no_budget_and_disabled_alerting_no_rule() {
    let mut r = relay(POLLING_RABBIT);
    r.spec.replicas = 1;
    r.spec.alerting.enabled = false;
    let desired = build(&r, &BuildOptions::default()).unwrap();
    assert!(desired.pod_disruption_budget.is_none());
    assert!(desired.prometheus_rule.is_none());
}

#[test]
fn the_image_defaults_to_the_operators_own() {
    let mut r = relay(POLLING_RABBIT);
    let image = |r: &OutboxRelay, o: &BuildOptions| {
        build(r, o)
            .unwrap()
            .deployment
            .spec
            .unwrap()
            .template
            .spec
            .unwrap()
            .containers[0]
            .image
            .clone()
            .unwrap()
    };
    let options = BuildOptions {
        relay_image: "registry.example/outbox:1".to_owned(),
        ..BuildOptions::default()
    };
    assert_eq!(image(&r, &options), "registry.example/outbox:1");
    r.spec.relay.image = Some("mine:2".to_owned());
    assert_eq!(image(&r, &options), "mine:2");
    assert!(default_relay_image().ends_with(env!("CARGO_PKG_VERSION")));
}

#[test]
fn the_spec_overrides_the_operators_pod_defaults() {
    let pod_spec = |r: &OutboxRelay, o: &BuildOptions| {
        build(r, o)
            .unwrap()
            .deployment
            .spec
            .unwrap()
            .template
            .spec
            .unwrap()
    };
    let options = BuildOptions {
        relay_image_pull_policy: Some(crate::api::ImagePullPolicy::IfNotPresent),
        relay_image_pull_secrets: vec!["regcred".to_owned()],
        relay_run_as_user: Some(2000),
        relay_fs_group: Some(3000),
        ..BuildOptions::default()
    };
    let mut r = relay(POLLING_RABBIT);
    let defaults = pod_spec(&r, &options);
    let sc = defaults.security_context.clone().unwrap();
    assert_eq!(
        (sc.run_as_user, sc.run_as_group, sc.fs_group),
        (Some(2000), None, Some(3000))
    );
    assert_eq!(
        defaults.containers[0].image_pull_policy.as_deref(),
        Some("IfNotPresent")
    );
    assert!(defaults.topology_spread_constraints.is_none());

    r.spec.relay = serde_yaml::from_str(
        r#"
imagePullPolicy: Never
imagePullSecrets: [{name: team-pull}, {name: regcred}]
runAsUser: 1000680000
runAsGroup: 0
topologySpreadConstraints:
  - {maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: ScheduleAnyway}
  - {maxSkew: 2, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule,
     labelSelector: {matchLabels: {tier: relays}}}
"#,
    )
    .unwrap();
    let chosen = pod_spec(&r, &options);
    let sc = chosen.security_context.clone().unwrap();
    assert_eq!(
        (
            sc.run_as_user,
            sc.run_as_group,
            sc.fs_group,
            sc.run_as_non_root
        ),
        (Some(1_000_680_000), Some(0), Some(3000), Some(true))
    );
    assert_eq!(
        chosen.containers[0].image_pull_policy.as_deref(),
        Some("Never")
    );
    let pulls: Vec<String> = chosen
        .image_pull_secrets
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(
        pulls,
        ["regcred", "team-pull"],
        "the operator's first, each once"
    );
    let spread = chosen.topology_spread_constraints.unwrap();
    // No selector: this relay's own pods are counted.
    let own = spread[0]
        .label_selector
        .clone()
        .unwrap()
        .match_labels
        .unwrap();
    assert_eq!(own, selector_labels(&crate::spec::parse(&r).unwrap()));
    let theirs = spread[1]
        .label_selector
        .clone()
        .unwrap()
        .match_labels
        .unwrap();
    assert_eq!(theirs.get("tier").map(String::as_str), Some("relays"));
}

#[test]
fn every_alert_has_for_severity_summary_and_description() {
    let desired = build(&relay(LOG_TAILING_KAFKA), &BuildOptions::default()).unwrap();
    let rule = desired.prometheus_rule.unwrap();
    let rules = rule.data["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .clone();
    assert!(rules.len() >= 4, "{rules:?}");
    for r in &rules {
        assert!(r["for"].is_string(), "{r}");
        assert!(r["labels"]["severity"].is_string(), "{r}");
        assert!(r["annotations"]["summary"].is_string(), "{r}");
        assert!(r["annotations"]["description"].is_string(), "{r}");
    }
    let wal = rules
        .iter()
        .find(|r| r["alert"] == "OutboxRelaySlotRetainedWalHigh")
        .unwrap();
    assert!(
        wal["expr"].as_str().unwrap().ends_with("> 1073741824"),
        "{wal}"
    );
}

#[test]
fn an_invalid_spec_builds_nothing() {
    let mut r = relay(POLLING_RABBIT);
    r.spec.mode.log_tailing = Some(Default::default());
    let err = build(&r, &BuildOptions::default()).unwrap_err().to_string();
    assert!(err.contains("spec.mode"), "{err}");
}

#[test]
fn the_config_map_holds_no_secret_values() {
    let cm: ConfigMap = config_map(&valid(POLLING_RABBIT)).unwrap();
    let text = &cm.data.unwrap()[CONFIG_KEY];
    // Secrets are named, never quoted: the values reach the pod as variables.
    assert!(text.contains("name: orders-db"), "{text}");
    assert!(!text.contains("://"), "{text}");
}

fn alert_rules(r: &OutboxRelay) -> Vec<serde_json::Value> {
    let rule = build(r, &BuildOptions::default())
        .unwrap()
        .prometheus_rule
        .unwrap();
    rule.data["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn alerts_select_the_relays_own_labels_and_link_their_runbook() {
    for r in alert_rules(&relay(POLLING_RABBIT)) {
        let alert = r["alert"].as_str().unwrap();
        let expr = r["expr"].as_str().unwrap();
        if alert == "OutboxRelayDown" {
            // `up` has target labels only.
            assert!(
                expr.contains(r#"up{namespace="shop",service="orders-relay"}"#),
                "{r}"
            );
        } else {
            assert!(
                expr.contains(r#"relay_namespace="shop",relay_name="orders""#),
                "{r}"
            );
        }
        assert_eq!(
            r["annotations"]["runbook_url"],
            format!(
                "{}#{}",
                default_runbook_base_url(),
                alert.to_ascii_lowercase()
            ),
            "{r}"
        );
    }
}

#[test]
fn monitoring_objects_carry_the_operators_then_the_relays_labels_and_runbook_base() {
    let mut r = relay(POLLING_RABBIT);
    r.spec.monitoring.labels = [
        ("team".to_owned(), "payments".to_owned()),
        ("release".to_owned(), "relay-choice".to_owned()),
        // Never over the operator's own labels.
        (
            "app.kubernetes.io/managed-by".to_owned(),
            "someone".to_owned(),
        ),
    ]
    .into();
    let options = BuildOptions {
        monitoring_labels: vec![
            ("release".to_owned(), "kube-prometheus-stack".to_owned()),
            ("tier".to_owned(), "ops".to_owned()),
        ],
        runbook_base_url: "https://runbooks.example/outbox".to_owned(),
        ..BuildOptions::default()
    };
    let desired = build(&r, &options).unwrap();
    for object in [
        &desired.service_monitor,
        desired.prometheus_rule.as_ref().unwrap(),
    ] {
        let labels = object.metadata.labels.clone().unwrap();
        let get = |k: &str| labels.get(k).map(String::as_str);
        assert_eq!(get("release"), Some("relay-choice"), "{labels:?}");
        assert_eq!(get("tier"), Some("ops"));
        assert_eq!(get("team"), Some("payments"));
        assert_eq!(get("app.kubernetes.io/managed-by"), Some(MANAGED_BY));
    }
    // The scrape still selects the Service by the operator's labels only.
    let selector = &desired.service_monitor.data["spec"]["selector"]["matchLabels"];
    assert!(selector.get("team").is_none(), "{selector}");
    let rules = desired.prometheus_rule.unwrap().data["spec"]["groups"][0]["rules"].clone();
    assert_eq!(
        rules[0]["annotations"]["runbook_url"],
        "https://runbooks.example/outbox#outboxrelaydown"
    );
    r.spec.monitoring.labels = [("bad key!".to_owned(), "x".to_owned())].into();
    let refused = build(&r, &options).unwrap_err();
    assert!(refused.contains("spec.monitoring.labels"), "{refused}");
}

#[test]
fn a_relay_scaled_to_zero_gets_no_down_alert() {
    let mut r = relay(POLLING_RABBIT);
    r.spec.replicas = 0;
    let names: Vec<String> = alert_rules(&r)
        .iter()
        .map(|r| r["alert"].as_str().unwrap().to_owned())
        .collect();
    assert!(!names.contains(&"OutboxRelayDown".to_owned()), "{names:?}");
    assert!(names.contains(&"OutboxRelayOldestUnpublishedTooOld".to_owned()));
}

#[test]
fn thresholds_come_from_the_spec() {
    let mut r = relay(POLLING_RABBIT);
    r.spec.alerting.oldest_unpublished_age = "90s".to_owned();
    r.spec.alerting.backlog_rows = 42;
    r.spec.ordering.partitions = 16;
    let rules = alert_rules(&r);
    let expr = |name: &str| {
        rules.iter().find(|r| r["alert"] == name).unwrap()["expr"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(expr("OutboxRelayOldestUnpublishedTooOld").ends_with("> 90"));
    assert!(expr("OutboxRelayBacklogHigh").ends_with("> 42"));
    assert!(expr("OutboxRelayPartitionsUnowned").ends_with("< 16"));
}

#[test]
fn every_child_kind_has_its_object_in_the_catalogues_order_and_api_form() {
    let desired = build(&relay(POLLING_RABBIT), &BuildOptions::default()).unwrap();
    let children = desired.children().unwrap();
    let kinds: Vec<ChildKind> = children.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        kinds,
        ChildKind::ALL.to_vec(),
        "replicas 3 and alerting on: all six"
    );
    for (kind, object) in &children {
        let resource = kind.api_resource();
        let types = object.types.as_ref().unwrap();
        assert_eq!(types.api_version, resource.api_version, "{kind:?}");
        assert_eq!(types.kind, resource.kind, "{kind:?}");
        assert!(object.metadata.name.is_some(), "{kind:?}");
    }
    let mut one = relay(POLLING_RABBIT);
    one.spec.replicas = 1;
    one.spec.alerting.enabled = false;
    let desired = build(&one, &BuildOptions::default()).unwrap();
    let kinds: Vec<ChildKind> = desired
        .children()
        .unwrap()
        .iter()
        .map(|(k, _)| *k)
        .collect();
    assert!(!kinds.contains(&ChildKind::PodDisruptionBudget));
    assert!(!kinds.contains(&ChildKind::PrometheusRule));
}

#[test]
fn holds_compares_what_the_operator_sets_and_allows_what_the_server_adds() {
    use super::holds;
    use serde_json::json;
    let want = json!({
        "metadata": {"name": "r", "labels": {"a": "1"}, "annotations": {}},
        "spec": {"replicas": 2, "ports": [{"name": "metrics", "port": 9090}], "tolerations": []}
    });
    // Defaults and other managers' fields: held.
    let served = json!({
        "metadata": {"name": "r", "labels": {"a": "1", "other": "x"}, "uid": "u", "resourceVersion": "7"},
        "spec": {"replicas": 2.0, "ports": [{"name": "metrics", "port": 9090, "protocol": "TCP"}]},
        "status": {}
    });
    assert!(holds(&served, &want));
    // A list element added or moved: drift (args, tolerations are replaced whole).
    let mut added = served.clone();
    added["spec"]["ports"] = json!([{"name": "metrics", "port": 9090}, {"name": "x", "port": 1}]);
    assert!(!holds(&added, &want));
    let two = json!({"args": ["a", "b"]});
    assert!(!holds(&json!({"args": ["b", "a"]}), &two));
    assert!(!holds(&json!({"args": ["a", "b", "c"]}), &two));
    // A field the operator sets, edited or removed: drift.
    let mut edited = served.clone();
    edited["spec"]["replicas"] = json!(3);
    assert!(!holds(&edited, &want));
    let mut removed = served.clone();
    removed["metadata"]["labels"] = json!({"other": "x"});
    assert!(!holds(&removed, &want));
    let mut port = served.clone();
    port["spec"]["ports"] = json!([{"name": "metrics", "port": 9091}]);
    assert!(!holds(&port, &want));
    assert!(!holds(&json!(null), &json!("x")));
    assert!(holds(&json!({}), &json!({"a": null})));
}
