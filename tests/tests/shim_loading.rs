//! The shim is two libraries: `libgpufrac.so`, the small one `LD_PRELOAD` names, and
//! `libgpufrac_core.so` beside it, loaded at the first CUDA or NVML call. Real processes:
//! one that never calls CUDA never maps the core; one that does gets it whichever way it
//! reaches the driver; without the core (or with a foreign file in its place) every CUDA
//! call fails after one line saying why, and nothing reaches the GPU; `dlsym(RTLD_NEXT)`
//! still answers for the caller's library, so wrappers preloaded beside the shim work.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use gpufrac_e2e::{artifact, compile_c, SimGpu};

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A fresh folder under the temp dir, removed when dropped.
struct Folder(PathBuf);

impl Folder {
    fn new(name: &str) -> Folder {
        let path = std::env::temp_dir().join(format!("gpufrac-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("make a temp folder");
        Folder(path)
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `alloc_paths` (dlopen + dlsym) under the shim `shim`, asking for 32 MiB.
fn cuda_program(gpu: &SimGpu, shim: &Path) -> Command {
    let mut cmd = gpu.command(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.env("LD_PRELOAD", shim)
        .env("GPUFRAC_MEMORY_REQUEST", "256MiB")
        .env("GPUFRAC_MEMORY_LIMIT", gpu.plus_real_context("640MiB"))
        .args(["alloc", &(32u64 << 20).to_string(), &(32u64 << 20).to_string()])
        .stdin(Stdio::null());
    cmd
}

#[test]
fn a_process_that_never_calls_cuda_never_maps_the_core() {
    let gpu = SimGpu::new("2GiB");
    let shim = artifact("libgpufrac.so");
    let out =
        gpu.command("/bin/cat").arg("/proc/self/maps").env("LD_PRELOAD", &shim).output().expect("run cat");
    let maps = text(&out);
    assert!(out.status.success(), "{maps}");
    assert!(maps.contains("/libgpufrac.so"), "the shim is preloaded: {maps}");
    assert!(
        !maps.contains("libgpufrac_core.so"),
        "the core is mapped by a process that never called CUDA: {maps}"
    );

    // A program that dlopens the driver gets the core at its first lookup of a hooked
    // name (Python's own dlsym calls for its modules do not load it).
    let script = "import ctypes\n\
                  core = lambda: 'libgpufrac_core.so' in open('/proc/self/maps').read()\n\
                  before = core()\n\
                  cuda = ctypes.CDLL('libcuda.so.1')\n\
                  print('BEFORE', before, 'INIT', cuda.cuInit(0), 'AFTER', core())";
    let out = gpu
        .command("python3")
        .args(["-c", script])
        .env("LD_PRELOAD", &shim)
        .env("GPUFRAC_MEMORY_REQUEST", "256MiB")
        .output()
        .expect("run python3");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "BEFORE False INIT 0 AFTER True",
        "{}",
        text(&out)
    );

    // And a program linked with -lcuda gets it at its first call: it sees its 256 MiB
    // limit as the device (2 GiB bare) and fills no more than that. (On a real GPU the
    // limit also has room for a real context.)
    let request = gpu.plus_real_context("256MiB");
    let slice = gpufrac_common::size::parse_bytes("the request", &request).expect("a size");
    let mut linked = gpu.command(compile_c("alloc_paths.c", &["MODE_LINKED"], true));
    linked
        .env("LD_PRELOAD", &shim)
        .env("GPUFRAC_MEMORY_REQUEST", &request)
        .args(["alloc", &(32u64 << 20).to_string()])
        .stdin(Stdio::null());
    let out = linked.output().expect("run alloc_paths");
    let all = text(&out);
    let ready: Vec<u64> = all
        .lines()
        .find_map(|l| l.strip_prefix("READY "))
        .map(|l| l.split(' ').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default();
    assert!(out.status.success() && all.contains("DONE"), "{all}");
    assert!(
        ready.len() == 3 && ready[2] == slice && ready[0] <= slice,
        "a linked program is held to its slice by the core: {all}"
    );
}

#[test]
fn without_its_core_the_shim_fails_every_cuda_call_and_says_why_once() {
    let gpu = SimGpu::new("2GiB");
    let folder = Folder::new("lone-shim");
    let lone = folder.0.join("libgpufrac.so");
    std::fs::copy(artifact("libgpufrac.so"), &lone).expect("copy the shim alone");

    let out = cuda_program(&gpu, &lone).output().expect("run alloc_paths");
    let all = text(&out);
    assert!(!out.status.success() && !all.contains("DONE"), "a CUDA program ran without the core: {all}");
    let ours: Vec<&str> = all.lines().filter(|l| l.starts_with("gpufrac:")).collect();
    assert_eq!(ours.len(), 1, "one line from the shim: {all}");
    assert!(
        ours[0].contains("cannot load libgpufrac_core.so")
            && ours[0].contains(&folder.0.join("libgpufrac_core.so").display().to_string())
            && ours[0].contains("CUDA and NVML calls fail"),
        "names the missing file and the consequence: {}",
        ours[0]
    );

    // Linked the other way (dlsym on RTLD_DEFAULT for gpufrac.h), the same: no context.
    let out =
        gpu.command(compile_c("query.c", &[], false)).env("LD_PRELOAD", &lone).output().expect("run query");
    let all = text(&out);
    assert!(!out.status.success() && all.contains("CUDA setup failed"), "{all}");

    // A file in the core's place that is not the core is refused the same way.
    std::fs::copy(artifact("libsimgpu_nvml.so"), folder.0.join("libgpufrac_core.so"))
        .expect("copy a foreign library");
    let out = cuda_program(&gpu, &lone).output().expect("run alloc_paths");
    let all = text(&out);
    assert!(!out.status.success() && !all.contains("DONE"), "a CUDA program ran with a foreign core: {all}");
    assert!(all.contains("gpufrac: libgpufrac_core.so was not built with this libgpufrac.so"), "{all}");
}

/// Builds `tests/c/<source>` as a shared library in `folder`.
fn wrapper_library(folder: &Folder, source: &str) -> PathBuf {
    let library = folder.0.join(format!("lib{}.so", source.trim_end_matches(".c")));
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&library)
        .arg(gpufrac_e2e::c_source_dir().join(source))
        .args(["-ldl", "-lpthread"])
        .status()
        .expect("run cc");
    assert!(status.success(), "cc failed on {source}");
    library
}

#[test]
fn a_wrapper_preloaded_beside_the_shim_finds_the_next_function_with_rtld_next() {
    let folder = Folder::new("next-wrapper");
    let wrapper = wrapper_library(&folder, "next_wrapper.c");
    let both = format!("{}:{}", artifact("libgpufrac.so").display(), wrapper.display());
    let out = Command::new("/bin/true").env("LD_PRELOAD", &both).output().expect("run /bin/true");
    assert!(text(&out).contains("NEXT libc"), "dlsym(RTLD_NEXT) from the wrapper: {}", text(&out));
    // The same answer as without the shim.
    let alone = Command::new("/bin/true").env("LD_PRELOAD", &wrapper).output().expect("run /bin/true");
    assert!(text(&alone).contains("NEXT libc"), "{}", text(&alone));
}

#[test]
fn a_shim_preloaded_through_a_symbolic_link_finds_its_core() {
    let gpu = SimGpu::new("2GiB");
    let folder = Folder::new("linked-shim");
    let link = folder.0.join("libgpufrac.so");
    std::os::unix::fs::symlink(artifact("libgpufrac.so"), &link).expect("link the shim");
    let out = cuda_program(&gpu, &link).output().expect("run alloc_paths");
    assert!(out.status.success() && text(&out).contains("DONE"), "{}", text(&out));
}

#[test]
fn a_child_forked_while_another_thread_loads_the_core_loads_it_itself() {
    let gpu = SimGpu::new("2GiB");
    let folder = Folder::new("fork-during-load");
    let forker = wrapper_library(&folder, "fork_during_load.c");
    let preload = format!("{}:{}", artifact("libgpufrac.so").display(), forker.display());
    let out = cuda_program(&gpu, Path::new(&preload)).output().expect("run alloc_paths");
    let all = text(&out);
    assert!(all.contains("CHILD ok"), "the child's cuInit: {all}");
    assert!(out.status.success() && all.contains("DONE"), "the parent goes on: {all}");
}
