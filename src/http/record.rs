//! What an idempotency record is made of: the key that names it, the
//! fingerprint of the request that created it, and the stored response.

use std::fmt;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// Names one idempotent operation: the `Idempotency-Key` *scoped* by user,
/// method and path. The same key sent by two users names two operations.
///
/// Stores index records by [`digest`](Self::digest): a SHA-256 over the four
/// parts, each prefixed with its length. A separator could be forged (user
/// `"a|POST"` and user `"a"` with method `"POST|..."`); a length prefix cannot,
/// so no two distinct tuples share a record. A request without a user is
/// marked so in the digest by a tag no user id can produce: no user id (not
/// `"anonymous"`, not `""`) reaches the records of requests without one.
#[derive(Clone, PartialEq, Eq)]
pub struct RecordKey {
    digest: [u8; 32],
    user: Option<String>,
    method: String,
    path: String,
    key: String,
}

impl RecordKey {
    /// The record key of `key` sent by `user` (`None`: a request without
    /// one) to `method path`.
    pub fn new(user: Option<&str>, method: &str, path: &str, key: &str) -> Self {
        let mut hasher = Sha256::new();
        match user {
            // The tag byte keeps "no user" apart from every user id.
            None => hasher.update([0u8]),
            Some(user) => {
                hasher.update([1u8]);
                length_prefixed(&mut hasher, user.as_bytes());
            }
        }
        for part in [method, path, key] {
            length_prefixed(&mut hasher, part.as_bytes());
        }
        RecordKey {
            digest: hasher.finalize().into(),
            user: user.map(str::to_owned),
            method: method.to_owned(),
            path: path.to_owned(),
            key: key.to_owned(),
        }
    }

    /// The SHA-256 that stores use as the record's primary key.
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// [`digest`](Self::digest) in lowercase hex.
    pub fn hex(&self) -> String {
        hex::encode(self.digest)
    }

    /// The user the operation belongs to (`None`: a request without one).
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The request method.
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The request path (without the query).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The `Idempotency-Key` itself.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordKey")
            .field("user", &self.user)
            .field("method", &self.method)
            .field("path", &self.path)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// The SHA-256 of a request's method, path with query, and body: what the
/// key promised to mean. A retry must match it; reusing the key for a
/// different request is answered with 422.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a request.
    pub fn of_request(method: &str, path_and_query: &str, body: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        for part in [method.as_bytes(), path_and_query.as_bytes(), body] {
            length_prefixed(&mut hasher, part);
        }
        Fingerprint(hasher.finalize().into())
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Reads a fingerprint back from a store.
    ///
    /// # Errors
    /// [`Error::CorruptRecord`] unless `bytes` is 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        bytes
            .try_into()
            .map(Fingerprint)
            .map_err(|_| Error::CorruptRecord(format!("fingerprint of {} bytes", bytes.len())))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(self.0))
    }
}

/// A response kept for replay: status, the configured headers, and the body
/// byte for byte.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredResponse {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
}

impl StoredResponse {
    /// The default of [`IdempotencyLayer::stores_status`](super::IdempotencyLayer::stores_status), on one principle: a
    /// response that reports an **executed** outcome is stored and replayed; one
    /// that says the request was **not executed** is not stored, and the key is
    /// released so that the client can retry it.
    ///
    /// | status | stored | why |
    /// |---|---|---|
    /// | 2xx | yes | executed |
    /// | 402 Payment Required | yes | executed: a decline is the outcome of the attempt |
    /// | 500 Internal Server Error | yes | indeterminate: it may have executed, so it is replayed rather than repeated (as Stripe does) |
    /// | 400, 401, 403, 404, 405, 406, 409, 410, 411, 413, 414, 415, 422 and the other 4xx | no | refused before executing: validation, auth, routing, conflict |
    /// | 408, 425, 429 | no | not done: too slow, too early, overloaded |
    /// | 501, 502, 503, 504 and the other 5xx | no | not done: unavailable, try again |
    /// | 1xx, 3xx | no | not an outcome |
    ///
    /// What a handler must do to be safe under it: answer a status that is not
    /// stored **only when it wrote nothing** (a failed validation, a database
    /// that was down before anything committed), because the retry runs again.
    /// A handler that may fail half-way should use the
    /// [atomic phase](crate::http#the-atomic-phase) (its writes roll back with
    /// any answer that is not stored) or answer 500.
    pub fn stored_by_default(status: http::StatusCode) -> bool {
        matches!(status.as_u16(), 200..=299 | 402 | 500)
    }

    /// A response to store.
    pub fn new(status: StatusCode, headers: Vec<(HeaderName, HeaderValue)>, body: Bytes) -> Self {
        StoredResponse {
            status,
            headers,
            body,
        }
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stored headers, in their original order.
    pub fn headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The headers in a compact binary form (for stores with a separate
    /// column): a `u16` count, then per header a `u16`-prefixed name and a
    /// `u32`-prefixed value. Binary rather than JSON so that any header byte
    /// survives.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_headers(&mut out, &self.headers);
        out
    }

    /// Reads back [`encode_headers`](Self::encode_headers).
    ///
    /// # Errors
    /// [`Error::CorruptRecord`] if the bytes are not such an encoding.
    pub fn decode_headers(bytes: &[u8]) -> Result<Vec<(HeaderName, HeaderValue)>> {
        let mut reader = Reader(bytes);
        let headers = reader.headers()?;
        reader.end()?;
        Ok(headers)
    }

    /// The whole response in one byte string (for key-value stores): the
    /// status as `u16`, the headers as in [`encode_headers`](Self::encode_headers),
    /// then the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.body.len() + 64);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        put_headers(&mut out, &self.headers);
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads back [`encode`](Self::encode).
    ///
    /// # Errors
    /// [`Error::CorruptRecord`] if the bytes are not such an encoding.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut reader = Reader(bytes);
        let status = StatusCode::from_u16(u16::from_be_bytes(reader.array()?))
            .map_err(|e| Error::CorruptRecord(format!("stored status: {e}")))?;
        let headers = reader.headers()?;
        Ok(StoredResponse {
            status,
            headers,
            body: Bytes::copy_from_slice(reader.0),
        })
    }
}

impl fmt::Debug for StoredResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoredResponse")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body_len", &self.body.len())
            .finish()
    }
}

fn length_prefixed(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

fn put_headers(out: &mut Vec<u8>, headers: &[(HeaderName, HeaderValue)]) {
    // Header names are at most 64 KiB and values far below 4 GiB in any real
    // server (hyper's limits are much smaller), so the casts cannot truncate.
    out.extend_from_slice(&(headers.len() as u16).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(Error::CorruptRecord("stored response is truncated".into()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }

    fn headers(&mut self) -> Result<Vec<(HeaderName, HeaderValue)>> {
        let count = u16::from_be_bytes(self.array()?);
        (0..count)
            .map(|_| {
                let len = u16::from_be_bytes(self.array()?) as usize;
                let name = HeaderName::from_bytes(self.take(len)?)
                    .map_err(|e| Error::CorruptRecord(format!("stored header name: {e}")))?;
                let len = u32::from_be_bytes(self.array()?) as usize;
                let value = HeaderValue::from_bytes(self.take(len)?)
                    .map_err(|e| Error::CorruptRecord(format!("stored header value: {e}")))?;
                Ok((name, value))
            })
            .collect()
    }

    fn end(&self) -> Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Error::CorruptRecord(
                "trailing bytes after the headers".into(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_prefixes_keep_tuples_apart() {
        // Joined with a separator these two would be the same string.
        let a = RecordKey::new(Some("alice|POST"), "/x", "/y", "k");
        let b = RecordKey::new(Some("alice"), "POST|/x", "/y", "k");
        assert_ne!(a.digest(), b.digest());
        assert_eq!(a, RecordKey::new(Some("alice|POST"), "/x", "/y", "k"));
    }

    #[test]
    fn no_user_id_reaches_the_records_of_requests_without_one() {
        let nobody = RecordKey::new(None, "POST", "/p", "k");
        for forged in ["", "anonymous", "\0"] {
            assert_ne!(
                nobody.digest(),
                RecordKey::new(Some(forged), "POST", "/p", "k").digest()
            );
        }
        assert_eq!(nobody.user(), None);
    }

    #[test]
    fn fingerprint_covers_method_path_and_body() {
        let base = Fingerprint::of_request("POST", "/p", b"{}");
        assert_eq!(base, Fingerprint::of_request("POST", "/p", b"{}"));
        assert_ne!(base, Fingerprint::of_request("PATCH", "/p", b"{}"));
        assert_ne!(base, Fingerprint::of_request("POST", "/q", b"{}"));
        assert_ne!(base, Fingerprint::of_request("POST", "/p", b"{ }"));
        assert!(Fingerprint::from_slice(&[0; 31]).is_err());
        assert_eq!(Fingerprint::from_slice(base.as_bytes()).unwrap(), base);
    }

    #[test]
    fn stored_response_round_trips_any_bytes() {
        let response = StoredResponse::new(
            StatusCode::CREATED,
            vec![
                (
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (
                    http::header::LOCATION,
                    HeaderValue::from_bytes(b"/p/\xff1").unwrap(),
                ),
            ],
            Bytes::from_static(b"\x00\x01{\"id\":1}\xff"),
        );
        assert_eq!(
            StoredResponse::decode(&response.encode()).unwrap(),
            response
        );
        let headers = StoredResponse::decode_headers(&response.encode_headers()).unwrap();
        assert_eq!(headers, response.headers());
        assert!(StoredResponse::decode(&response.encode()[..5]).is_err());
        assert!(StoredResponse::decode_headers(&[0, 1, 0]).is_err());
    }
}
