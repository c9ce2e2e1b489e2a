//! Compiles the kubelet's gRPC APIs with protox (pure Rust: no protoc needed) and generates
//! the tonic clients and servers: the device plugin API, the DRA kubelet plugin API (`v1`
//! and `v1beta1`) and plugin registration (`v1`). Also exports `gpufrac_daemon_marker`
//! (defined by `gpufrac_common::daemon_marker!` in `src/main.rs`) in the binary's dynamic
//! symbol table, so that a shim preloaded into the plugin passes every call through.

const PROTOS: [&str; 4] = [
    "proto/api.proto",
    "proto/dra/v1/api.proto",
    "proto/dra/v1beta1/api.proto",
    "proto/pluginregistration/v1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=gpufrac_daemon_marker");
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
