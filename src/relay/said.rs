//! A batch's rows as the relay publishes them, and what the broker said
//! of each message: the words between the relay and a transport's link.

use crate::outbox::packed::Staged;

/// A picked row and what became of each of its messages.
pub(crate) struct Envelope {
    pub(crate) id: i64,
    pub(crate) attempts: i32,
    pub(crate) packed: bool,
    pub(crate) key: Option<String>,
    pub(crate) messages: Vec<Staged>,
}

/// What the broker said about one message of a batch.
pub(crate) enum Said {
    Confirmed,
    /// Refused because of the message itself (nacked, returned, a channel
    /// error over it, a header frame too large); `certain`: it can never
    /// go out (given up at once).
    Refused {
        error: String,
        certain: bool,
    },
    /// No answer that can be attributed: the broker may or may not hold it
    /// (the row stays pending and is published again, no attempt counted).
    Unknown(String),
}

impl Said {
    pub(crate) fn unknown(&self) -> Option<&str> {
        match self {
            Said::Unknown(why) => Some(why),
            _ => None,
        }
    }
}
