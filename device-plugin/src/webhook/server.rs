//! The webhook's HTTPS server: an accept loop over a listener the caller bound, one task
//! per connection (TLS handshake, then HTTP/1.1), and the routes:
//!
//! | route | answer |
//! | --- | --- |
//! | `POST /mutate`, `Content-Type: application/json` | 200 and the AdmissionReview answer; 400 for a body that is not JSON or not an AdmissionReview v1; 413 over [`MAX_BODY_BYTES`]; 415 for another content type |
//! | `POST /validate` (DRA claims, claim templates and device classes) | the same |
//! | `GET` (or `HEAD`) `/healthz` | 200 `ok` |
//! | another method on those paths | 405 |
//! | any other path | 404 |
//!
//! A failed handshake, a slow or broken client, or a bad request ends that connection
//! only. On shutdown the server stops accepting, lets the requests in flight finish
//! (for a few seconds at most), and returns.
//!
//! Clients that hold connections without using them cannot lock the API server out:
//! - a TLS handshake must finish within [`HANDSHAKE_TIMEOUT`], and a request's headers
//!   and then its body must each arrive within [`REQUEST_TIMEOUT`];
//! - one peer IP holds at most [`MAX_CONNECTIONS_PER_PEER`] connections; one more is
//!   closed at once;
//! - when all [`MAX_CONNECTIONS`] slots are taken, the connection that has been in its TLS
//!   handshake longest is dropped to admit the new one (an honest handshake takes a round
//!   trip, so the dropped one is the staller); only when every slot is past its
//!   handshake is the new connection closed.
//!
//! Accepted sockets get `TCP_NODELAY`: an answer written in two segments would otherwise
//! wait for the client's delayed ACK (about 40 ms).

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Timeout;
use tokio_rustls::server::Accept;
use tokio_rustls::TlsAcceptor;

use super::review::{try_review, BadReview};
use super::validate::try_validate;

/// The largest `/mutate` or `/validate` body read; a bigger one is answered 413. (The API server's own
/// limit on an object is 1.5 MiB, but a pod near 1 MiB is already absurd.)
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Connections served at once (see the module's doc for what happens past it).
pub const MAX_CONNECTIONS: usize = 256;
/// Connections one peer IP may hold at once; one more is closed at once.
pub const MAX_CONNECTIONS_PER_PEER: usize = 32;
/// Time for a client to finish its TLS handshake (a round trip or two for an honest one).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Time for a client to send a request's headers, and then its body.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Time given to the requests in flight at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Pause after a failed accept (out of file descriptors, say) before the next one.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves the webhook on `listener` with `tls` until `shutdown` completes, then waits
/// a few seconds for the requests in flight and returns.
///
/// `tls` is used as given (see [`load_tls`](super::load_tls)); its ALPN must offer
/// `http/1.1` or nothing, since only HTTP/1.1 is served. Errors of one connection are
/// logged (at debug level) and never stop the server; a failed accept is logged and
/// retried after a pause, so this returns `Ok` once shut down.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    let slots = Slots::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "webhook serving HTTPS");
    }
    tokio::pin!(shutdown);

    loop {
        while let Some(done) = connections.try_join_next() {
            if let Err(e) = done {
                if e.is_panic() {
                    tracing::error!("webhook connection task panicked: {e}");
                }
            }
        }
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => match slots.admit(peer.ip()) {
                Ok(slot) => {
                    connections.spawn(connection(acceptor.clone(), stream, peer, stop_rx.clone(), slot));
                }
                Err(full) => {
                    tracing::debug!(%peer, "webhook connection refused: {full}");
                    close_at_once(&stream);
                }
            },
            Err(e) => {
                tracing::warn!("webhook accept failed: {e}");
                tokio::select! {
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }

    tracing::info!("webhook shutting down");
    drop(listener);
    let _ = stop_tx.send(true);
    let drained =
        tokio::time::timeout(SHUTDOWN_GRACE, async { while connections.join_next().await.is_some() {} })
            .await;
    if drained.is_err() {
        tracing::warn!(
            "webhook: {} connections still open after {SHUTDOWN_GRACE:?}, closing them",
            connections.len()
        );
        connections.shutdown().await;
    }
    Ok(())
}

/// Why a new connection was closed at once.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("its peer already holds {MAX_CONNECTIONS_PER_PEER} connections")]
    PeerFull,
    #[error("all {MAX_CONNECTIONS} connections are past their TLS handshake")]
    Full,
}

/// The connections open, shared by the accept loop and the connection tasks.
#[derive(Clone, Default)]
struct Slots(Arc<Mutex<Registry>>);

#[derive(Default)]
struct Registry {
    /// Numbers connections in the order they were admitted.
    next_id: u64,
    /// The open connections, oldest first.
    open: BTreeMap<u64, Open>,
    /// Connections per peer IP (no entry for none).
    per_peer: HashMap<IpAddr, usize>,
}

struct Open {
    peer: IpAddr,
    /// While in the TLS handshake: sending on it (or dropping it) drops the connection.
    evict: Option<oneshot::Sender<()>>,
}

/// A connection's place in [`Slots`], given back on drop.
struct Slot {
    slots: Slots,
    id: u64,
    /// Fires when the connection is dropped to make room, while in its handshake.
    evicted: oneshot::Receiver<()>,
}

impl Slots {
    fn lock(&self) -> MutexGuard<'_, Registry> {
        // The registry is consistent between statements; a panic elsewhere leaves it usable.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a new connection from `peer`, dropping the oldest connection still in
    /// its handshake when all are taken.
    fn admit(&self, peer: IpAddr) -> Result<Slot, Refused> {
        let mut registry = self.lock();
        if registry.per_peer.get(&peer).copied().unwrap_or(0) >= MAX_CONNECTIONS_PER_PEER {
            return Err(Refused::PeerFull);
        }
        if registry.open.len() >= MAX_CONNECTIONS {
            let oldest = registry.open.iter().find(|(_, open)| open.evict.is_some()).map(|(id, _)| *id);
            let Some(oldest) = oldest else {
                return Err(Refused::Full);
            };
            if let Some(Open { evict: Some(evict), .. }) = registry.remove(oldest) {
                let _ = evict.send(());
            }
        }
        let id = registry.next_id;
        registry.next_id += 1;
        let (evict, evicted) = oneshot::channel();
        registry.open.insert(id, Open { peer, evict: Some(evict) });
        *registry.per_peer.entry(peer).or_insert(0) += 1;
        Ok(Slot { slots: self.clone(), id, evicted })
    }
}

impl Registry {
    fn remove(&mut self, id: u64) -> Option<Open> {
        let open = self.open.remove(&id)?;
        if let Some(count) = self.per_peer.get_mut(&open.peer) {
            *count -= 1;
            if *count == 0 {
                self.per_peer.remove(&open.peer);
            }
        }
        Some(open)
    }
}

impl Slot {
    /// Marks the handshake done, so the connection is no longer dropped to make room;
    /// false if it was dropped already (it must then end).
    fn handshake_done(&mut self) -> bool {
        match self.slots.lock().open.get_mut(&self.id) {
            Some(open) => {
                open.evict = None;
                true
            }
            None => false,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.lock().remove(self.id);
    }
}

/// One client: the TLS handshake, then HTTP/1.1 requests until the client closes, the
/// connection fails, or the server shuts down (after the request in flight).
async fn connection(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    mut stop: watch::Receiver<bool>,
    mut slot: Slot,
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, "webhook cannot set TCP_NODELAY: {e}");
    }
    let mut handshake = std::pin::pin!(tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)));
    let stream = tokio::select! {
        _ = stop.wait_for(|stop| *stop) => return,
        _ = &mut slot.evicted => {
            tracing::debug!(%peer, "webhook connection dropped in its TLS handshake to admit a new one");
            if let Some(stream) = Accept::get_ref(Timeout::get_ref(&handshake)) {
                close_at_once(stream);
            }
            return;
        }
        done = &mut handshake => match done {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                tracing::debug!(%peer, "webhook TLS handshake failed: {e}");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "webhook TLS handshake timed out");
                if let Some(stream) = Accept::get_ref(Timeout::get_ref(&handshake)) {
                    close_at_once(stream);
                }
                return;
            }
        },
    };
    if !slot.handshake_done() {
        return;
    }

    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(REQUEST_TIMEOUT);
    let conn = http.serve_connection(TokioIo::new(stream), hyper::service::service_fn(handle));
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::debug!(%peer, "webhook connection ended: {e}");
                }
                return;
            }
            _ = stop.wait_for(|stop| *stop), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Makes the coming close of `stream` a reset: a connection dropped for stalling leaves
/// no `TIME_WAIT` behind on the server, however fast a client renews it.
fn close_at_once(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

/// Routes one request.
async fn handle(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let response = match (request.uri().path(), request.method()) {
        ("/mutate", &Method::POST) => answer(request, try_review).await,
        ("/validate", &Method::POST) => answer(request, try_validate).await,
        ("/mutate" | "/validate", _) => not_allowed("POST"),
        ("/healthz", &Method::GET | &Method::HEAD) => text(StatusCode::OK, "ok"),
        ("/healthz", _) => not_allowed("GET, HEAD"),
        _ => text(StatusCode::NOT_FOUND, "not found: the webhook serves POST /mutate and POST /validate"),
    };
    Ok(response)
}

/// `POST /mutate` or `POST /validate`: reads the AdmissionReview and answers it with
/// `decide` (the route's pure function).
async fn answer(
    request: Request<Incoming>,
    decide: fn(&serde_json::Value) -> Result<serde_json::Value, BadReview>,
) -> Response<Full<Bytes>> {
    let json = request
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return text(StatusCode::UNSUPPORTED_MEDIA_TYPE, "expected Content-Type: application/json");
    }
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > MAX_BODY_BYTES as u64) {
        return too_large();
    }

    let body = Limited::new(request.into_body(), MAX_BODY_BYTES).collect();
    let body = match tokio::time::timeout(REQUEST_TIMEOUT, body).await {
        Err(_) => return text(StatusCode::REQUEST_TIMEOUT, "the request body was too slow"),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return too_large(),
        Ok(Err(e)) => return text(StatusCode::BAD_REQUEST, &format!("cannot read the request body: {e}")),
        Ok(Ok(body)) => body.to_bytes(),
    };
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(e) => return text(StatusCode::BAD_REQUEST, &format!("the request body is not JSON: {e}")),
    };
    match decide(&value) {
        Ok(answer) => {
            let mut response = Response::new(Full::new(Bytes::from(answer.to_string())));
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response
        }
        Err(bad) => text(StatusCode::BAD_REQUEST, &bad.to_string()),
    }
}

fn too_large() -> Response<Full<Bytes>> {
    text(StatusCode::PAYLOAD_TOO_LARGE, &format!("the request body is over {MAX_BODY_BYTES} bytes"))
}

fn not_allowed(allow: &'static str) -> Response<Full<Bytes>> {
    let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
    response.headers_mut().insert(ALLOW, HeaderValue::from_static(allow));
    response
}

/// A plain-text answer (one line).
fn text(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(format!("{message}\n"))));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    #[test]
    fn one_peer_is_capped() {
        let slots = Slots::default();
        let held: Vec<Slot> =
            (0..MAX_CONNECTIONS_PER_PEER).map(|_| slots.admit(ip(1)).expect("under the cap")).collect();
        assert!(matches!(slots.admit(ip(1)), Err(Refused::PeerFull)));
        assert!(slots.admit(ip(2)).is_ok());
        drop(held);
        assert!(slots.admit(ip(1)).is_ok());
        assert!(slots.lock().open.is_empty() && slots.lock().per_peer.is_empty());
    }

    #[test]
    fn full_slots_drop_the_oldest_handshake() {
        let slots = Slots::default();
        let peers = MAX_CONNECTIONS / MAX_CONNECTIONS_PER_PEER;
        let mut held: Vec<Slot> =
            (0..MAX_CONNECTIONS).map(|i| slots.admit(ip((i % peers) as u8)).expect("a free slot")).collect();
        // The two oldest finished their handshakes; the third oldest is dropped.
        assert!(held[0].handshake_done() && held[1].handshake_done());
        let new = slots.admit(ip(200)).expect("room made");
        assert!(held[2].evicted.try_recv().is_ok());
        assert!(!held[2].handshake_done());
        assert!(held[3].evicted.try_recv().is_err());
        assert_eq!(slots.lock().open.len(), MAX_CONNECTIONS);
        drop(new);
        // Every slot past its handshake: a new connection is closed.
        for slot in held.iter_mut().skip(3) {
            assert!(slot.handshake_done());
        }
        let mut last = slots.admit(ip(201)).expect("the slot `new` gave back");
        assert!(last.handshake_done());
        assert!(matches!(slots.admit(ip(202)), Err(Refused::Full)));
    }
}
