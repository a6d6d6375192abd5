//! Deliveries the AMQP client cannot parse, moved to the dead-letter queue.
//!
//! RabbitMQ accepts a message whose `message_id`, `content_type` (any short
//! string property) or a header *name* is not valid UTF-8; lapin refuses to
//! parse its frames and drops the connection. The broker then redelivers that
//! message first, and every new session dies the same way: one message would
//! stop the queue. So when a session ends with a frame lapin could not
//! parse, the runtime reads the head of the queue itself, on a connection of
//! its own with a parser that takes any bytes: `basic.get` until it finds
//! the messages whose properties are not UTF-8 (at most a prefetch's worth),
//! publishes each to the DLQ (confirmed, `mandatory`) with the properties made
//! valid (invalid bytes replaced by U+FFFD), the original bytes in
//! `x-idempo-error` and reason `undecodable properties`, and acks it. The
//! well-formed messages it read are handed back by closing the connection.
//!
//! This is a deliberately small AMQP 0-9-1 client: one connection (on
//! lapin's transport, so `amqps://` and the broker's TLS settings work as for
//! the consumer), PLAIN authentication, one channel, `basic.get`,
//! `basic.publish` with confirms, `basic.ack`. Every step is bounded in time.

use std::time::{Duration, SystemTime};

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use lapin::tcp::AMQPUriTcpExt;

use super::broker::Broker;

use super::dead_letter::DeadLetterReason;
use super::headers::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, ERROR_HEADER, FIRST_FAILURE_HEADER, LAST_FAILURE_HEADER,
    QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER, rfc3339,
};

/// How long the whole pass may take.
pub(crate) const TIME_LIMIT: Duration = Duration::from_secs(30);

/// Why a pass could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum QuarantineError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("the broker said: {0}")]
    Broker(String),
    #[error("unexpected frame: {0}")]
    Protocol(String),
    #[error("the broker address: {0}")]
    Address(String),
    #[error("the dead letter was not confirmed: {0}")]
    NotConfirmed(&'static str),
    #[error("took longer than {0:?}")]
    Timeout(Duration),
}

type Result<T> = std::result::Result<T, QuarantineError>;

/// Where to look and what to write on the dead letters.
pub(crate) struct Target<'a> {
    pub(crate) broker: &'a Broker,
    /// The node whose session died.
    pub(crate) node: usize,
    pub(crate) queue: &'a str,
    pub(crate) dead_letter_queue: &'a str,
    pub(crate) consumer: &'a str,
    /// How many messages to read at most (the ones before a bad one stay
    /// unacked meanwhile).
    pub(crate) limit: usize,
}

/// Moves the unparseable messages among the first `limit` of the queue to
/// the DLQ; returns how many it moved.
pub(crate) async fn run(target: &Target<'_>) -> Result<usize> {
    tokio::time::timeout(TIME_LIMIT, pass(target))
        .await
        .map_err(|_| QuarantineError::Timeout(TIME_LIMIT))?
}

async fn pass(target: &Target<'_>) -> Result<usize> {
    let uri = target
        .broker
        .uri(target.node)
        .map_err(|e| QuarantineError::Address(e.to_string()))?;
    let runtime =
        lapin::runtime::default_runtime().map_err(|e| QuarantineError::Address(e.to_string()))?;
    let tls = target.broker.tls();
    let stream = uri
        .connect_with_config_async(tls.as_ref(), &runtime)
        .await?;
    let mut wire = Wire::new(stream);
    wire.open(
        &uri.authority.userinfo.username,
        &uri.authority.userinfo.password,
        &uri.vhost,
    )
    .await?;
    let mut moved = 0;
    let mut publishes = 0u64;
    for _ in 0..target.limit {
        let Some(got) = wire.get(target.queue).await? else {
            break;
        };
        let problems = got.properties.problems(&got.routing_key);
        if problems.is_empty() {
            continue; // well-formed: handed back when the connection closes
        }
        let error = format!("undecodable properties: {}", problems.join("; "));
        tracing::warn!(queue = target.queue, %error, "moving a message the client cannot parse to the dead-letter queue");
        let now = rfc3339(SystemTime::now());
        let text = |s: &str| Value::long_string(s.as_bytes());
        let mut headers = got.properties.headers.clone().unwrap_or_default();
        headers.extend([
            (
                REASON_HEADER.into(),
                text(DeadLetterReason::UndecodableProperties.as_str()),
            ),
            (ERROR_HEADER.into(), text(&error)),
            (CONSUMER_HEADER.into(), text(target.consumer)),
            (QUEUE_HEADER.into(), text(target.queue)),
            (
                ROUTING_KEY_HEADER.into(),
                Value::long_string(&got.routing_key),
            ),
            (
                ATTEMPTS_HEADER.into(),
                Value::Other(b'l', 1i64.to_be_bytes().to_vec()),
            ),
            (FIRST_FAILURE_HEADER.into(), text(&now)),
            (LAST_FAILURE_HEADER.into(), text(&now)),
        ]);
        let mut properties = got.properties.clone();
        properties.headers = Some(headers);
        // As the republisher does: a dead letter must not expire out of the
        // DLQ, and another user's id would be refused.
        properties.expiration = None;
        properties.user_id = None;
        properties.delivery_mode = Some(2);
        publishes += 1;
        wire.publish(target.dead_letter_queue, &properties, &got.body, publishes)
            .await?;
        wire.ack(got.delivery_tag).await?;
        moved += 1;
    }
    wire.close().await;
    Ok(moved)
}

/// A message read with `basic.get`.
struct Got {
    delivery_tag: u64,
    routing_key: Vec<u8>,
    properties: Properties,
    body: Vec<u8>,
}

/// The basic properties, as raw as the wire has them.
#[derive(Debug, Clone, Default, PartialEq)]
struct Properties {
    content_type: Option<Vec<u8>>,
    content_encoding: Option<Vec<u8>>,
    headers: Option<Vec<(Vec<u8>, Value)>>,
    delivery_mode: Option<u8>,
    priority: Option<u8>,
    correlation_id: Option<Vec<u8>>,
    reply_to: Option<Vec<u8>>,
    expiration: Option<Vec<u8>>,
    message_id: Option<Vec<u8>>,
    timestamp: Option<u64>,
    kind: Option<Vec<u8>>,
    user_id: Option<Vec<u8>>,
    app_id: Option<Vec<u8>>,
    cluster_id: Option<Vec<u8>>,
}

/// A field value: tables and arrays parsed (their names may need mending),
/// every other type kept as its type tag and raw bytes.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Table(Vec<(Vec<u8>, Value)>),
    Array(Vec<Value>),
    Other(u8, Vec<u8>),
}

impl Value {
    fn long_string(bytes: &[u8]) -> Value {
        let mut raw = (bytes.len() as u32).to_be_bytes().to_vec();
        raw.extend_from_slice(bytes);
        Value::Other(b'S', raw)
    }
}

impl Properties {
    /// What lapin would refuse: short strings (and names) that are not UTF-8.
    fn problems(&self, routing_key: &[u8]) -> Vec<String> {
        let mut problems = Vec::new();
        let mut check = |what: &str, bytes: &Option<Vec<u8>>| {
            if let Some(bytes) = bytes
                && std::str::from_utf8(bytes).is_err()
            {
                problems.push(format!(
                    "{what} is not valid UTF-8 (hex {})",
                    hex::encode(bytes)
                ));
            }
        };
        check("the routing key", &Some(routing_key.to_vec()));
        check("content_type", &self.content_type);
        check("content_encoding", &self.content_encoding);
        check("correlation_id", &self.correlation_id);
        check("reply_to", &self.reply_to);
        check("expiration", &self.expiration);
        check("message_id", &self.message_id);
        check("type", &self.kind);
        check("user_id", &self.user_id);
        check("app_id", &self.app_id);
        check("cluster_id", &self.cluster_id);
        if let Some(headers) = &self.headers {
            table_problems(headers, &mut problems);
        }
        problems
    }
}

fn table_problems(table: &[(Vec<u8>, Value)], problems: &mut Vec<String>) {
    for (name, value) in table {
        if std::str::from_utf8(name).is_err() {
            problems.push(format!(
                "a header name is not valid UTF-8 (hex {})",
                hex::encode(name)
            ));
        }
        value_problems(value, problems);
    }
}

fn value_problems(value: &Value, problems: &mut Vec<String>) {
    match value {
        Value::Table(table) => table_problems(table, problems),
        Value::Array(values) => values.iter().for_each(|v| value_problems(v, problems)),
        Value::Other(..) => {}
    }
}

/// Reads the wire format.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.buf.len());
        let end = end.ok_or_else(|| QuarantineError::Protocol("a truncated frame".into()))?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn short_string(&mut self) -> Result<Vec<u8>> {
        let len = self.u8()?;
        Ok(self.take(len.into())?.to_vec())
    }

    fn table(&mut self) -> Result<Vec<(Vec<u8>, Value)>> {
        let len = self.u32()? as usize;
        let mut inner = Reader::new(self.take(len)?);
        let mut table = Vec::new();
        while inner.pos < inner.buf.len() {
            let name = inner.short_string()?;
            table.push((name, inner.value()?));
        }
        Ok(table)
    }

    fn value(&mut self) -> Result<Value> {
        let kind = self.u8()?;
        let fixed = |n: usize, r: &mut Self| Ok(Value::Other(kind, r.take(n)?.to_vec()));
        match kind {
            b't' | b'b' | b'B' => fixed(1, self),
            b's' | b'u' => fixed(2, self),
            b'I' | b'i' | b'f' => fixed(4, self),
            b'l' | b'L' | b'd' | b'T' => fixed(8, self),
            b'D' => fixed(5, self),
            b'V' => fixed(0, self),
            b'S' | b'x' => {
                let start = self.pos;
                let len = self.u32()? as usize;
                self.take(len)?;
                Ok(Value::Other(kind, self.buf[start..self.pos].to_vec()))
            }
            b'F' => Ok(Value::Table(self.table()?)),
            b'A' => {
                let len = self.u32()? as usize;
                let mut inner = Reader::new(self.take(len)?);
                let mut values = Vec::new();
                while inner.pos < inner.buf.len() {
                    values.push(inner.value()?);
                }
                Ok(Value::Array(values))
            }
            other => Err(QuarantineError::Protocol(format!(
                "unknown field type {:?}",
                other as char
            ))),
        }
    }

    fn properties(&mut self) -> Result<Properties> {
        let flags = self.u16()?;
        let has = |bit: u16| flags & (1 << bit) != 0;
        let mut p = Properties::default();
        if has(15) {
            p.content_type = Some(self.short_string()?);
        }
        if has(14) {
            p.content_encoding = Some(self.short_string()?);
        }
        if has(13) {
            p.headers = Some(self.table()?);
        }
        if has(12) {
            p.delivery_mode = Some(self.u8()?);
        }
        if has(11) {
            p.priority = Some(self.u8()?);
        }
        if has(10) {
            p.correlation_id = Some(self.short_string()?);
        }
        if has(9) {
            p.reply_to = Some(self.short_string()?);
        }
        if has(8) {
            p.expiration = Some(self.short_string()?);
        }
        if has(7) {
            p.message_id = Some(self.short_string()?);
        }
        if has(6) {
            p.timestamp = Some(self.u64()?);
        }
        if has(5) {
            p.kind = Some(self.short_string()?);
        }
        if has(4) {
            p.user_id = Some(self.short_string()?);
        }
        if has(3) {
            p.app_id = Some(self.short_string()?);
        }
        if has(2) {
            p.cluster_id = Some(self.short_string()?);
        }
        Ok(p)
    }
}

/// Writes the wire format. Strings are made valid UTF-8 on the way out (the
/// point of the copy: whoever reads the DLQ can parse it).
#[derive(Default)]
struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// A short string, mended to UTF-8 and cut to 255 bytes at a character boundary.
    fn short_string(&mut self, bytes: &[u8]) -> &mut Self {
        let text = String::from_utf8_lossy(bytes);
        let mut end = text.len().min(255);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.u8(end as u8);
        self.buf.extend_from_slice(&text.as_bytes()[..end]);
        self
    }

    fn long_string(&mut self, bytes: &[u8]) -> &mut Self {
        self.u32(bytes.len() as u32);
        self.buf.extend_from_slice(bytes);
        self
    }

    fn table(&mut self, table: &[(Vec<u8>, Value)]) -> &mut Self {
        let mut inner = Writer::default();
        for (name, value) in table {
            inner.short_string(name);
            inner.value(value);
        }
        self.long_string(&inner.buf)
    }

    fn value(&mut self, value: &Value) -> &mut Self {
        match value {
            Value::Table(table) => self.u8(b'F').table(table),
            Value::Array(values) => {
                let mut inner = Writer::default();
                values.iter().for_each(|v| {
                    inner.value(v);
                });
                self.u8(b'A').long_string(&inner.buf)
            }
            Value::Other(kind, raw) => {
                self.u8(*kind);
                self.buf.extend_from_slice(raw);
                self
            }
        }
    }

    fn properties(&mut self, p: &Properties) -> &mut Self {
        let strings = [
            (15, &p.content_type),
            (14, &p.content_encoding),
            (10, &p.correlation_id),
            (9, &p.reply_to),
            (8, &p.expiration),
            (7, &p.message_id),
            (5, &p.kind),
            (4, &p.user_id),
            (3, &p.app_id),
            (2, &p.cluster_id),
        ];
        let mut flags = 0u16;
        for (bit, value) in strings {
            if value.is_some() {
                flags |= 1 << bit;
            }
        }
        for (bit, set) in [
            (13, p.headers.is_some()),
            (12, p.delivery_mode.is_some()),
            (11, p.priority.is_some()),
            (6, p.timestamp.is_some()),
        ] {
            if set {
                flags |= 1 << bit;
            }
        }
        self.u16(flags);
        let short = |w: &mut Self, v: &Option<Vec<u8>>| {
            if let Some(v) = v {
                w.short_string(v);
            }
        };
        short(self, &p.content_type);
        short(self, &p.content_encoding);
        if let Some(headers) = &p.headers {
            self.table(headers);
        }
        if let Some(v) = p.delivery_mode {
            self.u8(v);
        }
        if let Some(v) = p.priority {
            self.u8(v);
        }
        short(self, &p.correlation_id);
        short(self, &p.reply_to);
        short(self, &p.expiration);
        short(self, &p.message_id);
        if let Some(v) = p.timestamp {
            self.u64(v);
        }
        short(self, &p.kind);
        short(self, &p.user_id);
        short(self, &p.app_id);
        short(self, &p.cluster_id);
        self
    }
}

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_HEARTBEAT: u8 = 8;
const FRAME_END: u8 = 0xCE;
const CHANNEL: u16 = 1;
/// Each step's bound (the pass as a whole has [`TIME_LIMIT`]).
const STEP: Duration = Duration::from_secs(10);

/// One connection, one channel.
struct Wire<S> {
    stream: S,
    frame_max: u32,
}

/// A method frame's class, method and arguments.
struct Method {
    class: u16,
    method: u16,
    args: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Wire<S> {
    fn new(stream: S) -> Self {
        Wire {
            stream,
            frame_max: 131_072,
        }
    }

    async fn open(&mut self, user: &str, password: &str, vhost: &str) -> Result<()> {
        self.stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
        self.expect(0, 10, 10).await?; // connection.start
        let mut response = vec![0u8];
        response.extend_from_slice(user.as_bytes());
        response.push(0);
        response.extend_from_slice(password.as_bytes());
        let mut w = Writer::default();
        let properties = [(
            b"connection_name".to_vec(),
            Value::long_string(b"idempo quarantine"),
        )];
        w.table(&properties)
            .short_string(b"PLAIN")
            .long_string(&response)
            .short_string(b"en_US");
        self.method(0, 10, 11, &w.buf).await?; // start-ok
        let tune = self.expect(0, 10, 30).await?;
        let mut r = Reader::new(&tune.args);
        let channel_max = r.u16()?;
        let frame_max = r.u32()?;
        if frame_max != 0 {
            self.frame_max = self.frame_max.min(frame_max);
        }
        let mut w = Writer::default();
        w.u16(channel_max).u32(self.frame_max).u16(0); // no heartbeats
        self.method(0, 10, 31, &w.buf).await?; // tune-ok
        let mut w = Writer::default();
        w.short_string(vhost.as_bytes()).short_string(b"").u8(0);
        self.method(0, 10, 40, &w.buf).await?; // connection.open
        self.expect(0, 10, 41).await?;
        self.method(CHANNEL, 20, 10, &[0]).await?; // channel.open
        self.expect(CHANNEL, 20, 11).await?;
        self.method(CHANNEL, 85, 10, &[0]).await?; // confirm.select
        self.expect(CHANNEL, 85, 11).await?;
        Ok(())
    }

    async fn get(&mut self, queue: &str) -> Result<Option<Got>> {
        let mut w = Writer::default();
        w.u16(0).short_string(queue.as_bytes()).u8(0); // no-ack off
        self.method(CHANNEL, 60, 70, &w.buf).await?;
        let reply = self.next_method().await?;
        match (reply.class, reply.method) {
            (60, 72) => Ok(None), // get-empty
            (60, 71) => {
                let mut r = Reader::new(&reply.args);
                let delivery_tag = r.u64()?;
                let _redelivered = r.u8()?;
                let _exchange = r.short_string()?;
                let routing_key = r.short_string()?;
                let (kind, _, header) = self.frame().await?;
                if kind != FRAME_HEADER {
                    return Err(QuarantineError::Protocol(
                        "expected a content header".into(),
                    ));
                }
                let mut r = Reader::new(&header);
                let (_class, _weight) = (r.u16()?, r.u16()?);
                let size = r.u64()? as usize;
                let properties = r.properties()?;
                let mut body = Vec::with_capacity(size);
                while body.len() < size {
                    let (kind, _, chunk) = self.frame().await?;
                    if kind != FRAME_BODY {
                        return Err(QuarantineError::Protocol("expected a body frame".into()));
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(Some(Got {
                    delivery_tag,
                    routing_key,
                    properties,
                    body,
                }))
            }
            (class, method) => Err(QuarantineError::Protocol(format!(
                "basic.get answered with {class}.{method}"
            ))),
        }
    }

    /// Publishes to `queue` through the default exchange and waits for the
    /// confirm of publish number `sequence`.
    async fn publish(
        &mut self,
        queue: &str,
        properties: &Properties,
        body: &[u8],
        sequence: u64,
    ) -> Result<()> {
        let mut w = Writer::default();
        w.u16(0)
            .short_string(b"")
            .short_string(queue.as_bytes())
            .u8(1); // mandatory
        self.method(CHANNEL, 60, 40, &w.buf).await?;
        let mut w = Writer::default();
        w.u16(60)
            .u16(0)
            .u64(body.len() as u64)
            .properties(properties);
        self.write_frame(FRAME_HEADER, CHANNEL, &w.buf).await?;
        let chunk = (self.frame_max as usize).saturating_sub(8).max(1);
        for part in body.chunks(chunk) {
            self.write_frame(FRAME_BODY, CHANNEL, part).await?;
        }
        let mut returned = false;
        loop {
            let reply = self.next_method().await?;
            match (reply.class, reply.method) {
                (60, 50) => {
                    // basic.return: its content follows; the ack comes after.
                    returned = true;
                    let (_, _, header) = self.frame().await?;
                    let mut r = Reader::new(&header);
                    let (_c, _w, size) = (r.u16()?, r.u16()?, r.u64()? as usize);
                    let mut read = 0;
                    while read < size {
                        read += self.frame().await?.2.len();
                    }
                }
                (60, 80) => {
                    let tag = Reader::new(&reply.args).u64()?;
                    if tag < sequence {
                        continue;
                    }
                    return match returned {
                        false => Ok(()),
                        true => Err(QuarantineError::NotConfirmed(
                            "unroutable: the dead-letter queue does not exist",
                        )),
                    };
                }
                (60, 120) => return Err(QuarantineError::NotConfirmed("nacked")),
                (class, method) => {
                    return Err(QuarantineError::Protocol(format!(
                        "publish answered with {class}.{method}"
                    )));
                }
            }
        }
    }

    async fn ack(&mut self, delivery_tag: u64) -> Result<()> {
        let mut w = Writer::default();
        w.u64(delivery_tag).u8(0);
        self.method(CHANNEL, 60, 80, &w.buf).await
    }

    /// Closes the connection; the messages read and not acked go back.
    async fn close(mut self) {
        let mut w = Writer::default();
        w.u16(200).short_string(b"done").u16(0).u16(0);
        if self.method(0, 10, 50, &w.buf).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(2), self.expect(0, 10, 51)).await;
        }
    }

    async fn method(&mut self, channel: u16, class: u16, method: u16, args: &[u8]) -> Result<()> {
        let mut w = Writer::default();
        w.u16(class).u16(method);
        w.buf.extend_from_slice(args);
        self.write_frame(FRAME_METHOD, channel, &w.buf).await
    }

    async fn write_frame(&mut self, kind: u8, channel: u16, payload: &[u8]) -> Result<()> {
        let mut w = Writer::default();
        w.u8(kind).u16(channel).u32(payload.len() as u32);
        w.buf.extend_from_slice(payload);
        w.u8(FRAME_END);
        tokio::time::timeout(STEP, async {
            self.stream.write_all(&w.buf).await?;
            self.stream.flush().await
        })
        .await
        .map_err(|_| QuarantineError::Timeout(STEP))??;
        Ok(())
    }

    /// The next frame that is not a heartbeat.
    async fn frame(&mut self) -> Result<(u8, u16, Vec<u8>)> {
        loop {
            let frame = tokio::time::timeout(STEP, self.read_frame())
                .await
                .map_err(|_| QuarantineError::Timeout(STEP))??;
            if frame.0 != FRAME_HEARTBEAT {
                return Ok(frame);
            }
        }
    }

    async fn read_frame(&mut self) -> Result<(u8, u16, Vec<u8>)> {
        let mut head = [0u8; 7];
        self.stream.read_exact(&mut head).await?;
        let kind = head[0];
        let channel = u16::from_be_bytes([head[1], head[2]]);
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]);
        if size > self.frame_max.max(131_072) {
            return Err(QuarantineError::Protocol(format!(
                "a frame of {size} bytes"
            )));
        }
        let mut payload = vec![0u8; size as usize + 1];
        self.stream.read_exact(&mut payload).await?;
        if payload.pop() != Some(FRAME_END) {
            return Err(QuarantineError::Protocol("a frame without its end".into()));
        }
        Ok((kind, channel, payload))
    }

    async fn next_method(&mut self) -> Result<Method> {
        let (kind, _channel, payload) = self.frame().await?;
        if kind != FRAME_METHOD {
            return Err(QuarantineError::Protocol(format!("frame type {kind}")));
        }
        let mut r = Reader::new(&payload);
        let (class, method) = (r.u16()?, r.u16()?);
        let args = payload[4..].to_vec();
        // connection.close or channel.close from the broker: say why.
        if (class, method) == (10, 50) || (class, method) == (20, 40) {
            let mut r = Reader::new(&args);
            let code = r.u16()?;
            let text = String::from_utf8_lossy(&r.short_string()?).into_owned();
            return Err(QuarantineError::Broker(format!("{code} {text}")));
        }
        Ok(Method {
            class,
            method,
            args,
        })
    }

    async fn expect(&mut self, _channel: u16, class: u16, method: u16) -> Result<Method> {
        let got = self.next_method().await?;
        if (got.class, got.method) != (class, method) {
            return Err(QuarantineError::Protocol(format!(
                "expected {class}.{method}, got {}.{}",
                got.class, got.method
            )));
        }
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_round_trip_and_invalid_strings_are_mended() {
        let p = Properties {
            content_type: Some(b"application/json".to_vec()),
            headers: Some(vec![
                (b"ok".to_vec(), Value::long_string(b"v")),
                (
                    b"nested".to_vec(),
                    Value::Table(vec![(b"bad-\xff".to_vec(), Value::Other(b't', vec![1]))]),
                ),
                (
                    b"list".to_vec(),
                    Value::Array(vec![Value::Other(b'I', vec![0, 0, 0, 7])]),
                ),
            ]),
            delivery_mode: Some(2),
            message_id: Some(b"id-\xfe".to_vec()),
            timestamp: Some(42),
            ..Properties::default()
        };
        assert_eq!(
            p.problems(b"rk"),
            [
                "message_id is not valid UTF-8 (hex 69642dfe)",
                "a header name is not valid UTF-8 (hex 6261642dff)"
            ]
        );
        let mut w = Writer::default();
        w.properties(&p);
        let back = Reader::new(&w.buf).properties().unwrap();
        // Everything survives, with the invalid bytes replaced.
        assert_eq!(back.message_id.as_deref(), Some("id-\u{fffd}".as_bytes()));
        assert_eq!(back.timestamp, Some(42));
        assert_eq!(back.content_type, p.content_type);
        assert!(back.problems(b"rk").is_empty(), "the copy parses");
        let headers = back.headers.unwrap();
        assert_eq!(headers[0], p.headers.as_ref().unwrap()[0]);
        assert_eq!(headers[2], p.headers.as_ref().unwrap()[2]);
    }

    #[test]
    fn a_truncated_table_is_an_error_not_a_panic() {
        let mut r = Reader::new(&[0, 0, 0, 9, 3, b'a']);
        assert!(r.table().is_err());
    }
}
