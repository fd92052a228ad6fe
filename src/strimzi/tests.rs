use serde_json::json;

use super::*;

fn reference(yaml: &str) -> KafkaRef {
    serde_yaml::from_str(yaml).unwrap()
}

/// A Kafka as Strimzi's examples write it: plain 9092, tls 9093 (client
/// certificates), scram 9094 (SCRAM over TLS), open 9095 (TLS, no authentication).
fn cluster() -> Seen<KafkaFacts> {
    Seen::Found(kafka_facts(&json!({
        "metadata": {"name": "events"},
        "spec": {"kafka": {"listeners": [
            {"name": "plain", "port": 9092, "type": "internal", "tls": false},
            {"name": "tls", "port": 9093, "type": "internal", "tls": true,
             "authentication": {"type": "tls"}},
            {"name": "scram", "port": 9094, "type": "internal", "tls": true,
             "authentication": {"type": "scram-sha-512"}},
            {"name": "open", "port": 9095, "type": "internal", "tls": true},
        ]}}
    })))
}

fn user(cluster: &str, auth: &str, ready: bool, secret: &str) -> Option<Seen<UserFacts>> {
    Some(Seen::Found(user_facts(&json!({
        "metadata": {"name": "relay", "labels": {"strimzi.io/cluster": cluster}},
        "spec": {"authentication": {"type": auth}},
        "status": {"secret": secret, "username": "CN=relay",
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
    }))))
}

fn reason(reference: &KafkaRef, seen: StrimziSeen) -> Option<&'static str> {
    problem(reference, &seen).map(|p| p.reason)
}

#[test]
fn a_ready_user_on_a_listener_of_its_kind_is_usable() {
    let tls = reference("{name: events, user: relay}");
    let seen = StrimziSeen {
        kafka: cluster(),
        user: user("events", "tls", true, "relay"),
    };
    assert_eq!(reason(&tls, seen), None);
    let scram = reference("{name: events, port: 9094, user: relay, authentication: scram-sha-512}");
    let seen = StrimziSeen {
        kafka: cluster(),
        user: user("events", "scram-sha-512", true, "relay"),
    };
    assert_eq!(reason(&scram, seen), None);
    // No user, a TLS listener that authenticates no one.
    let open = reference("{name: events, port: 9095}");
    let seen = StrimziSeen {
        kafka: cluster(),
        user: None,
    };
    assert_eq!(reason(&open, seen), None);
}

#[test]
fn each_disagreement_names_the_field_to_change() {
    let tls = reference("{name: events, user: relay}");
    let with = |kafka: Seen<KafkaFacts>, user: Option<Seen<UserFacts>>| StrimziSeen { kafka, user };
    let cases: Vec<(KafkaRef, StrimziSeen, &str, &str)> = vec![
        (
            tls.clone(),
            with(Seen::NotInstalled, None),
            "StrimziNotInstalled",
            "install Strimzi",
        ),
        (
            tls.clone(),
            with(Seen::Missing, None),
            "KafkaNotFound",
            "Kafka events does not exist",
        ),
        (
            tls.clone(),
            with(Seen::Forbidden, None),
            "StrimziNotReadable",
            "kafkas.kafka.strimzi.io",
        ),
        (
            reference("{name: events, port: 9999}"),
            with(cluster(), None),
            "KafkaListenerNotFound",
            "plain on 9092, tls on 9093 (TLS), scram on 9094 (TLS), open on 9095 (TLS)",
        ),
        (
            reference("{name: events, port: 9092}"),
            with(cluster(), None),
            "KafkaListenerNotTls",
            "listener plain on port 9092",
        ),
        (
            reference("{name: events}"),
            with(cluster(), None),
            "KafkaListenerNeedsUser",
            "kafkaRef.user",
        ),
        (
            reference("{name: events, port: 9094, user: relay}"),
            with(cluster(), user("events", "tls", true, "relay")),
            "KafkaListenerAuthentication",
            "authenticates by scram-sha-512, but kafkaRef logs in by tls",
        ),
        (
            reference("{name: events, port: 9095, user: relay, authentication: scram-sha-512}"),
            with(cluster(), user("events", "scram-sha-512", true, "relay")),
            "KafkaListenerAuthentication",
            "takes no SASL login",
        ),
        (
            tls.clone(),
            with(cluster(), Some(Seen::Missing)),
            "KafkaUserNotFound",
            "KafkaUser relay does not exist",
        ),
        (
            tls.clone(),
            with(cluster(), user("other", "tls", true, "relay")),
            "KafkaUserOtherCluster",
            "belongs to Kafka other",
        ),
        (
            tls.clone(),
            with(cluster(), user("events", "scram-sha-512", true, "relay")),
            "KafkaUserAuthentication",
            "kafkaRef.authentication: scram-sha-512",
        ),
        (
            tls.clone(),
            with(cluster(), user("events", "tls-external", true, "relay")),
            "KafkaUserAuthentication",
            "tls-external",
        ),
        (
            tls.clone(),
            with(cluster(), user("events", "tls", false, "relay")),
            "KafkaUserNotReady",
            "not Ready yet",
        ),
        (
            tls.clone(),
            with(cluster(), user("events", "tls", true, "kafka-relay")),
            "KafkaUserSecretMismatch",
            "userSecretName: kafka-relay",
        ),
    ];
    for (reference, seen, want, says) in cases {
        let got = problem(&reference, &seen);
        assert!(
            got.as_ref()
                .is_some_and(|p| p.reason == want && p.message.contains(says)),
            "{reference:?} with {seen:?}: want {want} saying {says:?}, got {got:?}"
        );
    }
    // A Secret named in the spec is the user's choice.
    let own = reference("{name: events, user: relay, userSecretName: kafka-relay}");
    let seen = with(cluster(), user("events", "tls", true, "kafka-relay"));
    assert_eq!(reason(&own, seen), None);
}

#[test]
fn objects_without_status_or_listeners_read_as_empty() {
    assert_eq!(kafka_facts(&json!({"spec": {}})), KafkaFacts::default());
    let fresh = user_facts(
        &json!({"metadata": {"name": "u"}, "spec": {"authentication": {"type": "tls"}}}),
    );
    assert!(!fresh.ready && fresh.secret.is_none() && fresh.cluster.is_none());
}
