//! [`redact_url`]: the one way idempo (and its binaries) print a URL, with
//! its passwords hidden.

/// `url` as it may be printed: the password of its user info, and the value
/// of every query parameter whose name contains `password` (PostgreSQL's
/// `?password=`, `?sslpassword=`), replaced by `***`; the rest as written
/// (user, host, port, vhost or database). A string that does not parse as a
/// URL is not shown at all: it could hold a password anywhere.
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
/// ```
pub fn redact_url(url: &str) -> String {
    const HIDDEN: &str = "***";
    // Without `//` after the scheme, `user:password@host` would parse as a
    // scheme and a path: refused too.
    let Some(mut parsed) = url::Url::parse(url).ok().filter(|u| !u.cannot_be_a_base()) else {
        return "<an address that does not parse>".into();
    };
    if parsed.password().is_some() {
        // Only a URL without a host cannot take a password, and it has none.
        let _ = parsed.set_password(Some(HIDDEN));
    }
    let secret = |name: &str| name.to_ascii_lowercase().contains("password");
    if parsed.query_pairs().any(|(name, _)| secret(&name)) {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(name, value)| {
                let value = if secret(&name) {
                    HIDDEN.into()
                } else {
                    value.into_owned()
                };
                (name.into_owned(), value)
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.into()
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
            redact_url("host=h password=secret"),
            "<an address that does not parse>"
        );
        assert_eq!(redact_url("postgres:///db"), "postgres:///db");
    }
}
