//! What a loop that lives through sessions needs besides: after a success,
//! the next failure starts from the shortest pause again (the transports'
//! reconnects, the relay's).

use super::Backoff;

impl Backoff {
    /// Back to the shortest pause, after a success.
    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn after_a_reset_the_next_pause_is_the_shortest() {
        let min = Duration::from_millis(100);
        let mut b = Backoff::new(min, Duration::from_secs(2));
        for _ in 0..10 {
            b.next_delay();
        }
        b.reset();
        assert!(b.next_delay() <= min);
    }
}
