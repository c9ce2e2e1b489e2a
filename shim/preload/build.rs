//! Links libgpufrac.so, the library every process of a container loads (each line below
//! was measured with `startup_bench`; `libgpufrac_core.so` is linked as any Rust library):
//!
//! - with a version script so that `dlsym` is exported under both glibc symbol versions:
//!   programs built against glibc < 2.34 bind `dlsym@GLIBC_2.2.5` (or `@GLIBC_2.17` on
//!   aarch64), newer ones `dlsym@GLIBC_2.34`; a preloaded definition only interposes on
//!   the version a program asks for;
//! - with the unwinder linked in statically (`libgcc_eh.a`, hidden by the version
//!   script) instead of `libgcc_s.so.1`: loading that one more library was most of what
//!   the shim added to the start of every process (about 140 of 230 µs for `/bin/true`).
//!   rustc asks for `-lgcc_s`; a folder named first with `-L` that holds `libgcc_s.a`
//!   (a link to `libgcc_eh.a`) and no `libgcc_s.so` answers that with the static
//!   archive. Where the C compiler cannot name `libgcc_eh.a`, the library links
//!   `libgcc_s.so.1`;
//! - with `-Bsymbolic-functions`, so that the library's own references to the functions
//!   it exports (about a hundred entry points) are bound when it is linked, not looked up
//!   by name in every process at start;
//! - without RELRO (`-z norelro`): making the relocated data read-only after loading
//!   costs an `mprotect` that splits the mapping, about 30 µs of the start of every
//!   process in the container. RELRO would guard this library's GOT against a memory bug
//!   in the host program, but its table of the core's hooks is writable data in any case,
//!   so it would protect little here.

use std::path::Path;
use std::process::Command;

fn main() {
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let old = if arch == "aarch64" { "GLIBC_2.17" } else { "GLIBC_2.2.5" };
    let script = format!("{old} {{ global: dlsym; }};\nGLIBC_2.34 {{ global: dlsym; }} {old};\n");
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let path = Path::new(&out).join("dlsym-versions.map");
    std::fs::write(&path, script).expect("write the version script");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={}", path.display());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,norelro");

    let gnu_linux = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && std::env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu");
    if gnu_linux {
        if let Some(eh) = libgcc_eh() {
            let dir = Path::new(&out).join("static-unwind");
            let _ = std::fs::remove_dir_all(&dir);
            let linked = std::fs::create_dir_all(&dir)
                .and_then(|()| std::os::unix::fs::symlink(&eh, dir.join("libgcc_s.a")));
            if linked.is_ok() {
                // Every -L applies to every -l, wherever it stands; the ones given here
                // come before the compiler's own folders.
                println!("cargo:rustc-cdylib-link-arg=-L{}", dir.display());
            }
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CC");
}

/// Where the C compiler keeps `libgcc_eh.a`, if it has one.
fn libgcc_eh() -> Option<std::path::PathBuf> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let out = Command::new(cc).arg("-print-file-name=libgcc_eh.a").output().ok()?;
    let path = std::path::PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    // An unknown file is printed back as its bare name.
    (out.status.success() && path.is_absolute() && path.is_file()).then_some(path)
}
