//! Whether a publish's properties fit in one frame: the content header
//! (properties and headers) cannot be split, and a broker that receives one
//! larger than the connection's `frame_max` closes the whole connection
//! (`FRAME_ERROR`), so a publisher checks before sending.

use lapin::BasicProperties;
use lapin::protocol::basic::gen_properties;

/// The content header frame's bytes besides the properties: type, channel
/// and size (7), class, weight and body size (12), the end marker (1).
const HEADER_FRAME_OVERHEAD: usize = 20;

/// The size of the content header frame that carries `properties`, as the
/// client encodes it.
pub(crate) fn header_frame_size(properties: &BasicProperties) -> usize {
    match gen_properties::<Vec<u8>>(properties)(Vec::new().into()) {
        Ok(written) => HEADER_FRAME_OVERHEAD + written.write.len(),
        // Not encodable at all (a table over 4 GiB): as good as too large.
        Err(_) => usize::MAX,
    }
}

/// `Err(size)` when the header frame of `properties` does not fit in a
/// frame of `frame_max` bytes (the connection's negotiated maximum).
pub(crate) fn check_header_frame(
    properties: &BasicProperties,
    frame_max: u32,
) -> Result<(), usize> {
    let size = header_frame_size(properties);
    if size > frame_max as usize {
        Err(size)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{AMQPValue, FieldTable};

    #[test]
    fn the_header_frame_size_counts_every_property() {
        let bare = BasicProperties::default();
        // Only the 2-byte property flags.
        assert_eq!(header_frame_size(&bare), HEADER_FRAME_OVERHEAD + 2);
        let mut headers = FieldTable::default();
        headers.insert("k".into(), AMQPValue::LongString("x".repeat(1000).into()));
        let with = bare.with_message_id("id-1".into()).with_headers(headers);
        // flags, message id (1 + 4), table (4 + name 1 + 1 + type 1 + len 4 + 1000).
        assert_eq!(
            header_frame_size(&with),
            HEADER_FRAME_OVERHEAD + 2 + 5 + 4 + 2 + 1 + 4 + 1000
        );
        assert!(check_header_frame(&with, 131_072).is_ok());
        assert_eq!(
            check_header_frame(&with, 1_000),
            Err(header_frame_size(&with))
        );
    }
}
