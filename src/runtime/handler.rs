//! Handlers: the [`Handler`] trait (a blanket impl covers closures and async
//! fns taking the open transaction ([`Tx`]) and a typed message), and
//! [`HandlerError`].

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::Tx;
use crate::runtime::message::{DecodeError, FromMessage, Message, decode};

type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// What the runtime calls for each fresh message (or, as `Handler<Vec<M>>`,
/// for each batch): it runs in the transaction that claimed the message id,
/// and must not commit or roll back itself (the runtime commits after `Ok`,
/// then acks).
///
/// Closures and async fns `Fn(Tx, M) -> impl Future<Output = Result<(),
/// HandlerError>>` implement it (annotate the closure's arguments, as with
/// any trait-bounded closure: `|tx: Tx, JsonBody(p): JsonBody<Payment>|`).
/// Implement it by hand for a handler type that carries its own state. The
/// runtime keeps one handler behind an `Arc` and calls it through `&self`:
/// captured state is shared by every delivery, never copied per message.
///
/// # Example
/// ```
/// use idempo::Tx;
/// use idempo::consumer::{Handler, HandlerError, JsonBody};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { account: String, amount_cents: i64 }
///
/// /// A handler with a setting of its own.
/// struct Credit { table: &'static str }
///
/// impl Handler<JsonBody<Payment>> for Credit {
///     fn call(&self, tx: Tx, JsonBody(p): JsonBody<Payment>)
///         -> impl Future<Output = Result<(), HandlerError>> + Send + 'static
///     {
///         let sql = format!("UPDATE {} SET cents = cents + $2 WHERE account = $1", self.table);
///         async move {
///             let mut tx = tx.try_lock()?;
///             sqlx::query(sqlx::AssertSqlSafe(sql))
///                 .bind(&p.account)
///                 .bind(p.amount_cents)
///                 .execute(&mut *tx)
///                 .await?;
///             Ok(())
///         }
///     }
/// }
/// ```
///
/// # When a handler does not compile
/// A closure takes the transaction first, even one that does not use it
/// (`|_tx: Tx, m: Message|`). Without it, the compiler reports "closure is
/// expected to take 2 arguments, but it takes 1 argument":
///
/// ```compile_fail,E0593
/// use idempo::amqp::ConsumerBuilder;
/// use idempo::consumer::{HandlerError, Message, mode::NoHandler};
///
/// fn build(builder: ConsumerBuilder<NoHandler>) {
///     builder.handler(|m: Message| async move { Ok::<(), HandlerError>(()) });
/// }
/// ```
///
/// A value that is not a handler of the message type asked for (here a
/// per-message handler given to [`batch_handler`], which wants a
/// `Handler<Vec<M>>`) is reported as "`Credit` is not a `Handler<Vec<_>>`",
/// with notes that list the accepted shapes:
///
/// ```compile_fail,E0277
/// use idempo::Tx;
/// use idempo::amqp::ConsumerBuilder;
/// use idempo::consumer::{Handler, HandlerError, JsonBody, mode::NoHandler};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { account: String }
///
/// struct Credit;
///
/// impl Handler<JsonBody<Payment>> for Credit {
///     fn call(&self, _tx: Tx, _payment: JsonBody<Payment>)
///         -> impl Future<Output = Result<(), HandlerError>> + Send + 'static
///     {
///         async { Ok(()) }
///     }
/// }
///
/// fn build(builder: ConsumerBuilder<NoHandler>) {
///     builder.batch_handler(Credit);
/// }
/// ```
///
/// [`batch_handler`]: crate::amqp::ConsumerBuilder::batch_handler
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a `Handler<{M}>`",
    label = "not a handler of `{M}`",
    note = "a handler is an async fn or closure `Fn(Tx, M) -> impl Future<Output = Result<(), HandlerError>> + Send + 'static` (itself `Send + Sync + 'static`), or a type that implements `Handler<M>`",
    note = "`M: FromMessage` is the message: `JsonBody<T>`, `Message`, a pair such as `(JsonBody<T>, Message)`, or your own type; `batch_handler` takes `Vec<M>`: `Fn(Tx, Vec<M>)`",
    note = "annotate a closure's arguments: `|tx: Tx, JsonBody(p): JsonBody<Payment>| async move {{ .. }}`"
)]
pub trait Handler<M>: Send + Sync + 'static {
    /// Handles `message` in the transaction `tx`.
    fn call(
        &self,
        tx: Tx,
        message: M,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'static;
}

impl<M, F, Fut> Handler<M> for F
where
    F: Fn(Tx, M) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    fn call(
        &self,
        tx: Tx,
        message: M,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'static {
        self(tx, message)
    }
}

/// Whether a failed delivery should be tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Might succeed later (a timeout, a lock, a service down): retried.
    Transient,
    /// Will never succeed (invalid data, a business rule): dead-lettered.
    Permanent,
}

impl ErrorKind {
    /// The kind `?` gives an error in a handler: looks through its source
    /// chain for a PostgreSQL error (sqlx's, or one inside an
    /// [`idempo::Error`](crate::Error)) and classifies it by SQLSTATE class.
    ///
    /// | SQLSTATE | meaning | kind |
    /// |---|---|---|
    /// | `22xxx` | data exception (out of range, invalid text, NUL, division by zero) | permanent |
    /// | `23xxx` | integrity constraint (unique, foreign key, check, not null) | permanent |
    /// | `42xxx` | syntax error or access rule (undefined table or column, permission) | permanent |
    /// | `40001`, `40P01`, `55P03`, `57014` | serialization failure, deadlock, lock not available, statement timeout | transient |
    /// | connection errors, `25006`, `53xxx`, `57P01`–`57P05`, `58xxx` ([`idempo::Error::is_unavailable`](crate::Error::is_unavailable)) | the database cannot take writes now (down, read-only, out of disk) | the delivery waits at the database gate, spending no attempt |
    /// | anything else, and errors that are not database errors | | transient |
    pub fn of(error: &(dyn StdError + 'static)) -> ErrorKind {
        let mut current = Some(error);
        while let Some(e) = current {
            let database = match e.downcast_ref::<sqlx::Error>() {
                Some(db @ sqlx::Error::Database(_)) => Some(db),
                _ => match e.downcast_ref::<crate::Error>() {
                    Some(crate::Error::Database(db @ sqlx::Error::Database(_))) => Some(db),
                    _ => None,
                },
            };
            #[cfg(feature = "outbox")]
            if let Some(outbox) = e.downcast_ref::<crate::outbox::OutboxError>().or(e
                .downcast_ref::<crate::Error>()
                .and_then(crate::Error::downcast_ref))
                && outbox.is_permanent()
            {
                return ErrorKind::Permanent;
            }
            if let Some(db) = database {
                return if crate::sqlstate::is_permanent(db) {
                    ErrorKind::Permanent
                } else {
                    ErrorKind::Transient
                };
            }
            current = e.source();
        }
        ErrorKind::Transient
    }
}

/// A handler's failure. Either way the transaction rolls back: neither the
/// handler's writes nor the claim survive.
///
/// `?` converts every error a handler is likely to meet: any type that
/// implements `std::error::Error + Send + Sync` (sqlx's, serde's,
/// `std::io::Error`, [`idempo::Error`](crate::Error), your own thiserror
/// types), `anyhow::Error`, `Box<dyn std::error::Error + Send + Sync>`, and a
/// `String` or `&'static str` message. The kind is the one [`ErrorKind::of`]
/// gives the error: **transient** (retried), except database errors that the
/// same statement on the same data will raise again, which are **permanent**
/// (dead-lettered at once, with the database's message). An `anyhow::Error`
/// is classified as the error it carries (feature `anyhow`, on by default):
/// a unique violation behind `.context(..)` is still permanent, and
/// `anyhow::Error::from(decode_error)` is still dead-lettered as an
/// undecodable body. Choose the kind yourself with
/// [`HandlerError::permanent`] / [`HandlerError::transient`] or
/// [`ResultExt`]: that overrides the default.
///
/// ```
/// use anyhow::Context;
/// use idempo::Tx;
/// use idempo::consumer::{HandlerError, Message, ResultExt};
///
/// // Helpers of the application, written with anyhow.
/// fn parse_cents(raw: &str) -> anyhow::Result<i64> {
///     raw.trim().parse().context("the amount is not a number")
/// }
/// async fn exchange_rate(currency: &str) -> anyhow::Result<i64> {
///     anyhow::ensure!(currency == "EUR", "no rate for {currency}");
///     Ok(1)
/// }
///
/// async fn handle(tx: Tx, msg: Message) -> Result<(), HandlerError> {
///     let raw = std::str::from_utf8(msg.body()).permanent()?; // never UTF-8: dead-lettered
///     let cents = parse_cents(raw).permanent()?;              // never a number: dead-lettered
///     let rate = exchange_rate("EUR").await?;                 // anyhow::Error: transient, retried
///     let mut tx = tx.try_lock()?;
///     sqlx::query("INSERT INTO amounts (cents) VALUES ($1)")
///         .bind(cents * rate)
///         .execute(&mut *tx)
///         .await?;                                            // sqlx::Error: kind by SQLSTATE
///     Ok(())
/// }
/// ```
pub struct HandlerError {
    kind: ErrorKind,
    source: BoxError,
    retry_after: Option<Duration>,
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn transient(error: impl Into<BoxError>) -> Self {
        HandlerError {
            kind: ErrorKind::Transient,
            source: error.into(),
            retry_after: None,
        }
    }

    /// A failure that retrying cannot fix: the delivery is dead-lettered.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        HandlerError {
            kind: ErrorKind::Permanent,
            source: error.into(),
            retry_after: None,
        }
    }

    /// Asks for the retry to wait about `delay` (a transient error): the
    /// smallest delay tier of the [`RedeliveryPolicy`](crate::runtime::redelivery::RedeliveryPolicy) that is
    /// at least as long is used. For example, a downstream answered
    /// "429, Retry-After: 30".
    #[must_use]
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// The delay asked for with [`retry_after`](Self::retry_after).
    pub fn requested_delay(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Transient or permanent.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// `true` for [`ErrorKind::Permanent`].
    pub fn is_permanent(&self) -> bool {
        self.kind == ErrorKind::Permanent
    }

    /// The underlying error: the one `?` or [`transient`](Self::transient) /
    /// [`permanent`](Self::permanent) was given, except that `?` on an
    /// `anyhow::Error` (feature `anyhow`) keeps the error it carries, so that
    /// `downcast_ref` finds it.
    pub fn source(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.source
    }

    /// The underlying error, by value.
    pub fn into_source(self) -> BoxError {
        self.source
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .field("retry_after", &self.retry_after)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

// Deliberately no `impl std::error::Error for HandlerError`: it would conflict
// with this blanket conversion, which is what makes `?` work in handlers.
// `Into<BoxError>` covers every `std::error::Error + Send + Sync` type (std's
// blanket impl), `Box<dyn Error + Send + Sync>` itself, `anyhow::Error`
// (anyhow's `From` impl), `String` and `&'static str`. The kind comes from the
// error (a deterministic database error is permanent);
// HandlerError::transient/permanent choose it explicitly.
impl<E: Into<BoxError> + 'static> From<E> for HandlerError {
    fn from(error: E) -> Self {
        let source = into_source(error);
        HandlerError {
            kind: ErrorKind::of(&*source),
            source,
            retry_after: None,
        }
    }
}

/// `error` boxed as the source of a [`HandlerError`].
///
/// anyhow's own `Box` conversion wraps the error in a private type whose
/// source is the *cause* of the error it carries: `downcast_ref` and
/// [`ErrorKind::of`] would no longer see the error itself (a `DecodeError`,
/// a `sqlx::Error`). Unwrapped instead, an `anyhow::Error` classifies as the
/// error it carries would (its backtrace, if one was captured, is dropped).
fn into_source<E: Into<BoxError> + 'static>(error: E) -> BoxError {
    #[cfg(feature = "anyhow")]
    {
        let mut slot = Some(error);
        // A type test resolved at compile time: E is anyhow::Error or not.
        if let Some(slot) =
            (&mut slot as &mut dyn std::any::Any).downcast_mut::<Option<anyhow::Error>>()
            && let Some(error) = slot.take()
        {
            return error.reallocate_into_boxed_dyn_error_without_backtrace();
        }
        slot.map(Into::into)
            .expect("the error is still in its slot")
    }
    #[cfg(not(feature = "anyhow"))]
    {
        error.into()
    }
}

/// Marks the error of a `Result` as transient or permanent, for `?`.
///
/// ```
/// use idempo::consumer::{HandlerError, ResultExt};
/// fn parse_amount(raw: &str) -> Result<i64, HandlerError> {
///     raw.parse::<i64>().permanent()   // retrying will not make it a number
/// }
/// assert!(parse_amount("ten").unwrap_err().is_permanent());
/// ```
pub trait ResultExt<T> {
    /// Maps the error to [`HandlerError::permanent`].
    fn permanent(self) -> Result<T, HandlerError>;
    /// Maps the error to [`HandlerError::transient`].
    fn transient(self) -> Result<T, HandlerError>;
}

impl<T, E: Into<BoxError>> ResultExt<T> for Result<T, E> {
    fn permanent(self) -> Result<T, HandlerError> {
        self.map_err(HandlerError::permanent)
    }
    fn transient(self) -> Result<T, HandlerError> {
        self.map_err(HandlerError::transient)
    }
}

/// A unit's messages decoded and bound to the user's handler, waiting for
/// the transaction.
pub(crate) type Call = Box<dyn FnOnce(Tx) -> BoxFuture<'static, Result<(), HandlerError>> + Send>;

/// The user's handler with its message type erased, as the runtime keeps it:
/// decoding is a step of its own, so an undecodable body is refused before
/// any database work (even while the database is down).
pub(crate) trait Prepare: Send + Sync + 'static {
    /// Decodes every message of a unit and binds the handler to them, or says
    /// which one (by index) does not decode.
    fn prepare(&self, messages: &[Message]) -> Result<Call, (usize, DecodeError)>;
}

fn decode_all<M: FromMessage>(messages: &[Message]) -> Result<Vec<M>, (usize, DecodeError)> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| decode::<M>(m.clone()).map_err(|e| (i, e)))
        .collect()
}

/// The W3C trace context the message carries, for what its handler stages.
fn traceparent(message: &Message) -> Option<String> {
    #[cfg(feature = "outbox")]
    {
        message.header_text(crate::headers::TRACEPARENT_HEADER)
    }
    #[cfg(not(feature = "outbox"))]
    {
        let _ = message;
        None
    }
}

/// Runs a handler's future with the message's trace context, so that the
/// messages it stages in the outbox carry it on.
async fn with_trace<F: Future>(trace: Option<String>, future: F) -> F::Output {
    #[cfg(feature = "outbox")]
    {
        crate::outbox::with_traceparent(trace, future).await
    }
    #[cfg(not(feature = "outbox"))]
    {
        let _ = trace;
        future.await
    }
}

/// A per-message handler: called once per message, in order, on the unit's
/// transaction (a unit is one delivery, or a batch in batch mode).
pub(crate) struct EachMessage<H, M> {
    handler: Arc<H>,
    message: PhantomData<fn() -> M>,
}

impl<H, M> EachMessage<H, M> {
    pub(crate) fn new(handler: H) -> Self {
        EachMessage {
            handler: Arc::new(handler),
            message: PhantomData,
        }
    }
}

impl<H: Handler<M>, M: FromMessage> Prepare for EachMessage<H, M> {
    fn prepare(&self, messages: &[Message]) -> Result<Call, (usize, DecodeError)> {
        let mut decoded = decode_all::<M>(messages)?;
        let handler = self.handler.clone();
        let mut traces: Vec<Option<String>> = messages.iter().map(traceparent).collect();
        if decoded.len() == 1 {
            let message = decoded.pop().expect("one message");
            let trace = traces.pop().expect("one message");
            return Ok(Box::new(move |tx| {
                Box::pin(with_trace(trace, handler.call(tx, message)))
            }));
        }
        Ok(Box::new(move |tx: Tx| {
            Box::pin(async move {
                for (message, trace) in decoded.into_iter().zip(traces) {
                    with_trace(trace, handler.call(tx.clone(), message)).await?;
                }
                Ok(())
            })
        }))
    }
}

/// A batch handler: called once with every message of the unit.
pub(crate) struct WholeBatch<H, M> {
    handler: Arc<H>,
    message: PhantomData<fn() -> M>,
}

impl<H, M> WholeBatch<H, M> {
    pub(crate) fn new(handler: H) -> Self {
        WholeBatch {
            handler: Arc::new(handler),
            message: PhantomData,
        }
    }
}

impl<H: Handler<Vec<M>>, M: FromMessage> Prepare for WholeBatch<H, M> {
    fn prepare(&self, messages: &[Message]) -> Result<Call, (usize, DecodeError)> {
        let decoded = decode_all::<M>(messages)?;
        let handler = self.handler.clone();
        // One trace context for the call: the message's, for a batch of one.
        let trace = match messages {
            [one] => traceparent(one),
            _ => None,
        };
        Ok(Box::new(move |tx| {
            Box::pin(with_trace(trace, handler.call(tx, decoded)))
        }))
    }
}

#[cfg(test)]
mod tests;
