//! Links libgpufrac.so with a version script so that `dlsym` is exported under both glibc
//! symbol versions: programs built against glibc < 2.34 bind `dlsym@GLIBC_2.2.5` (or
//! `@GLIBC_2.17` on aarch64), newer ones `dlsym@GLIBC_2.34`; a preloaded definition only
//! interposes on the version a program asks for.

fn main() {
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let old = if arch == "aarch64" { "GLIBC_2.17" } else { "GLIBC_2.2.5" };
    let script = format!("{old} {{ global: dlsym; }};\nGLIBC_2.34 {{ global: dlsym; }} {old};\n");
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let path = std::path::Path::new(&out).join("dlsym-versions.map");
    std::fs::write(&path, script).expect("write the version script");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={}", path.display());
    println!("cargo:rerun-if-changed=build.rs");
}
