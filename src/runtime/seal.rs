//! The seal on the message id that idempo's own copies carry forward.
//!
//! A retried or dead-lettered copy keeps the id its original was
//! deduplicated on in `x-idempo-message-id`, because a copy's properties
//! (routing key, expiration) differ from the original's and an id derived
//! from them must not be derived again. Any publisher can write that header,
//! though: a new payment with a forged header naming an old one would be
//! acked as its duplicate. So the copy also carries
//! `x-idempo-message-id-seal`, an HMAC-SHA256 of (consumer, id, body hash)
//! under a per-consumer secret kept in PostgreSQL (`idempo_consumer_keys`,
//! shared by the consumer's replicas). A header without a valid seal, or an
//! empty one, is ignored: the message's own id decides.

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use sqlx::PgPool;
use subtle::ConstantTimeEq;
use tokio::sync::OnceCell;

use crate::Result;
use crate::inbox::payload_sha256;
use crate::runtime::header_names::{MESSAGE_ID_HEADER, MESSAGE_ID_SEAL_HEADER};
use crate::runtime::message::Message;

/// Where a consumer's [`Seal`] comes from: loaded (or created) on first
/// use, so that a consumer whose database is down still starts, consumes and
/// dead-letters poison; only a copy that carries an id needs the key.
pub(crate) struct Keyring {
    pool: PgPool,
    consumer: String,
    seal: OnceCell<Seal>,
}

impl Keyring {
    pub(crate) fn new(pool: PgPool, consumer: String) -> Self {
        Keyring {
            pool,
            consumer,
            seal: OnceCell::new(),
        }
    }

    /// The key, if it is loaded already.
    pub(crate) fn loaded(&self) -> Option<&Seal> {
        self.seal.get()
    }

    /// The key, loading it if needed.
    pub(crate) async fn get(&self) -> Result<&Seal> {
        self.seal
            .get_or_try_init(|| Seal::load(&self.pool, &self.consumer))
            .await
    }

    /// The key, waiting (with backoff) while the database cannot give it;
    /// `None` if `give_up` resolves first.
    pub(crate) async fn wait(&self, give_up: impl Future<Output = ()>) -> Option<&Seal> {
        let waited = crate::wait::until_database_answers(
            "cannot load the consumer's key",
            (Duration::from_millis(100), Duration::from_secs(10)),
            give_up,
            || self.get(),
            // Whatever the cause, the key is needed before any copy is sent.
            |_| true,
        )
        .await;
        match waited {
            crate::wait::Waited::Done(seal) => Some(seal),
            _ => None,
        }
    }
}

/// The consumers that have a key: every consumer that sent a retry or
/// dead-letter copy (for `idempo status`, which looks for their queues).
#[cfg(feature = "ops")]
pub(crate) async fn consumers_with_keys(pool: &PgPool) -> Result<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT consumer FROM idempo_consumer_keys ORDER BY consumer")
            .fetch_all(pool)
            .await?,
    )
}

/// A consumer's key for sealing the ids on its copies.
#[derive(Clone)]
pub(crate) struct Seal {
    consumer: String,
    key: [u8; 32],
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seal")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

impl Seal {
    /// The consumer's key, created on first use (replicas racing to create it
    /// agree on whichever insert won).
    pub(crate) async fn load(pool: &PgPool, consumer: &str) -> Result<Seal> {
        let fresh: [u8; 32] = crate::random::bytes()?;
        let secret: Vec<u8> = sqlx::query_scalar(
            "WITH created AS (
                 INSERT INTO idempo_consumer_keys (consumer, secret) VALUES ($1, $2)
                 ON CONFLICT (consumer) DO NOTHING RETURNING secret)
             SELECT secret FROM created
             UNION ALL
             SELECT secret FROM idempo_consumer_keys WHERE consumer = $1
             LIMIT 1",
        )
        .bind(consumer)
        .bind(&fresh[..])
        .fetch_one(pool)
        .await?;
        let key = secret
            .try_into()
            .map_err(|_| crate::Error::CorruptRecord("a consumer key is not 32 bytes".into()))?;
        Ok(Seal {
            consumer: consumer.to_owned(),
            key,
        })
    }

    #[cfg(test)]
    pub(crate) fn for_test(consumer: &str, key: [u8; 32]) -> Seal {
        Seal {
            consumer: consumer.to_owned(),
            key,
        }
    }

    /// The seal of `id` on a copy of `message`, as lowercase hex.
    pub(crate) fn seal(&self, id: &str, message: &Message) -> String {
        hex::encode(self.mac(id, message))
    }

    /// The id an idempo copy carries forward, if `message` is one: the
    /// header is there, not empty, and its seal is valid.
    pub(crate) fn carried_id(&self, message: &Message) -> Option<String> {
        let id = claimed_id(message)?;
        let seal = message.header_text(MESSAGE_ID_SEAL_HEADER);
        let expected = self.seal(&id, message);
        match seal {
            Some(seal) if bool::from(seal.as_bytes().ct_eq(expected.as_bytes())) => Some(id),
            _ => {
                tracing::warn!(
                    header = MESSAGE_ID_HEADER,
                    "ignoring a message id header without a valid seal (not an idempo copy)"
                );
                None
            }
        }
    }

    fn mac(&self, id: &str, message: &Message) -> [u8; 32] {
        let body = payload_sha256(message.body());
        hmac_sha256(&self.key, &[self.consumer.as_bytes(), id.as_bytes(), &body])
    }
}

/// The id a message claims to carry forward (not yet checked): a non-empty
/// [`MESSAGE_ID_HEADER`].
pub(crate) fn claimed_id(message: &Message) -> Option<String> {
    message
        .header_text(MESSAGE_ID_HEADER)
        .filter(|id| !id.is_empty())
}

/// HMAC-SHA256 (RFC 2104) of `parts`, each prefixed with its length (a
/// big-endian u64) when there is more than one, so that no two different
/// tuples hash alike. A single part is MACed as it is (the RFC 4231 vectors).
fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    for part in parts {
        if parts.len() > 1 {
            mac.update(&(part.len() as u64).to_be_bytes());
        }
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2: key "Jefe".
        let mac = hmac_sha256(b"Jefe", &[b"what do ya want for nothing?"]);
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn hmac_matches_rfc_4231_with_a_key_longer_than_a_block() {
        // Test case 6: a 131-byte key, hashed first.
        let mac = hmac_sha256(
            &[0xaa; 131],
            &[b"Test Using Larger Than Block-Size Key - Hash Key First"],
        );
        assert_eq!(
            hex::encode(mac),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    /// Copies sealed by an earlier build of idempo sit in retry queues and
    /// DLQs: their seals must still verify, so the seal of a given (key,
    /// consumer, id, body) never changes.
    #[test]
    fn seals_keep_their_format() {
        const SEALED_BEFORE: &str =
            "4f1a88296d56eae915265b342220dc01896ec2b2b55230c33ee498e8bf0d1877";
        let seal = Seal::for_test("payments", [7; 32]);
        let body = br#"{"account":"a","amount_cents":1}"#;
        let plain = Message::for_test_with_headers(body, &[]);
        assert_eq!(seal.seal("pay-A", &plain), SEALED_BEFORE);
        let copy = |sealed: &str| {
            Message::for_test_with_headers(
                body,
                &[
                    (MESSAGE_ID_HEADER, "pay-A"),
                    (MESSAGE_ID_SEAL_HEADER, sealed),
                ],
            )
        };
        assert_eq!(
            seal.carried_id(&copy(SEALED_BEFORE)).as_deref(),
            Some("pay-A")
        );
        // One digit changed, upper case, cut short, one digit too many.
        let tampered = SEALED_BEFORE.replacen('4', "5", 1);
        let upper = SEALED_BEFORE.to_uppercase();
        let short = &SEALED_BEFORE[..63];
        let long = format!("{SEALED_BEFORE}0");
        for forged in [tampered.as_str(), upper.as_str(), short, long.as_str()] {
            assert_eq!(seal.carried_id(&copy(forged)), None, "{forged}");
        }
    }

    #[test]
    fn only_a_valid_seal_carries_an_id_forward() {
        let seal = Seal::for_test("payments", [7; 32]);
        let body = br#"{"account":"a","amount_cents":1}"#;
        let message = |headers: &[(&str, &str)]| Message::for_test_with_headers(body, headers);
        let sealed = seal.seal("pay-A", &message(&[]));
        let genuine = message(&[
            (MESSAGE_ID_HEADER, "pay-A"),
            (MESSAGE_ID_SEAL_HEADER, &sealed),
        ]);
        assert_eq!(seal.carried_id(&genuine).as_deref(), Some("pay-A"));
        // Forged: no seal, a wrong seal, another consumer's key, an empty id.
        let forged = message(&[(MESSAGE_ID_HEADER, "pay-A")]);
        assert_eq!(seal.carried_id(&forged), None);
        let wrong = message(&[
            (MESSAGE_ID_HEADER, "pay-B"),
            (MESSAGE_ID_SEAL_HEADER, &sealed),
        ]);
        assert_eq!(seal.carried_id(&wrong), None);
        let other = Seal::for_test("payments", [8; 32]);
        assert_eq!(other.carried_id(&genuine), None);
        let empty = message(&[(MESSAGE_ID_HEADER, ""), (MESSAGE_ID_SEAL_HEADER, &sealed)]);
        assert_eq!(seal.carried_id(&empty), None);
    }
}
