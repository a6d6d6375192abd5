//! The quarantine's one connection: frames, the handshake (PLAIN), and the
//! few methods it needs (`basic.get`, `basic.publish` with confirms,
//! `basic.ack`), each bounded in time.

use std::time::Duration;

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::codec::{Got, Properties, Reader, Value, Writer};
use super::error::{QuarantineError, Result};

pub(super) const FRAME_METHOD: u8 = 1;
pub(super) const FRAME_HEADER: u8 = 2;
pub(super) const FRAME_BODY: u8 = 3;
pub(super) const FRAME_HEARTBEAT: u8 = 8;
pub(super) const FRAME_END: u8 = 0xCE;
pub(super) const CHANNEL: u16 = 1;
/// Each step's bound (the pass as a whole has [`TIME_LIMIT`]).
pub(super) const STEP: Duration = Duration::from_secs(10);

/// One connection, one channel.
pub(super) struct Wire<S> {
    pub(super) stream: S,
    pub(super) frame_max: u32,
}

/// A method frame's class, method and arguments.
pub(super) struct Method {
    pub(super) class: u16,
    pub(super) method: u16,
    pub(super) args: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Wire<S> {
    pub(super) fn new(stream: S) -> Self {
        Wire {
            stream,
            frame_max: crate::wire_size::DEFAULT_FRAME_MAX as u32,
        }
    }

    pub(super) async fn open(&mut self, user: &str, password: &str, vhost: &str) -> Result<()> {
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

    pub(super) async fn get(&mut self, queue: &str) -> Result<Option<Got>> {
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
    pub(super) async fn publish(
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

    pub(super) async fn ack(&mut self, delivery_tag: u64) -> Result<()> {
        let mut w = Writer::default();
        w.u64(delivery_tag).u8(0);
        self.method(CHANNEL, 60, 80, &w.buf).await
    }

    /// Closes the connection; the messages read and not acked go back.
    pub(super) async fn close(mut self) {
        let mut w = Writer::default();
        w.u16(200).short_string(b"done").u16(0).u16(0);
        if self.method(0, 10, 50, &w.buf).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(2), self.expect(0, 10, 51)).await;
        }
    }

    pub(super) async fn method(
        &mut self,
        channel: u16,
        class: u16,
        method: u16,
        args: &[u8],
    ) -> Result<()> {
        let mut w = Writer::default();
        w.u16(class).u16(method);
        w.buf.extend_from_slice(args);
        self.write_frame(FRAME_METHOD, channel, &w.buf).await
    }

    pub(super) async fn write_frame(
        &mut self,
        kind: u8,
        channel: u16,
        payload: &[u8],
    ) -> Result<()> {
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
    pub(super) async fn frame(&mut self) -> Result<(u8, u16, Vec<u8>)> {
        loop {
            let frame = tokio::time::timeout(STEP, self.read_frame())
                .await
                .map_err(|_| QuarantineError::Timeout(STEP))??;
            if frame.0 != FRAME_HEARTBEAT {
                return Ok(frame);
            }
        }
    }

    pub(super) async fn read_frame(&mut self) -> Result<(u8, u16, Vec<u8>)> {
        let mut head = [0u8; 7];
        self.stream.read_exact(&mut head).await?;
        let kind = head[0];
        let channel = u16::from_be_bytes([head[1], head[2]]);
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]);
        if size
            > self
                .frame_max
                .max(crate::wire_size::DEFAULT_FRAME_MAX as u32)
        {
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

    pub(super) async fn next_method(&mut self) -> Result<Method> {
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

    pub(super) async fn expect(
        &mut self,
        _channel: u16,
        class: u16,
        method: u16,
    ) -> Result<Method> {
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
