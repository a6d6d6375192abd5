//! Handlers: closures that get the open transaction ([`Tx`]) and a typed message.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use super::message::{DecodeError, FromMessage, Message};
use crate::Tx;

type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Whether a failed delivery should be tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Might succeed later (a timeout, a lock, a service down): retried.
    Transient,
    /// Will never succeed (invalid data, a business rule): dead-lettered.
    Permanent,
}

/// A handler's failure. Either way the transaction rolls back: neither the
/// handler's writes nor the claim survive.
///
/// `?` converts any `std::error::Error` into a **transient** error, so a lost
/// database connection is retried. Mark errors that retrying cannot fix with
/// [`HandlerError::permanent`] or [`ResultExt::permanent`].
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
    /// smallest delay tier of the [`RetryPolicy`](super::RetryPolicy) that is
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

    /// The underlying error.
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
impl<E: StdError + Send + Sync + 'static> From<E> for HandlerError {
    fn from(error: E) -> Self {
        HandlerError::transient(error)
    }
}

/// Marks the error of a `Result` as transient or permanent, for `?`.
///
/// ```
/// use idempo::amqp::{HandlerError, ResultExt};
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

/// A handler with its message type erased, as the runtime stores it: decoding
/// is a separate step, so an undecodable body is refused before any database
/// work (and even while the database is down).
pub(crate) type BoxedHandler =
    Arc<dyn Fn(Message) -> Result<PreparedCall, DecodeError> + Send + Sync>;

/// A decoded message bound to its handler, waiting for the transaction.
pub(crate) type PreparedCall =
    Box<dyn FnOnce(Tx) -> BoxFuture<'static, Result<(), HandlerError>> + Send>;

pub(crate) fn boxed<M, F, Fut>(handler: F) -> BoxedHandler
where
    M: FromMessage,
    F: Fn(Tx, M) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    Arc::new(move |message| {
        let message = super::message::decode::<M>(message)?;
        let handler = handler.clone();
        Ok(Box::new(move |tx| Box::pin(handler(tx, message))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_mark_on_a_std_error_is_transient() {
        fn f() -> Result<(), HandlerError> {
            Err(std::io::Error::other("timeout"))?;
            Ok(())
        }
        let e = f().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Transient);
        assert_eq!(e.to_string(), "timeout");
    }

    #[test]
    fn permanent_marks_the_error() {
        let r: Result<(), &str> = Err("negative amount");
        let e = r.permanent().unwrap_err();
        assert!(e.is_permanent());
        assert_eq!(e.to_string(), "negative amount");
    }
}
