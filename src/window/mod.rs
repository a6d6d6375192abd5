//! An SQS-FIFO-style deduplication window (feature `window`).
//!
//! Amazon SQS FIFO queues drop a message whose deduplication id was seen in
//! the last five minutes. This module brings that to RabbitMQ:
//!
//! - [`DedupId`]: explicit (1 to 128 characters from SQS's set) or
//!   content-based (SHA-256 of the body), counted per [`Scope`]: per queue,
//!   or per message group.
//! - [`DedupWindow`]: "insert this id unless it was seen within the window",
//!   atomically, over a [`WindowStore`]: [`MemoryWindow`] (bounded),
//!   [`PostgresWindow`] (spawn [`WindowStore::run_cleanup`] for it) or `RedisWindow`
//!   (feature `redis`; `RedisWindow::connect(url)` needs no redis types).
//! - With feature `amqp`, `amqp::window` joins the two: a `DedupPublisher`
//!   that sends a duplicate id only once within the window (recording the id
//!   only after the broker confirmed the first publish), and a consumer mode
//!   that deduplicates on a window instead of the inbox.
//!
//! # How it compares with the inbox
//! The [inbox](crate::inbox) remembers every processed id until retention
//! removes it, and the id commits in the same transaction as the handler's
//! writes: exactly-once effects. A window forgets ids after its length, and
//! recording an id is a separate step from the effect: a duplicate that
//! arrives after the window passes, and a crash between the effect and the
//! record lets the redelivery run again. Use a window where there is no
//! database to put the effect in, or at the publishing side.

mod dedup_id;
mod dedup_window;
mod memory;
mod postgres;
#[cfg(feature = "redis")]
mod redis;
pub(crate) mod store;

pub use dedup_id::{DedupId, InvalidDedupId, Scope};
pub use dedup_window::DedupWindow;
pub use memory::MemoryWindow;
pub use postgres::PostgresWindow;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::RedisWindow;
pub use store::{Insertion, Reservation, WindowStore};
