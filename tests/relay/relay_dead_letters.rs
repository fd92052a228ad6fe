//! `outbox-operator dead-letters`: a relay dead-letters the rows NATS cannot take (a
//! subject their aggregate type makes invalid); the command lists them with the reason;
//! once the relay's subject is fixed, `--redrive ID` and then `--redrive all` move them
//! back into the outbox table and the relay publishes them with their original ids, in
//! both modes (polling selects them; log tailing streams the insert).

use crate::common;

use std::collections::BTreeSet;
use std::process::Output;
use std::time::Duration;

use common::{RelayBroker, RelayOptions, RelayProcess, SlotGuard};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

fn dead_letters(relay_yaml: &str, database_url: &str, redrive: Option<&str>) -> String {
    let config: serde_json::Value = serde_yaml::from_str(relay_yaml).unwrap();
    let manifest = json!({
        "apiVersion": "outbox.dev/v1alpha1",
        "kind": "OutboxRelay",
        "metadata": {"name": "orders", "namespace": "shop"},
        "spec": config["spec"],
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.yaml");
    std::fs::write(&file, serde_yaml::to_string(&manifest).unwrap()).unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-operator"));
    command
        .args(["dead-letters", "-f"])
        .arg(&file)
        .env("OUTBOX_DATABASE_URL", database_url);
    if let Some(ids) = redrive {
        command.args(["--redrive", ids]);
    }
    let output: Output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        common::describe_output(&output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

async fn dead_count(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM public.outbox_dead_letter", &[])
        .await
        .map_or(-1, |r| r.get(0))
}

async fn scenario(log_tailing: bool) {
    let db = common::fresh_database().await;
    common::create_outbox_table(&db.client, 4).await;
    let guard = SlotGuard::new(&db.url, "redrive");
    if log_tailing {
        common::create_replication(&db.client, &guard.slot, &guard.slot).await;
    }
    let stream = common::fresh_stream().await;
    let url = common::Rig::load().nats_url().to_owned();
    let relay_yaml = |subject: String| {
        let broker = RelayBroker::Nats {
            url: url.clone(),
            subject,
        };
        let options = RelayOptions {
            max_attempts: 1,
            on_exhausted: "deadLetter",
            ..RelayOptions::default()
        };
        let yaml = common::relay_config_yaml(&broker, &options);
        let yaml = if log_tailing {
            common::with_spec_line(&yaml, "mode", &common::log_tailing_mode(&guard.slot, true))
        } else {
            yaml
        };
        (yaml, broker)
    };
    // The subject takes the aggregate type: `bad type` makes an invalid subject.
    let (yaml, broker) = relay_yaml(format!("{}.{{aggregateType}}", stream.subject_prefix));
    let mut written = BTreeSet::new();
    let mut bad = Vec::new();
    for i in 0..10 {
        let kind = if i % 5 == 0 { "bad type" } else { "order" };
        let id = common::insert_row(&db.client, kind, &format!("agg-{i}"), &json!({"i": i})).await;
        written.insert(id);
        if kind == "bad type" {
            bad.push(id);
        }
    }
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    let left = if log_tailing {
        "SELECT count(*) FROM public.outbox"
    } else {
        "SELECT count(*) FROM public.outbox WHERE published_at IS NULL"
    };
    let drained = || async {
        db.client
            .query_one(left, &[])
            .await
            .is_ok_and(|r| r.get::<_, i64>(0) == 0)
    };
    common::wait_for_relays(
        "the refused rows dead-lettered",
        WAIT,
        &[&relay],
        || async { drained().await && dead_count(&db.client).await == 2 },
    )
    .await;
    let listed = dead_letters(&yaml, &db.url, None);
    assert!(
        listed.contains("2 rows in outbox_dead_letter")
            && bad.iter().all(|id| listed.contains(&format!("  {id}  ")))
            && listed.contains("bad type"),
        "{listed}"
    );
    drop(relay);

    // Fixed: one subject for every event. Redrive one row, then the rest.
    let (yaml, broker) = relay_yaml(format!("{}.fixed", stream.subject_prefix));
    let relay = RelayProcess::start(&yaml, &db.url, &broker);
    let first = dead_letters(&yaml, &db.url, Some(&bad[0].to_string()));
    assert!(
        first.contains("1 rows moved back") && first.contains("1 rows in outbox_dead_letter"),
        "{first}"
    );
    let rest = dead_letters(&yaml, &db.url, Some("all"));
    assert!(
        rest.contains("1 rows moved back") && rest.contains("0 rows in outbox_dead_letter"),
        "{rest}"
    );
    common::wait_for_relays("the redriven rows published", WAIT, &[&relay], || async {
        drained().await
            && common::consume_nats(&stream)
                .await
                .iter()
                .any(|r| r.id == bad[1])
    })
    .await;
    let received = common::consume_nats(&stream).await;
    let report = common::check_delivery(&received, &written, &BTreeSet::new());
    assert!(report.missing.is_empty(), "lost: {:?}", report.missing);
    assert_eq!(dead_count(&db.client).await, 0);
    println!(
        "dead-letters ({}): 2 rows dead-lettered, redriven by id and by `all`, {} of {} delivered with their ids",
        if log_tailing {
            "log tailing"
        } else {
            "polling"
        },
        report.distinct,
        written.len()
    );
    drop(relay);
    drop(guard);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_and_redriven_with_their_ids_polling() {
    scenario(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_and_redriven_with_their_ids_log_tailing() {
    scenario(true).await;
}
