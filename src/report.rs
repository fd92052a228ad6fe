//! What a process leaves where the kubelet reads it: the container's termination
//! message (`/dev/termination-log`), which the pod's status carries as
//! `state.terminated.message` after the process ends. The relay leaves why it stopped;
//! the tools (`check`, `audit`, `replay`, `dead-letters`) run in a Job leave their
//! report, so `kubectl outbox` and the operator read it from the API without the
//! pod's log (which needs the kubelet reachable from the API server, and rotates).
//!
//! Outside a pod the file does not exist, and none is made.

use std::io::Write;
use std::path::Path;

/// Where the kubelet reads a container's termination message unless told otherwise.
pub const TERMINATION_MESSAGE_PATH: &str = "/dev/termination-log";

/// The kubelet keeps at most this much of a termination message.
pub const TERMINATION_MESSAGE_MAX: usize = 4096;

/// Leaves `message` (cut to what the kubelet keeps) at `path`, if that file exists.
pub fn leave_at(path: &Path, message: &str) {
    let message = &message[..message.floor_char_boundary(TERMINATION_MESSAGE_MAX)];
    // No `create`: the kubelet provides the file.
    let written = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .and_then(|mut file| file.write_all(message.as_bytes()));
    if let Err(e) = written
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(error = %e, path = %path.display(), "cannot leave the termination message");
    }
}

/// A report folded to at most `limit` bytes: whole when it fits; else its first lines
/// and its last ones (a report's verdict is at its end), with a line saying how many
/// were left out and where the whole report is.
pub fn fold(report: &str, limit: usize) -> String {
    if report.len() <= limit {
        return report.to_owned();
    }
    let lines: Vec<&str> = report.lines().collect();
    let marker = |left_out: usize| {
        format!("… {left_out} lines left out: the pod's log has the whole report\n")
    };
    // Room for the marker with the largest count it can show.
    let budget = limit.saturating_sub(marker(lines.len()).len());
    let head_budget = budget / 3;
    let mut head = 0;
    let mut used = 0;
    while head < lines.len() && used + lines[head].len() < head_budget {
        used += lines[head].len() + 1;
        head += 1;
    }
    let mut tail = 0;
    while tail < lines.len() - head && used + lines[lines.len() - 1 - tail].len() < budget {
        used += lines[lines.len() - 1 - tail].len() + 1;
        tail += 1;
    }
    let mut text = String::with_capacity(limit);
    for line in &lines[..head] {
        text.push_str(line);
        text.push('\n');
    }
    text.push_str(&marker(lines.len() - head - tail));
    for line in &lines[lines.len() - tail..] {
        text.push_str(line);
        text.push('\n');
    }
    // A single line longer than the limit: cut it on a character.
    text.truncate(text.floor_char_boundary(limit));
    text
}

/// The line of a replay's report that says how far it got; [`events_in`] reads it back.
pub fn replayed(done: usize, selected: usize) -> String {
    format!("replayed {done} of {selected} events")
}

/// The line of a redrive's report that says how many rows went back to the relay;
/// [`events_in`] reads it back.
pub fn moved_back(rows: u64) -> String {
    format!("{rows} rows moved back")
}

/// (selected, done) as a replay's or a redrive's report says them ([`replayed`],
/// [`moved_back`]); `None` when it says neither (it stopped before).
pub fn events_in(report: &str) -> Option<(i64, i64)> {
    let number = |text: &str| text.trim().parse::<i64>().ok();
    report.lines().find_map(|line| {
        if let Some((_, rest)) = line.split_once("replayed ")
            && let Some((done, rest)) = rest.split_once(" of ")
            && let Some((selected, _)) = rest.split_once(" events")
        {
            return Some((number(selected)?, number(done)?));
        }
        let (before, _) = line.split_once(" rows moved back")?;
        let moved = number(before.rsplit(' ').next()?)?;
        Some((moved, moved))
    })
}

/// The counts an audit found for one relay's window, as the last line of its report
/// says them ([`AuditCounts::line`]; [`AuditCounts::read`] reads them back).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditCounts {
    /// Rows published in the window.
    pub rows: i64,
    /// Deliveries of them read from the broker.
    pub deliveries: i64,
    /// Rows never delivered.
    pub missing: i64,
    /// Rows first delivered after a later row of their aggregate.
    pub out_of_order: i64,
    /// Deliveries after a row's first.
    pub redeliveries: i64,
}

impl AuditCounts {
    /// Every row delivered, each aggregate in order.
    pub fn passed(&self) -> bool {
        self.missing == 0 && self.out_of_order == 0
    }

    /// The report's last line.
    pub fn line(&self) -> String {
        format!(
            "audit {}: {} rows, {} deliveries, {} missing, {} out of order, {} redeliveries",
            if self.passed() { "passed" } else { "FAILED" },
            self.rows,
            self.deliveries,
            self.missing,
            self.out_of_order,
            self.redeliveries
        )
    }

    /// The counts of the last such line of `report`.
    pub fn read(report: &str) -> Option<Self> {
        report.lines().rev().find_map(|line| {
            let (_, counts) = line.trim().split_once("audit ")?.1.split_once(": ")?;
            let mut numbers = counts
                .split(", ")
                .map(|part| part.split(' ').next().and_then(|n| n.parse::<i64>().ok()));
            let mut next = || numbers.next().flatten();
            Some(Self {
                rows: next()?,
                deliveries: next()?,
                missing: next()?,
                out_of_order: next()?,
                redeliveries: next()?,
            })
        })
    }
}

/// A writer that passes everything on to `inner` and keeps a copy, so the report a
/// tool printed can also be left as its termination message ([`Tee::leave`]).
pub struct Tee<W> {
    inner: W,
    kept: Vec<u8>,
}

impl<W: Write> Tee<W> {
    /// Writes to `inner`, keeping a copy.
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            kept: Vec::new(),
        }
    }

    /// What was written, with `last` (an error, say) after it, folded to what the
    /// kubelet keeps, left at `path` when that file exists.
    pub fn leave_at(&self, path: &Path, last: Option<&str>) {
        let mut report = String::from_utf8_lossy(&self.kept).into_owned();
        if let Some(last) = last {
            if !report.is_empty() && !report.ends_with('\n') {
                report.push('\n');
            }
            report.push_str(last);
            report.push('\n');
        }
        leave_at(path, &fold(&report, TERMINATION_MESSAGE_MAX));
    }

    /// [`Tee::leave_at`] the kubelet's path.
    pub fn leave(&self, last: Option<&str>) {
        self.leave_at(Path::new(TERMINATION_MESSAGE_PATH), last);
    }
}

impl<W: Write> Write for Tee<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Kept whatever becomes of stdout (a closed pipe must not lose the report).
        self.kept.extend_from_slice(buf);
        match self.inner.write_all(buf) {
            Ok(()) => Ok(buf.len()),
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(buf.len()),
            Err(e) => Err(e),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_that_fits_is_left_whole() {
        assert_eq!(fold("ok  table\nok  slot\n", 100), "ok  table\nok  slot\n");
    }

    #[test]
    fn a_long_report_keeps_its_head_and_its_verdict() {
        let mut report = String::from("OutboxRelay shop/orders\n");
        for i in 0..500 {
            report.push_str(&format!("missing  aggregate-{i}  id-{i}\n"));
        }
        report.push_str("FAILED: 500 missing, 0 out of order\n");
        let folded = fold(&report, TERMINATION_MESSAGE_MAX);
        assert!(folded.len() <= TERMINATION_MESSAGE_MAX, "{}", folded.len());
        assert!(
            folded.len() > TERMINATION_MESSAGE_MAX - 200,
            "{}",
            folded.len()
        );
        assert!(folded.starts_with("OutboxRelay shop/orders\nmissing  aggregate-0  id-0\n"));
        assert!(folded.ends_with("FAILED: 500 missing, 0 out of order\n"));
        let left_out: usize = folded
            .lines()
            .find_map(|l| l.strip_prefix("… "))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse().ok())
            .expect("the marker");
        assert_eq!(
            folded.lines().count() - 1 + left_out,
            report.lines().count()
        );
    }

    #[test]
    fn a_reports_counts_read_back_as_written() {
        let replay = format!(
            "OutboxRelay shop/orders: 12 rows in the window\nok    {} in 0.1s\n",
            replayed(12, 12)
        );
        assert_eq!(events_in(&replay), Some((12, 12)));
        let stopped = format!(
            "FAIL  {} in 3.0s\n      stopped: the broker stayed unavailable",
            replayed(4, 12)
        );
        assert_eq!(events_in(&stopped), Some((12, 4)));
        let redrive = format!(
            "OutboxRelay shop/orders: {} from outbox_dead_letter into the outbox table\n",
            moved_back(2)
        );
        assert_eq!(events_in(&redrive), Some((2, 2)));
        assert_eq!(events_in("error: cannot connect"), None);
    }

    #[test]
    fn an_audits_counts_read_back_as_written() {
        let counts = AuditCounts {
            rows: 33,
            deliveries: 42,
            missing: 1,
            out_of_order: 0,
            redeliveries: 10,
        };
        let report = format!(
            "OutboxRelay shop/orders: 33 rows\nFAIL  missing  1 of 33\n{}\n",
            counts.line()
        );
        assert!(
            counts
                .line()
                .starts_with("audit FAILED: 33 rows, 42 deliveries, 1 missing")
        );
        assert_eq!(AuditCounts::read(&report), Some(counts));
        assert!(!counts.passed());
        assert_eq!(AuditCounts::read("error: cannot connect"), None);
    }

    #[test]
    fn one_line_longer_than_the_limit_is_cut_on_a_character() {
        let folded = fold(&"€".repeat(3000), TERMINATION_MESSAGE_MAX);
        assert!(folded.len() <= TERMINATION_MESSAGE_MAX);
        assert!(folded.is_char_boundary(folded.len()));
    }

    #[test]
    fn the_report_goes_only_to_a_file_the_kubelet_provides() {
        let dir = tempfile::tempdir().expect("tempdir");
        let provided = dir.path().join("termination-log");
        std::fs::write(&provided, "an older message, longer than the new one").expect("write");
        let mut tee = Tee::new(Vec::new());
        write!(tee, "ok  table\nFAIL slot").expect("write");
        tee.leave_at(&provided, Some("error: the broker is down"));
        assert_eq!(
            std::fs::read_to_string(&provided).expect("read"),
            "ok  table\nFAIL slot\nerror: the broker is down\n"
        );
        assert_eq!(tee.inner, b"ok  table\nFAIL slot");
        let missing = dir.path().join("none");
        tee.leave_at(&missing, None);
        assert!(!missing.exists());
    }
}
