//! The book of VMM physical allocations (`cuMemCreate`) and their mappings, kept by the
//! memory hooks: an allocation's memory is freed when its last handle reference is
//! released and its last mapping unmapped, as in CUDA.

use std::collections::{BTreeMap, HashMap};

/// Physical allocations and their mappings: the memory is freed when the last handle
/// reference is released and the last mapping unmapped, as in CUDA.
#[derive(Default)]
pub(crate) struct VmmBook {
    /// handle → (references, mappings)
    pub handles: HashMap<u64, (u32, u32)>,
    /// mapped address → (handle, size)
    pub mappings: BTreeMap<u64, (u64, u64)>,
    /// Handles exported to a shareable handle (`cuMemExportToShareableHandle`).
    pub exported: std::collections::HashSet<u64>,
}

impl VmmBook {
    /// Forgets `handle` if nothing references or maps it any more.
    pub(crate) fn unused(&mut self, handle: u64) -> bool {
        if self.handles.get(&handle).is_some_and(|&(refs, maps)| refs == 0 && maps == 0) {
            self.handles.remove(&handle);
            return true;
        }
        false
    }
}
