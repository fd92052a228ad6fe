//! `outbox-operator check -f relay.yaml`: runs the controller's database checks for each
//! OutboxRelay in a manifest against the database whose URL is in the environment, then
//! connects to its broker with the relay's settings and looks for the destination;
//! prints one line per check, with the fix for each failure. Read-only: it creates no
//! slot, publication, topic, stream or exchange.

use std::io::Write;
use std::path::Path;

use kube::ResourceExt;

use crate::Error;
use crate::broker::probe;
use crate::postgres::admin::{self, Plan};
use crate::postgres::redact_url;

/// Default variable holding the database URL, as in the relay's pods.
pub const DEFAULT_URL_ENV: &str = crate::secrets::ENV_DATABASE_URL;

/// `outbox-operator check`'s arguments.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// OutboxRelay manifest to check.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: std::path::PathBuf,
    /// Environment variable holding the database URL.
    #[arg(long, value_name = "VAR", default_value = DEFAULT_URL_ENV)]
    pub database_url_env: String,
}

/// Checks every OutboxRelay in the file at `path`, with the URL from variable `url_env`.
/// Returns whether every check passed; writes the report to `out`.
pub async fn check_file(path: &Path, url_env: &str, out: &mut impl Write) -> Result<bool, Error> {
    let text =
        std::fs::read_to_string(path).map_err(|source| crate::controller::Error::ReadManifest {
            path: path.display().to_string(),
            source,
        })?;
    let documents = crate::render::load_documents(&text, &path.display().to_string())?;
    let url = std::env::var(url_env)
        .ok()
        .filter(|u| !u.trim().is_empty())
        .ok_or_else(|| {
            Error::Check(format!(
                "set {url_env} to the database URL (postgres://user:password@host:5432/db) the relay would use"
            ))
        })?;
    let mut all_ok = true;
    for document in documents {
        let relay = match document {
            crate::render::Document::Relay(relay) => relay,
            crate::render::Document::Refused { name, problems, .. } => {
                // kubectl apply would refuse it: nothing to connect to for it.
                all_ok = false;
                line(
                    out,
                    &format!(
                        "OutboxRelay {name}: does not fit the CRD's schema (kubectl apply would refuse it), not checked against any server"
                    ),
                );
                for problem in &problems {
                    report(out, false, "schema", problem);
                }
                continue;
            }
        };
        let valid = match crate::spec::parse(&relay) {
            Ok(valid) => valid,
            Err(problems) => {
                // The same rules the controller applies: nothing is connected to for a
                // spec it would refuse.
                all_ok = false;
                line(
                    out,
                    &format!(
                        "OutboxRelay {}/{}: invalid spec, not checked against any server",
                        relay.namespace().unwrap_or_default(),
                        relay.name_any()
                    ),
                );
                for problem in &problems.0 {
                    report(out, false, "spec", &problem.to_string());
                }
                continue;
            }
        };
        let plan = Plan::for_relay(&valid);
        line(
            out,
            &format!(
                "OutboxRelay {}/{} ({}) against {}",
                valid.namespace,
                valid.name,
                valid.mode.name(),
                redact_url(&url)
            ),
        );
        all_ok &= check_database(&valid, &plan, &url, url_env, out).await;
        let env = crate::secrets::env_value;
        let probes = match crate::spec::config::read_broker(&valid, &env) {
            Ok(settings) => settings.probe().await,
            Err(err) => vec![probe::Probe {
                name: "broker",
                ok: false,
                message: format!(
                    "{err} (outside a pod, set these variables to the values the relay would get)"
                ),
            }],
        };
        for probe in probes {
            all_ok &= probe.ok;
            report(out, probe.ok, probe.name, &probe.message);
        }
    }
    Ok(all_ok)
}

/// The controller's database checks, one line each; false when one failed.
async fn check_database(
    relay: &crate::spec::ValidRelay,
    plan: &Plan,
    url: &str,
    url_env: &str,
    out: &mut impl Write,
) -> bool {
    let env = crate::secrets::env_value;
    let tls = match crate::postgres::tls::PgTls::from_files(relay, &env) {
        Ok(tls) => tls,
        Err((field, message)) => {
            report(out, false, "tls", &format!("{field}: {message}"));
            return false;
        }
    };
    let client = match crate::postgres::connect(url, url_env, &tls).await {
        Ok(client) => client,
        Err(err) => {
            report(
                out,
                false,
                "connection",
                &format!("{err}; check the URL, the network and pg_hba.conf"),
            );
            return false;
        }
    };
    let facts = match admin::gather(&client, plan).await {
        Ok(facts) => facts,
        Err(err) => {
            report(out, false, "queries", &err.to_string());
            return false;
        }
    };
    let mut all_ok = true;
    for check in admin::evaluate(plan, &facts) {
        all_ok &= check.ok;
        report(out, check.ok, check.name, &check.message);
    }
    all_ok
}

fn report(out: &mut impl Write, ok: bool, name: &str, message: &str) {
    let verdict = if ok { "ok  " } else { "FAIL" };
    line(out, &format!("{verdict}  {name:<12}  {message}"));
}

fn line(out: &mut impl Write, text: &str) {
    // A closed stdout (`check | head`) only loses the report, not the exit code.
    let _ = writeln!(out, "{text}");
}
