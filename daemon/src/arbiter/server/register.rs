//! Registration on a GPU: what a connection's group is guaranteed and may burst to there,
//! held to its entitlement; a request lent out is taken back at once.

use std::sync::Arc;

use gpufrac_common::protocol::{DeviceId, Reply};

use super::connection::Connection;
use super::document::record;
use super::frames::reply;
use super::peers::believe_again;
use super::Shared;
use crate::arbiter::document::EventKind;
use crate::arbiter::metrics::Refusal;
use crate::arbiter::policy::{uuid_string, Policy};
use crate::entitlement::believe_register;

/// A `Register`: the connection joins the GPU's ledger under its group, its request and
/// limit capped by its entitlement (on the GPU's own size); the reply says what its group
/// has and whether it is parked.
#[allow(clippy::too_many_arguments)]
pub(super) fn on_register(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    c: &mut Connection,
    out: &mut Vec<u8>,
    device: DeviceId,
    total: u64,
    request: u64,
    limit: u64,
    held: u64,
    granted: u64,
    swapped: u64,
) {
    let (conn, pid, uid) = (c.who.conn, c.who.pid, c.who.uid);
    // A verdict looked up again just now replaces what was believed of its `Hello`.
    believe_again(shared, policy, c);
    // Capped by the entitlement on the GPU's own size, not the one the shim reports.
    let device_total = policy.total(&device).unwrap_or(total);
    let verdict = c.verdict.as_ref().unwrap_or(&crate::entitlement::Verdict::Unrestricted);
    let (declared_request, declared_limit) = (request, limit);
    let (request, limit, cut) = believe_register(verdict, &device, device_total, request, limit);
    // A limit below the request is the shim's error, reported as such.
    let (request, limit) =
        if declared_limit < declared_request { (declared_request, declared_limit) } else { (request, limit) };
    if let Some(cut) = &cut {
        policy.note_capped(conn, cut);
        if !c.capped_logged {
            c.capped_logged = true;
            if let Some(suppressed) = shared.logs.refusal_line(uid) {
                tracing::warn!(pid, uid, suppressed, gpu = %uuid_string(&device), "registration beyond the entitlement: {cut}");
            }
        }
    }
    // Swapped-out memory it says it keeps is in its own host memory, or nowhere.
    let swapped = if swapped > 0 { swapped.min(shared.host_memory_cap(conn, pid)) } else { 0 };
    let result = policy.on_register(conn, device, total, request, limit, held, granted, swapped);
    match result {
        Ok((parked, follow)) => {
            c.registered = true;
            if shared.logs.connection_line(uid).is_some() {
                tracing::info!(pid, gpu = %uuid_string(&device), request, limit, held, granted, swapped, "registered");
            }
            let (request, limit) = policy.group_of(conn, &device).unwrap_or((request, limit));
            let context = policy.context_bytes(&device).unwrap_or(0);
            let small = policy.small_request_warning(&device, request);
            if let Some(warning) = small {
                if let Some(suppressed) = shared.logs.refusal_line(uid) {
                    tracing::warn!(pid, uid, suppressed, gpu = %uuid_string(&device), "{warning}");
                }
            }
            reply(out, &Reply::Registered { device, request, limit, parked, context });
            // Its request may be lent out: take it back now (or parked groups crowd it:
            // park them); a group with a compute share joins the leases.
            shared.follow_up(policy, follow);
        }
        Err(reason) => {
            shared.metrics.refusals.get_or_create(&Refusal { reason: "admission".into() }).inc();
            if let Some(suppressed) = shared.logs.refusal_line(uid) {
                tracing::warn!(pid, uid, suppressed, gpu = %uuid_string(&device), "registration refused: {reason}");
            }
            let detail = format!("registration refused: {reason}");
            record(shared, policy, conn, pid, uuid_string(&device), EventKind::Refused, request, detail);
            reply(out, &Reply::Refused { device, reason });
        }
    }
}
