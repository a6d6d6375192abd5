//! The stream and the durable pull consumer a [`Consumer`](super::Consumer)
//! reads: created when missing (the stream only when allowed), checked when
//! present, so that a conflict is an error at start, not a silent loss.

use std::time::Duration;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::{self, RetentionPolicy};
use async_nats::jetstream::{self as js, Context};

use super::error::NatsError;

/// What the consumer reads, derived from the builder.
#[derive(Debug, Clone)]
pub(crate) struct Topology {
    pub(crate) stream: String,
    pub(crate) subject: String,
    /// The durable consumer's name: the idempo consumer's.
    pub(crate) durable: String,
    /// Create the stream when it is missing.
    pub(crate) create_stream: bool,
    pub(crate) ack_wait: Duration,
    /// JetStream's `max_ack_pending`: deliveries in the client at once.
    pub(crate) max_ack_pending: i64,
    /// The duplicate window of a stream idempo creates (JetStream's default
    /// when unset).
    pub(crate) duplicate_window: Option<Duration>,
    /// How long claims are kept: a new durable must not deliver older
    /// messages again.
    pub(crate) claim_retention: Option<Duration>,
}

impl Topology {
    /// The stream (created when missing and allowed), then the durable
    /// consumer (created when missing), each checked against what the
    /// runtime needs.
    pub(crate) async fn ensure(&self, context: &Context) -> Result<PullConsumer, NatsError> {
        let stream = self.stream(context).await?;
        if let Some(retention) = self.claim_retention {
            self.check_horizon(&stream, retention).await?;
        }
        let config = pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            // idempo dead-letters into the table at the policy's last
            // attempt; a MaxDeliver would stop redelivering first, silently.
            max_deliver: -1,
            max_ack_pending: self.max_ack_pending,
            deliver_policy: DeliverPolicy::All,
            filter_subject: self.filter(&stream),
            ..pull::Config::default()
        };
        let consumer = stream
            .get_or_create_consumer(&self.durable, config)
            .await
            .map_err(|e| self.consumer_error(&e))?;
        self.check_consumer(consumer.cached_info())?;
        Ok(consumer)
    }

    async fn stream(&self, context: &Context) -> Result<stream::Stream, NatsError> {
        match context.get_stream(&self.stream).await {
            Ok(stream) => {
                self.check_stream(&stream.cached_info().config)?;
                Ok(stream)
            }
            Err(e) if is_not_found(&e) => {
                if !self.create_stream {
                    return Err(self.stream_conflict(
                        "it does not exist, and this consumer does not create streams".into(),
                    ));
                }
                context
                    .create_stream(new_stream(
                        &self.stream,
                        &self.subject,
                        self.duplicate_window,
                    ))
                    .await
                    .map_err(|e| create_error(&self.stream, &e))
            }
            Err(e) => {
                let action = format!("about the stream {:?}", self.stream);
                let reason = e.to_string();
                Err(match e.kind() {
                    GetStreamErrorKind::Request => NatsError::Unavailable { action, reason },
                    GetStreamErrorKind::JetStream(js) if unavailable(&js) => {
                        NatsError::Unavailable { action, reason }
                    }
                    _ => NatsError::Api { action, reason },
                })
            }
        }
    }

    /// The stream must take the consumed subject, and keep messages until
    /// they are acknowledged.
    fn check_stream(&self, config: &stream::Config) -> Result<(), NatsError> {
        if !config.subjects.iter().any(|s| covers(s, &self.subject)) {
            return Err(self.stream_conflict(format!(
                "its subjects {:?} do not take {:?}",
                config.subjects, self.subject
            )));
        }
        if config.no_ack {
            return Err(self.stream_conflict(
                "it does not acknowledge publishes (no_ack): a publish may be lost unseen".into(),
            ));
        }
        // Limits that drop the oldest messages drop them acknowledged or not
        // (900 of 1000 gone with max_msgs 100). Discard-new refuses the
        // publish instead, which its publisher sees.
        if config.discard == stream::DiscardPolicy::Old {
            let limits = [
                ("max_msgs", config.max_messages),
                ("max_bytes", config.max_bytes),
                ("max_msgs_per_subject", config.max_messages_per_subject),
            ];
            if let Some((name, limit)) = limits.iter().find(|(_, limit)| *limit > 0) {
                return Err(self.stream_conflict(format!(
                    "its {name} limit ({limit}) with discard=old deletes messages before they \
                     are acknowledged; remove the limit, or set discard=new so that a full \
                     stream refuses publishes instead"
                )));
            }
        }
        if config.max_age > Duration::ZERO {
            tracing::warn!(
                stream = %self.stream,
                max_age = ?config.max_age,
                "the stream deletes messages older than its max_age, acknowledged or not: \
                 a consumer stopped for longer loses them"
            );
        }
        Ok(())
    }

    fn check_consumer(&self, info: &js::consumer::Info) -> Result<(), NatsError> {
        let config = &info.config;
        if config.deliver_subject.is_some() {
            return Err(self.consumer_conflict("it is a push consumer".into()));
        }
        if config.ack_policy != AckPolicy::Explicit {
            return Err(self.consumer_conflict(format!(
                "its ack policy is {:?}, not explicit",
                config.ack_policy
            )));
        }
        if config.max_deliver > 0 {
            return Err(self.consumer_conflict(format!(
                "its MaxDeliver ({}) would stop redelivering before idempo dead-letters; \
                 delete the consumer (idempo creates it without one)",
                config.max_deliver
            )));
        }
        // The runtime extends a delivery in flight every third of *its*
        // ack wait: a durable that waits less redelivers a delivery still
        // being handled (a 25 s handler ran 9 times with 2 s).
        if config.ack_wait < self.ack_wait {
            return Err(self.consumer_conflict(format!(
                "its ack wait ({:?}) is shorter than the consumer's ack_wait ({:?}): deliveries \
                 still being handled would be delivered again; delete the consumer (idempo \
                 creates it) or set the builder's ack_wait to at most {:?}",
                config.ack_wait, self.ack_wait, config.ack_wait
            )));
        }
        // Messages published before such a durable was created are never
        // delivered (300 in the stream, 0 applied, no error).
        if matches!(
            config.deliver_policy,
            DeliverPolicy::New | DeliverPolicy::Last | DeliverPolicy::LastPerSubject
        ) {
            return Err(self.consumer_conflict(format!(
                "its deliver policy {:?} skips what the stream held when it was created; delete \
                 the consumer (idempo creates it with deliver policy all)",
                config.deliver_policy
            )));
        }
        if !config.filter_subject.is_empty() && config.filter_subject != self.subject {
            return Err(self.consumer_conflict(format!(
                "it filters {:?}, not {:?}",
                config.filter_subject, self.subject
            )));
        }
        Ok(())
    }

    /// A durable created now delivers the whole stream: refused while the
    /// stream holds messages older than the claims kept, which would run
    /// again (500 payments applied twice after the durable was deleted).
    /// An existing durable knows what it delivered.
    async fn check_horizon(
        &self,
        stream: &stream::Stream,
        retention: Duration,
    ) -> Result<(), NatsError> {
        use async_nats::jetstream::context::ConsumerInfoErrorKind;
        let missing = match stream.consumer_info(&self.durable).await {
            Ok(_) => false,
            Err(e) => match e.kind() {
                ConsumerInfoErrorKind::NotFound => true,
                ConsumerInfoErrorKind::TimedOut
                | ConsumerInfoErrorKind::Request
                | ConsumerInfoErrorKind::NoResponders
                | ConsumerInfoErrorKind::Offline => {
                    return Err(NatsError::Unavailable {
                        action: format!("about the consumer {:?}", self.durable),
                        reason: e.to_string(),
                    });
                }
                ConsumerInfoErrorKind::JetStream(js) if unavailable(&js) => {
                    return Err(NatsError::Unavailable {
                        action: format!("about the consumer {:?}", self.durable),
                        reason: e.to_string(),
                    });
                }
                _ => false,
            },
        };
        let state = &stream.cached_info().state;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let horizon = i64::try_from(now.saturating_sub(retention.as_secs())).unwrap_or(i64::MAX);
        if missing && state.messages > 0 && state.first_timestamp.unix_timestamp() < horizon {
            return Err(self.consumer_conflict(format!(
                "it does not exist, and the stream holds messages older than the claims kept \
                 ({retention:?}): a new durable would deliver them all again, and those \
                 processed before would run twice. Create it yourself, then start again: with \
                 deliver policy all if they were never processed (`nats consumer add {stream} \
                 {durable} --pull --ack explicit --deliver all`), or from a start time to skip \
                 what was (`--deliver <time>`)",
                stream = self.stream,
                durable = self.durable,
            )));
        }
        Ok(())
    }

    /// The filter the consumer needs: none when the stream takes exactly
    /// the consumed subject.
    fn filter(&self, stream: &stream::Stream) -> String {
        match stream.cached_info().config.subjects.as_slice() {
            [only] if *only == self.subject => String::new(),
            _ => self.subject.clone(),
        }
    }

    /// Creates the stream `name`, taking the subject `name`, unless it
    /// exists (the relay's streams).
    pub(crate) async fn create_stream_if_missing(
        context: &Context,
        name: &str,
        duplicate_window: Option<Duration>,
    ) -> Result<(), NatsError> {
        super::names::check_name("stream", name)?;
        context
            .get_or_create_stream(new_stream(name, name, duplicate_window))
            .await
            .map(|_| ())
            .map_err(|e| create_error(name, &e))
    }

    fn stream_conflict(&self, reason: String) -> NatsError {
        NatsError::StreamConflict {
            stream: self.stream.clone(),
            reason,
        }
    }

    /// A timeout or a JetStream that is briefly unavailable is no conflict:
    /// the consumer asks again (a leader election answers late).
    fn consumer_error(&self, e: &async_nats::jetstream::stream::ConsumerError) -> NatsError {
        use async_nats::jetstream::stream::ConsumerErrorKind;
        let transient = match e.kind() {
            ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request => true,
            ConsumerErrorKind::JetStream(js) => unavailable(&js),
            _ => false,
        };
        if transient {
            NatsError::Unavailable {
                action: format!("about the consumer {:?} on {:?}", self.durable, self.stream),
                reason: e.to_string(),
            }
        } else {
            self.consumer_conflict(e.to_string())
        }
    }

    fn consumer_conflict(&self, reason: String) -> NatsError {
        NatsError::ConsumerConflict {
            stream: self.stream.clone(),
            consumer: self.durable.clone(),
            reason,
        }
    }
}

/// A stream idempo creates: file storage, kept by limits (not by
/// interest: a replay or a new consumer may still need a message), taking
/// `subject`, with `duplicate_window` when set.
fn new_stream(name: &str, subject: &str, duplicate_window: Option<Duration>) -> stream::Config {
    stream::Config {
        name: name.to_owned(),
        subjects: vec![subject.to_owned()],
        retention: RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        duplicate_window: duplicate_window.unwrap_or_default(),
        ..stream::Config::default()
    }
}

/// A stream creation that failed: an outage when JetStream did not answer.
fn create_error(name: &str, e: &async_nats::jetstream::context::CreateStreamError) -> NatsError {
    use async_nats::jetstream::context::CreateStreamErrorKind;
    let action = format!("to create the stream {name:?}");
    let reason = e.to_string();
    match e.kind() {
        CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => {
            NatsError::Unavailable { action, reason }
        }
        CreateStreamErrorKind::JetStream(js) if unavailable(&js) => {
            NatsError::Unavailable { action, reason }
        }
        _ => NatsError::Api { action, reason },
    }
}

/// JetStream's "temporarily unavailable" (503, as during a leader
/// election) or a request that timed out on the server's side (408).
fn unavailable(e: &async_nats::jetstream::Error) -> bool {
    matches!(e.code(), 503 | 408)
}

fn is_not_found(e: &async_nats::jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), GetStreamErrorKind::JetStream(js) if js.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// Whether the stream subject `pattern` takes every message of `subject`
/// (itself possibly a wildcard filter).
pub(crate) fn covers(pattern: &str, subject: &str) -> bool {
    let mut pattern = pattern.split('.');
    let mut subject = subject.split('.');
    loop {
        match (pattern.next(), subject.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(token)) if token != ">" => {}
            (Some(p), Some(s)) if p == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::covers;

    #[test]
    fn a_stream_subject_covers_what_its_wildcards_take() {
        assert!(covers("payments", "payments"));
        assert!(covers("orders.>", "orders.eu.paid"));
        assert!(covers("orders.>", "orders.>"));
        assert!(covers("orders.*.paid", "orders.eu.paid"));
        assert!(covers("orders.*.paid", "orders.*.paid"));
        assert!(covers(">", "anything.at.all"));
        assert!(!covers("orders.*", "orders.eu.paid"));
        assert!(!covers("orders.*", "orders.>"));
        assert!(!covers("payments", "payment"));
        assert!(!covers("orders.eu", "orders.*"));
        assert!(!covers("orders.>", "orders"));
    }
}
