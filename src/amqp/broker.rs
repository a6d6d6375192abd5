//! [`Broker`]: where RabbitMQ is (one node, or the nodes of a cluster), how
//! to reach it (TLS, timeouts), and the connection that finds a live node.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use lapin::tcp::OwnedTLSConfig;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};

use super::error::{AmqpError, NodeFailure};
use crate::redact::redact_url;
use crate::{Error, Result};

/// How long a connection attempt to one node may take, by default: the TCP
/// connect, the TLS handshake and the AMQP handshake together.
pub(crate) const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// The broker a consumer (or a publisher) connects to: one or more node
/// addresses, tried in order (or shuffled) until one answers; TLS settings
/// for `amqps://` addresses; the connection timeout and heartbeat.
///
/// ```
/// use std::time::Duration;
/// use idempo::amqp::Broker;
///
/// // One URL per node of the cluster; a comma-separated list works too.
/// let broker = Broker::new("amqp://guest:guest@rabbit-1:5672/%2f")?
///     .address("amqp://guest:guest@rabbit-2:5672/%2f")?
///     .address("amqp://guest:guest@rabbit-3:5672/%2f")?
///     .heartbeat(Duration::from_secs(30));
/// assert_eq!(broker.addresses().len(), 3);
/// # Ok::<_, idempo::Error>(())
/// ```
///
/// # Default
/// - addresses tried in the order given (see [`shuffle`](Self::shuffle)); after
///   a lost connection, the next one is tried first;
/// - 10 s per node to connect ([`connection_timeout`](Broker::connection_timeout));
/// - heartbeat: what the broker proposes (RabbitMQ: 60 s), unless the URL's
///   `heartbeat` query parameter or [`heartbeat`](Self::heartbeat) says otherwise;
/// - TLS (`amqps://`, feature `tls`): the system's root certificates, no
///   client certificate.
#[derive(Clone)]
pub struct Broker {
    addresses: Vec<String>,
    shuffle: bool,
    heartbeat: Option<Duration>,
    connection_timeout: Duration,
    ca_pem: Option<String>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Addresses carry passwords: shown without them.
        let addresses: Vec<String> = self.addresses.iter().map(|a| redact_url(a)).collect();
        f.debug_struct("Broker")
            .field("addresses", &addresses)
            .field("shuffle", &self.shuffle)
            .field("heartbeat", &self.heartbeat)
            .field("connection_timeout", &self.connection_timeout)
            .field("custom_ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

impl Broker {
    /// A broker at `addresses`: one AMQP URL, or several separated by commas
    /// (one per node of a cluster).
    ///
    /// # Errors
    /// [`Error::Config`] when an address is not an AMQP URL.
    pub fn new(addresses: &str) -> Result<Self> {
        let mut broker = Broker {
            addresses: Vec::new(),
            shuffle: false,
            heartbeat: None,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            ca_pem: None,
            identity: None,
        };
        for address in crate::amqp::urls::split(addresses) {
            broker = broker.address(address)?;
        }
        if broker.addresses.is_empty() {
            return Err(Error::Config("no broker address given".into()));
        }
        Ok(broker)
    }

    /// Adds the address of another node.
    ///
    /// # Errors
    /// [`Error::Config`] when it is not an AMQP URL.
    pub fn address(mut self, address: &str) -> Result<Self> {
        AMQPUri::from_str(address).map_err(|e| {
            Error::Config(format!("{:?} is not an AMQP URL: {e}", redact_url(address)))
        })?;
        self.addresses.push(address.to_owned());
        Ok(self)
    }

    /// The addresses, in the order given.
    pub fn addresses(&self) -> &[String] {
        &self.addresses
    }

    /// Tries the nodes in a random order (so that replicas spread over the
    /// cluster) instead of in the order given.
    #[must_use]
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The heartbeat interval to propose: a dead connection is noticed after
    /// about two of them.
    #[must_use]
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = Some(interval);
        self
    }

    /// How long an attempt to reach one node may take before the next is
    /// tried: the TCP connect, the TLS handshake and the AMQP handshake
    /// together.
    #[must_use]
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The TLS settings of `amqps://` addresses: the CA to trust instead of
    /// the system's roots, a client certificate to present (mutual TLS).
    /// Files are read and checked now.
    ///
    /// ```
    /// use idempo::ClientTls;
    /// use idempo::amqp::Broker;
    ///
    /// // AMQP_CA_FILE, AMQP_CLIENT_CERT_FILE, AMQP_CLIENT_KEY_FILE (unset: the defaults)
    /// let tls = ClientTls::from_env("AMQP")?;
    /// let broker = Broker::new("amqps://guest:guest@rabbit:5671/%2f")?.tls(&tls)?;
    /// # Ok::<_, idempo::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Certificate`] naming the file that is missing or unusable;
    /// [`Error::Config`] for settings other than the defaults without
    /// idempo's `tls` feature.
    pub fn tls(self, tls: &crate::ClientTls) -> Result<Self> {
        if tls.is_default() {
            return Ok(self);
        }
        #[cfg(not(feature = "tls"))]
        return Err(Error::Config(
            "TLS settings for amqps:// need idempo's `tls` feature".into(),
        ));
        #[cfg(feature = "tls")]
        {
            let loaded = tls.load()?;
            Ok(Broker {
                ca_pem: loaded
                    .ca_pem
                    .map(|pem| String::from_utf8_lossy(&pem).into_owned()),
                identity: loaded.identity,
                ..self
            })
        }
    }

    /// The lapin TLS configuration of these settings.
    pub(crate) fn tls_config(&self) -> OwnedTLSConfig {
        OwnedTLSConfig {
            identity: self
                .identity
                .as_ref()
                .map(|(pem, key)| lapin::tcp::OwnedIdentity::PKCS8 {
                    pem: pem.clone(),
                    key: key.clone(),
                }),
            cert_chain: self.ca_pem.clone(),
        }
    }

    /// The address at `index`, with this broker's heartbeat and timeout
    /// written into its query.
    pub(crate) fn uri(&self, index: usize) -> Result<AMQPUri> {
        let address = &self.addresses[index % self.addresses.len()];
        let mut uri = AMQPUri::from_str(address)
            .map_err(|e| Error::Config(format!("{:?}: {e}", redact_url(address))))?;
        if let Some(heartbeat) = self.heartbeat {
            uri.query.heartbeat = Some(heartbeat.as_secs().clamp(1, u64::from(u16::MAX)) as u16);
        }
        uri.query.connection_timeout = Some(self.connection_timeout.as_millis() as u64);
        Ok(uri)
    }

    /// The order in which to try the nodes, starting after `last` (the node
    /// of the connection that was lost, if any).
    pub(crate) fn order(&self, last: Option<usize>) -> Vec<usize> {
        let n = self.addresses.len();
        let mut order: Vec<usize> = match last {
            Some(last) => (1..=n).map(|i| (last + i) % n).collect(),
            None => (0..n).collect(),
        };
        if self.shuffle {
            fastrand::shuffle(&mut order);
        }
        order
    }

    /// Connects to the first node that answers, starting after `last`.
    /// Returns the connection and the index of its node. Each node gets the
    /// [`connection_timeout`](Self::connection_timeout) for the TCP connect,
    /// the TLS handshake and the AMQP handshake together.
    ///
    /// # Errors
    /// Each names every node tried and why it failed:
    /// [`Error::Tls`] when every node refused the TLS handshake (a wrong CA,
    /// a host name the certificate does not name, a port that does not speak
    /// TLS); [`AmqpError::BrokerRefused`] when every node refused the connection
    /// for a configuration reason (credentials, vhost, TLS, an `amqp://` URL
    /// to a TLS port); [`AmqpError::BrokerUnreachable`] otherwise (refused TCP
    /// connections, nodes that did not answer in time, lost connections);
    /// [`Error::Certificate`] when `SSL_CERT_FILE` names an unusable file.
    pub(crate) async fn connect_from(
        &self,
        last: Option<usize>,
        name: &str,
    ) -> Result<(Connection, usize)> {
        let mut failures: Vec<(Failure, NodeFailure)> = Vec::new();
        for index in self.order(last) {
            let uri = self.uri(index)?;
            let tls = uri.scheme == AMQPScheme::AMQPS;
            if tls && self.ca_pem.is_none() {
                // The AMQP client reads it for the roots; a bad one would show
                // as an untrusted certificate.
                check_ssl_cert_file()?;
            }
            let properties =
                ConnectionProperties::default().with_connection_name(name.to_owned().into());
            let runtime = lapin::runtime::default_runtime()?;
            let connecting =
                Connection::connect_uri_with_config(uri, properties, self.tls_config(), runtime);
            let node = redact_url(&self.addresses[index]);
            // One bound for TCP, TLS and AMQP together: lapin's async connect
            // does not apply the URL's timeout, and a node that accepts TCP and
            // never answers would otherwise hold us forever.
            let failure = match tokio::time::timeout(self.connection_timeout, connecting).await {
                Ok(Ok(connection)) => {
                    // Failed over: the nodes passed over are worth a look.
                    // (When every node fails, the error names them all.)
                    for (_, failed) in &failures {
                        tracing::warn!(node = %failed.node, reason = %failed.reason,
                            "cannot connect to this node; connected to the next");
                    }
                    return Ok((connection, index));
                }
                Ok(Err(e)) => classify(&e, tls),
                Err(_) => (
                    Failure::Outage,
                    format!(
                        "no answer within {:?} (the connection timeout)",
                        self.connection_timeout
                    ),
                ),
            };
            tracing::debug!(%node, reason = %failure.1, "cannot connect to this node");
            failures.push((
                failure.0,
                NodeFailure {
                    node,
                    reason: failure.1,
                },
            ));
        }
        let every = |kind: &[Failure]| failures.iter().all(|(f, _)| kind.contains(f));
        let nodes = || failures.iter().map(|(_, n)| n.clone()).collect::<Vec<_>>();
        if failures.is_empty() {
            return Err(Error::Config("no broker address".into()));
        }
        if every(&[Failure::Tls]) {
            return Err(Error::Tls {
                service: "RabbitMQ".into(),
                reason: nodes()
                    .iter()
                    .map(|n| format!("{}: {}", n.node, n.reason))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        if every(&[Failure::Tls, Failure::Refused]) {
            return Err(AmqpError::BrokerRefused { nodes: nodes() }.into());
        }
        Err(AmqpError::BrokerUnreachable { nodes: nodes() }.into())
    }

    /// Connects to the first node that answers (for publishers and tools).
    ///
    /// # Errors
    /// As for the consumer: [`Error::Tls`] when every node refused the TLS
    /// handshake, [`AmqpError::BrokerRefused`] when every node refused the
    /// credentials, the vhost or the scheme, [`AmqpError::BrokerUnreachable`]
    /// otherwise; each names every node tried and why it failed.
    pub async fn connect(&self, connection_name: &str) -> Result<Connection> {
        self.connect_from(None, connection_name)
            .await
            .map(|(connection, _)| connection)
    }
}

/// How a connection attempt to one node failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// The TLS handshake failed: a configuration error.
    Tls,
    /// The broker refused the credentials, the vhost or the protocol: a
    /// configuration error.
    Refused,
    /// Refused TCP, no answer, a lost connection: an outage.
    Outage,
}

/// Why lapin could not connect to one node, from the error's type: AMQP
/// close codes, rustls's errors inside the I/O error, a parser error.
fn classify(error: &lapin::Error, tls: bool) -> (Failure, String) {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            let said = amqp.get_message();
            match amqp.get_id() {
                // ACCESS_REFUSED at connect time: the login.
                403 => (
                    Failure::Refused,
                    format!("the user name or password was refused ({said})"),
                ),
                // NOT_ALLOWED (and INVALID_PATH): the vhost.
                530 | 402 => (
                    Failure::Refused,
                    format!("the vhost does not exist or the user may not access it ({said})"),
                ),
                _ => (Failure::Outage, error.to_string()),
            }
        }
        lapin::ErrorKind::AuthProviderError(e) => {
            (Failure::Refused, format!("cannot authenticate: {e}"))
        }
        // The first bytes back were not AMQP: a TLS listener answers a
        // plain client with a TLS alert.
        lapin::ErrorKind::ParsingError(_) | lapin::ErrorKind::InvalidProtocolVersion(_) if !tls => {
            (
                Failure::Refused,
                "the node did not answer in AMQP: this port probably speaks TLS (use amqps://)"
                    .into(),
            )
        }
        lapin::ErrorKind::IOError(io) if tls => match tls_failure(io) {
            Some(reason) => (Failure::Tls, reason),
            None => (Failure::Outage, error.to_string()),
        },
        _ => (Failure::Outage, error.to_string()),
    }
}

/// Checks the file in `SSL_CERT_FILE`, if set: the CA certificates that the
/// AMQP client trusts instead of the system's for `amqps://` (without a CA of
/// its own). An unusable one would otherwise show as `UnknownIssuer`.
///
/// # Errors
/// As [`read_ca_file`](crate::certificate::read_ca_file).
fn check_ssl_cert_file() -> Result<(), crate::certificate::CertificateError> {
    match std::env::var_os("SSL_CERT_FILE") {
        Some(path) if !path.is_empty() => {
            crate::certificate::read_ca_file(std::path::PathBuf::from(path)).map(drop)
        }
        _ => Ok(()),
    }
}

/// The TLS failure inside an I/O error of the handshake, if it is one.
#[cfg(feature = "tls")]
fn tls_failure(io: &std::io::Error) -> Option<String> {
    let rustls = crate::tls::tls_failure(io)?;
    Some(match rustls {
        rustls::Error::InvalidMessage(_) => {
            format!("the port does not speak TLS (use amqp://): {rustls}")
        }
        _ => format!("TLS handshake failed: {rustls}"),
    })
}

#[cfg(not(feature = "tls"))]
fn tls_failure(_: &std::io::Error) -> Option<String> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_and_rotate_after_the_lost_node() {
        let broker = Broker::new("amqp://a:5672, amqp://b:5673,amqp://c:5674").unwrap();
        assert_eq!(broker.addresses().len(), 3);
        assert_eq!(broker.order(None), [0, 1, 2]);
        assert_eq!(broker.order(Some(0)), [1, 2, 0]);
        assert_eq!(broker.order(Some(2)), [0, 1, 2]);
        let mut shuffled = broker.clone().shuffle(true).order(Some(1));
        shuffled.sort();
        assert_eq!(shuffled, [0, 1, 2]);
        assert!(Broker::new("").is_err());
        assert!(Broker::new("http://x").is_err());
    }

    #[test]
    fn passwords_stay_out_of_debug_output() {
        let broker = Broker::new("amqp://guest:secret@rabbit:5672/%2f").unwrap();
        let shown = format!("{broker:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("rabbit:5672"), "{shown}");
    }

    #[test]
    fn heartbeat_and_timeout_go_into_the_uri() {
        let broker = Broker::new("amqp://a")
            .unwrap()
            .heartbeat(Duration::from_secs(15))
            .connection_timeout(Duration::from_secs(3));
        let uri = broker.uri(0).unwrap();
        assert_eq!(uri.query.heartbeat, Some(15));
        assert_eq!(uri.query.connection_timeout, Some(3000));
    }
}
