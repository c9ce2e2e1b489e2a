//! The book of CUDA graphs' memory: the executable graphs with allocation nodes, and what
//! is charged for each device's graph memory pool (brought to what the pool reserves by
//! the graph hooks, `hooks::graphs`).

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::driver::ffi::{Status, OUT_OF_MEMORY, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::Enforcer;

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
    pub(crate) inner: Mutex<Graphs>,
    /// Executable graphs with allocation nodes: a launch of any other graph looks no
    /// further than this count while it is 0.
    pub(crate) with_memory: AtomicUsize,
}

#[derive(Default)]
pub(crate) struct Graphs {
    /// executable graph → (CUDA ordinal, bytes its allocation nodes take)
    pub(crate) execs: HashMap<u64, (usize, u64)>,
    /// CUDA ordinal → bytes charged for its graph pool
    pub(crate) charged: HashMap<usize, u64>,
}

/// What graph `graph`'s allocation nodes take together (0 for a graph without them, or
/// when the driver cannot list them).
pub(crate) fn allocation_bytes(graph: Ptr) -> u64 {
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
    pub(crate) fn settle(&self, e: &Enforcer, ordinal: usize, strict: bool) -> Status {
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
    pub(crate) fn ran(&self, e: &Enforcer, exec: Ptr) {
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
