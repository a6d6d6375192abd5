//! Who may use the dashboard: the `--token` (a bearer header, or the session
//! cookie its login page sets), and the CSRF token every action carries.
//! Compared in constant time.

use axum::http::HeaderMap;
use axum::http::header::{AUTHORIZATION, COOKIE};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "idempo_session";

/// The dashboard's secrets: the operator's token, and a key of this process
/// from which the session cookie and the CSRF token are derived.
pub(crate) struct Auth {
    token: Option<String>,
    key: [u8; 32],
}

impl Auth {
    pub(crate) fn new(token: Option<String>) -> Self {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the operating system gives random bytes");
        Auth { token, key }
    }

    /// Whether a token is required.
    pub(crate) fn required(&self) -> bool {
        self.token.is_some()
    }

    fn derive(&self, purpose: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(purpose.as_bytes());
        if let Some(token) = &self.token {
            mac.update(token.as_bytes());
        }
        hex::encode(mac.finalize().into_bytes())
    }

    /// The session cookie's value: proves the token was given once.
    pub(crate) fn session(&self) -> String {
        self.derive("session")
    }

    /// The CSRF token the pages put in every form.
    pub(crate) fn csrf(&self) -> String {
        self.derive("csrf")
    }

    /// Whether `given` is the operator's token.
    pub(crate) fn is_token(&self, given: &str) -> bool {
        self.token
            .as_deref()
            .is_some_and(|token| bool::from(token.as_bytes().ct_eq(given.as_bytes())))
    }

    /// Whether `given` is the CSRF token.
    pub(crate) fn is_csrf(&self, given: &str) -> bool {
        bool::from(self.csrf().as_bytes().ct_eq(given.as_bytes()))
    }

    /// Whether a request may see the dashboard: no token required, or a
    /// bearer token, or the session cookie.
    pub(crate) fn allows(&self, headers: &HeaderMap) -> bool {
        if !self.required() {
            return true;
        }
        let bearer = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.is_some_and(|given| self.is_token(given.trim())) {
            return true;
        }
        let session = self.session();
        headers
            .get_all(COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().split_once('='))
            .any(|(name, value)| {
                name == SESSION_COOKIE && bool::from(session.as_bytes().ct_eq(value.as_bytes()))
            })
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn a_token_is_needed_when_one_is_set() {
        let open = Auth::new(None);
        assert!(open.allows(&HeaderMap::new()));
        let auth = Auth::new(Some("s3cret".into()));
        assert!(!auth.allows(&HeaderMap::new()));
        let mut bearer = HeaderMap::new();
        bearer.insert(AUTHORIZATION, HeaderValue::from_static("Bearer s3cret"));
        assert!(auth.allows(&bearer));
        let mut wrong = HeaderMap::new();
        wrong.insert(AUTHORIZATION, HeaderValue::from_static("Bearer s3cre"));
        assert!(!auth.allows(&wrong));
        let mut cookie = HeaderMap::new();
        let value = format!("a=b; {SESSION_COOKIE}={}", auth.session());
        cookie.insert(COOKIE, HeaderValue::from_str(&value).unwrap());
        assert!(auth.allows(&cookie));
        assert!(auth.is_csrf(&auth.csrf()));
        assert!(!auth.is_csrf("x"));
    }
}
