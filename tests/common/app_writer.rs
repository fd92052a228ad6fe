//! An application writing outbox events the way the pattern asks: each event in the same
//! transaction as a change of its aggregate, several aggregates and events per
//! transaction, several concurrent writers, and some transactions rolled back.
//!
//! Each transaction first locks its aggregates' rows (`SELECT … ORDER BY id FOR UPDATE`,
//! in one order, so writers never deadlock) and bumps their version, as a business update
//! would. That lock is what makes "per-aggregate order" well defined: two transactions
//! of one aggregate never overlap, so its outbox ids grow in commit order.
//!
//! The writer works against a budget: it commits events until it has committed as many
//! as the budget allows, then waits for more (or for [`AppWriter::finish`]). A test
//! raises the budget in steps to write before, during and after something it does.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;

/// What the writers did, for the consumer-side check.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    /// Ids of committed outbox rows.
    pub committed: BTreeSet<i64>,
    /// Ids of outbox rows whose transaction was rolled back: they must never arrive.
    pub aborted: BTreeSet<i64>,
    /// Committed transactions.
    pub transactions: usize,
    /// Rolled-back transactions.
    pub rollbacks: usize,
    /// Ids of outbox rows whose COMMIT got no answer (the server went away): committed
    /// or not, only the server can tell (see [`WriterOptions::failover`]).
    pub in_doubt: BTreeSet<i64>,
}

impl Ledger {
    /// The ledger as the server that survived a failover has it: `kept` holds the ids
    /// it has (the witness table). Committed are the rows it kept; every other row
    /// written (rolled back, in doubt, or acknowledged by a primary that died before
    /// its standby had them) must never arrive.
    pub fn as_kept_by(&self, kept: &BTreeSet<i64>) -> Ledger {
        let written: BTreeSet<i64> = self
            .committed
            .iter()
            .chain(&self.aborted)
            .chain(&self.in_doubt)
            .copied()
            .collect();
        Ledger {
            committed: written.intersection(kept).copied().collect(),
            aborted: written.difference(kept).copied().collect(),
            transactions: self.transactions,
            rollbacks: self.rollbacks,
            in_doubt: BTreeSet::new(),
        }
    }
}

/// How the application writes.
#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// Aggregate type of every event.
    pub aggregate_type: String,
    /// Aggregates `agg-000` … spread over.
    pub aggregates: usize,
    /// Concurrent writers, each on its own connection.
    pub writers: usize,
    /// Share of transactions rolled back.
    pub rollback_ratio: f64,
    /// Pause between one writer's transactions.
    pub pause: Duration,
    /// Writers outlive their server: a failed transaction is written off (its ids in
    /// [`Ledger::in_doubt`] when its COMMIT got no answer) and the writer connects to
    /// the same URL again until it answers (a promoted standby behind the address).
    /// Each transaction also records its outbox ids in `public.witness`, which tells
    /// what the surviving server has once the rows are deleted.
    pub failover: bool,
}

impl Default for WriterOptions {
    fn default() -> Self {
        Self {
            aggregate_type: "order".to_owned(),
            aggregates: 100,
            writers: 4,
            rollback_ratio: 0.1,
            pause: Duration::from_millis(10),
            failover: false,
        }
    }
}

struct Shared {
    budget: AtomicUsize,
    claimed: AtomicUsize,
    committed: AtomicUsize,
    finishing: AtomicBool,
    ledger: Mutex<Ledger>,
}

/// Concurrent writers of outbox events into `public.outbox` (the tests' schema).
pub struct AppWriter {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl AppWriter {
    /// Creates the `aggregates` table (the business rows) in the database at `url` and
    /// starts the writers with a budget of 0 events.
    pub async fn start(url: &str, options: WriterOptions) -> AppWriter {
        let setup = super::pg_connect(url)
            .await
            .unwrap_or_else(|e| panic!("app writer: connecting failed: {e}"));
        setup
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS public.aggregates (id text PRIMARY KEY, version bigint NOT NULL);
                 INSERT INTO public.aggregates
                   SELECT format('agg-%s', lpad(i::text, 3, '0')), 0 FROM generate_series(0, {}) AS i
                   ON CONFLICT DO NOTHING;
                 CREATE TABLE IF NOT EXISTS public.witness (id bigint PRIMARY KEY);",
                options.aggregates.saturating_sub(1)
            ))
            .await
            .unwrap_or_else(|e| panic!("app writer: creating the aggregates failed: {e}"));
        let shared = Arc::new(Shared {
            budget: AtomicUsize::new(0),
            claimed: AtomicUsize::new(0),
            committed: AtomicUsize::new(0),
            finishing: AtomicBool::new(false),
            ledger: Mutex::new(Ledger::default()),
        });
        let mut tasks = Vec::new();
        for _ in 0..options.writers {
            let client = super::pg_connect(url)
                .await
                .unwrap_or_else(|e| panic!("app writer: connecting failed: {e}"));
            tasks.push(tokio::spawn(write_loop(
                client,
                url.to_owned(),
                shared.clone(),
                options.clone(),
            )));
        }
        AppWriter { shared, tasks }
    }

    /// Lets the writers commit up to `events` events in total.
    pub fn allow(&self, events: usize) {
        self.shared.budget.fetch_max(events, Ordering::SeqCst);
    }

    /// Events committed so far.
    pub fn committed(&self) -> usize {
        self.shared.committed.load(Ordering::SeqCst)
    }

    /// Waits until `events` events are committed (panics after `timeout`, or when a
    /// writer died).
    pub async fn wait_committed(&self, events: usize, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.committed() < events {
            if let Some(task) = self.tasks.iter().find(|t| t.is_finished()) {
                panic!("app writer: a writer stopped early ({task:?})");
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "app writer: only {} of {events} events committed after {timeout:?}",
                self.committed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the writers once the budget is used up and returns what they did.
    pub async fn finish(self) -> Ledger {
        self.shared.finishing.store(true, Ordering::SeqCst);
        for task in self.tasks {
            if let Err(err) = task.await {
                std::panic::resume_unwind(err.into_panic());
            }
        }
        let ledger = self
            .shared
            .ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        ledger.clone()
    }
}

/// Claims up to `wanted` events of the budget; 0 when it is used up.
fn claim(shared: &Shared, wanted: usize) -> usize {
    let mut claimed = shared.claimed.load(Ordering::SeqCst);
    loop {
        let budget = shared.budget.load(Ordering::SeqCst);
        let take = wanted.min(budget.saturating_sub(claimed));
        if take == 0 {
            return 0;
        }
        match shared.claimed.compare_exchange(
            claimed,
            claimed + take,
            Ordering::SeqCst,
            Ordering::SeqCst,
        ) {
            Ok(_) => return take,
            Err(now) => claimed = now,
        }
    }
}

async fn write_loop(
    mut client: tokio_postgres::Client,
    url: String,
    shared: Arc<Shared>,
    options: WriterOptions,
) {
    let mut rng = StdRng::from_os_rng();
    loop {
        // One transaction: 1-3 aggregates, 1-4 events each, in a random interleaving.
        let how_many = rng.random_range(1..=3).min(options.aggregates);
        let picked = sample(&mut rng, options.aggregates, how_many).into_vec();
        let mut events: Vec<String> = picked
            .iter()
            .flat_map(|i| std::iter::repeat_n(format!("agg-{i:03}"), rng.random_range(1..=4)))
            .collect();
        for i in (1..events.len()).rev() {
            events.swap(i, rng.random_range(0..=i));
        }
        let rollback = rng.random_bool(options.rollback_ratio);
        let mut take = 0;
        if !rollback {
            take = claim(&shared, events.len());
            if take == 0 {
                if shared.finishing.load(Ordering::SeqCst)
                    && shared.claimed.load(Ordering::SeqCst) >= shared.budget.load(Ordering::SeqCst)
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            events.truncate(take);
        }
        match write_one(&mut client, &options, &events, rollback).await {
            Ok(ids) => {
                let mut ledger = shared
                    .ledger
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if rollback {
                    ledger.aborted.extend(ids);
                    ledger.rollbacks += 1;
                } else {
                    ledger.committed.extend(ids);
                    ledger.transactions += 1;
                }
            }
            Err((ids, err)) => {
                assert!(options.failover, "app writer: {err}");
                shared.claimed.fetch_sub(take, Ordering::SeqCst);
                shared
                    .ledger
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .in_doubt
                    .extend(ids);
                client = reconnect(&url).await;
                continue;
            }
        }
        if !rollback {
            shared.committed.fetch_add(events.len(), Ordering::SeqCst);
        }
        tokio::time::sleep(options.pause).await;
    }
}

/// Connects to `url` again, for up to two minutes.
async fn reconnect(url: &str) -> tokio_postgres::Client {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        match super::pg_connect(url).await {
            Ok(client) => return client,
            Err(err) => assert!(
                tokio::time::Instant::now() < deadline,
                "app writer: no server at {url} for 120 s: {err}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One transaction of `events`; on failure, the ids whose COMMIT got no answer (empty
/// when it failed earlier: then nothing was committed) and what failed.
async fn write_one(
    client: &mut tokio_postgres::Client,
    options: &WriterOptions,
    events: &[String],
    rollback: bool,
) -> Result<Vec<i64>, (Vec<i64>, String)> {
    let mut aggregates: Vec<String> = events.to_vec();
    aggregates.sort();
    aggregates.dedup();
    let early = |what: &str| {
        let what = what.to_owned();
        move |e: tokio_postgres::Error| (Vec::new(), format!("{what} failed: {e}"))
    };
    let tx = client.transaction().await.map_err(early("BEGIN"))?;
    tx.query(
        "SELECT id FROM public.aggregates WHERE id = ANY($1) ORDER BY id FOR UPDATE",
        &[&aggregates],
    )
    .await
    .map_err(early("locking aggregates"))?;
    tx.execute(
        "UPDATE public.aggregates SET version = version + 1 WHERE id = ANY($1)",
        &[&aggregates],
    )
    .await
    .map_err(early("updating aggregates"))?;
    let rows = tx
        .query(
            "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload)
             SELECT $1, a, 'Changed', jsonb_build_object('aggregate', a, 'n', o)
             FROM unnest($2::text[]) WITH ORDINALITY AS t(a, o) ORDER BY o
             RETURNING id",
            &[&options.aggregate_type, &events],
        )
        .await
        .map_err(early("inserting outbox rows"))?;
    let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    if options.failover {
        tx.execute(
            "INSERT INTO public.witness SELECT unnest($1::int8[])",
            &[&ids],
        )
        .await
        .map_err(early("recording the witness rows"))?;
    }
    if rollback {
        tx.rollback().await.map_err(early("ROLLBACK"))?;
    } else {
        tx.commit()
            .await
            .map_err(|e| (ids.clone(), format!("COMMIT failed: {e}")))?;
    }
    Ok(ids)
}
