//! References to a key in a Secret of the relay's namespace. Each role has its own type
//! so that leaving the key out picks the key the ecosystem writes for that role:
//! cert-manager and `kubernetes.io/tls` Secrets hold `ca.crt`, `tls.crt` and `tls.key`;
//! CloudNativePG's and Strimzi's user Secrets `username` and `password`; a connection
//! URI is `uri` (CloudNativePG's application Secret). Everything downstream of the spec
//! works on [`SecretKeyRef`], which each converts to.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// The name pattern of a Secret (a DNS subdomain).
macro_rules! secret_ref {
    ($(#[$meta:meta])* $name:ident, $default_fn:ident, $default_name:literal, $default:literal, $key_doc:literal) => {
        $(#[$meta])*
        #[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
        #[serde(rename_all = "camelCase")]
        pub struct $name {
            /// Name of the Secret.
            #[schemars(
                length(min = 1, max = 253),
                regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
            )]
            pub name: String,
            #[doc = $key_doc]
            #[serde(default = $default_name)]
            #[schemars(length(min = 1, max = 253), regex(pattern = "^[-._a-zA-Z0-9]+$"))]
            pub key: String,
        }

        fn $default_fn() -> String {
            $default.to_owned()
        }

        impl $name {
            /// The reference to `name`'s key for this role.
            pub fn named(name: impl Into<String>) -> Self {
                Self {
                    name: name.into(),
                    key: $default_fn(),
                }
            }

            /// The key a reference of this role reads when it names none.
            pub const DEFAULT_KEY: &'static str = $default;
        }
    };
}

secret_ref!(
    /// A key in a Secret in the relay's namespace.
    SecretKeyRef,
    default_uri_key,
    "default_uri_key",
    "uri",
    "Key within the Secret; `uri` when left out."
);
secret_ref!(
    /// A Secret key holding CA certificates (PEM).
    CaSecretRef,
    default_ca_key,
    "default_ca_key",
    "ca.crt",
    "Key within the Secret; `ca.crt` when left out (cert-manager, CloudNativePG and Strimzi write it)."
);
secret_ref!(
    /// A Secret key holding a certificate chain (PEM).
    CertSecretRef,
    default_cert_key,
    "default_cert_key",
    "tls.crt",
    "Key within the Secret; `tls.crt` when left out (a `kubernetes.io/tls` Secret)."
);
secret_ref!(
    /// A Secret key holding a private key (PEM).
    KeySecretRef,
    default_key_key,
    "default_key_key",
    "tls.key",
    "Key within the Secret; `tls.key` when left out (a `kubernetes.io/tls` Secret)."
);
secret_ref!(
    /// A Secret key holding a user name.
    UsernameSecretRef,
    default_username_key,
    "default_username_key",
    "username",
    "Key within the Secret; `username` when left out."
);
secret_ref!(
    /// A Secret key holding a password.
    PasswordSecretRef,
    default_password_key,
    "default_password_key",
    "password",
    "Key within the Secret; `password` when left out (CloudNativePG and Strimzi write it)."
);

macro_rules! into_secret_key_ref {
    ($($name:ident),*) => {$(
        impl From<&$name> for SecretKeyRef {
            fn from(r: &$name) -> Self {
                Self {
                    name: r.name.clone(),
                    key: r.key.clone(),
                }
            }
        }
    )*};
}

into_secret_key_ref!(
    CaSecretRef,
    CertSecretRef,
    KeySecretRef,
    UsernameSecretRef,
    PasswordSecretRef
);

/// The references of a TLS block, as set: the CA, the client certificate, and the
/// client key, which defaults to `tls.key` of the certificate's Secret (one
/// `kubernetes.io/tls` Secret named in `clientCertSecretRef` gives both).
pub(super) fn tls_refs(
    ca: Option<&CaSecretRef>,
    cert: Option<&CertSecretRef>,
    key: Option<&KeySecretRef>,
) -> [Option<SecretKeyRef>; 3] {
    let key = key
        .cloned()
        .or_else(|| cert.map(|cert| KeySecretRef::named(&cert.name)));
    [
        ca.map(SecretKeyRef::from),
        cert.map(SecretKeyRef::from),
        key.as_ref().map(SecretKeyRef::from),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_left_out_key_is_the_one_the_role_reads() {
        let name = r#"{"name": "s"}"#;
        let uri: SecretKeyRef = serde_json::from_str(name).unwrap();
        let ca: CaSecretRef = serde_json::from_str(name).unwrap();
        let cert: CertSecretRef = serde_json::from_str(name).unwrap();
        let key: KeySecretRef = serde_json::from_str(name).unwrap();
        let user: UsernameSecretRef = serde_json::from_str(name).unwrap();
        let password: PasswordSecretRef = serde_json::from_str(name).unwrap();
        assert_eq!(
            [uri.key, ca.key, cert.key, key.key, user.key, password.key],
            [
                "uri", "ca.crt", "tls.crt", "tls.key", "username", "password"
            ]
        );
        let chosen: CaSecretRef =
            serde_json::from_str(r#"{"name": "s", "key": "root.pem"}"#).unwrap();
        assert_eq!(SecretKeyRef::from(&chosen).key, "root.pem");
        assert_eq!(CaSecretRef::named("x").key, CaSecretRef::DEFAULT_KEY);
    }

    #[test]
    fn a_client_key_defaults_to_the_certificates_secret() {
        let cert = CertSecretRef::named("my-tls");
        let [ca, c, k] = tls_refs(None, Some(&cert), None);
        assert_eq!(ca, None);
        assert_eq!(
            c.map(|c| (c.name, c.key)),
            Some(("my-tls".into(), "tls.crt".into()))
        );
        assert_eq!(
            k.map(|k| (k.name, k.key)),
            Some(("my-tls".into(), "tls.key".into()))
        );
        let own = KeySecretRef::named("other");
        let [_, _, k] = tls_refs(None, Some(&cert), Some(&own));
        assert_eq!(k.map(|k| k.name), Some("other".into()));
        assert_eq!(tls_refs(None, None, None), [None, None, None]);
    }
}
