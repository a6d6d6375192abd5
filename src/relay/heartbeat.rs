//! A standalone relay says it is alive in `idempo_heartbeats`, as consumers
//! do, so that the dashboard and `idempo status` list it beside them.

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::RelayHealth;
use crate::runtime::heartbeat::{HEARTBEAT_EVERY, Identity, lower, write};

/// A standalone relay's heartbeats (consumer `relay`, no queue), every
/// [`HEARTBEAT_EVERY`] and when its state changes, until `stop`; then one
/// saying `stopped`.
pub(crate) async fn beat_for_relay(pool: PgPool, health: RelayHealth, stop: CancellationToken) {
    let who = Identity::new("relay", "");
    loop {
        let state = health.snapshot().state;
        let text = lower(state);
        write(&pool, &who, &text, Some(&text), serde_json::json!({})).await;
        tokio::select! {
            () = tokio::time::sleep(HEARTBEAT_EVERY) => {}
            _ = health.wait_for(|s| s.state != state) => {}
            () = stop.cancelled() => break,
        }
    }
    write(
        &pool,
        &who,
        "stopped",
        Some("stopped"),
        serde_json::json!({}),
    )
    .await;
}
