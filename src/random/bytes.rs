//! The one source: `N` bytes from the operating system's generator.

use crate::error::RandomnessUnavailable;

/// `N` bytes from the OS generator.
pub(crate) fn bytes<const N: usize>() -> Result<[u8; N], RandomnessUnavailable> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(RandomnessUnavailable)?;
    Ok(bytes)
}
