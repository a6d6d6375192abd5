//! What the Redis stores share: how they connect and how they express TTLs.

use std::time::Duration;

use redis::aio::ConnectionManager;

use crate::{ClientTls, Error, Result};

/// A connection manager for `url` with 2-second connection and response
/// timeouts, so that a Redis outage fails calls quickly instead of hanging them.
/// `tls` replaces the system's roots (and adds a client certificate) for a
/// `rediss://` URL.
pub(crate) async fn connect(url: &str, tls: Option<&ClientTls>) -> Result<ConnectionManager> {
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
        let reason = match crate::tls::tls_failure(&error) {
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

fn client(url: &str, tls: Option<&ClientTls>) -> Result<redis::Client> {
    if url.starts_with("rediss://") && cfg!(not(feature = "tls")) {
        return Err(Error::Config(
            "a rediss:// URL needs idempo's `tls` feature".into(),
        ));
    }
    match tls.filter(|tls| !tls.is_default()) {
        #[cfg(feature = "tls")]
        Some(tls) => {
            let loaded = tls.load()?;
            let certificates = redis::TlsCertificates {
                client_tls: loaded.identity.map(|(client_cert, client_key)| {
                    redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    }
                }),
                root_cert: loaded.ca_pem,
            };
            Ok(redis::Client::build_with_tls(url, certificates)?)
        }
        #[cfg(not(feature = "tls"))]
        Some(_) => Err(Error::Config(
            "TLS settings for rediss:// need idempo's `tls` feature".into(),
        )),
        None => Ok(redis::Client::open(url)?),
    }
}

/// A `PX` argument: whole milliseconds, at least 1 (Redis refuses 0).
pub(crate) fn px(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        crate::StoreError::Redis(e).into()
    }
}
