//! Where the consumer runtime and the [dedup window](crate::window) meet
//! (features `amqp` and `window`): the [`DedupPublisher`], and a consumer
//! mode that deduplicates on a window instead of the inbox
//! ([`ConsumerBuilder::dedup_window`](crate::amqp::ConsumerBuilder::dedup_window)).

mod consumer;
mod publisher;

pub use consumer::{WindowHandler, WindowNoHandler, Windowed};
pub use publisher::{DedupPublisher, DedupPublisherBuilder, Outgoing, Published};
