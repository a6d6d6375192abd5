//! Why a quarantine pass could not run.

use std::time::Duration;

/// Why a pass could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum QuarantineError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("the broker said: {0}")]
    Broker(String),
    #[error("unexpected frame: {0}")]
    Protocol(String),
    #[error("the broker address: {0}")]
    Address(String),
    #[error("the dead letter was not confirmed: {0}")]
    NotConfirmed(&'static str),
    #[error("took longer than {0:?}")]
    Timeout(Duration),
    #[error("the dead-letter table refused the letter: {0}")]
    Store(String),
}

pub(super) type Result<T> = std::result::Result<T, QuarantineError>;
