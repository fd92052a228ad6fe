//! A Kafka relay's settings: the spec's rules, its Secret references, the settings
//! with Secret values resolved, and the producer configuration built from them.

use rdkafka::ClientConfig;

use super::properties::{GAPLESS, canonical, deadline, refused_by_librdkafka, refused_together};
use crate::api::{KafkaSpec, SaslMechanism};
use crate::broker::tls::{self, TlsFiles};
use crate::rules::{
    BrokerKind, Problems, check_secret_ref, check_template_into, is_fixed_kafka_property,
};
use crate::secrets::{
    Content, Delivery, ENV_KAFKA_SASL_PASSWORD, ENV_KAFKA_SASL_USERNAME, SecretSlot, SecretUse,
};

/// The Secret references of a Kafka spec: SASL credentials as variables, the TLS files
/// mounted.
pub fn secrets(k: &KafkaSpec) -> Vec<SecretSlot> {
    let slot = |field, reference: &crate::api::SecretKeyRef, delivery| SecretSlot {
        field,
        purpose: SecretUse::Broker,
        reference: reference.clone(),
        delivery,
        content: Content::Text,
    };
    let mut all = Vec::new();
    if let Some(sasl) = &k.sasl {
        if let Some(username) = &sasl.username_secret_ref {
            all.push(slot(
                "spec.broker.kafka.sasl.usernameSecretRef",
                &username.into(),
                Delivery::Env(ENV_KAFKA_SASL_USERNAME),
            ));
        }
        all.push(slot(
            "spec.broker.kafka.sasl.passwordSecretRef",
            &(&sasl.password_secret_ref).into(),
            Delivery::Env(ENV_KAFKA_SASL_PASSWORD),
        ));
    }
    all.extend(tls::secrets(k.tls.as_ref(), tls::KAFKA));
    all
}

/// Kafka producer settings with credentials resolved. No `Debug`: it holds secrets.
#[derive(Clone)]
pub struct KafkaSettings {
    /// `host:port` list.
    pub bootstrap_servers: String,
    /// Topic template.
    pub topic: String,
    /// TLS on (with the system roots when no CA file is given).
    pub tls: bool,
    /// CA and client certificate files.
    pub tls_files: TlsFiles,
    /// SASL mechanism, user name and password.
    pub sasl: Option<(SaslMechanism, String, String)>,
    /// Extra librdkafka producer settings.
    pub properties: std::collections::BTreeMap<String, String>,
}

/// The settings of a Kafka spec, with Secret values (`value`, by field) and mounted
/// files (`file`, by field) resolved.
pub fn settings(
    k: &KafkaSpec,
    value: &dyn Fn(&str) -> String,
    file: &dyn Fn(&str) -> Option<String>,
) -> KafkaSettings {
    KafkaSettings {
        bootstrap_servers: k.bootstrap_servers.clone(),
        topic: k.topic.clone(),
        tls: k.tls.is_some(),
        tls_files: TlsFiles::locate(tls::KAFKA, file),
        sasl: k.sasl.as_ref().map(|s| {
            (
                s.mechanism,
                s.username
                    .clone()
                    .unwrap_or_else(|| value("spec.broker.kafka.sasl.usernameSecretRef")),
                value("spec.broker.kafka.sasl.passwordSecretRef"),
            )
        }),
        properties: k.properties.clone(),
    }
}

/// Every problem of a Kafka spec.
pub fn check(k: &KafkaSpec, p: &mut Problems) {
    if k.bootstrap_servers.trim().is_empty() {
        p.push(
            "spec.broker.kafka.bootstrapServers",
            "is empty",
            "name at least one host:port, or a Strimzi Kafka cluster in kafkaRef",
        );
    }
    check_template_into(p, BrokerKind::Kafka, "spec.broker.kafka.topic", &k.topic);
    if let Err(why) = deadline(&k.properties) {
        p.push(
            "spec.broker.kafka.properties",
            why.to_string(),
            "give a whole number of milliseconds (0: wait for ever)",
        );
    }
    // What librdkafka takes one by one, for the rules between settings.
    let mut accepted = std::collections::BTreeMap::new();
    for (key, value) in &k.properties {
        if is_fixed_kafka_property(key) {
            p.push(
                format!("spec.broker.kafka.properties.{key}"),
                "is fixed by the relay (delivery guarantees) or set through tls and sasl",
                "remove it; acks=all and idempotence are always on",
            );
        } else if let Some(why) = refused_by_librdkafka(key, value) {
            p.push(
                format!("spec.broker.kafka.properties.{key}"),
                why,
                "use a librdkafka producer property and a value it takes (librdkafka's CONFIGURATION.md lists them)",
            );
        } else {
            accepted.insert(key.clone(), value.clone());
        }
    }
    for (key, why) in refused_together(&accepted) {
        p.push(
            format!("spec.broker.kafka.properties.{key}"),
            why,
            "remove it or give a value the relay's idempotent producer takes",
        );
    }
    if k.sasl.is_some() && k.tls.is_none() && !k.allow_plaintext_credentials {
        p.push(
            "spec.broker.kafka.sasl",
            "without tls sends the login unencrypted (SASL_PLAINTEXT)",
            "add spec.broker.kafka.tls (SASL_SSL), or set spec.broker.kafka.allowPlaintextCredentials: true to accept that",
        );
    }
    if let Some(sasl) = &k.sasl {
        if let Some(username) = &sasl.username_secret_ref {
            check_secret_ref(
                p,
                "spec.broker.kafka.sasl.usernameSecretRef",
                &username.name,
                &username.key,
            );
        }
        match (&sasl.username, &sasl.username_secret_ref) {
            (Some(_), Some(_)) => p.push(
                "spec.broker.kafka.sasl.username",
                "the user name is given twice",
                "keep username or usernameSecretRef, not both",
            ),
            (None, None) => p.push(
                "spec.broker.kafka.sasl.username",
                "no user name",
                "set username (a Strimzi KafkaUser's name) or usernameSecretRef",
            ),
            (Some(name), None) if name.trim().is_empty() => p.push(
                "spec.broker.kafka.sasl.username",
                "is empty",
                "give the user name",
            ),
            _ => {}
        }
        check_secret_ref(
            p,
            "spec.broker.kafka.sasl.passwordSecretRef",
            &sasl.password_secret_ref.name,
            &sasl.password_secret_ref.key,
        );
    }
    tls::check(k.tls.as_ref(), tls::KAFKA, p);
}

/// The producer settings the relay uses: the user's `properties` first, then what
/// correctness needs, then TLS and SASL. `check` connects with the same.
pub(super) fn client_config(config: &KafkaSettings) -> ClientConfig {
    let mut client = ClientConfig::new();
    // Defaults a user may tune through `properties`.
    client
        .set("socket.connection.setup.timeout.ms", "5000")
        .set("linger.ms", "1")
        // The Java client's partitioning (murmur2 of the key): an aggregate's events land
        // on the partition Kafka Connect, Debezium and Java producers put them on, so
        // consumers migrating from them keep each aggregate on one partition, in order.
        // librdkafka's own default (CRC32) would not.
        .set("partitioner", "murmur2_random");
    for (key, value) in &config.properties {
        client.set(canonical(key), value);
    }
    for (key, value) in GAPLESS {
        client.set(key, value);
    }
    // Fixed, after the user's properties: idempotence keeps each Kafka partition in
    // send order without duplicates from internal retries (it requires
    // max.in.flight <= 5), and acks=all means "acknowledged" survives a broker loss.
    client
        .set("bootstrap.servers", &config.bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5");
    let protocol = match (config.tls, config.sasl.is_some()) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    client.set("security.protocol", protocol);
    if config.tls {
        // The broker's certificate is verified, host name included (librdkafka's
        // default since 1.9, set so no property can turn it off).
        client.set("ssl.endpoint.identification.algorithm", "https");
        if let Some(ca) = &config.tls_files.ca {
            client.set("ssl.ca.location", ca);
        }
        if let Some((cert, key)) = &config.tls_files.client {
            client
                .set("ssl.certificate.location", cert)
                .set("ssl.key.location", key);
        }
    }
    if let Some((mechanism, user, password)) = &config.sasl {
        let mechanism = serde_json::to_value(mechanism)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        client
            .set("sasl.mechanism", mechanism)
            .set("sasl.username", user)
            .set("sasl.password", password);
    }
    client
}

/// The settings of the producer that sends a chain's next message: the relay's, with
/// no lingering (see `broker::kafka`'s notes, "Why two producers").
pub(super) fn eager_config(config: &KafkaSettings) -> ClientConfig {
    let mut client = client_config(config);
    client.set("linger.ms", "0");
    client
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn settings(properties: &[(&str, &str)]) -> KafkaSettings {
        KafkaSettings {
            bootstrap_servers: "kafka:9092".to_owned(),
            topic: "outbox".to_owned(),
            tls: false,
            tls_files: Default::default(),
            sasl: None,
            properties: properties
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn keys_are_partitioned_as_the_java_client_does_unless_the_user_says_otherwise() {
        let config = client_config(&settings(&[]));
        assert_eq!(config.get("partitioner"), Some("murmur2_random"));
        let config = client_config(&settings(&[("partitioner", "consistent_random")]));
        assert_eq!(config.get("partitioner"), Some("consistent_random"));
        // What correctness needs is not the user's to change.
        let config = client_config(&settings(&[("acks", "1")]));
        assert_eq!(config.get("acks"), Some("all"));
    }

    /// The fields `problems` name, in order.
    fn fields(problems: &[crate::rules::Problem]) -> Vec<&str> {
        problems.iter().map(|p| p.field.as_str()).collect()
    }

    /// What [`check`] finds in a Kafka spec with these `properties`.
    fn problems(properties: serde_json::Value) -> Vec<crate::rules::Problem> {
        let spec: KafkaSpec = serde_json::from_value(serde_json::json!({
            "bootstrapServers": "kafka:9092",
            "topic": "orders",
            "properties": properties,
        }))
        .expect("a Kafka spec");
        let mut p = Problems(Vec::new());
        check(&spec, &mut p);
        p.0
    }

    #[test]
    fn settings_librdkafka_refuses_together_are_spec_problems() {
        // Settings librdkafka takes alone but refuses with idempotence or together.
        let together = problems(serde_json::json!({
            "queuing.strategy": "LIFO",
            "delivery.report.only.error": "T",
            "queue.buffering.backpressure.threshold": " 2",
            "reconnect.backoff.ms": "20000",
        }));
        assert_eq!(
            fields(&together),
            [
                "spec.broker.kafka.properties.queuing.strategy",
                "spec.broker.kafka.properties.delivery.report.only.error",
                "spec.broker.kafka.properties.queue.buffering.backpressure.threshold",
                "spec.broker.kafka.properties.reconnect.backoff.ms",
            ],
            "{together:?}"
        );
        assert!(together[3].message.contains("10000"), "{together:?}");
        // As librdkafka reads them: leading blanks, octal, trailing text.
        let read = problems(serde_json::json!({
            "queuing.strategy": " lifo",
            "queue.buffering.backpressure.threshold": "2ms",
            "reconnect.backoff.ms": "0200",
            "reconnect.backoff.max.ms": "150",
            "partition.assignment.strategy": "range",
            "internal.termination.signal": "15",
            "api.version.request": "false",
        }));
        assert_eq!(
            fields(&read),
            [
                "spec.broker.kafka.properties.queuing.strategy",
                "spec.broker.kafka.properties.queue.buffering.backpressure.threshold",
                "spec.broker.kafka.properties.partition.assignment.strategy",
                "spec.broker.kafka.properties.internal.termination.signal",
                "spec.broker.kafka.properties.api.version.request",
            ],
            "{read:?}"
        );
        // A value librdkafka refuses alone is reported once, by its own reason.
        let once = problems(serde_json::json!({"reconnect.backoff.max.ms": "-1"}));
        assert_eq!(once.len(), 1, "{once:?}");
        let fine = problems(serde_json::json!({
            "internal.termination.signal": "0",
            "api.version.request": "true",
            "delivery.report.only.error": "false",
            "queuing.strategy": "fifo",
            "queue.buffering.backpressure.threshold": "1",
            "reconnect.backoff.ms": "500",
            "reconnect.backoff.max.ms": "500",
        }));
        assert!(fine.is_empty(), "{fine:?}");
    }

    #[test]
    fn properties_librdkafka_refuses_are_spec_problems() {
        let fine = problems(serde_json::json!({
            "linger.ms": "5",
            "compression.type": "lz4",
            "batch.num.messages": "5000",
            "message.timeout.ms": "30000",
            // Overridden by the relay, never handed to librdkafka.
            "retries": "-1",
            "enable.gapless.guarantee": "maybe",
        }));
        assert!(fine.is_empty(), "{fine:?}");
        // The relay's timeout is deadline()'s to report, once.
        let timeout = problems(serde_json::json!({"message.timeout.ms": "soon"}));
        assert_eq!(timeout.len(), 1, "{timeout:?}");
        assert_eq!(timeout[0].field, "spec.broker.kafka.properties");
        // Never handed to librdkafka, which would load the library.
        let plugin = problems(serde_json::json!({"plugin.library.paths": "/tmp/evil.so"}));
        assert_eq!(plugin.len(), 1, "{plugin:?}");
        assert!(plugin[0].message.contains("plugins"), "{plugin:?}");
        // librdkafka takes its mock cluster's setting; the relay does not.
        assert!(
            ClientConfig::new()
                .set("test.mock.num.brokers", "3")
                .create_native_config()
                .is_ok()
        );
        let mock = problems(serde_json::json!({"test.mock.num.brokers": "3"}));
        assert_eq!(mock.len(), 1, "{mock:?}");
        assert!(mock[0].message.contains("mock cluster"), "{mock:?}");
        // Out of range, without librdkafka's trailing line break.
        let range =
            problems(serde_json::json!({"linger.ms": "1000000", "message.timeout.ms": "0"}));
        assert_eq!(range.len(), 1, "{range:?}");
        assert!(range[0].message.contains("range"), "{range:?}");
        assert_eq!(range[0].message.trim_end(), range[0].message);
        let refused = problems(serde_json::json!({
            "linger.msec": "5",
            "compression.type": "brotli",
            "batch.num.messages": "lots",
        }));
        assert_eq!(
            fields(&refused),
            [
                "spec.broker.kafka.properties.batch.num.messages",
                "spec.broker.kafka.properties.compression.type",
                "spec.broker.kafka.properties.linger.msec",
            ]
        );
        assert!(
            refused[2]
                .message
                .contains("No such configuration property"),
            "{:?}",
            refused[2]
        );
        assert!(refused[1].message.contains("brotli"), "{:?}", refused[1]);
        // The codecs this build has, as the field's reference says (zstd built in).
        for codec in ["none", "gzip", "snappy", "lz4", "zstd"] {
            assert_eq!(
                refused_by_librdkafka("compression.type", codec),
                None,
                "{codec}"
            );
        }
    }

    #[test]
    fn a_chains_next_message_never_lingers_and_lands_where_the_batch_would_put_it() {
        let user = settings(&[("linger.ms", "20"), ("partitioner", "consistent")]);
        let batching = client_config(&user);
        let eager = eager_config(&user);
        assert_eq!(batching.get("linger.ms"), Some("20"));
        assert_eq!(eager.get("linger.ms"), Some("0"));
        // Under librdkafka's other name for it, too.
        let alias = settings(&[("queue.buffering.max.ms", "20")]);
        assert_eq!(client_config(&alias).get("linger.ms"), Some("20"));
        assert_eq!(eager_config(&alias).get("linger.ms"), Some("0"));
        assert_eq!(eager_config(&alias).get("queue.buffering.max.ms"), None);
        // Everything else is the same: a key maps to the same partition through both,
        // with the same delivery guarantees.
        let rest = |c: &ClientConfig| {
            let mut all: Vec<(String, String)> = c
                .config_map()
                .iter()
                .filter(|(k, _)| k.to_string() != "linger.ms")
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            all.sort();
            all
        };
        assert_eq!(rest(&batching), rest(&eager));
        assert_eq!(eager.get("enable.idempotence"), Some("true"));
    }

    #[test]
    fn librdkafka_never_gives_a_message_up_on_its_own_and_the_relay_waits_message_timeout_ms() {
        // Whatever the user sets, librdkafka neither times out nor stops retrying a
        // message, and stops on a refusal that would leave a gap.
        let user = settings(&[
            ("message.timeout.ms", "5000"),
            ("retries", "3"),
            ("enable.gapless.guarantee", "false"),
        ]);
        for config in [client_config(&user), eager_config(&user)] {
            assert_eq!(config.get("message.timeout.ms"), Some("0"));
            assert_eq!(config.get("message.send.max.retries"), Some("2147483647"));
            assert_eq!(config.get("retries"), None);
            assert_eq!(config.get("enable.gapless.guarantee"), Some("true"));
        }
        let alias = client_config(&settings(&[("delivery.timeout.ms", "7000")]));
        assert_eq!(alias.get("message.timeout.ms"), Some("0"));
        assert_eq!(alias.get("delivery.timeout.ms"), None);
        // The relay's own deadline takes the user's value.
        let of = |properties: &[(&str, &str)]| deadline(&settings(properties).properties);
        assert_eq!(of(&[]), Ok(Some(Duration::from_secs(20))));
        assert_eq!(
            of(&[("message.timeout.ms", "5000")]),
            Ok(Some(Duration::from_secs(5)))
        );
        assert_eq!(
            of(&[("delivery.timeout.ms", "7000")]),
            Ok(Some(Duration::from_secs(7)))
        );
        assert_eq!(of(&[("message.timeout.ms", "0")]), Ok(None));
        for bad in ["soon", "-1", "2147483648", "1"] {
            let err = of(&[("message.timeout.ms", bad)]).expect_err(bad);
            let err = err.to_string();
            assert!(err.contains("message.timeout.ms"), "{err}");
        }
        let err = of(&[("delivery.timeout.ms", "50"), ("linger.ms", "50")]).expect_err("linger");
        let err = err.to_string();
        assert!(err.contains("linger.ms"), "{err}");
        // The default too.
        let err = of(&[("linger.ms", "30000")]).expect_err("linger over the default");
        let err = err.to_string();
        assert!(err.contains("20000"), "{err}");
        // `check` says so before any relay starts.
        let found = problems(serde_json::json!({"delivery.timeout.ms": "soon"}));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].field, "spec.broker.kafka.properties");
    }
}
