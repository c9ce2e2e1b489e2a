//! Exports `gpufrac_daemon_marker` (defined by `gpufrac_common::daemon_marker!` in each
//! binary) in the binaries' dynamic symbol tables, so that a shim preloaded into
//! `gpufrac-arbiter` or `gpufrac` finds it and passes every call through; and compiles the
//! kubelet's PodResources API (`podresources/v1`) with protox (pure Rust: no protoc
//! needed) into a tonic client and server (the server for the tests' kubelet stand-in).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=proto/podresources/v1/api.proto");
    println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=gpufrac_daemon_marker");
    let descriptors = protox::compile(["podresources/v1/api.proto"], ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
