//! [`ClientTls`]: the one shape of a TLS client's settings, for every
//! service idempo connects to with its own client (RabbitMQ's `amqps://`,
//! Redis's `rediss://`). PostgreSQL takes its files in the URL
//! (`sslrootcert`, `sslcert`, `sslkey`), as libpq does.

use std::fmt;
use std::path::PathBuf;

use crate::{Error, Result};

/// Where a TLS client finds its trust and its identity: the CA certificates
/// to trust instead of the system's roots, and a client certificate with
/// its key (mutual TLS), each as PEM bytes or as a file. Files are read and
/// checked when the settings are used, and a bad one is named
/// ([`Error::Certificate`]).
///
/// ```
/// use idempo::ClientTls;
///
/// // In PEM, as a secret store hands them out:
/// let tls = ClientTls::new()
///     .ca_pem(b"-----BEGIN CERTIFICATE-----...".to_vec())
///     .client_identity_pem(b"client certificate".to_vec(), b"client key".to_vec());
/// // As files, named by AMQP_CA_FILE, AMQP_CLIENT_CERT_FILE, AMQP_CLIENT_KEY_FILE:
/// let from_env = ClientTls::from_env("AMQP")?;
/// # Ok::<_, idempo::Error>(())
/// ```
///
/// # Default
/// The system's root certificates, no client certificate.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ClientTls {
    pub(crate) ca: Option<Pem>,
    /// The client certificate and its key.
    pub(crate) identity: Option<(Pem, Pem)>,
}

/// PEM bytes, or the file that holds them.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Pem {
    Bytes(Vec<u8>),
    File(PathBuf),
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Keys must not reach a log: files by path, PEM by presence.
        let source = |pem: &Pem| match pem {
            Pem::Bytes(_) => "PEM".to_owned(),
            Pem::File(path) => path.display().to_string(),
        };
        f.debug_struct("ClientTls")
            .field("ca", &self.ca.as_ref().map(source))
            .field(
                "client_certificate",
                &self.identity.as_ref().map(|(c, _)| source(c)),
            )
            .finish()
    }
}

impl ClientTls {
    /// The system's root certificates, no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// The files named by `{prefix}_CA_FILE`, `{prefix}_CLIENT_CERT_FILE`
    /// and `{prefix}_CLIENT_KEY_FILE` (unset or empty: none), as the
    /// `payments` example and the `idempo` command read them with the
    /// prefix `AMQP`.
    ///
    /// # Errors
    /// [`Error::Config`] when one of the client certificate and its key is
    /// named without the other.
    pub fn from_env(prefix: &str) -> Result<Self> {
        let var = |suffix: &str| {
            std::env::var_os(format!("{prefix}_{suffix}"))
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        Self::files(
            var("CA_FILE"),
            var("CLIENT_CERT_FILE"),
            var("CLIENT_KEY_FILE"),
        )
        .map_err(|_| {
            Error::Config(format!(
                "a client certificate needs both {prefix}_CLIENT_CERT_FILE and \
                 {prefix}_CLIENT_KEY_FILE"
            ))
        })
    }

    /// Settings from optional files, as a command line takes them: a CA
    /// file, and a client certificate file with its key file.
    ///
    /// # Errors
    /// [`Error::Config`] when one of the client certificate and its key is
    /// given without the other.
    pub fn files(
        ca: Option<PathBuf>,
        certificate: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Result<Self> {
        let mut tls = ClientTls::new();
        if let Some(ca) = ca {
            tls = tls.ca_file(ca);
        }
        match (certificate, key) {
            (Some(certificate), Some(key)) => Ok(tls.client_identity_files(certificate, key)),
            (None, None) => Ok(tls),
            _ => Err(Error::Config(
                "a client certificate needs both its certificate file and its key file".into(),
            )),
        }
    }

    /// Trusts this CA (PEM) instead of the system's roots.
    #[must_use]
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(Pem::Bytes(pem.into()));
        self
    }

    /// Trusts the CA certificates in this PEM file instead of the system's
    /// roots.
    #[must_use]
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca = Some(Pem::File(path.into()));
        self
    }

    /// Presents this client certificate and key (PEM; an unencrypted
    /// PKCS#8, PKCS#1 or SEC1 key): mutual TLS.
    #[must_use]
    pub fn client_identity_pem(
        mut self,
        certificate: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.identity = Some((Pem::Bytes(certificate.into()), Pem::Bytes(key.into())));
        self
    }

    /// Presents the client certificate and key in these PEM files.
    #[must_use]
    pub fn client_identity_files(
        mut self,
        certificate: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.identity = Some((Pem::File(certificate.into()), Pem::File(key.into())));
        self
    }

    /// Whether these are the defaults (the system's roots, no client
    /// certificate).
    pub fn is_default(&self) -> bool {
        self.ca.is_none() && self.identity.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_without_its_key_is_refused() {
        let only_cert = ClientTls::files(None, Some("c.pem".into()), None);
        assert!(matches!(only_cert, Err(Error::Config(_))));
        let only_key = ClientTls::files(None, None, Some("k.pem".into()));
        assert!(matches!(only_key, Err(Error::Config(_))));
        assert!(ClientTls::files(None, None, None).unwrap().is_default());
    }

    #[test]
    fn debug_shows_no_key_material() {
        let tls = ClientTls::new().client_identity_pem(b"CERT".to_vec(), b"SECRET KEY".to_vec());
        let shown = format!("{tls:?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.contains("PEM"), "{shown}");
    }
}
