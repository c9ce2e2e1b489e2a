//! The simulated GPU shares its device memory between processes on every allocation path,
//! whichever way a program reaches the driver, and gives a process's memory back when it
//! frees it or dies.
//!
//! Each case runs `tests/c/alloc_paths.c`, built three ways (linked with `-lcuda`, loaded
//! with `dlopen`/`dlsym`, resolved through `cuGetProcAddress_v2`), on one of the eight
//! allocation paths (`cuMemAlloc`, pitched, managed, stream-ordered, pool, 2D and 3D
//! arrays, VMM) against a private 1 GiB device whose contexts take 64 MiB each.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test simgpu_alloc_paths`.

use std::path::PathBuf;

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{
    compile_c, describe_status, process_state, skip_on_real_gpu, ChildProcess, SimGpu, TIMEOUT,
};

const DEVICE: u64 = GIB;
const OVERHEAD: u64 = 64 * MIB;
const CHUNK: u64 = 32 * MIB;
/// What one process can hold on an otherwise idle device: all but its context.
const ROOM: u64 = DEVICE - OVERHEAD;
/// Why every test here needs simgpu.
const SIMULATOR: &str = "tests the simulator itself: a 1 GiB simulated device with 64 MiB contexts";

/// How `alloc_paths` reaches the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Linked,
    Dlsym,
    ProcAddr,
}

impl Mode {
    fn program(self) -> PathBuf {
        match self {
            Mode::Linked => compile_c("alloc_paths.c", &["MODE_LINKED"], true),
            Mode::Dlsym => compile_c("alloc_paths.c", &["MODE_DLSYM"], false),
            Mode::ProcAddr => compile_c("alloc_paths.c", &["MODE_PROCADDR"], false),
        }
    }
}

/// One case: a mode and an allocation path, named in every failure message.
#[derive(Debug, Clone, Copy)]
struct Case {
    mode: Mode,
    path: &'static str,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}/{}", self.mode, self.path)
    }
}

/// `READY <held> <free> <total>` from `alloc_paths`.
#[derive(Debug, Clone, Copy)]
struct Report {
    held: u64,
    free: u64,
    total: u64,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "held {}, free {}, total {}", mib(self.held), mib(self.free), mib(self.total))
    }
}

impl Case {
    /// Starts `alloc_paths` on this case's path, filling the device or up to `limit` bytes.
    fn start(&self, gpu: &SimGpu, limit: Option<u64>) -> ChildProcess {
        let mut cmd = gpu.command(self.mode.program());
        cmd.arg(self.path).arg(CHUNK.to_string());
        if let Some(limit) = limit {
            cmd.arg(limit.to_string());
        }
        ChildProcess::spawn(&mut cmd)
    }

    /// Waits for the child's `READY` line.
    fn report(&self, child: &mut ChildProcess) -> Report {
        let v = child.ready();
        assert_eq!(v.len(), 3, "{self}: READY must carry held, free and total: {v:?}");
        let report = Report { held: v[0], free: v[1], total: v[2] };
        assert_eq!(report.total, DEVICE, "{self}: cuMemGetInfo total must be the device's memory ({report})");
        report
    }

    /// A process that filled the device got between `room - CHUNK` (exclusive) and `room`,
    /// and the driver reports less than a chunk free: the allocation that failed really
    /// did not fit.
    fn assert_filled(&self, who: &str, report: Report, room: u64) {
        assert!(
            report.held <= room && report.held + CHUNK > room,
            "{self}: process {who} should hold all but less than one {} chunk of the {} left to it, got {report}",
            mib(CHUNK),
            mib(room)
        );
        assert!(
            report.free < CHUNK && report.free <= room - report.held,
            "{self}: process {who} ran out of memory, so less than a chunk must be free, got {report}"
        );
    }
}

fn setup() -> SimGpu {
    SimGpu::new("1GiB").with_context_overhead("64MiB")
}

/// Two processes share one device, each sees only what the other left, and everything
/// freed is available again.
fn device_is_shared(case: Case) {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = setup();

    // A fills the device.
    let mut a = case.start(&gpu, None);
    let ra = case.report(&mut a);
    case.assert_filled("A", ra, ROOM);

    // B gets only what A left, after paying for its own context; with nothing left even
    // its context does not fit, which it must be told cleanly.
    let left_to_b = ROOM - ra.held;
    let mut b = case.start(&gpu, None);
    let line = b.expect_line(&["READY", "CTX_OOM"], TIMEOUT);
    if line == "CTX_OOM" {
        b.expect_exit_code(3);
        assert!(
            left_to_b < OVERHEAD,
            "{case}: process B could not create its context though A left {} and a context takes {}",
            mib(left_to_b),
            mib(OVERHEAD)
        );
    } else {
        let fields: Vec<u64> = line.split_whitespace().skip(1).filter_map(|w| w.parse().ok()).collect();
        assert!(fields.len() == 3, "{case}: malformed line from B: {line:?}");
        let held_b = fields[0];
        assert!(
            left_to_b >= OVERHEAD && held_b <= left_to_b - OVERHEAD,
            "{case}: process B holds {} while A holds {} of the {} a process can use",
            mib(held_b),
            mib(ra.held),
            mib(ROOM)
        );
        b.finish();
    }

    // A lets go, and C gets the whole device again.
    a.finish();
    let mut c = case.start(&gpu, None);
    let rc = case.report(&mut c);
    case.assert_filled("C", rc, ROOM);
    c.finish();

    // D holds half the device; E gets exactly the rest, less its context.
    let half = DEVICE / 2;
    let mut d = case.start(&gpu, Some(half));
    let rd = case.report(&mut d);
    assert!(
        rd.held <= half && rd.held + CHUNK > half,
        "{case}: process D was asked to hold up to {}, got {rd}",
        mib(half)
    );
    assert_eq!(
        rd.free,
        DEVICE - OVERHEAD - rd.held,
        "{case}: with only D on the device, free must be the device less D's context and memory ({rd})"
    );
    let mut e = case.start(&gpu, None);
    let re = case.report(&mut e);
    case.assert_filled("E (beside D)", re, ROOM - rd.held - OVERHEAD);
    e.finish();
    d.finish();
}

/// A process killed while it holds the whole device gives all of it back, whether or not
/// its parent has reaped it yet.
fn killed_process_releases(case: Case, reap: bool) {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = setup();
    let mut a = case.start(&gpu, None);
    let ra = case.report(&mut a);
    case.assert_filled("A", ra, ROOM);

    a.kill();
    if reap {
        let status = a.wait(TIMEOUT);
        assert_eq!(describe_status(status), "killed by signal 9", "{case}: A should have died of SIGKILL");
    } else {
        a.wait_terminated(TIMEOUT);
        assert_eq!(process_state(a.pid()), Some('Z'), "{case}: A should be an unreaped zombie");
    }

    let mut c = case.start(&gpu, None);
    let rc = case.report(&mut c);
    case.assert_filled(
        if reap { "C (after A was killed and reaped)" } else { "C (beside A's zombie)" },
        rc,
        ROOM,
    );
    c.finish();

    if !reap {
        assert_eq!(process_state(a.pid()), Some('Z'), "{case}: A should still be unreaped");
        a.wait(TIMEOUT);
    }
}

/// One `#[test]` per allocation path, in a module per mode, calling `$run(Case)`.
macro_rules! per_path {
    ($module:ident, $mode:expr, $run:expr) => {
        mod $module {
            use super::*;
            per_path!(@tests $mode, $run; alloc, pitch, managed, async_, pool, array, array3d, vmm);
        }
    };
    (@tests $mode:expr, $run:expr; $($path:ident),*) => {
        $(
            #[test]
            fn $path() {
                // `async` is a keyword: its test is `async_`.
                let path = stringify!($path).trim_end_matches('_');
                ($run)(Case { mode: $mode, path });
            }
        )*
    };
}

per_path!(linked, Mode::Linked, device_is_shared);
per_path!(dlsym, Mode::Dlsym, device_is_shared);
per_path!(procaddr, Mode::ProcAddr, device_is_shared);
per_path!(killed_and_reaped, Mode::Linked, |case| killed_process_releases(case, true));
per_path!(killed_zombie, Mode::Dlsym, |case| killed_process_releases(case, false));
