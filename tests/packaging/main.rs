//! What ships besides the binary's behaviour: the Helm chart (lint, dry-run apply,
//! install, RBAC), the rendered alerts (promtool and the rig's Prometheus), `render`
//! and its golden files, the command-line surface and the generated reference (docs/reference.md), the docs book.
//!
//! One test binary per area (see tests/smoke/main.rs). Run one file's tests with e.g.
//! `cargo test --test packaging render_golden`.

#[path = "../common/mod.rs"]
mod common;

#[path = "../chart_common/mod.rs"]
mod chart_common;

mod alerts_prometheus;
mod alerts_rules;
mod alerts_stack;
mod chart_apply;
mod chart_install;
mod chart_lint;
mod chart_rbac_controller;
mod chart_relay_pods;
mod cli;
mod code_layers;
mod crd_explain;
mod docs_book;
mod docs_reference;
mod image_libraries;
mod release_workflow;
mod render_cli;
mod render_golden;
