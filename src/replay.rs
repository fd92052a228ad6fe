//! `outbox-operator replay -f relay.yaml`: publishes a window of already published
//! events again, for a consumer that lost them. The window — a time range, ids,
//! aggregate ids, event types — is read from where the relay leaves its published rows
//! (marked rows, rows log tailing keeps, the archive table), and each event goes out
//! as the relay built it (destination, key, headers, payload, CloudEvents) with its
//! original id, plus the header `outbox-replay: <name>` so consumers can tell a replay
//! from a first delivery; consumers that deduplicate by id stay correct. Events go out
//! one at a time in the relay's order, so each aggregate's replayed events keep their
//! order, at most `--rate` per second. A NATS replay has its own `Nats-Msg-Id` scope
//! per replay name: JetStream does not drop it as a duplicate of the first delivery,
//! and running the same replay again within the stream's duplicate window lands
//! nothing twice. The database is only read.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use crate::Error;
use crate::broker::{BrokerSettings, OutboxRow, PublishError};
use crate::postgres::audit::Evidence;
use crate::postgres::table::{OutboxTable, ReplayWindow};
use crate::spec::ValidRelay;

/// The header every replayed message carries; its value is the replay's name.
pub const REPLAY_HEADER: &str = "outbox-replay";

/// `outbox-operator replay`'s arguments.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// OutboxRelay manifest whose events to publish again.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: PathBuf,
    /// Environment variable holding the database URL (broker credentials come from the
    /// variables `check` reads).
    #[arg(long, value_name = "VAR", default_value = crate::secrets::ENV_DATABASE_URL)]
    pub database_url_env: String,
    /// Events created at most this long ago (by the created-at column).
    #[arg(long, value_name = "DURATION", value_parser = crate::api::duration_arg)]
    pub since: Option<Duration>,
    /// Events created at least this long ago.
    #[arg(long, value_name = "DURATION", value_parser = crate::api::duration_arg)]
    pub until: Option<Duration>,
    /// Events created at or after this time (RFC 3339), instead of --since.
    #[arg(long, value_name = "TIME", value_parser = crate::api::time_arg, conflicts_with = "since")]
    pub from: Option<SystemTime>,
    /// Events created at or before this time (RFC 3339), instead of --until.
    #[arg(long, value_name = "TIME", value_parser = crate::api::time_arg, conflicts_with = "until")]
    pub to: Option<SystemTime>,
    /// These ids only, separated by commas.
    #[arg(long, value_name = "ID,...", value_delimiter = ',')]
    pub ids: Vec<String>,
    /// Events of these aggregate ids only, separated by commas.
    #[arg(long = "aggregate-id", value_name = "ID,...", value_delimiter = ',')]
    pub aggregate_ids: Vec<String>,
    /// Events of these types only, separated by commas.
    #[arg(long = "type", value_name = "TYPE,...", value_delimiter = ',')]
    pub event_types: Vec<String>,
    /// Events published per second at most.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub rate: u32,
    /// The replay's name, sent as the `outbox-replay` header (default: the time it
    /// started, UTC).
    #[arg(long)]
    pub name: Option<String>,
    /// Events replayed at most; a larger window is refused (narrow it, or raise this).
    #[arg(long, default_value_t = 100_000)]
    pub limit: i64,
    /// List what would be replayed; publish nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// How long a broker outage may last before the replay stops (the events not sent
    /// are listed).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = crate::api::duration_arg)]
    pub outage_timeout: Duration,
}

impl ReplayArgs {
    /// The window as the table reads it, relative to `now`; an error when it names
    /// nothing (a replay of everything is never what a flag left out meant).
    pub fn window(&self, now: SystemTime) -> Result<ReplayWindow, String> {
        let trim = |list: &[String]| -> Vec<String> {
            list.iter()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect()
        };
        let unix = |ago: Duration| {
            (now - ago)
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        };
        let at = |time: SystemTime| {
            time.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        };
        let window = ReplayWindow {
            since: self.from.map(at).or(self.since.map(unix)),
            until: self.to.map(at).or(self.until.map(unix)),
            ids: trim(&self.ids),
            aggregate_ids: trim(&self.aggregate_ids),
            event_types: trim(&self.event_types),
        };
        if window == ReplayWindow::default() {
            return Err(
                "name the events to replay: --since or --from (and --until or --to), --ids, --aggregate-id or --type"
                    .to_owned(),
            );
        }
        Ok(window)
    }
}

/// Replays the window for every OutboxRelay in the manifest; writes the report to
/// `out` and returns whether every event of every window was published again.
pub async fn replay_file(args: &ReplayArgs, out: &mut impl Write) -> Result<bool, Error> {
    let now = SystemTime::now();
    let window = args.window(now).map_err(Error::Replay)?;
    let name = args.name.clone().unwrap_or_else(|| {
        k8s_openapi::jiff::Timestamp::now()
            .strftime("%Y%m%dT%H%M%SZ")
            .to_string()
    });
    let url = crate::secrets::database_url_from(&args.database_url_env).map_err(Error::Replay)?;
    let mut complete = true;
    for valid in crate::render::parsed_relays(&args.file)? {
        complete &= replay_relay(&valid, &url, args, &window, &name, out).await?;
    }
    Ok(complete)
}

async fn replay_relay(
    valid: &ValidRelay,
    url: &str,
    args: &ReplayArgs,
    window: &ReplayWindow,
    name: &str,
    out: &mut impl Write,
) -> Result<bool, Error> {
    let who = format!("OutboxRelay {}/{}", valid.namespace, valid.name);
    let fail = |what: String| Error::Replay(format!("{who}: {what}"));
    let evidence = Evidence::of(valid).map_err(&fail)?;
    let client = crate::postgres::connect_for(valid, url, &args.database_url_env)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let table = OutboxTable::of_relay(&client, valid)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let rows = table
        .replay_rows(&client, &evidence, window, args.limit)
        .await
        .map_err(|e| fail(e.to_string()))?;
    if rows.len() > usize::try_from(args.limit).unwrap_or(usize::MAX) {
        return Err(fail(format!(
            "the window holds more than {} events: narrow it, or raise --limit",
            args.limit
        )));
    }
    let from = evidence.describe();
    let _ = writeln!(
        out,
        "{who}: {} {from} in the window{}",
        rows.len(),
        if args.dry_run {
            ": dry run, nothing published".to_owned()
        } else {
            format!(
                "; replaying them as {REPLAY_HEADER}: {name}, at most {}/s",
                args.rate
            )
        }
    );
    if args.dry_run {
        for row in &rows {
            let _ = writeln!(
                out,
                "  {}  aggregate {}  type {}",
                row.id,
                row.aggregate_id.as_deref().unwrap_or(""),
                row.event_type.as_deref().unwrap_or("")
            );
        }
        return Ok(true);
    }
    let env = crate::secrets::env_value;
    let mut broker = crate::spec::config::read_broker(valid, &env).map_err(|e| {
        fail(format!(
            "{e} (outside a pod, set these variables to the values the relay gets)"
        ))
    })?;
    if let BrokerSettings::Nats(n) = &mut broker {
        n.msg_id_scope = format!("{}/replay/{name}", n.msg_id_scope);
    }
    let publisher = broker.connect().await.map_err(|e| fail(e.to_string()))?;
    let shape = valid.shape();
    let started = tokio::time::Instant::now();
    let spacing = Duration::from_secs(1) / args.rate;
    let mut sent = 0usize;
    let mut refused = Vec::new();
    let mut stopped = None;
    for (i, row) in rows.iter().enumerate() {
        tokio::time::sleep_until(started + spacing * u32::try_from(i).unwrap_or(u32::MAX)).await;
        match publish_one(&*publisher, &shape, row, name, args.outage_timeout).await {
            Ok(()) => sent += 1,
            Err(PublishError::Outage(why)) => {
                stopped = Some((i, why));
                break;
            }
            Err(err) => refused.push(format!("{}: {err}", row.id)),
        }
    }
    let _ = writeln!(
        out,
        "{}  {} in {:.1}s",
        if sent == rows.len() { "ok  " } else { "FAIL" },
        crate::report::replayed(sent, rows.len()),
        started.elapsed().as_secs_f64()
    );
    for line in &refused {
        let _ = writeln!(out, "      refused {line}");
    }
    if let Some((at, why)) = &stopped {
        let rest: Vec<String> = rows[*at..].iter().map(|r| r.id.to_string()).collect();
        let _ = writeln!(
            out,
            "      stopped: the broker stayed unavailable ({why}); not sent: {}",
            rest.join(",")
        );
    }
    Ok(sent == rows.len())
}

/// Publishes one event as the relay built it, with the replay header; a broker outage
/// is retried until `outage_timeout` passes.
async fn publish_one(
    publisher: &dyn crate::broker::Broker,
    shape: &crate::broker::Shape,
    row: &OutboxRow,
    name: &str,
    outage_timeout: Duration,
) -> Result<(), PublishError> {
    let mut message = shape.build(row)?;
    message
        .headers
        .push((REPLAY_HEADER.to_owned(), name.to_owned()));
    let deadline = tokio::time::Instant::now() + outage_timeout;
    let mut pause = Duration::from_millis(200);
    loop {
        match publisher.publish(&message).await {
            Ok(_) => return Ok(()),
            Err(PublishError::Outage(why)) if tokio::time::Instant::now() + pause < deadline => {
                tracing::warn!(id = %row.id, %why, "broker unavailable; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(err) => return Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ReplayArgs,
    }

    fn args(list: &[&str]) -> ReplayArgs {
        Cli::parse_from(std::iter::once("replay").chain(list.iter().copied())).args
    }

    #[test]
    fn a_window_must_name_something_and_reads_relative_to_now() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let none = args(&["-f", "r.yaml"]);
        assert!(none.window(now).is_err());
        let w = args(&["-f", "r.yaml", "--since", "1h", "--until", "10m"])
            .window(now)
            .unwrap();
        assert_eq!((w.since, w.until), (Some(6_400.0), Some(9_400.0)));
        let w = args(&["-f", "r.yaml", "--aggregate-id", "a, b,", "--type", "Paid"])
            .window(now)
            .unwrap();
        assert_eq!(w.aggregate_ids, ["a", "b"]);
        assert_eq!(w.event_types, ["Paid"]);
        assert_eq!(w.since, None);
    }

    #[test]
    fn a_window_can_be_given_as_times() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let w = args(&[
            "-f",
            "r.yaml",
            "--from",
            "1970-01-01T01:00:00Z",
            "--to",
            "1970-01-01T02:00:00Z",
        ])
        .window(now)
        .unwrap();
        assert_eq!((w.since, w.until), (Some(3_600.0), Some(7_200.0)));
        assert!(Cli::try_parse_from(["replay", "-f", "r", "--from", "yesterday"]).is_err());
        assert!(
            Cli::try_parse_from([
                "replay",
                "-f",
                "r",
                "--since",
                "1h",
                "--from",
                "1970-01-01T01:00:00Z"
            ])
            .is_err()
        );
    }

    #[test]
    fn the_rate_is_at_least_one_per_second() {
        assert!(
            Cli::try_parse_from(["replay", "-f", "r.yaml", "--ids", "1", "--rate", "0"]).is_err()
        );
        assert_eq!(args(&["-f", "r.yaml", "--ids", "1"]).rate, 100);
    }
}
