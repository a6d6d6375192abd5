//! What the Redis stores share: how they connect and how they express TTLs.

use std::time::Duration;

use redis::aio::ConnectionManager;

use crate::{Error, Result};

/// The CA and client certificate for a `rediss://` connection (feature
/// `tls`): what `RedisStore::connect_with_tls` (`http`) and
/// `RedisWindow::connect_with_tls` (`window`) take.
///
/// ```
/// let tls = idempo::RedisTls::new()
///     .ca_pem(b"-----BEGIN CERTIFICATE-----...".to_vec())
///     .client_identity_pem(b"client certificate".to_vec(), b"client key".to_vec());
/// ```
#[cfg(feature = "tls")]
#[derive(Clone, Default)]
pub struct RedisTls {
    ca_pem: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

#[cfg(feature = "tls")]
impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A client key must not reach a log.
        f.debug_struct("RedisTls")
            .field("custom_ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

#[cfg(feature = "tls")]
impl RedisTls {
    /// The system's root certificates, no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts this CA (PEM) instead of the system's roots.
    #[must_use]
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Presents this client certificate and key (PEM): mutual TLS.
    #[must_use]
    pub fn client_identity_pem(
        mut self,
        certificate: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.identity = Some((certificate.into(), key.into()));
        self
    }

    fn certificates(self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .identity
                .map(|(client_cert, client_key)| redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                }),
            root_cert: self.ca_pem,
        }
    }
}

/// A connection manager for `url` with 2-second connection and response
/// timeouts, so that a Redis outage fails calls quickly instead of hanging them.
/// `tls` replaces the system's roots (and adds a client certificate) for a
/// `rediss://` URL.
pub(crate) async fn connect(url: &str, tls: Option<TlsCertificates>) -> Result<ConnectionManager> {
    let client = client(url, tls)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(2)))
        .set_number_of_retries(1);
    // The manager connects before it returns: a refused handshake is reported
    // here, at start, rather than on the first request.
    match ConnectionManager::new_with_config(client.clone(), config).await {
        Ok(manager) => Ok(manager),
        Err(e) => Err(connect_error(url, &client, e).await),
    }
}

/// Why a `rediss://` connection failed, when TLS is the reason: a rustls
/// error (an untrusted certificate, a refused client certificate), or a
/// server that answers plain RESP (it never answers the TLS hello: the
/// client only times out).
async fn connect_error(url: &str, client: &redis::Client, error: redis::RedisError) -> Error {
    #[cfg(feature = "tls")]
    if let redis::ConnectionAddr::TcpTls { host, port, .. } = client.get_connection_info().addr() {
        let reason = match crate::error::tls_failure(&error) {
            Some(rustls) => Some(format!("TLS handshake failed: {rustls}")),
            None if speaks_plain_resp(host, *port).await => Some(
                "the server does not speak TLS: it answers plain Redis (use redis://)".to_owned(),
            ),
            None => None,
        };
        if let Some(reason) = reason {
            return Error::Tls {
                service: "Redis".into(),
                reason: format!("{}: {reason}", crate::redact_url(url)),
            };
        }
    }
    let _ = (url, client);
    crate::StoreError::Redis(error).into()
}

/// Whether `host:port` answers a plain `PING` in RESP (`+PONG`, or an error
/// such as `-NOAUTH`): a server without TLS.
#[cfg(feature = "tls")]
async fn speaks_plain_resp(host: &str, port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        stream.write_all(b"PING\r\n").await.ok()?;
        let mut first = [0u8; 1];
        stream.read_exact(&mut first).await.ok()?;
        Some(matches!(first[0], b'+' | b'-'))
    };
    tokio::time::timeout(Duration::from_secs(2), probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

#[cfg(feature = "tls")]
type TlsCertificates = RedisTls;
#[cfg(not(feature = "tls"))]
type TlsCertificates = std::convert::Infallible;

fn client(url: &str, tls: Option<TlsCertificates>) -> Result<redis::Client> {
    if url.starts_with("rediss://") && cfg!(not(feature = "tls")) {
        return Err(Error::Config(
            "a rediss:// URL needs idempo's `tls` feature".into(),
        ));
    }
    match tls {
        #[cfg(feature = "tls")]
        Some(tls) => Ok(redis::Client::build_with_tls(url, tls.certificates())?),
        #[cfg(not(feature = "tls"))]
        Some(never) => match never {},
        None => Ok(redis::Client::open(url)?),
    }
}

/// A `PX` argument: whole milliseconds, at least 1 (Redis refuses 0).
pub(crate) fn px(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
