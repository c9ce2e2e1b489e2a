//! The daemons never carry the shim: no daemon executable defines the shim's interposed
//! `cu*`, `nvml*` or `dlsym` symbols (only `libgpufrac.so` does), each exports the marker
//! that tells a preloaded shim to stand aside, and an arbiter started with the shim
//! preloaded and a request and limit in its environment still manages the whole GPU.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

use gpufrac_e2e::{artifact, status, Arbiter, SimGpu};

/// The daemon executables: none may contain the shim.
const DAEMONS: [&str; 3] = ["gpufrac-arbiter", "gpufrac", "gpufrac-device-plugin"];

/// The symbols `binary` defines in its dynamic symbol table, without version suffixes
/// (`dlsym@GLIBC_2.34` reads `dlsym`), as `nm -D --defined-only` lists them.
fn dynamic_symbols(binary: &Path) -> Vec<String> {
    let output =
        Command::new("nm").arg("-D").arg("--defined-only").arg(binary).output().unwrap_or_else(|e| {
            panic!("cannot run nm ({e}): install binutils (apt-get install binutils), which this test needs")
        });
    assert!(
        output.status.success(),
        "nm -D --defined-only {} failed: {}",
        binary.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().last())
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .collect()
}

/// The symbols of the shim's interposition list: driver, NVML and `dlsym`.
fn interposed(symbols: &[String]) -> Vec<&str> {
    symbols
        .iter()
        .map(String::as_str)
        .filter(|s| s.starts_with("cu") || s.starts_with("nvml") || *s == "dlsym")
        .collect()
}

#[test]
fn no_daemon_executable_defines_the_shims_symbols() {
    // The check itself works: the shim defines them.
    let shim = dynamic_symbols(&artifact("libgpufrac.so"));
    assert!(
        interposed(&shim).len() > 50 && shim.iter().any(|s| s == "dlsym"),
        "nm does not show the shim's own exports: {shim:?}"
    );
    for daemon in DAEMONS {
        let symbols = dynamic_symbols(&artifact(daemon));
        let found = interposed(&symbols);
        assert!(found.is_empty(), "{daemon} defines {} of the shim's symbols: {found:?}", found.len());
        assert!(
            symbols.iter().any(|s| s == "gpufrac_daemon_marker"),
            "{daemon} does not export gpufrac_daemon_marker (gpufrac_common::daemon_marker! and its \
             build.rs): {symbols:?}"
        );
    }
}

/// The arbiter's process, found by its socket on its command line.
fn arbiter_pid(arbiter: &Arbiter) -> Option<u32> {
    let socket = arbiter.socket().as_os_str().as_encoded_bytes();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        let ours = args.first().is_some_and(|a| a.ends_with(b"gpufrac-arbiter")) && args.contains(&socket);
        ours.then_some(pid)
    })
}

#[test]
fn an_arbiter_with_the_shim_preloaded_and_a_limit_set_manages_the_whole_gpu() {
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let shim = artifact("libgpufrac.so");
    let arbiter = Arbiter::start_with_env(
        &gpu,
        gpu.lib_dir().join("arbiter.sock"),
        &[],
        &[
            ("LD_PRELOAD", shim.as_os_str()),
            ("GPUFRAC_MEMORY_REQUEST", OsStr::new("512MiB")),
            ("GPUFRAC_MEMORY_LIMIT", OsStr::new("1GiB")),
        ],
    );
    // The shim really is inside the arbiter, so the test does not pass vacuously.
    let pid = arbiter_pid(&arbiter).expect("the arbiter's process in /proc");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    assert!(maps.contains("libgpufrac.so"), "the shim is not loaded into the arbiter (pid {pid})");

    let s = status(&arbiter);
    assert_eq!(s.gpus.len(), gpu.device_count(), "{s:?}");
    assert_eq!(
        s.gpus[0].total,
        gpu.device_total(0),
        "the arbiter sees a slice, not the GPU: the preloaded shim enforced GPUFRAC_MEMORY_LIMIT in it\n{}",
        arbiter.log_text()
    );
}
