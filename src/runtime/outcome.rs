//! How a delivery is to end ([`Outcome`]), decided by the inbox steps
//! (`steps.rs`) or the dedup window (`window/consumer.rs`) and carried out
//! by `settle.rs` through a transport; and the outcomes of the ways user code fails.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::inbox::InvalidMessageId;
use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::handler::HandlerError;
use crate::runtime::message::DecodeError;
use crate::runtime::message::Message;
use crate::runtime::stats::{Counter, Stats};

/// How a delivery is to end: decided by the steps, carried out by `settle`.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// The handler ran and its transaction committed: ack.
    Processed,
    /// Already processed with the same body: ack without running the handler.
    Duplicate,
    /// Final failure: publish to the DLQ (confirmed), then ack.
    DeadLetter {
        reason: DeadLetterReason,
        error: String,
    },
    /// Might succeed later: retry per the policy.
    Retry {
        cause: RetryCause,
        error: String,
        requested_delay: Option<Duration>,
    },
    /// Shutdown came, or the channel closed, while the delivery waited: leave
    /// it unacked; it returns to the queue when the channel closes.
    Abandoned,
}

/// Why a delivery is retried: the `error.type` of its span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryCause {
    /// The handler returned a transient error.
    Handler,
    /// The handler ran past its timeout.
    Timeout,
    /// The handler panicked.
    Panic,
    /// The database failed the claim or the commit.
    Database,
    /// The dedup window could not decide yet.
    #[cfg(feature = "window")]
    Window,
}

impl RetryCause {
    /// The cause as an OpenTelemetry `error.type`: a short identifier.
    pub(crate) fn error_type(self) -> &'static str {
        match self {
            RetryCause::Handler => "handler_error",
            RetryCause::Timeout => "timeout",
            RetryCause::Panic => "panic",
            RetryCause::Database => "database",
            #[cfg(feature = "window")]
            RetryCause::Window => "dedup_window",
        }
    }
}

/// How a delivery was settled: the `idempo.settlement` field of its span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    Processed,
    Duplicate,
    DeadLettered,
    /// Republished to a delay queue, or handed back with nack.
    Retried,
    /// Left unacked on purpose.
    Abandoned,
}

impl Settled {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Settled::Processed => "processed",
            Settled::Duplicate => "duplicate",
            Settled::DeadLettered => "dead_lettered",
            Settled::Retried => "retried",
            Settled::Abandoned => "abandoned",
        }
    }
}

/// What decides the outcome of the deliveries of a unit: the inbox steps
/// below, or (feature `window`) the dedup window of `amqp::window`.
pub(crate) trait Decide: Send + Sync + 'static {
    /// One outcome per message, in order. Every message has its id.
    fn decide<'a>(
        &'a self,
        messages: &'a [Message],
        abandon: &'a Abandon,
    ) -> BoxFuture<'a, Vec<Outcome>>;
}

/// What makes a waiting delivery give up: shutdown, or its channel closing
/// (a reconnect, the broker's consumer timeout), after which the broker
/// redelivers it anyway.
pub(crate) struct Abandon {
    pub(crate) shutdown: CancellationToken,
    /// Whether the unit's deliveries can no longer be settled (their channel
    /// closed): asked of the transport once a second.
    pub(crate) gone: Option<Gone>,
}

/// The transport's answer to "is this delivery beyond settling?".
pub(crate) type Gone = Box<dyn Fn() -> bool + Send + Sync>;

impl Abandon {
    /// Resolves when waiting is pointless.
    pub(crate) async fn wait(&self) {
        let closed = async {
            match &self.gone {
                Some(gone) => {
                    while !gone() {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = self.shutdown.cancelled() => {}
            () = closed => {}
        }
    }
}

/// How a handler call ended.
pub(crate) enum HandlerRun {
    Done,
    Failed(HandlerError),
    Panicked(String),
    TimedOut,
}

/// A reused id: counted, logged, and dead-lettered.
pub(crate) fn mismatch(consumer: &str, stats: &Stats, message: &Message) -> Outcome {
    let id = message.id();
    stats.incr(Counter::PayloadMismatches);
    tracing::warn!(message_id = %id, "message id reused with a different payload");
    Outcome::DeadLetter {
        reason: DeadLetterReason::PayloadMismatch,
        error: format!(
            "message id {id:?} was already processed by {consumer:?} with a different body"
        ),
    }
}

/// Runs user code (the call that makes the handler's future, and the future)
/// bounded by `timeout`, with panics caught.
pub(crate) async fn guarded<F, Fut>(make: F, timeout: Duration, stats: &Stats) -> HandlerRun
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), HandlerError>>,
{
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(
        timeout,
        AssertUnwindSafe(async { make().await }).catch_unwind(),
    )
    .await;
    stats.handler_duration(started.elapsed());
    match result {
        Ok(Ok(Ok(()))) => HandlerRun::Done,
        Ok(Ok(Err(e))) => HandlerRun::Failed(e),
        Ok(Err(panic)) => HandlerRun::Panicked(panic_message(&*panic).to_owned()),
        Err(_) => HandlerRun::TimedOut,
    }
}

/// The outcome of a handler's error.
pub(crate) fn handler_failed(e: HandlerError) -> Outcome {
    // `msg.json()?` inside a handler: a body that cannot decode never will,
    // whatever kind the `?` conversion gave the error.
    if let Some(decode) = e.source().downcast_ref::<DecodeError>() {
        undecodable(decode)
    } else if e.is_permanent() {
        Outcome::DeadLetter {
            reason: DeadLetterReason::PermanentError,
            error: e.to_string(),
        }
    } else {
        Outcome::Retry {
            cause: RetryCause::Handler,
            requested_delay: e.requested_delay(),
            error: format!("handler failed: {e}"),
        }
    }
}

pub(crate) fn timed_out(timeout: Duration) -> Outcome {
    retry(
        RetryCause::Timeout,
        "handler timed out after",
        format!("{timeout:?}"),
    )
}

pub(crate) fn undecodable(e: &DecodeError) -> Outcome {
    Outcome::DeadLetter {
        reason: DeadLetterReason::UndecodableBody,
        error: e.to_string(),
    }
}

pub(crate) fn invalid_id(e: InvalidMessageId) -> Outcome {
    let reason = match e {
        InvalidMessageId::Missing => DeadLetterReason::MissingMessageId,
        _ => DeadLetterReason::InvalidMessageId,
    };
    Outcome::DeadLetter {
        reason,
        error: e.to_string(),
    }
}

pub(crate) fn retry(cause: RetryCause, context: &str, e: impl std::fmt::Display) -> Outcome {
    Outcome::Retry {
        cause,
        error: format!("{context}: {e}"),
        requested_delay: None,
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "non-string panic payload"
    }
}
