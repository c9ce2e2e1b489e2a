//! Bursts served behind waiters that cannot be served (see the module doc of [`super`]).

use std::time::Instant;

use super::super::Gpu;

impl Gpu {
    /// A new burst behind waiters that cannot be served, to serve now (its place and its
    /// grant, what it needs): one whose whole claim (all it may still borrow) free memory
    /// holds beside what the bursts under way may still claim. It finishes without anyone
    /// giving back, so the GPU is left no less safe than it was (it can go first in any
    /// order there was). Only while no waiter ahead of it, nor a step of a burst under way,
    /// could be served even if every burst so served gave back what it holds: served this
    /// way, a burst never keeps those waiting beyond how long the bursts already served
    /// so take. Without it, a head that only a resolver's move can serve (the safety rule
    /// keeps it waiting) kept every small burst behind it waiting, with memory free, until
    /// their timeouts.
    pub(super) fn backfill(&self, now: Instant) -> Option<(usize, u64)> {
        // Nothing is lent while guarantees are owed memory.
        if self.shortfall() > 0 {
            return None;
        }
        let mut trial: Option<Gpu> = None;
        for (i, w) in self.queue.iter().enumerate() {
            if w.resume || self.held_back(w) || self.under_way(&w.group, now) {
                continue;
            }
            let Some(g) = self.groups.get(&w.group) else { continue };
            let room = g.room();
            let whole = room.min(self.lendable().saturating_sub(g.granted()));
            // What bursts under way that do not wait may still claim (those that wait are
            // checked below with the waiters ahead), here or, for a group bursting on
            // another of its GPUs, all it may claim here.
            let claimed: u64 = self
                .groups
                .iter()
                .filter(|(name, o)| {
                    *name != &w.group
                        && (o.granted() > 0 || self.elsewhere.contains(name.as_str()))
                        && self.under_way(name, now)
                        && !self.waits(name)
                })
                .map(|(_, o)| o.range().min(self.lendable()).saturating_sub(o.granted()))
                .sum();
            if w.bytes > whole || whole.saturating_add(claimed) > self.free() {
                continue;
            }
            let trial = trial.get_or_insert_with(|| self.without_backfills());
            let kept_waiting = self.queue.iter().enumerate().any(|(j, a)| {
                let first = j < i || (!a.resume && self.under_way(&a.group, now));
                first
                    && !self.held_back(a)
                    && if a.resume {
                        trial.swap_in_fits(a, now)
                    } else {
                        trial.servable(&a.group, a.bytes, a.preferred, now)
                    }
            });
            // Every burst behind this one has the same waiters before it, and more.
            return (!kept_waiting).then_some((i, w.bytes));
        }
        None
    }

    /// This GPU as if the bursts under way that `backfill` served had given back all they
    /// hold and were over.
    fn without_backfills(&self) -> Gpu {
        let mut trial = self.clone();
        for g in trial.groups.values_mut() {
            if g.burst.backfilled && g.burst.started.is_some() {
                g.burst.started = None;
                for m in g.members.values_mut() {
                    m.granted = 0;
                }
            }
        }
        trial
    }
}
