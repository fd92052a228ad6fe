//! The rustls pieces every TLS client of the binary shares (PostgreSQL's query
//! connections and NATS; Kafka uses librdkafka's OpenSSL with the same files, RabbitMQ
//! lapin's rustls with the same PEM): trusted roots from a CA in PEM or the system,
//! a client identity from a PEM certificate chain and key, and a verifying client
//! configuration. All on ring, the binary's one crypto provider.
//!
//! Errors name what is wrong with a file, never its content.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

/// Why TLS material cannot be used. The text names the file or the part that is
/// wrong, never its content.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file cannot be read.
    #[error("cannot read {path}: {error}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        error: std::io::Error,
    },
    /// Certificates (`what`: the CA, the client certificate) that are not PEM.
    #[error("{what} is not PEM certificates: {error}")]
    NotPem {
        /// Which certificates.
        what: String,
        /// The parser's reason.
        error: rustls::pki_types::pem::Error,
    },
    /// PEM text (`what`) without a certificate in it.
    #[error("{what} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")]
    NoCertificate {
        /// Which certificates.
        what: String,
    },
    /// The client key is not a PEM private key rustls reads.
    #[error("the client key is not an unencrypted PEM private key (PKCS#8, PKCS#1 or SEC1): {0}")]
    Key(rustls::pki_types::pem::Error),
    /// A CA certificate rustls refuses as a root.
    #[error("the CA certificate cannot be used: {0}")]
    Ca(rustls::Error),
    /// No CA was given and the system has none.
    #[error("no CA given (caSecretRef) and no system CA certificates found")]
    NoSystemRoots,
    /// The crypto provider offers no TLS version rustls supports.
    #[error("TLS versions: {0}")]
    Versions(rustls::Error),
    /// The client certificate and key are not a pair.
    #[error("the client certificate and key do not go together: {0}")]
    Identity(rustls::Error),
}

/// A client certificate chain and its private key, for mutual TLS. No `Debug`: it
/// holds the key.
#[derive(Clone)]
pub struct Identity {
    /// The certificate chain, leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's private key.
    pub key: Arc<PrivateKeyDer<'static>>,
}

impl Identity {
    /// Parses a PEM certificate chain and a PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, TlsError> {
        let chain = certificates(cert_pem, "the client certificate")?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(TlsError::Key)?;
        Ok(Self {
            chain,
            key: Arc::new(key),
        })
    }
}

/// Every certificate in `pem`; at least one.
pub fn certificates(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|error| TlsError::NotPem {
            what: what.to_owned(),
            error,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what: what.to_owned(),
        });
    }
    Ok(certs)
}

/// The trusted roots: the CA certificates given, else the system's.
pub fn roots(ca_pem: Option<&str>) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            for cert in certificates(pem, "the CA")? {
                store.add(cert).map_err(TlsError::Ca)?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                // A system root rustls cannot parse is skipped, as OpenSSL would.
                let _ = store.add(cert);
            }
            if store.is_empty() {
                return Err(TlsError::NoSystemRoots);
            }
        }
    }
    Ok(store)
}

/// The crypto provider of every rustls client here.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A client configuration that verifies the server's chain and host name against
/// `ca_pem` (else the system's roots) and presents `identity` when the server asks.
pub fn verifying_client_config(
    ca_pem: Option<&str>,
    identity: Option<&Identity>,
) -> Result<ClientConfig, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Versions)?
        .with_root_certificates(roots(ca_pem)?);
    with_identity(builder, identity)
}

/// Finishes a configuration with or without a client identity.
pub fn with_identity(
    builder: rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>,
    identity: Option<&Identity>,
) -> Result<ClientConfig, TlsError> {
    match identity {
        None => Ok(builder.with_no_client_auth()),
        Some(id) => builder
            .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
            .map_err(TlsError::Identity),
    }
}

/// Reads a PEM file a relay pod mounts (or its local copy), naming the file on error.
pub fn read_pem(path: &str) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|error| TlsError::Read {
        path: path.to_owned(),
        error,
    })
}

/// Makes rustls's ring provider the process default. Every TLS client of the binary
/// (kube, lapin, async-nats, tokio-postgres) is built on ring, but pgwire-replication
/// enables tokio-rustls's default features, which compile aws-lc-rs in as well; with two
/// providers rustls no longer picks one by itself. Idempotent; call before any client
/// is built.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_pem_is_named_not_quoted() {
        let err = roots(Some("garbage s3cret")).unwrap_err().to_string();
        assert!(err.contains("no PEM certificate"), "{err}");
        assert!(!err.contains("s3cret"));
        let Err(err) = Identity::from_pem("nope", "nope") else {
            panic!("parsed");
        };
        let err = err.to_string();
        assert!(err.contains("client certificate"), "{err}");
    }
}
