//! The command-line surface: every role is a subcommand, and usage errors are reported as such.

use std::process::{Command, Output};

fn outbox_operator(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_outbox-operator"))
        .args(args)
        // `relay --config` falls back to this variable; the tests must not see one.
        .env_remove("OUTBOX_RELAY_CONFIG")
        .output()
        .expect("the outbox-operator binary runs")
}

#[test]
fn help_lists_every_subcommand() {
    let output = outbox_operator(&["--help"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "--help failed: {output:?}");
    for subcommand in ["controller", "relay", "crd", "render", "check"] {
        assert!(
            stdout
                .lines()
                .any(|line| line.trim_start().starts_with(subcommand)),
            "--help does not list `{subcommand}`:\n{stdout}"
        );
    }
}

#[test]
fn relay_without_config_is_a_usage_error() {
    let output = outbox_operator(&["relay"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        stderr.contains("--config"),
        "stderr does not name --config:\n{stderr}"
    );
}

#[test]
fn unimplemented_subcommands_say_which_issue_brings_them() {
    let cases: [(&[&str], &str); 1] = [(
        &["check", "-f", "relay.yaml"],
        "check: not implemented yet (arrives with issue #5)",
    )];
    for (args, message) in cases {
        let output = outbox_operator(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: stderr:\n{stderr}");
        assert_eq!(stderr.trim(), message, "{args:?}");
    }
}

#[test]
fn relay_with_a_missing_config_file_names_it() {
    let output = outbox_operator(&["relay", "--config", "/nonexistent/relay.yaml"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        stderr.contains("cannot read relay config /nonexistent/relay.yaml"),
        "{stderr}"
    );
}
