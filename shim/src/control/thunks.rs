//! Entry points the shim does not hook, handed out by `cuGetProcAddress` in a parkable
//! process, through a thunk that waits for the process's wake while the driver holds it
//! locked for a checkpoint park.
//!
//! A process the arbiter parks with the driver's checkpoint API is locked by the driver:
//! every CUDA call it makes blocks inside the driver until the arbiter restores and
//! unlocks it, which the arbiter only does when the process asks to be woken. Hooked calls
//! ask at the shim's gate; an entry point the shim does not hook would go straight into
//! the driver and block for ever. The CUDA runtime (so PyTorch, CuPy, vLLM) finds every
//! driver function through `cuGetProcAddress` and calls some of them (`cuCtxGetDevice`
//! from `cudaGetDevice`, before nearly every operation) first, so in a parkable process
//! `cuGetProcAddress` answers an unhooked `cu*` name with a thunk instead: while nothing
//! is parked, one compare and two jumps to the real function; while the driver holds the
//! process, the thunk waits for the wake (asking for it), then jumps on. A wake that
//! fails returns `CUDA_ERROR_OUT_OF_MEMORY` from the call (every driver function returns a
//! `CUresult`) rather than block.
//!
//! A thunk keeps every argument register as it was (it saves them around the wait), so it
//! serves a function of any signature, variadic ones included. x86_64 only; elsewhere (and
//! past [`THUNKS`] distinct functions) the real function is handed out, and such a call
//! blocks inside the driver until another call of the process wakes it (docs/arbiter.md).

use std::sync::atomic::{AtomicBool, Ordering};

use crate::driver::ffi::{Status, OUT_OF_MEMORY, SUCCESS};

type Ptr = *mut std::ffi::c_void;

/// How many distinct unhooked functions get a thunk.
pub(crate) const THUNKS: usize = 1024;

/// The driver holds this process locked for a checkpoint park: thunks wait for the wake.
static HELD: AtomicBool = AtomicBool::new(false);

/// Marks the process locked by the driver (a checkpoint park), or free again (woken).
pub(crate) fn set_held(held: bool) {
    HELD.store(held, Ordering::SeqCst);
}

/// Whether the driver may hold this process locked for a checkpoint park.
#[inline(always)]
pub(crate) fn held() -> bool {
    HELD.load(Ordering::Relaxed)
}

/// [`held`], ordered with the count of hooked calls (`park::to_driver`).
pub(crate) fn held_now() -> bool {
    HELD.load(Ordering::SeqCst)
}

/// What a call that reached the driver while it holds the process locked does first: waits
/// for the wake. `Err` (out-of-memory) if the wake failed.
#[cold]
#[inline(never)]
pub(crate) fn wait_until_released() -> Result<(), Status> {
    while held() {
        crate::control::gate::wait_awake()?;
        if held() {
            // Woken but not yet released (the wake is finishing): look again shortly.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    Ok(())
}

/// The thunks' slow path, called with the caller's argument registers saved: 0 to go on
/// into the driver, else the status to return. Never unwinds into the assembly.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
extern "C" fn thunk_wait() -> Status {
    // A wait that panicked must not let the call into the locked driver: it fails instead.
    std::panic::catch_unwind(wait_until_released).map_or(OUT_OF_MEMORY, |r| r.err().unwrap_or(SUCCESS))
}

#[cfg(target_arch = "x86_64")]
mod x86_64 {
    use std::sync::atomic::AtomicPtr;

    use super::{thunk_wait, HELD, THUNKS};

    /// The real function behind each thunk, by index.
    pub(super) static TARGETS: [AtomicPtr<std::ffi::c_void>; THUNKS] =
        [const { AtomicPtr::new(std::ptr::null_mut()) }; THUNKS];

    // Each thunk is 16 bytes from `gpufrac_unhooked_thunks`: its index into `r11` (a
    // scratch register no C argument uses), then the common part. That jumps to
    // `TARGETS[r11]`, unless `HELD` is set: then it saves the argument registers (the six
    // integer ones, `rax` for variadic calls and `xmm0`-`xmm7`), calls `thunk_wait` with
    // the stack 16-byte aligned, restores them and jumps on, or returns its status.
    std::arch::global_asm!(
        ".pushsection .text.gpufrac_thunks,\"ax\",@progbits",
        ".balign 16",
        ".globl gpufrac_unhooked_thunks",
        ".hidden gpufrac_unhooked_thunks",
        "gpufrac_unhooked_thunks:",
        ".set gpufrac_thunk_index, 0",
        ".rept {count}",
        ".balign 16",
        "movl $gpufrac_thunk_index, %r11d",
        "jmp 3f",
        ".set gpufrac_thunk_index, gpufrac_thunk_index + 1",
        ".endr",
        "3:",
        "cmpb $0, {held}(%rip)",
        "jne 5f",
        "4:",
        "leaq {targets}(%rip), %r10",
        "jmpq *(%r10,%r11,8)",
        "5:",
        "pushq %rdi",
        "pushq %rsi",
        "pushq %rdx",
        "pushq %rcx",
        "pushq %r8",
        "pushq %r9",
        "pushq %rax",
        "pushq %r11",
        "subq $136, %rsp",
        "movdqu %xmm0, 0(%rsp)",
        "movdqu %xmm1, 16(%rsp)",
        "movdqu %xmm2, 32(%rsp)",
        "movdqu %xmm3, 48(%rsp)",
        "movdqu %xmm4, 64(%rsp)",
        "movdqu %xmm5, 80(%rsp)",
        "movdqu %xmm6, 96(%rsp)",
        "movdqu %xmm7, 112(%rsp)",
        "call {wait}",
        "movl %eax, %r10d",
        "movdqu 0(%rsp), %xmm0",
        "movdqu 16(%rsp), %xmm1",
        "movdqu 32(%rsp), %xmm2",
        "movdqu 48(%rsp), %xmm3",
        "movdqu 64(%rsp), %xmm4",
        "movdqu 80(%rsp), %xmm5",
        "movdqu 96(%rsp), %xmm6",
        "movdqu 112(%rsp), %xmm7",
        "addq $136, %rsp",
        "popq %r11",
        "popq %rax",
        "popq %r9",
        "popq %r8",
        "popq %rcx",
        "popq %rdx",
        "popq %rsi",
        "popq %rdi",
        "testl %r10d, %r10d",
        "jz 4b",
        "movl %r10d, %eax",
        "ret",
        ".popsection",
        count = const THUNKS,
        held = sym HELD,
        targets = sym TARGETS,
        wait = sym thunk_wait,
        options(att_syntax)
    );

    extern "C" {
        static gpufrac_unhooked_thunks: u8;
    }

    /// The address of thunk `index`.
    pub(super) fn thunk(index: usize) -> *mut std::ffi::c_void {
        // Only the address of the assembly's label is taken; nothing is read.
        let base = std::ptr::addr_of!(gpufrac_unhooked_thunks) as usize;
        (base + 16 * index) as *mut std::ffi::c_void
    }
}

/// A thunk for the real function `real`, the same one each time it is asked for; `None`
/// where there is none (not x86_64, or every thunk taken).
pub(crate) fn thunk_for(real: Ptr) -> Option<Ptr> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::Mutex;
        /// How many thunks are handed out; assigned under the lock (lookups are rare).
        static ASSIGNED: Mutex<usize> = Mutex::new(0);
        if real.is_null() {
            return None;
        }
        let mut assigned = ASSIGNED.lock().unwrap_or_else(|p| p.into_inner());
        let targets = &x86_64::TARGETS;
        if let Some(i) = (0..*assigned).find(|&i| targets[i].load(Ordering::Acquire) == real) {
            return Some(x86_64::thunk(i));
        }
        if *assigned == THUNKS {
            return None;
        }
        let i = *assigned;
        targets[i].store(real, Ordering::Release);
        *assigned += 1;
        Some(x86_64::thunk(i))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = real;
        None
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Nine integer and two floating-point arguments (three on the stack) and a variadic
    /// tail: whatever reaches the function is what the caller passed.
    extern "C" fn sums(
        a: u64,
        b: u64,
        c: u64,
        d: u64,
        e: u64,
        f: u64,
        g: u64,
        h: u64,
        i: u64,
        x: f64,
        y: f64,
    ) -> Status {
        let ints = a + 2 * b + 3 * c + 4 * d + 5 * e + 6 * f + 7 * g + 8 * h + 9 * i;
        (ints as f64 + 10.0 * x + 11.0 * y) as Status
    }

    type Sums = extern "C" fn(u64, u64, u64, u64, u64, u64, u64, u64, u64, f64, f64) -> Status;

    #[test]
    fn a_thunk_passes_every_argument_and_the_result_through_and_is_the_same_each_time() {
        let real = sums as Sums as Ptr;
        let thunk = thunk_for(real).expect("a thunk");
        assert_eq!(thunk_for(real), Some(thunk), "the same function gets the same thunk");
        assert_ne!(thunk, real);
        // SAFETY: the thunk jumps to `sums`, whose signature this is.
        let via_thunk: Sums = unsafe { std::mem::transmute::<Ptr, Sums>(thunk) };
        let expected = sums(1, 2, 3, 4, 5, 6, 7, 8, 9, 0.5, 0.25);
        assert_eq!(via_thunk(1, 2, 3, 4, 5, 6, 7, 8, 9, 0.5, 0.25), expected);
        // Held, with nothing parked (the wait returns at once): the slow path saves and
        // restores every register the call needs.
        let _turn = crate::control::gate::TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
        set_held(true);
        let held_result = std::thread::spawn(move || {
            // Released from another thread while this one may be in the wait.
            via_thunk(1, 2, 3, 4, 5, 6, 7, 8, 9, 0.5, 0.25)
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        set_held(false);
        crate::control::gate::notify_waiters();
        assert_eq!(held_result.join().unwrap(), expected);
    }

    extern "C" fn minus(a: u64, b: u64) -> Status {
        (a as i64 - b as i64) as Status
    }

    type Minus = extern "C" fn(u64, u64) -> Status;

    #[test]
    fn each_thunk_jumps_to_its_own_function_the_last_one_too() {
        let other = thunk_for(minus as Minus as Ptr).expect("a thunk");
        // SAFETY: the thunk jumps to `minus`, whose signature this is.
        assert_eq!(unsafe { std::mem::transmute::<Ptr, Minus>(other) }(9, 4), 5);
        // The last thunk, the farthest from the common part: its index and its jump.
        x86_64::TARGETS[THUNKS - 1].store(minus as Minus as Ptr, Ordering::Release);
        let last = x86_64::thunk(THUNKS - 1);
        // SAFETY: as above; TARGETS[THUNKS - 1] is `minus`.
        assert_eq!(unsafe { std::mem::transmute::<Ptr, Minus>(last) }(20, 7), 13);
        x86_64::TARGETS[THUNKS - 1].store(std::ptr::null_mut(), Ordering::Release);
    }
}
