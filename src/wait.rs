//! Waiting for PostgreSQL: the one loop that runs an operation again, with
//! backoff, while the database cannot answer, and gives up only when told to.
//!
//! An outage of the database is not a failure of the work that meets it: the
//! consumer's schema check, the seal's key, a dead letter's insert and the
//! database gate's probe all wait here instead of failing.

use std::future::Future;
use std::time::Duration;

use crate::backoff::Backoff;

/// How [`until_database_answers`] ended.
#[derive(Debug)]
pub(crate) enum Waited<T, E> {
    /// The operation succeeded.
    Done(T),
    /// The operation failed in a way waiting does not mend.
    Failed(E),
    /// `stop` resolved while the database was still away.
    Stopped,
}

/// Runs `attempt` until it succeeds or fails with an error `outage` does not
/// accept; after each outage sleeps a backoff delay between `min` and `max`,
/// logging `what` with the error (a warning for the 1st, 2nd, 4th… outage in
/// a row, debug otherwise). Cancel-safe: dropping the
/// future between attempts loses nothing.
pub(crate) async fn until_database_answers<T, E, Fut>(
    what: &str,
    (min, max): (Duration, Duration),
    stop: impl Future<Output = ()>,
    mut attempt: impl FnMut() -> Fut,
    outage: impl Fn(&E) -> bool,
) -> Waited<T, E>
where
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut backoff = Backoff::new(min, max);
    let mut outages: u32 = 0;
    tokio::pin!(stop);
    loop {
        match attempt().await {
            Ok(value) => return Waited::Done(value),
            Err(e) if outage(&e) => {
                let pause = backoff.next_delay();
                outages = outages.saturating_add(1);
                // The 1st, 2nd, 4th, 8th… in a row: a long outage does not
                // flood the log, and its start is never missed.
                if outages.is_power_of_two() {
                    tracing::warn!(error = %e, ?pause, outages, "{what}: waiting for the database");
                } else {
                    tracing::debug!(error = %e, ?pause, outages, "{what}: waiting for the database");
                }
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = &mut stop => return Waited::Stopped,
                }
            }
            Err(e) => return Waited::Failed(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUICK: (Duration, Duration) = (Duration::from_millis(1), Duration::from_millis(2));

    #[tokio::test]
    async fn an_outage_is_waited_out_and_another_error_is_returned() {
        let mut calls = 0;
        let waited = until_database_answers(
            "test",
            QUICK,
            std::future::pending(),
            || {
                calls += 1;
                let n = calls;
                async move {
                    match n {
                        1 | 2 => Err("down"),
                        3 => Err("bad"),
                        _ => Ok(n),
                    }
                }
            },
            |e: &&str| *e == "down",
        )
        .await;
        assert!(matches!(waited, Waited::Failed("bad")), "{waited:?}");
        assert_eq!(calls, 3);
    }

    #[tokio::test]
    async fn success_after_an_outage_and_stop_during_one() {
        let mut calls = 0;
        let waited = until_database_answers(
            "test",
            QUICK,
            std::future::pending(),
            || {
                calls += 1;
                let n = calls;
                async move { if n < 3 { Err("down") } else { Ok(n) } }
            },
            |_: &&str| true,
        )
        .await;
        assert!(matches!(waited, Waited::Done(3)), "{waited:?}");
        let stopped: Waited<(), &str> = until_database_answers(
            "test",
            QUICK,
            std::future::ready(()),
            || async { Err("down") },
            |_| true,
        )
        .await;
        assert!(matches!(stopped, Waited::Stopped));
    }
}
