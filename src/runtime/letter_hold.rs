//! A dead letter's hold on its message's claim: stored in the letter's own
//! transaction, it makes any later delivery of the message a duplicate of
//! its letter, never run again, also a *first* delivery (a JetStream durable
//! set up anew sends the stream again). A replay releases it. The claim
//! itself is the inbox's; the hold is a flag on it (`lettered`), which the
//! inbox's lookups pass over.

use sqlx::{Postgres, Transaction};

use crate::Result;
use crate::inbox::{Claim, Inbox};
use crate::message_id::validate_message_id;

/// What [`hold`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LetterHold {
    /// The claim is the letter's (or no claim can hold the id).
    Held,
    /// The message was processed: its delivery is a duplicate, not a letter.
    Processed,
}

/// Claims `message_id` for `consumer` on behalf of its dead letter, in the
/// letter's transaction (at READ COMMITTED), through `inbox` (set for the
/// table's shape, plain or partitioned). An id claimed already keeps its
/// claim; an id no claim can hold is left alone.
///
/// [`LetterHold::Processed`] when the message was processed already (with
/// this body): it must not be dead-lettered too. The claim is the lock, so
/// a processing still in flight is waited for.
pub(crate) async fn hold(
    tx: &mut Transaction<'_, Postgres>,
    inbox: &Inbox,
    message_id: &str,
    body: &[u8],
) -> Result<LetterHold> {
    if validate_message_id(message_id).is_err() {
        return Ok(LetterHold::Held);
    }
    let consumer = inbox.consumer();
    if inbox.claim(tx, message_id, body).await? == Claim::Fresh {
        // The row this transaction inserted: its `processed_at` is now().
        sqlx::query(
            "UPDATE processed_messages SET lettered = true \
             WHERE consumer = $1 AND message_id = $2 AND processed_at = now()",
        )
        .bind(consumer)
        .bind(message_id)
        .execute(&mut **tx)
        .await?;
    }
    // A statement of its own: at READ COMMITTED it sees the claim a
    // concurrent processing committed while the claim waited on it. The
    // lookup passes over held claims: a duplicate is a processing's.
    Ok(match inbox.lookup(&mut **tx, message_id, body).await? {
        Claim::Duplicate => LetterHold::Processed,
        Claim::Fresh | Claim::Mismatch => LetterHold::Held,
    })
}

/// Releases the claim `message_id`'s dead letter holds for `consumer`
/// ([`hold`]), in the replay's transaction: the replayed copy is then
/// fresh. A claim of a processing stays. (Replays are the operator's
/// tools: feature `ops`.)
#[cfg(feature = "ops")]
pub(crate) async fn release<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    consumer: &str,
    message_id: &str,
) -> Result<()> {
    sqlx::query(
        "DELETE FROM processed_messages WHERE consumer = $1 AND message_id = $2 AND lettered",
    )
    .bind(consumer)
    .bind(message_id)
    .execute(executor)
    .await?;
    Ok(())
}
