//! The arbiter trusts nothing a client says (docs/security.md), with real processes on simgpu,
//! some of them run as another user (`setpriv`, UID 65534): a client declaring a higher
//! priority than it is allowed never gets another user's process ended; a larger request
//! or limit than its entitlement gets only its entitlement; naming another user's group
//! does not join it; a holder that forked and exited is never signalled by its (reused)
//! PID; overflowing and contradictory raw frames never put more in the ledger than the GPU
//! and the entitlement allow; and `gpufrac status` shows a user only its own processes
//! unless it is root or in `--admin-group`; memory used past the entitlement is seen as used
//! outside gpufrac; a connection whose process exited before its `Hello` is not entitled
//! under a policy; and bad entitlement flags are refused naming the flag.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpufrac_common::protocol::{read_frame, Reply, Request, SwapDirection, MAX_FRAME, VERSION};
use gpufrac_common::Resolver;
use gpufrac_daemon::status::{ProcessStatus, Status};
use gpufrac_e2e::raw_client::{device_id, hello, RawClient};
use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{
    artifact, compile_c, skip_on_real_gpu, status, unique, wait_for, Arbiter, ChildProcess, ShimSettings,
    SimGpu, NOT_GRANTED, WAIT_TIMED_OUT,
};

/// The other user: `nobody` on most systems.
const OTHER: u32 = 65534;
const CHUNK: u64 = 32 * MIB;
/// Why tests here need simgpu: a burst waits only when the device is full.
const COLLIDE: &str =
    "the bursts collide on simgpu's 4 GiB device; on a larger real GPU they fit side by side";
/// Why others need it: sizes to the byte.
const EXACT: &str = "exact sizes from simgpu's 64 MiB contexts on its 4 GiB device";

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

/// Lets another user run on `gpu`: its folder and the simulated machine's state are
/// opened to everyone (the test's own folder under the temp dir; nothing else is).
fn open_to_others(gpu: &SimGpu) {
    let dir = gpu.lib_dir();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).expect("chmod the simgpu folder");
    for entry in std::fs::read_dir(dir).expect("the simgpu folder").flatten() {
        let meta = std::fs::symlink_metadata(entry.path()).expect("stat");
        if meta.is_file() {
            let _ = std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o666));
        }
    }
}

/// An arbiter on `gpu` with `args`, reachable by the other user.
fn arbiter(gpu: &SimGpu, name: &str, args: &[&str]) -> Arbiter {
    let arbiter = Arbiter::start_at(gpu, gpu.lib_dir().join(name), args);
    open_to_others(gpu);
    arbiter
}

/// A policy file in `gpu`'s folder.
fn policy(gpu: &SimGpu, text: &str) -> PathBuf {
    let path = gpu.lib_dir().join(format!("policy-{}.json", unique("p")));
    std::fs::write(&path, text).expect("write the policy");
    path
}

/// `program` run as `uid` (through `setpriv`, with no supplementary groups) on `gpu`.
fn command_as(gpu: &SimGpu, uid: u32, program: &Path) -> Command {
    if uid == 0 {
        return gpu.command(program);
    }
    let mut cmd = gpu.command("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .arg("--")
        .arg(program);
    cmd
}

/// What a shim declares.
struct Declared<'a> {
    uid: u32,
    group: &'a str,
    request: &'a str,
    limit: &'a str,
    resolver: &'a str,
    priority: i64,
    wait: &'a str,
}

impl Default for Declared<'_> {
    fn default() -> Self {
        Declared {
            uid: 0,
            group: "g",
            request: "1GiB",
            limit: "3GiB",
            resolver: "wait",
            priority: 0,
            wait: "30s",
        }
    }
}

/// `alloc_paths alloc` under the shim, allocating in chunks up to `upto` bytes.
fn shim(gpu: &SimGpu, arbiter: &Arbiter, d: &Declared, upto: u64) -> ChildProcess {
    let program = compile_c("alloc_paths.c", &["MODE_DLSYM"], false);
    let mut cmd = command_as(gpu, d.uid, &program);
    cmd.preload_shim()
        .memory_request(d.request)
        .memory_limit(d.limit)
        .resolver(d.resolver)
        .priority(d.priority.to_string())
        .arbiter_socket(arbiter.socket())
        .group(d.group)
        .wait_timeout(d.wait)
        .log("info")
        .args(["alloc", &CHUNK.to_string(), &upto.to_string()]);
    ChildProcess::spawn(&mut cmd)
}

fn processes(s: &Status) -> &[ProcessStatus] {
    &s.gpus[0].processes
}

fn of_group<'a>(s: &'a Status, group: &str) -> Vec<&'a ProcessStatus> {
    processes(s).iter().filter(|p| p.group == group).collect()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|rest| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// The arbiter denied `child`'s burst for its timeout after making it wait `ms` in all
/// (its own account: a burst it granted, that simgpu then refused, would not be there).
/// The shim may ask again after a denial while its own wait lasts, so the waits of the
/// denials add up.
fn denied_after_waiting(arbiter: &Arbiter, child: &mut ChildProcess, ms: u64) {
    let waited = arbiter.denials(child.pid(), "Timeout");
    assert!(
        waited.iter().sum::<u64>() >= ms,
        "denied after waiting {ms} ms: {waited:?}\n{}\n{}",
        child.diagnostics(),
        arbiter.log_text()
    );
}

/// `child`, which has exited, said on stderr that its burst was not granted because its
/// wait timed out (the shim's own words).
fn shim_says_wait_timed_out(child: &mut ChildProcess) {
    let stderr = child.stderr_text();
    assert!(stderr.contains(NOT_GRANTED) && stderr.contains(WAIT_TIMED_OUT), "{}", child.diagnostics());
}

/// The issue's report: an unprivileged user with `GPUFRAC_PRIORITY=1000000` got a root
/// process holding burst memory ended. Without a policy a client is believed only about
/// itself: its burst waits instead.
#[test]
fn without_a_policy_a_priority_never_ends_another_users_process() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = arbiter(&gpu, "a.sock", &["--kill-grace", "1s"]);
    assert!(arbiter.log_text().contains("no entitlement policy loaded"), "{}", arbiter.log_text());
    let holder = unique("root");
    let mut a = shim(&gpu, &arbiter, &Declared { group: &holder, ..Declared::default() }, 2560 * MIB);
    assert_eq!(a.ready()[0], 2560 * MIB, "the holder bursts\n{}", a.diagnostics());
    let vip = unique("vip");
    let d = Declared {
        uid: OTHER,
        group: &vip,
        resolver: "priority",
        priority: 1_000_000,
        wait: "3s",
        ..Declared::default()
    };
    let mut b = shim(&gpu, &arbiter, &d, 2 * GIB);
    let got = b.ready()[0];
    assert!(got < 2 * GIB, "the other user's burst stopped at out-of-memory ({got})\n{}", b.diagnostics());
    denied_after_waiting(&arbiter, &mut b, 3000);
    assert!(alive(a.pid()), "the root holder is alive\n{}", arbiter.log_text());
    assert!(!arbiter.log_text().contains("terminating"), "{}", arbiter.log_text());
    let s = status(&arbiter);
    let p = of_group(&s, &vip);
    assert_eq!((p.len(), p[0].uid, p[0].entitlement.as_str()), (1, OTHER, "unrestricted (no policy)"));
    b.close_stdin();
    b.finish();
    shim_says_wait_timed_out(&mut b);
    a.close_stdin();
    a.finish();
}

/// With a policy, the priority a client declares is cut to its entry's: a declared
/// 1000000 against a holder of priority 5 of another user waits; the cut is logged and
/// shown in status.
#[test]
fn a_priority_above_the_policy_is_cut_and_ends_nobody() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let file = policy(
        &gpu,
        &format!(
            r#"{{ "uids": {{
                "0": {{ "max_request": "1GiB", "max_limit": "3GiB", "max_priority": 5 }},
                "{OTHER}": {{ "max_request": "1GiB", "max_limit": "3GiB", "max_priority": 2 }} }} }}"#
        ),
    );
    let arbiter = arbiter(&gpu, "p.sock", &["--policy", file.to_str().unwrap(), "--kill-grace", "1s"]);
    assert!(arbiter.log_text().contains("entitlements from the policy file"), "{}", arbiter.log_text());
    let holder = unique("root");
    let mut a =
        shim(&gpu, &arbiter, &Declared { group: &holder, priority: 5, ..Declared::default() }, 2560 * MIB);
    assert_eq!(a.ready()[0], 2560 * MIB, "{}", a.diagnostics());
    let vip = unique("vip");
    let d = Declared {
        uid: OTHER,
        group: &vip,
        resolver: "priority",
        priority: 1_000_000,
        wait: "3s",
        ..Declared::default()
    };
    let mut b = shim(&gpu, &arbiter, &d, 2 * GIB);
    let s = wait_for(&arbiter, "the other user's shim registered", |s| !of_group(s, &vip).is_empty());
    let p = of_group(&s, &vip)[0].clone();
    assert_eq!(p.priority, 2, "the priority believed is the policy's: {p:?}");
    assert!(p.capped.contains("priority 1000000 -> 2"), "{p:?}");
    assert!(p.entitlement.contains(&format!("uid {OTHER}")), "{p:?}");
    assert!(b.ready()[0] < 2 * GIB, "the burst stopped at out-of-memory\n{}", b.diagnostics());
    denied_after_waiting(&arbiter, &mut b, 3000);
    assert!(alive(a.pid()) && !arbiter.log_text().contains("terminating"), "{}", arbiter.log_text());
    assert!(arbiter.log_text().contains("declared more than its entitlement"), "{}", arbiter.log_text());
    b.close_stdin();
    b.finish();
    shim_says_wait_timed_out(&mut b);
    a.close_stdin();
    a.finish();
}

/// A limit above the entitlement: bursts stop at the entitled limit. A request above it:
/// only the entitled request is guaranteed, so another group's request still fits.
#[test]
fn a_request_or_limit_above_the_entitlement_gets_only_the_entitlement() {
    skip_on_real_gpu!("the guarantees add up to simgpu's 4 GiB device");
    let gpu = gpu();
    let file = policy(
        &gpu,
        &format!(
            r#"{{ "uids": {{
                "0": {{ "max_request": "3GiB", "max_limit": "3GiB" }},
                "{OTHER}": {{ "max_request": "1GiB", "max_limit": "2GiB" }} }} }}"#
        ),
    );
    let arbiter = arbiter(&gpu, "r.sock", &["--policy", file.to_str().unwrap()]);
    // Declares a 3.5 GiB limit; entitled to 2 GiB.
    let greedy = unique("greedy");
    let d = Declared { uid: OTHER, group: &greedy, limit: "3584MiB", wait: "2s", ..Declared::default() };
    let mut a = shim(&gpu, &arbiter, &d, 3584 * MIB);
    let got = a.ready()[0];
    assert!(got <= 2 * GIB, "held {got} past the entitled limit\n{}", a.diagnostics());
    let s = status(&arbiter);
    let p = of_group(&s, &greedy)[0].clone();
    assert_eq!((p.request, p.limit), (GIB, 2 * GIB), "{p:?}");
    assert!(p.capped.contains("limit 3758096384 -> 2147483648"), "{p:?}");
    // The shim is told, and says so.
    let said = a.stderr_text();
    assert!(said.contains("the arbiter holds this process to less than it declared"), "{said}");
    a.close_stdin();
    a.finish();

    // Declares the whole GPU as its request; entitled to 1 GiB.
    let squatter = unique("squat");
    let d = Declared { uid: OTHER, group: &squatter, request: "4GiB", limit: "4GiB", ..Declared::default() };
    let mut b = shim(&gpu, &arbiter, &d, 256 * MIB);
    b.ready();
    let s = status(&arbiter);
    assert_eq!(s.gpus[0].guaranteed, GIB, "only the entitled request is guaranteed: {s:?}");
    // Root's 3 GiB request fits beside it (it would not beside a 4 GiB one).
    let owner = unique("owner");
    let mut c =
        shim(&gpu, &arbiter, &Declared { group: &owner, request: "3GiB", ..Declared::default() }, 256 * MIB);
    assert_eq!(c.ready()[0], 256 * MIB, "admitted\n{}", c.diagnostics());
    assert_eq!(status(&arbiter).gpus[0].guaranteed, 4 * GIB);
    c.close_stdin();
    c.finish();
    b.close_stdin();
    b.finish();
}

/// The shim holds its process to what the arbiter believes (the entitlement), not to what
/// its environment declares: entitled to 1 GiB, it sees a 1 GiB device and gets no more,
/// and says why. A process that escapes the shim (no `LD_PRELOAD`) is seen through NVML as
/// memory outside gpufrac, and none of that memory is lent.
#[test]
fn memory_past_the_entitlement_is_refused_by_the_shim_and_outside_gpufrac_without_it() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let file = policy(
        &gpu,
        &format!(
            r#"{{ "uids": {{
                "0": {{ "max_request": "1GiB", "max_limit": "3GiB" }},
                "{OTHER}": {{ "max_request": "1GiB", "max_limit": "1GiB" }} }} }}"#
        ),
    );
    let arbiter = arbiter(&gpu, "u.sock", &["--policy", file.to_str().unwrap()]);
    let greedy = unique("greedy");
    let d = Declared { uid: OTHER, group: &greedy, request: "3GiB", limit: "3GiB", ..Declared::default() };
    let mut a = shim(&gpu, &arbiter, &d, 2560 * MIB);
    // Its 1 GiB entitlement less its 64 MiB context, in 32 MiB chunks.
    assert_eq!(a.ready()[0], GIB - 64 * MIB, "held to its entitlement\n{}", a.diagnostics());
    a.close_stdin();
    a.finish();
    assert!(
        a.stderr_text().contains("holds this process to less than it declared"),
        "the shim says why\n{}",
        a.diagnostics()
    );

    // The same user without the shim: 1.5 GiB and its context, all outside gpufrac.
    let mut cmd = command_as(&gpu, OTHER, &compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.args(["alloc", &CHUNK.to_string(), &(1536 * MIB).to_string()]);
    let mut escaped = ChildProcess::spawn(&mut cmd);
    assert_eq!(escaped.ready()[0], 1536 * MIB);
    let s = wait_for(&arbiter, "the escaped memory seen as outside gpufrac", |s| s.gpus[0].outside > 0);
    assert_eq!(s.gpus[0].outside, 1536 * MIB + 64 * MIB, "{s:?}");
    // Root bursts: only what is really free is lent (4 GiB - 1.5625 outside - 1 guaranteed).
    let owner = unique("owner");
    let mut b =
        shim(&gpu, &arbiter, &Declared { group: &owner, wait: "1s", ..Declared::default() }, 2560 * MIB);
    let got = b.ready()[0];
    assert!(got < 2560 * MIB - 64 * MIB, "lent only what is free: {got}\n{}", b.diagnostics());
    let now = status(&arbiter);
    let (lent, guaranteed) = (now.gpus[0].burst, now.gpus[0].guaranteed);
    assert!(lent + s.gpus[0].outside + guaranteed <= 4 * GIB, "lent {lent}, guaranteed {guaranteed}");
    b.close_stdin();
    b.finish();
    escaped.close_stdin();
    escaped.finish();
}

/// A client of another user naming a root group's name gets a group of its own: it shares
/// neither the guarantee nor the burst room, and the root group keeps its request and limit.
#[test]
fn naming_another_users_group_does_not_join_it() {
    skip_on_real_gpu!("a 512 MiB limit holds 256 MiB and a context only with simgpu's 64 MiB contexts");
    let gpu = gpu();
    let arbiter = arbiter(&gpu, "g.sock", &[]);
    let group = unique("shared");
    let mut a = shim(&gpu, &arbiter, &Declared { group: &group, ..Declared::default() }, 2 * GIB);
    assert_eq!(a.ready()[0], 2 * GIB, "{}", a.diagnostics());
    let d = Declared { uid: OTHER, group: &group, request: "512MiB", limit: "512MiB", ..Declared::default() };
    let mut b = shim(&gpu, &arbiter, &d, 256 * MIB);
    assert_eq!(b.ready()[0], 256 * MIB, "{}", b.diagnostics());
    let s = status(&arbiter);
    let members = of_group(&s, &group);
    assert_eq!(members.len(), 2, "{s:?}");
    let root = members.iter().find(|p| p.uid == 0).expect("root's member");
    let other = members.iter().find(|p| p.uid == OTHER).expect("the other user's member");
    assert_eq!((root.request, root.limit), (GIB, 3 * GIB), "root's group is unchanged");
    assert_eq!((other.request, other.limit), (512 * MIB, 512 * MIB), "a group of its own");
    assert_eq!(s.gpus[0].guaranteed, GIB + 512 * MIB, "two guarantees, not one shared");
    b.close_stdin();
    b.finish();
    a.close_stdin();
    a.finish();
}

/// `gpufrac status` as another user lists only that user's processes; root and members of
/// `--admin-group` see everyone.
#[test]
fn status_shows_a_user_only_its_own_processes() {
    let gpu = gpu();
    let arbiter = arbiter(&gpu, "s.sock", &["--admin-group", "4242"]);
    let mine = unique("root");
    let mut a = shim(&gpu, &arbiter, &Declared { group: &mine, ..Declared::default() }, 256 * MIB);
    a.ready();
    let theirs = unique("other");
    let mut b =
        shim(&gpu, &arbiter, &Declared { uid: OTHER, group: &theirs, ..Declared::default() }, 256 * MIB);
    b.ready();
    let json = |uid: u32, groups: &str| -> Status {
        let mut cmd = Command::new("setpriv");
        cmd.arg(format!("--reuid={uid}")).arg(format!("--regid={uid}"));
        if groups.is_empty() {
            cmd.arg("--clear-groups");
        } else {
            cmd.arg(format!("--groups={groups}"));
        }
        let out = cmd
            .arg("--")
            .arg(artifact("gpufrac"))
            .args(["status", "--json", "--socket"])
            .arg(arbiter.socket())
            .output()
            .expect("gpufrac status");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("status JSON")
    };
    let seen = |s: &Status| {
        let mut groups: Vec<String> = processes(s).iter().map(|p| p.group.clone()).collect();
        groups.sort();
        groups
    };
    let mut both = vec![mine.clone(), theirs.clone()];
    both.sort();
    assert_eq!(seen(&json(OTHER, "")), vec![theirs.clone()], "the other user sees its own only");
    let other = json(OTHER, "");
    assert_eq!(other.gpus[0].guaranteed, 2 * GIB, "the GPU's totals stay");
    assert_eq!(seen(&json(OTHER, "4242")), both, "a member of --admin-group sees everyone");
    assert_eq!(seen(&json(1000, "")), Vec::<String>::new(), "a user with no process sees none");
    assert_eq!(seen(&status(&arbiter)), both, "root sees everyone");
    b.close_stdin();
    b.finish();
    a.close_stdin();
    a.finish();
}

/// This process's resident and swapped host memory, in bytes, with a margin for growth.
fn host_memory() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb = |field: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (kb("VmRSS:") + kb("VmSwap:")) * 1024 * 2
}

/// Frames claiming 2^64-1 of everything, from 8 members of one group and from 4 groups,
/// never put more in the ledger than the GPU has and the entitlement allows, and a
/// well-behaved process is still admitted and served.
#[test]
fn overflowing_and_contradictory_reports_stay_within_the_gpu_and_the_entitlement() {
    skip_on_real_gpu!(EXACT);
    for with_policy in [false, true] {
        let gpu = gpu();
        let file = policy(&gpu, r#"{ "default": { "max_request": "512MiB", "max_limit": "1GiB" } }"#);
        let args: Vec<&str> = if with_policy {
            vec!["--policy", file.to_str().unwrap(), "--swap-limit", "3GiB"]
        } else {
            vec![]
        };
        let arbiter = arbiter(&gpu, "o.sock", &args);
        let device = device_id(&arbiter);
        let total = 4 * GIB;
        let mut clients = Vec::new();
        for i in 0..12 {
            let group = if i < 8 { "crowd".to_owned() } else { format!("solo{i}") };
            let mut raw = RawClient::hello(&arbiter, &hello(&group, "", Resolver::Swap, 0, 100));
            let request = if with_policy { u64::MAX } else { total / 8 };
            raw.send(&Request::Register {
                device,
                total: u64::MAX,
                request,
                limit: u64::MAX,
                held: u64::MAX,
                granted: u64::MAX,
                swapped: u64::MAX,
            });
            let reply = raw.reply();
            assert!(matches!(reply, Reply::Registered { .. } | Reply::Refused { .. }), "{reply:?}");
            raw.send(&Request::Acquire {
                seq: 1,
                device,
                bytes: u64::MAX / 2,
                preferred: u64::MAX,
                held: u64::MAX,
                resume: false,
            });
            raw.send(&Request::Swapped {
                device,
                direction: SwapDirection::Out,
                bytes: u64::MAX,
                granted: u64::MAX,
                host_bytes: u64::MAX,
                held: u64::MAX,
                micros: u64::MAX,
            });
            raw.send(&Request::Release { device, bytes: 0, held: u64::MAX });
            clients.push(raw);
        }
        // A status once every client's frames were handled.
        for raw in &mut clients {
            raw.handled(device, 2);
        }
        let s = status(&arbiter);
        let g = &s.gpus[0];
        assert!(g.guaranteed <= total && g.burst <= total, "{with_policy}: {g:?}");
        assert!(g.guaranteed + g.burst <= total, "{with_policy}: {g:?}");
        assert_eq!(g.burst, 0, "{with_policy}: a claimed grant NVML does not show is not believed: {g:?}");
        for p in &g.processes {
            assert!(p.request <= p.limit && p.limit <= total, "{with_policy}: {p:?}");
            if with_policy {
                assert!(p.request <= 512 * MIB && p.limit <= GIB && p.host_bytes <= GIB, "{p:?}");
            }
        }
        if with_policy {
            assert!(g.swapped <= 3 * GIB, "the node's swap limit: {g:?}");
        }
        // Each raw client is this test process: it keeps at most its own host memory.
        let own = host_memory();
        assert!(g.swapped <= 12 * own, "{with_policy}: {} swapped, this process holds {own}", g.swapped);
        // One group ("crowd") and four solo groups, each its own request.
        let crowd: Vec<_> = g.processes.iter().filter(|p| p.group == "crowd").collect();
        assert_eq!(crowd.len(), 8, "{with_policy}: {g:?}");
        // Meanwhile a well-behaved process is admitted and gets its burst.
        let d = Declared { group: &unique("fine"), request: "512MiB", limit: "1GiB", ..Declared::default() };
        let mut ok = shim(&gpu, &arbiter, &d, GIB);
        // Its limit counts its context's 64 MiB.
        assert_eq!(ok.ready()[0], GIB - 64 * MIB, "{with_policy}\n{}", ok.diagnostics());
        drop(clients);
        wait_for(&arbiter, "the raw clients gone", |s| s.gpus[0].processes.len() == 1);
        ok.close_stdin();
        ok.finish();
    }
}

/// What a process of the test spawned with `fork` does: connects, says hello, registers,
/// takes a 1.5 GiB grant, forks a child that keeps the connection and sleeps, and exits.
/// Everything is prepared before the fork: in the child only system calls run.
struct ForkedHolder {
    /// The process that connected (exited and reaped when `spawn` returns).
    connected: u32,
    /// The child that holds the connection now.
    holder: u32,
}

impl ForkedHolder {
    fn spawn(arbiter: &Arbiter, device: [u8; 16], group: &str) -> ForkedHolder {
        let mut frames = Request::Hello {
            version: VERSION,
            group: group.into(),
            pod: String::new(),
            resolver: Resolver::Wait,
            priority: 0,
            wait_timeout_ms: 1000,
            park_after_ms: 0,
            compute_request_pm: 0,
            compute_limit_pm: 0,
        }
        .encode();
        frames.extend(
            Request::Register {
                device,
                total: 4 * GIB,
                request: GIB,
                limit: 3 * GIB,
                held: 0,
                granted: 0,
                swapped: 0,
            }
            .encode(),
        );
        frames.extend(
            Request::Acquire {
                seq: 1,
                device,
                bytes: 1536 * MIB,
                preferred: 1536 * MIB,
                held: GIB,
                resume: false,
            }
            .encode(),
        );
        // The replies' length: Welcome (one GPU), Registered, Granted.
        let replies_len = Reply::Welcome { version: VERSION, pid: 0, managed: vec![(device, 0)] }
            .encode()
            .len()
            + Reply::Registered { device, request: 0, limit: 0, parked: false, context: 0 }.encode().len()
            + Reply::Granted { seq: 1, bytes: 0 }.encode().len();
        let path = std::ffi::CString::new(arbiter.socket().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a zeroed sockaddr_un is valid; the path fits (checked below).
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.as_bytes_with_nul();
        assert!(bytes.len() <= addr.sun_path.len(), "socket path too long");
        for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        let mut pipe = [0; 2];
        // SAFETY: `pipe` holds two descriptors.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child runs only system calls on memory prepared before the fork, then
        // `_exit`s (or pauses until killed): nothing that takes a lock another thread held.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            // SAFETY: as above; every buffer lives in this frame or was made before the fork.
            unsafe {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                if fd < 0 || libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) != 0 {
                    libc::_exit(10);
                }
                if libc::write(fd, frames.as_ptr().cast(), frames.len()) != frames.len() as isize {
                    libc::_exit(11);
                }
                // Welcome, Registered, Granted: read until the grant is in (a few frames).
                let mut buf = [0u8; 512];
                let mut got = 0usize;
                let deadline = libc::time(std::ptr::null_mut()) + 30;
                while got < replies_len && libc::time(std::ptr::null_mut()) < deadline {
                    let n = libc::read(fd, buf.as_mut_ptr().add(got).cast(), buf.len() - got);
                    if n <= 0 {
                        libc::_exit(12);
                    }
                    got += n as usize;
                }
                let holder = libc::fork();
                if holder == 0 {
                    loop {
                        libc::pause();
                    }
                }
                libc::write(
                    pipe[1],
                    (&holder as *const libc::pid_t).cast(),
                    std::mem::size_of::<libc::pid_t>(),
                );
                libc::_exit(0);
            }
        }
        // SAFETY: closing our copy of the write end; reading the child's PID into a local.
        let holder = unsafe {
            libc::close(pipe[1]);
            let mut holder: libc::pid_t = 0;
            let n = libc::read(
                pipe[0],
                (&mut holder as *mut libc::pid_t).cast(),
                std::mem::size_of::<libc::pid_t>(),
            );
            libc::close(pipe[0]);
            assert_eq!(n, std::mem::size_of::<libc::pid_t>() as isize, "the holder's PID");
            holder
        };
        let mut wstatus = 0;
        // SAFETY: reaping our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut wstatus, 0) }, pid);
        assert!(
            libc::WIFEXITED(wstatus) && libc::WEXITSTATUS(wstatus) == 0,
            "the connecting process: {wstatus}"
        );
        ForkedHolder { connected: pid as u32, holder: holder as u32 }
    }
}

impl Drop for ForkedHolder {
    fn drop(&mut self) {
        // SAFETY: the holder is a process this test made; it is reparented, not ours to reap.
        unsafe { libc::kill(self.holder as libc::pid_t, libc::SIGKILL) };
    }
}

/// Starts a process with PID `pid` (the last one handed out is set just below it), or
/// returns `None` when another process took the PID first.
fn sleeper_with_pid(pid: u32) -> Option<std::process::Child> {
    for _ in 0..20 {
        if std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).is_err() {
            return None;
        }
        let child = Command::new("sleep").arg("120").spawn().expect("spawn sleep");
        if child.id() == pid {
            return Some(child);
        }
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
    }
    None
}

/// The issue's report: a holder forked, left its connection to the child and exited; its
/// PID was reused by an unrelated root `sleep`, which the arbiter then SIGTERMed. Signals
/// go through the pidfd of the process that connected: it has exited, so nothing is
/// signalled, and the connection is closed instead (its grant comes back).
#[test]
fn a_holder_that_forked_and_exited_is_never_signalled_by_its_reused_pid() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = arbiter(&gpu, "f.sock", &["--kill-grace", "1s"]);
    let device = device_id(&arbiter);
    let group = unique("forked");
    let forked = ForkedHolder::spawn(&arbiter, device, &group);
    let s = wait_for(&arbiter, "the forked holder's grant", |s| s.gpus[0].burst == 1536 * MIB);
    assert_eq!(of_group(&s, &group)[0].pid, forked.connected);
    // Its PID, reused on purpose where the kernel lets us (ns_last_pid, as root).
    let mut reused = sleeper_with_pid(forked.connected);
    let vip = unique("vip");
    let d = Declared { group: &vip, resolver: "priority", priority: 10, ..Declared::default() };
    let mut b = shim(&gpu, &arbiter, &d, 2 * GIB);
    assert_eq!(b.ready()[0], 2 * GIB, "the priority burst is served\n{}", arbiter.log_text());
    let log = arbiter.log_text();
    assert!(log.contains("has exited but its connection is still open"), "{log}");
    if let Some(sleep) = reused.as_mut() {
        assert!(
            sleep.try_wait().expect("try_wait").is_none(),
            "the process that reused PID {} was signalled\n{log}",
            forked.connected
        );
        let _ = sleep.kill();
        let _ = sleep.wait();
    } else {
        eprintln!("PID {} could not be reused on purpose: checked the pidfd path only", forked.connected);
    }
    assert!(alive(forked.holder), "the child holding the connection is not signalled either");
    b.close_stdin();
    b.finish();
}

/// Every entitlement flag is checked at start, and a refusal names the flag.
#[test]
fn bad_entitlement_flags_are_refused_naming_the_flag() {
    let gpu = gpu();
    let bad_policy = policy(&gpu, r#"{ "uids": { "bob": { "max_request": "1GiB", "max_limit": "1GiB" } } }"#);
    let socket = gpu.lib_dir().join("never.sock");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--policy".into(), "/nonexistent/policy.json".into()],
            "--policy: policy file /nonexistent/policy.json: cannot read",
        ),
        (vec!["--policy".into(), bad_policy.display().to_string()], "\"bob\" is not a numeric uid"),
        (
            vec!["--policy".into(), bad_policy.display().to_string(), "--kubernetes".into()],
            "'--policy <FILE>' cannot be used with '--kubernetes'",
        ),
        (vec!["--pod-resources-socket".into(), "/x".into()], "--kubernetes"),
        (
            vec!["--admin-group".into(), "no-such-group-gpufrac".into()],
            "--admin-group \"no-such-group-gpufrac\": no such group",
        ),
        (vec!["--kubernetes".into(), "--shares-per-gpu".into(), "0".into()], "--shares-per-gpu 0"),
    ];
    for (args, want) in cases {
        let out = gpu
            .command(artifact("gpufrac-arbiter"))
            .arg("--socket")
            .arg(&socket)
            .args(&args)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .expect("run gpufrac-arbiter");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    // Outside a pod, --kubernetes says what is missing.
    let out = gpu
        .command(artifact("gpufrac-arbiter"))
        .arg("--socket")
        .arg(&socket)
        .arg("--kubernetes")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("run gpufrac-arbiter");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("--kubernetes")
            && stderr.contains("KUBERNETES_SERVICE_HOST"),
        "{stderr}"
    );
    // A group name is looked up (root's group is 0 everywhere).
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("ok.sock"), &["--admin-group", "root"]);
    assert!(arbiter.log_text().contains("gid=0"), "{}", arbiter.log_text());
}

/// The frames a process that connected and exited before its `Hello` got: its child, which
/// kept the connection, sends `Hello`, `Register` and `Acquire` once the connecting
/// process is reaped (so that its PID names nobody), hands back every byte it read, and
/// keeps the connection open until dropped.
struct OrphanedConnection {
    replies: Vec<Reply>,
    holder: u32,
}

impl OrphanedConnection {
    fn spawn(arbiter: &Arbiter, device: [u8; 16], group: &str) -> OrphanedConnection {
        let mut frames = Request::Hello {
            version: VERSION,
            group: group.into(),
            pod: String::new(),
            resolver: Resolver::Wait,
            priority: 0,
            wait_timeout_ms: 100,
            park_after_ms: 0,
            compute_request_pm: 0,
            compute_limit_pm: 0,
        }
        .encode();
        for r in [
            Request::Register {
                device,
                total: 4 * GIB,
                request: GIB,
                limit: 2 * GIB,
                held: 0,
                granted: 0,
                swapped: 0,
            },
            Request::Acquire {
                seq: 1,
                device,
                bytes: 256 * MIB,
                preferred: 256 * MIB,
                held: 0,
                resume: false,
            },
        ] {
            frames.extend(r.encode());
        }
        let path = std::ffi::CString::new(arbiter.socket().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a zeroed sockaddr_un is valid; the path fits (checked below).
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.as_bytes_with_nul();
        assert!(bytes.len() <= addr.sun_path.len(), "socket path too long");
        for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        // `go`: the test tells the holder the connecting process is reaped; `back`: the
        // holder's PID, then what it read.
        let (mut go, mut back) = ([0; 2], [0; 2]);
        // Welcome (one GPU) and Registered, and the start of the answer to the burst.
        let first_replies = Reply::Welcome { version: VERSION, pid: 0, managed: vec![(device, 0)] }
            .encode()
            .len()
            + Reply::Registered { device, request: 0, limit: 0, parked: false, context: 0 }.encode().len()
            + 8;
        // SAFETY: each array holds two descriptors.
        assert_eq!(unsafe { libc::pipe(go.as_mut_ptr()) }, 0);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::pipe(back.as_mut_ptr()) }, 0);
        // SAFETY: the child runs only system calls on memory prepared before the fork, then
        // `_exit`s (or pauses until killed): nothing that takes a lock another thread held.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            // SAFETY: as above; every buffer lives in this frame or was made before the fork.
            unsafe {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                if fd < 0 || libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) != 0 {
                    libc::_exit(10);
                }
                let holder = libc::fork();
                if holder != 0 {
                    libc::write(
                        back[1],
                        (&holder as *const libc::pid_t).cast(),
                        std::mem::size_of::<libc::pid_t>(),
                    );
                    libc::_exit(0);
                }
                // The holder: waits for the word, speaks, hands back the replies.
                let mut word = 0u8;
                if libc::read(go[0], (&mut word as *mut u8).cast(), 1) != 1 {
                    libc::_exit(11);
                }
                if libc::write(fd, frames.as_ptr().cast(), frames.len()) != frames.len() as isize {
                    libc::_exit(12);
                }
                // Welcome, Registered, then the answer to the burst.
                let mut buf = [0u8; 512];
                let mut got = 0usize;
                let deadline = libc::time(std::ptr::null_mut()) + 20;
                while got < first_replies && libc::time(std::ptr::null_mut()) < deadline {
                    let n = libc::read(fd, buf.as_mut_ptr().add(got).cast(), buf.len() - got);
                    if n <= 0 {
                        break;
                    }
                    got += n as usize;
                }
                // One more moment for the rest of the last frame.
                libc::usleep(200_000);
                let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                while got < buf.len() && libc::poll(&mut pfd, 1, 0) == 1 && pfd.revents & libc::POLLIN != 0 {
                    let n = libc::read(fd, buf.as_mut_ptr().add(got).cast(), buf.len() - got);
                    if n <= 0 {
                        break;
                    }
                    got += n as usize;
                }
                libc::write(back[1], buf.as_ptr().cast(), got);
                libc::close(back[1]);
                loop {
                    libc::pause();
                }
            }
        }
        // SAFETY: closing our copies of the ends the children use; reading into locals.
        let holder = unsafe {
            libc::close(go[0]);
            libc::close(back[1]);
            let mut holder: libc::pid_t = 0;
            let n = libc::read(
                back[0],
                (&mut holder as *mut libc::pid_t).cast(),
                std::mem::size_of::<libc::pid_t>(),
            );
            assert_eq!(n, std::mem::size_of::<libc::pid_t>() as isize, "the holder's PID");
            holder
        };
        let mut wstatus = 0;
        // SAFETY: reaping our own child: its PID names nobody from here on.
        assert_eq!(unsafe { libc::waitpid(pid, &mut wstatus, 0) }, pid);
        assert!(
            libc::WIFEXITED(wstatus) && libc::WEXITSTATUS(wstatus) == 0,
            "the connecting process: {wstatus}"
        );
        // SAFETY: writing one byte from a local, then reading what the holder sends into a
        // buffer of ours until it closes its end.
        let read = unsafe {
            assert_eq!(libc::write(go[1], [1u8].as_ptr().cast(), 1), 1);
            libc::close(go[1]);
            let mut read = Vec::new();
            let mut buf = [0u8; 512];
            loop {
                let n = libc::read(back[0], buf.as_mut_ptr().cast(), buf.len());
                if n <= 0 {
                    break;
                }
                read.extend_from_slice(&buf[..n as usize]);
            }
            libc::close(back[0]);
            read
        };
        let mut cursor = std::io::Cursor::new(read);
        let mut replies = Vec::new();
        while let Ok(frame) = read_frame(&mut cursor, MAX_FRAME) {
            replies.push(Reply::decode(&frame).expect("a reply frame"));
        }
        OrphanedConnection { replies, holder: holder as u32 }
    }
}

impl Drop for OrphanedConnection {
    fn drop(&mut self) {
        // SAFETY: the holder is a process this test made; it is reparented, not ours to reap.
        unsafe { libc::kill(self.holder as libc::pid_t, libc::SIGKILL) };
    }
}

/// A process that forks and lets the parent that opened the socket exit (reaped) before
/// its `Hello` cannot be pinned: its cgroup, read by a PID that names nobody, says
/// nothing, and must never make it a host process. Under a source of entitlements it is
/// not entitled, whatever its user: no guarantee, no burst. (Kernels whose
/// `SO_PEERPIDFD` hands a pidfd of the exited process make it "has exited"; older ones
/// give none: "cannot pin".) The same user connecting itself gets its entitlement.
#[test]
fn a_connection_whose_process_exited_before_hello_is_not_entitled() {
    let gpu = gpu();
    let file = policy(&gpu, r#"{ "default": { "max_request": "1GiB", "max_limit": "2GiB" } }"#);
    let arbiter = arbiter(&gpu, "n.sock", &["--policy", file.to_str().unwrap()]);
    let device = device_id(&arbiter);
    let orphan_group = unique("orphan");
    let orphan = OrphanedConnection::spawn(&arbiter, device, &orphan_group);
    let replies = &orphan.replies;
    assert!(matches!(replies.first(), Some(Reply::Welcome { .. })), "{replies:?}");
    assert!(
        matches!(replies.get(1), Some(Reply::Registered { request: 0, limit: 0, .. })),
        "nothing believed: {replies:?}\n{}",
        arbiter.log_text()
    );
    assert!(matches!(replies.get(2), Some(Reply::Denied { seq: 1, .. })), "no burst: {replies:?}");
    let s = status(&arbiter);
    let p = of_group(&s, &orphan_group);
    assert_eq!(p.len(), 1, "{s:?}");
    assert!(p[0].entitlement.starts_with("not entitled"), "{:?}", p[0]);
    assert_eq!((s.gpus[0].guaranteed, s.gpus[0].burst), (0, 0), "{s:?}");
    // The same user, connecting itself, is entitled by the same policy.
    let mut raw = RawClient::hello(&arbiter, &hello(&unique("pinned"), "", Resolver::Swap, 0, 100));
    raw.send(&Request::Register {
        device,
        total: 4 * GIB,
        request: GIB,
        limit: 2 * GIB,
        held: 0,
        granted: 0,
        swapped: 0,
    });
    assert!(
        matches!(raw.reply(), Reply::Registered { request, limit, .. } if request == GIB && limit == 2 * GIB)
    );
}
