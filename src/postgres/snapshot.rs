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
}
