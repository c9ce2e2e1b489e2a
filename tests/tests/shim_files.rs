//! The shim's files in shared places cannot be turned against it: a group's ledger lives
//! in the user's own folder `/dev/shm/gpufrac-<euid>/`, and a symbolic link, a file or a
//! folder someone else made (or anyone may write) there is refused at `cuInit` with a
//! line naming it, never written through or adopted. And a context is charged before it
//! exists: one larger than the limit is refused. Real processes on simgpu.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use gpufrac_e2e::size::MIB;
use gpufrac_e2e::{
    compile_c, ledger_path, report_skip, skip_on_real_gpu, unique, ChildProcess, ShimSettings, SimGpu, Skip,
};

fn gpu() -> SimGpu {
    SimGpu::new("2GiB").with_context_overhead("64MiB")
}

/// `alloc_paths` under the shim in `group`: 256 MiB request, 640 MiB limit, holding
/// 32 MiB.
fn member(gpu: &SimGpu, group: &str) -> Command {
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.memory_request("256MiB").memory_limit(gpu.plus_real_context("640MiB")).group(group).args([
        "alloc",
        &(32 * MIB).to_string(),
        &(32 * MIB).to_string(),
    ]);
    cmd
}

fn output(cmd: &mut Command) -> (Output, String) {
    let out = cmd.output().expect("run");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out, text)
}

/// The member fails `cuInit` with one line from the shim naming `path` and `why`.
fn refused(cmd: &mut Command, path: &Path, why: &str) {
    let (out, text) = output(cmd);
    assert!(!out.status.success(), "{} was used: {text}", path.display());
    assert!(text.contains("CUDA_ERROR_NOT_INITIALIZED"), "{text}");
    let ours: Vec<&str> = text.lines().filter(|l| l.starts_with("gpufrac:")).collect();
    assert_eq!(ours.len(), 1, "one line from the shim: {text}");
    assert!(
        ours[0].contains(&format!("refusing {}", path.display())) && ours[0].contains(why),
        "{}",
        ours[0]
    );
}

/// The member runs, holds its memory and gives it back.
fn works(cmd: &mut Command) {
    cmd.stdin(std::process::Stdio::null());
    let (out, text) = output(cmd);
    assert!(out.status.success() && text.contains("DONE"), "{text}");
}

/// This user's ledger folder exists (as the shim makes it), for planting files in.
fn ledger_dir_of(group: &str) -> PathBuf {
    let dir = ledger_path(group).parent().expect("a folder").to_path_buf();
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap(),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => panic!("cannot create {}: {e}", dir.display()),
    }
    dir
}

/// A scratch folder removed at drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Scratch {
        let dir = std::env::temp_dir().join(unique(&format!("shim-files-{what}")));
        std::fs::create_dir(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_symbolic_link_at_the_ledger_path_is_never_written_through() {
    let gpu = gpu();
    let group = unique("planted-link");
    let path = ledger_path(&group);
    ledger_dir_of(&group);
    let scratch = Scratch::new("link");
    let target = scratch.0.join("precious");
    std::fs::write(&target, b"not a ledger").unwrap();
    std::os::unix::fs::symlink(&target, &path).unwrap();
    refused(&mut member(&gpu, &group), &path, "symbolic link");
    let kept = std::fs::read(&target).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(kept, b"not a ledger", "the link's target is untouched");
    // Without the link the group works, and leaves nothing behind.
    works(&mut member(&gpu, &group));
    assert!(!path.exists());
}

#[test]
fn a_ledger_anyone_may_write_or_someone_else_made_is_not_adopted() {
    let gpu = gpu();
    let group = unique("planted-file");
    let path = ledger_path(&group);
    ledger_dir_of(&group);
    std::fs::write(&path, [7u8; 64]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused(&mut member(&gpu, &group), &path, "mode is 0666");
    assert_eq!(std::fs::read(&path).unwrap(), [7u8; 64], "the file is untouched");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
        refused(&mut member(&gpu, &group), &path, "belongs to uid 65534");
        assert_eq!(std::fs::read(&path).unwrap(), [7u8; 64], "the file is untouched");
    }
    std::fs::remove_file(&path).unwrap();
    works(&mut member(&gpu, &group));
}

/// An unused user ID for this test process.
fn spare_uid() -> u32 {
    2_000_000_000 + std::process::id() % 100_000_000
}

#[test]
fn a_ledger_folder_that_is_a_link_open_to_all_or_someone_elses_is_refused() {
    // The folder is per user: play the victim as another user, so that this test's
    // planted folders disturb no other test. Only root can.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        report_skip(Skip::ThisMachine, "needs root to run a process as another user");
        return;
    }
    let uid = spare_uid();
    let gpu = gpu();
    std::os::unix::fs::chown(gpu.lib_dir(), Some(uid), Some(uid)).unwrap();
    let group = unique("planted-folder");
    let shm = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let dir = shm.join(format!("gpufrac-{uid}"));
    let victim = || {
        let mut cmd = member(&gpu, &group);
        cmd.uid(uid).gid(uid);
        cmd
    };
    let _ = std::fs::remove_file(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(dir.clone());

    // A link to a folder that would pass every check.
    let scratch = Scratch::new("folder");
    let real = scratch.0.join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&real, Some(uid), Some(uid)).unwrap();
    std::os::unix::fs::symlink(&real, &dir).unwrap();
    refused(&mut victim(), &dir, "symbolic link");
    assert_eq!(std::fs::read_dir(&real).unwrap().count(), 0, "nothing was made through the link");
    std::fs::remove_file(&dir).unwrap();

    // The user's folder, but anyone may write in it.
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&dir, Some(uid), Some(uid)).unwrap();
    refused(&mut victim(), &dir, "mode is 0777");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);

    // Someone else's folder.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    refused(&mut victim(), &dir, "belongs to uid 65534");
    std::fs::remove_dir(&dir).unwrap();

    // No folder: the shim makes it, the user's own and 0700, and the ledger goes at exit.
    works(&mut victim());
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert!(meta.is_dir() && meta.uid() == uid && meta.mode() & 0o7777 == 0o700, "{meta:?}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

/// Polls the simulated device's memory in use until stopped; returns the most seen.
fn watch_device(gpu: &SimGpu) -> (Arc<AtomicBool>, std::thread::JoinHandle<u64>) {
    let machine = gpu.device_state();
    let stop = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicU64::new(0));
    let (s, m) = (stop.clone(), most.clone());
    let watcher = std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            m.fetch_max(machine.used(0), Ordering::Relaxed);
        }
        m.load(Ordering::Relaxed)
    });
    (stop, watcher)
}

#[test]
fn a_context_larger_than_the_limit_is_refused_and_holds_nothing() {
    skip_on_real_gpu!("needs simgpu's 256 MiB contexts (SIMGPU_CONTEXT_OVERHEAD) and watches its device state (SIMGPU_STATE)");
    // Contexts of 256 MiB, a limit of 128 MiB.
    let gpu = SimGpu::new("2GiB").with_context_overhead("256MiB");
    let group = unique("big-context");
    let small = |group: &str, limit: &str| {
        let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_LINKED"], true));
        cmd.memory_request("64MiB").memory_limit(limit).group(group).args([
            "alloc",
            &(32 * MIB).to_string(),
            &(64 * MIB).to_string(),
        ]);
        cmd
    };
    // The first context anyone makes on the device: measured, destroyed, refused.
    let (out, text) = output(&mut small(&group, "128MiB"));
    assert_eq!(out.status.code(), Some(3), "the context is refused: {text}");
    assert!(text.contains("CTX_OOM"), "{text}");
    assert!(text.contains("GPUFRAC_MEMORY_LIMIT"), "the shim says why: {text}");

    // Once measured, a context that does not fit is refused before it exists: a member
    // holds its context and 64 MiB of a 384 MiB limit; a second one's context never
    // reaches the device.
    let (stop, watcher) = watch_device(&gpu);
    let mut holder = ChildProcess::spawn(&mut small(&group, "384MiB"));
    assert_eq!(holder.ready()[0], 64 * MIB);
    let (out, text) = output(&mut small(&group, "384MiB"));
    assert_eq!(out.status.code(), Some(3), "the context is refused: {text}");
    holder.close_stdin();
    holder.finish();
    stop.store(true, Ordering::Relaxed);
    let most = watcher.join().unwrap();
    assert!(most <= 384 * MIB, "the group never held more than its limit on the device: {} MiB", most / MIB);
}
