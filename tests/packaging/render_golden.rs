//! Golden files: `render` of every example manifest (each mode × broker) matches
//! tests/golden/<example>.yaml. Regenerate with `UPDATE_GOLDEN=1 cargo test --test packaging render_golden`.

use std::path::{Path, PathBuf};

use outbox_operator::render::render_file;
use outbox_operator::resources::BuildOptions;

/// A fixed image, so the golden files do not change with the crate version.
fn options() -> BuildOptions {
    BuildOptions {
        relay_image: "ghcr.io/outbox-operator/outbox-operator:golden".to_owned(),
        ..BuildOptions::default()
    }
}

fn examples() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_example_renders_as_its_golden_file() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1");
    let golden_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut mismatches = Vec::new();
    let examples = examples();
    for example in &examples {
        let rendered = render_file(example, &options())
            .unwrap_or_else(|e| panic!("{} does not render: {e}", example.display()));
        let golden = golden_dir.join(example.file_name().unwrap());
        if update {
            std::fs::write(&golden, &rendered).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&golden).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; create it with UPDATE_GOLDEN=1 cargo test --test packaging render_golden",
                golden.display()
            )
        });
        if expected != rendered {
            mismatches.push(golden.display().to_string());
        }
    }
    assert!(
        mismatches.is_empty(),
        "rendered output differs from {mismatches:?}; review the change and regenerate with UPDATE_GOLDEN=1 cargo test --test packaging render_golden"
    );
}

#[test]
fn examples_cover_every_mode_and_broker() {
    let names: Vec<String> = examples()
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    for mode in ["polling", "log-tailing"] {
        for broker in ["kafka", "nats", "rabbitmq"] {
            let name = format!("{mode}-{broker}");
            assert!(names.contains(&name), "examples/{name}.yaml is missing");
        }
    }
}
