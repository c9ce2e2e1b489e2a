//! `libgpufrac.so`, the shim preloaded into every process of a container.
//!
//! This crate is at its foundation stage: it builds the library and exports the version
//! query of `include/gpufrac.h`. Interception and enforcement arrive with the shim issue.
#![deny(missing_docs)]

/// The shim's version as `major * 10000 + minor * 100 + patch`, for programs that ask.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_version() -> u32 {
    let part = |s: &str| s.parse::<u32>().unwrap_or(0);
    part(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + part(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + part(env!("CARGO_PKG_VERSION_PATCH"))
}
