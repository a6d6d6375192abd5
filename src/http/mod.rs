//! The `Idempotency-Key` pattern as a tower layer (feature `http`).
//!
//! A client retries a POST because the answer was lost; without help the
//! server charges twice. [`IdempotencyLayer`] makes the retry harmless: the
//! first request with a key runs and its response is stored; every retry with
//! the same key gets that response back, byte for byte, marked
//! `Idempotent-Replayed: true`. It works in axum (`Router::layer`,
//! `MethodRouter::layer`) and in any tower stack.
//!
//! ```no_run
//! use axum::{Router, routing::post, http::StatusCode};
//! use idempo::http::{IdempotencyLayer, IdempotencyStore, PostgresStore};
//!
//! # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
//! idempo::migrate(&pool).await?;
//! let store = PostgresStore::new(pool);
//! tokio::spawn(store.clone().run_cleanup(std::time::Duration::from_secs(60)));
//!
//! let app: Router = Router::new().route(
//!     "/payments",
//!     post(|| async { (StatusCode::CREATED, "charged") })
//!         .layer(IdempotencyLayer::new(store).require_key()),
//! );
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! # What a key means
//! - **The key**: header `Idempotency-Key`, 1 to 255 characters of visible
//!   ASCII, as a plain token or a structured-field string (`"..."`). See
//!   [`IdempotencyKey`].
//! - **Scope**: the key plus the user ([`IdempotencyLayer::user`]), the method
//!   and the path. Two users sending the same key run two operations. The
//!   record is found by a SHA-256 over the *length-prefixed* parts
//!   ([`RecordKey`]), so no user id or key can be crafted to reach another
//!   user's record.
//! - **Fingerprint**: SHA-256 of method, path with query, and body. The same
//!   key with another fingerprint is answered with 422: a key names one
//!   request.
//!
//! # The key's state machine
//! ```text
//!            begin (atomic)                         complete (token matches)
//! absent ─────────────────────▶ in progress ───────────────────────────────▶ complete ──▶ (TTL) absent
//!   ▲                           lease + token          │                          │
//!   │     release (token matches): handler error,      │ lease ran out:           │ retry: replay
//!   └──── panic, unstored status, oversize response ◀──┘ a retry takes over       ▼
//!                                                         with a new token     stored response
//! ```
//! - A request that finds the record **in progress** with a live lease gets
//!   409 with `Retry-After`. The lease (30 s) is renewed while the handler
//!   runs, so it runs out only when the process holding it died; then a retry
//!   with the same fingerprint takes the record over with a new
//!   [`FencingToken`].
//! - Completing, releasing and renewing act only when the record still
//!   carries the caller's token: a process that lost its lease cannot
//!   overwrite the new owner's record.
//! - Statuses that report an executed outcome (by default 2xx, 402 and 500:
//!   see [`StoredResponse::stored_by_default`] for the table and the principle)
//!   complete the record; the others release it so the client can retry. A
//!   handler error or panic releases it too.
//!
//! # The atomic phase
//! With [`PostgresStore`], a handler can take a [`Tx`](crate::Tx) (an axum
//! extractor): its writes and the completed record commit in one
//! transaction, after the handler returned. Then there is no window in which
//! the effect happened but the response was not stored, and a process that
//! lost its lease has its writes rolled back instead of doubled. Without
//! it (other stores, or handlers that write elsewhere), a crash between the
//! effect and storing the response leaves the key in progress until the lease
//! runs out, and the retry executes again: at-least-once.
//!
//! # Stores
//! | store | shared by instances | survives a restart | atomic phase |
//! |---|---|---|---|
//! | [`PostgresStore`] | yes | yes | yes |
//! | `RedisStore` (feature `redis`) | yes | as configured in Redis | no |
//! | [`MemoryStore`] | no | no | no |
//!
//! One difference: once a dead holder's lease ran out, PostgreSQL and memory
//! still know the record's fingerprint (a different body gets 422), while on
//! Redis the lease key is gone and the key is free for any request.
//!
//! A store error fails closed with 503 unless [`IdempotencyLayer::fail_open`].
//! Expired records count as absent; [`IdempotencyStore::run_cleanup`] deletes them.
//!
//! # Problems
//! The layer's own answers are `application/problem+json` (RFC 9457) with a
//! `type` of `https://docs.rs/idempo/latest/idempo/http/index.html` (this
//! page) plus one of these fragments:
//!
//! | `type` fragment | status | when |
//! |---|---|---|
//! | `#missing-key` | 400 | the route requires a key and none was sent, or a handler takes `Tx` and the request has no key |
//! | `#invalid-key` | 400 | empty, over 255 characters, not visible ASCII, badly quoted, repeated |
//! | `#body-too-large` | 413 | the body exceeds [`IdempotencyLayer::max_request_body`] |
//! | `#body-unreadable` | 400 | the request body failed while being read |
//! | `#body-timeout` | 408 | the request body did not arrive within [`IdempotencyLayer::body_timeout`] |
//! | `#key-mismatch` | 422 | the key was used for a different request |
//! | `#in-progress` | 409 | the first request is still running (with `Retry-After`) |
//! | `#store-unavailable` | 503 | the store failed, did not answer within [`IdempotencyLayer::store_timeout`], or is full; nothing was executed (with `Retry-After`) |
//! | `#response-too-large` | 500 | atomic phase: the response could not be stored, writes rolled back |
//! | `#lease-lost` | 409 | atomic phase: another request took the key over, writes rolled back |
//! | `#commit-failed` | 503 | atomic phase: the commit failed |
//! | `#no-transaction` | 500 | a handler asked for `Tx` on a route without the layer on a store with the atomic phase |
//! | `#database-unavailable` | 503 | a handler returned an [`idempo::Error`](crate::Error) that says the database is unreachable (never stored) |
//! | `#handler-failed` | 500 | a handler returned another [`idempo::Error`](crate::Error) (never stored) |

mod body;
mod config;
mod key;
mod layer;
mod memory;
mod postgres;
mod problem;
mod record;
#[cfg(feature = "redis")]
mod redis;
mod service;
mod store;
mod transaction;

pub use key::IdempotencyKey;
pub use layer::{IdempotencyLayer, InFlight};
pub use memory::MemoryStore;
pub use postgres::PostgresStore;
pub use record::{Fingerprint, RecordKey, StoredResponse};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::RedisStore;
pub use service::Idempotency;
pub use store::{AtomicStore, Begin, FencingToken, IdempotencyStore, Operation};
pub use transaction::TxRejection;
