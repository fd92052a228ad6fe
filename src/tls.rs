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
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, String> {
        let chain = certificates(cert_pem, "the client certificate")?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| {
            format!(
                "the client key is not an unencrypted PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"
            )
        })?;
        Ok(Self {
            chain,
            key: Arc::new(key),
        })
    }
}

/// Every certificate in `pem`; at least one.
pub fn certificates(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{what} is not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        ));
    }
    Ok(certs)
}

/// The trusted roots: the CA certificates given, else the system's.
pub fn roots(ca_pem: Option<&str>) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            for cert in certificates(pem, "the CA")? {
                store
                    .add(cert)
                    .map_err(|e| format!("the CA certificate cannot be used: {e}"))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                // A system root rustls cannot parse is skipped, as OpenSSL would.
                let _ = store.add(cert);
            }
            if store.is_empty() {
                return Err(
                    "no CA given (caSecretRef) and no system CA certificates found".to_owned(),
                );
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
) -> Result<ClientConfig, String> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS versions: {e}"))?
        .with_root_certificates(roots(ca_pem)?);
    with_identity(builder, identity)
}

/// Finishes a configuration with or without a client identity.
pub fn with_identity(
    builder: rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>,
    identity: Option<&Identity>,
) -> Result<ClientConfig, String> {
    match identity {
        None => Ok(builder.with_no_client_auth()),
        Some(id) => builder
            .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
            .map_err(|e| format!("the client certificate and key do not go together: {e}")),
    }
}

/// Reads a PEM file a relay pod mounts (or its local copy), naming the file on error.
pub fn read_pem(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_pem_is_named_not_quoted() {
        let err = roots(Some("garbage s3cret")).unwrap_err();
        assert!(err.contains("no PEM certificate"), "{err}");
        assert!(!err.contains("s3cret"));
        let Err(err) = Identity::from_pem("nope", "nope") else {
            panic!("parsed");
        };
        assert!(err.contains("client certificate"), "{err}");
    }
}
