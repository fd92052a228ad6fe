//! `kubectl outbox` as kubectl runs it: the binary under test linked as `kubectl-outbox`
//! on the `PATH` of the rig's real kubectl, with the rig's kubeconfig.

use std::process::Output;

use super::Rig;

/// Runs `kubectl outbox <args>` through the rig's kubectl.
pub fn kubectl_outbox(args: &[&str]) -> Output {
    let rig = Rig::load();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        super::operator::operator_binary(),
        dir.path().join("kubectl-outbox"),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    std::process::Command::new(rig.get("OUTBOX_RIG_KUBECTL"))
        .arg("outbox")
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", rig.kubeconfig())
        .output()
        .unwrap()
}

/// Its stdout, once it exited with `code`; else a panic with what it printed.
pub fn exited(output: &Output, code: i32) -> String {
    assert_eq!(
        output.status.code(),
        Some(code),
        "{}",
        super::describe_output(output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
