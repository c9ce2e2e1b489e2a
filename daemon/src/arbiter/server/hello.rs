//! What a `Hello` may say: group and pod names are checked (they reach logs and `gpufrac
//! status`), and the wait timeout is bounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Reply, Request, VERSION};
use gpufrac_common::ComputeSpec;
use tokio::sync::mpsc;

use super::connection::Declared;
use super::connection::{Connection, Flow};
use super::document::document_for;
use super::frames::reply;
use super::parking::{load_checkpoint_api, parkable_hello};
use super::peers::believe;
use super::Shared;
use crate::arbiter::policy::Peer;

/// Longest wait a shim may ask for.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// Longest group name (`GPUFRAC_GROUP`).
const MAX_GROUP: usize = 64;
/// Longest pod (`namespace/name`, each part at most 253 characters).
const MAX_POD: usize = 2 * 253 + 1;

/// Why a group name from `Hello` is refused, if it is: 1 to 64 of `A-Za-z0-9._-`.
fn check_group(group: &str) -> Result<(), String> {
    let ok = !group.is_empty()
        && group.len() <= MAX_GROUP
        && group.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!("group {group:?} refused: expected 1 to {MAX_GROUP} of A-Z a-z 0-9 . _ -"))
    }
}

/// Why a pod from `Hello` is refused, if it is: empty, or 1 to 507 of `A-Za-z0-9._-/:`.
fn check_pod(pod: &str) -> Result<(), String> {
    let ok = pod.len() <= MAX_POD
        && pod.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/' | b':'));
    if ok {
        Ok(())
    } else {
        Err(format!("pod {pod:?} refused: expected at most {MAX_POD} of A-Z a-z 0-9 . _ - / :"))
    }
}

/// Applies a connection's first frame: `Status` is answered (the connection then
/// closes), `Hello` checked, believed as far as its verdict allows and entered in the
/// ledger; anything else closes the connection. Takes the policy's lock once, after
/// anything slow (loading the driver's checkpoint API).
pub(super) fn on_greeting(
    shared: &Arc<Shared>,
    c: &mut Connection,
    tx: &mpsc::UnboundedSender<Vec<u8>>,
    request: Request,
    out: &mut Vec<u8>,
) -> Result<Flow, String> {
    let (conn, pid, uid) = (c.who.conn, c.who.pid, c.who.uid);
    match request {
        Request::Status => {
            // Plain data built under the ledger's lock, serialized outside it; only
            // what this user may see.
            let document = document_for(shared, &shared.policy(), c.who, c.admin);
            let json = serde_json::to_string(&document).map_err(|e| e.to_string())?;
            reply(out, &Reply::Status { json });
            Ok(Flow::Close)
        }
        Request::Hello {
            version,
            group,
            pod,
            resolver,
            priority,
            wait_timeout_ms,
            park_after_ms,
            compute_request_pm,
            compute_limit_pm,
        } => {
            // Names reach logs and `gpufrac status`: nothing but the characters the
            // shim allows is accepted.
            check_group(&group)?;
            check_pod(&pod)?;
            if park_after_ms > 0 && version == VERSION {
                // Outside the policy's lock: it may load the CUDA driver.
                load_checkpoint_api(shared);
            }
            let mut policy = shared.policy();
            // What it manages of each GPU: the shim's fractions are of it.
            let managed = policy.totals();
            reply(out, &Reply::Welcome { version: VERSION, pid, managed });
            if version != VERSION {
                return Err(format!("protocol version {version}, this arbiter speaks {VERSION}"));
            }
            let wait_timeout = Duration::from_millis(wait_timeout_ms).min(MAX_WAIT);
            shared.add_writer(conn, tx.clone());
            if shared.logs.connection_line(uid).is_some() {
                tracing::info!(pid, uid, %group, %pod, %resolver, priority, "shim connected");
            }
            let now = Instant::now();
            c.verdict.get_or_insert(crate::entitlement::Verdict::Unrestricted);
            // Checked when the frame was decoded.
            let compute = ComputeSpec::from_wire(compute_request_pm, compute_limit_pm).ok().flatten();
            c.hello = Some(Declared { group, resolver, priority, compute });
            let believed = believe(shared, c);
            let signalable = shared.pidfd(conn).is_some();
            let peer = Peer {
                pid,
                uid,
                group: believed.group_key,
                pod,
                resolver: believed.resolver,
                priority: believed.priority,
                wait_timeout,
                last_active: now,
                activity: 0,
                vetted: believed.vetted,
                signalable,
                entitlement: believed.entitlement,
                capped: believed.capped.join(", "),
                park_after: (park_after_ms > 0).then(|| Duration::from_millis(park_after_ms)),
                // Held to its entitlement like its priority.
                compute: believed.compute,
            };
            if park_after_ms > 0 {
                parkable_hello(shared, &mut policy);
            }
            policy.hello(conn, peer);
            if !signalable {
                // Shown in status: its bursts are refused (a loan must be takeable back).
                policy.note_capped(conn, "no burst (no pidfd: it could never be made to give a loan back)");
            }
            drop(policy);
            c.greeted = true;
            Ok(Flow::Continue)
        }
        other => Err(format!("expected Hello or Status first, got {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_names_are_what_the_shim_allows() {
        for ok in ["a", "pod-a.web_1", "pid-1234", &"x".repeat(MAX_GROUP)] {
            assert_eq!(check_group(ok), Ok(()), "{ok}");
        }
        for bad in ["", "a b", "a/b", "evil\x1b[31m", "line\nforged", "tab\t", "é", "\u{7f}", &"x".repeat(65)]
        {
            let err = check_group(bad).expect_err(bad);
            assert!(!err.contains('\x1b') && !err.contains('\n'), "the reason escapes the name: {err}");
        }
    }

    #[test]
    fn pods_are_namespace_slash_name_or_empty() {
        for ok in ["", "default/server-0", "ns:x/a.b_c", &format!("{}/{}", "a".repeat(253), "b".repeat(253))]
        {
            assert_eq!(check_pod(ok), Ok(()), "{ok}");
        }
        for bad in ["a b", "ns/\x1b]0;title\x07", "ns/name\r", &"a".repeat(MAX_POD + 1)] {
            let err = check_pod(bad).expect_err(bad);
            assert!(!err.contains('\x1b') && !err.contains('\r'), "{err}");
        }
    }
}
