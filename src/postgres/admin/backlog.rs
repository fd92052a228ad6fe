//! The backlog for status: rows waiting and the oldest one's age, measured with short
//! statement timeouts, and that age written for people.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use super::{Plan, quote_literal};
use crate::postgres::{PgError, db, quote};

/// Rows counted at most for `status.backlogRows`: a backlog this large is reported as
/// this number (the count stays cheap however large the table grows).
pub const BACKLOG_COUNT_LIMIT: i64 = 100_000;

/// How long one status query (backlog, age) may run before it is abandoned.
const STATUS_QUERY_TIMEOUT: &str = "2s";

/// Rows waiting (capped at [`BACKLOG_COUNT_LIMIT`]) and the oldest one's age in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backlog {
    /// Rows waiting to be published (at most the limit).
    pub rows: i64,
    /// Age of the oldest, when the table has the created-at column and rows wait.
    pub oldest_age_seconds: Option<f64>,
}

/// The filter of the rows still to publish: every row in the table, except those with
/// the published-at column set where the table has it (polling marks rows; rows it
/// marked before a switch to log tailing are published too).
pub(super) fn unpublished_filter(plan: &Plan, has_marker: bool) -> String {
    if has_marker || plan.published_at.is_some() {
        format!("WHERE {} IS NULL", quote(&plan.marker))
    } else {
        String::new()
    }
}

/// Whether the outbox table has the created-at and the published-at column.
pub(super) async fn optional_columns(
    client: &Client,
    plan: &Plan,
) -> Result<(bool, bool, bool), PgError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
                WHERE table_schema = $1 AND table_name = $2 AND column_name = $3), \
             EXISTS (SELECT 1 FROM information_schema.columns \
                WHERE table_schema = $1 AND table_name = $2 AND column_name = $4), \
             EXISTS (SELECT 1 FROM information_schema.columns \
                WHERE table_schema = $1 AND table_name = $2 AND column_name = $5 \
                  AND data_type IN ('bigint', 'integer', 'smallint'))",
            &[
                &plan.schema,
                &plan.table,
                &plan.created_at,
                &plan.marker,
                &plan.id,
            ],
        )
        .await
        .map_err(db("looking up the created-at, published-at and id columns"))?;
    Ok((row.get(0), row.get(1), row.get(2)))
}

/// The backlog SQL for a plan: `None` when the table does not show it (log tailing
/// that keeps rows: every row stays in the table, published or not).
pub fn backlog_sql(
    plan: &Plan,
    has_created_at: bool,
    has_marker: bool,
    integer_id: bool,
) -> Option<(String, Option<String>)> {
    if plan
        .log_tailing
        .as_ref()
        .is_some_and(|lt| !lt.delete_after_publish)
    {
        return None;
    }
    let filter = unpublished_filter(plan, has_marker);
    let table = plan.qualified();
    let count = format!(
        "SELECT count(*) FROM (SELECT 1 FROM {table} {filter} LIMIT {BACKLOG_COUNT_LIMIT}) b"
    );
    // Oldest by id where the id is an integer: it grows with insertion, and the
    // primary key finds it without reading every waiting row. A uuid or text id says
    // nothing of age: the oldest created-at it is.
    let oldest = if integer_id {
        quote(&plan.id)
    } else {
        quote(&plan.created_at)
    };
    let age = has_created_at.then(|| {
        format!(
            "SELECT extract(epoch FROM now() - {})::float8 FROM {table} {filter} ORDER BY {oldest} LIMIT 1",
            quote(&plan.created_at),
        )
    });
    Some((count, age))
}

/// Measures the backlog with short statement timeouts; `None` when the mode does not
/// show one in the table.
pub async fn backlog(client: &Client, plan: &Plan) -> Result<Option<Backlog>, PgError> {
    let (has_created_at, has_marker, integer_id) = optional_columns(client, plan).await?;
    let Some((count_sql, age_sql)) = backlog_sql(plan, has_created_at, has_marker, integer_id)
    else {
        return Ok(None);
    };
    with_status_timeout(client, async {
        let rows: i64 = client
            .query_one(&count_sql, &[])
            .await
            .map_err(db("counting the backlog"))?
            .get(0);
        let oldest_age_seconds = match (&age_sql, rows) {
            (Some(sql), n) if n > 0 => client
                .query_opt(sql, &[])
                .await
                .map_err(db("measuring the oldest unpublished row"))?
                .and_then(|r| r.get::<_, Option<f64>>(0))
                .map(|a| a.max(0.0)),
            _ => None,
        };
        Ok(Some(Backlog {
            rows,
            oldest_age_seconds,
        }))
    })
    .await
}

/// Runs `queries` with [`STATUS_QUERY_TIMEOUT`] as the session's statement timeout,
/// reset afterwards whatever they returned.
async fn with_status_timeout<T>(
    client: &Client,
    queries: impl std::future::Future<Output = Result<T, PgError>>,
) -> Result<T, PgError> {
    client
        .batch_execute(&format!(
            "SET statement_timeout = {}",
            quote_literal(STATUS_QUERY_TIMEOUT)
        ))
        .await
        .map_err(db("limiting the status queries"))?;
    let result = queries.await;
    let _ = client.batch_execute("RESET statement_timeout").await;
    result
}

/// Rows in the dead-letter table (capped at [`BACKLOG_COUNT_LIMIT`]), with a short
/// statement timeout; `None` while the table does not exist (the relay makes it when a
/// row is first dead-lettered).
pub async fn dead_letter_rows(client: &Client, plan: &Plan) -> Result<Option<i64>, PgError> {
    let table = format!("{}.{}", quote(&plan.schema), quote(&plan.dead_letter));
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .map_err(db("looking up the dead-letter table"))?
        .get(0);
    if !exists {
        return Ok(None);
    }
    let sql = format!("SELECT count(*) FROM (SELECT 1 FROM {table} LIMIT {BACKLOG_COUNT_LIMIT}) d");
    with_status_timeout(client, async {
        let row = client
            .query_one(&sql, &[])
            .await
            .map_err(db("counting the dead letters"))?;
        Ok(Some(row.get(0)))
    })
    .await
}

/// A backlog measurement may take at most this share of the time between two of them.
///
/// The count reads the table's rows, dead ones included, up to
/// [`BACKLOG_COUNT_LIMIT`] live ones: cheap while the relay keeps up, but while it
/// works through a large backlog that was just the moment a count cost most. Measured
/// every 3 s during a drain of 400,000 rows, it kept the counting backend at 27% of a
/// core, beside a relay competing for the same two cores.
const BACKLOG_DUTY: u32 = 20;

/// When the next backlog measurement is due: every `every`, but never sooner after the
/// last one than [`BACKLOG_DUTY`] times what it took. So measuring costs a database
/// backend at most 1/20 of its time, however large the table, and a table that is
/// cheap to count is measured as often as before.
#[derive(Debug, Clone, Copy)]
pub struct Pacing {
    every: Duration,
    next: Option<Instant>,
}

impl Pacing {
    /// Due at once, then every `every` (or later, after slow measurements).
    pub fn new(every: Duration) -> Self {
        Self { every, next: None }
    }

    /// Whether a measurement is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.next.is_none_or(|next| now >= next)
    }

    /// A measurement (successful or not) started at `started` and took `took`.
    pub fn measured(&mut self, started: Instant, took: Duration) {
        self.next = Some(started + self.every.max(took.saturating_mul(BACKLOG_DUTY)));
    }

    /// Measures with `measure` when due, records what it took, and returns its result
    /// (`None` when not due).
    pub async fn run<F, T>(&mut self, measure: F) -> Option<T>
    where
        F: std::future::Future<Output = T>,
    {
        let started = Instant::now();
        if !self.due(started) {
            return None;
        }
        let result = measure.await;
        self.measured(started, started.elapsed());
        Some(result)
    }
}

/// An age for people: `0s`, `42s`, `4m12s`, `3h5m`, `2d4h`.
pub fn human_age(seconds: f64) -> String {
    // Whole seconds are enough for people; negative clock skew reads as 0s.
    let total = if seconds.is_finite() && seconds > 0.0 {
        seconds as u64
    } else {
        0
    };
    let (d, h, m, s) = (
        total / 86_400,
        total % 86_400 / 3600,
        total % 3600 / 60,
        total % 60,
    );
    if d > 0 {
        format!("{d}d{h}h")
    } else if h > 0 {
        format!("{h}h{m}m")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{TAILING, relay};
    use super::*;

    #[test]
    fn a_slow_backlog_measurement_spaces_the_next_ones() {
        let every = Duration::from_secs(3);
        let mut pacing = Pacing::new(every);
        let t0 = Instant::now();
        assert!(pacing.due(t0), "the first measurement is due at once");
        // Cheap: the period holds.
        pacing.measured(t0, Duration::from_millis(40));
        assert!(!pacing.due(t0 + Duration::from_millis(2999)));
        assert!(pacing.due(t0 + every));
        // 1 s: the next waits 20 s, so counting takes at most a twentieth of the time.
        let t1 = t0 + every;
        pacing.measured(t1, Duration::from_secs(1));
        assert!(!pacing.due(t1 + Duration::from_secs(19)));
        assert!(pacing.due(t1 + Duration::from_secs(20)));
        // Cheap again: back to the period.
        let t2 = t1 + Duration::from_secs(20);
        pacing.measured(t2, Duration::from_millis(5));
        assert!(pacing.due(t2 + every));
    }

    #[tokio::test]
    async fn pacing_runs_a_measurement_only_when_due() {
        let mut pacing = Pacing::new(Duration::from_secs(3600));
        assert_eq!(pacing.run(async { 7 }).await, Some(7));
        assert_eq!(pacing.run(async { 8 }).await, None);
    }

    #[test]
    fn backlog_queries_follow_the_mode() {
        let mark = relay(&TAILING.replace("{logTailing: {}}", "{polling: {}}"));
        let (count, age) = backlog_sql(&Plan::for_relay(&mark), true, true, true).unwrap();
        assert!(
            count.contains("WHERE \"published_at\" IS NULL LIMIT 100000"),
            "{count}"
        );
        assert!(age.unwrap().contains("ORDER BY \"id\" LIMIT 1"));
        // A uuid or text id: the oldest is the oldest created-at.
        let (_, age) = backlog_sql(&Plan::for_relay(&mark), true, true, false).unwrap();
        assert!(age.unwrap().contains("ORDER BY \"created_at\" LIMIT 1"));
        let (_, age) = backlog_sql(&Plan::for_relay(&mark), false, true, true).unwrap();
        assert!(age.is_none());
        let delete =
            relay(&TAILING.replace("{logTailing: {}}", "{polling: {afterPublish: delete}}"));
        let (count, _) = backlog_sql(&Plan::for_relay(&delete), true, false, true).unwrap();
        assert!(!count.contains("WHERE"), "{count}");
        // Log tailing that deletes rows: the table is the backlog, except rows polling
        // marked published before a switch.
        let (count, _) = backlog_sql(&Plan::for_relay(&relay(TAILING)), true, false, true).unwrap();
        assert!(!count.contains("WHERE"), "{count}");
        let (count, _) = backlog_sql(&Plan::for_relay(&relay(TAILING)), true, true, true).unwrap();
        assert!(count.contains("WHERE \"published_at\" IS NULL"), "{count}");
        let keep = relay(&TAILING.replace(
            "{logTailing: {}}",
            "{logTailing: {deleteAfterPublish: false}}",
        ));
        assert!(backlog_sql(&Plan::for_relay(&keep), true, true, true).is_none());
    }

    #[test]
    fn ages_read_like_people_write_them() {
        assert_eq!(human_age(0.4), "0s");
        assert_eq!(human_age(-3.0), "0s");
        assert_eq!(human_age(42.0), "42s");
        assert_eq!(human_age(252.0), "4m12s");
        assert_eq!(human_age(3.0 * 3600.0 + 300.0), "3h5m");
        assert_eq!(human_age(2.0 * 86_400.0 + 4.0 * 3600.0), "2d4h");
    }
}
