//! The server's side of the backstop (see `policy::backstop` for the rule): logs each
//! episode of memory held uncounted once, keeps it as an event for `gpufrac top`, and under
//! `--enforce-limits end` ends the groups still past their limit after `--enforce-grace`,
//! the way the priority resolver ends its victims.

use std::time::Instant;

use super::document::record;
use super::endings::{end, ending};
use super::{EventKind, Shared};
use crate::arbiter::policy::{uuid_string, EnforceLimits, Finding, Policy};

/// Acts on what the last comparison of the device's count with the shims' found.
pub(super) fn backstop(shared: &Shared, policy: &mut Policy) {
    let findings = policy.take_findings();
    for finding in findings {
        match finding {
            Finding::Found { device, group, pids, conn, bytes, used, limit } => {
                let gpu = uuid_string(&device);
                let listed: Vec<String> =
                    pids.iter().map(|(pid, used)| format!("{pid} ({used} bytes)")).collect();
                tracing::warn!(
                    %gpu,
                    %group,
                    pids = %listed.join(", "),
                    bytes,
                    used,
                    limit,
                    enforce = ?shared.options.enforce_limits,
                    "group {group} holds {bytes} bytes beyond what its shims counted (the device shows {used} bytes used by PIDs {}, limit {limit}): charged to it",
                    listed.join(", ")
                );
                // Named after its largest user.
                let pid = pids.iter().max_by_key(|(_, used)| *used).map_or(0, |(pid, _)| *pid);
                let detail = format!(
                    "held beyond its shims' count, by the device's (group using {used} bytes, limit {limit})"
                );
                record(shared, policy, conn, pid, gpu, EventKind::Uncounted, bytes, detail);
            }
            Finding::Cleared { device, group } => {
                tracing::info!(gpu = %uuid_string(&device), %group, "group {group} no longer holds memory beyond what its shims counted: the charge is gone");
            }
        }
    }
    if shared.options.enforce_limits != EnforceLimits::End {
        return;
    }
    let now = Instant::now();
    let mut ending = ending(shared, policy, now);
    let spared: Vec<_> = ending.keys().copied().collect();
    let victims = policy.over_limit_victims(now, shared.options.enforce_grace, &spared);
    let mut groups = std::collections::BTreeSet::new();
    for (device, v) in victims {
        tracing::warn!(pid = v.pid, group = %v.group, bytes = v.bytes, why = %v.why, "--enforce-limits end: ending a process of a group past its limit by the device's count");
        let detail = format!("--enforce-limits end: {}", v.why);
        record(shared, policy, v.conn, v.pid, uuid_string(&device), EventKind::Ended, v.bytes, detail);
        end(shared, &mut ending, &v, "over-limit", now);
        // One group per GPU, however many processes it had.
        groups.insert((device, v.group.clone()));
    }
    shared.metrics.groups_ended_over_limit.inc_by(groups.len() as u64);
}
