//! What a stream holds for its durable consumers: what the operations tools
//! show of a JetStream consumer where they show a RabbitMQ queue's depth.

use std::time::Duration;

use async_nats::jetstream;

use super::error::NatsError;
use crate::redact::redact_url;

/// One stream as `idempo status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StreamDepth {
    pub(crate) stream: String,
    pub(crate) exists: bool,
    /// Messages not yet delivered to the named durable consumers.
    pub(crate) pending: u64,
    /// Messages delivered to them and not acknowledged yet.
    pub(crate) unacked: u64,
    /// Consumers on the stream.
    pub(crate) consumers: u32,
}

/// The depth of each `(stream, durable consumers)` on the server at `url`.
pub(crate) async fn stream_depths(
    url: &str,
    streams: &[(String, Vec<String>)],
) -> Result<Vec<StreamDepth>, NatsError> {
    let client = async_nats::ConnectOptions::new()
        .name("idempo-ops")
        .connection_timeout(Duration::from_secs(5))
        .connect(super::connect::servers(url))
        .await
        .map_err(|e| NatsError::Refused {
            url: redact_url(url),
            reason: e.to_string(),
        })?;
    let context = jetstream::new(client);
    let mut depths = Vec::with_capacity(streams.len());
    for (name, durables) in streams {
        let mut depth = StreamDepth {
            stream: name.clone(),
            exists: false,
            pending: 0,
            unacked: 0,
            consumers: 0,
        };
        let Ok(mut stream) = context.get_stream(name).await else {
            depths.push(depth);
            continue;
        };
        let info = stream.info().await.map_err(|e| NatsError::Api {
            action: format!("the stream {name:?}"),
            reason: e.to_string(),
        })?;
        depth.exists = true;
        depth.consumers = u32::try_from(info.state.consumer_count).unwrap_or(u32::MAX);
        for durable in durables {
            if let Ok(consumer) = stream.consumer_info(durable).await {
                depth.pending += consumer.num_pending;
                depth.unacked += u64::try_from(consumer.num_ack_pending).unwrap_or(0);
            }
        }
        depths.push(depth);
    }
    Ok(depths)
}
