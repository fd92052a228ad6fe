//! One huge transaction through log tailing in bounded memory: a backfill of
//! 1,000,000 outbox rows committed at once is streamed to Kafka by a relay held to a
//! 128 MiB memory limit (a memory cgroup where the host allows one, as a Pod's limit
//! does). Every row must arrive in per-aggregate order, the relay must never be
//! OOM-killed, and its peak RSS (`VmHWM`) must stay under the limit.
//!
//! Before chunked publishing, the relay held a whole transaction in memory: this test
//! then died with the relay killed by the limit (or its peak far above it).

use crate::common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{RelayBroker, RelayProcess, SlotGuard};

/// Rows in the one transaction.
const ROWS: i64 = 1_000_000;
/// Distinct aggregates among them.
const AGGREGATES: i64 = 1000;
/// The relay's memory limit.
const LIMIT_BYTES: u64 = 128 * 1024 * 1024;

/// A child of this process's memory cgroup (v1 or v2) with a hard limit, removed on
/// drop. `None` (with the reason printed) where the host gives no writable cgroup: the
/// peak-RSS check still holds the relay to the same figure then.
struct MemoryCgroup {
    dir: PathBuf,
}

impl MemoryCgroup {
    fn create(limit: u64) -> Option<MemoryCgroup> {
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let (base, path, limit_file) = own.lines().find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            if controllers.split(',').any(|c| c == "memory") {
                Some(("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes"))
            } else if controllers.is_empty()
                && std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
            {
                Some(("/sys/fs/cgroup", path, "memory.max"))
            } else {
                None
            }
        })?;
        let dir = PathBuf::from(base)
            .join(path.trim_start_matches('/'))
            .join(format!("outbox-relay-{}", common::unique_suffix()));
        if let Err(err) = std::fs::create_dir(&dir) {
            println!(
                "no memory cgroup for the relay ({}: {err}); checking peak RSS only",
                dir.display()
            );
            return None;
        }
        let group = MemoryCgroup { dir };
        if let Err(err) = std::fs::write(group.dir.join(limit_file), limit.to_string()) {
            println!("cannot set the memory limit ({err}); checking peak RSS only");
            return None;
        }
        Some(group)
    }

    fn add(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|err| panic!("moving the relay into {}: {err}", self.dir.display()));
    }

    /// How often the limit was hit (v1 `memory.failcnt`, v2 `memory.events` max).
    fn limit_hits(&self) -> Option<u64> {
        if let Ok(v) = std::fs::read_to_string(self.dir.join("memory.failcnt")) {
            return v.trim().parse().ok();
        }
        let events = std::fs::read_to_string(self.dir.join("memory.events")).ok()?;
        events
            .lines()
            .find_map(|l| l.strip_prefix("max ")?.trim().parse().ok())
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A `/proc/<pid>/status` figure in bytes (`VmHWM`, `VmRSS`).
fn proc_status_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    })
}

/// Reads the whole topic: (id, aggregate, seq) of every message, in partition order.
fn consume_ids(bootstrap: &str, topic: &str, expected: usize) -> Vec<(i64, String, i64)> {
    use rdkafka::Message;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Headers;

    let consumer: BaseConsumer = common::kafka_config_for(bootstrap)
        .set("group.id", format!("verify-{}", common::unique_suffix()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap_or_else(|err| panic!("Kafka consumer: {err}"));
    consumer
        .subscribe(&[topic])
        .unwrap_or_else(|err| panic!("Kafka subscribe: {err}"));
    let mut out = Vec::with_capacity(expected);
    let mut idle_since = Instant::now();
    while idle_since.elapsed() < Duration::from_secs(20) && out.len() < expected + 1 {
        let Some(result) = consumer.poll(Duration::from_millis(200)) else {
            if out.len() >= expected {
                // Everything expected is in; wait a little for duplicates, not long.
                if idle_since.elapsed() > Duration::from_secs(2) {
                    break;
                }
            }
            continue;
        };
        idle_since = Instant::now();
        let message = result.unwrap_or_else(|err| panic!("Kafka consume: {err}"));
        let id = message
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "id"))
            .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse().ok())
            .unwrap_or_else(|| panic!("Kafka message without a numeric id header"));
        let aggregate = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        let seq =
            serde_json::from_slice::<serde_json::Value>(message.payload().unwrap_or_default())
                .ok()
                .and_then(|v| v.get("seq")?.as_i64())
                .unwrap_or_else(|| panic!("message {id} without a seq"));
        out.push((id, aggregate, seq));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_million_row_transaction_streams_through_128_mib() {
    let started = Instant::now();
    let rig = common::Rig::load();
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let topic = common::fresh_topic(4).await;
    let broker = RelayBroker::Kafka {
        bootstrap: rig.kafka_bootstrap().to_owned(),
        topic: topic.clone(),
    };
    let guard = SlotGuard::new(rig.pg_url(), "big");
    common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    let yaml = common::log_tailing_yaml(&broker, &guard.slot, true);
    let mut relay = RelayProcess::start(&yaml, &db.url, &broker);
    let pid = relay.child.id();
    let cgroup = MemoryCgroup::create(LIMIT_BYTES);
    if let Some(group) = &cgroup {
        group.add(pid);
        println!(
            "relay {pid} in {} with a {LIMIT_BYTES}-byte limit",
            group.dir.display()
        );
    }
    common::wait_slot_active(&db.client, &guard.slot, &relay).await;
    // One transaction; ids follow g, so each aggregate's seq rises with its ids.
    db.client
        .batch_execute(&format!(
            "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload)
             SELECT 'order', 'agg-' || (g % {AGGREGATES}), 'Backfilled',
                    jsonb_build_object('seq', g / {AGGREGATES}, 'pad', repeat('x', 64))
             FROM generate_series(0, {ROWS} - 1) AS g"
        ))
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: the backfill failed: {err}"));
    let committed = started.elapsed();
    println!("backfill of {ROWS} rows committed after {committed:?}");
    // Deleting what is published: an empty table means every row was acknowledged.
    let mut peak_seen = 0u64;
    common::wait_for_relays(
        "the backfill to be published and deleted",
        Duration::from_secs(900),
        &[&relay],
        || {
            if let Some(rss) = proc_status_bytes(pid, "VmRSS") {
                peak_seen = peak_seen.max(rss);
            }
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            assert!(
                !state.contains(") Z "),
                "the relay died (killed by its memory limit?); peak RSS seen {peak_seen} bytes"
            );
            async {
                db.client
                    .query_one("SELECT count(*) FROM public.outbox", &[])
                    .await
                    .map(|r| r.get::<_, i64>(0) == 0)
                    .unwrap_or(false)
            }
        },
    )
    .await;
    let published_after = started.elapsed();
    let peak = proc_status_bytes(pid, "VmHWM").unwrap_or(peak_seen);
    let hits = cgroup.as_ref().and_then(MemoryCgroup::limit_hits);
    let status = relay.terminate(Duration::from_secs(30));
    assert!(
        status.success(),
        "relay exit {status}: {}",
        relay.log_tail(40)
    );
    drop(cgroup);

    let bootstrap = rig.kafka_bootstrap().to_owned();
    let received = tokio::task::spawn_blocking(move || {
        consume_ids(&bootstrap, &topic, usize::try_from(ROWS).unwrap())
    })
    .await
    .unwrap();
    let mut seen: HashMap<i64, u32> = HashMap::with_capacity(received.len());
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    let mut reordered = 0u64;
    for (id, aggregate, seq) in &received {
        let n = seen.entry(*id).or_insert(0);
        *n += 1;
        if *n > 1 {
            continue;
        }
        let last = last_seq.entry(aggregate.clone()).or_insert(-1);
        if *seq < *last {
            reordered += 1;
        }
        *last = (*last).max(*seq);
    }
    let duplicates = received.len() - seen.len();
    println!(
        "{ROWS}-row transaction: {} messages, {} distinct, {duplicates} duplicates, {reordered} \
         order violations; relay peak RSS {:.1} MiB (limit {} MiB, limit hits {hits:?}); \
         committed after {committed:?}, published and deleted after {published_after:?}",
        received.len(),
        seen.len(),
        peak as f64 / 1048576.0,
        LIMIT_BYTES / 1048576,
    );
    assert_eq!(
        i64::try_from(seen.len()).unwrap(),
        ROWS,
        "rows of the transaction are missing"
    );
    assert_eq!(reordered, 0, "per-aggregate order broken");
    assert!(
        peak < LIMIT_BYTES,
        "relay peak RSS {peak} bytes is over the {LIMIT_BYTES}-byte limit"
    );
    drop(guard);
}
