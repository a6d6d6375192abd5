//! Window mode of the consumer: a [`DedupWindow`] instead of the inbox, for
//! handlers that touch no database.
//!
//! ```text
//! received ─► id ─► decode ─► reserve the id (per queue, or per group)
//!   ├─ seen, same body ─► Duplicate          ├─ seen, other body ─► DeadLetter (reused id)
//!   ├─ pending (another copy runs) ─► wait for it, then reserve again (shutdown: Abandoned)
//!   └─ reserved ─► handler (no transaction) ─┬─ Ok ─► record ─► Processed
//!                                            └─ error / panic / timeout ─► release ─► Retry / DeadLetter
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::Result;
use crate::runtime::builder::{ConsumerBuilder, runnable};
use crate::runtime::handler::HandlerError;
use crate::runtime::message::{DecodeError, FromMessage, Message, decode};
use crate::runtime::mode::{Dispatch, IntoDispatch, NoHandler, Parts};
use crate::runtime::outcome::{
    Abandon, Decide, HandlerRun, Outcome, RetryCause, guarded, handler_failed, mismatch, retry,
    timed_out, undecodable,
};
use crate::runtime::stats::Stats;
use crate::runtime::transport::Transport;
use crate::window::{DedupId, DedupWindow, Reservation, Scope, WindowStore};

/// The builder's state after [`dedup_window`](ConsumerBuilder::dedup_window):
/// it needs a [`window_handler`](ConsumerBuilder::window_handler).
pub struct WindowNoHandler {
    window: Arc<dyn ErasedWindow>,
}

/// Window mode: a handler with no transaction, deduplicated on a window.
pub struct Windowed {
    window: Arc<dyn ErasedWindow>,
    handler: Arc<dyn PrepareAlone>,
    groups: Option<String>,
}

impl fmt::Debug for WindowNoHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WindowNoHandler").finish_non_exhaustive()
    }
}

impl fmt::Debug for Windowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Windowed")
            .field("groups", &self.groups)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> ConsumerBuilder<T, NoHandler> {
    /// Deduplicates with a [`DedupWindow`] instead of the PostgreSQL inbox
    /// (feature `window`), for handlers that touch no database;
    /// set the handler with [`window_handler`](ConsumerBuilder::window_handler).
    ///
    /// The guarantee is weaker, and only this: a copy of a message id that
    /// arrives **within the window** after the first copy was processed is
    /// acked without running the handler. The id is reserved while the
    /// handler runs (a concurrent copy waits) and recorded after it
    /// succeeded, so a failed attempt does not hide its retry; but recording
    /// is not transactional with the handler's effects (a crash between the
    /// two runs the redelivery again), and copies after the window pass.
    /// Message groups scope ids per group. The body's hash is recorded with
    /// the id, so an id reused with another body is dead-lettered, as with
    /// the inbox. A store that fails is a transient failure: the delivery is
    /// retried through the delay queues and uses an attempt (unlike a
    /// database outage with the inbox, which waits at the gate).
    pub fn dedup_window<S>(self, window: DedupWindow<S>) -> ConsumerBuilder<T, WindowNoHandler>
    where
        S: WindowStore,
    {
        self.into_mode(WindowNoHandler {
            window: Arc::new(window),
        })
    }
}

impl<T: Transport> ConsumerBuilder<T, WindowNoHandler> {
    /// The handler of a consumer with a [`dedup_window`](ConsumerBuilder::dedup_window):
    /// a [`WindowHandler`], such as a closure or async fn
    /// `Fn(M) -> impl Future<Output = Result<(), HandlerError>>`, with no
    /// transaction. Errors, retries and dead letters work as with
    /// [`handler`](ConsumerBuilder::handler).
    pub fn window_handler<M, H>(self, handler: H) -> ConsumerBuilder<T, Windowed>
    where
        M: FromMessage,
        H: WindowHandler<M>,
    {
        let window = self.mode.window.clone();
        self.into_mode(Windowed {
            window,
            handler: Arc::new(Alone {
                handler: Arc::new(handler),
                message: std::marker::PhantomData::<fn() -> M>,
            }),
            groups: None,
        })
    }
}

/// What a consumer with a [`dedup_window`](ConsumerBuilder::dedup_window)
/// calls for each fresh message: the [`Handler`](crate::consumer::Handler) of
/// window mode, without a transaction (the window, not the inbox, keeps the
/// copies out).
///
/// Closures and async fns `Fn(M) -> impl Future<Output = Result<(),
/// HandlerError>>` implement it, where `M` is any
/// [`FromMessage`](crate::consumer::FromMessage) type: [`JsonBody<T>`](crate::consumer::JsonBody),
/// [`Message`], or a pair such as `(JsonBody<T>, Message)` (annotate the
/// closure's argument: `|msg: Message|`). Implement it by hand for a handler
/// type that carries its own state. The runtime keeps one handler behind an
/// `Arc` and calls it through `&self`.
///
/// # Example
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use idempo::consumer::{HandlerError, JsonBody};
/// use idempo::consumer::WindowHandler;
///
/// #[derive(serde::Deserialize)]
/// struct Ping { from: String }
///
/// /// Counts pings; a metric, a cache, a call to a service with its own key.
/// struct CountPings { seen: Arc<AtomicU64> }
///
/// impl WindowHandler<JsonBody<Ping>> for CountPings {
///     fn call(&self, JsonBody(ping): JsonBody<Ping>)
///         -> impl Future<Output = Result<(), HandlerError>> + Send + 'static
///     {
///         let seen = self.seen.clone();
///         async move {
///             if ping.from.is_empty() {
///                 return Err(HandlerError::permanent("a ping from nobody"));
///             }
///             seen.fetch_add(1, Ordering::Relaxed);
///             Ok(())
///         }
///     }
/// }
/// ```
///
/// # When it does not compile
/// A handler that takes the transaction belongs to the inbox
/// ([`handler`](ConsumerBuilder::handler)); given to `window_handler`, the
/// compiler reports "`Credit` is not a `WindowHandler<_>`", with notes that
/// list the accepted shapes:
///
/// ```compile_fail,E0277
/// use idempo::Tx;
/// use idempo::amqp::ConsumerBuilder;
/// use idempo::consumer::{Handler, HandlerError, Message};
/// use idempo::consumer::mode::WindowNoHandler;
///
/// struct Credit;
///
/// impl Handler<Message> for Credit {
///     fn call(&self, _tx: Tx, _message: Message)
///         -> impl Future<Output = Result<(), HandlerError>> + Send + 'static
///     {
///         async { Ok(()) }
///     }
/// }
///
/// fn build(builder: ConsumerBuilder<WindowNoHandler>) {
///     builder.window_handler(Credit);
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a `WindowHandler<{M}>`",
    label = "not a window handler of `{M}`",
    note = "a window handler has no transaction: an async fn or closure `Fn(M) -> impl Future<Output = Result<(), HandlerError>> + Send + 'static` (itself `Send + Sync + 'static`), or a type that implements `WindowHandler<M>`",
    note = "`M: FromMessage` is the message: `JsonBody<T>`, `Message`, a pair such as `(JsonBody<T>, Message)`, or your own type; annotate a closure's argument: `|msg: Message| async move {{ .. }}`",
    note = "a handler that takes the transaction (`Fn(Tx, M)`, `Handler<M>`) needs the inbox: `.handler(..)`, without `.dedup_window(..)`"
)]
pub trait WindowHandler<M>: Send + Sync + 'static {
    /// Handles `message`.
    fn call(
        &self,
        message: M,
    ) -> impl Future<Output = std::result::Result<(), HandlerError>> + Send + 'static;
}

impl<M, F, Fut> WindowHandler<M> for F
where
    F: Fn(M) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
{
    fn call(
        &self,
        message: M,
    ) -> impl Future<Output = std::result::Result<(), HandlerError>> + Send + 'static {
        self(message)
    }
}

impl<T: Transport> ConsumerBuilder<T, Windowed> {
    /// Message groups, as in per-message mode
    /// ([`message_groups`](ConsumerBuilder::message_groups)); ids count per group.
    pub fn message_groups(self) -> Self {
        self.message_groups_by("x-group-id")
    }

    /// [`message_groups`](Self::message_groups) with the group id in another header.
    pub fn message_groups_by(mut self, header: impl Into<String>) -> Self {
        self.mode.groups = Some(header.into());
        self
    }
}

runnable!(Windowed);

impl IntoDispatch for Windowed {
    fn into_dispatch(self, parts: &Parts<'_>) -> Result<Dispatch> {
        Ok(Dispatch {
            decide: Arc::new(WindowSteps {
                consumer: parts.consumer.to_owned(),
                queue: parts.queue.to_owned(),
                window: self.window,
                handler: self.handler,
                groups: self.groups.clone(),
                handler_timeout: parts.handler_timeout,
                stats: parts.stats.clone(),
            }),
            batch: None,
            groups: self.groups,
        })
    }
}

/// A window with its store type erased, as the consumer keeps it.
trait ErasedWindow: Send + Sync {
    fn reserve<'a>(&'a self, key: &'a str, lease: Duration) -> BoxFuture<'a, Result<Reservation>>;
    fn record<'a>(
        &'a self,
        key: &'a str,
        token: i64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool>>;
    fn release<'a>(&'a self, key: &'a str, token: i64) -> BoxFuture<'a, Result<bool>>;
}

impl<S: WindowStore> ErasedWindow for DedupWindow<S> {
    fn reserve<'a>(&'a self, key: &'a str, lease: Duration) -> BoxFuture<'a, Result<Reservation>> {
        Box::pin(self.store().reserve(key, lease))
    }
    fn record<'a>(
        &'a self,
        key: &'a str,
        token: i64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.store().record(key, token, value, self.length()))
    }
    fn release<'a>(&'a self, key: &'a str, token: i64) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.store().release(key, token))
    }
}

type AloneFuture = BoxFuture<'static, std::result::Result<(), HandlerError>>;

/// A window handler with its message type erased: decodes, then makes the future.
trait PrepareAlone: Send + Sync {
    fn prepare(
        &self,
        message: &Message,
    ) -> std::result::Result<Box<dyn FnOnce() -> AloneFuture + Send>, DecodeError>;
}

struct Alone<H, M> {
    handler: Arc<H>,
    message: std::marker::PhantomData<fn() -> M>,
}

impl<M, H> PrepareAlone for Alone<H, M>
where
    M: FromMessage,
    H: WindowHandler<M>,
{
    fn prepare(
        &self,
        message: &Message,
    ) -> std::result::Result<Box<dyn FnOnce() -> AloneFuture + Send>, DecodeError> {
        let decoded = decode::<M>(message.clone())?;
        let handler = self.handler.clone();
        Ok(Box::new(move || Box::pin(handler.call(decoded))))
    }
}

/// The steps of one delivery through the window.
struct WindowSteps {
    consumer: String,
    queue: String,
    window: Arc<dyn ErasedWindow>,
    handler: Arc<dyn PrepareAlone>,
    groups: Option<String>,
    handler_timeout: Duration,
    stats: Stats,
}

impl Decide for WindowSteps {
    fn decide<'a>(
        &'a self,
        messages: &'a [Message],
        abandon: &'a Abandon,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let mut outcomes = Vec::with_capacity(messages.len());
            for message in messages {
                outcomes.push(self.decide_one(message, abandon).await);
            }
            outcomes
        })
    }
}

impl WindowSteps {
    async fn decide_one(&self, message: &Message, abandon: &Abandon) -> Outcome {
        // Decode before touching the window: a bad body is final.
        let call = match self.handler.prepare(message) {
            Ok(call) => call,
            Err(e) => return undecodable(&e),
        };
        let group = self.groups.as_deref().and_then(|h| message.header_text(h));
        let scope = match group {
            Some(group) => Scope::group(&self.queue, &group),
            None => Scope::queue(&self.queue),
        };
        let key = scope.key_of(message.id());
        // Recorded with the id, so a reused id with another body is caught.
        let body_hash = DedupId::content(message.body());
        // The reservation outlives the longest handler run (bounded, so that
        // a huge handler timeout cannot overflow the clock).
        let lease = self
            .handler_timeout
            .saturating_add(Duration::from_secs(5))
            .min(Duration::from_secs(24 * 60 * 60));
        let deadline = tokio::time::Instant::now() + lease;
        let token = loop {
            match self.window.reserve(&key, lease).await {
                Err(e) => return retry(RetryCause::Window, "the dedup window failed", e),
                Ok(Reservation::Seen(seen)) if seen == body_hash.as_str() => {
                    return Outcome::Duplicate;
                }
                Ok(Reservation::Seen(_)) => return mismatch(&self.consumer, &self.stats, message),
                Ok(Reservation::Reserved { token }) => break token,
                // A copy is being processed right now: wait for its outcome.
                Ok(_) if tokio::time::Instant::now() < deadline => {
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(25)) => {}
                        () = abandon.wait() => return Outcome::Abandoned,
                    }
                }
                Ok(_) => {
                    return retry(
                        RetryCause::Window,
                        "the id stayed reserved by another copy",
                        "in the window",
                    );
                }
            }
        };
        let run = guarded(call, self.handler_timeout, &self.stats).await;
        if !matches!(run, HandlerRun::Done)
            && let Err(e) = self.window.release(&key, token).await
        {
            tracing::warn!(error = %e, "could not release the id in the dedup window");
        }
        match run {
            HandlerRun::Done => {
                match self.window.record(&key, token, body_hash.as_str()).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!("the window reservation expired before it was recorded")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "could not record the id in the dedup window")
                    }
                }
                Outcome::Processed
            }
            HandlerRun::Failed(e) => handler_failed(e),
            HandlerRun::Panicked(panic) => retry(RetryCause::Panic, "handler panicked", panic),
            HandlerRun::TimedOut => timed_out(self.handler_timeout),
        }
    }
}
