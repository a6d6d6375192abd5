//! Certificate and key files (PEM), read and checked before a TLS client sees
//! them: the clients report a bad file late and vaguely (an unusable CA file
//! shows as `UnknownIssuer` at the handshake, an encrypted key as `no keys
//! found`, a missing file without its path), so idempo names the file and
//! what is wrong with it up front.
//!
//! The broker's files (`AMQP_CA_FILE`, `AMQP_CLIENT_CERT_FILE`,
//! `AMQP_CLIENT_KEY_FILE`) are checked when the connection is built; a
//! PostgreSQL URL's (`sslrootcert`, `sslcert`, `sslkey`) and `SSL_CERT_FILE`
//! with [`check_database_url`], before the pool connects. Each failure is a
//! [`CertificateError`] naming the file:
//!
//! ```
//! let error = idempo::certificate::check_database_url(
//!     "postgres://app@db/app?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
//! )
//! .unwrap_err();
//! assert!(error.to_string().contains("/nonexistent/ca.pem"), "{error}");
//! ```

use std::io;
use std::path::{Path, PathBuf};

use rustls_pki_types::pem::{self, PemObject, SectionKind};

/// What is wrong with a certificate or key file; each names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertificateError {
    /// The file does not exist.
    #[error("certificate file not found: {}", path.display())]
    NotFound {
        /// The file.
        path: PathBuf,
    },
    /// The file exists but cannot be read (permissions, a directory, ...).
    #[error("cannot read certificate file {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The file is empty.
    #[error("certificate file {} is empty", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The file is not valid PEM (a broken section, bad base64).
    #[error("certificate file {} is not valid PEM: {source}", path.display())]
    InvalidPem {
        /// The file.
        path: PathBuf,
        /// What the PEM parser found.
        #[source]
        source: pem::Error,
    },
    /// A certificate was expected, and the file holds none (nor a key).
    #[error("no certificate in PEM file {}", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A certificate was expected, and the file holds a private key.
    #[error("{} holds a private key, not a certificate", path.display())]
    KeyNotCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A private key was expected, and the file holds none (nor a certificate).
    #[error("no private key in PEM file {}", path.display())]
    NoKey {
        /// The file.
        path: PathBuf,
    },
    /// A private key was expected, and the file holds a certificate.
    #[error("{} holds a certificate, not a private key", path.display())]
    CertificateNotKey {
        /// The file.
        path: PathBuf,
    },
    /// The key is encrypted with a passphrase, which the TLS clients cannot
    /// use.
    #[error(
        "{} holds an encrypted private key: decrypt it first \
         (openssl pkcs8 -in <key> -out <decrypted key>)",
        path.display()
    )]
    EncryptedKey {
        /// The file.
        path: PathBuf,
    },
}

impl CertificateError {
    /// The file this error is about.
    pub fn path(&self) -> &Path {
        match self {
            CertificateError::NotFound { path }
            | CertificateError::Unreadable { path, .. }
            | CertificateError::Empty { path }
            | CertificateError::InvalidPem { path, .. }
            | CertificateError::NoCertificate { path }
            | CertificateError::KeyNotCertificate { path }
            | CertificateError::NoKey { path }
            | CertificateError::CertificateNotKey { path }
            | CertificateError::EncryptedKey { path } => path,
        }
    }
}

/// What a PEM file holds, by section.
struct Sections {
    certificates: usize,
    keys: usize,
    /// Labels the PEM parser skips; an encrypted key is one of them.
    encrypted_key: bool,
}

fn read(path: &Path) -> Result<Vec<u8>, CertificateError> {
    let bytes = std::fs::read(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => CertificateError::NotFound {
            path: path.to_owned(),
        },
        _ => CertificateError::Unreadable {
            path: path.to_owned(),
            source,
        },
    })?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(CertificateError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

fn sections(path: &Path, bytes: &[u8]) -> Result<Sections, CertificateError> {
    let mut found = Sections {
        certificates: 0,
        keys: 0,
        // The parser skips labels it does not know, this one included.
        encrypted_key: bytes
            .split(|b| *b == b'\n')
            .any(|line| line.trim_ascii() == b"-----BEGIN ENCRYPTED PRIVATE KEY-----"),
    };
    for section in <(SectionKind, Vec<u8>)>::pem_slice_iter(bytes) {
        let (kind, _) = section.map_err(|source| CertificateError::InvalidPem {
            path: path.to_owned(),
            source,
        })?;
        match kind {
            SectionKind::Certificate => found.certificates += 1,
            SectionKind::PrivateKey | SectionKind::RsaPrivateKey | SectionKind::EcPrivateKey => {
                found.keys += 1
            }
            _ => {}
        }
    }
    Ok(found)
}

/// Reads a PEM file of CA certificates to trust, and checks that it holds at
/// least one certificate.
///
/// # Errors
/// A [`CertificateError`] naming the file: not found, unreadable, empty, not
/// PEM, a private key instead of a certificate, no certificate.
pub(crate) fn read_ca_file(path: impl AsRef<Path>) -> Result<Vec<u8>, CertificateError> {
    read_certificate_file(path)
}

/// Reads a PEM file of certificates (a client certificate and its chain),
/// and checks that it holds at least one.
///
/// # Errors
/// As [`read_ca_file`].
pub(crate) fn read_certificate_file(path: impl AsRef<Path>) -> Result<Vec<u8>, CertificateError> {
    let path = path.as_ref();
    let bytes = read(path)?;
    let found = sections(path, &bytes)?;
    if found.certificates > 0 {
        return Ok(bytes);
    }
    let path = path.to_owned();
    Err(if found.keys > 0 || found.encrypted_key {
        CertificateError::KeyNotCertificate { path }
    } else {
        CertificateError::NoCertificate { path }
    })
}

/// Reads a PEM file holding a private key (PKCS#8, PKCS#1 RSA or SEC1 EC),
/// and checks that the key is there and not encrypted.
///
/// # Errors
/// A [`CertificateError`] naming the file: not found, unreadable, empty, not
/// PEM, an encrypted key, a certificate instead of a key, no key.
pub(crate) fn read_key_file(path: impl AsRef<Path>) -> Result<Vec<u8>, CertificateError> {
    let path = path.as_ref();
    let bytes = read(path)?;
    let found = sections(path, &bytes)?;
    if found.keys > 0 {
        return Ok(bytes);
    }
    let path = path.to_owned();
    Err(if found.encrypted_key {
        CertificateError::EncryptedKey { path }
    } else if found.certificates > 0 {
        CertificateError::CertificateNotKey { path }
    } else {
        CertificateError::NoKey { path }
    })
}

/// Checks the certificate files a PostgreSQL URL names (`sslrootcert`,
/// `sslcert`, `sslkey` and their sqlx aliases; `PGSSLROOTCERT` when the URL
/// names no root certificate), before sqlx reads them. A URL that does not
/// parse is left to sqlx to report.
///
/// # Errors
/// A [`CertificateError`] naming the file, as when the broker's files are read.
pub fn check_database_url(url: &str) -> Result<(), CertificateError> {
    let mut root = std::env::var_os("PGSSLROOTCERT")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from);
    let (mut cert, mut key) = (None, None);
    if let Some((_, query)) = url.split_once('?') {
        for pair in query.split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = PathBuf::from(percent_decode(value));
            match name {
                "sslrootcert" | "ssl-root-cert" | "ssl-ca" => root = Some(value),
                "sslcert" | "ssl-cert" => cert = Some(value),
                "sslkey" | "ssl-key" => key = Some(value),
                _ => {}
            }
        }
    }
    // libpq's special value: the system's roots, no file.
    if let Some(root) = root.filter(|r| r.as_os_str() != "system") {
        read_ca_file(root)?;
    }
    if let Some(cert) = cert {
        read_certificate_file(cert)?;
    }
    if let Some(key) = key {
        read_key_file(key)?;
    }
    Ok(())
}

/// `%XX` escapes and `+` of a URL query value.
fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(high), Some(low)) => {
                    out.push((high * 16 + low) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, contents: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("idempo-certificate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    type Reader = fn(&Path) -> Result<Vec<u8>, CertificateError>;

    const CERT: &[u8] = b"-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n";
    const KEY: &[u8] = b"-----BEGIN PRIVATE KEY-----\nMAA=\n-----END PRIVATE KEY-----\n";
    const ENCRYPTED: &[u8] =
        b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMAA=\n-----END ENCRYPTED PRIVATE KEY-----\n";

    #[test]
    fn each_mistake_names_the_file_and_what_is_wrong() {
        let cases: [(&str, &[u8], Reader, &str); 8] = [
            ("empty.pem", b"\n", |p| read_ca_file(p), "is empty"),
            (
                "garbage.pem",
                b"garbage",
                |p| read_ca_file(p),
                "no certificate in PEM",
            ),
            (
                "key-as-ca.pem",
                KEY,
                |p| read_ca_file(p),
                "holds a private key, not a certificate",
            ),
            (
                "enc-as-ca.pem",
                ENCRYPTED,
                |p| read_ca_file(p),
                "holds a private key, not a certificate",
            ),
            (
                "encrypted.key",
                ENCRYPTED,
                |p| read_key_file(p),
                "encrypted private key: decrypt it first",
            ),
            (
                "cert-as-key.pem",
                CERT,
                |p| read_key_file(p),
                "holds a certificate, not a private key",
            ),
            (
                "nothing.key",
                b"garbage",
                |p| read_key_file(p),
                "no private key in PEM",
            ),
            (
                "broken.pem",
                b"-----BEGIN CERTIFICATE-----\nMAA=\n",
                |p| read_ca_file(p),
                "is not valid PEM",
            ),
        ];
        for (name, contents, read, expected) in cases {
            let path = file(name, contents);
            let error = read(&path).unwrap_err();
            let text = error.to_string();
            assert!(text.contains(expected), "{name}: {text}");
            assert!(text.contains(&*path.to_string_lossy()), "{name}: {text}");
            assert_eq!(error.path(), path);
        }
        assert!(read_ca_file(file("ok.pem", CERT)).is_ok());
        assert!(read_key_file(file("ok.key", KEY)).is_ok());
        let missing = read_ca_file("/nonexistent/idempo/ca.pem").unwrap_err();
        assert_eq!(
            missing.to_string(),
            "certificate file not found: /nonexistent/idempo/ca.pem"
        );
    }

    #[test]
    fn a_database_url_is_checked_for_its_files() {
        let key = file("db.key", KEY);
        let url = format!(
            "postgres://u@h/db?sslmode=verify-ca&sslrootcert={}",
            key.display()
        );
        let error = check_database_url(&url).unwrap_err();
        assert!(
            matches!(error, CertificateError::KeyNotCertificate { .. }),
            "{error}"
        );
        let ok = format!(
            "postgres://u@h/db?sslrootcert={}&sslkey={}",
            file("db-ca.pem", CERT).display(),
            key.display()
        );
        check_database_url(&ok).unwrap();
        check_database_url("postgres://u@h/db?sslrootcert=system").unwrap();
        let missing = check_database_url("postgres://u@h/db?sslrootcert=%2Fno%2Fsuch.pem");
        assert!(
            matches!(&missing, Err(CertificateError::NotFound { path }) if path == Path::new("/no/such.pem")),
            "{missing:?}"
        );
    }
}
