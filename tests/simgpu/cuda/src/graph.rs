//! Stream capture, CUDA graphs and the per-device graph memory pool, as the real driver
//! has them.
//!
//! While a stream captures, the work queued on it (kernels, copies, sets, stream-ordered
//! allocations and frees) is recorded as graph nodes instead of run. An allocation node
//! gets its address at capture time: a range reserved for the graph (an anonymous
//! mapping that takes no memory until touched), backed by device memory only while the
//! allocation lives in a launched graph. A launched graph runs its nodes in order on the
//! launch stream, asynchronously, as a stream runs queued work.
//!
//! The graph memory pool (one per device in the process) is what backs graph
//! allocations. Launching or uploading a graph reserves, charged to the device, what its
//! allocation nodes need beyond what the pool already holds; memory a free node gives
//! back stays reserved in the pool for later launches of any graph, until
//! `cuDeviceGraphMemTrim` or the device's last context goes away. A graph's footprint is
//! the sum of its allocation sizes (simgpu does not overlap allocations of one graph
//! whose lifetimes are disjoint, which the real driver may).

use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::thread::ThreadId;

use cudarc::driver::sys::{
    CUdevice, CUdeviceptr, CUgraph, CUgraphExec, CUgraphNode, CUstream, CUDA_GRAPH_INSTANTIATE_PARAMS,
    CUDA_MEM_ALLOC_NODE_PARAMS,
};
use parking_lot::{Condvar, Mutex};

use crate::driver::{device_index, driver};
use crate::ffi::{read_in, write_out, CUresult, CuResult};
use crate::memory::{map_anonymous, release_allocation, round_up, Allocation, Kind, ALLOC_ALIGN, REGISTRY};
use crate::stream::{self, DefaultStream, Stream};

/// Work a graph node does when it runs; a graph may run many times.
pub(crate) type Task = Arc<dyn Fn() -> CuResult + Send + Sync>;

/// `CUgraphNodeType` values of the nodes capture records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum NodeType {
    Kernel = 0,
    Memcpy = 1,
    Memset = 2,
    MemAlloc = 10,
    MemFree = 11,
}

/// `CUstreamCaptureMode`.
pub(crate) const MODE_GLOBAL: c_uint = 0;
pub(crate) const MODE_RELAXED: c_uint = 2;

/// `CUstreamCaptureStatus`.
const STATUS_NONE: c_uint = 0;
const STATUS_ACTIVE: c_uint = 1;
const STATUS_INVALIDATED: c_uint = 2;

/// `CUgraphInstantiate_flags`.
const FLAG_AUTO_FREE_ON_LAUNCH: u64 = 1;
const FLAG_UPLOAD: u64 = 2;
const FLAG_DEVICE_LAUNCH: u64 = 4;
const FLAG_USE_NODE_PRIORITY: u64 = 8;

/// An address range reserved for one allocation node, for as long as a graph or a live
/// allocation refers to it.
pub(crate) struct VaRange {
    addr: u64,
    size: u64,
}

impl Drop for VaRange {
    fn drop(&mut self) {
        VAS.lock().remove(&self.addr);
        crate::memory::unmap(self.addr, self.size);
    }
}

/// Reserved graph addresses, to tell a graph allocation's address from others.
static VAS: LazyLock<Mutex<HashMap<u64, Weak<VaRange>>>> = LazyLock::new(Default::default);

/// Graph allocations that are live (their allocation node ran, nothing freed them yet).
static LIVE: LazyLock<Mutex<HashMap<u64, Arc<VaRange>>>> = LazyLock::new(Default::default);

/// One node of a graph.
pub(crate) enum Node {
    Task { ty: NodeType, run: Task, device_time: bool },
    Alloc { va: Arc<VaRange>, device: usize },
    Free { addr: u64 },
}

impl Node {
    fn node_type(&self) -> NodeType {
        match self {
            Node::Task { ty, .. } => *ty,
            Node::Alloc { .. } => NodeType::MemAlloc,
            Node::Free { .. } => NodeType::MemFree,
        }
    }

    fn charge(&self) -> u64 {
        match self {
            Node::Alloc { va, .. } => round_up(va.size, ALLOC_ALIGN),
            _ => 0,
        }
    }
}

/// A graph: its nodes in the order they run.
pub(crate) struct Graph {
    nodes: Mutex<Vec<Arc<Node>>>,
    /// The device its capture ran on (a graph made with `cuGraphCreate` has none).
    device: Option<usize>,
    /// Executable graphs instantiated from it and not destroyed.
    execs: AtomicU32,
}

static GRAPHS: LazyLock<Mutex<HashMap<usize, Arc<Graph>>>> = LazyLock::new(Default::default);

fn graph(handle: CUgraph) -> CuResult<Arc<Graph>> {
    GRAPHS.lock().get(&(handle as usize)).cloned().ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

fn register_graph(g: Graph) -> usize {
    let g = Arc::new(g);
    let handle = Arc::as_ptr(&g) as usize;
    GRAPHS.lock().insert(handle, g);
    handle
}

// ---- stream capture ----

/// One capture sequence, begun on its origin stream.
pub(crate) struct Capture {
    id: u64,
    mode: c_uint,
    thread: ThreadId,
    ctx: usize,
    device: usize,
    origin: usize,
    /// Whether the origin stream synchronizes with the legacy stream.
    blocking: bool,
    state: Mutex<CaptureState>,
}

#[derive(Default)]
struct CaptureState {
    nodes: Vec<Arc<Node>>,
    invalidated: bool,
    /// Streams other than the origin that joined through an event.
    joined: Vec<Arc<Stream>>,
    /// What `cuStreamGetCaptureInfo` hands out as the capture's dependencies.
    deps: Box<[usize; 1]>,
}

impl Capture {
    /// Records a node; an invalidated capture records nothing more.
    pub(crate) fn record(&self, node: Node) -> CuResult {
        let mut st = self.state.lock();
        if st.invalidated {
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        st.nodes.push(Arc::new(node));
        Ok(())
    }

    pub(crate) fn invalidate(&self) {
        self.state.lock().invalidated = true;
    }

    fn invalidated(&self) -> bool {
        self.state.lock().invalidated
    }
}

/// Captures begun and not ended; the count keeps calls outside any capture at one load.
static ACTIVE: LazyLock<Mutex<Vec<Arc<Capture>>>> = LazyLock::new(Default::default);
static ACTIVE_COUNT: AtomicUsize = AtomicUsize::new(0);
static NEXT_CAPTURE_ID: AtomicU64 = AtomicU64::new(1);

/// Whether any stream of the process captures.
pub(crate) fn any_capture() -> bool {
    ACTIVE_COUNT.load(Ordering::Acquire) > 0
}

/// A call the docs call "potentially unsafe" during capture (a synchronous allocation or
/// free, a synchronous copy, a context synchronize): under the calling thread's capture
/// mode (`cuThreadExchangeStreamCaptureMode`) it is refused with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` while this thread has a capture not begun in
/// RELAXED mode, or (thread mode GLOBAL) another thread has a GLOBAL one; the captures
/// that forbade it are invalidated.
pub(crate) fn unsafe_call() -> CuResult {
    if !any_capture() {
        return Ok(());
    }
    let mode = stream::thread_capture_mode();
    if mode == MODE_RELAXED {
        return Ok(());
    }
    let me = std::thread::current().id();
    let active = ACTIVE.lock();
    let forbidding: Vec<&Arc<Capture>> = active
        .iter()
        .filter(|c| {
            c.mode != MODE_RELAXED && (c.thread == me || (mode == MODE_GLOBAL && c.mode == MODE_GLOBAL))
        })
        .filter(|c| !c.invalidated())
        .collect();
    if forbidding.is_empty() {
        return Ok(());
    }
    forbidding.iter().for_each(|c| c.invalidate());
    Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
}

/// `cuCtxSynchronize` would wait for a capturing stream, which never finishes: every
/// capture in the context is invalidated and the call refused.
pub(crate) fn context_sync(ctx: usize) -> CuResult {
    if !any_capture() {
        return Ok(());
    }
    unsafe_call()?;
    let active = ACTIVE.lock();
    let mut found = false;
    for c in active.iter().filter(|c| c.ctx == ctx) {
        c.invalidate();
        found = true;
    }
    if found {
        Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    } else {
        Ok(())
    }
}

/// Work on the legacy default stream of `ctx` would depend on a capturing stream that
/// synchronizes with it (one not created non-blocking): refused with
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, and that capture invalidated.
pub(crate) fn legacy_use(ctx: usize) -> CuResult {
    if !any_capture() {
        return Ok(());
    }
    let active = ACTIVE.lock();
    let mut found = false;
    for c in active.iter().filter(|c| c.ctx == ctx && c.blocking) {
        c.invalidate();
        found = true;
    }
    if found {
        Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    } else {
        Ok(())
    }
}

/// `cuStreamBeginCapture` (all versions): `stream` starts recording into a new graph.
pub(crate) fn begin_capture(handle: CUstream, mode: c_uint, default: DefaultStream) -> CuResult {
    if mode > MODE_RELAXED {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let s = stream::resolve(handle, default)?;
    // The legacy stream cannot capture.
    if stream::is_legacy(&s) {
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    let mut slot = s.capture.lock();
    if slot.is_some() {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    let capture = Arc::new(Capture {
        id: NEXT_CAPTURE_ID.fetch_add(1, Ordering::Relaxed),
        mode,
        thread: std::thread::current().id(),
        ctx: s.ctx,
        device: s.device,
        origin: Arc::as_ptr(&s) as usize,
        blocking: s.flags & 1 == 0,
        state: Mutex::new(CaptureState::default()),
    });
    *slot = Some(capture.clone());
    let mut active = ACTIVE.lock();
    active.push(capture);
    ACTIVE_COUNT.store(active.len(), Ordering::Release);
    Ok(())
}

/// `cuStreamEndCapture`: ends the capture begun on `stream` and hands over its graph, or
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` (and no graph) if something broke it.
pub(crate) fn end_capture(handle: CUstream, out: *mut CUgraph, default: DefaultStream) -> CuResult {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let s = stream::resolve(handle, default)?;
    let capture = s.capture.lock().clone().ok_or(CUresult::CUDA_ERROR_ILLEGAL_STATE)?;
    if capture.origin != Arc::as_ptr(&s) as usize {
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    }
    if capture.mode != MODE_RELAXED && capture.thread != std::thread::current().id() {
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    }
    {
        let mut active = ACTIVE.lock();
        active.retain(|c| !Arc::ptr_eq(c, &capture));
        ACTIVE_COUNT.store(active.len(), Ordering::Release);
    }
    *s.capture.lock() = None;
    let mut st = capture.state.lock();
    for joined in st.joined.drain(..) {
        *joined.capture.lock() = None;
    }
    if st.invalidated {
        write_out(out, std::ptr::null_mut())?;
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    let nodes = std::mem::take(&mut st.nodes);
    let handle = register_graph(Graph {
        nodes: Mutex::new(nodes),
        device: Some(capture.device),
        execs: AtomicU32::new(0),
    });
    write_out(out, handle as CUgraph)
}

/// `cuStreamIsCapturing` and the status part of `cuStreamGetCaptureInfo`.
pub(crate) fn capture_status(s: &Stream) -> CuResult<(c_uint, Option<Arc<Capture>>)> {
    if stream::is_legacy(s) {
        legacy_use(s.ctx)?;
    }
    Ok(match s.capture.lock().clone() {
        None => (STATUS_NONE, None),
        Some(c) if c.invalidated() => (STATUS_INVALIDATED, None),
        Some(c) => (STATUS_ACTIVE, Some(c)),
    })
}

/// The parts of `cuStreamGetCaptureInfo` an active capture answers: its id, its graph
/// so far (a handle that lives until the capture ends) and its one dependency (the last
/// node recorded; captured work is a chain).
pub(crate) fn capture_info(c: &Capture) -> (u64, usize, *const usize, usize) {
    let mut st = c.state.lock();
    let last = st.nodes.last().map(|n| Arc::as_ptr(n) as usize);
    st.deps[0] = last.unwrap_or(0);
    let graph = c as *const Capture as usize;
    (c.id, graph, st.deps.as_ptr(), usize::from(last.is_some()))
}

/// An event recorded on a capturing stream: a stream that waits for it joins the capture
/// (the fork of multi-stream capture); its work is recorded after what came before.
pub(crate) fn join(s: &Arc<Stream>, capture: &Arc<Capture>) -> CuResult {
    let mut slot = s.capture.lock();
    match &*slot {
        Some(c) if Arc::ptr_eq(c, capture) => Ok(()),
        Some(_) => Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION),
        None => {
            let mut st = capture.state.lock();
            if st.invalidated {
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            }
            st.joined.push(s.clone());
            *slot = Some(capture.clone());
            Ok(())
        }
    }
}

/// Whether `capture` is still going on (an event recorded in it cannot be waited for).
pub(crate) fn is_active(capture: &Weak<Capture>) -> bool {
    capture.upgrade().is_some_and(|c| ACTIVE.lock().iter().any(|a| Arc::ptr_eq(a, &c)))
}

/// `cuMemAllocAsync`/`cuMemAllocFromPoolAsync` on a capturing stream: an allocation
/// node, whose address is reserved now and backed when the graph runs.
pub(crate) fn capture_alloc(capture: &Capture, out: *mut CUdeviceptr, size: usize) -> CuResult {
    if out.is_null() || size == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let addr = map_anonymous(size as u64, libc::PROT_READ | libc::PROT_WRITE)?;
    let va = Arc::new(VaRange { addr, size: size as u64 });
    VAS.lock().insert(addr, Arc::downgrade(&va));
    capture.record(Node::Alloc { va, device: capture.device })?;
    write_out(out, addr)
}

/// `cuMemFreeAsync` on a capturing stream: a free node, for a graph allocation only.
pub(crate) fn capture_free(capture: &Capture, ptr: CUdeviceptr) -> CuResult {
    if !is_graph_address(ptr) {
        capture.invalidate();
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let freed_twice =
        capture.state.lock().nodes.iter().any(|n| matches!(**n, Node::Free { addr } if addr == ptr));
    if freed_twice {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    capture.record(Node::Free { addr: ptr })
}

/// Whether `ptr` is the address of a graph's allocation node.
pub(crate) fn is_graph_address(ptr: u64) -> bool {
    VAS.lock().get(&ptr).is_some_and(|w| w.strong_count() > 0)
}

// ---- graphs ----

pub(crate) fn graph_create(out: *mut CUgraph, flags: c_uint) -> CuResult {
    driver()?;
    if flags != 0 || out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let handle =
        register_graph(Graph { nodes: Mutex::new(Vec::new()), device: None, execs: AtomicU32::new(0) });
    write_out(out, handle as CUgraph)
}

/// `cuGraphDestroy`: executable graphs made from it stay usable, as in CUDA.
pub(crate) fn graph_destroy(handle: CUgraph) -> CuResult {
    GRAPHS.lock().remove(&(handle as usize)).map(|_| ()).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

/// `cuGraphGetNodes`: the count when `nodes` is null, else up to `*count` handles (the
/// rest of the caller's array set to null) and the real count.
pub(crate) fn graph_get_nodes(handle: CUgraph, nodes: *mut CUgraphNode, count: *mut usize) -> CuResult {
    let g = graph(handle)?;
    let all = g.nodes.lock();
    if nodes.is_null() {
        return write_out(count, all.len());
    }
    let room = read_in(count.cast_const())?;
    for i in 0..room {
        let node = all.get(i).map_or(std::ptr::null_mut(), |n| Arc::as_ptr(n).cast_mut() as CUgraphNode);
        // SAFETY: the caller's array holds `*count` node handles.
        write_out(unsafe { nodes.add(i) }, node)?;
    }
    write_out(count, all.len())
}

/// The node behind a handle, in any live graph.
fn node(handle: CUgraphNode) -> CuResult<Arc<Node>> {
    let graphs = GRAPHS.lock();
    graphs
        .values()
        .find_map(|g| {
            g.nodes.lock().iter().find(|n| std::ptr::eq(Arc::as_ptr(n).cast(), handle.cast_const())).cloned()
        })
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

pub(crate) fn node_get_type(handle: CUgraphNode, out: *mut c_uint) -> CuResult {
    write_out(out, node(handle)?.node_type() as c_uint)
}

/// `cuGraphMemAllocNodeGetParams`: the node's size, address and pool properties
/// (pinned memory on its device, read-write for it alone).
pub(crate) fn mem_alloc_node_get_params(
    handle: CUgraphNode,
    out: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CuResult {
    let n = node(handle)?;
    let Node::Alloc { va, device } = &*n else {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    };
    // SAFETY: the struct is plain C data (integers, a null pointer and reserved bytes),
    // for which all zeroes is a valid value.
    let mut params: CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
    params.poolProps.allocType = cudarc::driver::sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    params.poolProps.location.type_ = cudarc::driver::sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    params.poolProps.location.id = *device as i32;
    params.bytesize = va.size as usize;
    params.dptr = va.addr;
    write_out(out, params)
}

// ---- executable graphs ----

/// An executable graph: the nodes at instantiation, and the order of its launches.
pub(crate) struct Exec {
    nodes: Vec<Arc<Node>>,
    graph: Weak<Graph>,
    device: Option<usize>,
    flags: u64,
    footprint: u64,
    /// Launches queued so far, and those finished: each waits for the one before it.
    launches: AtomicU64,
    finished: Arc<(Mutex<u64>, Condvar)>,
}

static EXECS: LazyLock<Mutex<HashMap<usize, Arc<Exec>>>> = LazyLock::new(Default::default);

fn exec(handle: CUgraphExec) -> CuResult<Arc<Exec>> {
    EXECS.lock().get(&(handle as usize)).cloned().ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

fn instantiate(out: *mut CUgraphExec, handle: CUgraph, flags: u64) -> CuResult<Arc<Exec>> {
    driver()?;
    let known = FLAG_AUTO_FREE_ON_LAUNCH | FLAG_UPLOAD | FLAG_DEVICE_LAUNCH | FLAG_USE_NODE_PRIORITY;
    let device_launch_and_auto_free = FLAG_DEVICE_LAUNCH | FLAG_AUTO_FREE_ON_LAUNCH;
    if out.is_null()
        || flags & !known != 0
        || flags & device_launch_and_auto_free == device_launch_and_auto_free
    {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let g = graph(handle)?;
    let nodes = g.nodes.lock().clone();
    let has_memory_nodes = nodes.iter().any(|n| matches!(**n, Node::Alloc { .. } | Node::Free { .. }));
    // A graph with memory nodes may have one executable graph at a time: its allocation
    // addresses are fixed in the graph.
    if has_memory_nodes && g.execs.load(Ordering::Acquire) > 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let footprint = nodes.iter().map(|n| n.charge()).sum();
    let e = Arc::new(Exec {
        nodes,
        graph: Arc::downgrade(&g),
        device: g.device,
        flags,
        footprint,
        launches: AtomicU64::new(0),
        finished: Arc::new((Mutex::new(0), Condvar::new())),
    });
    g.execs.fetch_add(1, Ordering::AcqRel);
    let h = Arc::as_ptr(&e) as usize;
    write_out(out, h as CUgraphExec)?;
    EXECS.lock().insert(h, e.clone());
    Ok(e)
}

pub(crate) fn instantiate_with_flags(out: *mut CUgraphExec, handle: CUgraph, flags: u64) -> CuResult {
    instantiate(out, handle, flags).map(|_| ())
}

/// `cuGraphInstantiate` of CUDA 10 and 11 (`_v2`): no flags; the error node and log
/// outputs are cleared.
pub(crate) fn instantiate_v1(
    out: *mut CUgraphExec,
    handle: CUgraph,
    err_node: *mut CUgraphNode,
    log: *mut c_char,
    log_size: usize,
) -> CuResult {
    if !err_node.is_null() {
        write_out(err_node, std::ptr::null_mut())?;
    }
    if !log.is_null() && log_size > 0 {
        write_out(log, 0)?;
    }
    instantiate(out, handle, 0).map(|_| ())
}

/// `cuGraphInstantiateWithParams`: flags from the parameters, which also name the
/// stream of an upload at instantiation, and receive the result.
pub(crate) fn instantiate_with_params(
    out: *mut CUgraphExec,
    handle: CUgraph,
    params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
    default: DefaultStream,
) -> CuResult {
    let mut p = read_in(params.cast_const())?;
    p.hErrNode_out = std::ptr::null_mut();
    let made = instantiate(out, handle, p.flags);
    p.result_out = match made {
        Ok(_) => cudarc::driver::sys::CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_SUCCESS,
        Err(_) => cudarc::driver::sys::CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_ERROR,
    };
    write_out(params, p)?;
    let e = made?;
    if p.flags & FLAG_UPLOAD != 0 {
        upload(&e, p.hUploadStream, default)?;
    }
    Ok(())
}

pub(crate) fn exec_destroy(handle: CUgraphExec) -> CuResult {
    let e = EXECS.lock().remove(&(handle as usize)).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if let Some(g) = e.graph.upgrade() {
        g.execs.fetch_sub(1, Ordering::AcqRel);
    }
    Ok(())
}

/// The stream a graph runs on: on the graph's device, and not capturing (simgpu does not
/// record a graph launch as a child graph node).
fn launch_stream(e: &Exec, handle: CUstream, default: DefaultStream) -> CuResult<Arc<Stream>> {
    let s = stream::resolve(handle, default)?;
    if e.device.is_some_and(|d| d != s.device) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if s.capture.lock().is_some() {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    Ok(s)
}

fn upload(e: &Exec, handle: CUstream, default: DefaultStream) -> CuResult {
    let s = launch_stream(e, handle, default)?;
    reserve(s.device, e.footprint, false)
}

/// `cuGraphUpload`: reserves the graph's memory in the pool now, so a launch finds it.
pub(crate) fn graph_upload(handle: CUgraphExec, s: CUstream, default: DefaultStream) -> CuResult {
    upload(&*exec(handle)?, s, default)
}

/// `cuGraphLaunch`: reserves what the graph's allocations need in the device's graph
/// memory pool (`CUDA_ERROR_OUT_OF_MEMORY` if the device does not have it), then queues
/// its nodes, in order, behind the stream's work and the graph's previous launch.
pub(crate) fn graph_launch(handle: CUgraphExec, stream_handle: CUstream, default: DefaultStream) -> CuResult {
    let e = exec(handle)?;
    let s = launch_stream(&e, stream_handle, default)?;
    if stream::is_legacy(&s) {
        legacy_use(s.ctx)?;
    }
    let allocs: Vec<u64> = e
        .nodes
        .iter()
        .filter_map(|n| match &**n {
            Node::Alloc { va, .. } => Some(va.addr),
            _ => None,
        })
        .collect();
    // Allocations a previous launch made and nobody freed: freed first with
    // AUTO_FREE_ON_LAUNCH, else the launch is refused.
    let unfreed: Vec<u64> = {
        let reg = REGISTRY.read();
        allocs.iter().copied().filter(|a| reg.allocs.get(a).is_some_and(|r| !r.freeing)).collect()
    };
    if !unfreed.is_empty() && e.flags & FLAG_AUTO_FREE_ON_LAUNCH == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    reserve(s.device, e.footprint, true)?;
    let generation = e.launches.fetch_add(1, Ordering::AcqRel) + 1;
    let finished = e.finished.clone();
    let (device, ctx) = (s.device, s.ctx);
    let queued = (|| {
        s.submit(Box::new(move || {
            let (done, cond) = &*finished;
            let mut done = done.lock();
            while *done + 1 < generation {
                cond.wait(&mut done);
            }
            drop(done);
            let mut reg = REGISTRY.write();
            for addr in unfreed {
                release_allocation(&mut reg, addr);
            }
            Ok(())
        }))?;
        for n in e.nodes.iter().cloned() {
            match &*n {
                Node::Task { run, device_time, .. } => {
                    let run = run.clone();
                    let job: stream::Job = Box::new(move || run());
                    if *device_time {
                        s.submit_kernel(job)?;
                    } else {
                        s.submit(job)?;
                    }
                }
                Node::Alloc { .. } => s.submit(Box::new(move || back_allocation(&n, device, ctx)))?,
                Node::Free { addr } => {
                    let addr = *addr;
                    s.submit(Box::new(move || free_node(addr)))?;
                }
            }
        }
        let finished = e.finished.clone();
        s.submit(Box::new(move || {
            let (done, cond) = &*finished;
            *done.lock() = generation;
            cond.notify_all();
            Ok(())
        }))
    })();
    if queued.is_err() {
        unschedule(device, e.footprint);
    }
    queued
}

/// An allocation node runs: the pool backs it, and its address becomes device memory.
fn back_allocation(n: &Node, device: usize, ctx: usize) -> CuResult {
    let Node::Alloc { va, .. } = n else {
        return Ok(());
    };
    let charged = n.charge();
    let mut reg = REGISTRY.write();
    if reg.allocs.contains_key(&va.addr) {
        // Still live from an earlier launch: the launch did not wait for its free.
        unschedule(device, charged);
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    take_from_pool(device, charged)?;
    LIVE.lock().insert(va.addr, va.clone());
    reg.allocs.insert(
        va.addr,
        Allocation { size: va.size, charged, device, ctx, kind: Kind::Graph, freeing: false },
    );
    Ok(())
}

/// A free node runs: a graph allocation goes back to the pool.
fn free_node(addr: u64) -> CuResult {
    let mut reg = REGISTRY.write();
    match reg.allocs.get(&addr) {
        Some(a) if a.kind == Kind::Graph => {
            release_allocation(&mut reg, addr);
            Ok(())
        }
        _ => Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
    }
}

/// A graph allocation was freed (free node, `cuMemFreeAsync`, `cuMemFree`, or its
/// context going away): its memory stays reserved in the pool, its pages are dropped.
pub(crate) fn returned(addr: u64, device: usize, charged: u64) {
    if let Some(va) = LIVE.lock().remove(&addr) {
        // SAFETY: the range is this allocation's reserved mapping, which no one uses
        // now that the registry no longer lists it; dropping its pages keeps it mapped.
        unsafe { libc::madvise(va.addr as *mut c_void, va.size as usize, libc::MADV_DONTNEED) };
    }
    let mut pools = POOLS.lock();
    let p = pools.entry(device).or_default();
    p.used = p.used.saturating_sub(charged);
}

// ---- the graph memory pool ----

#[derive(Default, Debug, Clone, Copy)]
struct GraphPool {
    /// Charged to the device.
    reserved: u64,
    /// In live graph allocations.
    used: u64,
    /// Promised to launches whose allocation nodes have not run yet.
    scheduled: u64,
    reserved_high: u64,
    used_high: u64,
}

static POOLS: LazyLock<Mutex<HashMap<usize, GraphPool>>> = LazyLock::new(Default::default);

/// Makes the pool hold what is in use, what queued launches will take, and `footprint`
/// more; a launch (`schedule`) then counts its footprint as promised.
fn reserve(device: usize, footprint: u64, schedule: bool) -> CuResult {
    let d = driver()?;
    let mut pools = POOLS.lock();
    let p = pools.entry(device).or_default();
    let need = p.used + p.scheduled + footprint;
    if need > p.reserved {
        d.slot.charge(device, need - p.reserved).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
        p.reserved = need;
        p.reserved_high = p.reserved_high.max(p.reserved);
    }
    if schedule {
        p.scheduled += footprint;
    }
    Ok(())
}

fn unschedule(device: usize, bytes: u64) {
    let mut pools = POOLS.lock();
    let p = pools.entry(device).or_default();
    p.scheduled = p.scheduled.saturating_sub(bytes);
}

/// An allocation node takes its memory from what its launch reserved (or, if that was
/// taken meanwhile, more from the device).
fn take_from_pool(device: usize, bytes: u64) -> CuResult {
    let d = driver()?;
    let mut pools = POOLS.lock();
    let p = pools.entry(device).or_default();
    p.scheduled = p.scheduled.saturating_sub(bytes);
    let need = p.used + p.scheduled + bytes;
    if need > p.reserved {
        d.slot.charge(device, need - p.reserved).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
        p.reserved = need;
        p.reserved_high = p.reserved_high.max(p.reserved);
    }
    p.used += bytes;
    p.used_high = p.used_high.max(p.used);
    Ok(())
}

fn release_unused(device: usize, p: &mut GraphPool) {
    let keep = p.used + p.scheduled;
    if p.reserved > keep {
        if let Ok(d) = driver() {
            d.slot.release(device, p.reserved - keep);
        }
        p.reserved = keep;
    }
}

/// `cuDeviceGraphMemTrim`: gives back what the pool holds beyond live allocations and
/// queued launches.
pub(crate) fn device_graph_mem_trim(device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    let mut pools = POOLS.lock();
    if let Some(p) = pools.get_mut(&index) {
        release_unused(index, p);
    }
    Ok(())
}

/// `CUgraphMem_attribute`.
const ATTR_USED_MEM_CURRENT: i32 = 0;
const ATTR_USED_MEM_HIGH: i32 = 1;
const ATTR_RESERVED_MEM_CURRENT: i32 = 2;
const ATTR_RESERVED_MEM_HIGH: i32 = 3;

/// `cuDeviceGetGraphMemAttribute`: bytes in use by graph allocations and reserved by the
/// pool, current and high-water marks (`cuuint64_t`).
pub(crate) fn device_get_graph_mem_attribute(device: CUdevice, attr: i32, value: *mut c_void) -> CuResult {
    let index = device_index(device)?;
    let p = POOLS.lock().get(&index).copied().unwrap_or_default();
    let v = match attr {
        ATTR_USED_MEM_CURRENT => p.used,
        ATTR_USED_MEM_HIGH => p.used_high,
        ATTR_RESERVED_MEM_CURRENT => p.reserved,
        ATTR_RESERVED_MEM_HIGH => p.reserved_high,
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    };
    write_out(value.cast::<u64>(), v)
}

/// `cuDeviceSetGraphMemAttribute`: only the high-water marks may be set, and only to 0,
/// which resets them (to the current value, below which a high-water mark cannot be).
pub(crate) fn device_set_graph_mem_attribute(device: CUdevice, attr: i32, value: *mut c_void) -> CuResult {
    let index = device_index(device)?;
    let v = read_in(value.cast::<u64>().cast_const())?;
    if v != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut pools = POOLS.lock();
    let p = pools.entry(index).or_default();
    match attr {
        ATTR_USED_MEM_HIGH => p.used_high = p.used,
        ATTR_RESERVED_MEM_HIGH => p.reserved_high = p.reserved,
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
    Ok(())
}

/// A context went away: with it the device's last, the pool gives everything back.
pub(crate) fn context_destroyed(device: usize) {
    if crate::context::devices_of_live_contexts().contains(&device) {
        return;
    }
    let mut pools = POOLS.lock();
    if let Some(p) = pools.get_mut(&device) {
        p.scheduled = 0;
        release_unused(device, p);
    }
}
