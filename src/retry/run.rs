//! The retry loop: [`retry`] for any async work, shared by the HTTP client.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::policy::RetryPolicy;

/// How one attempt ended, as the caller classifies it.
#[derive(Debug)]
pub enum Attempt<T, E> {
    /// Done: stop and return it.
    Done(T),
    /// Worth another try (after `after`, if the other side said so).
    Retry {
        /// The failure.
        error: E,
        /// The other side's `Retry-After`, if any.
        after: Option<Duration>,
    },
    /// Not worth another try.
    Fail(E),
}

/// Why [`RetryPolicy::retry`] gave up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RetryError<E> {
    /// Every attempt failed with a retryable error; the last one.
    #[error("gave up after {attempts} attempts: {last}")]
    Exhausted {
        /// The last attempt's error.
        last: E,
        /// Attempts made.
        attempts: u32,
    },
    /// An error that is not worth retrying.
    #[error("failed on attempt {attempts}, not retryable: {error}")]
    Permanent {
        /// The error.
        error: E,
        /// Attempts made.
        attempts: u32,
    },
    /// The policy's deadline passed: the next attempt could not start in
    /// time, or the one in flight was cut off.
    #[error("deadline passed after {attempts} attempts")]
    Deadline {
        /// The error of the last attempt that *ended*. When the deadline cut
        /// an attempt off, that attempt has no error of its own: `last` is
        /// the one before it (`None` if it was the first).
        last: Option<E>,
        /// Attempts made, the one cut off included.
        attempts: u32,
    },
    /// The policy's cancellation token fired.
    #[error("cancelled after {attempts} attempts")]
    Cancelled {
        /// Attempts made (or started).
        attempts: u32,
    },
}

impl<E> RetryError<E> {
    /// Attempts made before giving up.
    pub fn attempts(&self) -> u32 {
        match self {
            RetryError::Exhausted { attempts, .. }
            | RetryError::Permanent { attempts, .. }
            | RetryError::Deadline { attempts, .. }
            | RetryError::Cancelled { attempts } => *attempts,
        }
    }

    /// The error of the last attempt that ended, if one did.
    pub fn last(&self) -> Option<&E> {
        match self {
            RetryError::Exhausted { last, .. } => Some(last),
            RetryError::Permanent { error, .. } => Some(error),
            RetryError::Deadline { last, .. } => last.as_ref(),
            RetryError::Cancelled { .. } => None,
        }
    }

    /// [`last`](Self::last), by value.
    pub fn into_last(self) -> Option<E> {
        match self {
            RetryError::Exhausted { last, .. } => Some(last),
            RetryError::Permanent { error, .. } => Some(error),
            RetryError::Deadline { last, .. } => last,
            RetryError::Cancelled { .. } => None,
        }
    }
}

impl RetryPolicy {
    /// Runs `op` until it succeeds, retrying **every** error per this policy.
    /// `op` gets the attempt number (1-based).
    ///
    /// ```
    /// # async fn doc() {
    /// use idempo::retry::RetryPolicy;
    ///
    /// let mut calls = 0;
    /// let policy = RetryPolicy::new().base_delay(std::time::Duration::ZERO);
    /// let answer = policy.retry(|_attempt| {
    ///     calls += 1;
    ///     let ok = calls == 3;
    ///     async move { if ok { Ok(42) } else { Err("not yet") } }
    /// })
    /// .await;
    /// assert_eq!(answer.unwrap(), 42);
    /// # }
    /// ```
    ///
    /// Dropping the returned future cancels it (between attempts, or the attempt
    /// in flight); so does the policy's [`cancel_on`](RetryPolicy::cancel_on)
    /// token.
    ///
    /// # Errors
    /// [`RetryError`]: exhausted, past the deadline, or cancelled.
    pub async fn retry<T, E, F, Fut>(&self, mut op: F) -> Result<T, RetryError<E>>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.retry_with(|attempt| {
            let run = op(attempt);
            async move {
                match run.await {
                    Ok(value) => Attempt::Done(value),
                    Err(error) => Attempt::Retry { error, after: None },
                }
            }
        })
        .await
        .map(|(value, _)| value)
    }

    /// The loop under [`retry`](Self::retry), with the caller classifying each attempt;
    /// returns the value and the number of attempts.
    ///
    /// # Errors
    /// [`RetryError`].
    pub async fn retry_with<T, E, F, Fut>(&self, mut op: F) -> Result<(T, u32), RetryError<E>>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Attempt<T, E>>,
    {
        let policy = self;
        // A deadline beyond the clock's range (`Duration::MAX`) is never reached:
        // no deadline, rather than a panic on the addition.
        let deadline = policy.deadline.and_then(|d| Instant::now().checked_add(d));
        let cancelled = async {
            match &policy.cancel {
                Some(token) => token.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(cancelled);
        let mut attempt = 0;
        // The last retryable error, reported if the deadline cuts the next attempt.
        let mut last = None;
        loop {
            if policy.cancel.as_ref().is_some_and(|t| t.is_cancelled()) {
                return Err(RetryError::Cancelled { attempts: attempt });
            }
            attempt += 1;
            let run = op(attempt);
            // The attempt first: an answer that is ready wins over a deadline or
            // a cancellation that fire at the same moment.
            let outcome = tokio::select! {
                biased;
                outcome = run => outcome,
                () = &mut cancelled => return Err(RetryError::Cancelled { attempts: attempt }),
                () = sleep_until(deadline) => {
                    return Err(RetryError::Deadline { last, attempts: attempt });
                }
            };
            let (error, after) = match outcome {
                Attempt::Done(value) => return Ok((value, attempt)),
                Attempt::Fail(error) => {
                    return Err(RetryError::Permanent {
                        error,
                        attempts: attempt,
                    });
                }
                Attempt::Retry { error, after } => (error, after),
            };
            if attempt > policy.max_retries {
                return Err(RetryError::Exhausted {
                    last: error,
                    attempts: attempt,
                });
            }
            let wait = policy.delay(attempt, after);
            // A wait beyond the clock's range (a huge `Retry-After` under a
            // `max_delay` of `Duration::MAX`) ends after any deadline.
            if deadline.is_some_and(|d| Instant::now().checked_add(wait).is_none_or(|end| end >= d))
            {
                return Err(RetryError::Deadline {
                    last: Some(error),
                    attempts: attempt,
                });
            }
            last = Some(error);
            tokio::select! {
                biased;
                () = &mut cancelled => return Err(RetryError::Cancelled { attempts: attempt }),
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
