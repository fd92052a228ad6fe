//! The pace of a polling worker: when its next poll is due, and how many rows its next
//! batch selects.

use std::time::{Duration, Instant};

/// When the next poll is due. A round is the polls from one nap to the next: full
/// batches poll again at once, and the interval runs from the round's first poll, so
/// a round that needed several batches does not add its own length to the interval.
/// (Counted from the round's last poll, large rows made rounds of three batches and
/// a cycle of the interval plus those batches: 16 KiB rows at 6,000/s waited
/// 144 ms at p99 with `interval: 100ms`.)
#[derive(Debug, Default)]
pub(super) struct Rounds {
    /// The first poll of the current round.
    started: Option<Instant>,
}

impl Rounds {
    /// A poll starts at `at`.
    pub(super) fn polled(&mut self, at: Instant) {
        self.started.get_or_insert(at);
    }

    /// The poll did not fill a batch, at `now`: the round ends, and the next starts one
    /// interval after this one started. A round longer than that still rests a tenth
    /// of the interval, so a slow database gets a breath between rounds.
    pub(super) fn nap(&mut self, interval: Duration, now: Instant) -> Duration {
        let started = self.started.take().unwrap_or(now);
        interval
            .saturating_sub(now.saturating_duration_since(started))
            .max(interval / 10)
    }

    /// The round was cut short (an unavailable broker, no partition to poll): the
    /// next poll starts a new one.
    pub(super) fn abandon(&mut self) {
        self.started = None;
    }
}

/// The next batch's row limit: as many rows as fit `budget` bytes at the last batch's
/// average payload size, between 1 and `batch_size`. An empty batch says nothing about
/// sizes and keeps `current`.
pub(super) fn next_limit(
    batch_size: i64,
    current: i64,
    rows: usize,
    bytes: usize,
    budget: usize,
) -> i64 {
    if rows == 0 {
        return current;
    }
    let average = (bytes / rows).max(1);
    i64::try_from(budget / average)
        .unwrap_or(batch_size)
        .clamp(1, batch_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::MAX_BATCH_BYTES;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_interval_runs_from_a_rounds_first_poll() {
        let interval = 100 * MS;
        let t0 = Instant::now();
        let mut rounds = Rounds::default();
        // Three full batches of 25 ms, then one that is not full at 75 ms: the next
        // round starts 100 ms after the first poll, not 100 ms after the last.
        for poll in 0..4 {
            rounds.polled(t0 + poll * 25 * MS);
        }
        assert_eq!(rounds.nap(interval, t0 + 80 * MS), 20 * MS);
        // The next round counts from its own first poll.
        rounds.polled(t0 + 100 * MS);
        assert_eq!(rounds.nap(interval, t0 + 110 * MS), 90 * MS);
    }

    #[test]
    fn a_round_longer_than_the_interval_still_rests_a_tenth_of_it() {
        let t0 = Instant::now();
        let mut rounds = Rounds::default();
        rounds.polled(t0);
        rounds.polled(t0 + 150 * MS);
        assert_eq!(rounds.nap(100 * MS, t0 + 180 * MS), 10 * MS);
    }

    #[test]
    fn a_round_cut_short_does_not_shorten_the_next() {
        let t0 = Instant::now();
        let mut rounds = Rounds::default();
        rounds.polled(t0);
        // The broker was unavailable: back-off, then a new round at 5 s.
        rounds.abandon();
        rounds.polled(t0 + 5000 * MS);
        assert_eq!(rounds.nap(100 * MS, t0 + 5020 * MS), 80 * MS);
    }

    #[test]
    fn large_rows_make_smaller_batches_within_batch_size() {
        // 1 KiB rows: 2 MiB holds 2,048, so batchSize (500) stands.
        assert_eq!(next_limit(500, 500, 500, 500 * 1024, MAX_BATCH_BYTES), 500);
        // 16 KiB rows: 128 fit.
        assert_eq!(
            next_limit(500, 500, 500, 500 * 16 * 1024, MAX_BATCH_BYTES),
            128
        );
        // Small again: back to batchSize at once.
        assert_eq!(next_limit(500, 128, 128, 128 * 100, MAX_BATCH_BYTES), 500);
        // A row larger than the bound: one at a time, never zero.
        assert_eq!(
            next_limit(500, 500, 2, 2 * 4 * 1024 * 1024, MAX_BATCH_BYTES),
            1
        );
        // An empty batch keeps the limit.
        assert_eq!(next_limit(500, 128, 0, 0, MAX_BATCH_BYTES), 128);
        // Two workers share the bound: 16 KiB rows, 64 each.
        assert_eq!(
            next_limit(500, 500, 500, 500 * 16 * 1024, MAX_BATCH_BYTES / 2),
            64
        );
    }
}
