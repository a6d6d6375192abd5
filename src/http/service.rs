//! [`Idempotency`]: the service that runs each request through its key's
//! state machine (absent → in progress → complete, or released).

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum_core::body::Body;
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http::response::Parts as ResponseParts;
use http::{HeaderValue, Request, Response};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sqlx::{Postgres, Transaction};
use tower_service::Service;
use tracing::{Instrument, field};

use super::body::{Capped, failing, prefixed, read_capped};
use super::config::Config;
use super::key::{IDEMPOTENT_REPLAYED, IdempotencyKey};
use super::problem::{LayerAnswer, Problem};
use super::record::{Fingerprint, RecordKey, StoredResponse};
use super::store::{AtomicStore, Begin, FencingToken, IdempotencyStore, Operation};
use super::transaction::{AtomicPhase, WithoutKey};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service made by [`IdempotencyLayer`](super::IdempotencyLayer).
pub struct Idempotency<S, St> {
    inner: S,
    store: Arc<St>,
    config: Arc<Config>,
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(inner: S, store: Arc<St>, config: Arc<Config>) -> Self {
        Idempotency {
            inner,
            store,
            config,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, B, ResBody> Service<Request<B>> for Idempotency<S, St>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    B: HttpBody<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone takes the place of the service that was polled ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (store, config) = (self.store.clone(), self.config.clone());
        Box::pin(handle(inner, store, config, request))
    }
}

async fn handle<S, St, B, ResBody>(
    mut inner: S,
    store: Arc<St>,
    config: Arc<Config>,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    B: HttpBody<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if !config.methods.contains(request.method()) {
        return pass(&mut inner, request).await;
    }
    let key = match IdempotencyKey::from_headers(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if config.require_key => return Ok(Problem::MissingKey.into_response()),
        Ok(None) => {
            // A handler that asks for `Tx` then answers 400 (the client left
            // the key out), not 500.
            let mut request = request;
            request.extensions_mut().insert(WithoutKey);
            return pass(&mut inner, request).await;
        }
        Err(e) => return Ok(Problem::InvalidKey(e).into_response()),
    };

    let (mut parts, body) = request.into_parts();
    let reading = Limited::new(body, config.max_request_body).collect();
    let body = match tokio::time::timeout(config.body_timeout, reading).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            let limit = config.max_request_body;
            return Ok(Problem::BodyTooLarge { limit }.into_response());
        }
        Ok(Err(_)) => return Ok(Problem::BodyUnreadable.into_response()),
        Err(_) => {
            let after = config.body_timeout;
            return Ok(Problem::BodyTimeout { after }.into_response());
        }
    };
    let user = (config.user)(&parts);
    let record = RecordKey::new(
        user.as_deref(),
        parts.method.as_str(),
        parts.uri.path(),
        key.as_str(),
    );
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let fingerprint = Fingerprint::of_request(parts.method.as_str(), path_and_query, &body);

    let operation = Operation {
        key: &record,
        fingerprint: &fingerprint,
        lease: config.lease,
        ttl: config.ttl,
    };
    // The key's outcome, on a span the handler's own spans are children of.
    let span = tracing::info_span!("idempotency_key", "idempo.key.outcome" = field::Empty);
    let begun = bounded(config.store_timeout, store.begin(operation)).await;
    let outcome = begun.as_ref().map_or("store_unavailable", Begin::outcome);
    span.record("idempo.key.outcome", outcome);
    let token = match begun {
        Ok(Begin::Started(token)) => token,
        Ok(Begin::Completed(stored)) => return Ok(replay(stored)),
        Ok(Begin::InProgress { lease_left }) => {
            let retry_after = in_progress_retry_after(&config, lease_left);
            return Ok(Problem::InProgress { retry_after }.into_response());
        }
        Ok(Begin::Mismatch) => return Ok(Problem::KeyMismatch.into_response()),
        Err(error) if config.fail_open => {
            tracing::warn!(%error, "idempotency store failed; running the request without it");
            return pass(&mut inner, Request::from_parts(parts, B::from(body))).await;
        }
        Err(error) => {
            tracing::warn!(%error, "idempotency store failed; answering 503");
            return Ok(Problem::StoreUnavailable.into_response());
        }
    };

    let owner = Owner {
        store,
        config,
        record,
        token,
    };
    let phase = owner.store.atomic().map(|atomic| {
        let phase = AtomicPhase::new(atomic.pool().clone(), owner.config.store_timeout);
        parts.extensions.insert(phase.clone());
        phase
    });
    let request = Request::from_parts(parts, B::from(body));
    // Spawned: a client that disconnects drops this future, but the handler
    // must still finish and complete or release the key. Otherwise the key
    // would stay in progress until its lease ran out and the retry ran again.
    // Tracked, so that a graceful shutdown can wait for it (`in_flight`).
    let tasks = owner.config.tasks.clone();
    let task = tasks.spawn(
        async move {
            let call = async move { inner.call(request).await };
            owner.execute(call, phase).await
        }
        .instrument(span),
    );
    match task.await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Cancelled: the runtime is shutting down.
        Err(_) => Ok(Problem::CommitFailed.into_response()),
    }
}

/// A store call bounded by the layer's store timeout; running out of time
/// is a store error like any other (503, or `fail_open`).
async fn bounded<T>(
    timeout: std::time::Duration,
    call: impl Future<Output = crate::Result<T>>,
) -> crate::Result<T> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| Err(crate::StoreError::Timeout(timeout).into()))
}

/// How long a client should wait before retrying a key in progress: briefly
/// while the holder renews its lease on schedule (its answer is near); the
/// lease's remainder once a renewal is overdue (the holder is probably gone,
/// and nothing can happen before the lease runs out).
fn in_progress_retry_after(
    config: &Config,
    lease_left: Option<std::time::Duration>,
) -> std::time::Duration {
    let Some(left) = lease_left else {
        return config.retry_after;
    };
    // Renewed every third of the lease: a live holder's lease never has
    // less than two thirds left (a tenth of slack for the renewal's trip).
    let renewed_on_time = left + config.lease / 10 >= config.lease * 2 / 3;
    if renewed_on_time {
        config.retry_after
    } else {
        left.max(config.retry_after)
    }
}

async fn pass<S, B, ResBody>(inner: &mut S, request: Request<B>) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    Ok(inner.call(request).await?.map(Body::new))
}

fn replay(stored: StoredResponse) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body().clone()));
    *response.status_mut() = stored.status();
    let headers = response.headers_mut();
    for (name, value) in stored.headers() {
        headers.append(name.clone(), value.clone());
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// The request that holds the record: renews its lease while the handler
/// runs, then completes or releases it.
struct Owner<St> {
    store: Arc<St>,
    config: Arc<Config>,
    record: RecordKey,
    token: FencingToken,
}

impl<St: IdempotencyStore> Owner<St> {
    /// Runs the handler and reads its response under the lease's heartbeat,
    /// then completes or releases the key. A panic in the handler (or in its
    /// body) releases the key and resumes.
    async fn execute<F, E, ResBody>(
        self,
        call: F,
        phase: Option<AtomicPhase>,
    ) -> Result<Response<Body>, E>
    where
        F: Future<Output = Result<Response<ResBody>, E>>,
        ResBody: HttpBody<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let limit = self.config.max_response_body;
        let work = AssertUnwindSafe(async {
            match call.await {
                Err(error) => Ran::Failed(error),
                Ok(response) => {
                    let (parts, body) = response.into_parts();
                    if self.stores(&parts) {
                        Ran::Read(parts, read_capped(Box::pin(body), limit).await)
                    } else {
                        Ran::Unstored(parts, Body::new(body))
                    }
                }
            }
        })
        .catch_unwind();
        let ran = self.with_heartbeat(work).await;
        // The handler is done: take its transaction back (dropping it rolls back).
        let tx = handler_tx(phase).await;
        let atomic = !matches!(tx, HandlerTx::Unused);
        let ran = match ran {
            Ok(ran) => ran,
            Err(panic) => {
                drop(tx);
                self.release().await;
                std::panic::resume_unwind(panic)
            }
        };
        let (parts, body) = match ran {
            Ran::Read(parts, Capped::Complete(body)) => (parts, body),
            Ran::Failed(error) => {
                drop(tx);
                self.release().await;
                return Err(error);
            }
            Ran::Unstored(parts, body) => {
                drop(tx);
                self.release().await;
                return Ok(Response::from_parts(parts, body));
            }
            Ran::Read(parts, Capped::TooLarge(prefix, rest)) => {
                drop(tx); // before release: it holds one of the pool's connections
                self.release().await;
                if atomic {
                    return Ok(Problem::ResponseTooLarge { limit }.into_response());
                }
                return Ok(Response::from_parts(parts, prefixed(prefix, rest)));
            }
            Ran::Read(parts, Capped::Failed(prefix, error)) => {
                drop(tx);
                self.release().await;
                return Ok(Response::from_parts(parts, failing(prefix, error)));
            }
        };
        let stored = self.stored(&parts, body.clone());
        let answer = match (tx, self.store.atomic()) {
            (HandlerTx::Open(tx), Some(atomic)) => {
                self.complete_atomically(atomic, tx, &stored).await
            }
            // A transaction is only handed out by a store that has the capability.
            (HandlerTx::Open(_), None) => {
                self.release().await;
                Err(Problem::CommitFailed)
            }
            (HandlerTx::Stuck, _) => {
                self.release().await;
                Err(Problem::CommitFailed)
            }
            (HandlerTx::Unused, _) => {
                self.complete(&stored).await;
                Ok(())
            }
        };
        Ok(match answer {
            Ok(()) => Response::from_parts(parts, Body::from(body)),
            Err(problem) => problem.into_response(),
        })
    }

    /// Whether a response is stored: its status is, and it is the handler's
    /// own (the layer's problems, e.g. a 503 from the `Tx` extractor, are not).
    fn stores(&self, parts: &ResponseParts) -> bool {
        parts.extensions.get::<LayerAnswer>().is_none() && (self.config.stores_status)(parts.status)
    }

    /// Renews the lease every third of it while `work` runs, so that it runs
    /// out only when this process is gone.
    async fn with_heartbeat<F: Future>(&self, work: F) -> F::Output {
        let heartbeat = async {
            let every = self.config.lease / 3;
            loop {
                tokio::time::sleep(every).await;
                let extend = self
                    .store
                    .extend(&self.record, self.token, self.config.lease);
                match bounded(self.config.store_timeout, extend).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(key = ?self.record, "lease lost while the request ran");
                        std::future::pending::<()>().await;
                    }
                    Err(error) => tracing::warn!(%error, "could not renew the lease"),
                }
            }
        };
        tokio::select! {
            output = work => output,
            () = heartbeat => unreachable!("the heartbeat never ends"),
        }
    }

    async fn release(&self) {
        let release = self.store.release(&self.record, self.token);
        if let Err(error) = bounded(self.config.store_timeout, release).await {
            // The record stays in progress until its lease runs out; then a
            // retry takes it over.
            tracing::warn!(%error, "could not release the idempotency key");
        }
    }

    /// Completes through the store (no atomic phase). The effect already
    /// happened, so the handler's answer goes out whatever happens here; but
    /// an unstored answer means the retry after the lease runs out executes
    /// again, so a failing store is tried again, with backoff, for as long as
    /// the lease lasts (the fencing token makes a late completion safe: it is
    /// refused once another request took the key over).
    async fn complete(&self, stored: &StoredResponse) {
        let deadline = tokio::time::Instant::now() + self.config.lease;
        let mut backoff = crate::backoff::Backoff::new(
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs(2),
        );
        let mut retried = false;
        loop {
            let complete = self
                .store
                .complete(&self.record, self.token, stored, self.config.ttl);
            let error = match bounded(self.config.store_timeout, complete).await {
                Ok(true) => return,
                // After a failed attempt, an earlier one may have landed after all.
                Ok(false) if retried => {
                    tracing::debug!(key = ?self.record, "the record is no longer ours: an earlier attempt stored it, or another request took it over");
                    return;
                }
                Ok(false) => {
                    tracing::warn!(
                        key = ?self.record,
                        "the lease was taken over before the response was stored; answering without storing"
                    );
                    return;
                }
                Err(error) => error,
            };
            retried = true;
            let pause = backoff.next_delay();
            if tokio::time::Instant::now() + pause >= deadline {
                metrics::counter!("idempo_http_unstored_responses_total").increment(1);
                tracing::error!(
                    %error,
                    key = ?self.record,
                    "could not store the response within the lease; a retry after the lease runs out executes again"
                );
                return;
            }
            tracing::warn!(%error, ?pause, "could not store the response yet; trying again");
            tokio::time::sleep(pause).await;
        }
    }

    /// The atomic phase: complete the record inside the handler's
    /// transaction, then commit both.
    async fn complete_atomically(
        &self,
        atomic: &dyn AtomicStore,
        mut tx: Transaction<'static, Postgres>,
        stored: &StoredResponse,
    ) -> Result<(), Problem> {
        let ttl = self.config.ttl;
        match atomic
            .complete_in(&mut tx, &self.record, self.token, stored, ttl)
            .await
        {
            Ok(true) => match tx.commit().await {
                Ok(()) => Ok(()),
                Err(error) => {
                    tracing::warn!(%error, "commit of the atomic phase failed");
                    self.release().await; // a no-op if the commit did land
                    Err(Problem::CommitFailed)
                }
            },
            // Fenced out: another request owns the key; these writes must not land.
            Ok(false) => Err(Problem::LeaseLost),
            Err(error) if error.is_aborted_transaction() => {
                // The handler answered after a statement failed (say, a unique
                // violation it turned into a 4xx): its writes are gone. Store
                // an error answer on its own; a success would be a lie.
                drop(tx);
                if stored.status().is_success() {
                    self.release().await;
                    return Err(Problem::CommitFailed);
                }
                self.complete(stored).await;
                Ok(())
            }
            Err(error) => {
                tracing::warn!(%error, "completing the key in the handler's transaction failed");
                drop(tx);
                self.release().await;
                Err(Problem::CommitFailed)
            }
        }
    }

    fn stored(&self, parts: &ResponseParts, body: Bytes) -> StoredResponse {
        let headers = self
            .config
            .stored_headers
            .iter()
            .flat_map(|name| {
                parts
                    .headers
                    .get_all(name)
                    .iter()
                    .map(|value| (name.clone(), value.clone()))
            })
            .collect();
        StoredResponse::new(parts.status, headers, body)
    }
}

/// How the handler's part went.
enum Ran<E, B> {
    Failed(E),
    Unstored(ResponseParts, Body),
    Read(ResponseParts, Capped<B>),
}

/// The handler's transaction after it returned.
enum HandlerTx {
    /// It never asked for one.
    Unused,
    Open(Transaction<'static, Postgres>),
    /// A `TxGuard` outlived the handler (held by a task it spawned): the
    /// transaction cannot be completed.
    Stuck,
}

async fn handler_tx(phase: Option<AtomicPhase>) -> HandlerTx {
    let Some(phase) = phase else {
        return HandlerTx::Unused;
    };
    match phase.take().await {
        None => HandlerTx::Unused,
        Some(tx) => tx.take().map_or(HandlerTx::Stuck, HandlerTx::Open),
    }
}
