//! Telling a real PostgreSQL session from one lent by a connection pooler in
//! transaction or statement mode (PgBouncer's `pool_mode = transaction`).
//!
//! Polling relays own their partitions with session advisory locks, and a batch runs
//! on the session that holds them (see the publisher's module documentation). Behind
//! such a pooler, consecutive statements of one client connection may run on different
//! server sessions, and one server session serves many clients in turn: a lock is held
//! by whichever session happened to run the statement, released by nobody, and fences
//! nothing. The relay and the operator therefore look before they trust a URL: two
//! connections each ask for their backend's process id, and one of them sets a session
//! setting and reads it back. Each connection keeping its own backend and setting is a
//! session; anything else is a pooler lending sessions per transaction. Only the simple
//! query protocol is used, so the probe works where a pooler breaks prepared
//! statements.

use std::time::{SystemTime, UNIX_EPOCH};

use tokio_postgres::{Client, SimpleQueryMessage};

use super::admin::quote_literal;
use super::{PgError, db};

/// The placeholder setting the probe writes (a custom `outbox.*` class: nothing reads
/// it).
const SETTING: &str = "outbox.session_probe";

/// What one connection's statement ran on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `pg_backend_pid()`.
    pub backend: String,
    /// The probe setting as that backend has it.
    pub setting: Option<String>,
}

/// The verdict on three statements: `a` set the token, `b` then read, `a` read again.
/// `None` when each connection kept its own session; otherwise what gave the pooler
/// away, in words that are the same at every start (no backend PIDs): a relay that
/// refuses to run leaves it in its pod's status, which should not change at each restart.
pub fn verdict(token: &str, a_set: &Seen, b_read: &Seen, a_read: &Seen) -> Option<String> {
    if b_read.backend == a_set.backend {
        return Some("two connections were served by one server session".to_owned());
    }
    if a_read.backend != a_set.backend {
        return Some("one connection's statements ran on two server sessions".to_owned());
    }
    if b_read.setting.as_deref() == Some(token) {
        return Some("a session setting of one connection showed on another".to_owned());
    }
    if a_read.setting.as_deref() != Some(token) {
        return Some(
            "a session setting did not survive to the connection's next statement".to_owned(),
        );
    }
    None
}

/// Probes two connections of the same URL (see the module documentation). `Ok(None)`:
/// real sessions; `Ok(Some(why))`: a pooler lends sessions per transaction.
pub async fn pooled_sessions(a: &Client, b: &Client) -> Result<Option<String>, PgError> {
    // Other clients of a busy pooler can hand the sessions around so that one round
    // looks like two sessions of their own; a few rounds (each with a new token) make
    // that unlikely.
    for round in 0..ROUNDS {
        if let Some(why) = probe_once(a, b, round).await? {
            return Ok(Some(why));
        }
    }
    Ok(None)
}

/// Probe rounds per check.
const ROUNDS: u32 = 3;

async fn probe_once(a: &Client, b: &Client, round: u32) -> Result<Option<String>, PgError> {
    let token = format!(
        "{}-{round}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let a_set = ask(
        a,
        &format!(
            "SELECT pg_backend_pid()::text, set_config('{SETTING}', {}, false)",
            quote_literal(&token)
        ),
    )
    .await?;
    let read = format!("SELECT pg_backend_pid()::text, current_setting('{SETTING}', true)");
    let b_read = ask(b, &read).await?;
    let a_read = ask(a, &read).await?;
    Ok(verdict(&token, &a_set, &b_read, &a_read))
}

async fn ask(client: &Client, sql: &str) -> Result<Seen, PgError> {
    let messages = client
        .simple_query(sql)
        .await
        .map_err(db("probing whether the connection keeps its session"))?;
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(Seen {
                backend: row.get(0).unwrap_or_default().to_owned(),
                setting: row.get(1).filter(|s| !s.is_empty()).map(str::to_owned),
            }),
            _ => None,
        })
        .ok_or_else(|| PgError::Replication("the session probe returned no row".to_owned()))
}

/// The refusal, for the relay's log and the operator's condition.
pub fn refusal(why: &str) -> String {
    format!(
        "the database URL reaches a connection pooler that lends sessions per transaction or statement (PgBouncer pool_mode=transaction or statement): {why}. The relay owns its partitions with session advisory locks, which such a pooler neither keeps nor fences, and log tailing needs a replication session: point the URL at PostgreSQL itself, or at a pool in session mode"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(backend: &str, setting: Option<&str>) -> Seen {
        Seen {
            backend: backend.into(),
            setting: setting.map(str::to_owned),
        }
    }

    #[test]
    fn sessions_of_their_own_pass_and_every_sign_of_pooling_is_named() {
        let t = "tok";
        assert_eq!(
            verdict(
                t,
                &seen("1", Some(t)),
                &seen("2", None),
                &seen("1", Some(t))
            ),
            None
        );
        // Transaction pooling handing the idle session to the next client (LIFO).
        let shared = verdict(
            t,
            &seen("1", Some(t)),
            &seen("1", Some(t)),
            &seen("1", Some(t)),
        );
        assert!(shared.unwrap().contains("one server session"));
        // The next statement of the same connection elsewhere.
        let moved = verdict(t, &seen("1", Some(t)), &seen("2", None), &seen("2", None));
        assert!(moved.unwrap().contains("two server sessions"));
        // A pooler that fakes the backend id still loses or leaks the setting.
        let lost = verdict(t, &seen("1", Some(t)), &seen("2", None), &seen("1", None));
        assert!(lost.unwrap().contains("did not survive"));
        let leaked = verdict(
            t,
            &seen("1", Some(t)),
            &seen("2", Some(t)),
            &seen("1", Some(t)),
        );
        assert!(leaked.unwrap().contains("showed on another"));
    }
}
