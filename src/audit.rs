//! `outbox-operator audit -f relay.yaml`: proves a window of events reached the broker
//! completely and in order. It reads the rows the relay published in the window from
//! the evidence the table keeps (marked rows, rows log tailing keeps, the archive
//! table), reads what each destination received from the window's start (Kafka topic
//! partitions, JetStream streams) with the relay's own settings, and reports per
//! aggregate the rows never delivered, the rows first delivered after a later row of
//! their aggregate, and the redeliveries. Exit status 1 when a row is missing or out of
//! order (redeliveries are at-least-once, reported but allowed). Read-only on both.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use crate::Error;
use crate::postgres::audit::{AuditRow, Evidence, published_rows};
use crate::spec::ValidRelay;

/// `outbox-operator audit`'s arguments.
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    /// OutboxRelay manifest whose deliveries to audit.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: PathBuf,
    /// Environment variable holding the database URL (broker credentials come from the
    /// variables `check` reads).
    #[arg(long, value_name = "VAR", default_value = crate::secrets::ENV_DATABASE_URL)]
    pub database_url_env: String,
    /// The window starts this long ago (rows by their created-at column).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = crate::api::duration_arg)]
    pub since: Duration,
    /// The window ends this long ago: rows newer may not be published yet.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = crate::api::duration_arg)]
    pub until: Duration,
    /// RabbitMQ: the stream queue (`x-queue-type: stream`) bound to the relay's
    /// exchange for every routing key it uses, read as what RabbitMQ received (a queue
    /// cannot be read beside its consumers).
    #[arg(long, value_name = "QUEUE")]
    pub rabbitmq_stream: Option<String>,
}

/// What the broker showed for one window: per aggregate, in the table's order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// Rows published in the window.
    pub rows: usize,
    /// Deliveries of those rows read from the broker (redeliveries included).
    pub deliveries: usize,
    /// Aggregate → ids never delivered.
    pub missing: BTreeMap<String, Vec<String>>,
    /// Aggregate → (id, the later id of its aggregate first delivered before it).
    pub out_of_order: BTreeMap<String, Vec<(String, String)>>,
    /// Deliveries after a row's first.
    pub redeliveries: usize,
}

impl Findings {
    /// Every row delivered, each aggregate's first deliveries in order.
    pub fn passed(&self) -> bool {
        self.missing.is_empty() && self.out_of_order.is_empty()
    }
}

/// Compares the rows of a window (in the relay's order) with what each destination
/// delivered (each list in the order a consumer reads it). Ids not among the rows
/// (outside the window, or not the relay's) are not counted.
pub fn compare(rows: &[AuditRow], delivered: &[Vec<String>]) -> Findings {
    // id → (aggregate, its place in the table's order)
    let place: HashMap<&str, (&str, usize)> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.as_str(), (r.aggregate_id.as_str(), i)))
        .collect();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    // aggregate → the latest place first delivered so far, with its id
    let mut latest: HashMap<&str, (usize, &str)> = HashMap::new();
    let mut findings = Findings {
        rows: rows.len(),
        ..Findings::default()
    };
    for id in delivered.iter().flatten() {
        let Some(&(aggregate, at)) = place.get(id.as_str()) else {
            continue;
        };
        findings.deliveries += 1;
        let times = seen.entry(id.as_str()).or_insert(0);
        *times += 1;
        if *times > 1 {
            findings.redeliveries += 1;
            continue;
        }
        match latest.get(aggregate) {
            Some(&(before, later)) if before > at => {
                findings
                    .out_of_order
                    .entry(aggregate.to_owned())
                    .or_default()
                    .push((id.clone(), later.to_owned()));
            }
            _ => {
                latest.insert(aggregate, (at, id.as_str()));
            }
        }
    }
    for row in rows {
        if !seen.contains_key(row.id.as_str()) {
            findings
                .missing
                .entry(row.aggregate_id.clone())
                .or_default()
                .push(row.id.clone());
        }
    }
    findings
}

/// Audits every OutboxRelay in the manifest; writes the report to `out` and returns
/// whether every window passed.
pub async fn audit_file(args: &AuditArgs, out: &mut impl Write) -> Result<bool, Error> {
    let url = crate::secrets::database_url_from(&args.database_url_env).map_err(Error::Audit)?;
    let now = SystemTime::now();
    let (since, until) = (now - args.since, now - args.until);
    let mut passed = true;
    for valid in crate::render::parsed_relays(&args.file)? {
        passed &= audit_relay(&valid, &url, args, (since, until), out).await?;
    }
    Ok(passed)
}

async fn audit_relay(
    valid: &ValidRelay,
    url: &str,
    args: &AuditArgs,
    (since, until): (SystemTime, SystemTime),
    out: &mut impl Write,
) -> Result<bool, Error> {
    let who = format!("OutboxRelay {}/{}", valid.namespace, valid.name);
    let fail = |what: String| Error::Audit(format!("{who}: {what}"));
    let evidence = Evidence::of(valid).map_err(&fail)?;
    let client = crate::postgres::connect_for(valid, url, &args.database_url_env)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let unix = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let order_by = valid.table.columns.order.as_deref();
    let rows = published_rows(
        &client,
        &valid.table,
        &evidence,
        order_by,
        unix(since),
        unix(until),
    )
    .await
    .map_err(|e| fail(e.to_string()))?;
    let env = crate::secrets::env_value;
    let broker = crate::spec::config::read_broker(valid, &env).map_err(|e| {
        fail(format!(
            "{e} (outside a pod, set these variables to the values the relay gets)"
        ))
    })?;
    // Each destination the window's rows went to, read from the window's start (a
    // minute earlier: clocks of the database and the broker differ). RabbitMQ's is the
    // stream bound as a tap: every routing key's messages, in the order they came.
    let mut destinations: Vec<String> = match (&broker, &args.rabbitmq_stream) {
        (crate::broker::BrokerSettings::RabbitMq(r), None) => {
            return Err(fail(
                crate::broker::ReadError::NotReadable {
                    exchange: r.exchange.clone(),
                }
                .to_string(),
            ));
        }
        (crate::broker::BrokerSettings::RabbitMq(_), Some(stream)) => vec![stream.clone()],
        _ => rows
            .iter()
            .map(|r| {
                broker
                    .template()
                    .replace(crate::broker::AGGREGATE_TYPE_PLACEHOLDER, &r.aggregate_type)
            })
            .collect(),
    };
    destinations.sort();
    destinations.dedup();
    let mut delivered = Vec::with_capacity(destinations.len());
    for destination in &destinations {
        let ids = broker
            .delivered_ids(destination, since - Duration::from_secs(60))
            .await
            .map_err(|e| fail(e.to_string()))?;
        delivered.push(ids);
    }
    let findings = compare(&rows, &delivered);
    report(out, &who, &evidence, &destinations, &findings);
    Ok(findings.passed())
}

fn report(
    out: &mut impl Write,
    who: &str,
    evidence: &Evidence,
    destinations: &[String],
    f: &Findings,
) {
    let from = evidence.describe();
    let mut lines = vec![format!(
        "{who}: {} {from} in the window; {} deliveries of them read from {}",
        f.rows,
        f.deliveries,
        if destinations.is_empty() {
            "no destination".to_owned()
        } else {
            destinations.join(", ")
        }
    )];
    let first = |ids: Vec<String>| {
        let more = ids.len().saturating_sub(10);
        let mut shown: Vec<String> = ids.into_iter().take(10).collect();
        if more > 0 {
            shown.push(format!("and {more} more"));
        }
        shown.join(", ")
    };
    let missing: usize = f.missing.values().map(Vec::len).sum();
    let verdict = |ok: bool| if ok { "ok  " } else { "FAIL" };
    lines.push(format!(
        "{}  missing       {missing} of {} rows never delivered",
        verdict(missing == 0),
        f.rows
    ));
    for (aggregate, ids) in &f.missing {
        lines.push(format!(
            "      aggregate {aggregate}: {}",
            first(ids.clone())
        ));
    }
    let reordered: usize = f.out_of_order.values().map(Vec::len).sum();
    lines.push(format!(
        "{}  order         {reordered} rows first delivered after a later row of their aggregate",
        verdict(reordered == 0)
    ));
    for (aggregate, pairs) in &f.out_of_order {
        let pairs = pairs
            .iter()
            .map(|(id, later)| format!("{id} after {later}"))
            .collect();
        lines.push(format!("      aggregate {aggregate}: {}", first(pairs)));
    }
    lines.push(format!(
        "info  redeliveries  {} (at-least-once: a consumer deduplicates by the message id)",
        f.redeliveries
    ));
    let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    lines.push(
        crate::report::AuditCounts {
            rows: count(f.rows),
            deliveries: count(f.deliveries),
            missing: count(missing),
            out_of_order: count(reordered),
            redeliveries: count(f.redeliveries),
        }
        .line(),
    );
    for line in lines {
        // A closed stdout (`audit | head`) only loses the report, not the exit code.
        let _ = writeln!(out, "{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(list: &[(&str, &str)]) -> Vec<AuditRow> {
        list.iter()
            .map(|(id, aggregate)| AuditRow {
                id: (*id).to_owned(),
                aggregate_id: (*aggregate).to_owned(),
                aggregate_type: "order".to_owned(),
            })
            .collect()
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_complete_ordered_window_passes_with_its_redeliveries_counted() {
        let r = rows(&[("1", "a"), ("2", "b"), ("3", "a"), ("4", "b")]);
        // Two partitions, each in order; a replayed window on the first.
        let f = compare(&r, &[ids(&["1", "3", "1", "3"]), ids(&["2", "9", "4"])]);
        assert!(f.passed(), "{f:?}");
        assert_eq!((f.rows, f.deliveries, f.redeliveries), (4, 6, 2));
    }

    #[test]
    fn a_row_never_delivered_and_one_delivered_late_fail_by_aggregate() {
        let r = rows(&[("1", "a"), ("2", "a"), ("3", "a"), ("4", "b")]);
        let f = compare(&r, &[ids(&["1", "3", "2"])]);
        assert!(!f.passed());
        assert_eq!(f.missing, BTreeMap::from([("b".to_owned(), ids(&["4"]))]));
        assert_eq!(
            f.out_of_order,
            BTreeMap::from([("a".to_owned(), vec![("2".to_owned(), "3".to_owned())])])
        );
    }

    #[test]
    fn a_redelivery_of_an_older_row_is_not_out_of_order() {
        // 1 again after 2: a replay, not a first delivery out of order.
        let r = rows(&[("1", "a"), ("2", "a")]);
        let f = compare(&r, &[ids(&["1", "2", "1", "2"])]);
        assert!(f.passed(), "{f:?}");
        assert_eq!(f.redeliveries, 2);
    }

    #[test]
    fn evidence_follows_what_the_relay_keeps() {
        let parse = |mode: &str, archive: &str| {
            let relay: crate::api::OutboxRelay = serde_yaml::from_str(&format!(
                "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {{name: orders, namespace: shop}}
spec:
  database: {{postgres: {{connectionSecretRef: {{name: db}}}}}}
  table: {{name: outbox{archive}}}
  mode: {mode}
  broker: {{nats: {{url: \"nats://n:4222\"}}}}
"
            ))
            .unwrap();
            crate::spec::parse(&relay).unwrap()
        };
        assert_eq!(
            Evidence::of(&parse("{polling: {}}", "")),
            Ok(Evidence::Marked)
        );
        assert_eq!(
            Evidence::of(&parse("{logTailing: {deleteAfterPublish: false}}", "")),
            Ok(Evidence::Kept)
        );
        assert!(Evidence::of(&parse("{polling: {afterPublish: delete}}", "")).is_err());
        // Log tailing deletes by default.
        assert!(Evidence::of(&parse("{logTailing: {}}", "")).is_err());
        assert_eq!(
            Evidence::of(&parse(
                "{logTailing: {deleteAfterPublish: true}}",
                ", archive: {name: outbox_archive}"
            )),
            Ok(Evidence::Archived("public".into(), "outbox_archive".into()))
        );
    }
}
