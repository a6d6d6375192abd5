//! Lowercase hex, for digests in ids, keys and logs.

/// `bytes` as lowercase hex, two digits each.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_is_lowercase_and_padded() {
        assert_eq!(super::to_hex(&[0x0a, 0xff]), "0aff");
    }
}
