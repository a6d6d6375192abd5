//! [`RetryingClient`]: reqwest with retries that keep one `Idempotency-Key`.

use std::fmt;
use std::time::SystemTime;

use reqwest::header::{HeaderValue, RETRY_AFTER};
use reqwest::{Client, Request, Response};

use super::policy::{RetryPolicy, parse_retry_after};
use super::run::{Attempt, RetryError, retry_with};

use crate::IDEMPOTENCY_KEY;

/// A fresh random (version 4) UUID, e.g. for an `Idempotency-Key`: 122 bits
/// from the operating system's generator, so keys of different clients do
/// not collide (a collision would replay another request's answer).
pub fn new_key() -> String {
    crate::random::uuid_v4()
}

/// A response after retries.
#[derive(Debug)]
pub struct Retried {
    /// The last response: a success, a status that is not retried, or the
    /// last retryable one when the retries ran out.
    pub response: Response,
    /// Attempts made.
    pub attempts: u32,
    /// The `Idempotency-Key` sent with every attempt.
    pub key: String,
}

/// Why [`RetryingClient::send`] returned no response.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The key is not a valid header value (visible ASCII).
    #[error("the Idempotency-Key {0:?} is not a valid header value")]
    InvalidKey(String),
    /// No attempt got a response: network errors to the end, the deadline,
    /// or cancellation. The request may have run: retry later **with the
    /// same `key`**.
    #[error("{error} (Idempotency-Key {key})")]
    Retry {
        /// The key every attempt carried.
        key: String,
        /// What the retries ended with.
        #[source]
        error: RetryError<reqwest::Error>,
    },
}

/// What ended an attempt that is retried.
#[derive(Debug)]
enum Failure {
    Status(Response),
    Transport(reqwest::Error),
}

/// reqwest with retries per a [`RetryPolicy`], sending the **same**
/// `Idempotency-Key` on every attempt, so that an idempotent server executes
/// the request once however many attempts reach it.
///
/// Retried: network errors (connect, timeout, a connection that broke before
/// the answer), the policy's statuses (408, 409, 429, 5xx by default), with
/// the server's `Retry-After` honoured (seconds or HTTP-date, capped by the
/// max delay). Other statuses return at once.
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
/// let retried = client.send(request).await?;
/// println!("{} after {} attempt(s), key {}", retried.response.status(), retried.attempts, retried.key);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RetryingClient {
    client: Client,
    policy: RetryPolicy,
}

impl fmt::Debug for RetryingClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryingClient")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl RetryingClient {
    /// Wraps `client`.
    pub fn new(client: Client, policy: RetryPolicy) -> Self {
        RetryingClient { client, policy }
    }

    /// Sends `request` with a fresh key ([`new_key`]), or the key it already
    /// carries in `Idempotency-Key`.
    ///
    /// # Errors
    /// See [`send_with_key`](Self::send_with_key).
    pub async fn send(&self, request: Request) -> Result<Retried, SendError> {
        let key = match request.headers().get(IDEMPOTENCY_KEY) {
            None => new_key(),
            Some(value) => value.to_str().map(str::to_owned).map_err(|_| {
                SendError::InvalidKey(String::from_utf8_lossy(value.as_bytes()).into())
            })?,
        };
        self.send_with_key(request, &key).await
    }

    /// Sends `request` with `key` on every attempt (for example
    /// [`saga::idempotency_key`](crate#feature-flags)).
    ///
    /// A request whose body cannot be cloned (a stream) is sent once.
    ///
    /// # Errors
    /// [`SendError::Retry`] with the key, the last transport error and the
    /// attempt count when no response came (when retries run out on a
    /// retryable *status*, that response is returned as `Ok`);
    /// [`SendError::InvalidKey`].
    pub async fn send_with_key(
        &self,
        mut request: Request,
        key: &str,
    ) -> Result<Retried, SendError> {
        let value =
            HeaderValue::from_str(key).map_err(|_| SendError::InvalidKey(key.to_owned()))?;
        request.headers_mut().insert(IDEMPOTENCY_KEY, value);
        let cloneable = request.try_clone().is_some();
        let mut original = Some(request);
        let policy = if cloneable {
            self.policy.clone()
        } else {
            self.policy.clone().max_retries(0)
        };
        let outcome = retry_with(&policy, |_attempt| {
            let request = match original.as_ref().and_then(Request::try_clone) {
                Some(copy) => copy,
                None => original.take().expect("sent once when not cloneable"),
            };
            let client = self.client.clone();
            let policy = &self.policy;
            async move {
                match client.execute(request).await {
                    Ok(response) if policy.is_retryable(response.status().as_u16()) => {
                        let after = response
                            .headers()
                            .get(RETRY_AFTER)
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| parse_retry_after(v, SystemTime::now()));
                        Attempt::Retry {
                            error: Failure::Status(response),
                            after,
                        }
                    }
                    Ok(response) => Attempt::Done(response),
                    // A malformed request or a redirect loop fails the same way every time.
                    Err(error) if error.is_builder() || error.is_redirect() => {
                        Attempt::Fail(Failure::Transport(error))
                    }
                    Err(error) => Attempt::Retry {
                        error: Failure::Transport(error),
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
            Err(RetryError::Exhausted {
                last: Failure::Status(response),
                attempts,
            })
            | Err(RetryError::Deadline {
                last: Some(Failure::Status(response)),
                attempts,
            }) => Ok(Retried {
                response,
                attempts,
                key,
            }),
            Err(error) => Err(SendError::Retry {
                key,
                error: transport_only(error),
            }),
        }
    }
}

/// Narrows the loop's error to reqwest's: the arms that carry a response
/// were turned into `Ok` above, and a status is never a permanent failure.
fn transport_only(error: RetryError<Failure>) -> RetryError<reqwest::Error> {
    let transport = |f: Failure| match f {
        Failure::Transport(e) => e,
        Failure::Status(_) => unreachable!("responses are returned as Ok"),
    };
    match error {
        RetryError::Exhausted { last, attempts } => RetryError::Exhausted {
            last: transport(last),
            attempts,
        },
        RetryError::Permanent { error, attempts } => RetryError::Permanent {
            error: transport(error),
            attempts,
        },
        RetryError::Deadline { last, attempts } => RetryError::Deadline {
            last: last.map(transport),
            attempts,
        },
        RetryError::Cancelled { attempts } => RetryError::Cancelled { attempts },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_uuid_v4() {
        let key = new_key();
        assert_eq!(key.len(), 36);
        assert_eq!(&key[14..15], "4");
        assert!(matches!(&key[19..20], "8" | "9" | "a" | "b"));
        assert_ne!(key, new_key());
    }
}
