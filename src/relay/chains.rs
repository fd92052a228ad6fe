//! A batch split into chains, one per aggregate, each published in order: shared by the
//! polling and the log-tailing publisher.
//!
//! Rows of one aggregate go out one after another, each waiting for its broker
//! acknowledgement, so a retry can never overtake an earlier row; different aggregates
//! run concurrently.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::broker::{Broker, Delivered, PublishError, Shape, Step};
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

/// Chains of a batch still sending at which a chain's next message counts as crowded
/// ([`Step::crowded`]): the chains advance together, so their next messages come in
/// bursts as the acknowledgements of the ones before arrive. Sent one by one (Kafka's
/// chain-step producer, `linger.ms=0`), a burst of hundreds became as many produce
/// requests: with 250 aggregates to a batch of 500 rows (chains of two), polling's relay
/// and Kafka spent twice the CPU per event and drained 28% slower than with chains of
/// one. A few busy aggregates stay below it and keep sending each step at once.
pub(crate) const CROWD: usize = 32;

/// Publishes every chain of a batch at once and returns their outcomes.
///
/// All chains are in flight together: a batch is already bounded by `batchSize`, and a
/// cap below it (64 chains, earlier) left the producer waiting on a few dozen
/// acknowledgements per round trip instead of batching the whole poll, which held the
/// polling relay to a fraction of the broker's produce rate (see the README's
/// Performance section). Order is unaffected: it is kept inside each chain.
///
/// With a `fence`, no message is sent after it: the polling relay's partition locks
/// are only known to be held up to then (see publisher.rs, "Fencing"); the rest of each
/// chain comes back unsent, as after an outage.
pub(super) async fn publish_chains(
    broker: &dyn Broker,
    shape: &Shape,
    chains: Vec<Vec<OutboxRow>>,
    fence: Option<Instant>,
) -> Vec<ChainResult> {
    let sending = AtomicUsize::new(chains.len());
    let sending = &sending;
    futures::future::join_all(chains.into_iter().map(|chain| async move {
        let result = publish_chain(broker, shape, chain, fence, sending).await;
        sending.fetch_sub(1, Ordering::Relaxed);
        result
    }))
    .await
}

/// Publishes a chain one message at a time, stopping at the first failure (or at the
/// fence). `sending` counts the batch's chains not finished yet, this one included.
async fn publish_chain(
    broker: &dyn Broker,
    shape: &Shape,
    chain: Vec<OutboxRow>,
    fence: Option<Instant>,
    sending: &AtomicUsize,
) -> ChainResult {
    let mut published = Vec::with_capacity(chain.len());
    let mut rows = chain.into_iter();
    // The acknowledgement of the message before: the next one follows it.
    let mut previous: Option<Delivered> = None;
    while let Some(row) = rows.next() {
        let sent = if fence.is_some_and(|f| Instant::now() >= f) {
            Err(PublishError::transient(
                "not sent: the database session that holds this partition was last seen alive too long ago (fence)",
            ))
        } else {
            match shape.build(&row) {
                // The chain's first message goes out with the whole batch's; the
                // others one at a time, after their predecessor's acknowledgement,
                // and to where it went.
                Ok(message) => match previous {
                    None => broker.publish(&message).await,
                    Some(after) => {
                        let step = Step {
                            after,
                            crowded: sending.load(Ordering::Relaxed) >= CROWD,
                        };
                        broker.publish_next(&message, step).await
                    }
                },
                Err(err) => Err(err),
            }
        };
        match sent {
            Ok(delivered) => {
                previous = Some(delivered);
                published.push((row.id, row.created_at));
            }
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

/// A broker for unit tests that records what it is asked to publish.
#[cfg(test)]
pub(crate) mod recording {
    use crate::broker::{Broker, Delivered, Message, PublishError, Step};

    /// Records what it is asked to publish, and whether as a chain's next message (and
    /// then, in the second list, whether crowded); accepts everything.
    #[derive(Default)]
    pub struct Recorder(
        pub std::sync::Mutex<Vec<(String, bool)>>,
        pub std::sync::Mutex<Vec<bool>>,
    );

    impl Recorder {
        fn record(&self, message: &Message, next: bool) {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push((message.id.clone(), next));
        }
    }

    impl Broker for Recorder {
        fn publish<'a>(
            &'a self,
            message: &'a Message,
        ) -> futures::future::BoxFuture<'a, Result<Delivered, PublishError>> {
            self.record(message, false);
            // An acknowledgement takes a while: the other chains send meanwhile.
            Box::pin(async {
                tokio::task::yield_now().await;
                Ok(Delivered::default())
            })
        }

        fn publish_next<'a>(
            &'a self,
            message: &'a Message,
            step: Step,
        ) -> futures::future::BoxFuture<'a, Result<Delivered, PublishError>> {
            self.record(message, true);
            self.1
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(step.crowded);
            // An acknowledgement takes a while: the other chains send meanwhile.
            Box::pin(async {
                tokio::task::yield_now().await;
                Ok(Delivered::default())
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::recording::Recorder;
    use super::*;

    fn row(id: i64, aggregate: &str) -> OutboxRow {
        OutboxRow {
            id,
            aggregate_type: "A".into(),
            aggregate_id: Some(aggregate.into()),
            event_type: None,
            payload: Some(bytes::Bytes::new()),
            extra: Vec::new(),
            partition: 0,
            created_at: None,
            timestamp: None,
        }
    }

    #[tokio::test]
    async fn a_chains_first_message_goes_with_the_batch_and_the_rest_as_next() {
        let broker = Recorder::default();
        let rows = vec![row(1, "a"), row(2, "b"), row(3, "a"), row(4, "a")];
        let results = publish_chains(
            &broker,
            &Shape::new(crate::broker::BrokerKind::Nats, "s"),
            chains(rows, true),
            None,
        )
        .await;
        assert!(results.iter().all(|r| r.failed.is_none()));
        let mut sent = broker.0.lock().unwrap().clone();
        sent.sort();
        let sent: Vec<(&str, bool)> = sent.iter().map(|(id, n)| (id.as_str(), *n)).collect();
        assert_eq!(
            sent,
            vec![("1", false), ("2", false), ("3", true), ("4", true)]
        );
    }

    #[tokio::test]
    async fn next_messages_are_crowded_while_many_chains_send_and_alone_when_few_do() {
        let shape = Shape::new(crate::broker::BrokerKind::Nats, "s");
        // 40 aggregates with two events each: every second event has 39 other chains
        // sending beside it.
        let many: Vec<OutboxRow> = (0..80).map(|i| row(i, &format!("a{}", i % 40))).collect();
        let broker = Recorder::default();
        publish_chains(&broker, &shape, chains(many, true), None).await;
        let crowded = broker.1.lock().unwrap().clone();
        assert_eq!(crowded.len(), 40);
        assert!(crowded.iter().all(|c| *c), "{crowded:?}");
        // Three busy aggregates: each step alone.
        let few: Vec<OutboxRow> = (0..15).map(|i| row(i, &format!("b{}", i % 3))).collect();
        let broker = Recorder::default();
        publish_chains(&broker, &shape, chains(few, true), None).await;
        let crowded = broker.1.lock().unwrap().clone();
        assert_eq!(crowded.len(), 12);
        assert!(crowded.iter().all(|c| !*c), "{crowded:?}");
    }

    #[tokio::test]
    async fn nothing_is_sent_past_the_fence() {
        let broker = Recorder::default();
        let rows = vec![row(1, "a"), row(2, "a"), row(3, "b")];
        let open = Instant::now() + std::time::Duration::from_secs(60);
        let results = publish_chains(
            &broker,
            &Shape::new(crate::broker::BrokerKind::Nats, "s"),
            chains(rows.clone(), true),
            Some(open),
        )
        .await;
        assert!(results.iter().all(|r| r.failed.is_none()));
        assert_eq!(broker.0.lock().unwrap().len(), 3);
        // Past the fence: every chain comes back whole and unsent, as after an outage.
        let broker = Recorder::default();
        let passed = Instant::now() - std::time::Duration::from_millis(1);
        let results = publish_chains(
            &broker,
            &Shape::new(crate::broker::BrokerKind::Nats, "s"),
            chains(rows, true),
            Some(passed),
        )
        .await;
        assert!(broker.0.lock().unwrap().is_empty());
        let unsent: usize = results
            .iter()
            .map(|r| {
                let (rest, err) = r.failed.as_ref().unwrap();
                assert!(!err.row_fault && err.message.contains("fence"), "{err}");
                rest.len()
            })
            .sum();
        assert_eq!(unsent, 3);
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
