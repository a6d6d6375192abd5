//! The services' URLs as the environment gives them, parsed in one place:
//! a test that needs an address or a URL of its own (a proxy in front of
//! PostgreSQL or RabbitMQ, another user, another vhost or database) derives
//! it from `DATABASE_URL` or `AMQP_URL`, so that the suite runs against the
//! services those name, wherever they are.

use std::net::SocketAddr;

use url::Url;

/// A parsed `DATABASE_URL` or `AMQP_URL`, with its port always set.
#[derive(Clone, Debug)]
pub struct ServiceUrl(Url);

impl ServiceUrl {
    /// `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`).
    pub fn database() -> ServiceUrl {
        ServiceUrl::parse("DATABASE_URL", &super::database_url())
    }

    /// The first node of `AMQP_URL` (default
    /// `amqp://guest:guest@127.0.0.1:5672/%2f`; a comma-separated list names
    /// the nodes of a cluster).
    pub fn amqp() -> ServiceUrl {
        let urls = super::amqp_url();
        let first = urls.split(',').next().unwrap_or_default().trim();
        ServiceUrl::parse("AMQP_URL", first)
    }

    fn parse(name: &str, text: &str) -> ServiceUrl {
        let mut url = Url::parse(text).unwrap_or_else(|e| panic!("{name} is not a URL: {e}"));
        assert!(url.has_host(), "{name} names no host");
        if url.port().is_none() {
            let port = match url.scheme() {
                "amqp" => 5672,
                "amqps" => 5671,
                _ => 5432, // postgres://, postgresql://
            };
            url.set_port(Some(port))
                .expect("a URL with a host takes a port");
        }
        ServiceUrl(url)
    }

    /// `host:port` of the service, to connect a proxy to.
    pub fn addr(&self) -> String {
        let host = self.0.host_str().expect("checked at parse");
        format!("{host}:{}", self.0.port().expect("set at parse"))
    }

    /// The user name (percent-decoded).
    pub fn user(&self) -> String {
        decode(self.0.username())
    }

    /// The password (percent-decoded), if the URL has one.
    pub fn password(&self) -> Option<String> {
        self.0.password().map(decode)
    }

    /// The same URL with another user and password (`None`: none).
    pub fn with_user(&self, user: &str, password: Option<&str>) -> ServiceUrl {
        let mut url = self.0.clone();
        url.set_username(user)
            .expect("a URL with a host takes a user");
        url.set_password(password)
            .expect("a URL with a host takes a password");
        ServiceUrl(url)
    }

    /// The same URL with the same user and another password.
    pub fn with_password(&self, password: &str) -> ServiceUrl {
        let mut url = self.0.clone();
        url.set_password(Some(password))
            .expect("a URL with a host takes a password");
        ServiceUrl(url)
    }

    /// The same URL with another path: a database name for PostgreSQL, a
    /// vhost for RabbitMQ (`%2f` is `/`).
    pub fn with_path(&self, path: &str) -> ServiceUrl {
        let mut url = self.0.clone();
        url.set_path(&format!("/{path}"));
        ServiceUrl(url)
    }

    /// The same URL, but to `addr` (a proxy in front of the service).
    pub fn through(&self, addr: SocketAddr) -> ServiceUrl {
        let mut url = self.0.clone();
        url.set_ip_host(addr.ip()).expect("a URL with a host");
        url.set_port(Some(addr.port())).expect("a URL with a host");
        ServiceUrl(url)
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl std::fmt::Display for ServiceUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.as_str())
    }
}

impl From<ServiceUrl> for String {
    fn from(url: ServiceUrl) -> String {
        url.0.into()
    }
}

/// Percent-decodes a user name or password as it appears in a URL.
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok());
        match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(byte) if bytes[i] == b'%' => {
                out.push(byte);
                i += 3;
            }
            _ => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
