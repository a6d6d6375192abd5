use std::borrow::Cow;

use super::*;
use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::outcome::{Outcome, handler_failed};

/// A database error with a SQLSTATE, as PostgreSQL would report it.
#[derive(Debug)]
struct Sqlstate(&'static str);

impl fmt::Display for Sqlstate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SQLSTATE {}", self.0)
    }
}

impl StdError for Sqlstate {}

impl sqlx::error::DatabaseError for Sqlstate {
    fn message(&self) -> &str {
        "database error"
    }
    fn code(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self.0))
    }
    fn as_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self
    }
    fn as_error_mut(&mut self) -> &mut (dyn StdError + Send + Sync + 'static) {
        self
    }
    fn into_error(self: Box<Self>) -> BoxError {
        self
    }
    fn kind(&self) -> sqlx::error::ErrorKind {
        sqlx::error::ErrorKind::Other
    }
}

/// A division by zero (SQLSTATE 22012): permanent.
fn division_by_zero() -> sqlx::Error {
    sqlx::Error::Database(Box::new(Sqlstate("22012")))
}

/// A serialization failure (SQLSTATE 40001): transient.
fn serialization_failure() -> sqlx::Error {
    sqlx::Error::Database(Box::new(Sqlstate("40001")))
}

/// `?` on `error` in a function returning `Result<_, HandlerError>`.
fn question_mark<E>(error: E) -> HandlerError
where
    HandlerError: From<E>,
{
    fn f<E>(error: E) -> Result<(), HandlerError>
    where
        HandlerError: From<E>,
    {
        Err(error)?;
        Ok(())
    }
    f(error).unwrap_err()
}

fn reason(outcome: &Outcome) -> Option<DeadLetterReason> {
    match outcome {
        Outcome::DeadLetter { reason, .. } => Some(*reason),
        _ => None,
    }
}

#[test]
fn question_mark_on_a_std_error_is_transient() {
    fn f() -> Result<(), HandlerError> {
        Err(std::io::Error::other("timeout"))?;
        Ok(())
    }
    let e = f().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transient);
    assert_eq!(e.to_string(), "timeout");
}

#[test]
fn question_mark_on_a_std_error_classifies_it_by_sqlstate() {
    assert!(question_mark(division_by_zero()).is_permanent());
    assert!(!question_mark(serialization_failure()).is_permanent());
    let undecodable = question_mark(DecodeError("not json".into()));
    assert_eq!(
        reason(&handler_failed(undecodable)),
        Some(DeadLetterReason::UndecodableBody)
    );
}

#[test]
fn question_mark_on_a_boxed_error_keeps_it_and_its_kind() {
    let boxed: BoxError = Box::new(std::io::Error::other("refused"));
    let e = question_mark(boxed);
    assert_eq!(e.kind(), ErrorKind::Transient);
    assert_eq!(e.to_string(), "refused");
    assert!(
        e.source().downcast_ref::<std::io::Error>().is_some(),
        "the box is the source, not wrapped again"
    );

    let boxed: BoxError = Box::new(division_by_zero());
    assert!(question_mark(boxed).is_permanent());
}

#[test]
fn question_mark_on_a_message_is_transient() {
    let e = question_mark("downstream said no");
    assert_eq!(
        (e.kind(), e.to_string().as_str()),
        (ErrorKind::Transient, "downstream said no")
    );
    let e = question_mark(format!("attempt {}", 2));
    assert_eq!(
        (e.kind(), e.to_string().as_str()),
        (ErrorKind::Transient, "attempt 2")
    );
}

#[test]
fn question_mark_on_anyhow_is_transient() {
    let e = question_mark(anyhow::anyhow!("downstream timed out"));
    assert_eq!(e.kind(), ErrorKind::Transient);
    assert_eq!(e.to_string(), "downstream timed out");
    // Inside a handler-shaped function: `?` on a call returning anyhow::Result.
    fn fetch() -> anyhow::Result<u32> {
        anyhow::bail!("no answer")
    }
    fn handle() -> Result<u32, HandlerError> {
        Ok(fetch()? + 1)
    }
    assert_eq!(handle().unwrap_err().kind(), ErrorKind::Transient);
}

#[cfg(feature = "anyhow")]
#[test]
fn question_mark_on_anyhow_classifies_the_error_it_carries() {
    use anyhow::Context;
    // As the bare error would be: permanent, transient.
    let e = question_mark(anyhow::Error::from(division_by_zero()));
    assert!(e.is_permanent());
    assert!(e.source().downcast_ref::<sqlx::Error>().is_some());
    assert!(!question_mark(anyhow::Error::from(serialization_failure())).is_permanent());
    // Under context (on a Result, then on an anyhow::Error): still found.
    let e = Err::<(), _>(division_by_zero())
        .context("computing the share")
        .unwrap_err();
    let e = question_mark(e);
    assert!(e.is_permanent());
    assert_eq!(e.to_string(), "computing the share");
    let e = anyhow::Error::from(division_by_zero())
        .context("computing the share")
        .context("crediting the account");
    assert!(question_mark(e).is_permanent());
}

#[cfg(feature = "anyhow")]
#[test]
fn question_mark_on_anyhow_wrapped_decode_error_dead_letters_it_as_undecodable() {
    fn decode(body: &[u8]) -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::from_slice(body).map_err(|e| DecodeError(e.to_string()))?)
    }
    let e = question_mark(decode(b"{not json").unwrap_err());
    assert!(e.source().downcast_ref::<DecodeError>().is_some());
    assert_eq!(
        reason(&handler_failed(e)),
        Some(DeadLetterReason::UndecodableBody)
    );
}

#[test]
fn the_kind_chosen_by_the_user_wins() {
    let r: Result<(), anyhow::Error> = Err(anyhow::anyhow!("a business rule"));
    assert!(r.permanent().unwrap_err().is_permanent());
    let r: Result<(), BoxError> = Err("a business rule".into());
    assert!(r.permanent().unwrap_err().is_permanent());
    let r: Result<(), sqlx::Error> = Err(division_by_zero());
    assert!(!r.transient().unwrap_err().is_permanent());
    assert!(HandlerError::permanent(anyhow::anyhow!("no")).is_permanent());
}

#[test]
fn prepare_is_object_safe() {
    fn _obj_safe(_: Arc<dyn Prepare>) {}
}

#[test]
fn permanent_marks_the_error() {
    let r: Result<(), &str> = Err("negative amount");
    let e = r.permanent().unwrap_err();
    assert!(e.is_permanent());
    assert_eq!(e.to_string(), "negative amount");
}
