//! Exports `gpufrac_daemon_marker` (defined by `gpufrac_common::daemon_marker!` in each
//! binary) in the binaries' dynamic symbol tables, so that a shim preloaded into
//! `gpufrac-arbiter` or `gpufrac` finds it and passes every call through.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=gpufrac_daemon_marker");
}
