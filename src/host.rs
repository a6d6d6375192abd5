//! This machine's name: the one reading of it, for connection names,
//! heartbeats and the operator recorded on dead letters.

/// The host name the operating system reports (`gethostname(2)`), or
/// `"unknown-host"` when it is empty.
pub(crate) fn name() -> String {
    let name = gethostname::gethostname();
    let name = name.to_string_lossy();
    let name = name.trim();
    if name.is_empty() {
        "unknown-host".to_owned()
    } else {
        name.to_owned()
    }
}

/// The name a consumer's broker connection carries:
/// `idempo:<consumer>:<host>:<pid>`, so that an operator finds its process.
pub(crate) fn connection_name(consumer: &str) -> String {
    format!("idempo:{consumer}:{}:{}", name(), std::process::id())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_name_is_the_kernels() {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(super::name(), kernel.trim());
    }
}
