//! A counting TCP proxy for the PostgreSQL wire protocol: it forwards bytes
//! both ways unchanged and reads the framing of what the server sends
//! (1 type byte, then a big-endian i32 length that includes itself) to count
//! round trips and statements, whatever the client library does.
//!
//! - A round trip is a *flight*: what the client sends between two answers
//!   of the server (its ReadyForQuery), however many messages it pipelines
//!   in it. It also reads the framing of what the client sends, to tell:
//! - a flight with a Sync and no Execute is sqlx's ping (on release of a
//!   pooled connection, and on acquire of an idle one with
//!   `test_before_acquire`, the default), with whatever sqlx queued to go
//!   with it (the `ROLLBACK` of a dropped transaction);
//! - `Z` ReadyForQuery ends every simple Query and every Sync.
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
    pub flights: u64,
    pub ping_flights: u64,
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
            flights: self.flights - o.flights,
            ping_flights: self.ping_flights - o.ping_flights,
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
    flights: AtomicU64,
    ping_flights: AtomicU64,
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
    /// Listens on 127.0.0.1:0; every connection accepted is relayed to
    /// `upstream`, each answer of the server held back `delay` (a database
    /// on another host: the round trip time loopback does not have).
    pub async fn start(upstream: String, delay: std::time::Duration) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counters = Arc::<Counters>::default();
        let shared = counters.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, counters) = (upstream.clone(), shared.clone());
                // A connection's end (Terminate, a reset) is no error worth reporting.
                tokio::spawn(async move { relay(client, &upstream, &counters, delay).await });
            }
        });
        Ok(Proxy { addr, counters })
    }

    /// The counts so far; the figures of a window are the difference of two.
    pub fn counts(&self) -> Counts {
        let c = &self.counters;
        Counts {
            flights: c.flights.load(Relaxed),
            ping_flights: c.ping_flights.load(Relaxed),
            ready: c.ready.load(Relaxed),
            sync_only: c.sync_only.load(Relaxed),
            complete: c.complete.load(Relaxed),
            parsed: c.parsed.load(Relaxed),
            errors: c.errors.load(Relaxed),
        }
    }
}

async fn relay(
    client: TcpStream,
    upstream: &str,
    counters: &Counters,
    delay: std::time::Duration,
) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream).await?;
    // Both hops without Nagle: a proxy must not hold back a partial segment.
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Set when the server answered (a ReadyForQuery): what the client sends
    // next starts a new flight.
    let answered = std::sync::atomic::AtomicBool::new(false);
    let up = async {
        let mut flight = Flight::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0 {
                return server_write.shutdown().await;
            }
            if answered.swap(false, Relaxed) {
                flight.start(counters);
            }
            flight.feed(&buf[..n]);
            server_write.write_all(&buf[..n]).await?;
        }
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
            let answer = framing.feed(&buf[..n], counters);
            if answer && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if answer {
                answered.store(true, Relaxed);
            }
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
    /// Counts the messages in `bytes`; whether a ReadyForQuery (past
    /// start-up) was among them.
    fn feed(&mut self, mut bytes: &[u8], counters: &Counters) -> bool {
        let mut answered = false;
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
                answered |= self.message(self.header[0], counters);
            }
        }
        answered
    }

    fn message(&mut self, kind: u8, counters: &Counters) -> bool {
        if !self.ready {
            self.ready = kind == b'Z';
            return false;
        }
        if kind == b'Z' {
            counters.ready.fetch_add(1, Relaxed);
            if self.since_ready == 0 {
                counters.sync_only.fetch_add(1, Relaxed);
            }
            self.since_ready = 0;
            return true;
        }
        self.since_ready += 1;
        let counter = match kind {
            b'C' => &counters.complete,
            b'1' => &counters.parsed,
            b'E' => &counters.errors,
            _ => return false,
        };
        counter.fetch_add(1, Relaxed);
        false
    }
}

/// The client→server stream of one connection: its flights, cut into
/// messages to tell pings from statements. The first message (start-up) has
/// no type byte; flights begin only after the server's first answer.
#[derive(Default)]
struct Flight {
    /// Past the untyped start-up message.
    typed: bool,
    header: [u8; 5],
    header_len: usize,
    skip: usize,
    /// A flight is open: `start` counts it when the next one begins.
    open: bool,
    sync: bool,
    execute: bool,
}

impl Flight {
    /// Ends the open flight (counting it) and opens the next.
    fn start(&mut self, counters: &Counters) {
        if self.open {
            counters.flights.fetch_add(1, Relaxed);
            if self.sync && !self.execute {
                counters.ping_flights.fetch_add(1, Relaxed);
            }
        }
        (self.open, self.sync, self.execute) = (true, false, false);
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            // The start-up message: a length (that includes itself), no type.
            let header = if self.typed { 5 } else { 4 };
            let n = (header - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
            self.header_len += n;
            bytes = &bytes[n..];
            if self.header_len == header {
                self.header_len = 0;
                let len_at = header - 4;
                let len = i32::from_be_bytes(
                    self.header[len_at..len_at + 4].try_into().expect("4 bytes"),
                );
                self.skip = (len as usize).saturating_sub(4);
                if self.typed {
                    match self.header[0] {
                        b'S' => self.sync = true,
                        b'E' => self.execute = true,
                        _ => {}
                    }
                }
                self.typed = true;
            }
        }
    }
}
