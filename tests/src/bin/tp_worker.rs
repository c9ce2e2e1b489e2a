//! One worker of a simulated tensor-parallel server: each worker holds its shard of the
//! model on its own GPU and, every step, allocates its activations there, then exchanges
//! a buffer with its peer as NCCL does between processes: VMM memory (`cuMemCreate`, POSIX
//! file descriptors) exported, passed over a unix socket, imported and mapped by the peer,
//! which reads what the owner wrote. A step ends when both workers are done with it, so
//! the pair moves in lockstep, as a collective makes it. It calls the driver through
//! `cudarc::driver::sys`, so it runs bare on simgpu and under the shim alike.
//!
//! ```text
//! tp_worker --rank 0|1 --device N --socket PATH [--base SIZE] [--burst SIZE]
//!           [--exchange SIZE] [--steps N] [--hold-ms MS]
//! ```
//!
//! Rank 0 listens on `--socket`, rank 1 connects to it. Output, one line each, flushed:
//! `READY`, then per step `STEP <i> ok` or `STEP <i> oom <CUDA error name>` (a step this
//! worker or its peer could not allocate is skipped by both), then
//! `DONE steps=<n> ok=<k> oom=<m>`, exit 0; `CORRUPT ...` (exit 4) when the peer's buffer
//! reads back wrong; `FAILED <what> <error>` (exit 3) for a failed set-up.

use std::ffi::c_void;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::exit;
use std::ptr::null_mut;
use std::time::Duration;

use cudarc::driver::sys::{self, CUresult};
use gpufrac_e2e::device_model::{check, error_name, say};

const USAGE: &str = "usage: tp_worker --rank 0|1 --device N --socket PATH [--base SIZE] [--burst SIZE] \
[--exchange SIZE] [--steps N] [--hold-ms MS]";

struct Args {
    rank: u32,
    device: i32,
    socket: String,
    base: u64,
    burst: u64,
    exchange: u64,
    steps: u32,
    hold: Duration,
}

fn size(name: &str, value: &str) -> u64 {
    gpufrac_common::size::parse_bytes(name, value).unwrap_or_else(|e| {
        eprintln!("tp_worker: {e}");
        exit(2)
    })
}

fn number<T: std::str::FromStr>(name: &str, value: &str) -> T {
    value.parse().unwrap_or_else(|_| {
        eprintln!("tp_worker: {name} {value:?} is not a number");
        exit(2)
    })
}

fn args() -> Args {
    let mut a = Args {
        rank: 2,
        device: -1,
        socket: String::new(),
        base: 256 << 20,
        burst: 1 << 30,
        exchange: 2 << 20,
        steps: 10,
        hold: Duration::from_millis(20),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let Some(value) = it.next() else {
            eprintln!("tp_worker: {flag} needs a value\n{USAGE}");
            exit(2)
        };
        match flag.as_str() {
            "--rank" => a.rank = number(&flag, &value),
            "--device" => a.device = number(&flag, &value),
            "--socket" => a.socket = value,
            "--base" => a.base = size(&flag, &value),
            "--burst" => a.burst = size(&flag, &value),
            "--exchange" => a.exchange = size(&flag, &value),
            "--steps" => a.steps = number(&flag, &value),
            "--hold-ms" => a.hold = Duration::from_millis(number(&flag, &value)),
            _ => {
                eprintln!("tp_worker: unknown option {flag}\n{USAGE}");
                exit(2)
            }
        }
    }
    if a.rank > 1 || a.device < 0 || a.socket.is_empty() {
        eprintln!("tp_worker: --rank 0|1, --device and --socket are needed\n{USAGE}");
        exit(2)
    }
    a
}

fn failed(what: &str, r: CUresult) -> ! {
    eprintln!("FAILED {what} {}", error_name(r));
    exit(3)
}

/// The pair's link: a unix socket that carries one-byte verdicts and file descriptors.
struct Link(UnixStream);

impl Link {
    fn open(a: &Args) -> Link {
        if a.rank == 0 {
            let _ = std::fs::remove_file(&a.socket);
            let listener = UnixListener::bind(&a.socket).unwrap_or_else(|e| {
                eprintln!("FAILED listen {e}");
                exit(3)
            });
            let (stream, _) = listener.accept().unwrap_or_else(|e| {
                eprintln!("FAILED accept {e}");
                exit(3)
            });
            return Link(stream);
        }
        for _ in 0..600 {
            if let Ok(stream) = UnixStream::connect(&a.socket) {
                return Link(stream);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("FAILED connect {}", a.socket);
        exit(3)
    }

    /// Sends this worker's verdict on a step and gets the peer's: both true, or the step
    /// is skipped by both.
    fn agree(&mut self, ok: bool) -> bool {
        let sent = self.0.write_all(&[ok as u8]);
        let mut peer = [0u8];
        if sent.is_err() || self.0.read_exact(&mut peer).is_err() {
            eprintln!("FAILED link the peer is gone");
            exit(3)
        }
        ok && peer[0] == 1
    }

    /// Sends `fd` with SCM_RIGHTS.
    fn send_fd(&mut self, fd: RawFd) {
        let mut byte = [1u8];
        let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
        // SAFETY: CMSG_SPACE of a constant size.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        let mut control = vec![0u8; space];
        // SAFETY: msghdr is plain data; every pointer set below outlives the sendmsg call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds one header and its data (CMSG_SPACE above).
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&msg);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<RawFd>(), fd);
        }
        // SAFETY: a connected socket and the message built above.
        if unsafe { libc::sendmsg(self.0.as_raw_fd(), &msg, 0) } != 1 {
            eprintln!("FAILED sendmsg {}", std::io::Error::last_os_error());
            exit(3)
        }
    }

    /// Receives a descriptor sent with [`Link::send_fd`].
    fn receive_fd(&mut self) -> OwnedFd {
        let mut byte = [0u8];
        let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
        // SAFETY: CMSG_SPACE of a constant size.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        let mut control = vec![0u8; space];
        // SAFETY: as in `send_fd`.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: a connected socket and buffers that outlive the call.
        if unsafe { libc::recvmsg(self.0.as_raw_fd(), &mut msg, 0) } != 1 {
            eprintln!("FAILED recvmsg {}", std::io::Error::last_os_error());
            exit(3)
        }
        // SAFETY: the kernel filled the control buffer; a header of SCM_RIGHTS carries a
        // descriptor now owned by this process.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&msg);
            if header.is_null() || (*header).cmsg_type != libc::SCM_RIGHTS {
                eprintln!("FAILED recvmsg no descriptor");
                exit(3)
            }
            OwnedFd::from_raw_fd(std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<RawFd>()))
        }
    }
}

fn prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is valid.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p
}

/// Maps `handle` (`size` bytes) at a new address, read-write from `device`.
fn map(handle: u64, size: usize, device: i32) -> Result<u64, CUresult> {
    let mut va = 0u64;
    // SAFETY: valid out-pointers and a handle the driver gave.
    unsafe {
        check(sys::cuMemAddressReserve(&mut va, size, 0, 0, 0))?;
        check(sys::cuMemMap(va, size, 0, handle, 0))?;
        let access = sys::CUmemAccessDesc {
            location: prop(device).location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        check(sys::cuMemSetAccess(va, size, &access, 1))?;
    }
    Ok(va)
}

fn unmap(va: u64, size: usize, handle: u64) {
    // SAFETY: a mapping and handle made by `map` and `cuMemCreate`/import, undone once.
    unsafe {
        sys::cuMemUnmap(va, size);
        sys::cuMemAddressFree(va, size);
        sys::cuMemRelease(handle);
    }
}

/// The words of a step's exchange buffer: the owner's rank and step in each.
fn word(rank: u32, step: u32) -> u32 {
    0x7000_0000 | (rank << 16) | step
}

/// One step's exchange: this worker's buffer filled and sent, the peer's received, mapped
/// and checked. False if this worker could not make its buffer (out of memory).
fn exchange(a: &Args, link: &mut Link, step: u32) -> bool {
    let size = a.exchange as usize;
    let mut handle = 0u64;
    // SAFETY: a valid out-pointer and property.
    let made = unsafe { sys::cuMemCreate(&mut handle, size, &prop(a.device), 0) };
    let mine = check(made).and_then(|()| map(handle, size, a.device).map(|va| (va, handle)));
    if !link.agree(mine.is_ok()) {
        if let Ok((va, handle)) = mine {
            unmap(va, size, handle);
        }
        return false;
    }
    let (va, handle) = mine.unwrap_or_else(|r| failed("exchange", r));
    let words = vec![word(a.rank, step); size / 4];
    let mut fd: RawFd = -1;
    // SAFETY: a host buffer of `size` bytes; a valid out-pointer for the descriptor.
    unsafe {
        check(sys::cuMemcpyHtoD_v2(va, words.as_ptr().cast(), size)).unwrap_or_else(|r| failed("fill", r));
        check(sys::cuMemExportToShareableHandle(
            (&mut fd as *mut RawFd).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        ))
        .unwrap_or_else(|r| failed("export", r));
    }
    // SAFETY: the driver handed this process the descriptor to own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // Rank 0 sends first, so that the two never both wait to receive.
    let peers = if a.rank == 0 {
        link.send_fd(fd.as_raw_fd());
        link.receive_fd()
    } else {
        let peers = link.receive_fd();
        link.send_fd(fd.as_raw_fd());
        peers
    };
    drop(fd);
    let mut imported = 0u64;
    // SAFETY: the descriptor is passed as the driver's POSIX handle (an integer in a
    // pointer); a valid out-pointer.
    let status = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut imported,
            peers.as_raw_fd() as usize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    check(status).unwrap_or_else(|r| failed("import", r));
    drop(peers);
    let theirs = map(imported, size, a.device).unwrap_or_else(|r| failed("map the peer's buffer", r));
    let mut seen = vec![0u32; size / 4];
    // SAFETY: `seen` holds `size` bytes.
    unsafe { check(sys::cuMemcpyDtoH_v2(seen.as_mut_ptr().cast(), theirs, size)) }
        .unwrap_or_else(|r| failed("read the peer's buffer", r));
    let expected = word(1 - a.rank, step);
    if let Some(at) = seen.iter().position(|&w| w != expected) {
        eprintln!(
            "CORRUPT step {step}: word {at} of the peer's buffer is {:#x}, not {expected:#x}",
            seen[at]
        );
        exit(4)
    }
    // Both have read what the other wrote before either lets its buffer go.
    link.agree(true);
    unmap(theirs, size, imported);
    unmap(va, size, handle);
    true
}

fn main() {
    let a = args();
    // SAFETY: every call gets valid out-pointers and handles the driver gave.
    unsafe {
        check(sys::cuInit(0)).unwrap_or_else(|r| failed("init", r));
        let mut dev = 0;
        check(sys::cuDeviceGet(&mut dev, a.device)).unwrap_or_else(|r| failed("device", r));
        let mut ctx = null_mut();
        check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)).unwrap_or_else(|r| failed("context", r));
        check(sys::cuCtxSetCurrent(ctx)).unwrap_or_else(|r| failed("context", r));
    }
    let mut base = 0u64;
    // SAFETY: a valid out-pointer.
    check(unsafe { sys::cuMemAlloc_v2(&mut base, a.base as usize) }).unwrap_or_else(|r| failed("base", r));
    let mut link = Link::open(&a);
    say("READY");
    let (mut ok, mut oom) = (0, 0);
    for step in 0..a.steps {
        let mut activations = 0u64;
        // SAFETY: a valid out-pointer.
        let got = check(unsafe { sys::cuMemAlloc_v2(&mut activations, a.burst as usize) });
        let both = link.agree(got.is_ok());
        let done = both && exchange(&a, &mut link, step);
        if done {
            std::thread::sleep(a.hold);
            // The step's collective: both finished it before either frees its memory.
            link.agree(true);
        }
        if got.is_ok() {
            // SAFETY: allocated above, freed once.
            unsafe { sys::cuMemFree_v2(activations) };
        }
        match (done, got) {
            (true, _) => {
                ok += 1;
                say(&format!("STEP {step} ok"));
            }
            (false, Err(r)) => {
                oom += 1;
                say(&format!("STEP {step} oom {}", error_name(r)));
            }
            (false, Ok(())) => {
                oom += 1;
                say(&format!("STEP {step} oom the peer's"));
            }
        }
    }
    // SAFETY: allocated above, freed once.
    unsafe { sys::cuMemFree_v2(base) };
    say(&format!("DONE steps={} ok={ok} oom={oom}", a.steps));
}
