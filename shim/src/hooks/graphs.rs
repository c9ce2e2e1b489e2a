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

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::atomic::Ordering;

use crate::control::give_back;
use crate::driver::ffi::{read, Status, CAPTURE_INVALIDATED, CAPTURE_UNJOINED, OUT_OF_MEMORY, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::graphs::allocation_bytes;
use crate::enforcer::{enforcer, refused, Enforcer};

type Ptr = *mut c_void;

/// An instantiation: `real` instantiates `graph` into `*exec`.
fn instantiate(exec: *mut Ptr, graph: Ptr, real: impl FnOnce() -> Status) -> Status {
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    let status = real();
    // SAFETY: `exec` is what the caller passed: null or a readable value of its type (the API's contract).
    let Some(handle) = unsafe { read(exec) }.filter(|_| status == SUCCESS) else { return status };
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

/// Counts a capture that `begin` started.
fn begin_counted(begin: impl FnOnce() -> Status) -> Status {
    // Counted before the driver starts it: a give-back that looks meanwhile waits.
    give_back::capture_began();
    let status = begin();
    if status != SUCCESS {
        give_back::capture_ended();
    }
    status
}

/// Counts a capture that `end` ended (with a graph, or broken).
fn end_counted(end: impl FnOnce() -> Status) -> Status {
    let status = end();
    if status == SUCCESS || status == CAPTURE_INVALIDATED || status == CAPTURE_UNJOINED {
        give_back::capture_ended();
    }
    status
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
