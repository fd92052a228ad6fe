//! How the controller reaches a relay's database: the connection URL and TLS from the
//! Secrets (or a CloudNativePG Cluster's), a small pool of connections per URL, and
//! whether the Cluster a relay names is still there. Nothing secret leaves it: the URL
//! is only ever handed to the driver and kept as a key in memory.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, ResourceExt};
use tokio_postgres::Client;

use super::Context;
use crate::api::OutboxRelay;
use crate::postgres::tls::PgTls;
use crate::postgres::{self, PgError};

/// Where the connection URL comes from, for messages (never the URL itself).
pub(super) fn secret_name(relay: &OutboxRelay) -> String {
    let r = relay.spec.database.postgres().connection_secret_ref;
    format!("Secret {} key {}", r.name, r.key)
}

/// How the operator connects to a relay's database: the URL (secret, so no `Debug`)
/// and TLS as the spec says.
#[derive(Clone)]
pub(super) struct Conn {
    /// The connection URL.
    pub url: String,
    /// TLS mode and CA.
    pub tls: PgTls,
}

impl std::fmt::Debug for Conn {
    /// Never the URL: it holds the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").finish_non_exhaustive()
    }
}

/// A key's value in a Secret, trimmed; `Ok(None)` when the Secret or key is missing or
/// the value empty.
async fn read_key(
    relay: &OutboxRelay,
    r: &crate::api::SecretKeyRef,
    ctx: &Context,
) -> Result<Option<String>, kube::Error> {
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &relay.namespace().unwrap_or_default());
    let Some(secret) = secrets.get_opt(&r.name).await? else {
        return Ok(None);
    };
    let from_data = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|b| String::from_utf8_lossy(&b.0).trim().to_owned());
    let from_string = secret
        .string_data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|s| s.trim().to_owned());
    Ok(from_data.or(from_string).filter(|u| !u.is_empty()))
}

/// The connection URL and TLS from the Secrets the raw spec names (cleanup reads them
/// without a parse): `Ok(None)` when the URL or a named CA, certificate or key is
/// missing.
pub(super) async fn read_connection(
    relay: &OutboxRelay,
    ctx: &Context,
) -> Result<Option<Conn>, kube::Error> {
    let pg = relay.spec.database.postgres();
    let login = relay
        .spec
        .database
        .database_ref
        .as_ref()
        .and_then(|r| r.login(&relay.namespace().unwrap_or_default()));
    let url = match &login {
        None => read_key(relay, &pg.connection_secret_ref, ctx).await?,
        Some(login) => match (
            read_key(relay, &login.user, ctx).await?,
            read_key(relay, &login.password, ctx).await?,
        ) {
            (Some(user), Some(password)) => Some(login.url(&user, &password)),
            _ => None,
        },
    };
    let Some(url) = url else {
        return Ok(None);
    };
    let mut pems = Vec::new();
    for reference in &pg.tls_refs() {
        pems.push(match reference {
            Some(r) => match read_key(relay, r, ctx).await? {
                Some(pem) => Some(pem),
                None => return Ok(None),
            },
            None => None,
        });
    }
    let [ca_pem, cert, key] = <[Option<String>; 3]>::try_from(pems).unwrap_or_default();
    Ok(Some(Conn {
        url,
        tls: PgTls {
            mode: pg.ssl_mode,
            ca_pem,
            client: cert
                .zip(key)
                .map(|(cert_pem, key_pem)| crate::postgres::tls::ClientPem { cert_pem, key_pem }),
        },
    }))
}

/// Connects like the relay does (same driver settings, same TLS).
pub(super) async fn connect(relay: &OutboxRelay, conn: &Conn) -> Result<Client, PgError> {
    postgres::connect_operator(&conn.url, &secret_name(relay), &conn.tls).await
}

/// Connections per database the controller keeps at most.
const POOL_SIZE: usize = 4;
/// A pooled connection unused this long is closed; a pool unused this long is dropped.
const POOL_IDLE_LIMIT: Duration = Duration::from_secs(60);

/// The controller's database connections: a small pool per connection URL.
///
/// Every relay's database is checked and measured each status interval. Connecting
/// each time cost PostgreSQL a backend start and an authentication per relay and
/// interval (50 a second with 500 relays on one database); relays sharing a database
/// now share up to [`POOL_SIZE`] connections. Idle connections close after
/// [`POOL_IDLE_LIMIT`], so the operator holds none to a database it no longer checks.
/// Each checkout resets the session (`RecyclingMethod::Clean`), so a statement timeout
/// set for the status queries never leaks into the next user. The URLs are keys in
/// memory only.
#[derive(Default)]
pub(crate) struct Pools {
    by_url: Mutex<HashMap<String, (Pool, Instant)>>,
    /// The last pooler probe per URL (`Some(why)`: sessions are lent per transaction),
    /// and when it ran.
    probed: Mutex<HashMap<String, (Option<String>, Instant)>>,
}

/// How long a pooler probe's verdict is reused for a URL.
const POOLER_PROBE_EVERY: Duration = Duration::from_secs(300);

/// The key of a URL with its TLS settings (in memory only).
fn url_key(conn: &Conn) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    conn.tls.hash(&mut hasher);
    format!("{:x} {}", hasher.finish(), conn.url)
}

impl Pools {
    /// Whether the URL reaches a pooler that lends sessions per transaction
    /// ([`postgres::pooling`]): `client` (pooled) and a connection of its own are probed
    /// together, at most every [`POOLER_PROBE_EVERY`] per URL. The second connection is
    /// not taken from the pool, where waiting for it could starve other reconciles.
    pub(super) async fn pooled_sessions(
        &self,
        relay: &OutboxRelay,
        conn: &Conn,
        client: &Client,
    ) -> Result<Option<String>, PgError> {
        let key = url_key(conn);
        if let Some((verdict, at)) = self
            .probed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&key)
            && at.elapsed() < POOLER_PROBE_EVERY
        {
            return Ok(verdict.clone());
        }
        let other = connect(relay, conn).await?;
        let verdict = postgres::pooling::pooled_sessions(client, &other).await?;
        let mut probed = self
            .probed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        probed.retain(|_, (_, at)| at.elapsed() < POOLER_PROBE_EVERY);
        probed.insert(key, (verdict.clone(), Instant::now()));
        Ok(verdict)
    }

    pub(super) async fn get(
        &self,
        relay: &OutboxRelay,
        conn: &Conn,
    ) -> Result<deadpool_postgres::Object, PgError> {
        let url = &conn.url;
        let key = url_key(conn);
        let pool = {
            let mut pools = self
                .by_url
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            pools.retain(|_, (pool, used)| {
                pool.retain(|_, metrics| metrics.last_used() < POOL_IDLE_LIMIT);
                used.elapsed() < POOL_IDLE_LIMIT
            });
            if let Some((pool, used)) = pools.get_mut(&key) {
                *used = Instant::now();
                pool.clone()
            } else {
                let config = postgres::operator_client_config(url, &secret_name(relay), &conn.tls)?;
                let manager = Manager::from_config(
                    config,
                    postgres::tls::connector(&conn.tls)?,
                    ManagerConfig {
                        recycling_method: RecyclingMethod::Clean,
                    },
                );
                let pool = Pool::builder(manager)
                    .max_size(POOL_SIZE)
                    .runtime(Runtime::Tokio1)
                    .wait_timeout(Some(Duration::from_secs(30)))
                    .create_timeout(Some(Duration::from_secs(10)))
                    .recycle_timeout(Some(Duration::from_secs(5)))
                    .build()
                    .map_err(|err| PgError::Pool(err.to_string()))?;
                pools.insert(key, (pool.clone(), Instant::now()));
                pool
            }
        };
        pool.get().await.map_err(|err| match err {
            PoolError::Backend(source) => PgError::Db {
                what: "connect",
                source,
            },
            PoolError::Timeout(_) => PgError::Pool(
                "timed out waiting for one of the operator's connections to this database"
                    .to_owned(),
            ),
            other => PgError::Pool(other.to_string()),
        })
    }
}

/// A stable key for a database, without credentials: `host:port/database`.
/// Where `url` leads, `host:port/database`, without credentials.
pub(super) fn database_key(url: &str) -> String {
    let Ok(config) = url.parse::<tokio_postgres::Config>() else {
        return "<unparseable>".to_owned();
    };
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config
        .get_dbname()
        .or(config.get_user())
        .unwrap_or("postgres");
    format!("{host}:{port}/{db}")
}
/// Whether the CloudNativePG Cluster a relay names is gone or being deleted (its kind
/// not served counts as gone).
pub(super) async fn cluster_gone(
    relay: &OutboxRelay,
    reference: &crate::api::DatabaseRef,
    ctx: &Context,
) -> Result<bool, kube::Error> {
    match clusters_api(relay, ctx).get_opt(&reference.name).await {
        Ok(Some(object)) => Ok(object.metadata.deletion_timestamp.is_some()),
        Ok(None) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(true),
        Err(err) => Err(err),
    }
}

pub(super) fn clusters_api(relay: &OutboxRelay, ctx: &Context) -> Api<kube::api::DynamicObject> {
    use crate::cnpg::{GROUP, KIND, PLURAL, VERSION};
    use kube::api::{ApiResource, GroupVersionKind};
    let resource =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL);
    Api::namespaced_with(
        ctx.client.clone(),
        &relay.namespace().unwrap_or_default(),
        &resource,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_keys_carry_no_credentials() {
        let key = database_key("postgres://app:s3cret@db.example:6543/shop?sslmode=disable");
        assert_eq!(key, "db.example:6543/shop");
        assert!(!database_key("host=h user=u password=s3cret dbname=d").contains("s3cret"));
    }
}
