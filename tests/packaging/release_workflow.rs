//! The release workflow (.github/workflows/release.yml) cannot run here: it is linted
//! with actionlint (shellcheck on its shell steps), its shape is checked against what a
//! release must do, and the steps that need no GitHub run for real: `make
//! release-check` (the tag, Cargo.toml, the chart and the changelog agree) and `make
//! chart-package`, whose package `helm template` renders with the release's image.

use crate::chart_common;
use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn workflow_path() -> PathBuf {
    repo().join(".github/workflows/release.yml")
}

fn workflow() -> Value {
    serde_yaml::from_str(&std::fs::read_to_string(workflow_path()).unwrap()).unwrap()
}

fn actionlint(path: &Path) -> std::process::Output {
    common::run_tool(common::Rig::load().actionlint(), &[path.to_str().unwrap()])
}

/// Every step of `job`.
fn steps<'a>(wf: &'a Value, job: &str) -> &'a Vec<Value> {
    wf["jobs"][job]["steps"]
        .as_sequence()
        .unwrap_or_else(|| panic!("the workflow has no job {job} with steps"))
}

fn uses<'a>(wf: &'a Value, job: &str, action: &str) -> &'a Value {
    steps(wf, job)
        .iter()
        .find(|s| s["uses"].as_str().is_some_and(|u| u.starts_with(action)))
        .unwrap_or_else(|| panic!("job {job} does not use {action}"))
}

fn runs(wf: &Value, job: &str) -> String {
    steps(wf, job)
        .iter()
        .filter_map(|s| s["run"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

fn make(args: &[&str]) -> std::process::Output {
    Command::new("make")
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("make: {e}"))
}

#[test]
fn the_workflow_passes_actionlint_and_a_broken_one_does_not() {
    let output = actionlint(&workflow_path());
    assert!(
        output.status.success(),
        "actionlint: {}",
        common::describe_output(&output)
    );
    // The linter is not a formality: an input the action does not have, and a shell
    // step quoting wrongly, are both caught.
    let broken = std::fs::read_to_string(workflow_path())
        .unwrap()
        .replace("sbom: true", "sbom: true\n          platform: linux/amd64")
        .replace(
            r#"run: cosign sign --yes "${IMAGE}@${DIGEST}""#,
            "run: cosign sign --yes $IMAGE@$DIGEST",
        );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("release.yml");
    std::fs::write(&path, broken).unwrap();
    let output = actionlint(&path);
    let report = common::describe_output(&output);
    assert!(
        !output.status.success(),
        "actionlint passed a broken workflow"
    );
    assert!(
        report.contains("platform") && report.contains("SC2086"),
        "actionlint missed a mistake: {report}"
    );
}

#[test]
fn a_tag_builds_tests_signs_and_publishes_image_and_chart() {
    let wf = workflow();
    let tags: Vec<&str> = wf["on"]["push"]["tags"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(tags, ["v*.*.*"]);
    // The whole suite first, after the tag's version is checked.
    let test = runs(&wf, "test");
    assert!(
        test.contains("make release-check") && test.contains("make test"),
        "{test}"
    );
    // The image: the Dockerfile, both architectures, SBOM and provenance, pushed.
    assert_eq!(wf["jobs"]["image"]["needs"], "test");
    let build = &uses(&wf, "image", "docker/build-push-action")["with"];
    assert_eq!(build["file"], "Dockerfile");
    assert_eq!(build["platforms"], "linux/amd64,linux/arm64");
    assert_eq!(build["sbom"], true);
    assert_eq!(build["push"], true);
    assert!(
        build["provenance"]
            .as_str()
            .is_some_and(|p| p.contains("max"))
    );
    // Keyless: the job's OIDC token, and no key anywhere.
    for job in ["image", "chart"] {
        assert_eq!(wf["jobs"][job]["permissions"]["id-token"], "write", "{job}");
        let run = runs(&wf, job);
        assert!(
            run.contains("cosign sign --yes") && !run.contains("--key"),
            "{job}: {run}"
        );
    }
    // The chart: packaged by the same make target as here, pushed as OCI.
    let chart = runs(&wf, "chart");
    assert!(
        chart.contains("make chart-package") && chart.contains("helm push"),
        "{chart}"
    );
    assert!(
        wf["env"]["CHARTS"]
            .as_str()
            .is_some_and(|c| c.starts_with("oci://")),
        "{:?}",
        wf["env"]
    );
    // The image the workflow pushes is the one the chart installs by default.
    assert_eq!(wf["env"]["IMAGE"], "ghcr.io/${{ github.repository }}");
    let values: Value = serde_yaml::from_str(
        &std::fs::read_to_string(repo().join("charts/outbox-operator/values.yaml")).unwrap(),
    )
    .unwrap();
    let repository = env!("CARGO_PKG_REPOSITORY")
        .strip_prefix("https://github.com/")
        .unwrap();
    assert_eq!(
        values["image"]["repository"].as_str(),
        Some(format!("ghcr.io/{repository}").as_str())
    );
}

#[test]
fn release_check_holds_the_tag_to_the_versions_and_the_changelog() {
    let version = env!("CARGO_PKG_VERSION");
    let ok = make(&[
        "--no-print-directory",
        "release-check",
        &format!("TAG=v{version}"),
    ]);
    assert!(ok.status.success(), "{}", common::describe_output(&ok));
    let wrong = make(&["--no-print-directory", "release-check", "TAG=v99.0.0"]);
    let report = common::describe_output(&wrong);
    assert!(
        !wrong.status.success() && report.contains("is not v"),
        "a tag that names another version passed: {report}"
    );
}

#[test]
fn the_packaged_chart_installs_the_release_image() {
    let version = env!("CARGO_PKG_VERSION");
    let dir = tempfile::tempdir().unwrap();
    let helm = common::Rig::load().helm().to_str().unwrap().to_owned();
    let output = make(&[
        "--no-print-directory",
        "chart-package",
        &format!("HELM={helm}"),
        &format!("DIST={}", dir.path().display()),
    ]);
    assert!(
        output.status.success(),
        "{}",
        common::describe_output(&output)
    );
    let package = dir.path().join(format!("outbox-operator-{version}.tgz"));
    assert!(package.exists(), "no {}", package.display());
    let rendered = chart_common::expect_success(
        "helm template of the package",
        chart_common::helm(&["template", "rel", package.to_str().unwrap()]),
    );
    let deployment = chart_common::documents(&rendered)
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .unwrap();
    let image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(image.ends_with(&format!(":{version}")), "{image}");
}
