//! [`AmqpOptions`]: what only a RabbitMQ consumer has (its queue, the
//! queues it declares, the broker), set through `ConsumerBuilder<Amqp, _>`'s
//! methods (`builder.rs`).

use super::broker::Broker;
use super::topology::QueueType;

/// A RabbitMQ consumer's own options, set with the methods of
/// [`ConsumerBuilder<Amqp, _>`](crate::amqp::ConsumerBuilder).
///
/// (Their defaults: [`ConsumerBuilder`](super::ConsumerBuilder)'s docs.)
#[derive(Debug)]
pub struct AmqpOptions {
    pub(crate) amqp_url: String,
    pub(crate) broker: Option<Broker>,
    pub(crate) queue: Option<String>,
    pub(crate) dead_letter_queue: Option<String>,
    pub(crate) queue_type: QueueType,
    pub(crate) declare: bool,
    pub(crate) bindings: Vec<(String, String)>,
    pub(crate) also_declare: Vec<String>,
    pub(crate) wait_for_topology: bool,
    pub(crate) connection_name: Option<String>,
}

impl AmqpOptions {
    /// The defaults, for a consumer of the broker at `amqp_url`.
    pub(crate) fn new(amqp_url: String) -> Self {
        AmqpOptions {
            amqp_url,
            broker: None,
            queue: None,
            dead_letter_queue: None,
            queue_type: QueueType::default(),
            declare: true,
            bindings: Vec::new(),
            also_declare: Vec::new(),
            wait_for_topology: false,
            connection_name: None,
        }
    }
}
