//! TLS to PostgreSQL with libpq's `sslmode` meanings, on rustls (ring, like the rest of
//! the binary), for every connection kind: the controller's and the relay's query
//! connections through [`connector`], the log-tailing replication connection through
//! [`replication_tls`].
//!
//! | mode | TLS | certificate chain | host name |
//! |---|---|---|---|
//! | `disable` | never | – | – |
//! | `prefer` | when the server offers it | not verified | not verified |
//! | `require` | always | not verified | not verified |
//! | `verify-ca` | always | verified | not verified |
//! | `verify-full` | always | verified | verified |
//!
//! The chain is verified against the CA the spec names (`caSecretRef`), else against
//! the system's roots. Channel binding (SCRAM-SHA-256-PLUS) is offered whenever the
//! session is encrypted; the server decides.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::PgError;
use crate::api::SslMode;

/// How one connection uses TLS: the mode, and the CA certificates (PEM) that verify
/// the server when the mode asks for it. A CA certificate is public, not a secret.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PgTls {
    /// libpq's `sslmode`.
    pub mode: SslMode,
    /// Trusted CA certificates (PEM); `None`: the system's roots.
    pub ca_pem: Option<String>,
}

impl PgTls {
    /// Plain TCP, for tests and tools that need no TLS.
    pub fn disabled() -> Self {
        Self {
            mode: SslMode::Disable,
            ca_pem: None,
        }
    }
}

/// The driver's own mode: whether it asks the server for TLS and whether it may go on
/// without. Verification is the connector's job ([`connector`]).
pub fn driver_mode(mode: SslMode) -> tokio_postgres::config::SslMode {
    match mode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    }
}

/// The TLS connector for tokio-postgres (and deadpool-postgres) for `tls`.
pub fn connector(tls: &PgTls) -> Result<MakeRustlsConnect, PgError> {
    Ok(MakeRustlsConnect::new(client_config(tls)?))
}

/// The rustls client configuration for `tls`.
pub fn client_config(tls: &PgTls) -> Result<ClientConfig, PgError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| PgError::Tls(format!("TLS versions: {e}")))?;
    let config = match tls.mode {
        SslMode::Disable | SslMode::Prefer | SslMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
            .with_no_client_auth(),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let roots = Arc::new(roots(tls.ca_pem.as_deref())?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| PgError::Tls(format!("certificate verifier: {e}")))?;
            if tls.mode == SslMode::VerifyFull {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
                    .with_no_client_auth()
            }
        }
    };
    Ok(config)
}

/// The trusted roots: the CA certificates given, else the system's.
fn roots(ca_pem: Option<&str>) -> Result<RootCertStore, PgError> {
    let mut store = RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            let certs: Vec<CertificateDer<'static>> =
                CertificateDer::pem_slice_iter(pem.as_bytes())
                    .collect::<Result<_, _>>()
                    .map_err(|e| PgError::Tls(format!("the CA is not PEM certificates: {e}")))?;
            if certs.is_empty() {
                return Err(PgError::Tls(
                    "the CA holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_owned(),
                ));
            }
            for cert in certs {
                store
                    .add(cert)
                    .map_err(|e| PgError::Tls(format!("the CA certificate cannot be used: {e}")))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                // A system root rustls cannot parse is skipped, as libpq's OpenSSL would.
                let _ = store.add(cert);
            }
            if store.is_empty() {
                return Err(PgError::Tls(
                    "no CA given (caSecretRef) and no system CA certificates found".to_owned(),
                ));
            }
        }
    }
    Ok(store)
}

/// `require` and `prefer`: encrypted, the server not authenticated (libpq's meaning).
/// Handshake signatures are still checked, so the session keys are the server's.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted CA; the host name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The replication connection's TLS (pgwire-replication, also rustls on ring), with the
/// CA as the file the relay pod mounts.
pub fn replication_tls(
    mode: SslMode,
    ca_file: Option<&str>,
) -> pgwire_replication::config::TlsConfig {
    use pgwire_replication::config::{SslMode as Rep, TlsConfig};
    TlsConfig {
        mode: match mode {
            SslMode::Disable => Rep::Disable,
            SslMode::Prefer => Rep::Prefer,
            SslMode::Require => Rep::Require,
            SslMode::VerifyCa => Rep::VerifyCa,
            SslMode::VerifyFull => Rep::VerifyFull,
        },
        ca_pem_path: ca_file.map(Into::into),
        ..TlsConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_map_to_the_drivers_and_verification_needs_a_usable_ca() {
        assert_eq!(
            driver_mode(SslMode::VerifyFull),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(
            driver_mode(SslMode::Prefer),
            tokio_postgres::config::SslMode::Prefer
        );
        for mode in [SslMode::Disable, SslMode::Prefer, SslMode::Require] {
            assert!(client_config(&PgTls { mode, ca_pem: None }).is_ok());
        }
        let bad = PgTls {
            mode: SslMode::VerifyFull,
            ca_pem: Some("not a certificate".to_owned()),
        };
        let err = client_config(&bad).unwrap_err().to_string();
        assert!(err.contains("PEM"), "{err}");
    }
}
