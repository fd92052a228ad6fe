//! Capped exponential backoff for reconnects and retries, shared by both publishers.

use std::time::Duration;

/// Longest pause before retrying after an outage or a failed row.
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Capped exponential backoff: 100 ms, doubling, at most [`MAX_BACKOFF`].
pub(super) struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);

    pub(super) fn new() -> Self {
        Self { next: Self::FIRST }
    }

    /// The pause to take now; the next one doubles.
    pub(super) fn step(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(MAX_BACKOFF);
        now
    }

    /// Back to the first pause, after a success.
    pub(super) fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut b = Backoff::new();
        let steps: Vec<Duration> = (0..10).map(|_| b.step()).collect();
        assert_eq!(steps[0], Duration::from_millis(100));
        assert_eq!(steps[1], Duration::from_millis(200));
        assert_eq!(*steps.last().unwrap(), MAX_BACKOFF);
        b.reset();
        assert_eq!(b.step(), Duration::from_millis(100));
    }
}
