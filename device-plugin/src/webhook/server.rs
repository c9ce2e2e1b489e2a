//! The webhook's HTTPS server: an accept loop over a listener the caller bound, one task
//! per connection (TLS handshake, then HTTP/1.1), and the routes:
//!
//! | route | answer |
//! | --- | --- |
//! | `POST /mutate`, `Content-Type: application/json` | 200 and the AdmissionReview answer; 400 for a body that is not JSON or not an AdmissionReview v1; 413 over [`MAX_BODY_BYTES`]; 415 for another content type |
//! | `GET` (or `HEAD`) `/healthz` | 200 `ok` |
//! | another method on those paths | 405 |
//! | any other path | 404 |
//!
//! A failed handshake, a slow or broken client, or a bad request ends that connection
//! only. On shutdown the server stops accepting, lets the requests in flight finish
//! (for a few seconds at most), and returns.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use super::review::try_review;

/// The largest `/mutate` body read; a bigger one is answered 413. (The API server's own
/// limit on an object is 1.5 MiB, but a pod near 1 MiB is already absurd.)
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Connections served at once; more wait in the listener's backlog.
const MAX_CONNECTIONS: usize = 256;
/// Time for a client to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time for a client to send a request's headers, and then its body.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
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
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
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
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break, // the semaphore is never closed
            },
        };
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                connections.spawn(connection(acceptor.clone(), stream, peer, stop_rx.clone(), permit));
            }
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

/// One client: the TLS handshake, then HTTP/1.1 requests until the client closes, the
/// connection fails, or the server shuts down (after the request in flight).
async fn connection(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    mut stop: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
    let stream = tokio::select! {
        _ = stop.wait_for(|stop| *stop) => return,
        handshake = handshake => match handshake {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                tracing::debug!(%peer, "webhook TLS handshake failed: {e}");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "webhook TLS handshake timed out");
                return;
            }
        },
    };

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

/// Routes one request.
async fn handle(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let response = match (request.uri().path(), request.method()) {
        ("/mutate", &Method::POST) => mutate(request).await,
        ("/mutate", _) => not_allowed("POST"),
        ("/healthz", &Method::GET | &Method::HEAD) => text(StatusCode::OK, "ok"),
        ("/healthz", _) => not_allowed("GET, HEAD"),
        _ => text(StatusCode::NOT_FOUND, "not found: the webhook serves POST /mutate"),
    };
    Ok(response)
}

/// `POST /mutate`: reads the AdmissionReview and answers it.
async fn mutate(request: Request<Incoming>) -> Response<Full<Bytes>> {
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
    match try_review(&value) {
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
