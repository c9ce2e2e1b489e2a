//! What this process uses of a device as NVML lists it, beside what the shim charged it:
//! how contexts, heaps and modules are measured, and how the backstop compares. The
//! device's total is never used: other processes allocate on it at any moment.

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::driver::ffi::SUCCESS;
use crate::driver::table::{call_real, uuid_string};
use crate::enforcer::Enforcer;

type Ptr = *mut c_void;

/// This process's own usage on CUDA device `ordinal` as NVML lists it (by the PID the
/// arbiter saw, in a container, where NVML reports the host's PIDs), next to what the shim
/// has charged this process there (`mine`, contexts and allocations). `own` is `None`
/// when NVML does not list the process (no context yet, or listed by a PID the shim does
/// not know: a container without an arbiter); the whole outer `None` without NVML, or when
/// this process's charge moved while NVML answered. The device's total is never used:
/// other processes allocate on it at any moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    pub own: Option<u64>,
    pub mine: u64,
}

pub(crate) fn usage(e: &Enforcer, ordinal: usize, dev: usize) -> Option<Usage> {
    let mut device = 0;
    let mut uuid = [0u8; 16];
    if call_real!(cuDeviceGet(&mut device, ordinal as c_int)) != SUCCESS
        || call_real!(cuDeviceGetUuid(&mut uuid, device)) != SUCCESS
        || call_real!(nvmlInit_v2()) != SUCCESS
    {
        return None;
    }
    let name = std::ffi::CString::new(uuid_string(&uuid)).ok()?;
    let mut handle: Ptr = std::ptr::null_mut();
    if call_real!(nvmlDeviceGetHandleByUUID(name.as_ptr() as *const c_char, &mut handle)) != SUCCESS {
        fence_once();
        return None;
    }
    let mut procs = [[0u64; 3]; 256];
    let mut count: c_uint = procs.len() as c_uint;
    let mine = e.ledger.held_by_me(dev);
    let listed =
        call_real!(nvmlDeviceGetComputeRunningProcesses_v3(handle, &mut count, procs.as_mut_ptr().cast()));
    fence_once();
    if listed != SUCCESS {
        return None;
    }
    // Another thread charged or freed while NVML answered: the two do not match.
    if e.ledger.held_by_me(dev) != mine {
        return None;
    }
    let me = e.ledger.my_host_pid().unwrap_or_else(std::process::id);
    let own = own_usage(&procs[..(count as usize).min(procs.len())], me);
    Some(Usage { own, mine })
}

/// How much address space [`fence_once`] reserves: one page-table page's reach (2 MiB
/// on x86_64 and aarch64 with 4 KiB pages) and a page. Not a whole multiple of 2 MiB:
/// the kernel aligns such anonymous mappings to 2 MiB (for huge pages), which would
/// leave a gap under NVML's mappings for small ones to fall into.
const FENCE: usize = (2 << 20) + 4096;

/// Reserves, once per process, a little over 2 MiB of address space (no memory:
/// `PROT_NONE`, never touched) right below the mappings NVML made when the shim loaded
/// it, and fills the small holes left above it (see [`fill_holes_above`]).
///
/// The kernel places a new mapping right below the lowest one. Without the fence, the
/// program's next mappings (a driver's host memory; every allocation of the simulated
/// driver, whose device memory is host memory) land right under NVML's, in the 2 MiB
/// that one of NVML's page-table pages covers: each `munmap` of them then walks that
/// page's entries instead of skipping a range with no page table, about 0.2 µs for a
/// 1 MiB block, all of it added by the shim having loaded NVML into a program that
/// never did. Below an untouched reservation of more than 2 MiB, the page-table page
/// they fall in holds nothing else, as in the program alone.
fn fence_once() {
    static FENCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if FENCED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // Kept for the process's life; nothing reads or writes it. A failure only leaves the
    // layout as it was.
    let fence = reserve(FENCE);
    if fence != libc::MAP_FAILED {
        fill_holes_above(fence as usize);
    }
}

/// At most how many pages [`fill_holes_above`] reserves: a bound on the system calls it
/// makes once per process, at the first context (a few in practice: 9 in `shim_bench`).
const MOST_FILLED_PAGES: usize = 1024;

/// Fills, a page at a time, the holes between mappings above the fence at `fence`
/// (every one smaller than the fence, or the kernel would have put the fence there).
///
/// The kernel puts a small mapping in the highest hole it fits, not below the lowest
/// mapping: a 4 KiB allocation lands in a hole among the libraries (the one ld.so leaves
/// where it read its cache, right under the first preloaded library), sharing its 2 MiB
/// page-table region with the libraries' touched pages, so that its `munmap` walks their
/// page table, and in the middle of the kernel's tree of mappings, where the shim's own
/// mappings (`libgpufrac.so` right above that hole) make finding its neighbours longer.
/// Filled, small mappings land below the fence like large ones. The filler pages are
/// `PROT_NONE` and adjacent ones merge into one mapping per hole. A hole's pages are
/// found by asking for a page anywhere until the kernel places one below the fence.
fn fill_holes_above(fence: usize) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    for _ in 0..MOST_FILLED_PAGES {
        // Kept for the process's life, like the fence (or unmapped just below).
        let filler = reserve(page);
        if filler == libc::MAP_FAILED {
            return;
        }
        if (filler as usize) < fence {
            // No hole above the fence any more: this page is not needed.
            // SAFETY: the page was just mapped here and nothing else knows of it.
            unsafe { libc::munmap(filler, page) };
            return;
        }
    }
}

/// `len` bytes of address space at an address of the kernel's choosing: no access, no
/// memory, no swap reserved (`MAP_FAILED` if the kernel refuses).
fn reserve(len: usize) -> *mut std::ffi::c_void {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing (no
    // hint) never replaces an existing mapping and has no other preconditions.
    unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    }
}

/// NVML's `NVML_VALUE_NOT_AVAILABLE`: a process listed whose usage the driver does not
/// report (some containers, Windows guests).
const NOT_AVAILABLE: u64 = u64::MAX;

/// The usage NVML lists for `pid` (`nvmlProcessInfo_t`: pid as u32, padded; usedGpuMemory;
/// instance ids), if it is listed with a usage.
fn own_usage(listed: &[[u64; 3]], pid: u32) -> Option<u64> {
    listed.iter().find(|p| p[0] & 0xffff_ffff == u64::from(pid)).map(|p| p[1]).filter(|&b| b != NOT_AVAILABLE)
}

/// Bytes a context took, from this process's own usage before and after creating it, less
/// what the process's other threads were charged for meanwhile (their allocations show in
/// its usage too). `None` when it cannot be measured cleanly: NVML does not list the
/// process afterwards.
pub(crate) fn delta(before: Usage, after: Usage) -> Option<u64> {
    Some(signed_delta(before, after)?.clamp(0, i128::from(u64::MAX)) as u64)
}

/// What a call changed in this process's own usage, less what its other threads were
/// charged or freed meanwhile: negative when the call gave memory back (a smaller heap).
pub(crate) fn signed_delta(before: Usage, after: Usage) -> Option<i128> {
    // Signed: another thread may have freed meanwhile (both figures fall by it).
    let grown = i128::from(after.own?) - i128::from(before.own.unwrap_or(0));
    let others = i128::from(after.mine) - i128::from(before.mine);
    Some(grown - others)
}

/// Whether `bytes` is far from the last clean measurement `known` (more than twice, or
/// less than half): then it is believed only if a second look agrees.
pub(crate) fn far_from(bytes: u64, known: Option<u64>) -> bool {
    known.is_some_and(|known| bytes > known.saturating_mul(2) || bytes.saturating_mul(2) < known)
}

#[cfg(test)]
mod tests {
    use super::{delta, far_from, own_usage, Usage};

    fn at(own: Option<u64>, mine: u64) -> Usage {
        Usage { own, mine }
    }

    #[test]
    fn a_context_is_measured_by_this_process_own_usage_only() {
        // Not listed before the first context, listed after.
        assert_eq!(delta(at(None, 0), at(Some(256), 0)), Some(256));
        // Listed both times.
        assert_eq!(delta(at(Some(100), 100), at(Some(356), 100)), Some(256));
        // Another thread of this process allocated 1000 meanwhile: not the context's.
        assert_eq!(delta(at(Some(100), 100), at(Some(1356), 1100)), Some(256));
        // Or freed 500 meanwhile: the context still took 256.
        assert_eq!(delta(at(Some(1000), 1000), at(Some(756), 500)), Some(256));
        // Not listed afterwards (a PID the shim does not know): not measurable, whatever
        // the device's usage did.
        assert_eq!(delta(at(None, 0), at(None, 0)), None);
    }

    #[test]
    fn a_usage_the_driver_does_not_report_is_no_measurement() {
        let listed = [[7, 300, 0], [9, u64::MAX, 0]];
        assert_eq!(own_usage(&listed, 7), Some(300));
        assert_eq!(own_usage(&listed, 9), None, "NVML_VALUE_NOT_AVAILABLE");
        assert_eq!(own_usage(&listed, 8), None, "not listed");
    }

    #[test]
    fn a_measurement_far_from_the_last_one_needs_a_second_look() {
        assert!(!far_from(300, None));
        assert!(!far_from(300, Some(256)));
        assert!(far_from(4 << 30, Some(256 << 20)));
        assert!(far_from(0, Some(256 << 20)));
        assert!(!far_from(0, Some(0)));
    }
}
