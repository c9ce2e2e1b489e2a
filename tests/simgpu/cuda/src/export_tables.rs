//! `cuGetExportTable`: the driver's private tables, which NVIDIA's CUDA runtime
//! (`libcudart`, and every framework that links it) asks for by UUID before anything else.
//!
//! The tables are undocumented. What is written here comes from public interoperability
//! work (ZLUDA's "dark API" notes name the tables and several slots) and from running
//! `libcudart` 12.9 (PyPI `nvidia-cuda-runtime-cu12` 12.9.79) against simgpu, logging
//! every table it asked for, every slot it called and the arguments it passed: each slot
//! below says what is known of it and how the runtime was seen to use it. No NVIDIA code
//! was read or disassembled. The same tables serve libcudart 12.8 (PyTorch 2.9's) and
//! CuPy's static copy of 12.9.
//!
//! A table is an array of pointer-sized slots. In most tables slot 0 holds the table's
//! size in bytes and the others are functions; the context-local-storage table has no
//! size slot. A slot nobody has seen called answers `CUDA_ERROR_NOT_SUPPORTED` and says
//! once on stderr which table and slot the runtime called, so the next gap shows itself
//! by running, not by guessing. A table nobody has described answers
//! `CUDA_ERROR_NOT_FOUND`, logged once per UUID.
//!
//! What libcudart 12.9 does with them, in order, on its first call (`cudaFree(0)`):
//! 1. asks for `f8cff951-…`; refused (NOT_FOUND), it carries on as if it were granted;
//! 2. asks for the runtime interface and the tools callback hooks, gets the callback
//!    buffers (hooks slots 2 and 6) and, per device, the primary context's handle
//!    (interface slot 2);
//! 3. asks for the tools TLS, context-local-storage and context-check tables (it cannot
//!    start without them) and calls context-check slot 3;
//! 4. asks for the integrity table and calls its slot 1 three times; the third answer
//!    must be the keyed hash below, or every runtime call fails with
//!    `cudaErrorSoftwareValidityNotEstablished` ("integrity checks failed");
//! 5. on each context it uses: looks up its state in context-local storage (slot 2),
//!    checks the context (context-check slot 2), stores its state (slot 0) and removes it
//!    at exit (slot 1).

use std::cell::UnsafeCell;
use std::collections::HashSet;
use std::ffi::{c_int, c_uint, c_void};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::LazyLock;

use cudarc::driver::sys::{CUcontext, CUdevice, CUdevice_attribute as A, CUuuid};
use parking_lot::Mutex;

use crate::context;
use crate::driver::{self, DRIVER_VERSION};
use crate::ffi::{guard, read_in, write_out, CUresult, CuResult};

/// One slot of a table: its size (slot 0 of most tables) or a function.
#[derive(Clone, Copy)]
#[repr(C)]
union Slot {
    size: usize,
    function: *const c_void,
}

/// A table as the runtime reads it: `N` pointer-sized slots.
#[repr(C)]
struct Table<const N: usize>([Slot; N]);

// SAFETY: the tables are immutable after compilation; they hold sizes and addresses of
// functions, which any thread may read.
unsafe impl<const N: usize> Sync for Table<N> {}

impl<const N: usize> Table<N> {
    fn start(&'static self) -> *const c_void {
        self.0.as_ptr().cast()
    }
}

/// Slot 0 of the tables that have one: the table's size in bytes.
const fn size_of_table(slots: usize) -> Slot {
    Slot { size: slots * std::mem::size_of::<Slot>() }
}

const fn function(f: *const c_void) -> Slot {
    Slot { function: f }
}

/// Says once on stderr that the runtime called a slot simgpu does not know.
fn report_unknown(table: &str, slot: usize, reported: &AtomicBool) {
    if !reported.swap(true, Ordering::Relaxed) {
        let _ = writeln!(
            std::io::stderr(),
            "simgpu: the CUDA runtime called slot {slot} of the private table {table}, which simgpu \
             does not implement; it answers CUDA_ERROR_NOT_SUPPORTED"
        );
    }
}

/// A slot whose meaning is unknown: `CUDA_ERROR_NOT_SUPPORTED`, logged once. Its
/// arguments, whatever they are, are left alone (the C calling convention lets a callee
/// ignore arguments it does not declare).
macro_rules! unknown {
    ($table:literal, $slot:literal) => {{
        extern "C" fn unknown_slot() -> CUresult {
            static REPORTED: AtomicBool = AtomicBool::new(false);
            report_unknown($table, $slot, &REPORTED);
            CUresult::CUDA_ERROR_NOT_SUPPORTED
        }
        function(unknown_slot as *const c_void)
    }};
}

// ---------------------------------------------------------------------------------------
// 6bd5fb6c-5bf4-e74a-8987-d93912fd9df9: the runtime interface ("CUDART_INTERFACE").
// ---------------------------------------------------------------------------------------

const CUDART_INTERFACE_ID: [u8; 16] =
    uuid(0x6bd5fb6c, 0x5bf4, 0xe74a, [0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9]);

static CUDART_INTERFACE: Table<10> = Table([
    // 0: the table's size.
    size_of_table(10),
    // 1: loads a module from a fat binary the runtime registered (`__cudaRegisterFatBinary`
    //    of a program's kernels): (CUmodule *out, const fatbin wrapper *). simgpu runs no
    //    compiled kernels; the memory, stream and event parts of the runtime never call it.
    unknown!("6bd5fb6c (runtime interface)", 1),
    // 2: (CUcontext *out, CUdevice): the handle of the device's primary context, without
    //    retaining it. Called once per device when the runtime starts; the runtime then
    //    makes the handle current and retains it itself (cuDevicePrimaryCtxRetain).
    function(primary_context as *const c_void),
    // 3-5: never seen called.
    unknown!("6bd5fb6c (runtime interface)", 3),
    unknown!("6bd5fb6c (runtime interface)", 4),
    unknown!("6bd5fb6c (runtime interface)", 5),
    // 6: another form of slot 1 (module from a fat binary, three more arguments).
    unknown!("6bd5fb6c (runtime interface)", 6),
    // 7: one pointer-sized argument; never seen called.
    unknown!("6bd5fb6c (runtime interface)", 7),
    // 8: another form of slot 1 (fat binary header first, module out second).
    unknown!("6bd5fb6c (runtime interface)", 8),
    // 9: never seen called.
    unknown!("6bd5fb6c (runtime interface)", 9),
]);

extern "C" fn primary_context(out: *mut CUcontext, device: CUdevice) -> CUresult {
    guard(|| write_out(out, context::primary_handle(device)? as CUcontext))
}

// ---------------------------------------------------------------------------------------
// a094798c-2e74-2e74-93f2-0800200c0a66: tools runtime callback hooks.
// ---------------------------------------------------------------------------------------

const CALLBACK_HOOKS_ID: [u8; 16] =
    uuid(0xa094798c, 0x2e74, 0x2e74, [0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66]);

static CALLBACK_HOOKS: Table<7> = Table([
    // 0: the table's size.
    size_of_table(7),
    // 1, 3-5: never seen called.
    unknown!("a094798c (tools callback hooks)", 1),
    // 2: (void **buffer, size_t *size): a zeroed buffer through which profiling tools
    //    hook the runtime's callbacks; zero means no tool. Called once at start.
    function(callback_buffer_1 as *const c_void),
    unknown!("a094798c (tools callback hooks)", 3),
    unknown!("a094798c (tools callback hooks)", 4),
    unknown!("a094798c (tools callback hooks)", 5),
    // 6: (void **buffer, size_t *size): a second, small zeroed buffer of the same kind.
    function(callback_buffer_2 as *const c_void),
]);

/// Zeroed memory lent to the runtime for as long as the process lives.
struct Buffer<const N: usize>(UnsafeCell<[u64; N]>);

// SAFETY: simgpu never reads or writes the buffer; it only hands out its address, and the
// runtime synchronises its own use of it.
unsafe impl<const N: usize> Sync for Buffer<N> {}

/// Sizes reported for the two buffers, in bytes (the runtime accepts these; the memory
/// behind them is larger, in case it counts in other units).
const BUFFER_1_SIZE: usize = 1024;
const BUFFER_2_SIZE: usize = 14;
static BUFFER_1: Buffer<1024> = Buffer(UnsafeCell::new([0; 1024]));
static BUFFER_2: Buffer<8> = Buffer(UnsafeCell::new([0; 8]));

extern "C" fn callback_buffer_1(buffer: *mut *mut c_void, size: *mut usize) {
    lend(buffer, size, BUFFER_1.0.get().cast(), BUFFER_1_SIZE);
}

extern "C" fn callback_buffer_2(buffer: *mut *mut c_void, size: *mut usize) {
    lend(buffer, size, BUFFER_2.0.get().cast(), BUFFER_2_SIZE);
}

fn lend(buffer: *mut *mut c_void, size: *mut usize, memory: *mut c_void, bytes: usize) {
    let _ = write_out(buffer, memory);
    let _ = write_out(size, bytes);
}

// ---------------------------------------------------------------------------------------
// 42d85a81-23f6-cb47-8298-f6e78a3aecdc: tools thread-local storage.
// ---------------------------------------------------------------------------------------

const TOOLS_TLS_ID: [u8; 16] =
    uuid(0x42d85a81, 0x23f6, 0xcb47, [0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc]);

/// The runtime refuses to start without this table (`cudaFree(0)` fails with "named
/// symbol not found"), but never calls a slot of it.
static TOOLS_TLS: Table<4> = Table([
    // 0: the table's size.
    size_of_table(4),
    // 1-3: never seen called.
    unknown!("42d85a81 (tools TLS)", 1),
    unknown!("42d85a81 (tools TLS)", 2),
    unknown!("42d85a81 (tools TLS)", 3),
]);

// ---------------------------------------------------------------------------------------
// c693336e-1121-df11-a8c3-68f355d89593: context-local storage, where the runtime keeps
// its state for each context. No size slot: slot 0 is a function.
// ---------------------------------------------------------------------------------------

const CONTEXT_STORAGE_ID: [u8; 16] =
    uuid(0xc693336e, 0x1121, 0xdf11, [0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93]);

static CONTEXT_STORAGE: Table<4> = Table([
    // 0: (CUcontext ctx or NULL for the current one, void *key, void *value,
    //    void (*destroyed)(CUcontext, void *key, void *value)): stores the runtime's state
    //    for a context; `destroyed` is called when the context goes (primary context reset
    //    or release, cuCtxDestroy).
    function(storage_put as *const c_void),
    // 1: (CUcontext ctx, void *key): forgets the value; called at exit.
    function(storage_delete as *const c_void),
    // 2: (void **value, CUcontext ctx or NULL, void *key): the stored value; an error when
    //    there is none, after which the runtime sets the context up and stores its state.
    function(storage_get as *const c_void),
    // 3: never seen called.
    unknown!("c693336e (context-local storage)", 3),
]);

/// A context's destruction callback, as the runtime registers it.
type Destroyed = Option<unsafe extern "C" fn(CUcontext, *mut c_void, *mut c_void)>;

#[derive(Clone, Copy)]
struct Stored {
    context: usize,
    key: usize,
    value: usize,
    destroyed: Destroyed,
}

/// Every value the runtime stored, few (one per context and key).
static STORAGE: LazyLock<Mutex<Vec<Stored>>> = LazyLock::new(Default::default);

/// The context a storage call names: `ctx`, or the current one when it is NULL.
fn storage_context(ctx: CUcontext) -> CuResult<usize> {
    if ctx.is_null() {
        Ok(context::current()?.handle())
    } else {
        Ok(ctx as usize)
    }
}

extern "C" fn storage_put(
    ctx: CUcontext,
    key: *mut c_void,
    value: *mut c_void,
    destroyed: Destroyed,
) -> CUresult {
    guard(|| {
        let context = storage_context(ctx)?;
        let (key, value) = (key as usize, value as usize);
        let mut storage = STORAGE.lock();
        match storage.iter_mut().find(|s| s.context == context && s.key == key) {
            Some(s) => {
                s.value = value;
                s.destroyed = destroyed;
            }
            None => storage.push(Stored { context, key, value, destroyed }),
        }
        Ok(())
    })
}

extern "C" fn storage_delete(ctx: CUcontext, key: *mut c_void) -> CUresult {
    guard(|| {
        let context = storage_context(ctx)?;
        STORAGE.lock().retain(|s| !(s.context == context && s.key == key as usize));
        Ok(())
    })
}

extern "C" fn storage_get(value: *mut *mut c_void, ctx: CUcontext, key: *mut c_void) -> CUresult {
    guard(|| {
        let context = storage_context(ctx)?;
        let found =
            STORAGE.lock().iter().find(|s| s.context == context && s.key == key as usize).map(|s| s.value);
        match found {
            Some(v) => write_out(value, v as *mut c_void),
            None => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        }
    })
}

/// Called by the context module as a context goes, before its memory and streams: runs
/// the runtime's destruction callbacks for the values stored on it and forgets them, so
/// that a context created later under the same handle (a primary context after a reset)
/// starts without the old state.
pub(crate) fn context_destroyed(handle: usize) {
    let gone: Vec<Stored> = {
        let mut storage = STORAGE.lock();
        let (gone, kept) = storage.drain(..).partition(|s| s.context == handle);
        *storage = kept;
        gone
    };
    for s in gone {
        if let Some(callback) = s.destroyed {
            // SAFETY: the runtime registered this callback for this context, key and
            // value, to be called once when the context is destroyed; it is.
            unsafe { callback(handle as CUcontext, s.key as *mut c_void, s.value as *mut c_void) };
        }
    }
}

// ---------------------------------------------------------------------------------------
// 263e8860-7cd2-6143-92f6-bbd5006dfa7e: context checks.
// ---------------------------------------------------------------------------------------

const CONTEXT_CHECKS_ID: [u8; 16] =
    uuid(0x263e8860, 0x7cd2, 0x6143, [0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e]);

static CONTEXT_CHECKS: Table<4> = Table([
    // 0: the table's size.
    size_of_table(4),
    // 1: never seen called.
    unknown!("263e8860 (context checks)", 1),
    // 2: (CUcontext, unsigned *flags, void **detail): called when the runtime first uses a
    //    context; flags 0 and no detail let it go on (no other answer is known).
    function(context_check as *const c_void),
    // 3: called once at start with pointers to the caller's stack; writes nothing and
    //    returns 0.
    function(start_check as *const c_void),
]);

extern "C" fn context_check(_ctx: CUcontext, flags: *mut c_uint, detail: *mut *const c_void) -> CUresult {
    guard(|| {
        write_out(flags, 0)?;
        if !detail.is_null() {
            write_out(detail, std::ptr::null())?;
        }
        Ok(())
    })
}

extern "C" fn start_check() -> c_uint {
    0
}

// ---------------------------------------------------------------------------------------
// d4082055-bde6-704b-8d34-ba123c66e1f2: the integrity check.
// ---------------------------------------------------------------------------------------

const INTEGRITY_ID: [u8; 16] =
    uuid(0xd4082055, 0xbde6, 0x704b, [0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2]);

static INTEGRITY: Table<3> = Table([
    // 0: the table's size.
    size_of_table(3),
    // 1: (unsigned version, uint64_t unix_seconds, uint64_t out[2]): see `integrity`.
    function(integrity as *const c_void),
    // 2: never seen called.
    unknown!("d4082055 (integrity check)", 2),
]);

/// The integrity check. libcudart 12.9 calls it three times as it starts, with its version
/// plus 0, 1 and 2 (12090, 12091, 12092) and the current time, and compares the third
/// answer with its own computation: HMAC-MD2 (RFC 2104 over RFC 1319) under a fixed key
/// of the driver version, the runtime's version, the process and thread, the addresses of
/// the runtime interface, of this table and of this function, the time, and each device's
/// UUID and PCI domain, bus and device numbers. The first two answers are not checked;
/// they get the same computation.
extern "C" fn integrity(version: c_uint, unix_seconds: u64, out: *mut [u64; 2]) -> CUresult {
    guard(|| {
        let mut message = Vec::with_capacity(48 + 28);
        message.extend_from_slice(&(DRIVER_VERSION as u32).to_ne_bytes());
        message.extend_from_slice(&version.to_ne_bytes());
        message.extend_from_slice(&std::process::id().to_ne_bytes());
        // SAFETY: pthread_self has no preconditions.
        let thread = unsafe { libc::pthread_self() } as u32;
        message.extend_from_slice(&thread.to_ne_bytes());
        for address in [CUDART_INTERFACE.start(), INTEGRITY.start(), integrity as *const c_void] {
            message.extend_from_slice(&(address as usize as u64).to_ne_bytes());
        }
        message.extend_from_slice(&unix_seconds.to_ne_bytes());
        let mut count: c_int = 0;
        driver::device_get_count(&mut count)?;
        for device in 0..count {
            let mut uuid = CUuuid { bytes: [0; 16] };
            driver::device_get_uuid(&mut uuid, device)?;
            message.extend(uuid.bytes.iter().map(|&b| b as u8));
            for attribute in [
                A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
                A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
                A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
            ] {
                let mut value: c_int = 0;
                driver::device_get_attribute(&mut value, attribute as c_int, device)?;
                message.extend_from_slice(&value.to_ne_bytes());
            }
        }
        let digest = hmac_md2(&INTEGRITY_KEY, &message);
        let half =
            |range: std::ops::Range<usize>| u64::from_ne_bytes(digest[range].try_into().unwrap_or_default());
        write_out(out, [half(0..8), half(8..16)])
    })
}

/// The key of the integrity check's HMAC.
const INTEGRITY_KEY: [u8; 16] =
    [0x14, 0x6a, 0xdd, 0xae, 0x53, 0xa9, 0xa7, 0x52, 0xaa, 0x08, 0x41, 0x36, 0x0b, 0xf5, 0x5a, 0x9f];

/// HMAC (RFC 2104) over MD2, whose block is 16 bytes: a 16-byte key is used as it is.
fn hmac_md2(key: &[u8; 16], message: &[u8]) -> [u8; 16] {
    let mut inner = Md2::default();
    inner.update(&key.map(|b| b ^ 0x36));
    inner.update(message);
    let inner = inner.finish();
    let mut outer = Md2::default();
    outer.update(&key.map(|b| b ^ 0x5c));
    outer.update(&inner);
    outer.finish()
}

/// MD2 (RFC 1319).
struct Md2 {
    /// The 48-byte state: the digest so far, the block, and their sum.
    state: [u8; 48],
    checksum: [u8; 16],
    block: [u8; 16],
    filled: usize,
}

/// RFC 1319's permutation of 0..=255, from the digits of pi.
const PI_SUBST: [u8; 256] = [
    41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199, 115, 140,
    152, 147, 43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66, 111, 24, 138, 23, 229,
    18, 190, 78, 196, 214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47, 238, 122, 169, 104, 121, 145, 21,
    178, 7, 63, 148, 194, 16, 137, 11, 34, 95, 33, 128, 127, 93, 154, 90, 144, 50, 39, 53, 62, 204, 231, 191,
    247, 151, 3, 255, 25, 48, 179, 72, 165, 181, 209, 215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210,
    150, 164, 125, 182, 118, 252, 107, 226, 156, 116, 4, 241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91,
    207, 101, 230, 45, 168, 2, 27, 96, 37, 173, 174, 176, 185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71,
    163, 35, 221, 81, 175, 58, 195, 92, 249, 206, 186, 197, 234, 38, 44, 83, 13, 110, 133, 40, 132, 9, 211,
    223, 205, 244, 65, 129, 77, 82, 106, 220, 55, 200, 108, 193, 171, 250, 36, 225, 123, 8, 12, 189, 177, 74,
    120, 136, 149, 139, 227, 99, 232, 109, 233, 203, 213, 254, 59, 0, 29, 57, 242, 239, 183, 14, 102, 88,
    208, 228, 166, 119, 114, 248, 235, 117, 75, 10, 49, 68, 80, 180, 143, 237, 31, 26, 219, 153, 141, 51,
    159, 17, 131, 20,
];

impl Default for Md2 {
    fn default() -> Md2 {
        Md2 { state: [0; 48], checksum: [0; 16], block: [0; 16], filled: 0 }
    }
}

impl Md2 {
    fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = (16 - self.filled).min(bytes.len());
            self.block[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == 16 {
                let block = self.block;
                self.compress(&block);
                self.filled = 0;
            }
        }
    }

    /// Processes one block: the checksum, then 18 rounds over the state.
    fn compress(&mut self, block: &[u8; 16]) {
        let mut last = self.checksum[15];
        for (j, &b) in block.iter().enumerate() {
            self.checksum[j] ^= PI_SUBST[(b ^ last) as usize];
            last = self.checksum[j];
            self.state[16 + j] = b;
            self.state[32 + j] = b ^ self.state[j];
        }
        let mut t = 0u8;
        for round in 0..18u8 {
            for x in self.state.iter_mut() {
                *x ^= PI_SUBST[t as usize];
                t = *x;
            }
            t = t.wrapping_add(round);
        }
    }

    fn finish(mut self) -> [u8; 16] {
        let pad = 16 - self.filled;
        self.update(&vec![pad as u8; pad]);
        let checksum = self.checksum;
        self.compress(&checksum);
        let mut digest = [0; 16];
        digest.copy_from_slice(&self.state[..16]);
        digest
    }
}

// ---------------------------------------------------------------------------------------
// The lookup.
// ---------------------------------------------------------------------------------------

/// f8cff951-2146-8b4e-b9e2-fb469e7c0dd9: asked for first, before `cuInit`. Refused, the
/// runtime (12.9) carries on unchanged, so simgpu refuses it without a word. Nothing is
/// known of its slots; granting it a table of unknown slots makes the runtime give up
/// with "driver version is insufficient".
const REFUSED_QUIETLY_ID: [u8; 16] =
    uuid(0xf8cff951, 0x2146, 0x8b4e, [0xb9, 0xe2, 0xfb, 0x46, 0x9e, 0x7c, 0x0d, 0xd9]);

/// A UUID's 16 bytes in memory order, from its usual written form.
const fn uuid(a: u32, b: u16, c: u16, d: [u8; 8]) -> [u8; 16] {
    let (a, b, c) = (a.to_be_bytes(), b.to_be_bytes(), c.to_be_bytes());
    [a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]
}

fn table(id: &[u8; 16]) -> Option<*const c_void> {
    Some(match *id {
        CUDART_INTERFACE_ID => CUDART_INTERFACE.start(),
        CALLBACK_HOOKS_ID => CALLBACK_HOOKS.start(),
        TOOLS_TLS_ID => TOOLS_TLS.start(),
        CONTEXT_STORAGE_ID => CONTEXT_STORAGE.start(),
        CONTEXT_CHECKS_ID => CONTEXT_CHECKS.start(),
        INTEGRITY_ID => INTEGRITY.start(),
        _ => return None,
    })
}

/// `cuGetExportTable(const void **table, const CUuuid *id)`.
pub(crate) fn get_export_table(out: *mut *const c_void, id: *const CUuuid) -> CuResult {
    let id = read_in(id)?.bytes.map(|b| b as u8);
    match table(&id) {
        Some(start) => write_out(out, start),
        None => {
            write_out(out, std::ptr::null())?;
            if id != REFUSED_QUIETLY_ID {
                static REPORTED: LazyLock<Mutex<HashSet<[u8; 16]>>> = LazyLock::new(Default::default);
                if REPORTED.lock().insert(id) {
                    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
                    let _ = writeln!(
                        std::io::stderr(),
                        "simgpu: cuGetExportTable asked for the private table {hex}, which simgpu does \
                         not implement; it answers CUDA_ERROR_NOT_FOUND"
                    );
                }
            }
            Err(CUresult::CUDA_ERROR_NOT_FOUND)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn md2(data: &[u8]) -> String {
        let mut m = Md2::default();
        m.update(data);
        hex(&m.finish())
    }

    #[test]
    fn md2_answers_the_rfc_1319_test_suite() {
        assert_eq!(md2(b""), "8350e5a3e24c153df2275c9f80692773");
        assert_eq!(md2(b"a"), "32ec01ec4a6dac72c0ab96fb34c0b5d1");
        assert_eq!(md2(b"abc"), "da853b0d3f88d99b30283a69e6ded6bb");
        assert_eq!(md2(b"message digest"), "ab4f496bfb2a530b219ff33031fe06b0");
        assert_eq!(md2(b"abcdefghijklmnopqrstuvwxyz"), "4e8ddff3650292ab5a4108c3aa47940b");
        let digits: Vec<u8> = (0..8).flat_map(|_| *b"1234567890").collect();
        assert_eq!(md2(&digits), "d5976f79d83d3a0dc9806c3c66f3efd8");
        // Fed in pieces across block boundaries, the same digest.
        let mut m = Md2::default();
        for piece in digits.chunks(7) {
            m.update(piece);
        }
        assert_eq!(hex(&m.finish()), "d5976f79d83d3a0dc9806c3c66f3efd8");
    }

    #[test]
    fn uuids_are_in_memory_order() {
        assert_eq!(hex(&CUDART_INTERFACE_ID), "6bd5fb6c5bf4e74a8987d93912fd9df9");
        assert_eq!(hex(&CALLBACK_HOOKS_ID), "a094798c2e742e7493f20800200c0a66");
        assert_eq!(hex(&REFUSED_QUIETLY_ID), "f8cff95121468b4eb9e2fb469e7c0dd9");
    }

    #[test]
    fn tables_that_have_a_size_slot_say_their_size() {
        // SAFETY: slot 0 of these tables is written as a size.
        let size = |t: *const c_void| unsafe { (*t.cast::<Slot>()).size };
        assert_eq!(size(CUDART_INTERFACE.start()), 80);
        assert_eq!(size(CALLBACK_HOOKS.start()), 56);
        assert_eq!(size(TOOLS_TLS.start()), 32);
        assert_eq!(size(CONTEXT_CHECKS.start()), 32);
        assert_eq!(size(INTEGRITY.start()), 24);
    }

    #[test]
    fn unknown_slots_answer_not_supported() {
        for (table, slot) in [(CUDART_INTERFACE.start(), 3), (TOOLS_TLS.start(), 1), (INTEGRITY.start(), 2)] {
            // SAFETY: these slots hold `unknown!` functions, which take no arguments.
            let f: extern "C" fn() -> CUresult =
                unsafe { std::mem::transmute((*table.cast::<Slot>().add(slot)).function) };
            assert_eq!(f(), CUresult::CUDA_ERROR_NOT_SUPPORTED);
            assert_eq!(f(), CUresult::CUDA_ERROR_NOT_SUPPORTED, "the second call answers the same");
        }
    }

    static DESTROYED: Mutex<Vec<(usize, usize, usize)>> = Mutex::new(Vec::new());

    unsafe extern "C" fn record_destroyed(ctx: CUcontext, key: *mut c_void, value: *mut c_void) {
        DESTROYED.lock().push((ctx as usize, key as usize, value as usize));
    }

    #[test]
    fn context_storage_keeps_a_value_per_context_and_key_until_the_context_goes() {
        let (ctx, other) = (0x7000_0010 as CUcontext, 0x7000_0020 as CUcontext);
        let (key, value) = (0x10 as *mut c_void, 0x1234 as *mut c_void);
        let mut got = std::ptr::null_mut();
        assert_eq!(storage_get(&mut got, ctx, key), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(storage_put(ctx, key, value, Some(record_destroyed)), CUresult::CUDA_SUCCESS);
        assert_eq!(storage_put(other, key, 0x99 as *mut c_void, None), CUresult::CUDA_SUCCESS);
        assert_eq!(storage_get(&mut got, ctx, key), CUresult::CUDA_SUCCESS);
        assert_eq!(got, value);
        assert_eq!(storage_get(&mut got, ctx, 0x20 as *mut c_void), CUresult::CUDA_ERROR_INVALID_VALUE);
        // The context goes: its destructor runs once with its value, the other context keeps
        // its own.
        context_destroyed(ctx as usize);
        context_destroyed(ctx as usize);
        assert_eq!(*DESTROYED.lock(), [(ctx as usize, key as usize, value as usize)]);
        assert_eq!(storage_get(&mut got, ctx, key), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(storage_get(&mut got, other, key), CUresult::CUDA_SUCCESS);
        assert_eq!(storage_delete(other, key), CUresult::CUDA_SUCCESS);
        assert_eq!(storage_get(&mut got, other, key), CUresult::CUDA_ERROR_INVALID_VALUE);
    }

    #[test]
    fn unknown_tables_are_refused() {
        let mut out = std::ptr::dangling::<c_void>();
        let id = CUuuid { bytes: [7; 16] };
        assert_eq!(get_export_table(&mut out, &id), Err(CUresult::CUDA_ERROR_NOT_FOUND));
        assert!(out.is_null());
        let id = CUuuid { bytes: REFUSED_QUIETLY_ID.map(|b| b as _) };
        assert_eq!(get_export_table(&mut out, &id), Err(CUresult::CUDA_ERROR_NOT_FOUND));
        let id = CUuuid { bytes: INTEGRITY_ID.map(|b| b as _) };
        assert_eq!(get_export_table(&mut out, &id), Ok(()));
        assert_eq!(out, INTEGRITY.start());
    }
}
