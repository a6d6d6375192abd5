//! [`RetryingClient`]: reqwest with retries that keep one `Idempotency-Key`.

use std::fmt;
use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderValue, RETRY_AFTER};
use reqwest::{Client, Request, Response};

use super::policy::{RetryPolicy, parse_retry_after};
use super::run::{Attempt, RetryError};

use crate::headers::IDEMPOTENCY_KEY;
use crate::key::KeyError;

/// A fresh random (version 4) UUID, e.g. for an `Idempotency-Key`: 122 bits
/// from the operating system's generator, so keys of different clients do
/// not collide (a collision would replay another request's answer).
///
/// # Panics
///
/// When the operating system gives no random bytes: a key from a weaker
/// source could collide with another client's.
pub(crate) fn new_key() -> String {
    crate::random::uuid_v4().expect("the operating system gives random bytes")
}

/// A final answer after retries: a success, or a status the policy does not
/// retry (a 400 is final too: the same request would get it again).
///
/// A retryable status when the retries ran out is no final answer: that is
/// [`SendError::GaveUp`], which carries the response.
#[derive(Debug)]
pub struct Retried {
    /// The final response.
    pub response: Response,
    /// Attempts made.
    pub attempts: u32,
    /// The `Idempotency-Key` header value sent with every attempt.
    pub key: String,
}

/// Why [`RetryingClient::send`] returned no final answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The key breaks the `Idempotency-Key` syntax that idempo's server
    /// enforces (see [`KeyError`]); nothing was sent.
    #[error("cannot send Idempotency-Key {key:?}: {reason}")]
    InvalidKey {
        /// The key as given (lossy, if it was not UTF-8).
        key: String,
        /// What is wrong with it.
        #[source]
        reason: KeyError,
    },
    /// No final answer: the retries ran out, the deadline passed or the
    /// policy's token was cancelled, while attempts ended with a retryable
    /// status, a network error or the attempt timeout. The request may have
    /// run: retry later **with the same `key`**. The last retryable
    /// response, if the last attempt that ended got one, is in `error`
    /// ([`response`](Self::response)).
    #[error("{error} (Idempotency-Key {key})")]
    GaveUp {
        /// The key every attempt carried.
        key: String,
        /// What the retries ended with.
        #[source]
        error: RetryError<AttemptError>,
    },
}

impl SendError {
    /// The key the request carried (or would have carried).
    pub fn key(&self) -> &str {
        match self {
            SendError::InvalidKey { key, .. } | SendError::GaveUp { key, .. } => key,
        }
    }

    /// The last retryable response, when the last attempt that ended got
    /// one (a 503 when the retries ran out, say).
    pub fn response(&self) -> Option<&Response> {
        match self {
            SendError::GaveUp { error, .. } => error.last().and_then(AttemptError::response),
            SendError::InvalidKey { .. } => None,
        }
    }

    /// [`response`](Self::response), by value (to read its body).
    pub fn into_response(self) -> Option<Response> {
        match self {
            SendError::GaveUp { error, .. } => {
                error.into_last().and_then(AttemptError::into_response)
            }
            SendError::InvalidKey { .. } => None,
        }
    }
}

/// Why one attempt gave no final answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttemptError {
    /// A status the policy retries; the response, its body unread.
    #[error("the server answered {}", .0.status())]
    Status(Response),
    /// No response: connecting, sending or receiving failed (or the inner
    /// client's own timeout fired).
    #[error("{0}")]
    Transport(#[source] reqwest::Error),
    /// No response head within the client's
    /// [attempt timeout](RetryingClient::attempt_timeout). The server may
    /// still be running the request.
    #[error("no response within the attempt timeout of {0:?}")]
    TimedOut(Duration),
}

impl AttemptError {
    /// The retryable response, for [`Status`](Self::Status).
    pub fn response(&self) -> Option<&Response> {
        match self {
            AttemptError::Status(response) => Some(response),
            _ => None,
        }
    }

    /// [`response`](Self::response), by value.
    pub fn into_response(self) -> Option<Response> {
        match self {
            AttemptError::Status(response) => Some(response),
            _ => None,
        }
    }

    /// No response in time: the attempt timeout, or the inner client's.
    pub fn is_timeout(&self) -> bool {
        match self {
            AttemptError::TimedOut(_) => true,
            AttemptError::Transport(error) => error.is_timeout(),
            AttemptError::Status(_) => false,
        }
    }
}

/// The default [attempt timeout](RetryingClient::attempt_timeout): 10 s.
pub(crate) const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// reqwest with retries per a [`RetryPolicy`], sending the **same**
/// `Idempotency-Key` on every attempt, so that an idempotent server executes
/// the request once however many attempts reach it.
///
/// Retried: network errors (connect, a connection that broke before the
/// answer), an attempt with no response within the
/// [attempt timeout](Self::attempt_timeout) (10 s by default), and the
/// policy's statuses (408, 409, 429, 5xx by default), with the server's
/// `Retry-After` honoured (seconds or HTTP-date, capped by the max delay).
/// Other statuses return at once.
///
/// ```no_run
/// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
/// use idempo::retry::{RetryPolicy, RetryingClient};
///
/// let client = RetryingClient::new(reqwest::Client::new(), RetryPolicy::new());
/// let request = reqwest::Client::new()
///     .post("http://127.0.0.1:3000/payments")
///     .header("content-type", "application/json")
///     .body(r#"{"account": "acc-1", "amount_cents": 500}"#)
///     .build()?;
/// // A final answer, or `SendError::GaveUp` (with the last 503, if any).
/// let retried = client.send(request).await?;
/// println!("{} after {} attempt(s), key {}", retried.response.status(), retried.attempts, retried.key);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RetryingClient {
    client: Client,
    policy: RetryPolicy,
    attempt_timeout: Duration,
}

impl fmt::Debug for RetryingClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryingClient")
            .field("policy", &self.policy)
            .field("attempt_timeout", &self.attempt_timeout)
            .finish_non_exhaustive()
    }
}

impl RetryingClient {
    /// Wraps `client`, with the default attempt timeout (10 s).
    pub fn new(client: Client, policy: RetryPolicy) -> Self {
        RetryingClient {
            client,
            policy,
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
        }
    }

    /// How long one attempt may wait for the response's head (connect, send
    /// and the server's work included) before it is abandoned and retried
    /// with the same key; 10 s by default. Reading the body is not covered:
    /// bound it with reqwest's own `timeout` or `read_timeout`.
    ///
    /// Without it, a server that accepts the connection and never answers
    /// would hold the first attempt forever. Keep it below the policy's
    /// [`deadline`](RetryPolicy::deadline), or one hung attempt uses the
    /// whole deadline. `Duration::MAX` waits forever.
    #[must_use]
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// Sends `request` with a fresh key (a random UUID v4), or the key it already
    /// carries in `Idempotency-Key`.
    ///
    /// # Errors
    /// See [`send_with_key`](Self::send_with_key); also
    /// [`KeyError::Repeated`] when the request carries the header twice.
    pub async fn send(&self, request: Request) -> Result<Retried, SendError> {
        let mut values = request.headers().get_all(IDEMPOTENCY_KEY).iter();
        let key = match (values.next(), values.next()) {
            (None, _) => new_key(),
            (Some(value), None) => lossy(value),
            (Some(value), Some(_)) => {
                return Err(SendError::InvalidKey {
                    key: lossy(value),
                    reason: KeyError::Repeated,
                });
            }
        };
        self.send_with_key(request, &key).await
    }

    /// Sends `request` with `key` on every attempt (for example
    /// `saga::Saga::idempotency_key`).
    ///
    /// The key must be what idempo's server accepts: 1 to 255 characters of
    /// visible ASCII as a plain token, or a quoted string (`"k"`, which names
    /// the key `k`; spaces allowed inside: `"order 42"`); it is sent as given.
    ///
    /// A request whose body cannot be cloned (a stream) is sent once.
    ///
    /// # Errors
    /// - [`SendError::GaveUp`] with the key, the attempt count and the last
    ///   failure when no final answer came, a retryable status included (the
    ///   response is in it: [`SendError::response`]).
    /// - [`SendError::InvalidKey`]; nothing is sent.
    pub async fn send_with_key(
        &self,
        mut request: Request,
        key: &str,
    ) -> Result<Retried, SendError> {
        let invalid = |reason| SendError::InvalidKey {
            key: key.to_owned(),
            reason,
        };
        // The server's own rule, so that what is sent is what it will read
        // (HTTP would strip the blanks of "  padded\t", say).
        crate::key::parse(key.as_bytes()).map_err(invalid)?;
        let value = HeaderValue::from_str(key).expect("visible ASCII is a valid header value");
        request.headers_mut().insert(IDEMPOTENCY_KEY, value);
        let cloneable = request.try_clone().is_some();
        let mut original = Some(request);
        let policy = if cloneable {
            self.policy.clone()
        } else {
            self.policy.clone().max_retries(0)
        };
        let timeout = self.attempt_timeout;
        let outcome = policy
            .retry_with(|_attempt| {
                let request = match original.as_ref().and_then(Request::try_clone) {
                    Some(copy) => copy,
                    None => original.take().expect("sent once when not cloneable"),
                };
                let client = self.client.clone();
                let policy = &self.policy;
                async move {
                    // Dropping the request on timeout closes its connection: the
                    // next attempt does not queue behind a hung one.
                    let Ok(sent) = tokio::time::timeout(timeout, client.execute(request)).await
                    else {
                        return Attempt::Retry {
                            error: AttemptError::TimedOut(timeout),
                            after: None,
                        };
                    };
                    match sent {
                        Ok(response) if policy.is_retryable(response.status().as_u16()) => {
                            let after = response
                                .headers()
                                .get(RETRY_AFTER)
                                .and_then(|v| v.to_str().ok())
                                .and_then(|v| parse_retry_after(v, SystemTime::now()));
                            Attempt::Retry {
                                error: AttemptError::Status(response),
                                after,
                            }
                        }
                        Ok(response) => Attempt::Done(response),
                        // A malformed request or a redirect loop fails the same way every time.
                        Err(error) if error.is_builder() || error.is_redirect() => {
                            Attempt::Fail(AttemptError::Transport(error))
                        }
                        Err(error) => Attempt::Retry {
                            error: AttemptError::Transport(error),
                            after: None,
                        },
                    }
                }
            })
            .await;
        let key = key.to_owned();
        match outcome {
            Ok((response, attempts)) => Ok(Retried {
                response,
                attempts,
                key,
            }),
            Err(error) => Err(SendError::GaveUp { key, error }),
        }
    }
}

/// A header value as text, for reporting (and re-checking) a key.
fn lossy(value: &HeaderValue) -> String {
    String::from_utf8_lossy(value.as_bytes()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The errors go into `anyhow::Error` and `Box<dyn Error + Send + Sync>`
    /// although they carry a response.
    #[test]
    fn errors_are_send_sync_static() {
        fn is<T: std::error::Error + Send + Sync + 'static>() {}
        is::<SendError>();
        is::<AttemptError>();
    }

    #[test]
    fn keys_are_uuid_v4() {
        let key = new_key();
        assert_eq!(key.len(), 36);
        assert_eq!(&key[14..15], "4");
        assert!(matches!(&key[19..20], "8" | "9" | "a" | "b"));
        assert_ne!(key, new_key());
    }
}
