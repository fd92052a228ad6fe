//! `kubectl explain` on the installed CRD says what an OutboxRelay is, and a field's
//! own description, not kube-derive's placeholder for the root type.

use crate::chart_common::{expect_success, kubectl};
use crate::common;

#[tokio::test]
async fn kubectl_explain_describes_the_resource_and_its_fields() {
    let client = common::kube_client().await;
    common::install_outbox_crd(&client).await;
    // The API server publishes a new or changed CRD's schema a moment after it is
    // established: explain is asked until it shows this one (a minute at most).
    let explain = || {
        let output = kubectl(&["explain", "outboxrelays"]);
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    common::wait_for_some_or(
        "kubectl explain outboxrelays to describe the resource",
        std::time::Duration::from_secs(60),
        || format!("\nit printed:\n{}", explain()),
        || async {
            explain()
                .contains("An OutboxRelay publishes every committed row")
                .then_some(())
        },
    )
    .await;
    assert!(!explain().contains("Auto-generated"), "{}", explain());
    let field = expect_success(
        "kubectl explain obr.spec.table.archive",
        kubectl(&["explain", "obr.spec.table.archive"]),
    );
    assert!(
        field.contains("Where published rows go instead of being deleted"),
        "{field}"
    );
}
