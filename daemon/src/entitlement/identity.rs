//! Who is on a connection, from the kernel: PID, UID and GID from `SO_PEERCRED`, a pidfd
//! for the peer, and its container from `/proc/<pid>/cgroup`.
//!
//! The pidfd is what makes signals safe: a PID is only a number, reused once its process
//! is gone (a holder that forked, left its connection to the child and exited), while a
//! pidfd names one process for as long as it is open. The arbiter signals only through it
//! ([`Pidfd::signal`]), so a reused PID is never signalled.
//!
//! Where the pidfd comes from:
//! - `SO_PEERPIDFD` (Linux 6.5+): the kernel hands the pidfd of the process that called
//!   `connect`, taken at that moment. No race at all.
//! - Else `pidfd_open(pid)` just after `accept`, then a check that the process it names
//!   started before the connection was accepted (its start time in `/proc/<pid>/stat`,
//!   read while the pidfd shows it alive, so the file read is that very process's). A
//!   process that took the PID over after `accept` fails the check. What is left is a
//!   peer that exited and whose PID was reused between `connect` and `accept`, while the
//!   connection sat in the backlog: Linux hands PIDs out cyclically, so that needs the
//!   whole PID space (`kernel.pid_max`) to wrap around in that window, microseconds on a
//!   served socket. Race-free enough; the kernels that matter have `SO_PEERPIDFD` anyway.
//! - Neither (a kernel before 5.3, or the peer gone already): no pidfd, and the arbiter
//!   never signals that process (it can still deny it bursts).
//!
//! System calls go through `nix`, except three it has no wrapper for: `pidfd_open`,
//! `pidfd_send_signal` and `SO_PEERGROUPS` stay plain `libc` calls.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{getsockopt, sockopt};
use nix::time::{clock_gettime, ClockId};
use nix::unistd::{sysconf, SysconfVar};

use super::{Cgroup, ContainerRef};

/// `SO_PEERGROUPS` (Linux 4.13+; the same on x86 and arm64; not in every libc version).
const SO_PEERGROUPS: libc::c_int = 59;

/// Why the peer of a socket could not be identified.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// `SO_PEERCRED` failed: the socket is not a connected unix socket.
    #[error("SO_PEERCRED: {0}")]
    PeerCred(io::Error),
}

/// A pidfd: one process, for as long as it is open, whatever happens to its PID.
#[derive(Debug)]
pub struct Pidfd(OwnedFd);

impl Pidfd {
    /// A pidfd for `pid` (`pidfd_open`), with no check of who it is.
    pub fn open(pid: u32) -> io::Result<Pidfd> {
        let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from(Errno::ESRCH))?;
        // SAFETY: pidfd_open takes a PID and flags and returns a new descriptor or -1; no
        // memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
        Ok(Pidfd(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }))
    }

    /// Sends `signal` to the process (`pidfd_send_signal`): `ESRCH` when it has exited,
    /// never another process.
    pub fn signal(&self, signal: i32) -> io::Result<()> {
        // SAFETY: pidfd_send_signal takes a descriptor we own, a signal number, a null
        // siginfo (the kernel fills one in) and no flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Whether the process has not been reaped yet.
    pub fn alive(&self) -> bool {
        self.signal(0).is_ok()
    }

    /// The PID of the process this pidfd names, as the kernel says (`Pid:` in its
    /// fdinfo): `None` once it has exited (-1 there) or when unreadable.
    pub fn pid(&self) -> Option<u32> {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", self.0.as_raw_fd())).ok()?;
        let pid: i64 = info.lines().find_map(|l| l.strip_prefix("Pid:"))?.trim().parse().ok()?;
        u32::try_from(pid).ok().filter(|&p| p > 0)
    }
}

/// The peer of a connected unix socket, as the kernel says.
#[derive(Debug)]
pub struct PeerCred {
    /// Its PID (in the arbiter's PID namespace).
    pub pid: u32,
    /// Its effective UID at connect.
    pub uid: u32,
    /// Its effective GID at connect.
    pub gid: u32,
    /// A pidfd for the process that connected, or why there is none.
    pub pidfd: Result<Pidfd, String>,
}

/// Reads the peer of `socket`: `SO_PEERCRED`, then a pidfd as the module doc says.
pub fn peer_of(socket: BorrowedFd<'_>) -> Result<PeerCred, IdentityError> {
    let cred = cred_of(socket)?;
    let pidfd = pidfd_of(socket, &cred);
    Ok(PeerCred { pid: cred.pid, uid: cred.uid, gid: cred.gid, pidfd })
}

/// The peer of a socket as `SO_PEERCRED` says, and when it was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cred {
    /// Its PID (in the arbiter's PID namespace).
    pub pid: u32,
    /// Its effective UID at connect.
    pub uid: u32,
    /// Its effective GID at connect.
    pub gid: u32,
    /// Clock ticks since boot when this was read (just after `accept`): a process that
    /// started later is not the peer.
    pub accepted: Option<u64>,
}

/// `SO_PEERCRED` alone: no descriptor is opened, so a connection that never says who it
/// is costs one descriptor, its own. Take the pidfd later with [`pidfd_of`].
pub fn cred_of(socket: BorrowedFd<'_>) -> Result<Cred, IdentityError> {
    // Taken before anything else: whatever holds the PID after this instant is not the peer.
    let accepted = boot_ticks();
    let cred =
        getsockopt(&socket, sockopt::PeerCredentials).map_err(|e| IdentityError::PeerCred(e.into()))?;
    Ok(Cred { pid: cred.pid().max(0) as u32, uid: cred.uid(), gid: cred.gid(), accepted })
}

/// A pidfd for the peer `cred` describes: `SO_PEERPIDFD` (the process that connected,
/// whenever this is called), else `pidfd_open` checked against `cred.accepted`.
pub fn pidfd_of(socket: BorrowedFd<'_>, cred: &Cred) -> Result<Pidfd, String> {
    match peer_pidfd(socket) {
        Ok(fd) => Ok(fd),
        // A kernel before 6.5.
        Err(Errno::ENOPROTOOPT | Errno::EINVAL | Errno::EOPNOTSUPP) => checked_open(cred.pid, cred.accepted),
        Err(e) => Err(format!("SO_PEERPIDFD: {}", io::Error::from(e))),
    }
}

/// `SO_PEERPIDFD`: the pidfd of the process that connected, from the kernel.
fn peer_pidfd(socket: BorrowedFd<'_>) -> nix::Result<Pidfd> {
    // The kernel answers a descriptor or an error (ENODATA when the peer has no PID).
    getsockopt(&socket, sockopt::PeerPidfd).map(Pidfd)
}

/// `pidfd_open(pid)`, kept only if the process started no later than `accepted` (clock
/// ticks since boot) and was alive while its start time was read.
fn checked_open(pid: u32, accepted: Option<u64>) -> Result<Pidfd, String> {
    if pid <= 1 {
        return Err(format!("no usable PID ({pid}) for the peer"));
    }
    let fd = Pidfd::open(pid).map_err(|e| format!("pidfd_open({pid}): {e}"))?;
    let started = start_ticks(pid).ok_or_else(|| format!("/proc/{pid}/stat unreadable"))?;
    // Alive after the read: the PID was not reusable meanwhile, so the file was its own.
    if !fd.alive() {
        return Err(format!("PID {pid} exited before it could be identified"));
    }
    match accepted {
        Some(accepted) if started > accepted => {
            Err(format!("PID {pid} was reused after the connection was accepted"))
        }
        _ => Ok(fd),
    }
}

/// Clock ticks (`_SC_CLK_TCK`) since boot, as `/proc/<pid>/stat` counts a start time.
fn boot_ticks() -> Option<u64> {
    // CLOCK_BOOTTIME is the clock process start times use.
    let ts = clock_gettime(ClockId::CLOCK_BOOTTIME).ok()?;
    let hz = sysconf(SysconfVar::CLK_TCK).ok()??;
    if hz <= 0 {
        return None;
    }
    Some(ts.tv_sec() as u64 * hz as u64 + ts.tv_nsec() as u64 * hz as u64 / 1_000_000_000)
}

/// A process's start time (`/proc/<pid>/stat` field 22), in clock ticks since boot.
pub fn start_ticks(pid: u32) -> Option<u64> {
    parse_start_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Field 22 of a `/proc/<pid>/stat` line. The command name (field 2) may hold spaces and
/// parentheses: fields are counted after its last `)`.
fn parse_start_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // Fields 3.. follow: the state is field 3, the start time field 22.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Host memory process `pid` holds, resident or swapped to disk (`VmRSS` + `VmSwap` in
/// `/proc/<pid>/status`): the most it can really keep in host RAM for swapped-out GPU
/// memory, whatever it reports. `None` when unreadable.
pub fn host_memory_of(pid: u32) -> Option<u64> {
    parse_host_memory(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// `VmRSS` + `VmSwap` (kB) of a `/proc/<pid>/status` text, in bytes.
fn parse_host_memory(status: &str) -> Option<u64> {
    let kb = |field: &str| -> Option<u64> {
        let line = status.lines().find_map(|l| l.strip_prefix(field))?;
        line.split_whitespace().next()?.parse().ok()
    };
    let rss = kb("VmRSS:")?;
    Some(rss.saturating_add(kb("VmSwap:").unwrap_or(0)).saturating_mul(1024))
}

/// The peer's supplementary groups as they were at connect (`SO_PEERGROUPS`, Linux
/// 4.13+): from the kernel, with no `/proc` read and no race with the PID's reuse.
pub fn peer_groups(socket: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    // NGROUPS_MAX is 65536; start small and grow to what the kernel says it needs.
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: `groups` holds `len` bytes and lives across the call; `len` lives on
        // this frame.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(Errno::ERANGE as i32) && n > groups.len() && n <= 65536 {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
}

/// Where process `pid` runs, from `/proc/<pid>/cgroup`; an unreadable file is
/// [`Cgroup::Unknown`], never the host.
pub fn cgroup_of(pid: u32) -> Cgroup {
    match std::fs::read_to_string(format!("/proc/{pid}/cgroup")) {
        Ok(text) => parse_cgroup(&text),
        Err(e) => Cgroup::Unknown(format!("/proc/{pid}/cgroup unreadable: {e}")),
    }
}

/// Where a `/proc/<pid>/cgroup` text places its process, every hierarchy (v2 `0::/path`
/// and each v1 one) considered:
/// - [`Cgroup::Container`] when some path names a container and none names another or is
///   not understood. Layouts, the container found in any component (a container may
///   have cgroups of its own below it: systemd inside, `.../<id>.scope/init.scope`):
///   - systemd driver: `.../kubepods-<qos>-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope`
///     (or `crio-<id>.scope`, `docker-<id>.scope`), and the v1 form `...slice:cri-containerd:<id>`;
///   - cgroupfs driver: `/kubepods/<qos>/pod<uid>/<id>` (`<qos>` absent for Guaranteed pods);
///     under `kubepods` the container is the component right after the pod's;
///   - docker without Kubernetes: `/system.slice/docker-<id>.scope` or `/docker/<id>`, with an
///     empty `pod_uid`.
/// - [`Cgroup::Host`] when no path is under `kubepods` or a container runtime's cgroup.
/// - [`Cgroup::Unknown`] otherwise: under `kubepods` without a pod and a container of it,
///   a runtime-looking component (`libpod-`, `crio-`, a 64-hex ID...) in no known layout,
///   two different containers, or a text that is not a cgroup file.
pub fn parse_cgroup(text: &str) -> Cgroup {
    let mut found: Option<ContainerRef> = None;
    let mut lines = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(_controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            return Cgroup::Unknown(format!("not a cgroup line: {}", shown_path(line)));
        };
        lines += 1;
        match parse_cgroup_path(path) {
            Cgroup::Host => {}
            Cgroup::Container(c) => match &found {
                Some(other) if *other != c => {
                    return Cgroup::Unknown(format!(
                        "its cgroups name two containers ({} and {})",
                        other.container_id, c.container_id
                    ))
                }
                _ => found = Some(c),
            },
            unknown @ Cgroup::Unknown(_) => return unknown,
        }
    }
    if lines == 0 {
        return Cgroup::Unknown("an empty cgroup file".into());
    }
    found.map_or(Cgroup::Host, Cgroup::Container)
}

/// A cgroup path for a message: at most 160 characters, escaped.
fn shown_path(path: &str) -> String {
    let cut: String = path.chars().take(160).collect();
    let more = if cut.len() < path.len() { "..." } else { "" };
    format!("{cut:?}{more}")
}

/// Where one cgroup path places its process (see [`parse_cgroup`]).
fn parse_cgroup_path(path: &str) -> Cgroup {
    // The v1 systemd form puts the container in a component: `slice:runtime:id`.
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/').filter(|p| !p.is_empty()) {
        match part.split_once(':') {
            Some((slice, rest)) => {
                parts.push(slice);
                parts.extend(rest.rsplit(':').next());
            }
            None => parts.push(part),
        }
    }
    let unknown = |what: &str| Cgroup::Unknown(format!("cgroup {} {what}", shown_path(path)));
    if let Some(kubepods) = parts.iter().position(|p| p.starts_with("kubepods")) {
        // The pod: the first component under kubepods naming a pod UID; its container: the
        // component right below it (anything deeper is the container's own business).
        let Some((at, pod_uid)) =
            parts[kubepods..].iter().enumerate().find_map(|(i, p)| pod_uid(p).map(|uid| (kubepods + i, uid)))
        else {
            return unknown("is under kubepods but names no pod");
        };
        return match parts.get(at + 1).and_then(|c| container_id(c)) {
            Some(container_id) => Cgroup::Container(ContainerRef { pod_uid, container_id }),
            None => unknown("is under a pod but names no container of it"),
        };
    }
    // Docker without a pod: `docker-<id>.scope`, or `docker/<id>`, in any component.
    for (i, part) in parts.iter().enumerate() {
        let id = match *part {
            "docker" => parts.get(i + 1).and_then(|next| container_id(next)),
            scope if scope.starts_with("docker-") => container_id(scope),
            _ => None,
        };
        if let Some(container_id) = id {
            return Cgroup::Container(ContainerRef { pod_uid: String::new(), container_id });
        }
    }
    if parts.iter().any(|p| runtime_like(p)) {
        return unknown("looks like a container's but is no layout the arbiter knows");
    }
    Cgroup::Host
}

/// Whether a cgroup component looks like a container runtime's: a runtime's prefix, or a
/// run of 64 hex digits (a container ID).
fn runtime_like(component: &str) -> bool {
    const PREFIXES: [&str; 6] = ["cri-containerd-", "crio-", "docker-", "libpod", "lxc", "containerd-"];
    if component == "docker" || PREFIXES.iter().any(|p| component.starts_with(p)) {
        return true;
    }
    let mut run = 0;
    for b in component.bytes() {
        run = if b.is_ascii_hexdigit() { run + 1 } else { 0 };
        if run >= 64 {
            return true;
        }
    }
    false
}

/// The container ID in a cgroup's last component: `cri-containerd-<id>.scope`,
/// `crio-<id>.scope`, `docker-<id>.scope`, or a bare `<id>` (cgroupfs driver).
fn container_id(component: &str) -> Option<String> {
    let id = match component.strip_suffix(".scope") {
        // `.scope` without a runtime's prefix is some other systemd unit.
        Some(unit) => ["cri-containerd-", "crio-", "docker-"].iter().find_map(|p| unit.strip_prefix(p))?,
        None => component,
    };
    let ok = id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    ok.then(|| id.to_owned())
}

/// The pod UID in a cgroup component: `kubepods-<qos>-pod<uid_with_underscores>.slice`,
/// `kubepods-pod<uid>.slice` or `pod<uid>` (cgroupfs); dashes restored.
fn pod_uid(component: &str) -> Option<String> {
    let uid = match component.strip_suffix(".slice") {
        Some(slice) => slice.rsplit_once("-pod").map(|(_, uid)| uid)?,
        None => component.strip_prefix("pod")?,
    };
    let uid = uid.replace('_', "-");
    // A UUID, or the 32-hex hash a static pod gets.
    let ok = (32..=36).contains(&uid.len()) && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    ok.then_some(uid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::Signal;

    const ID: &str = "8c1f6e0a5d7b4f2e9a3c1b0d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f";
    const POD: &str = "0f3c2a1b-4d5e-6f70-8192-a3b4c5d6e7f8";

    fn expect(text: &str, pod: &str) {
        let got = parse_cgroup(text);
        let want = Cgroup::Container(ContainerRef { pod_uid: pod.into(), container_id: ID.into() });
        assert_eq!(got, want, "{text}");
    }

    fn expect_unknown(text: &str) {
        let got = parse_cgroup(text);
        assert!(matches!(got, Cgroup::Unknown(_)), "{text}: {got:?}");
    }

    #[test]
    fn containerd_and_crio_under_the_systemd_driver_cgroup_v2() {
        let pod_ = POD.replace('-', "_");
        expect(
            &format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod_}.slice/cri-containerd-{ID}.scope\n"),
            POD,
        );
        expect(&format!("0::/kubepods.slice/kubepods-pod{pod_}.slice/crio-{ID}.scope\n"), POD);
        expect(
            &format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{pod_}.slice/docker-{ID}.scope"),
            POD,
        );
    }

    #[test]
    fn a_container_with_cgroups_of_its_own_is_still_that_container() {
        let pod_ = POD.replace('-', "_");
        // systemd inside a container moves itself to init.scope; a runtime nests its own.
        expect(
            &format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod_}.slice/cri-containerd-{ID}.scope/init.scope\n"),
            POD,
        );
        expect(&format!("0::/kubepods/burstable/pod{POD}/{ID}/system.slice/app.service\n"), POD);
        expect(&format!("0::/kubepods/pod{POD}/{ID}/docker/{}\n", "a".repeat(64)), POD);
        expect(&format!("0::/system.slice/docker-{ID}.scope\n"), "");
        expect(&format!("0::/docker/{ID}\n"), "");
        expect(&format!("0::/system.slice/docker-{ID}.scope/init.scope\n"), "");
        expect(&format!("0::/docker/{ID}/init.scope\n"), "");
        // The arbiter in a cgroup namespace of its own sees paths relative to it.
        expect(&format!("0::/../../kubepods/burstable/pod{POD}/{ID}\n"), POD);
    }

    #[test]
    fn cgroupfs_driver_and_cgroup_v1() {
        expect(&format!("0::/kubepods/burstable/pod{POD}/{ID}\n"), POD);
        expect(&format!("0::/kubepods/pod{POD}/{ID}\n"), POD);
        let v1 = format!(
            "12:pids:/kubepods/besteffort/pod{POD}/{ID}\n4:memory:/kubepods/besteffort/pod{POD}/{ID}\n1:name=systemd:/kubepods/besteffort/pod{POD}/{ID}\n0::/\n"
        );
        expect(&v1, POD);
        // v1, systemd driver: `slice:runtime:id`.
        let pod_ = POD.replace('-', "_");
        expect(
            &format!("3:cpu,cpuacct:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod_}.slice:cri-containerd:{ID}\n"),
            POD,
        );
        // A static pod's UID is a 32-hex hash.
        let hash = "6b1c3d5e7f9a0b2c4d6e8f0a1b3c5d7e";
        expect(&format!("0::/kubepods/burstable/pod{hash}/{ID}"), hash);
    }

    #[test]
    fn the_host_is_only_what_is_under_no_pod_and_no_runtime() {
        for host in [
            "0::/\n",
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            "0::/init.scope\n",
            "0::/system.slice/containerd.service\n",
            "0::/system.slice/docker.service\n",
            "12:pids:/user.slice\n1:name=systemd:/user.slice/user-0.slice/session-1.scope\n0::/\n",
        ] {
            assert_eq!(parse_cgroup(host), Cgroup::Host, "{host}");
        }
    }

    #[test]
    fn what_is_under_kubepods_or_a_runtime_but_not_understood_is_unknown_never_the_host() {
        let pod_ = POD.replace('-', "_");
        for unknown in [
            // A pod's own slice, not a container in it (the pause process's parent).
            format!("0::/kubepods/burstable/pod{POD}\n"),
            format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod_}.slice\n"),
            // Under kubepods without a pod UID.
            "0::/kubepods\n".to_owned(),
            "0::/kubepods.slice/kubepods-besteffort.slice\n".to_owned(),
            format!("0::/kubepods/burstable/{ID}\n"),
            // A pod, then something that is not one of its containers.
            format!("0::/kubepods/burstable/pod{POD}/init.scope/{ID}\n"),
            format!("0::/kubepods.slice/kubepods-pod{pod_}.slice/crio-conmon-{ID}.scope\n"),
            // Not hex, or not 64 characters.
            format!("0::/kubepods/burstable/pod{POD}/{}\n", &ID[..63]),
            format!("0::/kubepods/burstable/pod{POD}/{}\n", ID.to_uppercase()),
            // A runtime outside Kubernetes that is not docker, or a container-looking ID.
            format!("0::/machine.slice/libpod-{ID}.scope\n"),
            format!("0::/system.slice/{ID}.scope\n"),
            "0::/lxc.payload.c1\n".to_owned(),
            // Crafted: a path outside kubepods claiming a pod.
            format!("0::/evil/pod{POD}/{ID}\n"),
            // Hybrid: the unified hierarchy says nothing, a v1 one is a pod's slice.
            format!("0::/\n4:memory:/kubepods/burstable/pod{POD}\n"),
            // Two hierarchies, two containers.
            format!("0::/kubepods/pod{POD}/{ID}\n4:memory:/kubepods/pod{POD}/{}\n", "b".repeat(64)),
            "garbage".to_owned(),
            String::new(),
        ] {
            expect_unknown(&unknown);
        }
    }

    #[test]
    fn an_unreadable_cgroup_file_is_unknown() {
        assert!(matches!(cgroup_of(u32::MAX - 1), Cgroup::Unknown(_)));
    }

    #[test]
    fn start_time_is_field_22_whatever_the_command_name() {
        let stat = "4242 (a b) c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 123 45";
        assert_eq!(parse_start_ticks(stat), Some(987654));
        assert_eq!(parse_start_ticks("1 (x) S 0"), None);
        let own = start_ticks(std::process::id()).expect("own start time");
        assert!(own <= boot_ticks().expect("boot clock"), "a running process started in the past");
    }

    #[test]
    fn host_memory_is_resident_plus_swapped() {
        let status = "Name:\tx\nVmRSS:\t  2048 kB\nVmSwap:\t   512 kB\n";
        assert_eq!(parse_host_memory(status), Some(2560 * 1024));
        assert_eq!(parse_host_memory("VmRSS:\t1 kB\n"), Some(1024));
        assert_eq!(parse_host_memory("Name:\tkthread\n"), None);
        assert!(host_memory_of(std::process::id()).is_some_and(|b| b > 0));
    }

    #[test]
    fn a_pidfd_signals_only_its_own_process() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let fd = Pidfd::open(child.id()).expect("pidfd_open");
        assert!(fd.alive());
        fd.signal(Signal::SIGKILL as i32).expect("signal through the pidfd");
        child.wait().expect("reap");
        // Reaped: the PID may be anyone's now; the pidfd still names the dead process.
        let err = fd.signal(Signal::SIGTERM as i32).expect_err("a reaped process cannot be signalled");
        assert_eq!(err.raw_os_error(), Some(Errno::ESRCH as i32));
    }

    #[test]
    fn the_peer_of_a_socket_pair_is_this_process_with_a_pidfd() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        use std::os::fd::AsFd;
        let peer = peer_of(a.as_fd()).expect("SO_PEERCRED");
        assert_eq!(peer.pid, std::process::id());
        assert_eq!(peer.uid, nix::unistd::getuid().as_raw());
        assert!(peer.pidfd.expect("a pidfd").alive());
        let fallback = checked_open(std::process::id(), boot_ticks()).expect("pidfd_open fallback");
        assert!(fallback.alive());
        // A process that started after the accept is refused.
        assert!(checked_open(std::process::id(), Some(0)).is_err());
        // The credentials alone open nothing; the pidfd can be taken later.
        let cred = cred_of(a.as_fd()).expect("SO_PEERCRED");
        assert_eq!((cred.pid, cred.uid), (peer.pid, peer.uid));
        assert!(pidfd_of(a.as_fd(), &cred).expect("a pidfd later").alive());
        let own = nix::unistd::getgroups().expect("getgroups");
        assert_eq!(peer_groups(a.as_fd()).expect("SO_PEERGROUPS").len(), own.len());
    }
}
