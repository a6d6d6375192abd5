//! `build`: the builder's settings checked once, then the mode, and the
//! consumer assembled from them.

use super::*;

/// Checks the settings, then the mode, and builds the consumer.
pub(crate) fn finish<Mode: IntoDispatch>(builder: ConsumerBuilder<Mode>) -> Result<Consumer> {
    let ConsumerBuilder { settings: s, mode } = builder;
    let queue = s
        .queue
        .ok_or_else(|| Error::Config("a queue is required: call .queue(name)".into()))?;
    if s.concurrency == 0 {
        return Err(Error::Config("concurrency must be at least 1".into()));
    }
    if usize::from(s.prefetch) < s.concurrency {
        return Err(Error::Config(format!(
            "prefetch ({}) must be at least concurrency ({}): handlers beyond the prefetch would never get a delivery",
            s.prefetch, s.concurrency
        )));
    }
    let consumer = s.consumer.unwrap_or_else(|| queue.clone());
    if consumer.is_empty() || consumer.contains('\0') {
        return Err(Error::Config(
            "the consumer name must not be empty or contain NUL".into(),
        ));
    }
    s.redelivery.validate().map_err(Error::Config)?;
    if s.retention.is_some_and(|r| r.is_zero()) || s.retention_interval.is_zero() {
        return Err(Error::Config(
            "retention and retention_interval must be positive".into(),
        ));
    }
    let dead_letter_queue = s
        .dead_letter_queue
        .unwrap_or_else(|| dead_letter_queue(&queue));
    // Every name the runtime will send, derived ones included, fits AMQP.
    check_name("queue", &queue)?;
    check_name("dead-letter queue", &dead_letter_queue)?;
    if s.declare {
        for delay in s.redelivery.delays() {
            check_name("delay queue", &delay_queue(&queue, *delay))?;
        }
    }
    for other in &s.also_declare {
        check_name("queue", other)?;
        check_name(
            "dead-letter queue",
            &crate::amqp::topology::dead_letter_queue(other),
        )?;
    }
    for (exchange, routing_key) in &s.bindings {
        check_name("exchange", exchange)?;
        check_name("routing key", routing_key)?;
    }
    let broker = match s.broker {
        Some(broker) => broker,
        None => Broker::new(&s.amqp_url)?,
    };
    let connection_name = s
        .connection_name
        .unwrap_or_else(|| crate::host::connection_name(&consumer));
    let stats = Stats::new(&consumer);
    let health = Health::default();
    let shutdown = ShutdownHandle::default();
    let gate = DatabaseGate::new(
        s.pool.clone(),
        health.clone(),
        stats.clone(),
        shutdown.graceful_token().clone(),
    );
    let forwarding = Arc::new(Forwarding::new(s.relay, crate::amqp::TRANSPORT));
    let dispatch = mode.into_dispatch(&Parts {
        consumer: &consumer,
        queue: &queue,
        pool: &s.pool,
        prefetch: s.prefetch,
        handler_timeout: s.handler_timeout,
        gate: &gate,
        stats: &stats,
        forwarding: &forwarding,
        partitioned: s.partitioning.is_some(),
        checked_acquire: s.checked_acquire,
    })?;
    Ok(Consumer {
        config: Config {
            broker,
            pool: s.pool,
            consumer,
            topology: Topology {
                queue,
                dead_letter_queue,
                queue_type: s.queue_type,
                bindings: s.bindings,
                retry_delays: s.redelivery.delays().to_vec(),
            },
            declare: s.declare,
            prefetch: s.prefetch,
            concurrency: s.concurrency,
            message_id: s.message_id,
            redelivery: s.redelivery,
            shutdown_timeout: s.shutdown_timeout,
            retention: s.retention,
            retention_interval: s.retention_interval,
            partitioning: s.partitioning,
            connection_name,
            wait_for_topology: s.wait_for_topology,
            also_declare: s.also_declare,
            schema: s.schema,
            #[cfg(feature = "outbox")]
            dead_letters: s.dead_letters,
            #[cfg(feature = "outbox")]
            dead_letters_kept: s.dead_letters_kept,
        },
        dispatch,
        forwarding,
        shutdown,
        stats,
        health,
    })
}
