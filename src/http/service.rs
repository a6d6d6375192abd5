//! [`Idempotency`]: the service that runs each request through its key's
//! state machine (absent → in progress → complete, or released).

use std::any::Any;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum_core::body::Body;
use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use http::response::Parts as ResponseParts;
use http::{HeaderValue, Request, Response};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;

use super::key::{IDEMPOTENT_REPLAYED, IdempotencyKey};
use super::layer::{ANONYMOUS, Config};
use super::postgres::complete_on;
use super::problem::Problem;
use super::record::{Fingerprint, RecordKey, StoredResponse};
use super::store::{Attempt, Begin, FencingToken, IdempotencyStore};
use super::transaction::AtomicPhase;

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
    S::Error: Send,
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
    S: Service<Request<B>, Response = Response<ResBody>>,
    St: IdempotencyStore,
    B: HttpBody<Data = Bytes> + From<Bytes>,
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
        Ok(None) => return pass(&mut inner, request).await,
        Err(e) => return Ok(Problem::InvalidKey(e).into_response()),
    };

    let (mut parts, body) = request.into_parts();
    let body = match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            let limit = config.max_request_body;
            return Ok(Problem::BodyTooLarge { limit }.into_response());
        }
        Err(_) => return Ok(Problem::BodyUnreadable.into_response()),
    };
    let user = (config.user)(&parts).unwrap_or_else(|| ANONYMOUS.to_owned());
    let record = RecordKey::new(&user, parts.method.as_str(), parts.uri.path(), key.as_str());
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let fingerprint = Fingerprint::of_request(parts.method.as_str(), path_and_query, &body);

    let attempt = Attempt {
        key: &record,
        fingerprint: &fingerprint,
        lease: config.lease,
        ttl: config.ttl,
    };
    let token = match store.begin(attempt).await {
        Ok(Begin::Started(token)) => token,
        Ok(Begin::Completed(stored)) => return Ok(replay(stored)),
        Ok(Begin::InProgress) => {
            let retry_after = config.retry_after;
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
    let phase = owner.store.transactional().map(|pool| {
        let phase = AtomicPhase::new(pool.clone());
        parts.extensions.insert(phase.clone());
        phase
    });
    let call = inner.call(Request::from_parts(parts, B::from(body)));
    match owner.run(call).await {
        Ok(Ok(response)) => Ok(owner.finish(phase, response).await),
        Ok(Err(error)) => {
            drop(phase); // rolls back the handler's writes, if any
            owner.release().await;
            Err(error)
        }
        Err(panic) => {
            drop(phase);
            owner.release().await;
            std::panic::resume_unwind(panic)
        }
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
    /// Runs the handler, catching a panic, while renewing the lease every
    /// third of it (so the lease runs out only when this process is gone).
    async fn run<F: Future>(&self, call: F) -> Result<F::Output, Box<dyn Any + Send>> {
        let call = AssertUnwindSafe(call).catch_unwind();
        let heartbeat = async {
            let every = self.config.lease / 3;
            loop {
                tokio::time::sleep(every).await;
                match self
                    .store
                    .extend(&self.record, self.token, self.config.lease)
                    .await
                {
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
            output = call => output,
            () = heartbeat => unreachable!("the heartbeat never ends"),
        }
    }

    async fn release(&self) {
        if let Err(error) = self.store.release(&self.record, self.token).await {
            // The record stays in progress until its lease runs out; then a
            // retry takes it over.
            tracing::warn!(%error, "could not release the idempotency key");
        }
    }

    /// Stores the response if its status is stored and it fits, inside the
    /// handler's transaction when it took one.
    async fn finish<ResBody>(
        &self,
        phase: Option<AtomicPhase>,
        response: Response<ResBody>,
    ) -> Response<Body>
    where
        ResBody: HttpBody<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let tx = match phase {
            None => None,
            Some(phase) => match phase.take().await {
                None => None, // the handler did not ask for a transaction
                Some(tx) => match tx.take() {
                    Some(tx) => Some(tx),
                    None => {
                        // A TxGuard outlived the handler (held by a task it
                        // spawned): its transaction cannot be completed.
                        self.release().await;
                        return Problem::CommitFailed.into_response();
                    }
                },
            },
        };
        let (parts, body) = response.into_parts();
        if !(self.config.stores_status)(parts.status) {
            drop(tx);
            self.release().await;
            return Response::from_parts(parts, Body::new(body));
        }
        let limit = self.config.max_response_body;
        let body = match read_capped(Box::pin(body), limit).await {
            Capped::Complete(body) => body,
            Capped::TooLarge(prefix, rest) => {
                self.release().await;
                if tx.is_some() {
                    return Problem::ResponseTooLarge { limit }.into_response();
                }
                return Response::from_parts(parts, prefixed(prefix, rest));
            }
            Capped::Failed(prefix, error) => {
                drop(tx);
                self.release().await;
                return Response::from_parts(parts, failing(prefix, error));
            }
        };
        let stored = self.stored(&parts, body.clone());
        let ttl = self.config.ttl;
        match tx {
            Some(mut tx) => {
                match complete_on(&mut tx, &self.record, self.token, &stored, ttl).await {
                    Ok(true) => {
                        if let Err(error) = tx.commit().await {
                            tracing::warn!(%error, "commit of the atomic phase failed");
                            self.release().await; // a no-op if the commit did land
                            return Problem::CommitFailed.into_response();
                        }
                    }
                    Ok(false) => return Problem::LeaseLost.into_response(),
                    Err(error) => {
                        tracing::warn!(%error, "completing the key in the handler's transaction failed");
                        drop(tx);
                        self.release().await;
                        return Problem::CommitFailed.into_response();
                    }
                }
            }
            None => match self
                .store
                .complete(&self.record, self.token, &stored, ttl)
                .await
            {
                Ok(true) => {}
                Ok(false) => tracing::warn!(
                    key = ?self.record,
                    "the lease was taken over before the response was stored; answering without storing"
                ),
                Err(error) => tracing::error!(
                    %error,
                    key = ?self.record,
                    "could not store the response; a retry after the lease runs out executes again"
                ),
            },
        }
        Response::from_parts(parts, Body::from(body))
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

enum Capped<B> {
    Complete(Bytes),
    TooLarge(Bytes, B),
    Failed(Bytes, BoxError),
}

/// Reads a response body up to `limit` bytes; beyond that, hands back what
/// was read and the rest, unread, so it can still be streamed to the client.
async fn read_capped<B>(mut body: B, limit: usize) -> Capped<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                    if read.len() > limit {
                        return Capped::TooLarge(read.freeze(), body);
                    }
                }
            }
            Err(error) => return Capped::Failed(read.freeze(), error.into()),
        }
    }
    Capped::Complete(read.freeze())
}

/// `prefix`, then the rest of `body`.
fn prefixed<B>(prefix: Bytes, body: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let rest = Body::new(body).into_data_stream();
    let head = futures::stream::once(async move { Ok::<_, axum_core::Error>(prefix) });
    Body::from_stream(head.chain(rest))
}

/// `prefix`, then the error the body ended with: the client sees the
/// response break off, as it would without the layer.
fn failing(prefix: Bytes, error: BoxError) -> Body {
    let chunks: [Result<Bytes, BoxError>; 2] = [Ok(prefix), Err(error)];
    Body::from_stream(futures::stream::iter(chunks))
}
