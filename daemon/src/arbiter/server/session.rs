//! A connection's session: its task reads frames, says who may go on (`Hello` or `Status`
//! first, a GPU registered in time), applies each request, and writes direct replies and
//! answers decided elsewhere; when it ends, everything the connection held is released.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Instant;

use gpufrac_common::protocol::Request;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Notify};

use super::bursts::{on_acquire, on_release, on_swapped};
use super::compute::{on_lease_done, on_want};
use super::connection::{Connection, Counted, Flow};
use super::frames::{next_frame, reply};
use super::hello::on_greeting;
use super::parking::{on_parked, on_wake, on_woken};
use super::peers::{is_admin, look_up_again, take_pidfd, verdict};
use super::register::on_register;
use super::Shared;
use crate::arbiter::metrics::Refusal;
use crate::arbiter::policy::uuid_string;
use crate::entitlement::identity;

/// Serves one connection until it closes, is closed (evicted, or its process gone), or
/// misbehaves; then releases what it held. When the server stops, it ends after the frame
/// in hand and the answers already decided for it, and releases nothing: the arbiter
/// decides nothing more, and one started again learns what each process holds when its
/// shim registers again.
pub(super) async fn handle(
    stream: UnixStream,
    counted: Counted,
    evict: Arc<Notify>,
    close: Arc<Notify>,
    cred: Option<identity::Cred>,
) {
    let shared = counted.shared.clone();
    let who = counted.who;
    let (conn, pid) = (who.conn, who.pid);
    let (mut reader, mut writer) = stream.into_split();
    // Answers decided elsewhere (a grant after a wait) arrive here; direct replies are
    // written by this task at once, without a hop through another task.
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let mut state = Connection {
        who,
        greeted: false,
        registered: false,
        verdict: None,
        hello: None,
        capped_logged: false,
        admin: false,
        believe_again: false,
    };
    let mut buf = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(256);
    // Until `Hello` or `Status`, then until a GPU is registered; then none.
    let mut deadline = Some(tokio::time::Instant::now() + shared.options.hello_timeout);
    let mut stopping = shared.stopping.subscribe();
    let mut stopped = false;
    let result: Result<(), String> = loop {
        // Biased, frames first: a frame already read when the stop comes is answered
        // before the connection ends (a peer that never stops talking is cut off at the
        // server's grace).
        tokio::select! {
            biased;
            _ = evict.notified() => {
                break Err("too many connections: the oldest that had not said who it is".into());
            }
            _ = close.notified() => {
                break Err("the process that connected has exited; its connection is closed rather than its PID signalled".into());
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() => {
                break Err(if state.greeted {
                    format!("no GPU registered within {:?} of Hello", shared.options.register_timeout)
                } else {
                    format!("no Hello or Status within {:?}", shared.options.hello_timeout)
                });
            }
            frame = next_frame(&mut reader, &mut buf) => {
                let body = match frame {
                    Ok(Some(body)) => body,
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(e),
                };
                out.clear();
                let greeted = state.greeted;
                let request = match Request::decode(&body) {
                    Ok(request) => request,
                    Err(e) => break Err(e.to_string()),
                };
                if !state.greeted {
                    let socket = reader.as_ref().as_fd();
                    match request {
                        Request::Hello { .. } => {
                            take_pidfd(&shared, who, socket, cred.as_ref());
                            // What the client may have is known before its Hello is accepted.
                            if state.verdict.is_none() {
                                state.verdict = Some(verdict(&shared, who).await);
                            }
                        }
                        Request::Status => state.admin = is_admin(shared.options.admin_gid, who, socket),
                        _ => {}
                    }
                } else if matches!(request, Request::Register { .. }) {
                    look_up_again(&shared, &mut state).await;
                }
                let flow = on_frame(&shared, &mut state, &tx, request, &mut out);
                if state.registered {
                    deadline = None;
                } else if state.greeted && !greeted {
                    shared.admissions.identified(who);
                    deadline = Some(tokio::time::Instant::now() + shared.options.register_timeout);
                }
                if !out.is_empty() && writer.write_all(&out).await.is_err() {
                    break Ok(());
                }
                match flow {
                    Ok(Flow::Continue) => {}
                    Ok(Flow::Close) => break Ok(()),
                    Err(e) => break Err(e),
                }
            }
            Some(frame) = rx.recv() => {
                if writer.write_all(&frame).await.is_err() {
                    break Ok(());
                }
            }
            _ = stop_asked(&mut stopping) => {
                stopped = true;
                break Ok(());
            }
        }
    };
    if let Err(reason) = result {
        shared.metrics.refusals.get_or_create(&Refusal { reason: "bad-frame".into() }).inc();
        shared.logs.log_closing(who, &reason);
    }
    if stopped {
        // Answers decided before the stop still go out.
        while let Ok(frame) = rx.try_recv() {
            if writer.write_all(&frame).await.is_err() {
                break;
            }
        }
        shared.forget(conn);
        return;
    }
    shared.forget(conn);
    let mut policy = shared.policy();
    let had_peer = policy.peer(conn).is_some();
    let follow = policy.on_disconnect(conn, Instant::now());
    shared.queued.forget(conn);
    if had_peer && shared.logs.connection_line(who.uid).is_some() {
        tracing::info!(pid, uid = who.uid, conn, "process gone: released what it held");
    }
    // What it held answers bursts and may wake a parked group; a lease it held goes on at
    // once.
    shared.follow_up(&mut policy, follow);
    drop(policy);
    // The connection stops counting against its UID only now.
    drop(counted);
}

/// Returns once the server stops (the watched value's guard is let go of at once: it is
/// not `Send`).
async fn stop_asked(stopping: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stopping.wait_for(|&stop| stop).await.map(|_| ());
}

/// Applies one frame under one lock of the policy (taken here, or in `on_greeting` for
/// the first); direct replies go into `out`.
pub(super) fn on_frame(
    shared: &Arc<Shared>,
    c: &mut Connection,
    tx: &mpsc::UnboundedSender<Vec<u8>>,
    request: Request,
    out: &mut Vec<u8>,
) -> Result<Flow, String> {
    if !c.greeted {
        return on_greeting(shared, c, tx, request, out);
    }
    let (conn, pid) = (c.who.conn, c.who.pid);
    let mut policy = shared.policy();
    let policy = &mut *policy;
    match request {
        Request::Register { device, total, request, limit, held, granted, swapped } => {
            on_register(shared, policy, c, out, device, total, request, limit, held, granted, swapped)
        }
        Request::Acquire { seq, device, bytes, preferred, held, resume } => {
            on_acquire(shared, policy, c, out, seq, device, bytes, preferred, held, resume)
        }
        Request::Activity { count } => policy.activity(conn, count, Instant::now()),
        Request::Release { device, bytes, held } => on_release(shared, policy, c, device, bytes, held),
        Request::Swapped { device, direction, bytes, granted, host_bytes, held, micros } => {
            on_swapped(shared, policy, c, device, direction, bytes, granted, host_bytes, held, micros)
        }
        Request::Parked { device, host_bytes, held, micros } => {
            on_parked(shared, policy, (conn, pid), device, host_bytes, held, micros);
        }
        Request::Wake { seq, device } => {
            if let Some(answer) = on_wake(shared, policy, (conn, pid), seq, device) {
                reply(out, &answer);
            }
        }
        Request::Woken { device, held, micros } => {
            on_woken(shared, policy, (conn, pid), device, held, micros)
        }
        Request::ContextMeasured { device, bytes } => {
            tracing::debug!(pid, gpu = %uuid_string(&device), bytes, "a context measured");
            policy.context_measured(conn, &device, bytes);
        }
        Request::Want { device } => on_want(shared, policy, conn, device),
        Request::LeaseDone { device, lease, drain_us, more } => {
            on_lease_done(shared, policy, conn, (device, lease, drain_us, more))
        }
        other => return Err(format!("unexpected {other:?} after Hello")),
    }
    Ok(Flow::Continue)
}
