//! Compute shares: each group's guaranteed share of a GPU's time (its compute request)
//! and the most it may take (its compute limit), kept by pacing the groups that take more
//! than they are allowed while others want theirs.
//!
//! The rule, per GPU, every time fresh utilization samples arrive:
//! - A group is *active* while its processes kept the GPU busy (at least 1% of a sample)
//!   within the last [`ACTIVE_WINDOW`], or their shims reported launches, copies or sets
//!   within [`ACTIVITY_WINDOW`] (a real GPU's NVML may go a while without a sample of a
//!   process that runs little, a paced one say).
//! - A group alone among the active ones may use the GPU up to its limit.
//! - Beside other active groups, each gets its request, and the time no active group
//!   requested is shared in proportion to the requests, never past a limit. The unused
//!   part of an active group's request is kept for it: a latency-sensitive server's
//!   request is there the moment its next request arrives, which is what keeps its
//!   queueing short beside a flooding neighbour. Time of groups that are not active is
//!   lent (work-conserving).
//! - A group using more than its allowance is *paced*, as long as another active group is
//!   not (that one's share is what the pacing protects; beside groups that are all paced
//!   already, what it takes is time they cannot use, and pacing it too would leave the GPU
//!   idle): the shim lets its calls start work only a fraction of the wall clock (see
//!   shim/src/compute.rs). The fraction is corrected from what the GPU reports the group
//!   used (an integral controller) and remembered as a factor over the allowance, so that
//!   what the group gets converges on its allowance whatever its kernels look like, and a
//!   group paced again starts where it left off.
//!
//! Processes without compute settings are neither paced nor guaranteed anything; what
//! they use is shown (status's `compute_outside`) but not planned around.

use std::time::{Duration, Instant};

use gpufrac_common::protocol::DeviceId;
use gpufrac_common::ComputeSpec;

use super::{uuid_string, ConnId, Gpu, Peer, Policy};

/// How long after its last busy sample a group still counts as active.
pub const ACTIVE_WINDOW: Duration = Duration::from_secs(1);
/// How long after its shim last reported activity a group still counts as active (the
/// shim reports at most once a second).
pub const ACTIVITY_WINDOW: Duration = Duration::from_millis(2500);
/// Below this share of a sample a process is idle (a stray launch is not activity).
const BUSY_SHARE: f64 = 0.01;
/// How much a pace moves per unit of error (allowance - use) at each sample.
const GAIN: f64 = 0.25;
/// A group starts being paced once it uses this much more than its allowance.
const PACE_MARGIN: f64 = 0.02;
/// Least pace: a paced group always makes some progress.
const MIN_PACE: f64 = 0.01;
/// Most pace while paced: a group the controller would pace higher, and that still uses
/// less than its target, is not held by its pace; it is lifted (a real GPU's noisy samples
/// would otherwise lift and pace it by turns).
const MAX_PACE: f64 = 0.95;
/// How far a new pace must move from the one a member was told before it is told again
/// (per mille), unless it starts or stops pacing.
const PACE_STEP: u16 = 5;
/// Weight of the newest sample in a group's smoothed use.
const SMOOTHING: f64 = 0.4;

/// A group's compute state on one GPU.
#[derive(Debug, Clone, Default)]
pub(super) struct GroupCompute {
    /// Its share; `None`: not controlled.
    pub spec: Option<ComputeSpec>,
    /// Its smoothed share of the GPU's time (0 to 1).
    pub used: f64,
    /// When a sample last showed it busy.
    pub last_busy: Option<Instant>,
    /// What it may use now (0 to 1), as last planned.
    pub allowance: f64,
    /// Its pace (0 to 1); 1: unpaced.
    pub pace: f64,
    /// The pace it needed over its allowance, learnt while paced (1 until then): where a
    /// new pacing starts.
    pub factor: f64,
}

impl GroupCompute {
    fn busy_lately(&self, now: Instant) -> bool {
        self.last_busy.is_some_and(|t| now.saturating_duration_since(t) <= ACTIVE_WINDOW)
    }

    fn paced(&self) -> bool {
        self.pace > 0.0 && self.pace < 1.0
    }

    /// The pace in per mille, as the shim is told it.
    pub fn pace_pm(&self) -> u16 {
        if self.pace >= 1.0 || self.pace <= 0.0 {
            1000
        } else {
            ((self.pace * 1000.0).round() as u16).clamp(1, 1000)
        }
    }
}

/// What each group may use, by the rule above: `groups` are (request, limit, active)
/// shares; inactive groups get their limit (they may start at any time).
pub fn allowances(groups: &[(f64, f64, bool)]) -> Vec<f64> {
    let active: Vec<usize> = (0..groups.len()).filter(|&i| groups[i].2).collect();
    let mut out: Vec<f64> = groups.iter().map(|&(_, limit, _)| limit).collect();
    if active.len() <= 1 {
        return out;
    }
    for &i in &active {
        out[i] = groups[i].0.min(groups[i].1);
    }
    // Share what no active group requested, in proportion to the requests (equally among
    // groups that requested nothing if none did), a few rounds so that what a capped
    // group cannot take goes to the others.
    for _ in 0..4 {
        let spare = 1.0 - active.iter().map(|&i| out[i]).sum::<f64>();
        let open: Vec<usize> = active.iter().copied().filter(|&i| out[i] < groups[i].1 - 1e-9).collect();
        if spare <= 1e-9 || open.is_empty() {
            break;
        }
        let weight: f64 = open.iter().map(|&i| groups[i].0).sum();
        for &i in &open {
            let part = if weight > 0.0 { groups[i].0 / weight } else { 1.0 / open.len() as f64 };
            out[i] = (out[i] + spare * part).min(groups[i].1);
        }
    }
    out
}

/// A pace to tell a member: the connection, the GPU and the pace in per mille.
pub type PaceOrder = (ConnId, DeviceId, u16);

impl Policy {
    /// Whether any group has a compute share (the arbiter samples utilization only then).
    pub fn compute_controlled(&self) -> bool {
        self.gpus.values().any(|g| g.groups.values().any(|group| group.compute.spec.is_some()))
    }

    /// Checks a registration's compute share: a new group's request must fit beside the
    /// other groups' requests (at most the whole GPU), a member must declare its group's.
    pub(super) fn admit_compute(gpu: &Gpu, device: &DeviceId, peer: &Peer) -> Result<(), String> {
        if let Some(group) = gpu.groups.get(&peer.group) {
            if group.compute.spec != peer.compute {
                return Err(format!(
                    "GPUFRAC_COMPUTE_REQUEST/GPUFRAC_COMPUTE_LIMIT are {} for GPUFRAC_GROUP {:?} but {} for this process: a group's processes must declare the same compute share",
                    shown(group.compute.spec),
                    crate::entitlement::shown_group(&peer.group),
                    shown(peer.compute),
                ));
            }
            return Ok(());
        }
        let Some(spec) = peer.compute else { return Ok(()) };
        let requested: u32 = gpu
            .groups
            .values()
            .filter_map(|g| g.compute.spec)
            .map(|s| u32::from(s.request.per_mille()))
            .sum();
        if requested + u32::from(spec.request.per_mille()) > 1000 {
            return Err(format!(
                "GPUFRAC_COMPUTE_REQUEST ({}) does not fit on GPU {}: {} of its time is guaranteed to other groups",
                spec.request,
                uuid_string(device),
                gpufrac_common::ComputeShare::from_per_mille(requested.min(1000) as u16).unwrap_or_default(),
            ));
        }
        Ok(())
    }

    /// Takes fresh utilization samples, `(pid, share of the GPU's time)` per GPU since the
    /// previous call (a GPU absent from `samples` could not be read: nothing changes there),
    /// re-plans the allowances and returns the paces to tell members whose pace changed.
    pub fn compute_step(&mut self, now: Instant, samples: &[(DeviceId, Vec<(u32, f64)>)]) -> Vec<PaceOrder> {
        let mut orders = Vec::new();
        for (device, shares) in samples {
            let Some(gpu) = self.gpus.get_mut(device) else { continue };
            let mut accounted = 0.0;
            for group in gpu.groups.values_mut() {
                let pids: Vec<u32> =
                    group.members.keys().filter_map(|c| self.peers.get(c)).map(|p| p.pid).collect();
                let share: f64 = shares
                    .iter()
                    .filter(|(pid, _)| pids.contains(pid))
                    .map(|&(_, s)| s.clamp(0.0, 1.0))
                    .sum();
                if group.compute.spec.is_some() {
                    accounted += share;
                }
                let c = &mut group.compute;
                // The first sample is taken as it is: nothing to smooth it with.
                let weight = if c.last_busy.is_none() { 1.0 } else { SMOOTHING };
                c.used = weight * share.min(1.0) + (1.0 - weight) * c.used;
                if share >= BUSY_SHARE {
                    c.last_busy = Some(now);
                }
            }
            let total: f64 = shares.iter().map(|&(_, s)| s.clamp(0.0, 1.0)).sum();
            gpu.compute_outside =
                SMOOTHING * (total - accounted).max(0.0) + (1.0 - SMOOTHING) * gpu.compute_outside;
            let names: Vec<String> =
                gpu.groups.iter().filter(|(_, g)| g.compute.spec.is_some()).map(|(n, _)| n.clone()).collect();
            let peers = &self.peers;
            let active: Vec<bool> = names
                .iter()
                .map(|n| {
                    let g = &gpu.groups[n];
                    let reported = g.members.keys().filter_map(|c| peers.get(c)).any(|p| {
                        p.activity > 0 && now.saturating_duration_since(p.last_active) <= ACTIVITY_WINDOW
                    });
                    g.compute.busy_lately(now) || reported
                })
                .collect();
            let shares: Vec<(f64, f64, bool)> = names
                .iter()
                .zip(&active)
                .map(|(n, &active)| {
                    let spec = gpu.groups[n].compute.spec.unwrap_or(ComputeSpec {
                        request: gpufrac_common::ComputeShare::ZERO,
                        limit: gpufrac_common::ComputeShare::WHOLE,
                    });
                    (spec.request.fraction(), spec.limit.fraction(), active)
                })
                .collect();
            let planned = allowances(&shares);
            // Whose share pacing protects: active groups not paced themselves.
            let unpaced: Vec<bool> =
                names.iter().zip(&active).map(|(n, &a)| a && !gpu.groups[n].compute.paced()).collect();
            for (i, (name, allowance)) in names.iter().zip(planned).enumerate() {
                let protects = (0..names.len()).any(|j| j != i && unpaced[j]);
                let Some(group) = gpu.groups.get_mut(name) else { continue };
                let c = &mut group.compute;
                let before = c.pace_pm();
                c.allowance = allowance;
                // Beside groups that are all paced, it may take up to its limit.
                let target = if protects { allowance } else { shares[i].1 };
                (c.pace, c.factor) = next_pace(c.pace, c.factor, c.used, target, active[i]);
                let after = c.pace_pm();
                if before != after && (before == 1000 || after == 1000) {
                    tracing::info!(group = %crate::entitlement::shown_group(name), gpu = %uuid_string(device),
                        used = format!("{:.1}%", c.used * 100.0), allowance = format!("{:.1}%", allowance * 100.0),
                        "{}", if after < 1000 { "pacing a group past its compute allowance" } else { "a group's compute pace lifted" });
                }
                for (&conn, member) in group.members.iter_mut() {
                    let told = if member.pace_told == 0 { 1000 } else { member.pace_told };
                    let moved = told.abs_diff(after);
                    if moved >= PACE_STEP || (moved > 0 && (after == 1000 || told == 1000)) {
                        member.pace_told = after;
                        orders.push((conn, *device, after));
                    }
                }
            }
        }
        orders
    }
}

/// The next pace and factor of a group that used `used` of the GPU against a `target`.
fn next_pace(pace: f64, factor: f64, used: f64, target: f64, active: bool) -> (f64, f64) {
    let factor = if factor > 0.0 { factor } else { 1.0 };
    let unpaced = pace >= 1.0 || pace <= 0.0;
    if !active || target >= 0.999 {
        return (1.0, factor);
    }
    if unpaced {
        // Not paced yet: start where the last pacing left off, once over the target.
        return if used > target + PACE_MARGIN {
            ((target * factor).clamp(MIN_PACE, MAX_PACE), factor)
        } else {
            (1.0, factor)
        };
    }
    let next = (pace + GAIN * (target - used)).clamp(MIN_PACE, MAX_PACE);
    if next >= MAX_PACE && used < target - PACE_MARGIN {
        // Paced as high as pacing goes and still under its target: its pace holds it back
        // no more.
        return (1.0, factor);
    }
    // The factor is learnt up to 10: more means the group's work barely runs when it may
    // (a lone kernel per window beside a busy neighbour), nothing to remember.
    (next, (next / target.max(MIN_PACE)).clamp(0.1, 10.0))
}

fn shown(spec: Option<ComputeSpec>) -> String {
    spec.map_or("unset".to_owned(), |s| format!("{}/{}", s.request, s.limit))
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::*;
    use gpufrac_common::ComputeShare;

    fn share(request: u16, limit: u16) -> Option<ComputeSpec> {
        Some(ComputeSpec {
            request: ComputeShare::from_per_mille(request).unwrap(),
            limit: ComputeShare::from_per_mille(limit).unwrap(),
        })
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn alone_a_group_may_use_its_limit_beside_others_its_request_and_the_unrequested_time() {
        assert!(close(&allowances(&[(0.3, 1.0, true)]), &[1.0]));
        assert!(close(&allowances(&[(0.3, 0.6, true), (0.7, 1.0, false)]), &[0.6, 1.0]));
        assert!(close(&allowances(&[(0.3, 1.0, true), (0.7, 1.0, true)]), &[0.3, 0.7]));
        // 40% nobody requested, shared 1:3, the first capped at its limit of 0.25 and what
        // it cannot take going to the other.
        let a = allowances(&[(0.1, 0.25, true), (0.3, 1.0, true)]);
        assert!(close(&a, &[0.25, 0.75]), "{a:?}");
        // Nobody requested anything: equal shares.
        assert!(close(&allowances(&[(0.0, 1.0, true), (0.0, 1.0, true)]), &[0.5, 0.5]));
    }

    /// A GPU with compute groups on connections 1.. (pids 101..), each its own group.
    fn gpu_with(shares: &[Option<ComputeSpec>]) -> Policy {
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        for (i, &compute) in shares.iter().enumerate() {
            let conn = i as u64 + 1;
            p.hello(conn, Peer { pid: 100 + conn as u32, compute, ..peer(&format!("g{conn}"), 1000) });
            p.register(conn, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap();
        }
        p
    }

    #[test]
    fn compute_requests_past_the_whole_gpu_are_refused_naming_the_variable() {
        let mut p = gpu_with(&[share(600, 1000), None]);
        p.hello(9, Peer { pid: 109, compute: share(500, 500), ..peer("late", 1000) });
        let e = p.register(9, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap_err();
        assert!(e.contains("GPUFRAC_COMPUTE_REQUEST (50%)") && e.contains("60%"), "{e}");
        p.hello(10, Peer { pid: 110, compute: share(400, 400), ..peer("fits", 1000) });
        p.register(10, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap();
        // A member must declare its group's share.
        p.hello(11, Peer { pid: 111, compute: share(100, 100), ..peer("g1", 1000) });
        let e = p.register(11, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap_err();
        assert!(e.contains("60%/100%") && e.contains("10%/10%"), "{e}");
    }

    /// Plays `steps` samples of 100 ms in which each group would use `wants` of the GPU
    /// unpaced, and uses min(its pace, what the GPU's time-slicing gives it); returns the
    /// last shares.
    fn play(p: &mut Policy, wants: &[f64], steps: usize) -> Vec<f64> {
        let mut now = Instant::now();
        let mut got = vec![0.0; wants.len()];
        for _ in 0..steps {
            let paces: Vec<f64> = (0..wants.len())
                .map(|i| {
                    let g = &p.gpus[&GPU].groups[&format!("g{}", i + 1)];
                    f64::from(g.compute.pace_pm()) / 1000.0
                })
                .collect();
            // Round-robin slicing among those that want time, each capped by its pace.
            let mut left = 1.0;
            let mut open: Vec<usize> = (0..wants.len()).filter(|&i| wants[i] > 0.0).collect();
            got = vec![0.0; wants.len()];
            while left > 1e-6 && !open.is_empty() {
                let each = left / open.len() as f64;
                for &i in &open {
                    let take = each.min(wants[i].min(paces[i]) - got[i]);
                    got[i] += take;
                    left -= take;
                }
                open.retain(|&i| got[i] < wants[i].min(paces[i]) - 1e-6);
            }
            let samples: Vec<(u32, f64)> =
                got.iter().enumerate().map(|(i, &s)| (101 + i as u32, s)).collect();
            p.compute_step(now, &[(GPU, samples)]);
            now += Duration::from_millis(100);
        }
        got
    }

    #[test]
    fn two_saturating_groups_converge_on_their_requests() {
        let mut p = gpu_with(&[share(300, 1000), share(700, 1000)]);
        let got = play(&mut p, &[1.0, 1.0], 100);
        assert!((got[0] - 0.3).abs() < 0.03 && (got[1] - 0.7).abs() < 0.03, "{got:?}");
    }

    #[test]
    fn a_group_alone_is_not_paced_below_its_limit_and_is_paced_down_to_a_limit_below_the_gpu() {
        let mut p = gpu_with(&[share(300, 1000), share(700, 1000)]);
        let got = play(&mut p, &[1.0, 0.0], 30);
        assert!(got[0] > 0.99, "{got:?}");
        assert_eq!(p.gpus[&GPU].groups["g1"].compute.pace_pm(), 1000);
        let mut p = gpu_with(&[share(200, 600)]);
        let got = play(&mut p, &[1.0], 60);
        assert!((got[0] - 0.6).abs() < 0.03, "{got:?}");
    }

    #[test]
    fn a_paced_group_is_told_its_pace_and_told_again_when_it_is_lifted() {
        let mut p = gpu_with(&[share(300, 1000), share(700, 1000)]);
        let now = Instant::now();
        let orders = p.compute_step(now, &[(GPU, vec![(101, 0.5), (102, 0.5)])]);
        assert_eq!(orders, vec![(1, GPU, 300)], "the group over its request is paced at its allowance");
        // The neighbour stops: after the active window the first group is unpaced.
        let later = now + ACTIVE_WINDOW + Duration::from_millis(100);
        let orders = p.compute_step(later, &[(GPU, vec![(101, 0.3)])]);
        assert_eq!(orders, vec![(1, GPU, 1000)]);
        // A process without compute settings is neither paced nor planned around.
        let mut p = gpu_with(&[share(300, 1000), None]);
        assert!(p.compute_step(now, &[(GPU, vec![(101, 0.5), (102, 0.5)])]).is_empty());
        assert!(p.gpus[&GPU].compute_outside > 0.15);
    }
}
