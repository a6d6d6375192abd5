//! The operations behind the `idempo` command, as library functions
//! (feature `ops`): what an operator asks of idempo's tables and queues,
//! for any front end (the command, a web dashboard, a test).
//!
//! - [`Services::status`]: claims per consumer, queue depths, the outbox, HTTP keys
//!   and window entries, with the [`Warning`]s an operator must act on and
//!   the [`Condition`] of each queue, consumer process and the outbox;
//! - [`dead_letters`]: list, group, show, replay, discard and purge dead
//!   letters, in the `dead_letters` table or a RabbitMQ DLQ, one API;
//! - [`maintenance`]: the migrations' state, and the retention and expiry
//!   deletes run once.
//!
//! Each operation takes the [`Services`] (where PostgreSQL and RabbitMQ are;
//! it connects only to what the operation needs) and returns typed values,
//! serialisable with serde where a front end prints them as JSON. Errors are
//! [`OpsError`]s.
//!
//! # Example
//! ```no_run
//! use idempo::ops::{OpsError, Services, StatusOptions};
//!
//! # async fn doc() -> Result<(), OpsError> {
//! let services = Services::new(
//!     "amqp://guest:guest@127.0.0.1:5672/%2f",
//!     "postgres://postgres@127.0.0.1:5432/postgres",
//! );
//! let status = services.status(&StatusOptions::default()).await?;
//! for consumer in &status.consumers {
//!     println!("{}: {} claims", consumer.consumer, consumer.claims);
//! }
//! for warning in &status.warnings {
//!     println!("WARNING: {warning}");
//! }
//! # Ok(()) }
//! ```

mod condition;
pub mod dead_letters;
mod error;
pub mod maintenance;
pub mod management;
mod status;
mod warning;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::FieldTable;
use lapin::{Connection, ErrorKind};
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::OnceCell;

use crate::ClientTls;
use crate::amqp::Broker;
use crate::redact_url as redacted;

pub use condition::Condition;
pub use error::OpsError;
pub(crate) use error::Result;
pub use status::{ConsumerStatus, DelayQueueStatus, QueueStatus, Status, StatusOptions};
pub use warning::Warning;

/// Where PostgreSQL and RabbitMQ are. Operations connect to what they need:
/// the database once (a pool of 2, kept for later operations), the broker
/// once per operation (its connection is closed at the end).
///
/// # Default
/// Connection name `idempo-ops` on the broker; 10 s to connect to either.
#[derive(Clone)]
pub struct Services {
    amqp_url: String,
    database_url: String,
    pool: Arc<OnceCell<PgPool>>,
    connection_name: String,
    tls: ClientTls,
    max_connections: u32,
    /// NATS, where the JetStream consumers' streams are (feature `nats`).
    nats_url: Option<String>,
}

/// How long connecting to either service may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl fmt::Debug for Services {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Services")
            .field("amqp_url", &self.amqp_urls())
            .field("database_url", &redacted(&self.database_url))
            .field("connection_name", &self.connection_name)
            .finish_non_exhaustive()
    }
}

impl Services {
    /// RabbitMQ at `amqp_url` (one or more comma-separated URLs, one per
    /// node) and PostgreSQL at `database_url`. Nothing is connected yet.
    pub fn new(amqp_url: impl Into<String>, database_url: impl Into<String>) -> Self {
        Services {
            amqp_url: amqp_url.into(),
            database_url: database_url.into(),
            pool: Arc::default(),
            connection_name: "idempo-ops".into(),
            tls: ClientTls::default(),
            max_connections: 2,
            nats_url: None,
        }
    }

    /// NATS at `nats_url`, asked for the streams of the JetStream consumers
    /// (feature `nats`; without it, their depths are unknown).
    pub fn nats(mut self, nats_url: impl Into<String>) -> Self {
        self.nats_url = Some(nats_url.into());
        self
    }

    /// The NATS URL, if one was given.
    #[cfg(feature = "nats")]
    pub(crate) fn nats_url(&self) -> Option<&str> {
        self.nats_url.as_deref()
    }

    /// RabbitMQ at `amqp_url` and the database behind `pool` (for an
    /// application that has one already, such as a dashboard).
    pub fn with_pool(amqp_url: impl Into<String>, pool: PgPool) -> Self {
        Services {
            pool: Arc::new(OnceCell::new_with(Some(pool))),
            ..Services::new(amqp_url, "")
        }
    }

    /// The most connections the database pool opens (default 2: a command
    /// does one thing at a time; a dashboard serving concurrent actions
    /// wants more). No effect once the pool is connected.
    #[must_use]
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// The name the broker connections carry (shown in RabbitMQ's management UI).
    #[must_use]
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// The TLS settings of `amqps://` addresses (see [`Broker::tls`]).
    #[must_use]
    pub fn broker_tls(mut self, tls: ClientTls) -> Self {
        self.tls = tls;
        self
    }

    /// The database pool, connected on first use.
    ///
    /// # Errors
    /// [`OpsError::Idempo`] with [`Error::Certificate`](crate::Error::Certificate)
    /// when a certificate file the URL names is unusable;
    /// [`OpsError::DatabaseUnreachable`].
    pub async fn database(&self) -> Result<&PgPool> {
        self.pool
            .get_or_try_init(|| async {
                crate::certificate::check_database_url(&self.database_url)
                    .map_err(crate::Error::from)?;
                PgPoolOptions::new()
                    .max_connections(self.max_connections)
                    .acquire_timeout(CONNECT_TIMEOUT)
                    .connect(&self.database_url)
                    .await
                    .map_err(|source| OpsError::DatabaseUnreachable {
                        url: redacted(&self.database_url),
                        source,
                    })
            })
            .await
    }

    /// A new broker connection (close it when done).
    ///
    /// # Errors
    /// [`OpsError::InvalidBrokerUrl`]; [`OpsError::Idempo`] with an error
    /// that names each node and why it failed
    /// ([`BrokerUnreachable`](crate::amqp::AmqpError::BrokerUnreachable),
    /// [`BrokerRefused`](crate::amqp::AmqpError::BrokerRefused),
    /// [`Tls`](crate::Error::Tls)) or the certificate file that is unusable
    /// ([`Certificate`](crate::Error::Certificate));
    /// [`OpsError::BrokerUnreachable`] otherwise.
    pub async fn broker(&self) -> Result<Connection> {
        let broker = Broker::new(&self.amqp_url)
            .map_err(|source| OpsError::InvalidBrokerUrl {
                urls: self.amqp_urls(),
                source,
            })?
            .connection_timeout(CONNECT_TIMEOUT)
            .tls(&self.tls)?;
        broker
            .connect(&self.connection_name)
            .await
            .map_err(|source| {
                // These name every node already.
                let named = matches!(
                    source,
                    crate::Error::Tls { .. } | crate::Error::Certificate(_)
                ) || matches!(
                    crate::amqp::AmqpError::of(&source),
                    Some(
                        crate::amqp::AmqpError::BrokerUnreachable { .. }
                            | crate::amqp::AmqpError::BrokerRefused { .. }
                    )
                );
                if named {
                    OpsError::Idempo(source)
                } else {
                    OpsError::BrokerUnreachable {
                        urls: self.amqp_urls(),
                        source,
                    }
                }
            })
    }

    /// The broker URLs without their passwords.
    fn amqp_urls(&self) -> String {
        crate::amqp::urls::redacted(&self.amqp_url)
    }
}

/// A queue's ready messages and consumers, from a passive declare.
/// (Unacknowledged messages are not counted: that needs the management API.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub(crate) struct QueueDepth {
    /// Messages ready for delivery.
    pub ready: u32,
    /// Consumers attached.
    pub consumers: u32,
}

/// The depth of `queue`, or `None` when it does not exist. Declares nothing:
/// a passive declare on a channel of its own (a failed one closes its channel).
///
/// # Errors
/// [`OpsError::InspectQueue`] when the broker refuses for another reason
/// (access refused), [`OpsError::Amqp`] when no channel opens.
pub(crate) async fn queue_depth(
    connection: &Connection,
    queue: &str,
) -> Result<Option<QueueDepth>> {
    crate::amqp::topology::check_name("queue", queue)?;
    let channel = connection.create_channel().await?;
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(q) => {
            let _ = channel.close(200, "bye".into()).await;
            Ok(Some(QueueDepth {
                ready: q.message_count(),
                consumers: q.consumer_count(),
            }))
        }
        Err(e) if not_found(&e) => Ok(None),
        Err(source) => Err(OpsError::InspectQueue {
            queue: queue.to_owned(),
            source,
        }),
    }
}

/// The broker's channel error `NOT_FOUND` (404).
fn not_found(error: &lapin::Error) -> bool {
    match error.kind() {
        ErrorKind::ProtocolError(e) => {
            matches!(e.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
        }
        _ => false,
    }
}

/// PostgreSQL's `undefined_table` (42P01): a table of a feature whose
/// migration did not run.
fn undefined_table(error: &sqlx::Error) -> bool {
    crate::sqlstate::is(error, UNDEFINED_TABLE)
}

/// `undefined_table`: a table whose migration did not run.
const UNDEFINED_TABLE: &str = "42P01";

/// [`undefined_table`] for the crate's error.
fn missing_table(error: &crate::Error) -> bool {
    matches!(error, crate::Error::Database(e) if undefined_table(e))
}

/// A duration as the operations print it: one unit, rounded down (`250ms`,
/// `90s`, `45m`, `36h`, `7d`).
///
/// ```
/// use std::time::Duration;
/// use idempo::ops::short_duration;
///
/// assert_eq!(short_duration(Duration::from_millis(250)), "250ms");
/// assert_eq!(short_duration(Duration::from_secs(90)), "90s");
/// assert_eq!(short_duration(Duration::from_secs(7 * 86_400)), "7d");
/// ```
pub fn short_duration(d: std::time::Duration) -> String {
    match d.as_secs() {
        0 => format!("{}ms", d.as_millis()),
        s if s < 120 => format!("{s}s"),
        s if s < 7_200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// Closes a broker connection, ignoring errors (it is being let go).
async fn close(connection: &Connection) {
    let _ = connection.close(200, "bye".into()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_print_in_one_unit() {
        let s = std::time::Duration::from_secs;
        assert_eq!(short_duration(std::time::Duration::ZERO), "0ms");
        assert_eq!(short_duration(s(119)), "119s");
        assert_eq!(short_duration(s(120)), "2m");
        assert_eq!(short_duration(s(7_199)), "119m");
        assert_eq!(short_duration(s(7_200)), "2h");
        assert_eq!(short_duration(s(172_800)), "2d");
    }

    #[test]
    fn errors_stay_small() {
        // Results of operations move these around: no large variant.
        assert!(std::mem::size_of::<OpsError>() <= 112);
    }

    #[test]
    fn services_never_show_passwords() {
        let services = Services::new(
            "amqp://guest:secret@a:5672/%2f, amqp://guest:secret@b:5672/%2f",
            "postgres://app:hunter2@db/app",
        );
        let shown = format!("{services:?}");
        assert!(
            !shown.contains("secret") && !shown.contains("hunter2"),
            "{shown}"
        );
        assert!(
            shown.contains("amqp://guest:***@a:5672/%2f,amqp://guest:***@b:5672/%2f"),
            "{shown}"
        );
    }
}
