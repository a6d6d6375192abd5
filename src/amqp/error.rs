//! [`AmqpError`]: what the AMQP transport reports (the broker, its topology,
//! its publishes). It reaches callers inside the crate's
//! [`Error::Other`](crate::Error::Other): find it with
//! [`AmqpError::of`] (or `error.downcast_ref::<AmqpError>()`).

use crate::Error;

/// An error of the AMQP transport.
///
/// ```no_run
/// use idempo::amqp::{AmqpError, Consumer};
/// # async fn doc(consumer: Consumer) {
/// if let Err(error) = consumer.run().await {
///     match AmqpError::of(&error) {
///         Some(AmqpError::BrokerRefused { .. }) => eprintln!("fix the credentials: {error}"),
///         _ => eprintln!("{error}"),
///     }
/// }
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmqpError {
    /// The AMQP connection or channel failed.
    #[error("amqp error: {0}")]
    Client(#[from] lapin::Error),

    /// No broker node could be connected to: each node tried, and why it
    /// failed (refused, no answer within the connection timeout, lost). An
    /// outage: the consumer, the relay and the publishers retry it.
    #[error("cannot connect to RabbitMQ: {}", NodeFailure::list(.nodes))]
    BrokerUnreachable {
        /// Each node tried, in order.
        nodes: Vec<NodeFailure>,
    },

    /// The broker refused this client's configuration at connect time: a
    /// wrong user name or password (`ACCESS_REFUSED`), a vhost that does not
    /// exist or that the user may not access (`NOT_ALLOWED`), a port that
    /// speaks TLS to an `amqp://` URL. No retry can fix it: at start it is
    /// returned; after a connection once worked, it is retried (and reported
    /// in `Health`), as an operator may be fixing the broker.
    #[error("RabbitMQ refused the connection: {}", NodeFailure::list(.nodes))]
    BrokerRefused {
        /// Each node tried, in order, and why it failed.
        nodes: Vec<NodeFailure>,
    },

    /// The broker refused an operation for lack of a permission
    /// (`ACCESS_REFUSED`, 403): configure on a queue the consumer declares,
    /// read on the queue it consumes. Returned at start, like
    /// [`TopologyConflict`](AmqpError::TopologyConflict).
    #[error(
        "RabbitMQ refused to {operation} ({broker}): grant the user the permission \
         (rabbitmqctl set_permissions), or manage the queues yourself with declare(false)"
    )]
    AccessRefused {
        /// What was refused, e.g. `declare queue "payments"`.
        operation: String,
        /// What the broker said.
        broker: String,
    },

    /// The broker refused to declare a queue because it exists with other
    /// arguments (another type, other dead-letter settings): a configuration
    /// error, reported instead of retried.
    #[error(
        "the queues of {queue:?} exist with other arguments than this consumer declares \
         ({broker}); delete them, match the builder to them (queue_type, dead_letter_queue, \
         retry delays), or manage them yourself with declare(false)"
    )]
    TopologyConflict {
        /// The consumer's work queue.
        queue: String,
        /// What the broker said (it names the queue and the argument).
        broker: String,
    },

    /// The broker cancelled our consumer (for example: the queue was deleted).
    #[error("the broker cancelled the consumer of queue {queue:?}")]
    ConsumerCancelled {
        /// The queue that was being consumed.
        queue: String,
    },

    /// The broker did not confirm a publish (nacked, unroutable, timed out).
    #[error("publish not confirmed: {0}")]
    PublishNotConfirmed(String),
}

impl AmqpError {
    /// The AMQP error `error` carries, if any.
    pub fn of(error: &Error) -> Option<&AmqpError> {
        error.downcast_ref()
    }
}

impl From<AmqpError> for Error {
    fn from(e: AmqpError) -> Self {
        Error::Other(Box::new(e))
    }
}

impl From<lapin::Error> for Error {
    fn from(e: lapin::Error) -> Self {
        AmqpError::Client(e).into()
    }
}

/// One broker node that could not be used, and why (in
/// [`AmqpError::BrokerUnreachable`] and [`AmqpError::BrokerRefused`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeFailure {
    /// The node's address, without its password.
    pub node: String,
    /// Why it failed.
    pub reason: String,
}

impl NodeFailure {
    fn list(nodes: &[NodeFailure]) -> String {
        nodes
            .iter()
            .map(|n| format!("{}: {}", n.node, n.reason))
            .collect::<Vec<_>>()
            .join("; ")
    }
}
