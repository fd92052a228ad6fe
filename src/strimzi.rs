//! Strimzi clusters named by `spec.broker.kafka.kafkaRef`: what the controller reads
//! from a `Kafka` and a `KafkaUser` (`kafka.strimzi.io/v1beta2`) and what it checks, as
//! pure functions of the objects' JSON. The connection itself is what
//! [`crate::api::KafkaRef::resolve`] says (Strimzi's naming), so the controller,
//! `render` and the relay agree without reading the cluster; these checks say, before
//! any pod starts, when the cluster disagrees and which field to change.

use serde_json::Value;

use crate::api::{KafkaRef, KafkaUserAuthentication};

/// API group of Strimzi's resources.
pub const GROUP: &str = "kafka.strimzi.io";
/// The version read.
pub const VERSION: &str = "v1beta2";
/// The Kafka cluster's kind and plural.
pub const KAFKA: (&str, &str) = ("Kafka", "kafkas");
/// The Kafka user's kind and plural.
pub const KAFKA_USER: (&str, &str) = ("KafkaUser", "kafkausers");
/// The label that ties a KafkaUser to its cluster.
pub const CLUSTER_LABEL: &str = "strimzi.io/cluster";

/// An object as the controller found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen<T> {
    /// The kind is not served: Strimzi is not installed.
    NotInstalled,
    /// No object of that name in the relay's namespace.
    Missing,
    /// The operator may not read it (its RBAC lacks `get`).
    Forbidden,
    /// The object, as read.
    Found(T),
}

impl<T> Seen<T> {
    /// What `read` makes of a found object; the other cases as they are.
    pub fn map<U>(self, read: impl FnOnce(&T) -> U) -> Seen<U> {
        match self {
            Self::Found(object) => Seen::Found(read(&object)),
            Self::Missing => Seen::Missing,
            Self::NotInstalled => Seen::NotInstalled,
            Self::Forbidden => Seen::Forbidden,
        }
    }
}

/// A listener of a Kafka cluster (`spec.kafka.listeners[]`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listener {
    /// Its name.
    pub name: String,
    /// Its port.
    pub port: i64,
    /// `tls: true`.
    pub tls: bool,
    /// `authentication.type`, when it authenticates clients.
    pub authentication: Option<String>,
}

/// What the controller reads from a Kafka.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KafkaFacts {
    /// Its listeners.
    pub listeners: Vec<Listener>,
}

/// What the controller reads from a KafkaUser.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserFacts {
    /// Its `strimzi.io/cluster` label.
    pub cluster: Option<String>,
    /// `spec.authentication.type`.
    pub authentication: Option<String>,
    /// `status.secret`: the Secret the User Operator wrote.
    pub secret: Option<String>,
    /// `status.conditions[type=Ready].status == "True"`.
    pub ready: bool,
}

/// The cluster and the user as the controller found them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StrimziSeen {
    /// The Kafka.
    pub kafka: Seen<KafkaFacts>,
    /// The KafkaUser, when the reference names one.
    pub user: Option<Seen<UserFacts>>,
}

fn text(object: &Value, path: &str) -> Option<String> {
    object
        .pointer(path)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// Reads a Kafka object.
pub fn kafka_facts(kafka: &Value) -> KafkaFacts {
    let listeners = kafka
        .pointer("/spec/kafka/listeners")
        .and_then(Value::as_array)
        .map(|all| {
            all.iter()
                .map(|l| Listener {
                    name: text(l, "/name").unwrap_or_default(),
                    port: l.get("port").and_then(Value::as_i64).unwrap_or_default(),
                    tls: l.get("tls").and_then(Value::as_bool) == Some(true),
                    authentication: text(l, "/authentication/type"),
                })
                .collect()
        })
        .unwrap_or_default();
    KafkaFacts { listeners }
}

/// Reads a KafkaUser object (`metadata.labels` included).
pub fn user_facts(user: &Value) -> UserFacts {
    let ready = user
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|conditions| {
            conditions.iter().any(|c| {
                c.get("type").and_then(Value::as_str) == Some("Ready")
                    && c.get("status").and_then(Value::as_str) == Some("True")
            })
        });
    UserFacts {
        cluster: user
            .pointer("/metadata/labels")
            .and_then(|l| l.get(CLUSTER_LABEL))
            .and_then(Value::as_str)
            .map(str::to_owned),
        authentication: text(user, "/spec/authentication/type"),
        secret: text(user, "/status/secret"),
        ready,
    }
}

/// A reason the relay cannot use the cluster, for `BrokerReady`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StrimziProblem {
    /// The condition reason.
    pub reason: &'static str,
    /// What is wrong and the fix.
    pub message: String,
}

fn problem_of(reason: &'static str, message: String) -> Option<StrimziProblem> {
    Some(StrimziProblem { reason, message })
}

fn unreadable<T>(seen: &Seen<T>, kind: (&str, &str), name: &str) -> Option<StrimziProblem> {
    let (kind, plural) = kind;
    match seen {
        Seen::NotInstalled => problem_of(
            "StrimziNotInstalled",
            format!(
                "spec.broker.kafka.kafkaRef names Strimzi {kind} {name}, but the API server does not serve {plural}.{GROUP}/{VERSION}: install Strimzi, or give bootstrapServers, tls and sasl instead"
            ),
        ),
        Seen::Missing => problem_of(
            if kind == KAFKA.0 {
                "KafkaNotFound"
            } else {
                "KafkaUserNotFound"
            },
            format!(
                "Strimzi {kind} {name} does not exist in the relay's namespace: create it there, or fix spec.broker.kafka.kafkaRef"
            ),
        ),
        Seen::Forbidden => problem_of(
            "StrimziNotReadable",
            format!(
                "the operator may not read Strimzi {kind} {name}: grant it get on {plural}.{GROUP} (the Helm chart's RBAC does)"
            ),
        ),
        Seen::Found(_) => None,
    }
}

/// The first reason `reference` cannot be used as `seen` shows it (`None`: usable).
pub fn problem(reference: &KafkaRef, seen: &StrimziSeen) -> Option<StrimziProblem> {
    let name = &reference.name;
    let kafka = match &seen.kafka {
        Seen::Found(facts) => facts,
        other => return unreadable(other, KAFKA, name),
    };
    let port = i64::from(reference.port);
    let Some(listener) = kafka.listeners.iter().find(|l| l.port == port) else {
        let known: Vec<String> = kafka
            .listeners
            .iter()
            .map(|l| {
                format!(
                    "{} on {}{}",
                    l.name,
                    l.port,
                    if l.tls { " (TLS)" } else { "" }
                )
            })
            .collect();
        return problem_of(
            "KafkaListenerNotFound",
            format!(
                "Kafka {name} has no listener on port {port} (its listeners: {}): set spec.broker.kafka.kafkaRef.port to a TLS listener's port",
                known.join(", ")
            ),
        );
    };
    if !listener.tls {
        return problem_of(
            "KafkaListenerNotTls",
            format!(
                "listener {} on port {port} of Kafka {name} has no TLS, and kafkaRef connects over TLS only: choose a listener with tls: true in spec.broker.kafka.kafkaRef.port",
                listener.name
            ),
        );
    }
    let wanted = reference.user.as_ref().map(|_| reference.authentication());
    match (listener.authentication.as_deref(), wanted) {
        (Some(auth), None) => {
            return problem_of(
                "KafkaListenerNeedsUser",
                format!(
                    "listener {} of Kafka {name} authenticates clients ({auth}): name a KafkaUser in spec.broker.kafka.kafkaRef.user",
                    listener.name
                ),
            );
        }
        (Some(auth), Some(wanted)) if auth != wanted.as_str() => {
            return problem_of(
                "KafkaListenerAuthentication",
                format!(
                    "listener {} of Kafka {name} authenticates by {auth}, but kafkaRef logs in by {}: choose a listener whose authentication is {} (kafkaRef.port), or a user of the listener's kind",
                    listener.name,
                    wanted.as_str(),
                    wanted.as_str()
                ),
            );
        }
        (None, Some(KafkaUserAuthentication::ScramSha512)) => {
            return problem_of(
                "KafkaListenerAuthentication",
                format!(
                    "listener {} of Kafka {name} takes no SASL login, but kafkaRef logs in by scram-sha-512: choose a listener with authentication scram-sha-512 (kafkaRef.port)",
                    listener.name
                ),
            );
        }
        _ => {}
    }
    let (Some(user_name), Some(user)) = (&reference.user, &seen.user) else {
        return None;
    };
    let user = match user {
        Seen::Found(facts) => facts,
        other => return unreadable(other, KAFKA_USER, user_name),
    };
    if user.cluster.as_deref() != Some(name.as_str()) {
        return problem_of(
            "KafkaUserOtherCluster",
            format!(
                "KafkaUser {user_name} belongs to {} (its {CLUSTER_LABEL} label), not Kafka {name}: name a user of {name}",
                user.cluster
                    .as_deref()
                    .map_or("no cluster".to_owned(), |c| format!("Kafka {c}"))
            ),
        );
    }
    let wanted = reference.authentication();
    match user.authentication.as_deref() {
        Some(auth) if auth == wanted.as_str() => {}
        Some("tls-external") => {
            return problem_of(
                "KafkaUserAuthentication",
                format!(
                    "KafkaUser {user_name} authenticates by tls-external: Strimzi does not hold its certificate, so kafkaRef cannot find it; give bootstrapServers, tls and sasl instead"
                ),
            );
        }
        Some(auth @ ("tls" | "scram-sha-512")) => {
            return problem_of(
                "KafkaUserAuthentication",
                format!(
                    "KafkaUser {user_name} authenticates by {auth}, not {}: set spec.broker.kafka.kafkaRef.authentication: {auth}",
                    wanted.as_str()
                ),
            );
        }
        other => {
            return problem_of(
                "KafkaUserAuthentication",
                format!(
                    "KafkaUser {user_name} has {} authentication, and the relay logs in only by tls or scram-sha-512: give the user one of them",
                    other.unwrap_or("no")
                ),
            );
        }
    }
    if !user.ready {
        return problem_of(
            "KafkaUserNotReady",
            format!(
                "KafkaUser {user_name} is not Ready yet (the User Operator writes its Secret when it is): waiting"
            ),
        );
    }
    if let Some(secret) = &user.secret
        && reference.user_secret_name.is_none()
        && Some(secret) != reference.user_secret().as_ref()
    {
        return problem_of(
            "KafkaUserSecretMismatch",
            format!(
                "the User Operator keeps KafkaUser {user_name}'s credentials in Secret {secret}: set spec.broker.kafka.kafkaRef.userSecretName: {secret}"
            ),
        );
    }
    None
}

#[cfg(test)]
#[path = "strimzi/tests.rs"]
mod tests;
