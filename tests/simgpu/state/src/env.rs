//! Running programs on the simulated GPU: a private folder of driver symlinks and a
//! private machine state, applied to a `Command`.
//!
//! The simulated libraries are never named `libcuda.so*` in the build folder, so a real
//! driver is never shadowed by accident; programs see them only through this folder on
//! their `LD_LIBRARY_PATH`.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The names programs load, and the simgpu library each one points to.
const LINKS: [(&str, &str); 4] = [
    ("libcuda.so", "libsimgpu_cuda.so"),
    ("libcuda.so.1", "libsimgpu_cuda.so"),
    ("libnvidia-ml.so", "libsimgpu_nvml.so"),
    ("libnvidia-ml.so.1", "libsimgpu_nvml.so"),
];

/// A simulated machine for a group of programs, removed when dropped.
#[derive(Debug)]
pub struct SimGpuDir {
    dir: PathBuf,
    devices: String,
    context_overhead: Option<String>,
    nvlink: Option<String>,
}

impl SimGpuDir {
    /// Makes a private folder under `parent` (e.g. the temp dir) whose symlinks point at
    /// the simgpu libraries in `lib_dir`, for devices `devices` (`SIMGPU_DEVICES` syntax).
    pub fn new(parent: &Path, lib_dir: &Path, devices: &str) -> io::Result<SimGpuDir> {
        for (_, target) in LINKS {
            let lib = lib_dir.join(target);
            if !lib.exists() {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!(
                        "{} not found: build the workspace first (cargo build --workspace)",
                        lib.display()
                    ),
                ));
            }
        }
        let dir = unique_dir(parent)?;
        for (link, target) in LINKS {
            std::os::unix::fs::symlink(lib_dir.join(target), dir.join(link))?;
        }
        Ok(SimGpuDir { dir, devices: devices.to_owned(), context_overhead: None, nvlink: None })
    }

    /// Sets `SIMGPU_CONTEXT_OVERHEAD` for the programs.
    pub fn with_context_overhead(mut self, size: &str) -> SimGpuDir {
        self.context_overhead = Some(size.to_owned());
        self
    }

    /// Sets `SIMGPU_NVLINK` for the programs: the NVLinked pairs (`0-1,2-3`).
    pub fn with_nvlink(mut self, pairs: &str) -> SimGpuDir {
        self.nvlink = Some(pairs.to_owned());
        self
    }

    /// The folder holding the driver symlinks (put on `LD_LIBRARY_PATH`, or `-L` to link).
    pub fn lib_dir(&self) -> &Path {
        &self.dir
    }

    /// The shared state file of this machine.
    pub fn state_path(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// Sets up `cmd` to run on this machine.
    pub fn apply(&self, cmd: &mut Command) {
        let mut path = OsString::from(self.dir.as_os_str());
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(old);
        }
        cmd.env("LD_LIBRARY_PATH", path)
            .env("SIMGPU_STATE", self.state_path())
            .env("SIMGPU_DEVICES", &self.devices);
        match &self.context_overhead {
            Some(size) => cmd.env("SIMGPU_CONTEXT_OVERHEAD", size),
            None => cmd.env_remove("SIMGPU_CONTEXT_OVERHEAD"),
        };
        // Removed otherwise, so that the machine is what the test made, not the caller's.
        match &self.nvlink {
            Some(pairs) => cmd.env("SIMGPU_NVLINK", pairs),
            None => cmd.env_remove("SIMGPU_NVLINK"),
        };
    }
}

impl Drop for SimGpuDir {
    fn drop(&mut self) {
        // Exported VMM memory is backed by named files beside the state (in /dev/shm):
        // what the machine's processes left behind when they ended goes with it.
        let state = self.state_path();
        let state = state.to_string_lossy();
        let first = crate::objects::object_path(&state, 0);
        if let Some(prefix) = first.strip_suffix('0') {
            let (dir, name) = prefix.rsplit_once('/').unwrap_or((".", prefix));
            if let Ok(entries) = std::fs::read_dir(dir) {
                for entry in entries.flatten() {
                    if entry.file_name().to_string_lossy().starts_with(name) {
                        let _ = std::fs::remove_file(entry.path());
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Creates a fresh private folder (mode 0700) under `parent`.
fn unique_dir(parent: &Path) -> io::Result<PathBuf> {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let mut template = parent.join("simgpu-XXXXXX").into_os_string().into_vec();
    if template.contains(&0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "folder name contains NUL"));
    }
    template.push(0);
    // SAFETY: `template` is a writable NUL-terminated buffer ending in "XXXXXX", as
    // mkdtemp requires; it rewrites only those six characters.
    if unsafe { libc::mkdtemp(template.as_mut_ptr().cast()) }.is_null() {
        return Err(io::Error::last_os_error());
    }
    template.pop();
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(&template)))
}
