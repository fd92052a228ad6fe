//! Transaction visibility against a snapshot, as `pg_current_snapshot()` prints it
//! (`xmin:xmax:xip,...`, 64-bit xids), for 32-bit xids as the replication stream and a
//! row's `xmin` give them. Used by the delete task (wait until a streamed commit is
//! visible) and the operator's handover from polling to log tailing (which rows were
//! committed before the slot existed).

/// A parsed snapshot: the low 32 bits of `xmax` and of each in-progress xid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    xmax: u32,
    in_progress: Vec<u32>,
}

impl Snapshot {
    /// Parses `pg_current_snapshot()::text`; `None` when it does not read as one.
    pub fn parse(text: &str) -> Option<Snapshot> {
        let mut parts = text.trim().split(':');
        let (_xmin, xmax, xip) = (parts.next()?, parts.next()?, parts.next().unwrap_or(""));
        if parts.next().is_some() {
            return None;
        }
        // xid8 values: the low 32 bits are the xid.
        let low = |v: &str| {
            v.trim()
                .parse::<u64>()
                .ok()
                .map(|x| (x & 0xFFFF_FFFF) as u32)
        };
        let xmax = low(xmax)?;
        let in_progress = xip
            .split(',')
            .filter(|v| !v.is_empty())
            .map(low)
            .collect::<Option<Vec<u32>>>()?;
        Some(Snapshot { xmax, in_progress })
    }

    /// Whether a committed transaction `xid` is visible in the snapshot: before xmax
    /// and not in progress. xids compare modulo 2^32, as PostgreSQL's own
    /// `TransactionIdPrecedes` does; the xids asked about are within 2^31 of xmax.
    pub fn sees(&self, xid: u32) -> bool {
        let precedes = (xid.wrapping_sub(self.xmax) as i32) < 0;
        precedes && !self.in_progress.contains(&xid)
    }
}

impl Snapshot {
    /// Whether a committed transaction `xid` — any, however old — committed before the
    /// snapshot, given `now_xmax`, the `xmax` of a snapshot taken later. The xids
    /// assigned since the snapshot are exactly those from its `xmax` up to `now_xmax`
    /// (modulo 2^32; fewer than 2^32 of them pass between the two), so a transaction
    /// committed after it is one of those or was in progress then; every other xid is
    /// older, also one more than 2^31 transactions old, which [`Snapshot::sees`]
    /// would take for a future one.
    pub fn committed_before(&self, xid: u32, now_xmax: u32) -> bool {
        let assigned_since = now_xmax.wrapping_sub(self.xmax);
        let after = xid.wrapping_sub(self.xmax) < assigned_since;
        !after && !self.in_progress.contains(&xid)
    }

    /// The low 32 bits of `xmax` of a snapshot as text (`pg_current_snapshot()`).
    pub fn xmax_of(text: &str) -> Option<u32> {
        Snapshot::parse(text).map(|s| s.xmax)
    }
}

/// Whether every transaction of `xids` is visible in `snapshot` (text); `None` when
/// the text is not a snapshot.
pub fn all_visible(snapshot: &str, xids: &[u32]) -> Option<bool> {
    let snapshot = Snapshot::parse(snapshot)?;
    Some(xids.iter().all(|&x| snapshot.sees(x)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transactions_are_visible_before_xmax_and_out_of_progress() {
        // xmin 100, xmax 110, 105 in progress.
        let snap = "100:110:105";
        assert_eq!(all_visible(snap, &[99, 104, 109]), Some(true));
        assert_eq!(all_visible(snap, &[104, 105]), Some(false));
        assert_eq!(all_visible(snap, &[110]), Some(false));
        assert_eq!(all_visible("100:110:", &[105]), Some(true));
        // Full xid8 values with an epoch: the low 32 bits count, modulo 2^32.
        let epoch = 3u64 << 32;
        let snap = format!("{}:{}:", epoch + 5, epoch + 10);
        assert_eq!(all_visible(&snap, &[9]), Some(true));
        assert_eq!(all_visible(&snap, &[10]), Some(false));
        // Just before the epoch turned: an xid near 2^32 precedes xmax 10.
        assert_eq!(all_visible(&snap, &[u32::MAX - 3]), Some(true));
        assert_eq!(all_visible("garbage", &[1]), None);
        assert_eq!(all_visible("1:2:x", &[1]), None);
        assert_eq!(all_visible("1:2:3:4", &[1]), None);
    }

    #[test]
    fn a_row_of_any_age_counts_as_committed_before_and_only_later_ones_after() {
        // The slot's snapshot: xmax 3,000,000,000, 3,000,000,005 in progress; 100 xids
        // assigned since.
        let snap = Snapshot::parse("2999999990:3000000000:2999999995").unwrap();
        let now = 3_000_000_100;
        // 2.5 billion transactions older: more than 2^31 behind, which modulo-2^32
        // comparison takes for a future xid.
        let ancient = 500_000_000;
        assert!(!snap.sees(ancient), "the comparison this replaces");
        assert!(snap.committed_before(ancient, now));
        assert!(snap.committed_before(2_999_999_999, now));
        // In progress at the snapshot, or assigned after it: after.
        assert!(!snap.committed_before(2_999_999_995, now));
        assert!(!snap.committed_before(3_000_000_000, now));
        assert!(!snap.committed_before(3_000_000_099, now));
        // Across the 2^32 wrap: a snapshot just before it, xids just after.
        let snap = Snapshot::parse(&format!("{}:{}:", u32::MAX - 10, u32::MAX - 5)).unwrap();
        let now = 20;
        assert!(!snap.committed_before(3, now));
        assert!(snap.committed_before(u32::MAX - 6, now));
        assert!(snap.committed_before(2_000_000_000, now));
        assert_eq!(Snapshot::xmax_of("1:7:"), Some(7));
    }
}
