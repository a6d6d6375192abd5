//! Test your handlers without a broker (feature `testing`).
#![doc = include_str!("recipes.md")]

#[cfg(any(feature = "http", feature = "window"))]
pub mod conformance;
