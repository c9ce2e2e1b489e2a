//! The swap resolver takes turns: when the burst at the head of a GPU's queue uses it and
//! does not fit, holders of burst memory that also use swap are asked to move their burst
//! memory to host RAM: first those idle (no launch, copy or set for [`IDLE_FOR_SWAP`]),
//! at once; active ones only once they have held it for their quantum, so that active work
//! does not thrash. They come back when they ask (a gated call) or when memory is free
//! again. A swap-in is accepted only for memory the member has in host RAM, and waits
//! [`RESUME_WAIT`](super::RESUME_WAIT) at most (its shim asks again).

use std::time::{Duration, Instant};

use gpufrac_common::protocol::DeviceId;
use gpufrac_common::Resolver;

use super::{Answer, ConnId, Policy, Residency, SwapVictim};

/// How long a holder shows no activity before it counts as idle and may be swapped out
/// before its quantum ends. Shims report activity once a second, so two seconds without a
/// moved count is the shortest span that is not just the reporting period.
pub const IDLE_FOR_SWAP: Duration = Duration::from_secs(2);

/// How long a holder asked to swap out may take to answer before others are chosen.
const SWAP_OUT_ANSWER: Duration = Duration::from_secs(60);

impl Policy {
    /// Host RAM holding swapped-out memory now, plus what swaps under way will add.
    pub fn host_committed(&self) -> u64 {
        self.gpus
            .values()
            .flat_map(|g| g.members())
            .fold(0u64, |sum, (_, _, m)| sum.saturating_add(m.host_committed()))
    }

    /// Members told to swap out that have not answered for [`SWAP_OUT_ANSWER`] (a kernel
    /// that does not end?) count as resident again, so that others can be chosen; their
    /// answer, if it comes, still says where their memory is.
    fn forget_unanswered_swap_outs(&mut self, now: Instant) {
        for gpu in self.gpus.values_mut() {
            for (name, group) in gpu.groups.iter_mut() {
                for m in group.members.values_mut() {
                    let since = m.swapped_since.unwrap_or(now);
                    if m.residency == Residency::SwappingOut
                        && now.saturating_duration_since(since) > SWAP_OUT_ANSWER
                    {
                        tracing::warn!(group = %name, "no answer to a swap-out after {SWAP_OUT_ANSWER:?}");
                        (m.residency, m.swapped_since, m.resident_since) =
                            (Residency::Resident, None, Some(now));
                        (m.swapping_for_debt, m.moving) = (false, 0);
                    }
                }
            }
        }
    }

    /// Marks `conn` as swapping out on `device`; the victim to tell.
    pub(super) fn start_swap_out(
        &mut self,
        device: DeviceId,
        conn: ConnId,
        now: Instant,
    ) -> Option<SwapVictim> {
        let (gpu, group) = self.member_gpu(conn, &device)?;
        let m = gpu.member_mut(&group, conn)?;
        m.residency = Residency::SwappingOut;
        m.swapped_since = Some(now);
        m.moving = m.granted;
        let bytes = m.granted;
        let pid = self.peers.get(&conn).map_or(0, |p| p.pid);
        Some(SwapVictim { conn, device, pid, group, bytes })
    }

    /// The swap resolver: for each GPU whose first waiting burst uses swap and cannot be
    /// served, the holders to swap out (marked as swapping out). Candidates also use swap,
    /// belong to another group, do not wait themselves, are idle or have held their burst
    /// memory for at least `quantum`, and fit under `swap_limit` bytes of host RAM; idle
    /// ones go first, then the longest resident. A GPU with a swap-out under way gets no
    /// new one; a burst no set of candidates can serve is left to wait.
    pub fn swap_victims(&mut self, now: Instant, quantum: Duration, swap_limit: u64) -> Vec<SwapVictim> {
        self.forget_unanswered_swap_outs(now);
        let mut host = self.host_committed();
        let mut picked: Vec<(DeviceId, ConnId)> = Vec::new();
        for (&device, gpu) in &self.gpus {
            if gpu.members().any(|(_, _, m)| m.residency == Residency::SwappingOut) {
                continue;
            }
            let Some((_, head)) = gpu.head() else { continue };
            if self.peers.get(&head.conn).is_none_or(|p| p.resolver != Resolver::Swap)
                || gpu.left_to_queue(head, now)
            {
                continue;
            }
            // (busy, since, conn, bytes): idle holders sort first, then the longest resident.
            // (waits, busy, since, conn, bytes): holders that do not wait themselves sort
            // first, idle ones first among them, then the longest resident. A holder that
            // waits for its next step comes last: swapped out, its step is held back until
            // it is back, and the burst it collided with goes on (two half-grown swap
            // bursts waiting for each other take turns, not out-of-memory).
            let mut candidates: Vec<(bool, bool, Instant, ConnId, u64)> = Vec::new();
            for (name, conn, m) in gpu.members() {
                let Some(peer) = self.peers.get(&conn) else { continue };
                let swappable = *name != head.group
                    && m.granted > 0
                    && m.residency == Residency::Resident
                    && peer.resolver == Resolver::Swap;
                let since = m.resident_since.unwrap_or(now);
                let idle = now.saturating_duration_since(peer.last_active) >= IDLE_FOR_SWAP;
                if swappable && (idle || now.saturating_duration_since(since) >= quantum) {
                    candidates.push((gpu.waiter(conn).is_some(), !idle, since, conn, m.granted));
                }
            }
            candidates.sort();
            let (mut set, mut served, mut host_after) = (Vec::new(), false, host);
            for (_, _, _, conn, bytes) in candidates {
                if host_after.saturating_add(bytes) > swap_limit {
                    continue;
                }
                host_after += bytes;
                set.push(conn);
                if gpu.servable_without(&set, head, now) {
                    served = true;
                    break;
                }
            }
            if served {
                host = host_after;
                picked.extend(set.into_iter().map(|conn| (device, conn)));
            }
        }
        self.swap_with_their_groups(&mut picked, host, swap_limit);
        picked.into_iter().filter_map(|(device, conn)| self.start_swap_out(device, conn, now)).collect()
    }

    /// A group on several GPUs is swapped out as one: its workers step together, so with
    /// one of them in host RAM the others' bursts sit idle on their GPUs. Its members
    /// holding burst memory on its other GPUs are added to `picked` (resident, using swap,
    /// on a GPU with no swap-out under way, within `swap_limit` beside `host`).
    fn swap_with_their_groups(&self, picked: &mut Vec<(DeviceId, ConnId)>, mut host: u64, swap_limit: u64) {
        let groups: Vec<(DeviceId, String)> = picked
            .iter()
            .filter_map(|&(device, conn)| Some((device, self.peers.get(&conn)?.group.clone())))
            .collect();
        for (device, name) in groups {
            for (&other, gpu) in self.gpus.iter().filter(|(d, _)| **d != device) {
                if gpu.members().any(|(_, _, m)| m.residency == Residency::SwappingOut) {
                    continue;
                }
                let Some(g) = gpu.groups.get(&name) else { continue };
                for (&conn, m) in &g.members {
                    let swaps = self.peers.get(&conn).is_some_and(|p| p.resolver == Resolver::Swap);
                    if !swaps
                        || m.granted == 0
                        || m.residency != Residency::Resident
                        || picked.contains(&(other, conn))
                        || host.saturating_add(m.granted) > swap_limit
                    {
                        continue;
                    }
                    host += m.granted;
                    picked.push((other, conn));
                }
            }
        }
    }

    /// A process reports where its burst memory is after a swap (out or in) or a free
    /// of swapped-out memory: what it is granted, keeps in host RAM and holds now. Memory
    /// it gave back goes to the waiters.
    pub fn swapped(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        granted: u64,
        host_bytes: u64,
        held: u64,
        now: Instant,
    ) -> Vec<Answer> {
        // Host RAM the node's other swapped-out memory leaves under the swap limit.
        let host_room = self.swap_limit.saturating_sub(self.host_committed_except(&device, conn));
        // A process the arbiter cannot signal holds no loan, so it has none in host RAM.
        let signalable = self.peers.get(&conn).is_some_and(|p| p.signalable);
        let host_room = if signalable { host_room } else { 0 };
        let Some((gpu, group)) = self.member_gpu(conn, &device) else { return Vec::new() };
        let total = gpu.total;
        let owed = gpu.shortfall();
        let Some(g) = gpu.groups.get_mut(&group) else { return Vec::new() };
        // A report cannot put more in the ledger than was lent: a swap gives grants back or
        // uses one already made (the grant of its swap-in), never takes new ones. What it
        // keeps in host RAM is within its group's limit and what the node's swap limit
        // leaves: a report of 2^64-1 bytes swapped cannot fill host RAM. (Not within what
        // it was lent before the report: a Release may have crossed the swap-out, and a
        // swap-in for what it really has in host RAM would then be refused for ever.)
        let held = held.min(total);
        let mut back = false;
        if let Some(m) = g.members.get_mut(&conn) {
            let granted = granted.min(m.granted);
            if std::mem::take(&mut m.swapping_for_debt) {
                // Swapped out for a guarantee: what it moved off the GPU paid the debt.
                let moved = (m.granted - granted).min(owed);
                gpu.repaid.swapped = gpu.repaid.swapped.saturating_add(moved);
            }
            let reported = if signalable { host_bytes.min(g.limit) } else { 0 };
            let host_bytes = reported.min(host_room);
            (m.granted, m.host_bytes, m.host_reported, m.held) = (granted, host_bytes, reported, held);
            // Whichever way it went, the swap is over and its report says where it is.
            (m.resume_sent, m.swapping_in, m.moving) = (false, false, 0);
            if host_bytes > 0 {
                m.residency = Residency::Swapped;
                m.swapped_since.get_or_insert(now);
            } else {
                back = m.residency == Residency::Swapped;
                if let Some(since) = m.swapped_since.take() {
                    m.swapped_for += now.saturating_duration_since(since);
                }
                // Resident again (or nothing could be swapped): its quantum starts now.
                m.residency = Residency::Resident;
                m.resident_since = Some(now);
            }
        }
        let answers = Self::drain(device, gpu, now);
        // Brought back to work: not idle, whatever it did before its swap-out (it stood
        // at its gate meanwhile). Taken for idle, a process was moved out again the moment
        // its swap-in of 3.5 GiB, 5 s of copying, was reported.
        if let Some(peer) = self.peers.get_mut(&conn).filter(|_| back) {
            peer.last_active = peer.last_active.max(now);
        }
        answers
    }

    /// Swapped-out processes to tell to come back, each once per swap-out: those with a
    /// burst held back (at once), and those that may come back because memory is free and
    /// no burst was asked for on their GPU for `settle` (at most as many as the free
    /// memory holds).
    pub fn resume_candidates(&mut self, now: Instant, settle: Duration) -> Vec<(ConnId, DeviceId)> {
        let mut out = Vec::new();
        for (&device, gpu) in self.gpus.iter_mut() {
            // A process swapped out while its thread waited for a step (the step now held
            // back) asks for nothing itself: its thread waits for the step, not at its
            // gate. It is told to come back at once; its swap-in waits its turn.
            let held_back: Vec<ConnId> =
                gpu.queue.iter().filter(|w| gpu.held_back(w)).map(|w| w.conn).collect();
            for group in gpu.groups.values_mut() {
                for (&conn, m) in group.members.iter_mut() {
                    if m.residency == Residency::Swapped && !m.resume_sent && held_back.contains(&conn) {
                        m.resume_sent = true;
                        out.push((conn, device));
                    }
                }
            }
            if !gpu.queue.is_empty() || now.saturating_duration_since(gpu.last_busy) < settle {
                continue;
            }
            let mut free = gpu.free();
            for group in gpu.groups.values_mut() {
                let room = group.room();
                for (&conn, m) in group.members.iter_mut() {
                    if m.residency == Residency::Swapped && !m.resume_sent && m.host_bytes <= free.min(room) {
                        free -= m.host_bytes;
                        m.resume_sent = true;
                        out.push((conn, device));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
