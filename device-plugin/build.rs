//! Compiles the kubelet's device plugin API with protox (pure Rust: no protoc needed)
//! and generates the tonic client and server; exports `gpufrac_daemon_marker` (defined by
//! `gpufrac_common::daemon_marker!` in `src/main.rs`) in the binary's dynamic symbol
//! table, so that a shim preloaded into the plugin passes every call through.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/api.proto");
    println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=gpufrac_daemon_marker");
    let descriptors = protox::compile(["proto/api.proto"], ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
