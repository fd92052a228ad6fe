//! `spec.database`: a connection URL Secret, or a CloudNativePG cluster.

use super::{CaSecretRef, CertSecretRef, KeySecretRef, SecretKeyRef};
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The database holding the outbox table: `postgres` (a connection URL Secret) or
/// `databaseRef` (a CloudNativePG cluster).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.postgres) != has(self.databaseRef)").message("spec.database: set exactly one of postgres and databaseRef"))]
pub struct DatabaseSpec {
    /// PostgreSQL reached through a connection URL Secret (with `wal_level=logical` for
    /// log tailing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postgres: Option<PostgresSpec>,
    /// A CloudNativePG `Cluster` (`postgresql.cnpg.io/v1`) in the relay's namespace,
    /// instead of `postgres`: the relay connects as the cluster's application user
    /// (the `uri` of its `<name>-app` Secret, which points at the `<name>-rw` Service),
    /// over TLS verified (`verify-full`) against the cluster's CA (`ca.crt` of
    /// `<name>-ca`). The controller checks the Cluster and its `-rw` Service exist and,
    /// for log tailing, that the cluster keeps `wal_level = logical` and synchronises
    /// logical slots to its standbys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_ref: Option<DatabaseRef>,
}

impl DatabaseSpec {
    /// How the relay reaches PostgreSQL: `postgres` as written, or what `databaseRef`
    /// stands for (see [`DatabaseRef::connection`]). With neither, a reference to no
    /// Secret, which the spec's checks refuse.
    pub fn postgres(&self) -> PostgresSpec {
        match (&self.postgres, &self.database_ref) {
            (Some(pg), _) => pg.clone(),
            (None, Some(r)) => r.connection(),
            (None, None) => PostgresSpec {
                connection_secret_ref: SecretKeyRef {
                    name: String::new(),
                    key: SecretKeyRef::DEFAULT_KEY.to_owned(),
                },
                ssl_mode: SslMode::default(),
                ca_secret_ref: None,
                client_cert_secret_ref: None,
                client_key_secret_ref: None,
            },
        }
    }
}

/// A PostgreSQL cluster managed by another operator.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.secretName) && has(self.userSecretName))").message("spec.database.databaseRef: secretName (a uri) and userSecretName (a username and password) exclude each other"))]
#[x_kube(validation = Rule::new("!has(self.database) || has(self.userSecretName)").message("spec.database.databaseRef.database goes with userSecretName (the app Secret's uri names its database)"))]
pub struct DatabaseRef {
    /// The kind of cluster: `Cluster` (CloudNativePG, `postgresql.cnpg.io/v1`).
    #[serde(default)]
    pub kind: DatabaseRefKind,
    /// The cluster's name, in the relay's namespace.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
    /// The Secret to connect with, by its `uri` key; default `<name>-app` (the
    /// application user CloudNativePG creates). Name it when the Cluster bootstraps its
    /// application user from a Secret of its own (`spec.bootstrap.initdb.secret.name`),
    /// or to connect as the superuser (`<name>-superuser`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub secret_name: Option<String>,
    /// A `kubernetes.io/basic-auth` Secret (`username`, `password`) to log in with
    /// instead: a CloudNativePG managed role's `passwordSecret` (a role with
    /// `replication: true` for log tailing). The relay then connects to the `-rw`
    /// Service (`<name>-rw.<namespace>:5432`) and `database`. Not with `secretName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub user_secret_name: Option<String>,
    /// With `userSecretName`: the database to connect to; default `app`
    /// (CloudNativePG's default application database).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub database: Option<String>,
    /// The Secret holding the server's CA (`ca.crt`); default `<name>-ca`. Name it when
    /// the Cluster brings its own (`spec.certificates.serverCASecret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub ca_secret_name: Option<String>,
}

/// A login from parts: the host, port and database the spec names, and a Secret's
/// user name and password (never in one URL Secret).
#[derive(Clone, Debug, PartialEq)]
pub struct Login {
    /// Host name.
    pub host: String,
    /// Port.
    pub port: u16,
    /// Database.
    pub dbname: String,
    /// The Secret key holding the user name.
    pub user: SecretKeyRef,
    /// The Secret key holding the password.
    pub password: SecretKeyRef,
}

impl Login {
    /// The connection URL, user name and password percent-encoded.
    pub fn url(&self, user: &str, password: &str) -> String {
        use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
        let enc = |s: &str| utf8_percent_encode(s.trim(), NON_ALPHANUMERIC).to_string();
        format!(
            "postgresql://{}:{}@{}:{}/{}",
            enc(user),
            enc(password),
            self.host,
            self.port,
            enc(&self.dbname)
        )
    }
}

/// The kinds of cluster `databaseRef` can name.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DatabaseRefKind {
    /// CloudNativePG's `Cluster` (`postgresql.cnpg.io/v1`).
    #[default]
    Cluster,
}

impl DatabaseRef {
    /// The Secret the relay connects with (its `uri` key).
    pub fn secret(&self) -> String {
        self.secret_name
            .clone()
            .unwrap_or_else(|| format!("{}-app", self.name))
    }

    /// The Secret holding the server's CA (its `ca.crt` key).
    pub fn ca_secret(&self) -> String {
        self.ca_secret_name
            .clone()
            .unwrap_or_else(|| format!("{}-ca", self.name))
    }

    /// The read-write Service the cluster's `uri` points at.
    pub fn rw_service(&self) -> String {
        format!("{}-rw", self.name)
    }

    /// With `userSecretName`: where to log in (the `-rw` Service in `namespace`) and
    /// with which Secret's `username` and `password`.
    pub fn login(&self, namespace: &str) -> Option<Login> {
        let secret = self.user_secret_name.clone()?;
        Some(Login {
            host: format!("{}.{namespace}", self.rw_service()),
            port: 5432,
            dbname: self.database.clone().unwrap_or_else(|| "app".to_owned()),
            user: SecretKeyRef {
                name: secret.clone(),
                key: "username".to_owned(),
            },
            password: SecretKeyRef {
                name: secret,
                key: "password".to_owned(),
            },
        })
    }

    /// The connection it stands for: the Secret's `uri`, TLS verified against the
    /// cluster's CA (CloudNativePG's server certificates name the `-rw` Service). With
    /// `userSecretName` the reference is that Secret's `password` (the rest of the
    /// login is [`DatabaseRef::login`]).
    pub fn connection(&self) -> PostgresSpec {
        PostgresSpec {
            connection_secret_ref: match &self.user_secret_name {
                Some(secret) => SecretKeyRef {
                    name: secret.clone(),
                    key: "password".to_owned(),
                },
                None => SecretKeyRef {
                    name: self.secret(),
                    key: "uri".to_owned(),
                },
            },
            ssl_mode: SslMode::VerifyFull,
            ca_secret_ref: Some(CaSecretRef::named(self.ca_secret())),
            client_cert_secret_ref: None,
            client_key_secret_ref: None,
        }
    }
}

/// How to reach PostgreSQL.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.clientKeySecretRef) || has(self.clientCertSecretRef)").message("spec.database.postgres.clientKeySecretRef needs clientCertSecretRef: a key without its certificate is never sent"))]
#[x_kube(validation = Rule::new("!has(self.clientCertSecretRef) || !has(self.sslMode) || self.sslMode != 'disable'").message("spec.database.postgres.clientCertSecretRef needs TLS: set sslMode to verify-full (or require, verify-ca)"))]
pub struct PostgresSpec {
    /// The Secret key holding a connection URI (`postgres://user:password@host:5432/db`).
    /// The relay reads it from its environment; it never appears in a ConfigMap, log,
    /// event or status.
    pub connection_secret_ref: SecretKeyRef,
    /// TLS to the database, with libpq's meanings: `verify-full` (TLS, chain and host
    /// name verified; the default), `verify-ca` (TLS, chain verified), `require` (TLS,
    /// not verified), `prefer` (TLS when the server offers it, not verified) or
    /// `disable`. Verification uses `caSecretRef`, else the system's roots.
    /// Applies to every connection: the operator's, the relay's and its replication
    /// stream. It overrides an `sslmode` in the URL.
    #[serde(default)]
    pub ssl_mode: SslMode,
    /// A Secret key holding the CA certificate(s), PEM, that verify the server
    /// (`verify-ca`, `verify-full`); default the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<CaSecretRef>,
    /// A Secret key holding a client certificate (PEM), sent when the server asks for
    /// one (libpq's `sslcert`): for `cert` authentication in pg_hba.conf, or
    /// `clientcert=verify-full`. Needs an `sslMode` other than `disable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_secret_ref: Option<CertSecretRef>,
    /// A Secret key holding the client certificate's private key (PEM, unencrypted;
    /// libpq's `sslkey`). Default: `tls.key` of the certificate's Secret, so one
    /// `kubernetes.io/tls` Secret named in `clientCertSecretRef` gives both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_secret_ref: Option<KeySecretRef>,
}

impl PostgresSpec {
    /// The TLS references: CA, client certificate, client key (resolved), each as set.
    pub fn tls_refs(&self) -> [Option<SecretKeyRef>; 3] {
        super::secret_ref::tls_refs(
            self.ca_secret_ref.as_ref(),
            self.client_cert_secret_ref.as_ref(),
            self.client_key_secret_ref.as_ref(),
        )
    }
}

/// TLS mode for the database connection, as libpq names them.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS when the server offers it.
    Prefer,
    /// TLS, without verifying the server certificate.
    Require,
    /// TLS, verifying the certificate chain but not the host name.
    VerifyCa,
    /// TLS, verifying the certificate chain and the host name (the default).
    #[default]
    VerifyFull,
}

impl SslMode {
    /// The name libpq (and the spec) uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }
}
