//! One name for a condition the features cannot state alone:
//! `cfg(idempo_runtime)`, the consumer runtime is compiled. It takes feature
//! `runtime` (its dependencies) and a transport that runs it (`amqp`,
//! `nats`, which both turn `runtime` on): without a transport nothing
//! delivers a message, and every part of the runtime a transport calls would
//! be dead code. A new transport is added here, once.

fn main() {
    // Features are part of the build's fingerprint: nothing else to watch.
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(idempo_runtime)");
    let on = |feature: &str| std::env::var_os(format!("CARGO_FEATURE_{feature}")).is_some();
    if on("RUNTIME") && (on("AMQP") || on("NATS")) {
        println!("cargo::rustc-cfg=idempo_runtime");
    }
}
