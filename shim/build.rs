//! Links libgpufrac_core.so with `-Bsymbolic`: the core defines the hooked names too
//! (`cuInit`, ...), and its references to them (the table it hands to libgpufrac.so, its
//! own calls) must stay inside it. Without it the loader binds them to the first
//! definition in the program's scope, libgpufrac.so's entry points, which call the core:
//! an endless loop.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    println!("cargo:rerun-if-changed=build.rs");
}
