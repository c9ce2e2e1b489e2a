//! A pod's container cgroup for end-to-end tests of the arbiter's Kubernetes entitlement:
//! the arbiter finds a process's pod by the UID in its cgroup path, as the kubelet names
//! it, so a test process must really be in such a cgroup.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A cgroup (cgroupfs layout) that names a container of a pod, as the kubelet makes one:
/// `/kubepods/pod<uid>/<container id>`, in the first hierarchy that lets the test make it
/// and move a process into it: cgroup v1's `pids`, else cgroup v2 (`/sys/fs/cgroup`
/// on a unified host, `/sys/fs/cgroup/unified` on a hybrid one). Removed when dropped.
pub struct PodCgroup {
    pod_dir: PathBuf,
    container_dir: PathBuf,
}

/// Where [`PodCgroup::make`] tries, in order.
const CGROUP_ROOTS: [&str; 3] = ["/sys/fs/cgroup/pids", "/sys/fs/cgroup", "/sys/fs/cgroup/unified"];

impl PodCgroup {
    /// The cgroup of a container of the pod `pod_uid`, or why no hierarchy of this machine
    /// let the test make it.
    pub fn make(pod_uid: &str) -> Result<PodCgroup, String> {
        let mut why_not = Vec::new();
        for root in CGROUP_ROOTS {
            match PodCgroup::make_in(Path::new(root), pod_uid) {
                Ok(cgroup) => return Ok(cgroup),
                Err(why) => why_not.push(format!("{root}: {why}")),
            }
        }
        Err(why_not.join("; "))
    }

    /// [`PodCgroup::make`], or `None` after reporting the test skipped on this machine
    /// ([`crate::report_skip`]) when no hierarchy let it be made.
    pub fn make_or_skip(pod_uid: &str) -> Option<PodCgroup> {
        match PodCgroup::make(pod_uid) {
            Ok(cgroup) => Some(cgroup),
            Err(why) => {
                crate::report_skip(
                    crate::Skip::ThisMachine,
                    &format!("this machine does not let the test make a pod's cgroup ({why})"),
                );
                None
            }
        }
    }

    fn make_in(root: &Path, pod_uid: &str) -> Result<PodCgroup, String> {
        if !root.join("cgroup.procs").exists() {
            return Err("not a cgroup hierarchy".into());
        }
        let pod_dir = root.join("kubepods").join(format!("pod{pod_uid}"));
        let container_dir = pod_dir.join("c0ffee00".repeat(8));
        std::fs::create_dir_all(&container_dir)
            .map_err(|e| format!("cannot make {}: {e}", container_dir.display()))?;
        let cgroup = PodCgroup { pod_dir, container_dir };
        // A process can join it (cgroup v2 also asks for write access to cgroup.procs
        // where the test's process is).
        let mut probe = std::process::Command::new("true");
        cgroup.enter(&mut probe);
        match probe.status() {
            Ok(status) if status.success() => Ok(cgroup),
            Ok(status) => Err(format!("a process in it: {status}")),
            Err(e) => Err(format!("cannot move a process into it: {e}")),
        }
    }

    /// Makes `cmd`'s process a member before it runs anything.
    pub fn enter(&self, cmd: &mut std::process::Command) {
        use std::os::unix::process::CommandExt as _;
        let procs = std::ffi::CString::new(
            self.container_dir.join("cgroup.procs").into_os_string().into_encoded_bytes(),
        )
        .unwrap();
        // SAFETY: between fork and exec only async-signal-safe calls are made: open, write
        // and close on a path and buffer prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0\n".as_ptr().cast(), 2);
                libc::close(fd);
                if written != 2 {
                    return Err(std::io::Error::other("cannot join the pod's cgroup"));
                }
                Ok(())
            });
        }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.container_dir).is_ok() || !self.container_dir.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir(&self.pod_dir);
        let _ = std::fs::remove_dir(self.pod_dir.parent().unwrap());
    }
}
