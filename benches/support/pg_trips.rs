//! A counting TCP proxy for the PostgreSQL wire protocol: it forwards bytes
//! both ways unchanged and reads the framing of what the server sends
//! (1 type byte, then a big-endian i32 length that includes itself) to count
//! round trips and statements, whatever the client library does.
//!
//! - `Z` ReadyForQuery ends every simple Query and every Sync: one per round trip.
//! - A `Z` with no other message since the previous one answered a Sync alone:
//!   sqlx's ping (on release of a pooled connection, and on acquire of an idle
//!   one with `test_before_acquire`, the default).
//! - `C` CommandComplete: one per statement executed. `E` ErrorResponse.
//! - `1` ParseComplete: one per statement prepared (sqlx prepares each new
//!   statement once per connection, in a round trip of its own).
//!
//! A connection's start-up (authentication, ParameterStatus, BackendKeyData,
//! its first ReadyForQuery) is not counted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the server sent, over all connections through the proxy.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub ready: u64,
    pub sync_only: u64,
    pub complete: u64,
    pub parsed: u64,
    pub errors: u64,
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        Counts {
            ready: self.ready - o.ready,
            sync_only: self.sync_only - o.sync_only,
            complete: self.complete - o.complete,
            parsed: self.parsed - o.parsed,
            errors: self.errors - o.errors,
        }
    }
}

#[derive(Default)]
struct Counters {
    ready: AtomicU64,
    sync_only: AtomicU64,
    complete: AtomicU64,
    parsed: AtomicU64,
    errors: AtomicU64,
}

pub struct Proxy {
    pub addr: SocketAddr,
    counters: Arc<Counters>,
}

impl Proxy {
    /// Listens on 127.0.0.1:0; every connection accepted is relayed to `upstream`.
    pub async fn start(upstream: String) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counters = Arc::<Counters>::default();
        let shared = counters.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, counters) = (upstream.clone(), shared.clone());
                // A connection's end (Terminate, a reset) is no error worth reporting.
                tokio::spawn(async move { relay(client, &upstream, &counters).await });
            }
        });
        Ok(Proxy { addr, counters })
    }

    /// The counts so far; the figures of a window are the difference of two.
    pub fn counts(&self) -> Counts {
        let c = &self.counters;
        Counts {
            ready: c.ready.load(Relaxed),
            sync_only: c.sync_only.load(Relaxed),
            complete: c.complete.load(Relaxed),
            parsed: c.parsed.load(Relaxed),
            errors: c.errors.load(Relaxed),
        }
    }
}

async fn relay(client: TcpStream, upstream: &str, counters: &Counters) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream).await?;
    // Both hops without Nagle: a proxy must not hold back a partial segment.
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = async {
        tokio::io::copy(&mut client_read, &mut server_write).await?;
        server_write.shutdown().await
    };
    let down = async {
        let mut framing = Framing::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = server_read.read(&mut buf).await?;
            if n == 0 {
                return client_write.shutdown().await;
            }
            // Counted before the client sees it: a reader of the counts after
            // the client's reply never misses that reply's messages.
            framing.feed(&buf[..n], counters);
            client_write.write_all(&buf[..n]).await?;
        }
    };
    tokio::try_join!(up, down)?;
    Ok(())
}

/// The server→client stream of one connection, cut into messages.
#[derive(Default)]
struct Framing {
    /// Any byte seen yet.
    started: bool,
    /// Past start-up: the connection's first ReadyForQuery has been seen.
    ready: bool,
    /// The server accepted TLS: the rest is opaque (the bench disables TLS).
    opaque: bool,
    header: [u8; 5],
    header_len: usize,
    /// Bytes of the current message's body still to pass.
    skip: usize,
    /// Messages since the last ReadyForQuery.
    since_ready: u64,
}

impl Framing {
    fn feed(&mut self, mut bytes: &[u8], counters: &Counters) {
        if !self.started && !bytes.is_empty() {
            self.started = true;
            // The answer to an SSLRequest (or GSSENCRequest) is one unframed
            // byte. A framed stream's first message is `R`, `E` or `v`, so an
            // `N` or `S` here can only be that answer.
            match bytes[0] {
                b'N' => bytes = &bytes[1..],
                b'S' => {
                    eprintln!("pg_trips: the server accepted TLS; this connection is not counted");
                    self.opaque = true;
                }
                _ => {}
            }
        }
        while !bytes.is_empty() && !self.opaque {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (5 - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
            self.header_len += n;
            bytes = &bytes[n..];
            if self.header_len == 5 {
                self.header_len = 0;
                let len = i32::from_be_bytes(self.header[1..5].try_into().expect("4 bytes"));
                self.skip = (len as usize).saturating_sub(4);
                self.message(self.header[0], counters);
            }
        }
    }

    fn message(&mut self, kind: u8, counters: &Counters) {
        if !self.ready {
            self.ready = kind == b'Z';
            return;
        }
        if kind == b'Z' {
            counters.ready.fetch_add(1, Relaxed);
            if self.since_ready == 0 {
                counters.sync_only.fetch_add(1, Relaxed);
            }
            self.since_ready = 0;
            return;
        }
        self.since_ready += 1;
        let counter = match kind {
            b'C' => &counters.complete,
            b'1' => &counters.parsed,
            b'E' => &counters.errors,
            _ => return,
        };
        counter.fetch_add(1, Relaxed);
    }
}
