//! `build`: the settings every transport shares checked once, then the
//! transport's own options, then the mode; the consumer assembled from them.

use std::sync::Arc;

use super::ConsumerBuilder;
use crate::runtime::consumer::{Config, Consumer};
use crate::runtime::database_gate::DatabaseGate;
use crate::runtime::forwarding::Forwarding;
use crate::runtime::health::Health;
use crate::runtime::letters::LetterStore;
use crate::runtime::mode::{IntoDispatch, Parts};
use crate::runtime::shutdown::ShutdownHandle;
use crate::runtime::stats::Stats;
use crate::runtime::transport::{Setup, Transport};
use crate::{Error, Result};

/// Checks the settings, the transport's options and the mode, and builds
/// the consumer.
pub(crate) fn finish<T: Transport, Mode: IntoDispatch>(
    builder: ConsumerBuilder<T, Mode>,
) -> Result<Consumer<T>> {
    let ConsumerBuilder {
        settings: s,
        options,
        mode,
    } = builder;
    if s.concurrency == 0 {
        return Err(Error::Config("concurrency must be at least 1".into()));
    }
    if usize::from(s.prefetch) < s.concurrency {
        return Err(Error::Config(format!(
            "prefetch ({}) must be at least concurrency ({}): handlers beyond the prefetch would never get a delivery",
            s.prefetch, s.concurrency
        )));
    }
    s.redelivery.validate().map_err(Error::Config)?;
    if s.retention.is_some_and(|r| r.is_zero()) || s.retention_interval.is_zero() {
        return Err(Error::Config(
            "retention and retention_interval must be positive".into(),
        ));
    }
    let letters = letter_store::<T>(&s)?;
    let transport = T::build(
        options,
        &Setup {
            pool: &s.pool,
            consumer: s.consumer.as_deref(),
            prefetch: s.prefetch,
            concurrency: s.concurrency,
            batch: mode.batch_size(),
            redelivery: &s.redelivery,
            handler_timeout: s.handler_timeout,
            letters_in_table: letters.is_some(),
            claim_retention: s.retention,
        },
    )?;
    let consumer = s
        .consumer
        .clone()
        .unwrap_or_else(|| transport.source().to_owned());
    if consumer.is_empty() || consumer.contains('\0') {
        return Err(Error::Config(
            "the consumer name must not be empty or contain NUL".into(),
        ));
    }
    let stats = Stats::new(&consumer);
    let health = Health::default();
    let shutdown = ShutdownHandle::default();
    let gate = DatabaseGate::new(
        s.pool.clone(),
        health.clone(),
        stats.clone(),
        shutdown.graceful_token().clone(),
    );
    let forwarding = Arc::new(Forwarding::new(s.relay, T::NAME));
    let dispatch = mode.into_dispatch(&Parts {
        consumer: &consumer,
        #[cfg(feature = "window")]
        queue: transport.source(),
        pool: &s.pool,
        prefetch: s.prefetch,
        handler_timeout: s.handler_timeout,
        gate: &gate,
        stats: &stats,
        forwarding: &forwarding,
        partitioned: s.partitioning.is_some(),
        checked_acquire: s.checked_acquire,
        letters_in_table: letters.is_some(),
    })?;
    Ok(Consumer {
        transport: Arc::new(transport),
        config: Config {
            pool: s.pool,
            consumer,
            concurrency: s.concurrency,
            message_id: s.message_id,
            redelivery: s.redelivery,
            shutdown_timeout: s.shutdown_timeout,
            retention: s.retention,
            retention_interval: s.retention_interval,
            partitioning: s.partitioning,
            schema: s.schema,
            letters,
        },
        dispatch,
        forwarding,
        shutdown,
        stats,
        health,
    })
}

/// The dead-letter table when the consumer keeps its letters there (by
/// choice, or because the transport has no store of its own), with how long
/// its settled letters are kept; `None` for the transport's store.
fn letter_store<T: Transport>(
    s: &super::Settings,
) -> Result<Option<(Arc<dyn LetterStore>, std::time::Duration)>> {
    use crate::runtime::letters::DeadLetters;
    let store = s.dead_letters.unwrap_or(if T::OWN_DEAD_LETTERS {
        DeadLetters::Queue
    } else {
        DeadLetters::Table
    });
    match store {
        DeadLetters::Table => Ok(Some((
            Arc::new(crate::runtime::letter_table::TableStore {
                pool: s.pool.clone(),
            }) as Arc<dyn LetterStore>,
            s.dead_letters_kept,
        ))),
        DeadLetters::Queue if T::OWN_DEAD_LETTERS => Ok(None),
        DeadLetters::Queue => Err(Error::Config(format!(
            "the {} transport has no dead-letter store of its own: its dead letters go to the \
             dead_letters table (DeadLetters::Table, the default)",
            T::NAME
        ))),
    }
}
