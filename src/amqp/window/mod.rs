//! The deduplicating publisher (features `amqp` and `window`): RabbitMQ
//! publishes deduplicated on a [dedup window](crate::window), so that a
//! producer's retry of a publish it could not confirm goes out once. (The
//! consumer's window mode, a window instead of the inbox, is the runtime's:
//! [`ConsumerBuilder::dedup_window`](crate::consumer::ConsumerBuilder::dedup_window).)

mod publisher;

pub use publisher::{DedupPublisher, DedupPublisherBuilder, Outgoing, Published};
