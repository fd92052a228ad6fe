//! The pure helpers of tests/common (env-file parsing, URL handling); needs no rig.

use crate::common;

use common::{host_port, parse_env, pg_url_for, unique_suffix};

#[test]
fn host_port_strips_scheme_userinfo_and_path() {
    assert_eq!(
        host_port("postgres://postgres@127.0.0.1:5433/postgres"),
        "127.0.0.1:5433"
    );
    assert_eq!(
        host_port("amqp://guest:guest@127.0.0.1:5673/%2f"),
        "127.0.0.1:5673"
    );
    assert_eq!(host_port("nats://127.0.0.1:4223"), "127.0.0.1:4223");
    assert_eq!(host_port("127.0.0.1:9092"), "127.0.0.1:9092");
}

#[test]
fn pg_url_for_replaces_only_the_database() {
    assert_eq!(
        pg_url_for("postgres://postgres@127.0.0.1:5433/postgres", "test_x"),
        "postgres://postgres@127.0.0.1:5433/test_x"
    );
    assert_eq!(
        pg_url_for("postgres://u@h:1/db?sslmode=disable", "t"),
        "postgres://u@h:1/t?sslmode=disable"
    );
    assert_eq!(pg_url_for("postgres://u@h:1", "t"), "postgres://u@h:1/t");
}

#[test]
fn rig_env_skips_comments_and_blank_lines() {
    let env = parse_env("# written by the rig\n\nA=1\nB=\nC=http://x/?a=b\n");
    assert_eq!(env.get("A").map(String::as_str), Some("1"));
    assert_eq!(env.get("B").map(String::as_str), Some(""));
    assert_eq!(env.get("C").map(String::as_str), Some("http://x/?a=b"));
    assert_eq!(env.len(), 3);
}

#[test]
fn unique_suffixes_are_lowercase_and_differ() {
    let a = unique_suffix();
    let b = unique_suffix();
    assert_ne!(a, b);
    assert!(
        a.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()),
        "{a}"
    );
}

/// Deliveries `(id, aggregate)` in the order a consumer saw them.
fn deliveries(seen: &[(i64, &str)]) -> Vec<common::Received> {
    seen.iter()
        .map(|(id, aggregate)| common::Received {
            id: *id,
            aggregate: (*aggregate).to_owned(),
            headers: Default::default(),
            payload: Vec::new(),
        })
        .collect()
}

#[test]
fn the_delivery_checker_looks_at_every_redelivery() {
    let committed = (1..=5).collect();
    let none = Default::default();
    let check = |seen: &[(i64, &str)]| {
        let report = common::check_delivery(&deliveries(seen), &committed, &none);
        [report.order_violations, report.stale_redeliveries].concat()
    };
    let all = [(1, "a"), (2, "b"), (3, "a"), (4, "b"), (5, "a")];
    assert!(check(&all).is_empty());
    // A replayed window: older rows again, up to the newest, in order.
    let replayed = [all.as_slice(), &[(3, "a"), (5, "a"), (4, "b")]].concat();
    assert!(check(&replayed).is_empty(), "{:?}", check(&replayed));
    // A first delivery after a later row of its aggregate.
    assert_eq!(
        check(&[(1, "a"), (3, "a"), (2, "a"), (4, "b"), (5, "a")]).len(),
        1
    );
    // An older row delivered again after the newest, which is not delivered again:
    // before a new row of the aggregate, and by the end.
    let before_new = [(1, "a"), (3, "a"), (1, "a"), (5, "a"), (2, "b"), (4, "b")];
    let v = check(&before_new);
    assert!(v.len() == 1 && v[0].contains("before row 5 came"), "{v:?}");
    let by_end = [all.as_slice(), &[(3, "a")]].concat();
    let v = check(&by_end);
    assert!(v.len() == 1 && v[0].contains("by the end"), "{v:?}");
}
