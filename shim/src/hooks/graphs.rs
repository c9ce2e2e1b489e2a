//! CUDA graphs' memory. A graph's allocation nodes take their memory from the device's
//! graph memory pool when the graph is uploaded or launched, and the pool keeps it after
//! the graph's free nodes ran, until `cuDeviceGraphMemTrim`: memory no allocation hook
//! sees (a captured `cuMemAllocAsync` only reserves an address). So what a device's
//! graphs hold is charged from what the pool reserves (`cuDeviceGetGraphMemAttribute`),
//! and at least the allocations of each live executable graph: instantiating a graph
//! whose allocations do not fit under the limit is refused (`CUDA_ERROR_OUT_OF_MEMORY`),
//! so its launches stay within it. The charge is brought to that figure at instantiate,
//! upload, launch (only for graphs with allocation nodes: other launches pay one atomic
//! load), executable destruction and trim.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::driver::ffi::{read, Status, OUT_OF_MEMORY, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::{enforcer, refused, Enforcer};

type Ptr = *mut c_void;

/// `CU_GRAPH_NODE_TYPE_MEM_ALLOC`.
const NODE_MEM_ALLOC: c_uint = 10;
/// `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`.
const ATTR_RESERVED_CURRENT: c_int = 2;

/// `CUDA_MEM_ALLOC_NODE_PARAMS`: the pool's properties (88 bytes in every CUDA 11.4+
/// header), the access descriptors, then the size and the address.
#[repr(C)]
struct AllocNodeParams {
    pool_props: [u64; 11],
    access_descs: *const c_void,
    access_desc_count: usize,
    bytesize: usize,
    dptr: u64,
}

/// The executable graphs with allocation nodes, and what is charged for each device's
/// graph pool.
#[derive(Default)]
pub(crate) struct GraphBook {
    inner: Mutex<Graphs>,
    /// Executable graphs with allocation nodes: a launch of any other graph looks no
    /// further than this count while it is 0.
    with_memory: AtomicUsize,
}

#[derive(Default)]
struct Graphs {
    /// executable graph → (CUDA ordinal, bytes its allocation nodes take)
    execs: HashMap<u64, (usize, u64)>,
    /// CUDA ordinal → bytes charged for its graph pool
    charged: HashMap<usize, u64>,
}

/// What graph `graph`'s allocation nodes take together (0 for a graph without them, or
/// when the driver cannot list them).
fn allocation_bytes(graph: Ptr) -> u64 {
    let mut count = 0usize;
    if call_real!(cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count)) != SUCCESS || count == 0 {
        return 0;
    }
    let mut nodes = vec![std::ptr::null_mut(); count];
    if call_real!(cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count)) != SUCCESS {
        return 0;
    }
    nodes.truncate(count);
    nodes
        .into_iter()
        .filter(|&node| {
            let mut kind: c_uint = 0;
            call_real!(cuGraphNodeGetType(node, &mut kind)) == SUCCESS && kind == NODE_MEM_ALLOC
        })
        .map(|node| {
            // SAFETY: a plain C struct of integers and pointers, valid when zeroed.
            let mut params: AllocNodeParams = unsafe { std::mem::zeroed() };
            let ok =
                call_real!(cuGraphMemAllocNodeGetParams(node, (&mut params as *mut AllocNodeParams).cast()));
            if ok == SUCCESS {
                params.bytesize as u64
            } else {
                0
            }
        })
        .sum()
}

/// What device `ordinal`'s graph pool reserves now.
fn reserved(ordinal: usize) -> Option<u64> {
    let mut value = 0u64;
    let status = call_real!(cuDeviceGetGraphMemAttribute(
        ordinal as c_int,
        ATTR_RESERVED_CURRENT,
        (&mut value as *mut u64).cast()
    ));
    (status == SUCCESS).then_some(value)
}

impl GraphBook {
    /// Brings the charge for device `ordinal`'s graph pool to what it reserves, and at
    /// least the allocations of each live executable graph there. When `strict`, a charge
    /// that does not fit is refused (nothing changes); otherwise the memory exists
    /// already, and is charged past the limit (further allocations are refused).
    fn settle(&self, e: &Enforcer, ordinal: usize, strict: bool) -> Status {
        let Some(slice) = e.slice(ordinal) else { return SUCCESS };
        let mut graphs = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let largest =
            graphs.execs.values().filter(|(o, _)| *o == ordinal).map(|&(_, b)| b).max().unwrap_or(0);
        let need = reserved(ordinal).unwrap_or(0).max(largest);
        let was = graphs.charged.get(&ordinal).copied().unwrap_or(0);
        if need > was {
            if e.charge(ordinal, need - was).is_err() {
                if strict {
                    return OUT_OF_MEMORY;
                }
                e.ledger.force_charge(slice.ledger, need - was);
                tracing::warn!(
                    ordinal,
                    reserved = need,
                    limit = slice.limit,
                    "gpufrac: the graph memory pool grew past GPUFRAC_MEMORY_LIMIT at a launch: charged, further allocations are refused until it is trimmed"
                );
            }
        } else if need < was {
            e.release(slice.ledger, was - need);
        }
        graphs.charged.insert(ordinal, need);
        SUCCESS
    }

    /// After a launch or upload of `exec`: its memory, if it has allocation nodes.
    #[inline]
    fn ran(&self, e: &Enforcer, exec: Ptr) {
        if self.with_memory.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.ran_with_memory(e, exec);
    }

    #[cold]
    #[inline(never)]
    fn ran_with_memory(&self, e: &Enforcer, exec: Ptr) {
        let found = self.inner.lock().unwrap_or_else(|p| p.into_inner()).execs.get(&(exec as u64)).copied();
        if let Some((ordinal, _)) = found {
            self.settle(e, ordinal, false);
        }
    }
}

/// An instantiation: `real` instantiates `graph` into `*exec`.
fn instantiate(exec: *mut Ptr, graph: Ptr, real: impl FnOnce() -> Status) -> Status {
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    let status = real();
    let Some(handle) = read(exec).filter(|_| status == SUCCESS) else { return status };
    let bytes = allocation_bytes(graph);
    if bytes == 0 {
        return status;
    }
    let Some(cur) = e.current() else { return status };
    {
        let mut graphs = e.graphs.inner.lock().unwrap_or_else(|p| p.into_inner());
        graphs.execs.insert(handle as u64, (cur.ordinal, bytes));
        e.graphs.with_memory.store(graphs.execs.len(), Ordering::Relaxed);
    }
    if e.graphs.settle(e, cur.ordinal, true) != SUCCESS {
        forget(e, handle);
        let _ = call_real!(cuGraphExecDestroy(handle));
        tracing::warn!(
            ordinal = cur.ordinal,
            bytes,
            "gpufrac: out of memory: refused a graph whose allocations ({bytes} bytes) do not fit under GPUFRAC_MEMORY_LIMIT"
        );
        return OUT_OF_MEMORY;
    }
    status
}

/// Forgets executable graph `exec`; returns its device if it had allocation nodes.
fn forget(e: &Enforcer, exec: Ptr) -> Option<usize> {
    let mut graphs = e.graphs.inner.lock().unwrap_or_else(|p| p.into_inner());
    let gone = graphs.execs.remove(&(exec as u64)).map(|(ordinal, _)| ordinal);
    e.graphs.with_memory.store(graphs.execs.len(), Ordering::Relaxed);
    gone
}

pub(crate) fn instantiate_v1(
    exec: *mut Ptr,
    graph: Ptr,
    error_node: *mut Ptr,
    log: *mut c_char,
    size: usize,
) -> Status {
    instantiate(exec, graph, || call_real!(cuGraphInstantiate(exec, graph, error_node, log, size)))
}

pub(crate) fn instantiate_v2(
    exec: *mut Ptr,
    graph: Ptr,
    error_node: *mut Ptr,
    log: *mut c_char,
    size: usize,
) -> Status {
    instantiate(exec, graph, || call_real!(cuGraphInstantiate_v2(exec, graph, error_node, log, size)))
}

pub(crate) fn instantiate_with_flags(exec: *mut Ptr, graph: Ptr, flags: c_ulonglong) -> Status {
    instantiate(exec, graph, || call_real!(cuGraphInstantiateWithFlags(exec, graph, flags)))
}

pub(crate) fn instantiate_with_params(exec: *mut Ptr, graph: Ptr, params: Ptr) -> Status {
    instantiate(exec, graph, || call_real!(cuGraphInstantiateWithParams(exec, graph, params)))
}

pub(crate) fn instantiate_with_params_ptsz(exec: *mut Ptr, graph: Ptr, params: Ptr) -> Status {
    instantiate(exec, graph, || call_real!(cuGraphInstantiateWithParams_ptsz(exec, graph, params)))
}

/// A launch or upload on `stream`, through the gate like any launch, then the pool's
/// charge.
fn launched(exec: Ptr, stream: Ptr, real: impl FnOnce() -> Status) -> Status {
    let _inside = match crate::control::gate::enter_on(|| stream) {
        Ok(pass) => pass,
        Err(status) => return status,
    };
    let status = real();
    if let (SUCCESS, Some(e)) = (status, enforcer()) {
        e.graphs.ran(e, exec);
    }
    status
}

pub(crate) fn launch(exec: Ptr, stream: Ptr) -> Status {
    launched(exec, stream, || call_real!(cuGraphLaunch(exec, stream)))
}

pub(crate) fn launch_ptsz(exec: Ptr, stream: Ptr) -> Status {
    launched(exec, crate::control::compute::per_thread(stream), || {
        call_real!(cuGraphLaunch_ptsz(exec, stream))
    })
}

pub(crate) fn upload(exec: Ptr, stream: Ptr) -> Status {
    launched(exec, stream, || call_real!(cuGraphUpload(exec, stream)))
}

pub(crate) fn upload_ptsz(exec: Ptr, stream: Ptr) -> Status {
    launched(exec, crate::control::compute::per_thread(stream), || {
        call_real!(cuGraphUpload_ptsz(exec, stream))
    })
}

pub(crate) fn exec_destroy(exec: Ptr) -> Status {
    let status = call_real!(cuGraphExecDestroy(exec));
    if let (SUCCESS, Some(e)) = (status, enforcer()) {
        if let Some(ordinal) = forget(e, exec) {
            e.graphs.settle(e, ordinal, false);
        }
    }
    status
}

pub(crate) fn mem_trim(dev: c_int) -> Status {
    let status = call_real!(cuDeviceGraphMemTrim(dev));
    if let (SUCCESS, Some(e), Ok(ordinal)) = (status, enforcer(), usize::try_from(dev)) {
        e.graphs.settle(e, ordinal, false);
    }
    status
}

/// Stream captures under way in this process (begun, not yet ended).
static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`: the
/// capture ended all the same (with no graph).
const CAPTURE_ENDED_BROKEN: [Status; 2] = [901, 904];

/// Whether some stream of this process is being captured into a graph now.
pub(crate) fn capture_under_way() -> bool {
    CAPTURES.load(Ordering::Acquire) != 0
}

/// Counts a capture that `begin` started.
fn begin_counted(begin: impl FnOnce() -> Status) -> Status {
    // Counted before the driver starts it: a give-back that looks meanwhile waits.
    CAPTURES.fetch_add(1, Ordering::AcqRel);
    let status = begin();
    if status != SUCCESS {
        capture_ended();
    }
    status
}

/// Counts a capture that `end` ended (with a graph, or broken).
fn end_counted(end: impl FnOnce() -> Status) -> Status {
    let status = end();
    if status == SUCCESS || CAPTURE_ENDED_BROKEN.contains(&status) {
        capture_ended();
    }
    status
}

fn capture_ended() {
    let _ = CAPTURES.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
}

/// `cuStreamBeginCapture` (CUDA 10.0, global mode).
pub(crate) fn begin_capture_v1(stream: Ptr) -> Status {
    begin_counted(|| call_real!(cuStreamBeginCapture(stream)))
}

/// `cuStreamBeginCapture_ptsz`.
pub(crate) fn begin_capture_v1_ptsz(stream: Ptr) -> Status {
    begin_counted(|| call_real!(cuStreamBeginCapture_ptsz(stream)))
}

/// `cuStreamBeginCapture_v2`.
pub(crate) fn begin_capture(stream: Ptr, mode: c_uint) -> Status {
    begin_counted(|| call_real!(cuStreamBeginCapture_v2(stream, mode)))
}

/// `cuStreamBeginCapture_v2_ptsz`.
pub(crate) fn begin_capture_ptsz(stream: Ptr, mode: c_uint) -> Status {
    begin_counted(|| call_real!(cuStreamBeginCapture_v2_ptsz(stream, mode)))
}

/// `cuStreamEndCapture`.
pub(crate) fn end_capture(stream: Ptr, graph: *mut Ptr) -> Status {
    end_counted(|| call_real!(cuStreamEndCapture(stream, graph)))
}

/// `cuStreamEndCapture_ptsz`.
pub(crate) fn end_capture_ptsz(stream: Ptr, graph: *mut Ptr) -> Status {
    end_counted(|| call_real!(cuStreamEndCapture_ptsz(stream, graph)))
}
