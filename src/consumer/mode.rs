//! The consumer's modes, as the state of a [`ConsumerBuilder`]: each handler
//! method moves the builder into its mode, and only the options that make
//! sense there exist on it. A combination that cannot run (a batch handler
//! with message groups, two handlers, no handler) does not compile.
//!
//! | mode | entered with | options of its own |
//! |---|---|---|
//! | [`PerMessage`] | [`handler`](ConsumerBuilder::handler) | [`message_groups`](ConsumerBuilder::message_groups), [`batch`](ConsumerBuilder::batch) (→ [`Batched`]) |
//! | [`Batched`] | [`batch_handler`](ConsumerBuilder::batch_handler), or `.handler(h).batch(n)` | [`batch`](ConsumerBuilder::batch), [`batch_linger`](ConsumerBuilder::batch_linger) |
//! | [`Windowed`] (feature `window`) | `dedup_window(w).window_handler(h)` | `message_groups` |
//!
//! [`ConsumerBuilder`]: crate::consumer::ConsumerBuilder
//!
//! # What does not compile
//! No handler, no `build`:
//! ```compile_fail
//! # async fn doc(pool: sqlx::PgPool) {
//! idempo::amqp::Consumer::builder("amqp://127.0.0.1", pool).queue("q").build();
//! # }
//! ```
//! One handler per consumer:
//! ```compile_fail
//! # use idempo::{Tx, amqp::Consumer, consumer::{HandlerError, Message}};
//! # async fn h(_: Tx, _: Message) -> Result<(), HandlerError> { Ok(()) }
//! # async fn b(_: Tx, _: Vec<Message>) -> Result<(), HandlerError> { Ok(()) }
//! # async fn doc(pool: sqlx::PgPool) {
//! Consumer::builder("amqp://127.0.0.1", pool).batch_handler(b).handler(h);
//! # }
//! ```
//! Message groups need per-message mode:
//! ```compile_fail
//! # use idempo::{Tx, amqp::Consumer, consumer::{HandlerError, Message}};
//! # async fn h(_: Tx, _: Message) -> Result<(), HandlerError> { Ok(()) }
//! # async fn doc(pool: sqlx::PgPool) {
//! Consumer::builder("amqp://127.0.0.1", pool).handler(h).batch(10).message_groups();
//! # }
//! ```
//! A dedup window takes a handler without a transaction:
//! ```compile_fail
//! # use idempo::{Tx, amqp::Consumer, consumer::{HandlerError, Message}};
//! # use idempo::window::{DedupWindow, MemoryWindow};
//! # async fn h(_: Tx, _: Message) -> Result<(), HandlerError> { Ok(()) }
//! # async fn doc(pool: sqlx::PgPool) {
//! Consumer::builder("amqp://127.0.0.1", pool)
//!     .dedup_window(DedupWindow::new(MemoryWindow::new(10)))
//!     .handler(h);
//! # }
//! ```
//! And the same calls in a valid order compile:
//! ```
//! # use idempo::{Tx, amqp::Consumer, consumer::{HandlerError, Message}};
//! # async fn h(_: Tx, _: Message) -> Result<(), HandlerError> { Ok(()) }
//! # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
//! let per_message = Consumer::builder("amqp://127.0.0.1", pool.clone())
//!     .queue("q")
//!     .handler(h)
//!     .message_groups()
//!     .build()?;
//! let batched = Consumer::builder("amqp://127.0.0.1", pool)
//!     .queue("q")
//!     .handler(h)
//!     .batch(10)
//!     .build()?;
//! # Ok(()) }
//! ```

#[cfg(doc)]
use crate::consumer::ConsumerBuilder;
pub use crate::runtime::mode::{Batched, NoHandler, PerMessage};
#[cfg(feature = "window")]
#[cfg_attr(docsrs, doc(cfg(feature = "window")))]
pub use crate::runtime::window_mode::{WindowNoHandler, Windowed};
