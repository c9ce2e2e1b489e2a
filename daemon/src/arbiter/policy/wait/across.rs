//! A group registered on several GPUs (the workers of a tensor-parallel server, one per
//! GPU, in one `GPUFRAC_GROUP`) bursts on all of them together: each step needs every
//! worker's memory. Its burst under way on one GPU counts as under way on each of its
//! GPUs ([`Policy::share_bursts`]): there its claim is kept from new bursts and its first
//! ask is a step, served first. Otherwise two such servers could each start on a
//! different GPU and wait for each other's memory on the other one: a circle across GPUs
//! that no GPU's own queue sees, ending in out-of-memory.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use gpufrac_common::protocol::DeviceId;

use super::super::{Gpu, Policy, Residency};

impl Gpu {
    /// Whether `group`'s burst is under way on another GPU it is registered on, and it is
    /// on this device (see the module doc).
    pub(super) fn under_way_elsewhere(&self, group: &str) -> bool {
        self.elsewhere.contains(group)
            && self
                .groups
                .get(group)
                .is_some_and(|g| g.members.values().any(|m| m.residency == Residency::Resident))
    }
}

impl Policy {
    /// Marks, on each GPU, the groups registered there whose burst is under way on another
    /// of their GPUs (see the module doc); returns the GPUs where such a group's burst is
    /// over now, whose queues may move. Called before the queues are looked at.
    pub(in super::super) fn share_bursts(&mut self, now: Instant) -> Vec<DeviceId> {
        if self.gpus.len() < 2 {
            return Vec::new();
        }
        let mut under_way: BTreeMap<&str, Vec<DeviceId>> = BTreeMap::new();
        for (device, gpu) in &self.gpus {
            for name in gpu.groups.keys().filter(|name| gpu.under_way_here(name, now)) {
                under_way.entry(name.as_str()).or_default().push(*device);
            }
        }
        let shared: Vec<(DeviceId, BTreeSet<String>)> = self
            .gpus
            .iter()
            .map(|(device, gpu)| {
                let names = gpu
                    .groups
                    .keys()
                    .filter(|name| {
                        under_way.get(name.as_str()).is_some_and(|on| on.iter().any(|d| d != device))
                    })
                    .cloned()
                    .collect();
                (*device, names)
            })
            .collect();
        let mut freed = Vec::new();
        for (device, names) in shared {
            let Some(gpu) = self.gpus.get_mut(&device) else { continue };
            if gpu.elsewhere.iter().any(|name| !names.contains(name)) {
                freed.push(device);
            }
            gpu.elsewhere = names;
        }
        freed
    }
}
