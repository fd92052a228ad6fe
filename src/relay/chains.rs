//! A batch split into chains, one per aggregate, each published in order: shared by the
//! polling and the log-tailing publisher.
//!
//! A chain's first row goes out with the batch's; once it is acknowledged, the rest of
//! the chain goes to the broker as [`Broker::publish_rest`] sends it: one after another,
//! each waiting for its predecessor's acknowledgement (NATS, RabbitMQ), or all at once
//! to the first one's partition by a client that never writes a message behind one it
//! gave up (Kafka). Either way a failure ends the chain there, and nothing after it is
//! written ahead of its retry. Different aggregates run concurrently.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use tokio_postgres::Client;

use crate::broker::{Broker, Clearance, PublishError, Shape};
use crate::postgres::{OutboxRow, RowId};

/// A batch's right to send (see `relay::polling`, "Fencing"): the session that holds
/// its locks (polling's partition locks; the row locks of log tailing's sweep and
/// back-fill) is still open, and, for polling, its last round trip was less than the
/// fence ago. A session the server or a pooler ended (`pg_terminate_backend`, a
/// timeout, a restart) released the locks at that instant and another replica may
/// already publish the partition: its connection task has seen the end, so nothing
/// more is sent from then on. A session cut off without a word is covered by `until`.
pub(super) struct Fence<'a> {
    /// No message goes out at or after this instant.
    pub until: Option<Instant>,
    /// The session whose locks the rows are published under; `None` in tests of the
    /// deadline alone.
    pub session: Option<&'a Client>,
}

/// Why a message was not sent once the lock session ended.
pub(crate) const SESSION_ENDED: &str =
    "the database session that held this partition's lock ended, and the lock with it";

impl Clearance for Fence<'_> {
    fn check(&self) -> Result<(), PublishError> {
        if self.session.is_some_and(Client::is_closed) {
            return Err(PublishError::held_back(SESSION_ENDED));
        }
        if self.until.is_some_and(|until| Instant::now() >= until) {
            return Err(PublishError::held_back(
                "the database session that holds this partition was last seen alive too long ago (fence)",
            ));
        }
        Ok(())
    }
}

/// One chain's outcome.
pub(super) struct ChainResult {
    /// Rows the broker acknowledged: id and creation time (unix seconds).
    pub published: Vec<(RowId, Option<f64>)>,
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
/// polling relay to a fraction of the broker's produce rate (see
/// docs/performance.md). Order is unaffected: it is kept inside each chain.
///
/// No message is sent once `fence` says no (the polling relay's [`Fence`]: its
/// partition locks are only known to be held up to then); the rest of each chain comes
/// back unsent, as after an outage.
pub(super) async fn publish_chains(
    broker: &dyn Broker,
    shape: &Shape,
    chains: Vec<Vec<OutboxRow>>,
    fence: &dyn Clearance,
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

/// Publishes a chain: its first message with the batch's, then, once that one is
/// acknowledged (and so where it landed is known), the rest together through
/// [`Broker::publish_rest`], stopping at the first failure (or at the fence). `sending`
/// counts the batch's chains not finished yet, this one included.
async fn publish_chain(
    broker: &dyn Broker,
    shape: &Shape,
    chain: Vec<OutboxRow>,
    fence: &dyn Clearance,
    sending: &AtomicUsize,
) -> ChainResult {
    let mut published = Vec::with_capacity(chain.len());
    let mut rows = chain.into_iter();
    let Some(first) = rows.next() else {
        return ChainResult {
            published,
            failed: None,
        };
    };
    let first_sent = match fence.check() {
        Err(err) => Err(err),
        Ok(()) => match shape.build(&first) {
            Ok(message) => broker.publish(&message).await,
            Err(err) => Err(err),
        },
    };
    let after = match first_sent {
        Ok(delivered) => delivered,
        Err(err) => return failed_from(published, first, rows, err),
    };
    published.push((first.id.clone(), first.created_at));
    if let Err(err) = fence.check()
        && let Some(row) = rows.next()
    {
        return failed_from(published, row, rows, err);
    }
    let rest: Vec<OutboxRow> = rows.collect();
    // The messages up to the first row that cannot become one: those are sent, and
    // that row fails after them (as if the broker had refused it).
    let mut messages = Vec::with_capacity(rest.len());
    let mut unbuildable = None;
    for row in &rest {
        match shape.build(row) {
            Ok(message) => messages.push(message),
            Err(err) => {
                unbuildable = Some(err);
                break;
            }
        }
    }
    let crowded = sending.load(Ordering::Relaxed) >= CROWD;
    let outcomes = if messages.is_empty() {
        Vec::new()
    } else {
        broker.publish_rest(&messages, after, crowded, fence).await
    };
    // The unbuildable row comes right after the messages; with fewer outcomes than
    // messages the broker stopped before it.
    let unbuildable = unbuildable.filter(|_| outcomes.len() == messages.len());
    let mut rest = rest.into_iter();
    for outcome in outcomes {
        let Some(row) = rest.next() else { break };
        match outcome {
            Ok(_) => published.push((row.id.clone(), row.created_at)),
            Err(err) => return failed_from(published, row, rest, err),
        }
    }
    match rest.next() {
        None => ChainResult {
            published,
            failed: None,
        },
        Some(row) => {
            let err = unbuildable.unwrap_or_else(|| PublishError::held_back(BEHIND_A_FAILURE));
            failed_from(published, row, rest, err)
        }
    }
}

/// Why a chain's message after a failed one was not sent.
pub(crate) const BEHIND_A_FAILURE: &str =
    "an earlier message of its aggregate was not acknowledged";

/// A chain that stopped at `row` with `err`: `row` and the rows after it come back
/// unsent.
fn failed_from(
    published: Vec<(RowId, Option<f64>)>,
    row: OutboxRow,
    rows: impl Iterator<Item = OutboxRow>,
    err: PublishError,
) -> ChainResult {
    let mut failed = vec![row];
    failed.extend(rows);
    ChainResult {
        published,
        failed: Some((failed, err)),
    }
}

/// A broker for unit tests that records what it is asked to publish.
#[cfg(test)]
pub(crate) mod recording {
    use std::sync::{Mutex, PoisonError};
    use std::time::Duration;

    use crate::broker::{Broker, Delivered, Message, PublishError, Step};

    /// Records what it is asked to publish; accepts everything but the ids in
    /// `failing` (an outage, for those).
    #[derive(Default)]
    pub struct Recorder {
        /// Each message's id, and whether it came as a chain's next message.
        pub sent: Mutex<Vec<(String, bool)>>,
        /// Whether each next message was crowded.
        pub crowded: Mutex<Vec<bool>>,
        /// The length of each rest of a chain given at once.
        pub rests: Mutex<Vec<usize>>,
        /// Ids whose publishing fails.
        pub failing: Mutex<Vec<String>>,
        /// How long an acknowledgement takes (none: the other chains still send
        /// meanwhile, the task yields).
        pub ack_after: Duration,
    }

    impl Recorder {
        fn record(&self, message: &Message, next: bool) -> Result<Delivered, PublishError> {
            self.sent
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((message.id.clone(), next));
            let failing = self.failing.lock().unwrap_or_else(PoisonError::into_inner);
            if failing.contains(&message.id) {
                return Err(PublishError::outage(format!("{} failed", message.id)));
            }
            Ok(Delivered::default())
        }

        async fn acknowledge(&self) {
            if self.ack_after.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(self.ack_after).await;
            }
        }
    }

    impl Broker for Recorder {
        fn publish<'a>(
            &'a self,
            message: &'a Message,
        ) -> futures::future::BoxFuture<'a, Result<Delivered, PublishError>> {
            let outcome = self.record(message, false);
            Box::pin(async move {
                self.acknowledge().await;
                outcome
            })
        }

        fn publish_next<'a>(
            &'a self,
            message: &'a Message,
            step: Step,
        ) -> futures::future::BoxFuture<'a, Result<Delivered, PublishError>> {
            let outcome = self.record(message, true);
            self.crowded
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(step.crowded);
            Box::pin(async move {
                self.acknowledge().await;
                outcome
            })
        }

        /// All recorded as sent at once; the outcomes end at the first failure.
        fn publish_rest<'a>(
            &'a self,
            messages: &'a [Message],
            after: Delivered,
            crowded: bool,
            _clearance: &'a dyn crate::broker::Clearance,
        ) -> futures::future::BoxFuture<'a, Vec<Result<Delivered, PublishError>>> {
            self.rests
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(messages.len());
            let sent: Vec<_> = messages
                .iter()
                .map(|message| self.publish_next(message, Step { after, crowded }))
                .collect();
            Box::pin(async move {
                let mut outcomes = Vec::new();
                for outcome in futures::future::join_all(sent).await {
                    let failed = outcome.is_err();
                    outcomes.push(outcome);
                    if failed {
                        break;
                    }
                }
                outcomes
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
            id: id.into(),
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

    /// Publishes `rows` as per-aggregate chains to `broker`, as a NATS relay would,
    /// under a fence that passes at `fence` (none: always clear).
    async fn publish(
        broker: &dyn Broker,
        rows: Vec<OutboxRow>,
        fence: Option<Instant>,
    ) -> Vec<ChainResult> {
        let shape = Shape::new(crate::broker::BrokerKind::Nats, "s");
        let clearance: &dyn Clearance = match fence {
            Some(until) => &Fence {
                until: Some(until),
                session: None,
            },
            None => &crate::broker::Clear,
        };
        publish_chains(broker, &shape, chains(rows, true), clearance).await
    }

    /// A [`Recorder`] that sends a chain's rest as brokers do by default (NATS,
    /// RabbitMQ): each message after its predecessor's acknowledgement.
    struct OneByOne(Recorder);

    impl Broker for OneByOne {
        fn publish<'a>(
            &'a self,
            message: &'a crate::broker::Message,
        ) -> futures::future::BoxFuture<'a, Result<crate::broker::Delivered, PublishError>>
        {
            self.0.publish(message)
        }
    }

    /// The ids a chain published.
    fn published(result: &ChainResult) -> Vec<i64> {
        result
            .published
            .iter()
            .filter_map(|(id, _)| id.as_int())
            .collect()
    }

    /// The ids a chain sent back unpublished, and why.
    fn failed(result: &ChainResult) -> (Vec<i64>, &PublishError) {
        let (rows, err) = result.failed.as_ref().expect("a failure");
        (rows.iter().filter_map(|r| r.id.as_int()).collect(), err)
    }

    #[tokio::test]
    async fn a_chains_first_message_goes_with_the_batch_and_the_rest_as_next() {
        let broker = Recorder::default();
        let rows = vec![row(1, "a"), row(2, "b"), row(3, "a"), row(4, "a")];
        let results = publish(&broker, rows, None).await;
        assert!(results.iter().all(|r| r.failed.is_none()));
        let mut sent = broker.sent.lock().unwrap().clone();
        sent.sort();
        let sent: Vec<(&str, bool)> = sent.iter().map(|(id, n)| (id.as_str(), *n)).collect();
        assert_eq!(
            sent,
            vec![("1", false), ("2", false), ("3", true), ("4", true)]
        );
    }

    #[tokio::test]
    async fn next_messages_are_crowded_while_many_chains_send_and_alone_when_few_do() {
        // 40 aggregates with two events each: every second event has 39 other chains
        // sending beside it.
        let many: Vec<OutboxRow> = (0..80).map(|i| row(i, &format!("a{}", i % 40))).collect();
        let broker = Recorder::default();
        publish(&broker, many, None).await;
        let crowded = broker.crowded.lock().unwrap().clone();
        assert_eq!(crowded.len(), 40);
        assert!(crowded.iter().all(|c| *c), "{crowded:?}");
        // Three busy aggregates: each step alone.
        let few: Vec<OutboxRow> = (0..15).map(|i| row(i, &format!("b{}", i % 3))).collect();
        let broker = Recorder::default();
        publish(&broker, few, None).await;
        let crowded = broker.crowded.lock().unwrap().clone();
        assert_eq!(crowded.len(), 12);
        assert!(crowded.iter().all(|c| !*c), "{crowded:?}");
    }

    #[tokio::test]
    async fn a_chains_rest_goes_out_at_once_once_its_first_message_is_acknowledged() {
        let broker = Recorder::default();
        let rows = (1..=6)
            .map(|i| row(i, if i == 3 { "b" } else { "a" }))
            .collect();
        let results = publish(&broker, rows, None).await;
        assert!(results.iter().all(|r| r.failed.is_none()));
        // "a": 1 alone, then 2, 4, 5, 6 together; "b": 3 alone.
        assert_eq!(*broker.rests.lock().unwrap(), vec![4]);
        let published: Vec<Vec<i64>> = results.iter().map(published).collect();
        assert_eq!(published, vec![vec![1, 2, 4, 5, 6], vec![3]]);
    }

    #[tokio::test]
    async fn a_row_that_cannot_become_a_message_ends_its_chains_rest_and_nothing_after_it_is_sent()
    {
        let broker = Recorder::default();
        let mut rows: Vec<OutboxRow> = (1..=5).map(|i| row(i, "a")).collect();
        // Not a valid NATS subject token.
        rows[2].aggregate_type = "bad type".into();
        let results = publish_chains(
            &broker,
            &Shape::new(crate::broker::BrokerKind::Nats, "e.{aggregateType}"),
            chains(rows, true),
            &crate::broker::Clear,
        )
        .await;
        // 1 alone, then only 2: the rest stops before row 3.
        assert_eq!(*broker.rests.lock().unwrap(), vec![1]);
        let sent: Vec<String> = broker
            .sent
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _)| id.clone())
            .collect();
        assert_eq!(sent, vec!["1", "2"]);
        assert_eq!(published(&results[0]), vec![1, 2]);
        let (unsent, err) = failed(&results[0]);
        assert_eq!(unsent, vec![3, 4, 5]);
        assert!(err.is_refused(), "{err}");
    }

    #[tokio::test]
    async fn a_failure_in_a_chains_rest_sends_that_row_and_the_rest_back_unpublished() {
        let broker = Recorder::default();
        broker.failing.lock().unwrap().push("4".into());
        let rows = (1..=7).map(|i| row(i, "a")).collect();
        let results = publish(&broker, rows, None).await;
        assert_eq!(published(&results[0]), vec![1, 2, 3]);
        let (unsent, err) = failed(&results[0]);
        assert_eq!(unsent, vec![4, 5, 6, 7]);
        assert!(
            !err.is_refused() && err.message().contains("4 failed"),
            "{err}"
        );
        // A chain whose first message fails sends nothing more.
        let broker = Recorder::default();
        broker.failing.lock().unwrap().push("1".into());
        let rows = (1..=3).map(|i| row(i, "a")).collect();
        let results = publish(&broker, rows, None).await;
        assert!(published(&results[0]).is_empty());
        assert_eq!(failed(&results[0]).0.len(), 3);
        assert_eq!(broker.sent.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_chains_rest_is_not_sent_when_the_fence_passed_while_its_first_message_was_acknowledged()
     {
        let broker = Recorder {
            ack_after: std::time::Duration::from_millis(100),
            ..Recorder::default()
        };
        let rows = (1..=4).map(|i| row(i, "a")).collect();
        let fence = Instant::now() + std::time::Duration::from_millis(30);
        let results = publish(&broker, rows, Some(fence)).await;
        assert_eq!(published(&results[0]), vec![1]);
        let (unsent, err) = failed(&results[0]);
        assert_eq!(unsent, vec![2, 3, 4]);
        assert!(err.message().contains("fence"), "{err}");
        assert_eq!(broker.sent.lock().unwrap().len(), 1);
        assert!(broker.rests.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_rest_sent_one_by_one_stops_where_the_fence_passes() {
        let broker = OneByOne(Recorder {
            ack_after: std::time::Duration::from_millis(100),
            ..Recorder::default()
        });
        let rows = (1..=8).map(|i| row(i, "a")).collect();
        // Sent at about 0, 100 and 200 ms; the fourth would go at 300.
        let fence = Instant::now() + std::time::Duration::from_millis(250);
        let results = publish(&broker, rows, Some(fence)).await;
        assert_eq!(published(&results[0]), vec![1, 2, 3]);
        let (unsent, err) = failed(&results[0]);
        assert_eq!(unsent, vec![4, 5, 6, 7, 8]);
        assert!(
            err.is_held_back() && err.message().contains("fence"),
            "{err}"
        );
        assert_eq!(broker.0.sent.lock().unwrap().len(), 3);
    }

    #[tokio::test]
    async fn nothing_is_sent_past_the_fence() {
        let broker = Recorder::default();
        let rows = vec![row(1, "a"), row(2, "a"), row(3, "b")];
        let open = Instant::now() + std::time::Duration::from_secs(60);
        let results = publish(&broker, rows.clone(), Some(open)).await;
        assert!(results.iter().all(|r| r.failed.is_none()));
        assert_eq!(broker.sent.lock().unwrap().len(), 3);
        // Past the fence: every chain comes back whole and unsent, as after an outage.
        let broker = Recorder::default();
        let passed = Instant::now() - std::time::Duration::from_millis(1);
        let results = publish(&broker, rows, Some(passed)).await;
        assert!(broker.sent.lock().unwrap().is_empty());
        let unsent: usize = results
            .iter()
            .map(|r| {
                let (rest, err) = failed(r);
                assert!(
                    !err.is_refused() && err.message().contains("fence"),
                    "{err}"
                );
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
            .map(|c| c.iter().filter_map(|r| r.id.as_int()).collect())
            .collect();
        assert_eq!(ids, vec![vec![9, 3], vec![2, 1], vec![4]]);
        assert_eq!(chains(rows, false).len(), 5);
    }
}
