//! The field rules: pure checks of one value each, shared by `crate::spec::parse`, the
//! CRD schema (`crate::api`) and the code that builds SQL and broker names.

use std::fmt;
use std::time::Duration;

/// What a SQL identifier from a user may look like; it is also always quoted in SQL.
pub const IDENTIFIER_PATTERN: &str = "^[A-Za-z_][A-Za-z0-9_]{0,62}$";
/// PostgreSQL's rule for replication slot names; publications follow it too, because
/// pgoutput's `publication_names` option folds unquoted names to lower case.
pub const SLOT_NAME_PATTERN: &str = "^[a-z0-9_]{1,63}$";
/// Go-style durations: `500ms`, `30s`, `5m`, `24h`, `1h30m`.
pub const DURATION_PATTERN: &str = "^([0-9]+(ms|s|m|h))+$";
/// The key a Secret reference names when it names none: the one entry every reader
/// (CRD default, controller, relay, `check`, docs/reference.md) goes by.
pub const DEFAULT_SECRET_KEY: &str = "uri";
/// Checks a Kubernetes label: the key an optional DNS-subdomain prefix and a name of at
/// most 63 characters, the value at most 63, both alphanumeric at the ends with `-`,
/// `_` and `.` inside. The error says which part is wrong.
pub fn check_label(key: &str, value: &str) -> Result<(), String> {
    fn name_ok(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 63
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    }
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        let ok = !prefix.is_empty()
            && prefix.len() <= 253
            && prefix.split('.').all(|part| {
                !part.is_empty()
                    && part.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && part.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            });
        if !ok {
            return Err(format!(
                "label key {key:?}: its prefix is not a DNS subdomain"
            ));
        }
    }
    if !name_ok(name) {
        return Err(format!(
            "label key {key:?}: the name must be 1-63 letters, digits, '-', '_' or '.', alphanumeric at both ends"
        ));
    }
    if !value.is_empty() && !name_ok(value) {
        return Err(format!(
            "label {key}: the value {value:?} must be at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends"
        ));
    }
    Ok(())
}

/// A `KEY=VALUE` label (the operator's `--monitoring-label`), checked.
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))?;
    let (key, value) = (key.trim(), value.trim());
    check_label(key, value)?;
    Ok((key.to_owned(), value.to_owned()))
}

/// Placeholder in topic, subject and routing-key templates.
pub const AGGREGATE_TYPE_PLACEHOLDER: &str = "{aggregateType}";
/// The shortest heartbeat a log-tailing relay accepts.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(100);
/// Header names the relay sets itself; a header column may not take them.
pub const RESERVED_HEADERS: [&str; 3] = ["id", "type", "aggregateType"];
/// Librdkafka settings the relay fixes (delivery guarantees, connection security), so
/// `broker.kafka.properties` may not set them, under any of librdkafka's names for them:
/// an alias set beside the relay's own name would be a second key, and which of the two
/// librdkafka applies last is not defined. `topic.` addresses any topic setting under a
/// second name (`topic.acks`, `topic.message.timeout.ms`); the same settings without it
/// stay open. `transactional.id` would make the idempotent producer a transactional one,
/// which the relay never begins. Prefixes end with a dot.
pub const FIXED_KAFKA_PROPERTIES: [&str; 14] = [
    "acks",
    "request.required.acks",
    "enable.idempotence",
    "max.in.flight.requests.per.connection",
    "max.in.flight",
    "security.protocol",
    "bootstrap.servers",
    "metadata.broker.list",
    "transactional.id",
    "enable.ssl.certificate.verification",
    "enable.sasl.oauthbearer.unsecure.jwt",
    "sasl.",
    "ssl.",
    "topic.",
];

/// One thing wrong with a spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The field, as a path (`spec.mode.polling.interval`).
    pub field: String,
    /// What is wrong.
    pub message: String,
    /// How to fix it.
    pub fix: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ({})", self.field, self.message, self.fix)
    }
}

/// Every problem found in a spec, in field order of discovery.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct Problems(pub Vec<Problem>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&lines.join("; "))
    }
}

impl Problems {
    /// Adds a problem.
    pub fn push(&mut self, field: impl Into<String>, message: impl Into<String>, fix: &str) {
        self.0.push(Problem {
            field: field.into(),
            message: message.into(),
            fix: fix.to_owned(),
        });
    }

    /// True when nothing was found.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Checks a user-supplied SQL identifier against [`IDENTIFIER_PATTERN`].
pub fn check_identifier(value: &str) -> Result<(), String> {
    let mut chars = value.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if first_ok && rest_ok && value.len() <= 63 {
        Ok(())
    } else {
        Err(format!(
            "`{value}` is not a SQL identifier (letters, digits and _, not starting with a digit, at most 63)"
        ))
    }
}

/// Checks a replication slot or publication name against [`SLOT_NAME_PATTERN`].
pub fn check_slot_name(value: &str) -> Result<(), String> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{value}` is not a valid name (lowercase letters, digits and _, 1 to 63 characters)"
        ))
    }
}

/// Whether a Kafka property is one the relay fixes.
pub fn is_fixed_kafka_property(key: &str) -> bool {
    FIXED_KAFKA_PROPERTIES.iter().any(|fixed| {
        if fixed.ends_with('.') {
            key.starts_with(fixed)
        } else {
            key == *fixed
        }
    })
}

/// Which broker a name is checked for: each has its own rules for names and headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// Apache Kafka.
    Kafka,
    /// NATS JetStream.
    Nats,
    /// RabbitMQ.
    Amqp,
}

/// Why a rendered topic, subject or routing key breaks its broker's rules; the text is
/// said of the name and follows it in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    /// A Kafka topic of no characters or more than 249.
    #[error("is not 1 to 249 characters long")]
    KafkaLength,
    /// A Kafka topic with other characters than letters, digits, `.`, `_` and `-`, or
    /// `.` or `..` alone.
    #[error("is not a valid Kafka topic (letters, digits, '.', '_', '-')")]
    KafkaTopic,
    /// A NATS subject with spaces, wildcards or empty tokens.
    #[error("is not a valid NATS subject (no spaces, wildcards or empty tokens)")]
    NatsSubject,
    /// An AMQP routing key longer than 255 bytes.
    #[error("is longer than 255 bytes, the AMQP routing-key limit")]
    AmqpLength,
}

/// Checks a rendered topic, subject or routing key.
pub fn check_destination(kind: BrokerKind, destination: &str) -> Result<(), DestinationError> {
    match kind {
        BrokerKind::Kafka => {
            let valid_chars = destination
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if destination.is_empty() || destination.len() > 249 {
                Err(DestinationError::KafkaLength)
            } else if !valid_chars || destination == "." || destination == ".." {
                Err(DestinationError::KafkaTopic)
            } else {
                Ok(())
            }
        }
        BrokerKind::Nats => {
            if destination.is_empty()
                || destination.contains(|c: char| c.is_whitespace() || c == '*' || c == '>')
                || destination.split('.').any(str::is_empty)
            {
                Err(DestinationError::NatsSubject)
            } else {
                Ok(())
            }
        }
        BrokerKind::Amqp => {
            if destination.len() > 255 {
                Err(DestinationError::AmqpLength)
            } else {
                Ok(())
            }
        }
    }
}

/// Checks a template before any row is seen: it must yield a valid name for a typical
/// aggregate type.
pub fn check_template(kind: BrokerKind, template: &str) -> Result<(), DestinationError> {
    check_destination(kind, &template.replace(AGGREGATE_TYPE_PLACEHOLDER, "Order"))
}

/// Checks a destination template, adding a problem for `field` when it breaks `kind`'s
/// rules.
pub fn check_template_into(p: &mut Problems, kind: BrokerKind, field: &str, value: &str) {
    if let Err(message) = check_template(kind, value) {
        p.push(
            field,
            format!("`{value}` {message}"),
            "fix the template; {aggregateType} is replaced by each row's aggregate type",
        );
    }
}

/// Checks a Secret reference's name (a DNS subdomain) and key, adding a problem for each.
pub fn check_secret_ref(p: &mut Problems, field: &str, name: &str, key: &str) {
    let dns_subdomain = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.')
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
    };
    if !dns_subdomain(name) {
        p.push(
            format!("{field}.name"),
            format!("`{name}` is not a valid Secret name"),
            "name a Secret in the relay's namespace (lowercase letters, digits, - and .)",
        );
    }
    let key_ok = !key.is_empty()
        && key.len() <= 253
        && key
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
    if !key_ok {
        p.push(
            format!("{field}.key"),
            format!("`{key}` is not a valid Secret key"),
            "use letters, digits, -, _ and .",
        );
    }
}

/// `outbox_<namespace>_<name>`, made safe for PostgreSQL: lowercase letters, digits and
/// underscores, at most 63 bytes; a hash suffix keeps long names distinct.
pub fn default_slot_name(namespace: &str, name: &str) -> String {
    let raw = format!("outbox_{namespace}_{name}");
    let mut safe: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if safe.len() > 63 {
        // Namespace and name are each up to 63/253 characters; keep a readable prefix
        // and make the rest unique with a stable hash of the full name.
        let hash = fnv1a64(raw.as_bytes());
        safe.truncate(46);
        safe = format!("{safe}_{hash:016x}");
    }
    safe
}

/// FNV-1a: stable across releases and platforms, unlike `std`'s hasher.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_checked_as_kubernetes_does() {
        for good in [
            "release=kube-prometheus-stack",
            "prometheus.io/team=payments",
            "app.kubernetes.io/part-of=shop",
            "empty=",
        ] {
            assert!(parse_label(good).is_ok(), "{good}");
        }
        for bad in [
            "release",
            "=x",
            "-a=b",
            "a=b-",
            "Example.com/x=y",
            "a/b/c=d",
            &format!("a={}", "v".repeat(64)),
            &format!("{}=v", "k".repeat(64)),
        ] {
            assert!(parse_label(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_label(" release = prom ").unwrap(),
            ("release".to_owned(), "prom".to_owned())
        );
    }

    #[test]
    fn identifiers() {
        for good in ["outbox", "_x", "Outbox_2", &"a".repeat(63)] {
            assert!(check_identifier(good).is_ok(), "{good}");
        }
        for bad in ["", "2x", "a-b", "a b", "a\"b", "x;drop", &"a".repeat(64)] {
            assert!(check_identifier(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn slot_names() {
        for good in ["outbox_shop_orders", "a", "9_x"] {
            assert!(check_slot_name(good).is_ok(), "{good}");
        }
        for bad in ["", "Orders", "a-b", &"a".repeat(64)] {
            assert!(check_slot_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fixed_kafka_properties() {
        for fixed in [
            "acks",
            "ssl.ca.location",
            "sasl.mechanism",
            "bootstrap.servers",
            "metadata.broker.list",
            "max.in.flight",
            "topic.acks",
            "topic.message.timeout.ms",
            "transactional.id",
            "enable.ssl.certificate.verification",
        ] {
            assert!(is_fixed_kafka_property(fixed), "{fixed}");
        }
        for free in ["linger.ms", "compression.type", "acksx"] {
            assert!(!is_fixed_kafka_property(free), "{free}");
        }
    }

    /// The CRD's CEL rule refuses every fixed property at `kubectl apply`, as the spec
    /// check does after it.
    #[test]
    fn the_crd_refuses_every_fixed_kafka_property() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(crate::api::OutboxRelay::crd()).expect("json");
        let mut rules = Vec::new();
        fn walk<'a>(value: &'a serde_json::Value, rules: &mut Vec<&'a str>) {
            match value {
                serde_json::Value::Object(map) => {
                    if let Some(rule) = map.get("rule").and_then(|r| r.as_str()) {
                        rules.push(rule);
                    }
                    map.values().for_each(|v| walk(v, rules));
                }
                serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, rules)),
                _ => {}
            }
        }
        walk(&crd, &mut rules);
        let rule = rules
            .iter()
            .find(|rule| rule.contains("'request.required.acks'"))
            .expect("the properties rule");
        for fixed in FIXED_KAFKA_PROPERTIES {
            let named = if fixed.ends_with('.') {
                format!("k.startsWith('{fixed}')")
            } else {
                format!("'{fixed}'")
            };
            assert!(
                rule.contains(&named),
                "{fixed} is not in the CRD's rule: {rule}"
            );
        }
    }

    #[test]
    fn templates_are_checked() {
        assert!(check_template(BrokerKind::Kafka, "outbox.event.{aggregateType}").is_ok());
        assert!(check_template(BrokerKind::Kafka, "bad topic").is_err());
        assert!(check_template(BrokerKind::Nats, "outbox.>").is_err());
    }

    #[test]
    fn slot_names_are_safe_and_distinct() {
        assert_eq!(
            default_slot_name("team-a", "Orders.v2"),
            "outbox_team_a_orders_v2"
        );
        let long_a = default_slot_name("ns", &"x".repeat(200));
        let long_b = default_slot_name("ns", &format!("{}y", "x".repeat(199)));
        assert!(long_a.len() <= 63 && long_b.len() <= 63);
        assert_ne!(long_a, long_b);
        assert!(check_slot_name(&long_a).is_ok());
    }
}
