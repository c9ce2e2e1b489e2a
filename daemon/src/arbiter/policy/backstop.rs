//! The device's own count as the backstop. The shims' count (what their hooks charged) is
//! the fast path, and can be bypassed: raw ioctls, a statically linked or privately loaded
//! driver, an entry point nobody hooked. At every look at NVML's process list (the one
//! [`Policy::observe_processes`] already takes, every 250 ms), each group's usage on each
//! GPU (NVML's per-process figures summed over its processes' host PIDs) is compared with
//! the most its shims can have charged: its request (or what a parked group left on the
//! device) plus its grants. What the group uses beyond that, past a slack of one context
//! (or one allocation granule, whichever is larger), is *uncounted*; seen at two looks in
//! a row (so that a grant given back between NVML's listing and the comparison is not
//! taken for an escape), the smaller of the two is charged to the group: it counts
//! against the group's limit (less room for its bursts) and against the GPU (room,
//! admission and grants for everyone see it), and not as memory used outside gpufrac.
//! Freed, the charge goes at the next look.
//!
//! With `--enforce-limits end`, a group whose charged usage (request and grants plus the
//! uncounted excess) stays past its limit for `--enforce-grace` is ended.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::DeviceId;

use super::{ConnId, Gpu, Peer, Policy, Victim};

/// The driver's allocation granule (2 MiB on every current GPU): the least slack.
pub const GRANULE: u64 = 2 << 20;

/// The slack for a GPU whose context size the arbiter does not know: a context as simgpu
/// and the shim's first estimate size it (real ones take 300 to 600 MiB). A context being
/// created is charged by its shim from an estimate and corrected after it is measured:
/// one look may fall in between.
pub const UNKNOWN_CONTEXT_SLACK: u64 = 256 << 20;

/// Grace before a group still past its limit is ended (`--enforce-grace`), by default.
pub const DEFAULT_ENFORCE_GRACE: Duration = Duration::from_secs(5);

/// What the arbiter does about a group the device's count shows past what its shims
/// charged (`--enforce-limits`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EnforceLimits {
    /// The excess is charged to the group (the default).
    #[default]
    Count,
    /// Charged, and a group still past its limit after the grace is ended.
    End,
}

impl std::str::FromStr for EnforceLimits {
    type Err = String;
    fn from_str(text: &str) -> Result<EnforceLimits, String> {
        match text {
            "count" => Ok(EnforceLimits::Count),
            "end" => Ok(EnforceLimits::End),
            other => Err(format!("expected count or end, not {other:?}")),
        }
    }
}

/// A group's uncounted memory on one GPU.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Uncounted {
    /// The excess charged to the group now (confirmed at two looks in a row).
    pub charged: u64,
    /// The excess seen at the last look (what the next look confirms).
    last_seen: u64,
    /// Since when its charged usage is past its limit.
    over_limit_since: Option<Instant>,
    /// Its processes were chosen to be ended for it (once per episode).
    ended: bool,
}

/// What the backstop found at a look, for the server to log, show and act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// A group was found holding memory its shims did not charge (the start of an
    /// episode): logged once at WARN.
    Found {
        /// The GPU.
        device: DeviceId,
        /// The group as shown.
        group: String,
        /// Its processes' host PIDs with what NVML shows each using.
        pids: Vec<(u32, u64)>,
        /// The connection of its largest user (what the event is about).
        conn: ConnId,
        /// The excess charged.
        bytes: u64,
        /// What NVML shows the group using in all.
        used: u64,
        /// Its limit.
        limit: u64,
    },
    /// The excess is gone (freed): the charge went with it.
    Cleared {
        /// The GPU.
        device: DeviceId,
        /// The group as shown.
        group: String,
    },
}

/// What NVML's figure `used` shows beyond `believed` (the most the shims can have
/// charged), if it is more than `slack` beyond; else nothing.
pub fn excess(used: u64, believed: u64, slack: u64) -> u64 {
    if used > believed.saturating_add(slack) {
        used - believed
    } else {
        0
    }
}

/// The slack for a GPU whose contexts take `context` bytes (if known).
pub fn slack(context: Option<u64>) -> u64 {
    context.unwrap_or(UNKNOWN_CONTEXT_SLACK).max(GRANULE)
}

impl Gpu {
    /// What the groups hold that their shims did not charge, in all.
    pub(super) fn uncounted(&self) -> u64 {
        self.groups.values().fold(0u64, |sum, g| sum.saturating_add(g.uncounted.charged))
    }

    /// Memory on the device outside the groups' requests and grants: used by processes
    /// outside gpufrac, or by groups beyond what they charged.
    pub(super) fn unaccounted(&self) -> u64 {
        self.outside().saturating_add(self.uncounted())
    }

    /// Compares each group's usage as NVML last listed it (`self.seen`) with what its
    /// shims can have charged, and charges the confirmed excess (see the module doc).
    pub(super) fn compare(
        &mut self,
        device: DeviceId,
        peers: &HashMap<ConnId, Peer>,
        now: Instant,
        findings: &mut Vec<Finding>,
    ) {
        let slack = slack(self.context_bytes);
        let total = self.total;
        for (name, group) in self.groups.iter_mut() {
            let mut pids: Vec<u32> =
                group.members.keys().filter_map(|c| peers.get(c).map(|p| p.pid)).collect();
            pids.sort_unstable();
            pids.dedup();
            let used_by = |pid: &u32| self.seen.get(pid).copied().unwrap_or(0);
            let used = pids.iter().fold(0u64, |sum, pid| sum.saturating_add(used_by(pid))).min(total);
            // The most its shims can have charged: a shim holds itself to its request and
            // its grants (a parked group to what it left on the device). What its members
            // last reported holding is no more than that, but may be older. Memory its own
            // swaps move is never charged, whenever the device's count catches it: what a
            // swap-out was told to move, and a swapped-out member's host copy.
            let reported = group.members.values().fold(0u64, |sum, m| sum.saturating_add(m.held));
            let counted = group.reserved().saturating_add(group.granted()).max(reported);
            let believed = counted.saturating_add(group.in_transit());
            let seen = excess(used, believed, slack);
            let u = &mut group.uncounted;
            let before = u.charged;
            u.charged = seen.min(u.last_seen);
            u.last_seen = seen;
            let shown = crate::entitlement::shown_group(name).to_owned();
            if before == 0 && u.charged > 0 {
                let conn = group
                    .members
                    .keys()
                    .copied()
                    .max_by_key(|c| peers.get(c).map_or(0, |p| used_by(&p.pid)))
                    .unwrap_or_default();
                let pids = pids.iter().map(|pid| (*pid, used_by(pid))).collect();
                let (bytes, limit) = (u.charged, group.limit);
                findings.push(Finding::Found { device, group: shown, pids, conn, bytes, used, limit });
            } else if before > 0 && u.charged == 0 {
                findings.push(Finding::Cleared { device, group: shown });
            }
            // Past its limit by the device's count: found here, or found by its shims
            // (a shim that sees its process holding more than it charged charges the
            // excess past the limit and reports holding it).
            let past = (u.charged > 0 && counted.saturating_add(u.charged) > group.limit)
                || reported > group.limit.saturating_add(GRANULE);
            if !past {
                // An episode past the limit is over: a later one has a grace of its own.
                u.over_limit_since = None;
                u.ended = false;
            } else if u.over_limit_since.is_none() {
                u.over_limit_since = Some(now);
            }
        }
    }
}

impl Policy {
    /// Sets what a context takes on `device` (the slack of its comparison).
    pub fn set_context_bytes(&mut self, device: &DeviceId, bytes: u64) {
        if let Some(gpu) = self.gpus.get_mut(device) {
            gpu.context_bytes = Some(bytes);
        }
    }

    /// What the comparisons found since the last call.
    pub fn take_findings(&mut self) -> Vec<Finding> {
        std::mem::take(&mut self.findings)
    }

    /// The processes to end under `--enforce-limits end`: every member (that can be
    /// signalled, and is not in `spared`, being ended already) of each group whose charged
    /// usage has been past its limit for `grace`, once per episode.
    pub fn over_limit_victims(
        &mut self,
        now: Instant,
        grace: Duration,
        spared: &[ConnId],
    ) -> Vec<(DeviceId, Victim)> {
        let mut victims = Vec::new();
        for (&device, gpu) in self.gpus.iter_mut() {
            for (name, group) in gpu.groups.iter_mut() {
                let u = &mut group.uncounted;
                let due = u.over_limit_since.is_some_and(|t| now.saturating_duration_since(t) >= grace);
                if !due || u.ended {
                    continue;
                }
                u.ended = true;
                let why = format!(
                    "{} held beyond what its shims charged, past its limit of {} for {}s",
                    super::gib(u.charged),
                    super::gib(group.limit),
                    grace.as_secs_f64()
                );
                for &conn in group.members.keys() {
                    let Some(peer) = self.peers.get(&conn) else { continue };
                    if spared.contains(&conn) || !peer.signalable {
                        continue;
                    }
                    let group = crate::entitlement::shown_group(name).to_owned();
                    let victim = Victim { conn, pid: peer.pid, group, bytes: u.charged, why: why.clone() };
                    victims.push((device, victim));
                }
            }
        }
        victims
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn an_excess_counts_only_past_the_slack() {
        assert_eq!(excess(GIB, GIB, 2 * MIB), 0);
        assert_eq!(excess(GIB + 2 * MIB, GIB, 2 * MIB), 0);
        assert_eq!(excess(GIB + 3 * MIB, GIB, 2 * MIB), 3 * MIB, "the whole excess, once past");
        assert_eq!(excess(u64::MAX, 0, 0), u64::MAX);
        assert_eq!(slack(None), UNKNOWN_CONTEXT_SLACK);
        assert_eq!(slack(Some(400 * MIB)), 400 * MIB);
        assert_eq!(slack(Some(MIB)), GRANULE, "never below one granule");
    }

    #[test]
    fn the_flag_takes_count_or_end() {
        assert_eq!("count".parse(), Ok(EnforceLimits::Count));
        assert_eq!("end".parse(), Ok(EnforceLimits::End));
        let err = "kill".parse::<EnforceLimits>().unwrap_err();
        assert!(err.contains("count or end") && err.contains("kill"), "{err}");
    }

    /// A 16 GiB GPU with group a (pid 100: request 2 GiB, limit 4 GiB) and group b (pid
    /// 200: request 2 GiB, limit 8 GiB).
    fn two_groups() -> Policy {
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.hello(1, Peer { pid: 100, ..peer("a", 1000) });
        p.register(1, GPU, 16 * GIB, 2 * GIB, 4 * GIB, 0, 0, 0).unwrap();
        p.hello(2, Peer { pid: 200, ..peer("b", 1000) });
        p.register(2, GPU, 16 * GIB, 2 * GIB, 8 * GIB, 0, 0, 0).unwrap();
        p
    }

    fn uncounted(p: &Policy, group: &str) -> u64 {
        p.gpus[&GPU]
            .groups
            .values()
            .find(|g| g.members.keys().any(|c| p.peers[c].group == group))
            .map_or(0, |g| g.uncounted.charged)
    }

    #[test]
    fn an_excess_seen_twice_is_charged_to_the_group_not_outside() {
        let now = Instant::now();
        let mut p = two_groups();
        // a uses 3 GiB with nothing lent: 1 GiB its shim cannot have charged.
        p.observe_processes(GPU, &[(100, 3 * GIB)], now);
        assert_eq!(uncounted(&p, "a"), 0, "one look is not enough");
        assert!(p.take_findings().is_empty());
        p.observe_processes(GPU, &[(100, 3 * GIB)], now);
        assert_eq!(uncounted(&p, "a"), GIB);
        let s = &p.status().gpus[0];
        assert_eq!(s.outside, 0, "not memory outside gpufrac");
        assert_eq!(s.uncounted, GIB);
        assert_eq!(s.free, 16 * GIB - 4 * GIB - GIB, "the GPU's room sees it");
        let a = s.processes.iter().find(|x| x.group == "a").unwrap();
        assert_eq!(a.uncounted, GIB);
        let findings = p.take_findings();
        assert_eq!(findings.len(), 1);
        let Finding::Found { group, pids, bytes, used, limit, .. } = &findings[0] else {
            panic!("{findings:?}")
        };
        assert_eq!(
            (group.as_str(), pids.as_slice(), *bytes, *used, *limit),
            ("a", &[(100, 3 * GIB)][..], GIB, 3 * GIB, 4 * GIB)
        );
        // Once per episode: a look that finds it again says nothing new.
        p.observe_processes(GPU, &[(100, 3 * GIB)], now);
        assert!(p.take_findings().is_empty());
        // Freed: the charge goes at once.
        p.observe_processes(GPU, &[(100, 2 * GIB)], now);
        assert_eq!(uncounted(&p, "a"), 0);
        assert_eq!(p.status().gpus[0].free, 12 * GIB);
        assert!(matches!(p.take_findings().as_slice(), [Finding::Cleared { .. }]));
    }

    #[test]
    fn the_smaller_of_two_looks_is_charged() {
        let now = Instant::now();
        let mut p = two_groups();
        p.observe_processes(GPU, &[(100, 3 * GIB)], now);
        p.observe_processes(GPU, &[(100, 5 * GIB)], now);
        assert_eq!(uncounted(&p, "a"), GIB);
        p.observe_processes(GPU, &[(100, 5 * GIB)], now);
        assert_eq!(uncounted(&p, "a"), 3 * GIB);
    }

    #[test]
    fn within_the_slack_nothing_is_charged() {
        let now = Instant::now();
        let mut p = two_groups();
        for _ in 0..3 {
            p.observe_processes(GPU, &[(100, 2 * GIB + UNKNOWN_CONTEXT_SLACK)], now);
        }
        assert_eq!(uncounted(&p, "a"), 0);
        // With a known context size the slack is that size.
        p.set_context_bytes(&GPU, 64 << 20);
        for _ in 0..2 {
            p.observe_processes(GPU, &[(100, 2 * GIB + (100 << 20))], now);
        }
        assert_eq!(uncounted(&p, "a"), 100 << 20);
    }

    #[test]
    fn grants_and_what_members_report_are_what_the_shims_charged() {
        let now = Instant::now();
        let mut p = two_groups();
        assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 3 * GIB, false, now), Outcome::Granted(GIB));
        for _ in 0..2 {
            p.observe_processes(GPU, &[(100, 3 * GIB)], now);
        }
        assert_eq!(uncounted(&p, "a"), 0, "request and grant");
        // Members of a group are summed.
        p.hello(3, Peer { pid: 101, ..peer("a", 1000) });
        p.register(3, GPU, 16 * GIB, 2 * GIB, 4 * GIB, 0, 0, 0).unwrap();
        for _ in 0..2 {
            p.observe_processes(GPU, &[(100, 3 * GIB), (101, 2 * GIB)], now);
        }
        assert_eq!(uncounted(&p, "a"), 2 * GIB);
    }

    #[test]
    fn memory_a_groups_own_swap_moves_is_never_charged_to_it() {
        let now = Instant::now();
        let mut p = two_groups();
        let looks = |p: &mut Policy, used: u64| {
            for _ in 0..2 {
                p.observe_processes(GPU, &[(100, used)], now);
            }
            uncounted(p, "a")
        };
        // a swapped 1 GiB of burst memory out, and is granted its swap-in.
        p.register(1, GPU, 16 * GIB, 2 * GIB, 4 * GIB, 2 * GIB, 0, GIB).unwrap();
        assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 2 * GIB, true, now), Outcome::Granted(GIB));
        // While it maps the memory back, a Release crosses (an older shim answering a
        // reclaim gives back what it has not mapped yet): the device shows it all.
        p.release(1, GPU, GIB / 2, 2 * GIB + GIB / 2, now);
        assert_eq!(looks(&mut p, 3 * GIB), 0, "a swap-in under way");
        // Its report: resident, holding what the device shows.
        p.swapped(1, GPU, GIB / 2, 0, 3 * GIB, now);
        assert_eq!(looks(&mut p, 3 * GIB), 0);
        // It frees that and bursts by 1 GiB again.
        p.release(1, GPU, GIB / 2, 2 * GIB, now);
        assert_eq!(p.acquire(1, GPU, 2, GIB, GIB, 2 * GIB, false, now), Outcome::Granted(GIB));
        // Told to swap out; a Release crosses the copy, and the device frees last.
        assert!(p.start_swap_out(GPU, 1, now).is_some());
        p.release(1, GPU, GIB / 2, 2 * GIB, now);
        assert_eq!(looks(&mut p, 3 * GIB), 0, "a swap-out under way");
        // Its report comes between a listing and the comparison: the device still shows
        // what it moved.
        p.swapped(1, GPU, 0, GIB, 2 * GIB, now);
        assert_eq!(looks(&mut p, 3 * GIB), 0, "a listing older than the swap-out's report");
        assert!(p.take_findings().is_empty());
        // Beyond what its swap moves, memory is still charged: 1 GiB past request, grants
        // and host copy.
        assert_eq!(looks(&mut p, 4 * GIB), GIB);
        assert_eq!(looks(&mut p, 2 * GIB), 0);
    }

    #[test]
    fn an_uncounted_excess_counts_against_the_groups_limit_and_others_bursts() {
        let now = Instant::now();
        let mut p = two_groups();
        for _ in 0..2 {
            p.observe_processes(GPU, &[(100, 3 * GIB + GIB / 2)], now);
        }
        // a's burst range is 2 GiB; 1.5 GiB of it is used uncounted.
        assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 0, false, now), Outcome::Denied(Denial::OverLimit));
        assert_eq!(p.acquire(1, GPU, 2, GIB / 2, GIB / 2, 0, false, now), Outcome::Granted(GIB / 2));
        // b: 16 - 4 guaranteed - 0.5 lent - 1.5 uncounted = 10 GiB free.
        assert_eq!(p.status().gpus[0].free, 10 * GIB);
        assert_eq!(p.acquire(2, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Granted(6 * GIB));
        // Nor does admission forget it: 16 - 4 - 1.5 leaves 10.5 GiB for requests.
        p.hello(3, Peer { pid: 300, ..peer("c", 1000) });
        let err = p.register(3, GPU, 16 * GIB, 11 * GIB, 11 * GIB, 0, 0, 0).unwrap_err();
        assert!(err.contains("does not fit") && err.contains("1.50 GiB is held uncounted"), "{err}");
    }

    #[test]
    fn a_group_past_its_limit_is_ended_after_the_grace_once() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(5);
        let mut p = two_groups();
        p.hello(3, Peer { pid: 101, ..peer("a", 1000) });
        p.register(3, GPU, 16 * GIB, 2 * GIB, 4 * GIB, 0, 0, 0).unwrap();
        // 3 GiB uncounted: 2 GiB of request and 3 GiB are past its limit of 4 GiB.
        p.observe_processes(GPU, &[(100, 4 * GIB), (101, GIB)], t0);
        p.observe_processes(GPU, &[(100, 4 * GIB), (101, GIB)], t0);
        assert!(p.over_limit_victims(t0 + grace / 2, grace, &[]).is_empty(), "within the grace");
        let victims = p.over_limit_victims(t0 + grace, grace, &[3]);
        assert_eq!(
            victims.iter().map(|(d, v)| (*d, v.conn, v.pid)).collect::<Vec<_>>(),
            [(GPU, 1, 100)],
            "3 is being ended"
        );
        assert!(victims[0].1.why.contains("past its limit of 4.00 GiB"), "{}", victims[0].1.why);
        assert!(p.over_limit_victims(t0 + 2 * grace, grace, &[]).is_empty(), "once");
        // Back under its limit, the grace starts over.
        p.observe_processes(GPU, &[(100, 2 * GIB), (101, GIB)], t0);
        p.observe_processes(GPU, &[(100, 3 * GIB), (101, GIB)], t0 + grace);
        p.observe_processes(GPU, &[(100, 3 * GIB), (101, GIB)], t0 + grace);
        assert!(p.over_limit_victims(t0 + 3 * grace, grace, &[]).is_empty(), "2 GiB uncounted is within 4");
        // Group b, within its limit of 8 GiB with 3 GiB uncounted, is never ended.
        p.observe_processes(GPU, &[(200, 5 * GIB)], t0);
        p.observe_processes(GPU, &[(200, 5 * GIB)], t0);
        assert!(p.over_limit_victims(t0 + 10 * grace, grace, &[]).is_empty());
    }

    #[test]
    fn a_group_whose_shims_report_it_past_its_limit_is_ended_too() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(5);
        let mut p = two_groups();
        // a's shim found 1.5 GiB its hooks did not see and reports holding 5.5 GiB, past
        // its 4 GiB limit; the device shows the same, so nothing is uncounted here.
        p.release(1, GPU, 0, 5 * GIB + GIB / 2, t0);
        p.observe_processes(GPU, &[(100, 5 * GIB + GIB / 2)], t0);
        p.observe_processes(GPU, &[(100, 5 * GIB + GIB / 2)], t0);
        assert_eq!(uncounted(&p, "a"), 0);
        let victims = p.over_limit_victims(t0 + grace, grace, &[]);
        assert_eq!(victims.iter().map(|(_, v)| v.pid).collect::<Vec<_>>(), [100]);
    }
}
