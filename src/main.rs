//! Command-line entry point: parses arguments and dispatches to the library; no logic lives here.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use outbox_operator::Error;

/// Runs transactional-outbox relays from PostgreSQL to Kafka, NATS JetStream or RabbitMQ.
#[derive(Debug, Parser)]
#[command(name = "outbox-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the operator: watch OutboxRelay resources and reconcile them.
    Controller(outbox_operator::controller::ControllerArgs),
    /// Run the data plane inside a relay pod.
    Relay {
        /// Relay configuration file (rendered by the operator into a ConfigMap).
        #[arg(long, value_name = "FILE", env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
    },
    /// Print the CustomResourceDefinitions (OutboxRelay, OutboxReplay) as YAML.
    Crd {
        /// Only this one.
        #[arg(long, value_parser = outbox_operator::render::CRD_KINDS)]
        kind: Option<String>,
    },
    /// Print every object the operator would create for a manifest, offline; or, with
    /// --from-debezium, the OutboxRelay equivalent to a Debezium connector.
    Render {
        /// OutboxRelay manifest to render.
        #[arg(
            short = 'f',
            long = "file",
            value_name = "FILE",
            required_unless_present = "from_debezium"
        )]
        file: Option<PathBuf>,
        #[command(flatten)]
        options: outbox_operator::resources::BuildOptions,
        /// A Debezium PostgreSQL connector running the outbox event router (Kafka
        /// Connect JSON, or Debezium Server application.properties): print the
        /// equivalent OutboxRelay, with what changes as comments.
        #[arg(long, value_name = "FILE", conflicts_with = "file")]
        from_debezium: Option<PathBuf>,
        /// Name of the translated OutboxRelay (default: the connector's name).
        #[arg(long, requires = "from_debezium")]
        name: Option<String>,
        /// Namespace of the translated OutboxRelay.
        #[arg(long, requires = "from_debezium")]
        namespace: Option<String>,
        /// Kafka bootstrap servers, when the connector file has none (Kafka Connect
        /// keeps them in the worker's configuration).
        #[arg(long, requires = "from_debezium")]
        bootstrap_servers: Option<String>,
    },
    /// Prove a window of events reached the broker: every row the relay published in
    /// it delivered, each aggregate in order (exit 1 otherwise); redeliveries counted.
    Audit(outbox_operator::audit::AuditArgs),
    /// List a relay's dead-lettered rows; with --redrive, move them back into the outbox
    /// table with their ids, so the relay publishes them again.
    DeadLetters(outbox_operator::dead_letters::DeadLetterArgs),
    /// Publish a window of a relay's published events again (a time range, ids,
    /// aggregates, types), with their ids and the header outbox-replay, at a rate limit.
    Replay(outbox_operator::replay::ReplayArgs),
    /// The kubectl plugin's commands (status, suspend, resume, scale): linked or
    /// installed as kubectl-outbox on the PATH, `kubectl outbox <command>` runs them.
    Kubectl(outbox_operator::plugin::PluginArgs),
    /// Connect to the database a manifest's relay would use and report what is missing
    /// (wal_level, replication, free slots, table, columns, privileges), one line each.
    Check(outbox_operator::check::CheckArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(outbox_operator::plugin::command_line(std::env::args_os()));
    outbox_operator::install_crypto_provider();
    let result = match cli.command {
        Command::Controller(args) => run_controller(args),
        Command::Relay { config } => runtime()
            .block_on(outbox_operator::relay::run(&config))
            .inspect_err(outbox_operator::relay::leave_termination_message)
            .map_err(Error::from),
        Command::Crd { kind } => outbox_operator::render::crd_yaml(kind.as_deref())
            .map(|yaml| print_out(&yaml))
            .map_err(Error::from),
        Command::Render {
            from_debezium: Some(path),
            name,
            namespace,
            bootstrap_servers,
            ..
        } => {
            let options = outbox_operator::debezium::Options {
                name,
                namespace,
                bootstrap_servers,
            };
            outbox_operator::render::from_debezium(&path, &options)
                .map(|yaml| print_out(&yaml))
                .map_err(Error::from)
        }
        Command::Render { file, options, .. } => {
            let file = file.unwrap_or_default();
            outbox_operator::render::render_file(&file, &options)
                .map(|yaml| print_out(&yaml))
                .map_err(Error::from)
        }
        Command::Audit(args) => {
            return tool(|out| runtime().block_on(outbox_operator::audit::audit_file(&args, out)));
        }
        Command::DeadLetters(args) => {
            return tool(|out| {
                runtime()
                    .block_on(outbox_operator::dead_letters::dead_letters_file(&args, out))
                    .map(|()| true)
            });
        }
        Command::Replay(args) => {
            return tool(|out| {
                runtime().block_on(outbox_operator::replay::replay_file(&args, out))
            });
        }
        Command::Check(args) => {
            return tool(|out| {
                runtime().block_on(outbox_operator::check::check_file(
                    &args.file,
                    &args.database_url_env,
                    out,
                ))
            });
        }
        Command::Kubectl(args) => {
            return match runtime().block_on(outbox_operator::plugin::run(
                &args,
                &mut std::io::stdout().lock(),
            )) {
                Ok(code) => ExitCode::from(code),
                Err(err) => finish(Err(err)),
            };
        }
    };
    finish(result)
}

/// The async runtime. Without one nothing can run at all; main is the one place allowed
/// to stop so.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().expect("cannot start the tokio runtime")
}

fn run_controller(args: outbox_operator::controller::ControllerArgs) -> Result<(), Error> {
    outbox_operator::telemetry::init_logging();
    runtime().block_on(async move {
        let client = kube::Client::try_default()
            .await
            .map_err(outbox_operator::controller::Error::from)?;
        let metrics = std::sync::Arc::new(outbox_operator::controller::Metrics::new());
        outbox_operator::controller::run(
            client,
            args,
            metrics,
            outbox_operator::controller::shutdown_signal(),
        )
        .await?;
        Ok(())
    })
}

/// Runs a tool that reports on stdout: the report (and an error after it) is also left
/// as the container's termination message when run in a pod (a Job `kubectl outbox`
/// made), so it reads from the pod's status. Exit 0 when the tool found nothing wrong,
/// 1 with findings (the report says them), 2 on an error (it could not tell).
fn tool(
    run: impl FnOnce(
        &mut outbox_operator::report::Tee<std::io::StdoutLock<'static>>,
    ) -> Result<bool, Error>,
) -> ExitCode {
    let mut out = outbox_operator::report::Tee::new(std::io::stdout().lock());
    let result = run(&mut out);
    out.leave(result.as_ref().err().map(ToString::to_string).as_deref());
    match result {
        Ok(true) => ExitCode::SUCCESS,
        // Findings are the report, not a usage error.
        Ok(false) => ExitCode::from(1),
        Err(err) => finish(Err(err)),
    }
}

/// Writes to stdout; a closed pipe (`crd | head`) is not an error worth a panic.
fn print_out(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(err) = out.write_all(text.as_bytes()).and_then(|()| out.flush())
        && err.kind() != std::io::ErrorKind::BrokenPipe
    {
        eprintln!("cannot write to stdout: {err}");
        std::process::exit(1);
    }
}

fn finish(result: Result<(), Error>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{err}");
            ExitCode::from(2)
        }
    }
}
