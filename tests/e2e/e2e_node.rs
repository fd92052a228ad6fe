//! The rig's real node: kubelet 1.37 (from the API server's release) on containerd 2 with
//! runc, and the operator's image assembled from the binary under test
//! (`tests/rig/image.sh`, buildah from scratch, nothing pulled): the image agrees with
//! the Dockerfile's runtime stage. The relay pods of the end-to-end tests run from it
//! on the node (tests/common/node.rs).

use crate::common;

use std::path::Path;

use serde_json::{Value, json};

/// The runtime stage of the Dockerfile: its `USER`, `ENTRYPOINT`, `CMD` and `EXPOSE`,
/// and the title label.
fn dockerfile_runtime() -> (String, Value, Value, String, String) {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile"))
        .unwrap_or_else(|e| panic!("Dockerfile: {e}"));
    let stage = text
        .rsplit_once("\nFROM ")
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("no runtime stage in the Dockerfile"));
    let directive = |name: &str| {
        stage
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {name} in the Dockerfile's runtime stage"))
            .to_owned()
    };
    let title = stage
        .split("org.opencontainers.image.title=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or_else(|| panic!("no title label in the Dockerfile"))
        .to_owned();
    (
        directive("USER"),
        serde_json::from_str(&directive("ENTRYPOINT")).unwrap(),
        serde_json::from_str(&directive("CMD")).unwrap(),
        directive("EXPOSE"),
        title,
    )
}

#[test]
fn the_rig_image_agrees_with_the_dockerfile() {
    let (_, inspect) = common::node::operator_image();
    let config = &inspect["OCIv1"]["config"];
    let (user, entrypoint, cmd, expose, title) = dockerfile_runtime();
    assert_eq!(config["User"], json!(user), "user: {config}");
    assert_eq!(config["Entrypoint"], entrypoint, "entrypoint: {config}");
    assert_eq!(config["Cmd"], cmd, "cmd: {config}");
    assert!(
        config["ExposedPorts"]
            .as_object()
            .is_some_and(|p| p.contains_key(&format!("{expose}/tcp"))),
        "exposed ports: {config}"
    );
    assert_eq!(
        config["Labels"]["org.opencontainers.image.title"],
        json!(title)
    );
}
