//! `make demo`'s program (the `demo` example, tests/demo/demo.rs) against the shared
//! rig for a bounded time: it prints events arriving from every relay and
//! `kubectl get obr` with the lag columns, exits 0 on its own, and leaves no process
//! it started running.
//!
//! The example binary is built by `cargo build --all-targets` (which `make test` runs
//! first) or `cargo build --example demo`.

use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The demo's own run time; the test allows for setup and shutdown on top of it.
const RUN_FOR: &str = "40s";
const DEADLINE: Duration = Duration::from_secs(300);

/// `<target>/<profile>/examples/demo`, next to this test's `<target>/<profile>/deps/`.
fn demo_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .unwrap_or_else(|| panic!("{} has no parent folder", exe.display()));
    let demo = profile_dir.join("examples").join("demo");
    assert!(
        demo.is_file(),
        "{} is missing: build it with `cargo build --example demo` (make test builds all targets)",
        demo.display()
    );
    demo
}

/// Process ids and start times (field 22 of /proc/PID/stat) of every descendant of
/// `root` alive now.
fn descendants(root: u32) -> BTreeMap<u32, String> {
    let mut parents: BTreeMap<u32, (u32, String)> = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // The command name (field 2) may hold spaces: split after its closing paren.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if let (Some(ppid), Some(start)) = (fields.get(1), fields.get(19))
            && let Ok(ppid) = ppid.parse()
        {
            parents.insert(pid, (ppid, (*start).to_owned()));
        }
    }
    let mut found = BTreeMap::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for (pid, (ppid, start)) in &parents {
            if *ppid == parent && !found.contains_key(pid) {
                found.insert(*pid, start.clone());
                frontier.push(*pid);
            }
        }
    }
    found
}

/// True when `pid` still runs as the process that started at `start`.
fn still_running(pid: u32, start: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')').is_some_and(|(_, rest)| {
            let fields: Vec<&str> = rest.split_whitespace().collect();
            fields.get(19) == Some(&start) && fields.first() != Some(&"Z")
        })
    })
}

#[tokio::test]
async fn demo_prints_events_and_lag_then_stops_everything_it_started() {
    let rig = common::Rig::load();
    let client = common::kube_client().await;
    // tests/rig/demo.sh installs the chart's CRD; on the shared rig, tests install it.
    common::install_outbox_crd(&client).await;
    let prefix = format!("test-{}", common::unique_suffix());
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let out_path = dir.path().join("demo.out");
    let err_path = dir.path().join("demo.err");
    let out = std::fs::File::create(&out_path).unwrap_or_else(|e| panic!("{e}"));
    let err = std::fs::File::create(&err_path).unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();
    let mut child = Command::new(demo_binary())
        .args(["--duration", RUN_FOR, "--prefix", &prefix, "--shared-rig"])
        .args(["--rate", "20", "--table-every", "4"])
        .env("OUTBOX_RIG_ENV", &rig.env_file)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the demo: {e}"));
    let pid = child.id();

    // Every process the demo starts (operators, relays, kubectl), as seen while it runs.
    let mut seen: BTreeMap<u32, String> = BTreeMap::new();
    let status = loop {
        seen.extend(descendants(pid));
        if let Some(status) = child.try_wait().unwrap_or_else(|e| panic!("wait: {e}")) {
            break Some(status);
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let output = format!(
        "--- stdout ---\n{stdout}\n--- stderr ---\n{}",
        common::private::tail(&err_path, 60)
    );
    let status =
        status.unwrap_or_else(|| panic!("the demo did not stop within {DEADLINE:?}\n{output}"));
    println!(
        "demo ran {:.0}s, started {} processes",
        started.elapsed().as_secs_f64(),
        seen.len()
    );

    assert!(status.success(), "the demo exited with {status}\n{output}");
    if common::node::available() {
        assert!(
            stdout.contains(&format!(
                "relay pods run as containers on node {}",
                common::node::name()
            )),
            "the demo did not run its relay pods on the rig's node\n{output}"
        );
        // Its relay containers are gone too (they are the runtime's, not its children).
        for example in ["polling-kafka", "polling-nats", "log-tailing-rabbitmq"] {
            let left = common::node::crictl_pods(&format!("{prefix}-{example}"));
            assert!(left.is_empty(), "relay containers left running: {left:?}");
        }
    }
    for example in ["polling-kafka", "polling-nats", "log-tailing-rabbitmq"] {
        let lines = stdout
            .lines()
            .filter(|l| l.contains(&format!("received {example} ")))
            .count();
        assert!(lines > 0, "no events printed for {example}\n{output}");
        let row = stdout
            .lines()
            .any(|l| l.starts_with(&format!("{prefix}-{example} ")) && l.contains(example));
        assert!(row, "no `kubectl get obr` row for {example}\n{output}");
        // NAMESPACE NAME MODE BROKER READY BACKLOG ...: at some point the relay is
        // ready and its status carries a backlog figure (the operator's measurement).
        let measured = stdout.lines().any(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            fields.first() == Some(&format!("{prefix}-{example}").as_str())
                && fields.get(4) == Some(&"True")
                && fields.get(5).is_some_and(|b| b.parse::<u64>().is_ok())
        });
        assert!(
            measured,
            "no `kubectl get obr` row for {example} with READY True and a BACKLOG number\n{output}"
        );
    }
    let header = stdout.lines().any(|l| {
        [
            "NAMESPACE",
            "NAME",
            "MODE",
            "BROKER",
            "READY",
            "BACKLOG",
            "OLDEST",
            "AGE",
        ]
        .iter()
        .all(|column| l.split_whitespace().any(|w| w == *column))
    });
    assert!(
        header,
        "no `kubectl get obr` table with BACKLOG and OLDEST\n{output}"
    );
    assert!(
        stdout.contains("demo stopped; everything it started is gone"),
        "{output}"
    );
    assert!(!seen.is_empty(), "the demo started no process\n{output}");
    let left: Vec<u32> = seen
        .iter()
        .filter(|(pid, start)| still_running(**pid, start))
        .map(|(pid, _)| *pid)
        .collect();
    assert!(
        left.is_empty(),
        "processes the demo started still run after it exited: {left:?}\n{output}"
    );
    let _ = stderr;
}
