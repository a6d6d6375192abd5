//! A response body read up to the layer's cap, and bodies re-streamed from
//! what was read: how a response too large to store still reaches its client.

use axum_core::body::Body;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use http_body::Body as HttpBody;
use http_body_util::BodyExt;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub(super) enum Capped<B> {
    Complete(Bytes),
    TooLarge(Bytes, B),
    Failed(Bytes, BoxError),
}

/// Reads a response body up to `limit` bytes; beyond that, hands back what
/// was read and the rest, unread, so it can still be streamed to the client.
pub(super) async fn read_capped<B>(mut body: B, limit: usize) -> Capped<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                    if read.len() > limit {
                        return Capped::TooLarge(read.freeze(), body);
                    }
                }
            }
            Err(error) => return Capped::Failed(read.freeze(), error.into()),
        }
    }
    Capped::Complete(read.freeze())
}

/// `prefix`, then the rest of `body`.
pub(super) fn prefixed<B>(prefix: Bytes, body: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let rest = Body::new(body).into_data_stream();
    let head = futures::stream::once(async move { Ok::<_, axum_core::Error>(prefix) });
    Body::from_stream(head.chain(rest))
}

/// `prefix`, then the error the body ended with: the client sees the
/// response break off, as it would without the layer.
pub(super) fn failing(prefix: Bytes, error: BoxError) -> Body {
    let chunks: [Result<Bytes, BoxError>; 2] = [Ok(prefix), Err(error)];
    Body::from_stream(futures::stream::iter(chunks))
}
