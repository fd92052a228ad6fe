//! `outbox-operator dead-letters -f relay.yaml`: lists a relay's dead-lettered rows, and
//! with `--redrive` moves them (all, or the ids given) back into the outbox table with
//! their ids, once whatever refused them is fixed. The relay then publishes them as the
//! same messages (same message id, so consumers that deduplicate stay correct), in both
//! modes: polling selects them, log tailing streams the insert. A redriven event goes
//! out after the newer events of its aggregate that were published meanwhile: the
//! dead-letter policy already let those pass it.

use std::io::Write;
use std::path::PathBuf;

use crate::Error;
use crate::postgres::RowId;
use crate::postgres::table::OutboxTable;
use crate::spec::ValidRelay;

/// `outbox-operator dead-letters`'s arguments.
#[derive(Debug, clap::Args)]
pub struct DeadLetterArgs {
    /// OutboxRelay manifest whose dead-letter table to read.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: PathBuf,
    /// Environment variable holding the database URL.
    #[arg(long, value_name = "VAR", default_value = crate::secrets::ENV_DATABASE_URL)]
    pub database_url_env: String,
    /// Move rows back into the outbox table: `all`, or ids separated by commas.
    #[arg(long, value_name = "all|ID,...")]
    pub redrive: Option<String>,
    /// Rows listed at most.
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
}

/// Which rows `--redrive` names: every one, or these ids (as text; the table's id kind
/// reads them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Redrive {
    /// Every dead-lettered row.
    All,
    /// These ids.
    Ids(Vec<String>),
}

/// Reads `--redrive`'s value.
pub fn redrive_of(text: &str) -> Result<Redrive, String> {
    if text.trim() == "all" {
        return Ok(Redrive::All);
    }
    let ids: Vec<String> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    if ids.is_empty() {
        return Err("--redrive takes `all` or ids separated by commas".to_owned());
    }
    Ok(Redrive::Ids(ids))
}

/// Lists (and with `--redrive`, moves back) the dead-lettered rows of every OutboxRelay
/// in the manifest; writes the report to `out`.
pub async fn dead_letters_file(args: &DeadLetterArgs, out: &mut impl Write) -> Result<(), Error> {
    let redrive = args
        .redrive
        .as_deref()
        .map(redrive_of)
        .transpose()
        .map_err(Error::DeadLetters)?;
    let url =
        crate::secrets::database_url_from(&args.database_url_env).map_err(Error::DeadLetters)?;
    for valid in crate::render::parsed_relays(&args.file)? {
        one_relay(&valid, &url, args, redrive.as_ref(), out).await?;
    }
    Ok(())
}

async fn one_relay(
    valid: &ValidRelay,
    url: &str,
    args: &DeadLetterArgs,
    redrive: Option<&Redrive>,
    out: &mut impl Write,
) -> Result<(), Error> {
    let who = format!("OutboxRelay {}/{}", valid.namespace, valid.name);
    let fail = |what: String| Error::DeadLetters(format!("{who}: {what}"));
    let dead_letter_table = valid.dead_letter_table();
    let client = crate::postgres::connect_for(valid, url, &args.database_url_env)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let table = OutboxTable::of_relay(&client, valid)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let mut lines = Vec::new();
    if let Some(redrive) = redrive {
        let ids: Option<Vec<RowId>> = match redrive {
            Redrive::All => None,
            Redrive::Ids(ids) => Some(
                ids.iter()
                    .map(|id| match id.parse::<i64>() {
                        Ok(n) if table.has_int_ids() => RowId::Int(n),
                        _ => RowId::Text(id.as_str().into()),
                    })
                    .collect(),
            ),
        };
        let moved = table
            .redrive(&client, ids.as_deref())
            .await
            .map_err(|e| fail(e.to_string()))?;
        lines.push(format!(
            "{who}: {} from {} into the outbox table; the relay publishes them again with their ids",
            crate::report::moved_back(moved),
            dead_letter_table
        ));
    }
    let rows = table
        .dead_letters(&client, args.limit)
        .await
        .map_err(|e| fail(e.to_string()))?;
    lines.push(format!("{who}: {} rows in {dead_letter_table}", rows.len()));
    for row in rows {
        lines.push(format!(
            "  {}  aggregate {}  at {}  {}",
            row.id, row.aggregate_id, row.at, row.reason
        ));
    }
    for line in lines {
        // A closed stdout only loses the report, not the exit code.
        let _ = writeln!(out, "{line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redrive_names_all_or_ids() {
        assert_eq!(redrive_of("all"), Ok(Redrive::All));
        assert_eq!(
            redrive_of("12, 13,,a1b2"),
            Ok(Redrive::Ids(vec!["12".into(), "13".into(), "a1b2".into()]))
        );
        assert!(redrive_of(" , ").is_err());
    }
}
