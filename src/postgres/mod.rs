//! PostgreSQL for the relay and the operator: connecting (TLS, keepalives, the URL
//! kept out of every message), the errors, and quoting.
//!
//! Every user identifier passes [`check_identifier`] when the configuration is validated
//! and is double-quoted here, so no SQL is ever built from unchecked text.
//!
//! # Submodules
//!
//! The outbox table's SQL, which both modes read rows with (`table`); the polling
//! relay's partitions and advisory locks (`polling`); logical replication, the
//! log-tailing relay's stream and slot (`replication`, with `coverage`, `horizon`,
//! `standby` and `snapshot`); what the operator runs (`admin`, `provision`); and the
//! connections' TLS, hosts and poolers (`tls`, `hosts`, `pooling`).

pub mod admin;
pub mod audit;
pub mod coverage;
pub mod horizon;
pub mod hosts;
pub mod ids;
pub mod polling;
pub mod pooling;
pub mod provision;
pub mod removal;
pub mod replication;
pub mod snapshot;
pub mod standby;
pub mod table;
pub mod tls;

use std::time::Duration;

use tokio_postgres::Client;

use tls::PgTls;

/// The PostgreSQL problems the relay reports.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// A statement or the connection failed; the text never contains the URL. The causes
    /// are spelled out (a TLS handshake error names the certificate problem).
    #[error("PostgreSQL: {what}: {}", with_causes(source))]
    Db {
        /// What the relay was doing.
        what: &'static str,
        /// The driver's error (server message or I/O error).
        source: tokio_postgres::Error,
    },
    /// The table does not have the shape the configuration names.
    #[error("outbox table: {0}")]
    Schema(String),
    /// The replication slot or publication is missing, in use or in conflict.
    #[error("{0}")]
    Replication(String),
    /// TLS cannot be set up as the spec asks (the CA is unusable).
    #[error("PostgreSQL TLS: {0}")]
    Tls(String),
    /// No pooled connection could be had (the pool's wait or create timeout).
    #[error("PostgreSQL connection pool: {0}")]
    Pool(String),
    /// The connection URL cannot be used.
    #[error("database URL (from ${env}): {message}")]
    Url {
        /// The variable that held it.
        env: String,
        /// Why, without the URL itself.
        message: String,
    },
}

/// An error and its causes on one line, without repeating a cause its parent already
/// printed (tokio-postgres repeats "db error" and TLS messages).
fn with_causes(error: &tokio_postgres::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = cause.source();
    }
    text
}

fn db(what: &'static str) -> impl FnOnce(tokio_postgres::Error) -> PgError {
    move |source| PgError::Db { what, source }
}

pub use crate::rules::check_identifier;

/// A session as relay `valid`'s pods open it, from outside a pod (the commands `audit`
/// and `dead-letters`): the URL given, TLS as its spec asks with the certificate files
/// the variables of [`tls::PgTls::from_files`] name.
pub async fn connect_for(
    valid: &crate::spec::ValidRelay,
    url: &str,
    url_env: &str,
) -> Result<tokio_postgres::Client, PgError> {
    let env = crate::secrets::env_value;
    let tls = tls::PgTls::from_files(valid, &env)
        .map_err(|(field, message)| PgError::Tls(format!("{field}: {message}")))?;
    connect(url, url_env, &tls).await
}

/// Double-quotes an identifier, doubling any quote inside it as SQL requires. Every
/// identifier passed [`check_identifier`] (so holds no quote); the escaping keeps this
/// function safe on its own.
pub fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// A PostgreSQL connection string for logs and reports: `postgres://user:***@host:port/db`,
/// rebuilt from what the driver's own parser read (URL or key=value form), so nothing
/// of the password can leak whatever characters it holds or how they are encoded, and
/// query parameters (which may carry `password=`) are dropped.
pub fn redact_url(url: &str) -> String {
    let Ok(config) = url.parse::<tokio_postgres::Config>() else {
        return "<not a PostgreSQL connection string>".to_owned();
    };
    // A password written unencoded can move the parser's `@` or `/` and land in what it
    // reads as host, user or database: a part is shown only when it looks like one.
    let plain = |text: &str| {
        if !text.is_empty()
            && text
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '/'))
        {
            text.to_owned()
        } else {
            "***".to_owned()
        }
    };
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let host = match host {
                tokio_postgres::config::Host::Tcp(h) => plain(h),
                tokio_postgres::config::Host::Unix(p) => plain(&p.display().to_string()),
            };
            match ports.get(i).or(ports.first()) {
                Some(port) => format!("{host}:{port}"),
                None => host,
            }
        })
        .collect();
    let user = config.get_user().map(plain).unwrap_or_default();
    let password = if config.get_password().is_some() {
        ":***"
    } else {
        ""
    };
    let at = if user.is_empty() && password.is_empty() {
        String::new()
    } else {
        format!("{user}{password}@")
    };
    format!(
        "postgres://{at}{}/{}",
        hosts.join(","),
        config.get_dbname().map(plain).unwrap_or_default()
    )
}

/// Connects with a short timeout and TLS as `tls` says, and spawns the connection task.
pub async fn connect(url: &str, env: &str, tls: &PgTls) -> Result<Client, PgError> {
    connect_as(url, env, tls, "outbox-relay").await
}

/// [`connect`] under another `application_name` (the operator's own sessions show as
/// `outbox-operator` in `pg_stat_activity`).
pub async fn connect_as(
    url: &str,
    env: &str,
    tls: &PgTls,
    application_name: &str,
) -> Result<Client, PgError> {
    let config = client_config(url, env, tls, application_name)?;
    let (client, connection) = config
        .connect(tls::connector(tls)?)
        .await
        .map_err(db("connect"))?;
    tokio::spawn(async move {
        if let Err(err) = connection.await {
            tracing::warn!(error = %err, "PostgreSQL connection ended");
        }
    });
    Ok(client)
}

/// The driver settings [`connect_as`] uses (short connect timeout, keepalives, the TLS
/// mode of `tls` whatever the URL says, `application_name`), for callers that keep
/// connections in a pool (they connect with [`tls::connector`]).
pub fn client_config(
    url: &str,
    env: &str,
    tls: &PgTls,
    application_name: &str,
) -> Result<tokio_postgres::Config, PgError> {
    let mut config: tokio_postgres::Config = url.parse().map_err(|_| PgError::Url {
        env: env.to_owned(),
        // The parser's message can quote the input, which may hold the password.
        message: "not a valid postgres:// URL or key=value connection string".to_owned(),
    })?;
    config
        .ssl_mode(tls::driver_mode(tls.mode))
        .connect_timeout(Duration::from_secs(5))
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        // A peer that stopped answering (a cut link, a crashed host) is noticed within
        // about 25 s rather than the system's default of more than ten minutes, and
        // data left unacknowledged for 30 s ends the connection.
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3)
        .tcp_user_timeout(Duration::from_secs(30))
        .application_name(application_name);
    hosts::prefer_primary(&mut config);
    Ok(config)
}

/// Turns off, for this session only, the server's idle timeouts
/// (`idle_in_transaction_session_timeout`, and `idle_session_timeout` where the server
/// has it) that a role or database may set. A relay's transaction stays open, idle,
/// while the broker acknowledges what it selected: ended by such a timeout, it would
/// release the partition locks (and row locks) it publishes under, and another replica
/// would publish the same aggregates at the same time. The relay bounds its own
/// transactions (the fence, the broker's message timeout). Plain `set_config` calls,
/// not startup options, so they pass session-mode poolers; settings the server does
/// not know are skipped.
pub async fn keep_open_while_publishing(client: &Client) -> Result<(), PgError> {
    client
        .batch_execute(
            "SELECT set_config(name, '0', false) FROM pg_settings \
             WHERE name IN ('idle_in_transaction_session_timeout', 'idle_session_timeout')",
        )
        .await
        .map_err(db("turning the session's idle timeouts off"))
}

/// Session settings of the operator's own connections: a DDL statement waiting behind
/// a table lock (a migration holding `ACCESS EXCLUSIVE`), a slot creation waiting for
/// old transactions, or a forgotten transaction fails after a bounded time with the
/// reason in a condition and is retried, instead of holding a reconcile (and a pooled
/// connection) forever. Relays set their own per statement.
pub const OPERATOR_SESSION_OPTIONS: &str =
    "-c lock_timeout=5s -c statement_timeout=60s -c idle_in_transaction_session_timeout=60s";

/// [`client_config`] for the operator: the same, plus [`OPERATOR_SESSION_OPTIONS`]
/// appended to any `options` the URL carries.
pub fn operator_client_config(
    url: &str,
    env: &str,
    tls: &PgTls,
) -> Result<tokio_postgres::Config, PgError> {
    let mut config = client_config(url, env, tls, "outbox-operator")?;
    let options = match config.get_options() {
        Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {OPERATOR_SESSION_OPTIONS}"),
        _ => OPERATOR_SESSION_OPTIONS.to_owned(),
    };
    config.options(options);
    Ok(config)
}

/// Connects as the operator ([`operator_client_config`]) and spawns the connection task.
pub async fn connect_operator(url: &str, env: &str, tls: &PgTls) -> Result<Client, PgError> {
    let config = operator_client_config(url, env, tls)?;
    let (client, connection) = config
        .connect(tls::connector(tls)?)
        .await
        .map_err(db("connect"))?;
    tokio::spawn(async move {
        if let Err(err) = connection.await {
            tracing::warn!(error = %err, "PostgreSQL connection ended");
        }
    });
    Ok(client)
}

pub use crate::broker::{OutboxRow, RowId};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked() {
        for good in ["outbox", "_x", "Outbox_2", &"a".repeat(63)] {
            assert!(check_identifier(good).is_ok(), "{good}");
        }
        for bad in ["", "1a", "a-b", "a\"b", "a b", &"a".repeat(64), "é"] {
            assert!(check_identifier(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/orders?password=x"),
            "postgres://app:***@db:5432/orders"
        );
        assert_eq!(
            redact_url("host=db port=6543 user=app password=s3cret dbname=shop"),
            "postgres://app:***@db:6543/shop"
        );
        assert_eq!(redact_url("postgres://db/shop"), "postgres://db:5432/shop");
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "<not a PostgreSQL connection string>"
        );
    }

    /// Percent-encodes everything but letters and digits, as a careful user would.
    fn encode(text: &str) -> String {
        text.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    }

    /// Generated passwords of every printable character, percent-encoded or written
    /// as they are (which may make the URL unparseable, or move the `@`): no form of
    /// the password reaches the redacted text, the URL error, or a Secret value check.
    #[test]
    fn no_generated_password_survives_redaction_or_an_error_message() {
        use rand::Rng;
        let mut rng = rand::rng();
        let printable: Vec<char> = (0x20u8..0x7f).map(char::from).collect();
        let slot = crate::secrets::SecretSlot {
            field: "spec.database.postgres.connectionSecretRef",
            purpose: crate::secrets::SecretUse::Database,
            reference: crate::api::SecretKeyRef {
                name: "db".into(),
                key: "uri".into(),
            },
            delivery: crate::secrets::Delivery::Env("OUTBOX_DATABASE_URL"),
            content: crate::secrets::Content::PostgresUrl,
        };
        for _ in 0..2000 {
            let len = rng.random_range(10..24);
            let password: String = (0..len)
                .map(|_| printable[rng.random_range(0..printable.len())])
                .collect();
            for url in [
                format!("postgres://app:{}@db.example:5432/shop", encode(&password)),
                format!("postgres://app:{password}@db.example:5432/shop"),
                format!(
                    "postgresql://app@db.example/shop?password={}",
                    encode(&password)
                ),
                format!(
                    "host=db user=app password='{}' dbname=shop",
                    password.replace('\\', "\\\\").replace('\'', "\\'")
                ),
            ] {
                let outputs = [
                    redact_url(&url),
                    client_config(&url, "OUTBOX_DATABASE_URL", &PgTls::disabled(), "t")
                        .err()
                        .map(|e| e.to_string())
                        .unwrap_or_default(),
                    slot.check_value(&url).err().unwrap_or_default(),
                ];
                for output in outputs {
                    assert!(
                        !output.contains(&password) && !output.contains(&encode(&password)),
                        "password {password:?} leaked from {url:?}: {output}"
                    );
                }
            }
        }
    }
}
