//! No spec may pass the controller and then fail in the relay: a table of invalid
//! OutboxRelays, each applied to the rig's real kube-apiserver (with the CRD from the
//! code) while the real controller runs against the real PostgreSQL. Each one is either
//! refused by the API server (schema, CEL rule or strict field validation) or ends with
//! `Ready=False, reason=InvalidSpec` naming every problem — and none of them leaves a
//! replication slot, a publication, a ConfigMap or a Deployment behind. What the API
//! server refuses, `render` and `check` refuse too, offline.

use crate::common;

use std::time::Duration;

use common::operator;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use outbox_operator::api::OutboxRelay;
use outbox_operator::controller::ControllerArgs;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// A valid polling relay on NATS with Secret `db`; cases edit it.
fn base(name: &str) -> Value {
    json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": name},
        "spec": {
            "database": {"postgres": {"connectionSecretRef": {"name": "db"}, "sslMode": "disable"}},
            "mode": {"polling": {}},
            "broker": {"nats": {"url": "nats://nats:4222"}},
            "replicas": 1
        }
    })
}

fn log_tailing(spec: &mut Value) {
    spec["mode"] = json!({"logTailing": {}});
}

/// One case: a name, an edit of the valid manifest, and text its refusal or its
/// `InvalidSpec` message must contain (one entry per problem).
struct Case {
    what: &'static str,
    edit: fn(&mut Value),
    expect: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        what: "a PostgreSQL client key without its certificate",
        edit: |s| {
            s["database"]["postgres"]["sslMode"] = json!("verify-full");
            s["database"]["postgres"]["clientKeySecretRef"] = json!({"name": "pg"});
        },
        expect: &["clientKeySecretRef needs clientCertSecretRef"],
    },
    Case {
        what: "a Kafka login over plain text",
        edit: |s| {
            s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "sasl": {
                "mechanism": "PLAIN", "username": "u", "passwordSecretRef": {"name": "k"}}}});
        },
        expect: &["sends the login unencrypted (SASL_PLAINTEXT)"],
    },
    Case {
        what: "a NATS token over plain text",
        edit: |s| s["broker"]["nats"]["tokenSecretRef"] = json!({"name": "nats"}),
        expect: &["may cross the network unencrypted"],
    },
    Case {
        what: "an amqp:// URI with a password, not allowed",
        edit: |s| {
            s["broker"] = json!({"rabbitmq": {"urlSecretRef": {"name": "mq", "key": "plain"}}});
        },
        expect: &[
            "spec.broker.rabbitmq.urlSecretRef: Secret mq key plain holds an amqp:// URI with a password",
        ],
    },
    Case {
        what: "a Kafka user name given twice",
        edit: |s| {
            s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "sasl": {
                "mechanism": "SCRAM-SHA-512", "username": "u",
                "usernameSecretRef": {"name": "k"}, "passwordSecretRef": {"name": "k"}}}});
        },
        expect: &["give the user name one way"],
    },
    Case {
        what: "a Kafka login without a user name",
        edit: |s| {
            s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "sasl": {
                "mechanism": "SCRAM-SHA-512", "passwordSecretRef": {"name": "k"}}}});
        },
        expect: &["give the user name one way"],
    },
    Case {
        what: "a PostgreSQL client certificate with sslMode disable",
        edit: |s| {
            s["database"]["postgres"]["clientCertSecretRef"] =
                json!({"name": "pg", "key": "tls.crt"});
            s["database"]["postgres"]["clientKeySecretRef"] =
                json!({"name": "pg", "key": "tls.key"});
        },
        expect: &["needs TLS"],
    },
    Case {
        what: "two NATS logins at once",
        edit: |s| {
            s["broker"]["nats"]["tokenSecretRef"] = json!({"name": "nats", "key": "token"});
            s["broker"]["nats"]["nkeySeedSecretRef"] = json!({"name": "nats", "key": "seed"});
        },
        expect: &["authenticate one way"],
    },
    Case {
        what: "a NATS user name without a password",
        edit: |s| s["broker"]["nats"]["usernameSecretRef"] = json!({"name": "nats", "key": "user"}),
        expect: &["passwordSecretRef"],
    },
    Case {
        what: "a broker client key without its certificate",
        edit: |s| {
            s["broker"]["nats"]["tls"] =
                json!({"clientKeySecretRef": {"name": "t", "key": "tls.key"}});
        },
        expect: &["clientCertSecretRef"],
    },
    Case {
        what: "RabbitMQ EXTERNAL login without a client certificate",
        edit: |s| {
            s["broker"] = json!({"rabbitmq": {"urlSecretRef": {"name": "amqp"}, "authMechanism": "EXTERNAL"}});
        },
        expect: &["EXTERNAL"],
    },
    Case {
        what: "an sslMode libpq does not know",
        edit: |s| s["database"]["postgres"]["sslMode"] = json!("verify-host"),
        expect: &["sslMode"],
    },
    Case {
        what: "a CA Secret name that cannot exist",
        edit: |s| s["database"]["postgres"]["caSecretRef"] = json!({"name": "Pg_CA"}),
        expect: &["caSecretRef"],
    },
    Case {
        what: "upper-case publicationName",
        edit: |s| s["mode"] = json!({"logTailing": {"publicationName": "Orders"}}),
        expect: &["publicationName"],
    },
    Case {
        what: "upper-case slotName",
        edit: |s| s["mode"] = json!({"logTailing": {"slotName": "Bad-Slot"}}),
        expect: &["slotName"],
    },
    Case {
        what: "both modes",
        edit: |s| s["mode"] = json!({"polling": {}, "logTailing": {}}),
        expect: &["exactly one of mode.polling and mode.logTailing"],
    },
    Case {
        what: "no mode",
        edit: |s| s["mode"] = json!({}),
        expect: &["exactly one of mode.polling and mode.logTailing"],
    },
    Case {
        what: "no broker",
        edit: |s| s["broker"] = json!({}),
        expect: &["exactly one of broker.kafka"],
    },
    Case {
        what: "two brokers",
        edit: |s| s["broker"]["kafka"] = json!({"bootstrapServers": "k:9092"}),
        expect: &["exactly one of broker.kafka"],
    },
    Case {
        what: "SQL in the table name",
        edit: |s| s["table"] = json!({"name": "orders; drop table x"}),
        expect: &["spec.table.name"],
    },
    Case {
        what: "bad column identifier",
        edit: |s| s["table"] = json!({"columns": {"id": "a-b"}}),
        expect: &["spec.table.columns.id"],
    },
    Case {
        what: "a header the relay sets itself",
        edit: |s| s["table"] = json!({"headers": ["traceparent", "id"]}),
        expect: &["spec.table.headers"],
    },
    Case {
        what: "a partition placement on NATS",
        edit: |s| {
            s["table"] = json!({"additionalFields": [{"column": "part", "placement": "partition"}]})
        },
        expect: &["only Kafka has partitions"],
    },
    Case {
        what: "two partition placements, one with an alias",
        edit: |s| {
            s["broker"] = json!({"kafka": {"bootstrapServers": "kafka:9092"}});
            s["table"] = json!({"additionalFields": [
                {"column": "a", "placement": "partition", "as": "p"},
                {"column": "b", "placement": "partition"}
            ]});
        },
        expect: &["at most one column sets the partition", "takes no alias"],
    },
    Case {
        what: "an envelope field named payload",
        edit: |s| s["table"] = json!({"additionalFields": [{"column": "x", "placement": "envelope", "as": "payload"}]}),
        expect: &["spec.table.additionalFields[0]"],
    },
    Case {
        what: "a bad timestamp column",
        edit: |s| s["table"] = json!({"columns": {"timestamp": "occurred at"}}),
        expect: &["spec.table.columns.timestamp"],
    },
    Case {
        what: "partitions 0",
        edit: |s| s["ordering"] = json!({"partitions": 0}),
        expect: &["spec.ordering.partitions"],
    },
    Case {
        what: "partitions 2000",
        edit: |s| s["ordering"] = json!({"partitions": 2000}),
        expect: &["spec.ordering.partitions"],
    },
    Case {
        what: "batchSize 0",
        edit: |s| s["mode"] = json!({"polling": {"batchSize": 0}}),
        expect: &["batchSize"],
    },
    Case {
        what: "replicas -1",
        edit: |s| s["replicas"] = json!(-1),
        expect: &["spec.replicas"],
    },
    Case {
        what: "maxAttempts 0",
        edit: |s| s["failure"] = json!({"maxAttempts": 0}),
        expect: &["maxAttempts"],
    },
    Case {
        what: "an unknown broker field",
        edit: |s| s["broker"]["nats"]["jetStreem"] = json!(true),
        expect: &["jetStreem"],
    },
    Case {
        what: "an unknown spec field",
        edit: |s| s["partitionz"] = json!(4),
        expect: &["partitionz"],
    },
    Case {
        what: "poll interval 0s",
        edit: |s| s["mode"] = json!({"polling": {"interval": "0s"}}),
        expect: &["interval"],
    },
    Case {
        what: "poll interval that is no duration",
        edit: |s| s["mode"] = json!({"polling": {"interval": "5x"}}),
        expect: &["interval"],
    },
    Case {
        what: "heartbeat 10ms",
        edit: |s| s["mode"] = json!({"logTailing": {"heartbeatInterval": "10ms"}}),
        expect: &["heartbeatInterval"],
    },
    Case {
        what: "retention shorter than the poll interval",
        edit: |s| {
            s["mode"] = json!({"polling": {"interval": "10s"}});
            s["retention"] = json!({"publishedRows": "5s"});
        },
        expect: &["publishedRows"],
    },
    Case {
        what: "deadLetter into the outbox table itself",
        edit: |s| s["failure"] = json!({"onExhausted": "deadLetter", "deadLetterTable": "outbox"}),
        expect: &["deadLetterTable"],
    },
    Case {
        what: "deadLetter with no usable target (default name too long)",
        edit: |s| {
            s["table"] = json!({"name": "a234567890123456789012345678901234567890123456789012345"});
            s["failure"] = json!({"onExhausted": "deadLetter"});
        },
        expect: &["deadLetterTable"],
    },
    Case {
        what: "kafka acks weakened",
        edit: |s| {
            s["broker"] =
                json!({"kafka": {"bootstrapServers": "k:9092", "properties": {"acks": "1"}}})
        },
        expect: &["properties"],
    },
    Case {
        what: "kafka in-flight limit raised past idempotence",
        edit: |s| s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "properties": {"max.in.flight.requests.per.connection": "50"}}}),
        expect: &["properties"],
    },
    Case {
        what: "kafka timeout set again under its topic-level name",
        edit: |s| s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "properties": {"topic.message.timeout.ms": "5000"}}}),
        expect: &["properties"],
    },
    Case {
        what: "kafka in-flight limit raised under its alias",
        edit: |s| {
            s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "properties": {"max.in.flight": "50"}}})
        },
        expect: &["properties"],
    },
    Case {
        what: "a librdkafka plugin",
        edit: |s| s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "properties": {"plugin.library.paths": "/tmp/x.so"}}}),
        expect: &["plugins are not supported"],
    },
    Case {
        what: "librdkafka's mock cluster",
        edit: |s| s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "properties": {"test.mock.num.brokers": "3"}}}),
        expect: &["mock cluster"],
    },
    Case {
        what: "a kafka setting librdkafka refuses beside idempotence",
        edit: |s| s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "properties": {"queuing.strategy": "lifo"}}}),
        expect: &["queuing.strategy"],
    },
    Case {
        what: "more kafka properties than the schema allows",
        edit: |s| {
            let properties: serde_json::Map<String, Value> =
                (0..129).map(|i| (format!("x.{i}"), json!("1"))).collect();
            s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "properties": properties}})
        },
        // The schema's refusal: names librdkafka does not know would otherwise end as
        // InvalidSpec and pass a check on "properties" alone.
        expect: &["128"],
    },
    Case {
        what: "kafka bootstrapServers past the schema's 2048 characters",
        edit: |s| {
            let servers = vec!["broker-0123456789.kafka.example:9092"; 60].join(",");
            s["broker"] = json!({"kafka": {"bootstrapServers": servers}})
        },
        expect: &["bootstrapServers"],
    },
    Case {
        what: "a duration past the schema's 32 characters",
        edit: |s| s["alerting"] = json!({"oldestUnpublishedAge": "1h".repeat(20)}),
        expect: &["oldestUnpublishedAge"],
    },
    Case {
        what: "a duration longer than the API server's durations hold",
        edit: |s| {
            s["mode"] = json!({"logTailing": {"heartbeatInterval": "9999999h"}});
        },
        expect: &["heartbeatInterval"],
    },
    Case {
        what: "databaseRef with both secretName and userSecretName",
        edit: |s| {
            s["database"] = json!({"databaseRef": {
                "name": "pg", "secretName": "pg-app", "userSecretName": "pg-user"}})
        },
        expect: &["secretName"],
    },
    Case {
        what: "databaseRef database without userSecretName",
        edit: |s| s["database"] = json!({"databaseRef": {"name": "pg", "database": "shop"}}),
        expect: &["database"],
    },
    Case {
        what: "returnAfter under 1s without a WAL budget",
        edit: |s| s["mode"] = json!({"logTailing": {"returnAfter": "500ms"}}),
        expect: &["returnAfter"],
    },
    Case {
        what: "kafka topic with a space",
        edit: |s| {
            s["broker"] = json!({"kafka": {"bootstrapServers": "k:9092", "topic": "outbox events"}})
        },
        expect: &["topic"],
    },
    Case {
        what: "nats subject with a wildcard",
        edit: |s| s["broker"]["nats"]["subject"] = json!("outbox.>"),
        expect: &["subject"],
    },
    Case {
        what: "nats url that is not nats://",
        edit: |s| s["broker"]["nats"]["url"] = json!("http://nats:4222"),
        expect: &["url"],
    },
    Case {
        what: "slotRetainedWal 0",
        edit: |s| s["alerting"] = json!({"slotRetainedWal": "0"}),
        expect: &["slotRetainedWal"],
    },
    Case {
        what: "oldestUnpublishedAge 0s",
        edit: |s| s["alerting"] = json!({"oldestUnpublishedAge": "0s"}),
        expect: &["oldestUnpublishedAge"],
    },
    Case {
        what: "a Secret name that cannot exist",
        edit: |s| s["database"]["postgres"]["connectionSecretRef"]["name"] = json!("Orders_DB"),
        expect: &["connectionSecretRef"],
    },
    Case {
        what: "a relay image while the install does not allow one",
        edit: |s| s["relay"] = json!({"image": "registry.example/anything:1"}),
        expect: &[
            "spec.relay.image: this operator's install does not let an OutboxRelay choose its image",
        ],
    },
    Case {
        what: "a ServiceAccount while the install does not allow one",
        edit: |s| s["relay"] = json!({"serviceAccountName": "cluster-admin-ish"}),
        expect: &["spec.relay.serviceAccountName"],
    },
    Case {
        what: "a Secret reference into another namespace",
        edit: |s| {
            s["database"]["postgres"]["connectionSecretRef"]["namespace"] = json!("kube-system")
        },
        expect: &["namespace"],
    },
    Case {
        what: "the Secret exists but has no such key",
        edit: |s| s["database"]["postgres"]["connectionSecretRef"]["key"] = json!("url"),
        expect: &["spec.database.postgres.connectionSecretRef: Secret db has no key url"],
    },
    Case {
        what: "the CA Secret holds no PEM certificate",
        edit: |s| {
            s["database"]["postgres"]["sslMode"] = json!("verify-full");
            s["database"]["postgres"]["caSecretRef"] = json!({"name": "db", "key": "mysql"});
        },
        expect: &[
            "spec.database.postgres.caSecretRef: Secret db key mysql does not hold PEM certificates",
        ],
    },
    Case {
        what: "the Secret holds no PostgreSQL URL (log tailing: no slot for it)",
        edit: |s| {
            log_tailing(s);
            s["database"]["postgres"]["connectionSecretRef"]["key"] = json!("mysql");
        },
        expect: &["does not hold a postgres:// URL"],
    },
    Case {
        what: "every problem at once: bad database URL and a RabbitMQ URL that is not AMQP",
        edit: |s| {
            s["database"]["postgres"]["connectionSecretRef"]["key"] = json!("mysql");
            s["broker"] = json!({"rabbitmq": {"urlSecretRef": {"name": "mq", "key": "http"}}});
        },
        expect: &[
            "2 problems",
            "spec.database.postgres.connectionSecretRef",
            "spec.broker.rabbitmq.urlSecretRef: Secret mq key http does not hold an amqp://",
        ],
    },
];

/// Replication slots and publications that exist, by name.
async fn replication_objects(db: &tokio_postgres::Client) -> (Vec<String>, Vec<String>) {
    let names = |rows: Vec<tokio_postgres::Row>| -> Vec<String> {
        rows.iter().map(|r| r.get::<_, String>(0)).collect()
    };
    let slots = db
        .query(
            "SELECT slot_name::text FROM pg_replication_slots ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    let publications = db
        .query("SELECT pubname::text FROM pg_publication ORDER BY 1", &[])
        .await
        .unwrap();
    (names(slots), names(publications))
}

/// Why `render` and `check` refuse `manifest`, offline: the CRD's schema as
/// `load_relays` holds it, then the spec rules; `None` when both pass it.
fn offline_refusal(manifest: &Value) -> Option<String> {
    let text = serde_yaml::to_string(manifest).unwrap();
    match outbox_operator::render::load_relays(&text, "case") {
        Err(err) => Some(err.to_string()),
        Ok(relays) => relays
            .iter()
            .find_map(|relay| outbox_operator::spec::parse(relay).err())
            .map(|problems| problems.to_string()),
    }
}

enum Outcome {
    Refused(String),
    InvalidSpec(String),
}

async fn apply_case(client: &Client, namespace: &str, name: &str, manifest: &Value) -> Outcome {
    let api: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    // As `kubectl apply --server-side` does: strict field validation, so an unknown
    // field is refused rather than dropped.
    let applied = api
        .patch(
            name,
            &PatchParams::apply("invalid-specs-test").validation_strict(),
            &Patch::Apply(manifest),
        )
        .await;
    match applied {
        Err(kube::Error::Api(status)) => Outcome::Refused(status.message),
        Err(other) => panic!("applying {name}: {other}"),
        Ok(_) => {
            let relay = common::wait_for_some(
                &format!("{name} to report Ready=False InvalidSpec"),
                WAIT,
                || async {
                    let relay = api.get_opt(name).await.ok().flatten()?;
                    let ready = operator::condition(&relay, "Ready")?;
                    (ready.reason == "InvalidSpec"
                        && ready.observed_generation == relay.metadata.generation)
                        .then_some(ready)
                },
            )
            .await;
            assert_eq!(relay.status, "False", "{name}: {relay:?}");
            Outcome::InvalidSpec(relay.message)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_specs_are_refused_or_reported_and_create_nothing() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    let namespace = common::fresh_namespace(&client).await;
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let admin = common::pg_admin().await;
    operator::create_secret(
        &client,
        &namespace,
        "db",
        &[
            ("uri", db.url.as_str()),
            ("mysql", "mysql://app:s3cret@db:3306/shop"),
        ],
    )
    .await;
    operator::create_secret(
        &client,
        &namespace,
        "mq",
        &[
            ("http", "http://u:p@mq"),
            ("plain", "amqp://app:s3cret@mq:5672/%2f"),
        ],
    )
    .await;
    let before = replication_objects(&admin).await;
    let (_, publications_before) = replication_objects(&db.client).await;

    let mut args = ControllerArgs::for_namespace(&namespace);
    args.identity = Some("invalid-specs-test".to_owned());
    args.lease_name = "outbox-operator-invalid-specs-test".to_owned();
    args.status_interval_seconds = 1;
    let running = operator::InProcess::start(&client, args);

    let mut report = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let name = format!("bad-{i}");
        let mut manifest = base(&name);
        (case.edit)(&mut manifest["spec"]);
        let offline = offline_refusal(&manifest);
        let (how, message) = match apply_case(&client, &namespace, &name, &manifest).await {
            Outcome::Refused(m) => {
                // What the API server refuses, `render` and `check` refuse before it.
                let offline = offline.unwrap_or_else(|| {
                    panic!(
                        "{}: refused by the API server ({m}), but render and check pass it",
                        case.what
                    )
                });
                assert!(!offline.contains("s3cret"), "{}: {offline}", case.what);
                ("refused by the API server", m)
            }
            Outcome::InvalidSpec(m) => ("Ready=False InvalidSpec", m),
        };
        for expected in case.expect {
            assert!(
                message.contains(expected),
                "{}: `{expected}` missing from the answer ({how}): {message}",
                case.what
            );
        }
        assert!(
            !message.contains("s3cret"),
            "{}: a Secret value leaked: {message}",
            case.what
        );
        report.push(format!("{:<75} {how}", case.what));
    }
    assert!(CASES.len() >= 30, "the table must keep at least 30 cases");

    // A valid relay reconciled after them proves the controller was working all along
    // (its database checks pass, so it creates its children).
    let good = base("good");
    let api: Api<OutboxRelay> = Api::namespaced(client.clone(), &namespace);
    api.patch(
        "good",
        &PatchParams::apply("invalid-specs-test"),
        &Patch::Apply(&good),
    )
    .await
    .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &namespace);
    common::wait_for("the valid relay's Deployment", WAIT, || async {
        deployments
            .get_opt("good-relay")
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;

    // Nothing of the invalid ones exists anywhere.
    let names: Vec<String> = deployments
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(names, vec!["good-relay".to_owned()], "Deployments");
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let stray: Vec<String> = config_maps
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(ResourceExt::name_any)
        .filter(|n| n.starts_with("bad-"))
        .collect();
    assert!(stray.is_empty(), "ConfigMaps of invalid relays: {stray:?}");
    let after = replication_objects(&admin).await;
    let ours = |slots: &[String]| -> Vec<String> {
        slots
            .iter()
            .filter(|s| s.contains(&namespace.replace('-', "_")) || s.contains("bad_slot"))
            .cloned()
            .collect()
    };
    assert_eq!(ours(&after.0), ours(&before.0), "replication slots");
    assert!(ours(&after.0).is_empty(), "slots: {:?}", after.0);
    let (_, publications_after) = replication_objects(&db.client).await;
    assert_eq!(publications_after, publications_before, "publications");

    println!("{} invalid specs:\n{}", CASES.len(), report.join("\n"));
    // Every relay, invalid ones included, goes on delete: the finalizer never blocks on
    // a spec that cannot run or a Secret that never held a usable URL.
    let _ = api
        .delete_collection(&Default::default(), &ListParams::default())
        .await;
    common::wait_for("every relay to be finalized and gone", WAIT / 2, || async {
        api.list(&ListParams::default())
            .await
            .is_ok_and(|l| l.items.is_empty())
    })
    .await;
    let _ = running.stop(WAIT).await;
    common::delete_namespace(&client, &namespace).await;
    db.drop_database().await;
}
