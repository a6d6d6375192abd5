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
}

impl Topology {
    /// The stream (created when missing and allowed), then the durable
    /// consumer (created when missing), each checked against what the
    /// runtime needs.
    pub(crate) async fn ensure(&self, context: &Context) -> Result<PullConsumer, NatsError> {
        let stream = self.stream(context).await?;
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
            .map_err(|e| self.consumer_conflict(e.to_string()))?;
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
                    .map_err(|e| NatsError::Api {
                        action: format!("to create the stream {:?}", self.stream),
                        reason: e.to_string(),
                    })
            }
            Err(e) => Err(NatsError::Api {
                action: format!("the stream {:?}", self.stream),
                reason: e.to_string(),
            }),
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
        if !config.filter_subject.is_empty() && config.filter_subject != self.subject {
            return Err(self.consumer_conflict(format!(
                "it filters {:?}, not {:?}",
                config.filter_subject, self.subject
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
            .map_err(|e| NatsError::Api {
                action: format!("to create the stream {name:?}"),
                reason: e.to_string(),
            })
    }

    fn stream_conflict(&self, reason: String) -> NatsError {
        NatsError::StreamConflict {
            stream: self.stream.clone(),
            reason,
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
