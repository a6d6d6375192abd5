//! What an operator reads when a command or a dashboard page fails: the
//! error and its causes on one line, each said once, in the operator's
//! terms.

use std::error::Error;

use sqlx::postgres::PgDatabaseError;

/// An error and its causes on one line, each cause once: a library error
/// often shows its cause in its own message too (`database error: X`, then
/// `X` as its source), which `{:#}` would print twice.
pub(crate) fn error_line(error: &anyhow::Error) -> String {
    cause_line(error.as_ref())
}

/// [`error_line`] of any error. A PostgreSQL error is said without sqlx's
/// "at line N": a line of PostgreSQL's own source, not the operator's.
pub(crate) fn cause_line(error: &(dyn Error + 'static)) -> String {
    let mut chain: Vec<&(dyn Error + 'static)> = vec![error];
    while let Some(source) = chain[chain.len() - 1].source() {
        chain.push(source);
    }
    // Each database error's text as sqlx shows it, and its message alone:
    // replaced in every cause that quotes it.
    let messages: Vec<(String, String)> = chain
        .iter()
        .filter_map(|e| database_error(*e))
        .map(|db| (db.to_string(), db.message().to_owned()))
        .collect();
    let mut line = String::new();
    for cause in chain {
        let mut text = cause.to_string();
        for (shown, message) in &messages {
            text = text.replace(shown.as_str(), message);
        }
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// The PostgreSQL error `error` is or carries.
fn database_error<'a>(error: &'a (dyn Error + 'static)) -> Option<&'a PgDatabaseError> {
    match error.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(db)) => db.try_downcast_ref::<PgDatabaseError>(),
        _ => error.downcast_ref::<PgDatabaseError>(),
    }
}

/// `error`, or, when PostgreSQL did not answer within the pool's timeout
/// (sqlx then says only "pool timed out"), why: its address, the reason and
/// how to start it ([`idempo::probe::why_unreachable`]).
pub(crate) async fn with_cause(error: anyhow::Error, database_url: &str) -> anyhow::Error {
    let timed_out = error.chain().any(|e| {
        matches!(
            e.downcast_ref::<sqlx::Error>(),
            Some(sqlx::Error::PoolTimedOut)
        )
    });
    if !timed_out {
        return error;
    }
    match idempo::probe::why_unreachable(database_url).await {
        Some(why) => anyhow::Error::msg(why),
        None => error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_said_once() {
        let inner = std::io::Error::other("connection refused");
        let error = anyhow::Error::new(inner)
            .context("database error: connection refused")
            .context("cannot connect to PostgreSQL at postgres://db/app");
        assert_eq!(
            error_line(&error),
            "cannot connect to PostgreSQL at postgres://db/app: database error: connection refused"
        );
    }
}
