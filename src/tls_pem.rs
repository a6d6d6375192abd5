//! The PEM a TLS client trusts and presents (feature `tls`): a
//! [`ClientTls`]'s certificates and key, files read and checked, for the
//! clients that take them (RabbitMQ's `amqps://`, Redis's `rediss://`).

use crate::Result;
use crate::certificate::{read_ca_file, read_certificate_file, read_key_file};
use crate::client_tls::{ClientTls, Pem};

/// The PEM of [`ClientTls`], files read and checked.
pub(crate) struct Loaded {
    pub(crate) ca_pem: Option<Vec<u8>>,
    /// The client certificate and its key.
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl ClientTls {
    /// The PEM, files read and checked.
    pub(crate) fn load(&self) -> Result<Loaded> {
        let ca_pem = match &self.ca {
            None => None,
            Some(Pem::Bytes(pem)) => Some(pem.clone()),
            Some(Pem::File(path)) => Some(read_ca_file(path)?),
        };
        let identity = match &self.identity {
            None => None,
            Some((certificate, key)) => Some((
                match certificate {
                    Pem::Bytes(pem) => pem.clone(),
                    Pem::File(path) => read_certificate_file(path)?,
                },
                match key {
                    Pem::Bytes(pem) => pem.clone(),
                    Pem::File(path) => read_key_file(path)?,
                },
            )),
        };
        Ok(Loaded { ca_pem, identity })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_is_named_when_loaded() {
        let tls = ClientTls::new().ca_file("/nonexistent/idempo/ca.pem");
        let error = tls.load().err().expect("a missing file fails");
        assert!(
            error.to_string().contains("/nonexistent/idempo/ca.pem"),
            "{error}"
        );
    }
}
