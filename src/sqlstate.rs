//! PostgreSQL's SQLSTATE codes, read in one place: every classification of a
//! database error (an outage, a lock that is busy, a bad
//! statement) is decided here, by code, never by matching message texts.

use std::borrow::Cow;

/// `division_by_zero`: how the commit check says its claim is gone.
pub(crate) const DIVISION_BY_ZERO: &str = "22012";
/// `read_only_sql_transaction`: a standby, or a database set read-only.
pub(crate) const READ_ONLY: &str = "25006";
/// `in_failed_sql_transaction`.
pub(crate) const IN_FAILED_TRANSACTION: &str = "25P02";
/// `too_many_connections`.
pub(crate) const TOO_MANY_CONNECTIONS: &str = "53300";
/// idempo's own: the partitioned claim refused below READ COMMITTED.
pub(crate) const ISOLATION_REFUSED: &str = "IDP01";

/// The SQLSTATE of a database error, if the server sent one.
pub(crate) fn of(error: &sqlx::Error) -> Option<Cow<'_, str>> {
    error.as_database_error()?.code()
}

/// Whether `error` is the database error `code`.
pub(crate) fn is(error: &sqlx::Error, code: &str) -> bool {
    of(error).is_some_and(|c| c == code)
}

/// Whether the statement itself is wrong for its data (classes 22 data
/// exception, 23 integrity constraint violation, 42 syntax or access rule):
/// running it again can never succeed.
pub(crate) fn is_permanent(error: &sqlx::Error) -> bool {
    of(error).is_some_and(|code| matches!(code.get(..2), Some("22" | "23" | "42")))
}

/// [`Error::is_connection_error`] for a bare sqlx error.
pub(crate) fn is_connection_error(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // sqlx reads the answer to its SSLRequest (sent first under the default
        // sslmode=prefer) without checking for end of file: a server or proxy
        // that closes the connection then shows as this protocol error.
        sqlx::Error::Protocol(message) => {
            message.starts_with("unexpected response from SSLRequest: 0x00")
        }
        sqlx::Error::Database(db) => {
            // FATAL (or PANIC) ends the session: every error that refuses or
            // drops a connection is one (28000 a role that may not log in,
            // 55000 a database not accepting connections, 3D000, 53300, 57P01
            // a terminated backend, ...), whatever its SQLSTATE.
            let fatal = db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some_and(|pg| {
                    matches!(
                        pg.severity(),
                        sqlx::postgres::PgSeverity::Fatal | sqlx::postgres::PgSeverity::Panic
                    )
                });
            // Class 08: connection exception (but 08P01, protocol violation, is
            // also what a wrong number of bind parameters gets: a bug, not an
            // outage); 57P01-57P03: admin shutdown, crash shutdown, cannot
            // connect now; 53300: too many clients.
            fatal
                || db.code().is_some_and(|code| {
                    (code.starts_with("08") && code != "08P01")
                        || matches!(&*code, "57P01" | "57P02" | "57P03" | "53300")
                })
        }
        _ => false,
    }
}

/// [`Error::is_unavailable`](crate::Error::is_unavailable) for a bare sqlx error: a
/// database that cannot take writes now (unreachable, read-only, out of
/// resources, shutting down).
pub(crate) fn is_unavailable(error: &sqlx::Error) -> bool {
    if is_connection_error(error) {
        return true;
    }
    let sqlx::Error::Database(db) = error else {
        return false;
    };
    db.code().is_some_and(|code| {
        code == READ_ONLY
            || code.starts_with("53")
            || code.starts_with("58")
            || matches!(&*code, "57P01" | "57P02" | "57P03" | "57P04" | "57P05")
    })
}
