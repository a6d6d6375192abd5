//! Contract tests for your own stores.
