//! A batch split into chains, one per aggregate, each published in order: shared by the
//! polling and the log-tailing publisher.
//!
//! Rows of one aggregate go out one after another, each waiting for its broker
//! acknowledgement, so a retry can never overtake an earlier row; different aggregates
//! run concurrently.

use std::collections::HashMap;

use crate::broker::{Broker, BrokerKind, PublishError, build_message};
use crate::postgres::OutboxRow;

/// One chain's outcome.
pub(super) struct ChainResult {
    /// Rows the broker acknowledged: id and creation time (unix seconds).
    pub published: Vec<(i64, Option<f64>)>,
    /// When a row failed: that row first, then the rest of its chain (not sent), with
    /// the error.
    pub failed: Option<(Vec<OutboxRow>, PublishError)>,
}

/// Splits a batch (in the order rows must go out: id order for polling, commit order
/// for log tailing) into chains: one per aggregate in `perAggregate` mode, one per row
/// otherwise. Each chain keeps the batch's order.
pub fn chains(rows: Vec<OutboxRow>, per_aggregate: bool) -> Vec<Vec<OutboxRow>> {
    if !per_aggregate {
        return rows.into_iter().map(|r| vec![r]).collect();
    }
    let mut index: HashMap<Option<String>, usize> = HashMap::new();
    let mut chains: Vec<Vec<OutboxRow>> = Vec::new();
    for row in rows {
        let slot = *index.entry(row.aggregate_id.clone()).or_insert_with(|| {
            chains.push(Vec::new());
            chains.len() - 1
        });
        chains[slot].push(row);
    }
    chains
}

/// Publishes every chain of a batch at once and returns their outcomes.
///
/// All chains are in flight together: a batch is already bounded by `batchSize`, and a
/// cap below it (64 chains, earlier) left the producer waiting on a few dozen
/// acknowledgements per round trip instead of batching the whole poll, which held the
/// polling relay to a fraction of the broker's produce rate (see the README's
/// Performance section). Order is unaffected: it is kept inside each chain.
pub(super) async fn publish_chains(
    broker: &dyn Broker,
    kind: BrokerKind,
    template: &str,
    chains: Vec<Vec<OutboxRow>>,
) -> Vec<ChainResult> {
    futures::future::join_all(
        chains
            .into_iter()
            .map(|chain| publish_chain(broker, kind, template, chain)),
    )
    .await
}

/// Publishes a chain one message at a time, stopping at the first failure.
pub(super) async fn publish_chain(
    broker: &dyn Broker,
    kind: BrokerKind,
    template: &str,
    chain: Vec<OutboxRow>,
) -> ChainResult {
    let mut published = Vec::with_capacity(chain.len());
    let mut rows = chain.into_iter();
    while let Some(row) = rows.next() {
        let sent = match build_message(kind, template, &row) {
            Ok(message) => broker.publish(&message).await,
            Err(err) => Err(err),
        };
        match sent {
            Ok(()) => published.push((row.id, row.created_at)),
            Err(err) => {
                let mut rest = vec![row];
                rest.extend(rows);
                return ChainResult {
                    published,
                    failed: Some((rest, err)),
                };
            }
        }
    }
    ChainResult {
        published,
        failed: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, aggregate: &str) -> OutboxRow {
        OutboxRow {
            id,
            aggregate_type: "A".into(),
            aggregate_id: Some(aggregate.into()),
            event_type: None,
            payload: Vec::new(),
            headers: Vec::new(),
            partition: 0,
            created_at: None,
        }
    }

    #[test]
    fn chains_keep_each_aggregates_rows_in_batch_order() {
        // Commit order, not id order: row 9 committed before row 3.
        let rows = vec![
            row(9, "a"),
            row(2, "b"),
            row(3, "a"),
            row(1, "b"),
            row(4, "c"),
        ];
        let ids: Vec<Vec<i64>> = chains(rows.clone(), true)
            .iter()
            .map(|c| c.iter().map(|r| r.id).collect())
            .collect();
        assert_eq!(ids, vec![vec![9, 3], vec![2, 1], vec![4]]);
        assert_eq!(chains(rows, false).len(), 5);
    }
}
