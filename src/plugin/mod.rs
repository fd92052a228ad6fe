//! `kubectl outbox`: the kubectl plugin, built from the same binary. Installed (or
//! linked) as `kubectl-outbox` on the `PATH`, kubectl runs it for `kubectl outbox …`
//! (krew's naming); `outbox-operator kubectl …` is the same commands. It talks to the
//! API server of the current kubeconfig context (`KUBECONFIG`, `--context`), as the
//! user running it: every change is a patch the user's RBAC must allow.
//!
//! - `status`: every relay with what its status says (mode, broker, ready and why,
//!   pods, partitions owned, backlog, oldest unpublished event, dead letters, the
//!   slot's retained WAL, the last in-cluster audit's verdict);
//! - `suspend` / `resume`: set `spec.suspend`;
//! - `scale --replicas N`: through the `/scale` subresource, as `kubectl scale` does;
//! - `check`, `audit`, `replay`, `dead-letters NAME [options]`: the tools, run in the
//!   cluster as the relay runs ([`tools`]).

mod tools;

use std::io::Write;

use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::config::KubeConfigOptions;
use serde_json::json;

use crate::Error;
use crate::api::OutboxRelay;

/// `kubectl outbox`'s arguments.
#[derive(Debug, clap::Args)]
pub struct PluginArgs {
    /// The namespace (default: the context's).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// The kubeconfig context (default: the current one).
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: PluginCommand,
}

/// `kubectl outbox`'s commands.
#[derive(Debug, clap::Subcommand)]
pub enum PluginCommand {
    /// Every relay: mode, broker, ready and why, pods, partitions owned, backlog,
    /// oldest unpublished event, dead letters, the slot's retained WAL, last audit.
    Status {
        /// Relays of every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
    /// Stop a relay publishing, keeping its slot and position (`spec.suspend: true`).
    Suspend {
        /// The OutboxRelay.
        name: String,
    },
    /// Let a suspended relay publish again from where it stopped.
    Resume {
        /// The OutboxRelay.
        name: String,
    },
    /// Set a polling relay's pods (the `/scale` subresource).
    Scale {
        /// The OutboxRelay.
        name: String,
        /// Pods wanted.
        #[arg(long)]
        replicas: i32,
    },
    /// Check the relay's database and broker from inside the cluster, with its own
    /// Secrets (as `outbox-operator check`).
    Check(ToolArgs),
    /// Audit a window of the relay's events against its broker, in the cluster (options
    /// as `outbox-operator audit`'s, after the name: --since, --until).
    Audit(ToolArgs),
    /// Publish a window of the relay's events again, in the cluster (options as
    /// `outbox-operator replay`'s, after the name: --since, --ids, --aggregate-id, …).
    Replay(ToolArgs),
    /// List the relay's dead letters, or redrive them (`--redrive all|ID,...`), in the
    /// cluster.
    DeadLetters(ToolArgs),
}

/// A tool run in the cluster against one relay.
#[derive(Debug, clap::Args)]
pub struct ToolArgs {
    /// How long the tool may run before Kubernetes stops it.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = crate::api::duration_arg)]
    pub job_timeout: std::time::Duration,
    /// The OutboxRelay.
    pub name: String,
    /// The tool's own options (as `outbox-operator <tool> --help` lists them, without -f).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub options: Vec<String>,
}

/// The program's file name kubectl finds on the `PATH` for `kubectl outbox`.
pub const PLUGIN_NAME: &str = "kubectl-outbox";

/// The command line as the CLI reads it: run as `kubectl-outbox`, the `kubectl`
/// command's arguments.
pub fn command_line(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let as_plugin = args.first().is_some_and(|program| {
        std::path::Path::new(program)
            .file_stem()
            .is_some_and(|stem| stem == PLUGIN_NAME)
    });
    if as_plugin {
        args.insert(1, "kubectl".into());
    }
    args
}

fn failed(what: impl std::fmt::Display) -> Error {
    Error::Plugin(what.to_string())
}

/// The API server's own words for a refusal (a CEL rule's message, a missing
/// permission), without the client's wrapping.
fn refused(err: kube::Error) -> Error {
    match err {
        kube::Error::Api(status) => failed(status.message),
        other => failed(other),
    }
}

/// Runs a `kubectl outbox` command; writes its output to `out`. Returns the exit status:
/// 0, or a tool's own (1 when it found something wrong, 2 when it could not tell).
pub async fn run(args: &PluginArgs, out: &mut impl Write) -> Result<u8, Error> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = kube::Config::from_kubeconfig(&options)
        .await
        .map_err(|e| failed(format!("reading the kubeconfig: {e}")))?;
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config).map_err(failed)?;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), &namespace);
    let text = match &args.command {
        PluginCommand::Status { all_namespaces } => {
            let api = if *all_namespaces {
                Api::all(client)
            } else {
                relays
            };
            let mut list = api
                .list(&ListParams::default())
                .await
                .map_err(refused)?
                .items;
            list.sort_by(|a, b| {
                (&a.metadata.namespace, &a.metadata.name)
                    .cmp(&(&b.metadata.namespace, &b.metadata.name))
            });
            if list.is_empty() {
                format!(
                    "No OutboxRelays found{}.\n",
                    if *all_namespaces {
                        String::new()
                    } else {
                        format!(" in namespace {namespace}")
                    }
                )
            } else {
                status_table(&list, *all_namespaces)
            }
        }
        PluginCommand::Suspend { name } | PluginCommand::Resume { name } => {
            let suspend = matches!(args.command, PluginCommand::Suspend { .. });
            relays
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"suspend": suspend}})),
                )
                .await
                .map_err(refused)?;
            format!(
                "outboxrelay.outbox.dev/{name} {}\n",
                if suspend { "suspended" } else { "resumed" }
            )
        }
        PluginCommand::Scale { name, replicas } => {
            relays
                .patch_scale(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": replicas}})),
                )
                .await
                .map_err(refused)?;
            format!("outboxrelay.outbox.dev/{name} scaled to {replicas}\n")
        }
        PluginCommand::Check(tool)
        | PluginCommand::Audit(tool)
        | PluginCommand::Replay(tool)
        | PluginCommand::DeadLetters(tool) => {
            let command = match &args.command {
                PluginCommand::Check(_) => "check",
                PluginCommand::Audit(_) => "audit",
                PluginCommand::Replay(_) => "replay",
                _ => "dead-letters",
            };
            let (job, ended) = tools::run_tool(
                &client,
                &namespace,
                &tool.name,
                command,
                &tool.options,
                tool.job_timeout,
            )
            .await?;
            let _ = out.write_all(ended.report.as_bytes());
            if !ended.report.ends_with('\n') {
                let _ = out.write_all(b"\n");
            }
            eprintln!("{}", tools::epilogue(&job, &ended));
            return Ok(tools::exit_status(ended.exit_code));
        }
    };
    // A closed stdout (`| head`) only loses the output.
    let _ = out.write_all(text.as_bytes());
    Ok(0)
}

/// Bytes for people: `512B`, `3.2MiB`, `1.0GiB`.
fn bytes(n: i64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n}B");
    }
    #[allow(clippy::cast_precision_loss)]
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1}{}", UNITS[unit])
}

/// The `status` table: one line per relay, columns aligned, `-` where the status says
/// nothing yet.
pub fn status_table(relays: &[OutboxRelay], with_namespace: bool) -> String {
    let dash = || "-".to_owned();
    let mut rows = vec![
        [
            "NAMESPACE",
            "NAME",
            "MODE",
            "BROKER",
            "READY",
            "REASON",
            "PODS",
            "PARTITIONS",
            "BACKLOG",
            "OLDEST",
            "DEAD-LETTERS",
            "RETAINED-WAL",
            "LAST-AUDIT",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for relay in relays {
        let status = relay.status.as_ref();
        let ready = status.and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
        let slot = status.and_then(|s| s.slot.as_ref());
        rows.push(vec![
            relay.metadata.namespace.clone().unwrap_or_else(dash),
            relay.metadata.name.clone().unwrap_or_else(dash),
            status.and_then(|s| s.mode.clone()).unwrap_or_else(dash),
            status.and_then(|s| s.broker.clone()).unwrap_or_else(dash),
            ready.map_or_else(dash, |c| c.status.clone()),
            ready.map_or_else(dash, |c| c.reason.clone()),
            status
                .and_then(|s| s.replicas)
                .map_or_else(dash, |n| n.to_string()),
            status
                .and_then(|s| s.partitions.as_ref())
                .map_or_else(dash, |p| format!("{}/{}", p.owned, p.desired)),
            status
                .and_then(|s| s.backlog_rows)
                .map_or_else(dash, |n| n.to_string()),
            status
                .and_then(|s| s.oldest_unpublished_age.clone())
                .unwrap_or_else(dash),
            status
                .and_then(|s| s.dead_letter_rows)
                .map_or_else(dash, |n| n.to_string()),
            slot.and_then(|s| s.retained_wal_bytes)
                .map_or_else(dash, bytes),
            status
                .and_then(|s| s.last_audit.as_ref())
                .map_or_else(dash, |a| a.verdict.clone()),
        ]);
    }
    let skip = usize::from(!with_namespace);
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut text = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .skip(skip)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        text.push_str(cells.join("   ").trim_end());
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Line {
        #[command(flatten)]
        plugin: PluginArgs,
    }

    #[test]
    fn a_tools_options_follow_its_relay_and_the_plugins_stay_the_plugins() {
        use clap::Parser;
        let line = Line::try_parse_from([
            "kubectl-outbox",
            "audit",
            "orders",
            "-n",
            "shop",
            "--since",
            "1h",
            "--until",
            "0s",
        ])
        .unwrap();
        let PluginCommand::Audit(tool) = &line.plugin.command else {
            panic!("{line:?}");
        };
        assert_eq!(tool.name, "orders");
        assert_eq!(tool.options, ["--since", "1h", "--until", "0s"]);
        assert_eq!(line.plugin.namespace.as_deref(), Some("shop"));
        let line = Line::try_parse_from([
            "kubectl-outbox",
            "replay",
            "orders",
            "--job-timeout",
            "5m",
            "--ids",
            "1,2",
        ])
        .unwrap();
        let PluginCommand::Replay(tool) = &line.plugin.command else {
            panic!("{line:?}");
        };
        assert_eq!(tool.job_timeout, std::time::Duration::from_secs(300));
        assert_eq!(tool.options, ["--ids", "1,2"]);
    }

    #[test]
    fn run_as_kubectl_outbox_it_takes_the_kubectl_commands() {
        let line = |args: &[&str]| {
            command_line(args.iter().map(std::ffi::OsString::from))
                .into_iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            line(&["/usr/local/bin/kubectl-outbox", "status", "-A"]),
            ["/usr/local/bin/kubectl-outbox", "kubectl", "status", "-A"]
        );
        assert_eq!(
            line(&["outbox-operator", "crd"]),
            ["outbox-operator", "crd"]
        );
    }

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(bytes(512), "512B");
        assert_eq!(bytes(3 * 1024 * 1024 + 200 * 1024), "3.2MiB");
        assert_eq!(bytes(1 << 30), "1.0GiB");
    }

    #[test]
    fn a_relay_without_status_shows_dashes() {
        let relay: OutboxRelay = serde_yaml::from_str(
            "apiVersion: outbox.dev/v1alpha1
kind: OutboxRelay
metadata: {name: orders, namespace: shop}
spec:
  database: {postgres: {connectionSecretRef: {name: db}}}
  mode: {polling: {}}
  broker: {nats: {url: \"nats://n:4222\"}}
",
        )
        .unwrap();
        assert_eq!(
            status_table(&[relay], false),
            "NAME     MODE   BROKER   READY   REASON   PODS   PARTITIONS   BACKLOG   OLDEST   DEAD-LETTERS   RETAINED-WAL   LAST-AUDIT\n\
             orders   -      -        -       -        -      -            -         -        -              -              -\n"
        );
    }
}
