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
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::PgError;
use crate::api::SslMode;

/// How one connection uses TLS: the mode, the CA certificates (PEM) that verify the
/// server when the mode asks for it (public, not a secret), and the client certificate
/// sent when the server asks for one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PgTls {
    /// libpq's `sslmode`.
    pub mode: SslMode,
    /// Trusted CA certificates (PEM); `None`: the system's roots.
    pub ca_pem: Option<String>,
    /// Client certificate and key (libpq's `sslcert`/`sslkey`).
    pub client: Option<ClientPem>,
}

/// A client certificate chain and key, PEM. Its `Debug` shows neither.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct ClientPem {
    /// Certificate chain, leaf first.
    pub cert_pem: String,
    /// Private key.
    pub key_pem: String,
}

impl std::fmt::Debug for ClientPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientPem(<certificate and key>)")
    }
}

impl PgTls {
    /// Plain TCP, for tests and tools that need no TLS.
    pub fn disabled() -> Self {
        Self {
            mode: SslMode::Disable,
            ca_pem: None,
            client: None,
        }
    }

    /// The TLS of a relay whose Secret files are mounted (or named by local variables
    /// outside a pod, through `env`): the mode, the CA and the client certificate.
    /// On error, the spec field and what is wrong.
    pub fn from_files(
        valid: &crate::spec::ValidRelay,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, (&'static str, String)> {
        let slots = valid.secrets();
        let read = |field: &'static str| {
            slots
                .iter()
                .find(|s| s.field == field)
                .map(|s| s.read(env).map_err(|message| (field, message)))
                .transpose()
        };
        let ca_pem = read(crate::spec::PG_CA_FIELD)?;
        let cert = read(crate::spec::PG_CLIENT_CERT_FIELD)?;
        let key = read(crate::spec::PG_CLIENT_KEY_FIELD)?;
        Ok(Self {
            mode: valid.ssl_mode,
            ca_pem,
            client: cert
                .zip(key)
                .map(|(cert_pem, key_pem)| ClientPem { cert_pem, key_pem }),
        })
    }

    fn identity(&self) -> Result<Option<crate::tls::Identity>, PgError> {
        self.client
            .as_ref()
            .map(|c| crate::tls::Identity::from_pem(&c.cert_pem, &c.key_pem))
            .transpose()
            .map_err(|e| PgError::Tls(e.to_string()))
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
    let provider = crate::tls::provider();
    let identity = tls.identity()?;
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| PgError::Tls(format!("TLS versions: {e}")))?;
    let builder = match tls.mode {
        SslMode::Disable | SslMode::Prefer | SslMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider))),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let roots = Arc::new(
                crate::tls::roots(tls.ca_pem.as_deref())
                    .map_err(|e| PgError::Tls(e.to_string()))?,
            );
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| PgError::Tls(format!("certificate verifier: {e}")))?;
            if tls.mode == SslMode::VerifyFull {
                builder.with_webpki_verifier(webpki)
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
            }
        }
    };
    crate::tls::with_identity(builder, identity.as_ref()).map_err(|e| PgError::Tls(e.to_string()))
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
/// CA and the client certificate and key as the files the relay pod mounts.
pub fn replication_tls(
    mode: SslMode,
    ca_file: Option<&str>,
    client: Option<(&str, &str)>,
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
        client_cert_pem_path: client.map(|(cert, _)| cert.into()),
        client_key_pem_path: client.map(|(_, key)| key.into()),
        ..TlsConfig::default()
    }
}

/// Under `verify-full`, a host given as an IP address is verified against the
/// certificate's IP addresses, as the query connections do (rustls); the replication
/// client refuses an IP literal unless it is named as the server name, so it is.
pub fn verify_by_address(tls: &mut pgwire_replication::config::TlsConfig, host: &str) {
    use pgwire_replication::config::SslMode as Rep;
    if tls.mode == Rep::VerifyFull
        && tls.sni_hostname.is_none()
        && host.parse::<std::net::IpAddr>().is_ok()
    {
        tls.sni_hostname = Some(host.to_owned());
    }
}

/// Why a connection failed at TLS, and what to change: the condition's reason and
/// advice, when `error` (the driver's text, causes included) is a TLS failure under
/// `mode`; `has_ca` tells whether the spec names a CA.
pub fn diagnose(mode: SslMode, has_ca: bool, error: &str) -> Option<(&'static str, String)> {
    if error.contains("server does not support TLS") {
        return Some((
            "TLSUnavailable",
            format!(
                "the server does not offer TLS, which sslMode {} requires: turn TLS on at \
                 the server (ssl = on), or set spec.database.postgres.sslMode: disable to \
                 connect in plain text (the password then crosses the network unencrypted)",
                mode.as_str()
            ),
        ));
    }
    let verifying = matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull);
    let certificate = error.contains("invalid peer certificate") || error.contains("certificate");
    if !verifying || !certificate {
        return None;
    }
    let advice = if error.contains("NotValidForName") {
        "the server's certificate does not name the host of the URL: connect by a name the \
         certificate carries, or set sslMode: verify-ca to verify the chain only"
            .to_owned()
    } else if has_ca {
        "the server's certificate does not chain to the CA in \
         spec.database.postgres.caSecretRef (or has expired): give the CA that signed it"
            .to_owned()
    } else {
        format!(
            "sslMode {} verifies the server's certificate, and it does not chain to the \
             system's roots: give its CA in spec.database.postgres.caSecretRef (a Secret's \
             ca.crt: CloudNativePG's <cluster>-ca, your cloud's regional bundle), or set \
             sslMode: require to encrypt without verifying (an on-path attacker could then \
             read the password)",
            mode.as_str()
        )
    };
    Some(("TLSNotVerified", advice))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replication_verifies_an_address_host_as_the_query_connections_do() {
        let mut tls = replication_tls(SslMode::VerifyFull, Some("/ca.crt"), None);
        verify_by_address(&mut tls, "10.244.0.1");
        assert_eq!(tls.sni_hostname.as_deref(), Some("10.244.0.1"));
        let mut named = replication_tls(SslMode::VerifyFull, Some("/ca.crt"), None);
        verify_by_address(&mut named, "db.example.com");
        assert_eq!(named.sni_hostname, None);
        let mut chain_only = replication_tls(SslMode::VerifyCa, Some("/ca.crt"), None);
        verify_by_address(&mut chain_only, "10.244.0.1");
        assert_eq!(chain_only.sni_hostname, None);
    }

    #[test]
    fn tls_failures_say_how_to_give_the_ca_or_choose_a_weaker_mode() {
        let unknown = "error performing TLS handshake: invalid peer certificate: UnknownIssuer";
        let (reason, advice) = diagnose(SslMode::VerifyFull, false, unknown).unwrap();
        assert_eq!(reason, "TLSNotVerified");
        assert!(
            advice.contains("caSecretRef") && advice.contains("sslMode: require"),
            "{advice}"
        );
        let (_, advice) = diagnose(SslMode::VerifyFull, true, unknown).unwrap();
        assert!(advice.contains("give the CA that signed it"), "{advice}");
        let name = "invalid peer certificate: NotValidForName";
        let (_, advice) = diagnose(SslMode::VerifyFull, true, name).unwrap();
        assert!(advice.contains("verify-ca"), "{advice}");
        let plain = "error performing TLS handshake: server does not support TLS";
        let (reason, advice) = diagnose(SslMode::VerifyFull, false, plain).unwrap();
        assert_eq!(reason, "TLSUnavailable");
        assert!(advice.contains("sslMode: disable"), "{advice}");
        // Not a TLS failure, or a mode that verifies nothing: no advice.
        assert_eq!(
            diagnose(SslMode::VerifyFull, false, "password authentication failed"),
            None
        );
        assert_eq!(diagnose(SslMode::Require, false, unknown), None);
    }

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
            assert!(
                client_config(&PgTls {
                    mode,
                    ..PgTls::default()
                })
                .is_ok()
            );
        }
        let bad = PgTls {
            mode: SslMode::VerifyFull,
            ca_pem: Some("not a certificate".to_owned()),
            client: None,
        };
        let err = client_config(&bad).unwrap_err().to_string();
        assert!(err.contains("PEM"), "{err}");
        let key = PgTls {
            mode: SslMode::Require,
            ca_pem: None,
            client: Some(ClientPem {
                cert_pem: "x".to_owned(),
                key_pem: "s3cret".to_owned(),
            }),
        };
        assert!(!format!("{key:?}").contains("s3cret"));
    }
}
