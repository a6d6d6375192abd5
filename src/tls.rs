//! TLS failures (feature `tls`): a handshake the other side refused, told
//! apart from an outage in the errors of the clients idempo connects with
//! (sqlx, lapin, redis), so that it is reported at once as
//! [`Error::Tls`](crate::Error::Tls) instead of waited out.

use std::error::Error as StdError;

/// The TLS failure behind a client's error, if it is one: a rustls error
/// anywhere in the chain of sources, or inside an I/O error of it (how
/// lapin, redis and sqlx carry them). Typed, so that a vhost or a queue
/// named `alerts` or `tls` is not taken for one.
pub(crate) fn tls_failure<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut current = Some(error);
    while let Some(e) = current {
        // redis keeps its I/O error as an `Arc<dyn Error>`, whose `source`
        // skips the error itself.
        let e = match e.downcast_ref::<std::sync::Arc<dyn StdError + Send + Sync>>() {
            Some(shared) => &**shared as &(dyn StdError + 'static),
            None => e,
        };
        if let Some(rustls) = e.downcast_ref::<rustls::Error>() {
            return Some(rustls);
        }
        // io::Error's `source` skips the error it carries, too.
        if let Some(rustls) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(rustls);
        }
        current = e.source();
    }
    None
}
