//! How live relay processes share partitions: pure arithmetic, so it is unit-tested.
//!
//! Every process holds a member advisory lock; all of them see the same sorted member
//! list in `pg_locks`, so each computes its own share without talking to the others.
//! Shares differ by at most one and add up to the partition count; a process above its
//! share releases partitions (between batches), one below it takes free ones.

/// How many of `partitions` the member at `rank` (0-based among `members`) should own.
pub fn target(partitions: usize, members: usize, rank: usize) -> usize {
    let members = members.max(1);
    partitions / members + usize::from(rank < partitions % members)
}

/// The order in which the member at `rank` tries free partitions: starting at its own
/// slice, so members rarely race for the same partition.
pub fn preference(partitions: usize, members: usize, rank: usize) -> Vec<i64> {
    let members = members.max(1);
    let start = rank.min(members) * partitions / members;
    (0..partitions)
        .map(|i| i64::try_from((start + i) % partitions.max(1)).unwrap_or(0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_and_differ_by_at_most_one() {
        for partitions in 1..40 {
            for members in 1..12 {
                let shares: Vec<usize> = (0..members)
                    .map(|r| target(partitions, members, r))
                    .collect();
                assert_eq!(shares.iter().sum::<usize>(), partitions);
                let (min, max) = (shares.iter().min(), shares.iter().max());
                assert!(max.unwrap() - min.unwrap() <= 1, "{shares:?}");
            }
        }
    }

    #[test]
    fn preference_visits_every_partition_once_from_the_own_slice() {
        let p = preference(8, 2, 1);
        assert_eq!(p[0], 4);
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..8).collect::<Vec<_>>());
    }
}
