//! [`redact_url`]: the one way idempo (and its binaries) print a URL, with
//! its passwords hidden.

/// `url` as it may be printed: the password of its user info, and the value
/// of every parameter whose name contains `password` (PostgreSQL's
/// `?password=`, `?sslpassword=`, or `password=` in a libpq key/value string),
/// replaced by `***`; the rest as written (user, host, port, vhost or
/// database).
///
/// It reads the text rather than parsing a URL, because the passwords that
/// leak are the ones a parser gets wrong: one holding an unencoded `/`, `?`,
/// `#` or `@` (`postgres://app:se/cret@db/pay` parses as host `app`, port
/// `se`). The user info is everything between `://` and the **last** `@`, so
/// an address with an `@` in its query is hidden up to that `@`: more than
/// needed, never less.
///
/// One function for every URL idempo prints (broker addresses in `Debug`
/// output, logs and errors; the operations' connection errors); use it for
/// the URLs your own program prints.
///
/// ```
/// assert_eq!(
///     idempo::redact_url("postgres://app:S3cret@db:5432/pay?sslpassword=x"),
///     "postgres://app:***@db:5432/pay?sslpassword=***"
/// );
/// assert_eq!(
///     idempo::redact_url("postgres://app:se/cret@db/pay"),
///     "postgres://app:***@db/pay"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let (userinfo, address) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let mut shown = String::with_capacity(url.len());
    if let Some(scheme) = scheme {
        shown.push_str(scheme);
        shown.push_str("://");
    }
    if let Some(userinfo) = userinfo {
        match userinfo.split_once(':') {
            Some((user, _password)) => {
                shown.push_str(user);
                shown.push_str(":***");
            }
            None => shown.push_str(userinfo),
        }
        shown.push('@');
    }
    shown.push_str(&hide_password_parameters(address));
    shown
}

/// `name=value` pieces (separated by `&`, `?`, `;` or blanks) whose name
/// contains `password`, with the value hidden.
fn hide_password_parameters(text: &str) -> String {
    let mut shown = String::with_capacity(text.len());
    let mut piece_start = 0;
    let is_separator = |c: char| matches!(c, '&' | '?' | ';' | '#') || c.is_whitespace();
    for (i, c) in text.char_indices().chain([(text.len(), ' ')]) {
        if i < text.len() && !is_separator(c) {
            continue;
        }
        let piece = &text[piece_start..i];
        match piece.split_once('=') {
            Some((name, _)) if name.to_ascii_lowercase().contains("password") => {
                shown.push_str(name);
                shown.push_str("=***");
            }
            _ => shown.push_str(piece),
        }
        if i < text.len() {
            shown.push(c);
        }
        piece_start = i + c.len_utf8();
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_replaced_and_the_rest_is_kept() {
        assert_eq!(
            redact_url("amqp://guest:secret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://postgres@h/db"),
            "postgres://postgres@h/db"
        );
        assert_eq!(redact_url("amqps://rabbit:5671"), "amqps://rabbit:5671");
        let query = redact_url("postgres://u@h/db?sslmode=require&password=secret&SSLPassword=x");
        assert!(
            !query.contains("secret") && !query.contains("=x"),
            "{query}"
        );
        assert!(query.contains("sslmode=require"), "{query}");
        // Not a URL: nothing of it is shown, since a password could be anywhere.
        let shown = redact_url("guest:secret@host");
        assert!(!shown.contains("secret"), "{shown}");
        assert_eq!(
            redact_url("host=h password=secret port=1"),
            "host=h password=*** port=1"
        );
        assert_eq!(redact_url("postgres:///db"), "postgres:///db");
    }

    #[test]
    fn passwords_that_a_url_parser_misreads_are_hidden_too() {
        for (url, password) in [
            ("postgres://postgres:se/cret@127.0.0.1:5432/db", "se/cret"),
            ("postgres://u:123/456@host/db", "123/456"),
            ("amqp://u:pa?ss#w@rd@rabbit/%2f", "pa?ss#w@rd"),
            ("redis://:S3cretPW@127.0.0.1:6379", "S3cretPW"),
            ("postgres://u@h/db?password=QpW&sslmode=require", "QpW"),
        ] {
            let shown = redact_url(url);
            assert!(!shown.contains(password), "{url} -> {shown}");
            assert!(shown.contains("***"), "{url} -> {shown}");
        }
        assert_eq!(
            redact_url("postgres://postgres:se/cret@127.0.0.1:5432/db"),
            "postgres://postgres:***@127.0.0.1:5432/db"
        );
        assert_eq!(
            redact_url("redis://:S3cretPW@h:6379"),
            "redis://:***@h:6379"
        );
        // Written as the user wrote it: no normalisation.
        assert_eq!(redact_url("amqp://rabbit"), "amqp://rabbit");
    }
}
