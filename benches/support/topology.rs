//! The benches' queues are declared by the runtime itself, so that a
//! prefilled queue has exactly the arguments the measured consumer expects.

use idempo::amqp::Consumer;

/// Runs `consumer` until it consumes (its topology declared), then stops it.
pub async fn declare_once(consumer: Consumer) -> anyhow::Result<()> {
    let (stop, health) = (consumer.shutdown_handle(), consumer.health());
    let task = tokio::spawn(consumer.run());
    health.wait_for(|h| h.is_consuming()).await;
    stop.shutdown();
    task.await??;
    Ok(())
}
