//! The rules of librdkafka properties in a Kafka spec: what librdkafka refuses alone
//! or together, the settings the relay fixes after the user's, the names librdkafka
//! knows a setting under, and the relay's own message timeout.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;

/// Why [`deadline`] refuses the relay's message timeout.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeadlineError {
    /// The timeout setting is not a number of milliseconds in range.
    #[error("Kafka property {key} = {value:?}: not a number of milliseconds from 0 to 2147483647")]
    NotMilliseconds {
        /// The setting's name as written.
        key: String,
        /// Its value.
        value: String,
    },
    /// The timeout (set, or the default) is not longer than `linger.ms`.
    #[error(
        "Kafka property {key} = {ms} is not longer than linger.ms ({linger}): every message would time out"
    )]
    NotLongerThanLinger {
        /// The setting's name as written, or `message.timeout.ms (by default)`.
        key: String,
        /// The timeout.
        ms: u32,
        /// `linger.ms`.
        linger: f64,
    },
}

/// How long the relay waits for a message's acknowledgement before it gives the
/// message and its producer up: `message.timeout.ms` (or its alias
/// `delivery.timeout.ms`) from `properties`, 20 s by default; 0 waits for ever. Like
/// librdkafka, which no longer sees it, it must be longer than `linger.ms`.
pub(super) fn deadline(
    properties: &std::collections::BTreeMap<String, String>,
) -> Result<Option<Duration>, DeadlineError> {
    let (key, ms) = match timeout_setting(properties) {
        None => ("message.timeout.ms (by default)", 20_000),
        Some((key, value)) => match value.trim().parse::<u32>() {
            Ok(0) => return Ok(None),
            Ok(ms) if ms <= 2_147_483_647 => (key.as_str(), ms),
            _ => {
                return Err(DeadlineError::NotMilliseconds {
                    key: key.clone(),
                    value: value.clone(),
                });
            }
        },
    };
    let linger = properties
        .iter()
        .rfind(|(key, _)| canonical(key) == "linger.ms")
        .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        .unwrap_or(1.0);
    if f64::from(ms) <= linger {
        return Err(DeadlineError::NotLongerThanLinger {
            key: key.to_owned(),
            ms,
            linger,
        });
    }
    Ok(Some(Duration::from_millis(u64::from(ms))))
}

/// The properties to give up when [`deadline`] refuses `properties`: the timeout
/// setting it read, when one is set (a value out of range, or not longer than
/// `linger.ms`); otherwise `linger.ms` under each of its names, which reached the
/// default timeout (a Java producer's own default is six times as long).
pub(crate) fn deadline_culprits(
    properties: &std::collections::BTreeMap<String, String>,
) -> Vec<String> {
    match timeout_setting(properties) {
        Some((timeout, _)) => vec![timeout.clone()],
        None => properties
            .keys()
            .filter(|key| canonical(key) == "linger.ms")
            .cloned()
            .collect(),
    }
}

/// `message.timeout.ms` and its alias: the relay keeps that timeout itself and never
/// hands the value to librdkafka; [`deadline`] checks it.
fn is_relay_timeout(key: &str) -> bool {
    canonical(key) == "message.timeout.ms"
}

/// The relay's timeout setting in effect, if `properties` set one: the last of its
/// names in key order, as librdkafka would apply them. [`deadline`] reads it and
/// [`deadline_culprits`] gives it up, so the two always agree on which name wins.
fn timeout_setting(
    properties: &std::collections::BTreeMap<String, String>,
) -> Option<(&String, &String)> {
    properties.iter().rfind(|(key, _)| is_relay_timeout(key))
}

/// Why librdkafka refuses the property `key` = `value`, if it does: an unknown name (a
/// Java client's, say), a value not of its type or range, a codec librdkafka does not have.
/// Asked of librdkafka's own configuration parser, which makes no client: otherwise such
/// a setting is found only when the relay starts, and its pod restarts over and over.
/// The relay's own timeout ([`is_relay_timeout`]) is [`deadline`]'s to check, and the
/// [`GAPLESS`] settings never reach librdkafka, so neither is asked about.
/// `plugin.*` is refused without asking: setting it makes librdkafka load the libraries
/// named, in whichever process checks the spec (the controller's, say). So are its test
/// settings (`test.*`), which librdkafka takes.
pub(crate) fn refused_by_librdkafka(key: &str, value: &str) -> Option<String> {
    if GAPLESS.iter().any(|(fixed, _)| *fixed == canonical(key)) {
        return None;
    }
    if key.starts_with("plugin.") {
        return Some("librdkafka plugins are not supported: the relay's image has none".to_owned());
    }
    if key.starts_with("test.") || key.starts_with("ut_") {
        // librdkafka takes `test.mock.num.brokers` (a hidden setting): the producer
        // would then write to a mock cluster inside the relay, which acknowledges every
        // event, and the rows would be marked or deleted with nothing published.
        return Some(
            "librdkafka's test settings are not supported: a mock cluster would acknowledge events no broker received".to_owned(),
        );
    }
    match ClientConfig::new().set(key, value).create_native_config() {
        // librdkafka ends some of its reasons with a line break.
        Err(KafkaError::ClientConfig(_, why, _, _)) => Some(why.trim_end().to_owned()),
        Err(err) => Some(err.to_string()),
        Ok(_) => None,
    }
}

/// Properties librdkafka takes one by one (so [`refused_by_librdkafka`] lets them
/// pass) but refuses when it creates a producer with the relay's settings
/// (idempotence) or with one another, and so would be found only when the relay
/// starts, its pod restarting over and over; and `delivery.report.only.error`, which
/// would stall it. These are the checks of librdkafka's
/// `rd_kafka_conf_finalize` and `rd_kafka_topic_conf_finalize` (2.12) that such a
/// producer can meet; asking librdkafka itself would mean creating a client, with its
/// threads, in whichever process checks the spec. Values librdkafka does not take at
/// all are left to [`refused_by_librdkafka`].
pub(super) fn refused_together(
    properties: &std::collections::BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let mut refused = Vec::new();
    let mut refuse = |key: &str, why: String| refused.push((key.to_owned(), why));
    let int = |key: &str| properties.get(key).and_then(|v| c_int(v));
    let text = |key: &str| properties.get(key).map(|v| c_trim_start(v));
    let boolean = |key: &str| properties.get(key).and_then(|v| c_bool(v));
    if text("queuing.strategy").is_some_and(|v| v.eq_ignore_ascii_case("lifo")) {
        refuse(
            "queuing.strategy",
            "must be fifo: the relay's producer is idempotent, and librdkafka refuses lifo with enable.idempotence".to_owned(),
        );
    }
    // Not a librdkafka refusal, but a stall: the relay completes an event on its
    // delivery report, so without reports for successes every event would time out.
    if boolean("delivery.report.only.error") == Some(true) {
        refuse(
            "delivery.report.only.error",
            "must be false: the relay learns that an event was written from its delivery report; without one each event would time out and be written again, without end (or, with message.timeout.ms 0, waited for without end)".to_owned(),
        );
    }
    if int("queue.buffering.backpressure.threshold").is_some_and(|t| t > 1) {
        refuse(
            "queue.buffering.backpressure.threshold",
            "must be 1: the relay's producer is idempotent, and librdkafka refuses more with enable.idempotence".to_owned(),
        );
    }
    // librdkafka's defaults: 100 and 10000.
    let (min, max) = (
        int("reconnect.backoff.ms").unwrap_or(100),
        int("reconnect.backoff.max.ms").unwrap_or(10_000),
    );
    if max < min {
        let key = if properties.contains_key("reconnect.backoff.max.ms") {
            "reconnect.backoff.max.ms"
        } else {
            "reconnect.backoff.ms"
        };
        refuse(
            key,
            format!(
                "reconnect.backoff.max.ms ({max}) must not be less than reconnect.backoff.ms ({min}): librdkafka refuses it"
            ),
        );
    }
    // A consumer's setting, but librdkafka checks its value in a producer too, and any
    // value but its default can fail the producer's creation.
    if properties.contains_key("partition.assignment.strategy") {
        refuse(
            "partition.assignment.strategy",
            "is a consumer setting the relay's producer has no use for (librdkafka may refuse to create the producer over it)".to_owned(),
        );
    }
    // librdkafka installs a handler for this signal whenever it creates a producer
    // (replacing the relay's for SIGTERM, so a pod would stop without draining) and
    // sends it to its threads when it destroys one.
    if int("internal.termination.signal").is_some_and(|signal| signal != 0) {
        refuse(
            "internal.termination.signal",
            "must be 0: librdkafka would take the signal over from the relay (SIGTERM: pods would stop without draining) and raise it whenever the relay replaces a producer".to_owned(),
        );
    }
    // Without the broker's API versions the idempotent producer fails at run time
    // with brokers older than 0.10's protocol.
    if boolean("api.version.request") == Some(false) {
        refuse(
            "api.version.request",
            "must be true: the relay's idempotent producer needs the broker's API versions"
                .to_owned(),
        );
    }
    refused
}

/// Whether `properties` choose a partitioner that does not keep a key on one partition:
/// `random` ignores keys, `consistent_random` scatters empty ones (an empty aggregate
/// id). Per-aggregate order needs every event of an aggregate on one partition.
pub fn partitioner_scatters_keys(
    properties: &std::collections::BTreeMap<String, String>,
) -> Option<&'static str> {
    match properties.get("partitioner").map(|v| c_trim_start(v)) {
        Some("random") => Some("random ignores the key"),
        Some("consistent_random") => {
            Some("consistent_random sends an empty key (an empty aggregate id) to any partition")
        }
        _ => None,
    }
}

/// `value` without its leading blanks, as C's `isspace` counts them (librdkafka skips
/// them in numbers, enumerations and strings).
fn c_trim_start(value: &str) -> &str {
    value.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r'])
}

/// A boolean property as librdkafka reads it: `true` or `t` (any case) or `1`, and
/// `false` or `f` or `0`, as written; `None` for anything else, which librdkafka
/// refuses (and [`refused_by_librdkafka`] reports).
fn c_bool(value: &str) -> Option<bool> {
    if value.eq_ignore_ascii_case("true") || value.eq_ignore_ascii_case("t") || value == "1" {
        Some(true)
    } else if value.eq_ignore_ascii_case("false") || value.eq_ignore_ascii_case("f") || value == "0"
    {
        Some(false)
    } else {
        None
    }
}

/// An integer property as librdkafka reads it: C's `strtol(value, &end, 0)` (leading
/// blanks, a sign, `0x` for hexadecimal and `0` for octal, then as many digits as
/// there are, whatever follows) cast to `int`; `None` when no digit begins it, which
/// librdkafka refuses (and [`refused_by_librdkafka`] reports).
fn c_int(value: &str) -> Option<i64> {
    let rest = c_trim_start(value);
    let (negative, rest) = match rest.as_bytes().first() {
        Some(b'-') => (true, &rest[1..]),
        Some(b'+') => (false, &rest[1..]),
        _ => (false, rest),
    };
    let (radix, digits) = if let Some(hex) = rest
        .strip_prefix("0x")
        .or_else(|| rest.strip_prefix("0X"))
        .filter(|h| h.starts_with(|c: char| c.is_ascii_hexdigit()))
    {
        (16, hex)
    } else if rest.starts_with('0') {
        (8, rest)
    } else {
        (10, rest)
    };
    let run = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    if run == 0 {
        return None;
    }
    // strtol saturates at the long's bounds; the cast to int keeps the low 32 bits.
    let magnitude = i64::from_str_radix(&digits[..run], radix).unwrap_or(i64::MAX);
    let long = if negative {
        magnitude.saturating_neg()
    } else {
        magnitude
    };
    Some(i64::from(long as i32))
}

/// Settings `client_config` sets after the user's properties, so that no message is
/// ever written behind one of its chain that librdkafka gave up on (see
/// `broker::kafka`'s notes): librdkafka never times a message out (the relay does,
/// see [`deadline`]), retries it for as long as it waits, and stops on any refusal that
/// would leave a gap. A user may name them (under either name, see [`canonical`]), but
/// their values never reach librdkafka.
pub(super) const GAPLESS: [(&str, &str); 3] = [
    ("message.timeout.ms", "0"),
    ("message.send.max.retries", "2147483647"),
    ("enable.gapless.guarantee", "true"),
];

/// The one name the relay uses for a setting librdkafka knows under two, for the
/// settings the relay sets itself (`linger.ms` by default, the [`GAPLESS`] ones after
/// the user's): a user's value is set under that name, so the config never holds both
/// (which one wins would depend on the order librdkafka applies them in).
pub(super) fn canonical(key: &str) -> &str {
    match key {
        "queue.buffering.max.ms" => "linger.ms",
        "retries" => "message.send.max.retries",
        "delivery.timeout.ms" => "message.timeout.ms",
        key => key,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_read_as_librdkafka_reads_them() {
        for (value, read) in [
            ("42", Some(42)),
            ("  +7", Some(7)),
            ("-3", Some(-3)),
            ("0200", Some(128)),
            ("0x1F", Some(31)),
            ("0x", Some(0)),
            ("09", Some(0)),
            ("2.5", Some(2)),
            ("5ms", Some(5)),
            ("4294967297", Some(1)),
            ("", None),
            ("ms", None),
            ("-", None),
        ] {
            assert_eq!(c_int(value), read, "{value:?}");
        }
    }

    #[test]
    fn booleans_are_read_as_librdkafka_reads_them() {
        for (value, read) in [
            ("true", Some(true)),
            ("T", Some(true)),
            ("1", Some(true)),
            ("False", Some(false)),
            ("f", Some(false)),
            ("0", Some(false)),
            (" true", None),
            ("yes", None),
        ] {
            assert_eq!(c_bool(value), read, "{value:?}");
        }
    }
}
