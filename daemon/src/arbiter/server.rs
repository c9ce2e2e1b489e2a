//! The arbiter's socket server: one task per connection reads frames and applies them to
//! the ledger; replies and answers to queued bursts go out through each connection's
//! writer task; a ticker expires waiters. A connection that sends a malformed, oversized
//! or out-of-order frame is closed with a logged reason; the daemon goes on. Closing a
//! connection (the process exited or was killed) releases everything it held at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId, Reply, Request, MAX_FRAME, VERSION};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedReadHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

use super::metrics::{GpuLabel, Metrics, Refusal};
use super::policy::{uuid_string, Answer, ConnId, Outcome, Peer, Policy};
use crate::status::Status;

/// Longest wait a shim may ask for.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
/// How often waiters are checked against their deadlines.
const TICK: Duration = Duration::from_millis(5);
/// How often holders are reminded to give back unused grants while bursts wait.
const RECLAIM_EVERY: Duration = Duration::from_millis(200);

/// State shared by every connection.
pub struct Shared {
    policy: Mutex<Policy>,
    writers: Mutex<HashMap<ConnId, mpsc::UnboundedSender<Vec<u8>>>>,
    /// The metrics, also served over HTTP.
    pub metrics: Arc<Metrics>,
    next_conn: AtomicU64,
}

impl Shared {
    /// The server state for GPUs `(uuid, memory)`.
    pub fn new(gpus: &[(DeviceId, u64)]) -> Arc<Shared> {
        Arc::new(Shared {
            policy: Mutex::new(Policy::new(gpus)),
            writers: Mutex::new(HashMap::new()),
            metrics: Arc::new(Metrics::new()),
            next_conn: AtomicU64::new(1),
        })
    }

    fn policy(&self) -> MutexGuard<'_, Policy> {
        self.policy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The status document.
    pub fn status(&self) -> Status {
        self.policy().status()
    }

    fn send(&self, conn: ConnId, reply: &Reply) {
        if let Some(tx) = self.writers.lock().unwrap_or_else(|p| p.into_inner()).get(&conn) {
            let _ = tx.send(reply.encode());
        }
    }

    /// While bursts wait, holders of grants are asked to give back what they do not use.
    fn ask_to_give_back(&self) {
        let holders = self.policy().contended_holders();
        for (conn, device) in holders {
            self.send(conn, &Reply::Reclaim { device });
        }
    }

    /// Sends the answers to queued bursts, counts and logs them.
    fn deliver(&self, answers: Vec<Answer>) {
        for a in answers {
            let gpu = GpuLabel { gpu: uuid_string(&a.device) };
            let (pid, group) =
                self.policy().peer(a.conn).map_or((0, String::new()), |p| (p.pid, p.group.clone()));
            self.metrics.wait_seconds.get_or_create(&gpu).observe(a.waited.as_secs_f64());
            match a.result {
                Ok(bytes) => {
                    self.metrics.grants.get_or_create(&gpu).inc();
                    self.metrics.granted_bytes.get_or_create(&gpu).inc_by(bytes);
                    tracing::info!(pid, %group, gpu = %gpu.gpu, bytes, waited_ms = a.waited.as_millis() as u64, "grant after wait");
                    self.send(a.conn, &Reply::Granted { seq: a.seq, bytes });
                }
                Err(reason) => {
                    if reason == Denial::Timeout {
                        self.metrics.timeouts.get_or_create(&gpu).inc();
                    }
                    tracing::info!(pid, %group, gpu = %gpu.gpu, waited_ms = a.waited.as_millis() as u64, ?reason, "burst denied");
                    self.send(a.conn, &Reply::Denied { seq: a.seq, reason });
                }
            }
        }
    }
}

/// Serves shims and the CLI on `listener` until `shutdown` completes.
pub async fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let ticker = tokio::spawn(expire_waiters(shared.clone()));
    let accept = async {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    tokio::spawn(handle(stream, shared.clone()));
                }
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    };
    tokio::select! {
        _ = accept => {}
        _ = shutdown => {}
    }
    ticker.abort();
}

async fn expire_waiters(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(TICK);
    let mut last_reclaim = Instant::now();
    loop {
        tick.tick().await;
        let answers = shared.policy().expire(Instant::now());
        if !answers.is_empty() {
            shared.deliver(answers);
        }
        // Keep reminding holders while anyone waits (they keep no slack meanwhile).
        if last_reclaim.elapsed() >= RECLAIM_EVERY {
            last_reclaim = Instant::now();
            shared.ask_to_give_back();
        }
    }
}

async fn handle(stream: UnixStream, shared: Arc<Shared>) {
    // The peer's PID comes from the kernel, never from a message.
    let pid = stream.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0) as u32;
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let (mut reader, mut writer) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let writing = tokio::spawn(async move {
        while let Some(frame) = rx.recv().await {
            if writer.write_all(&frame).await.is_err() {
                break;
            }
        }
    });
    if let Err(reason) = serve_connection(conn, pid, &mut reader, &tx, &shared).await {
        shared.metrics.refusals.get_or_create(&Refusal { reason: "bad-frame".into() }).inc();
        tracing::warn!(pid, conn, "closing connection: {reason}");
    }
    shared.writers.lock().unwrap_or_else(|p| p.into_inner()).remove(&conn);
    let had_peer = shared.policy().peer(conn).is_some();
    let answers = shared.policy().disconnect(conn, Instant::now());
    if had_peer {
        tracing::info!(pid, conn, "process gone: released what it held");
    }
    shared.deliver(answers);
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(1), writing).await;
}

/// Reads one frame; `Ok(None)` on a clean end of stream between frames.
async fn read_frame(reader: &mut OwnedReadHalf) -> Result<Option<Vec<u8>>, String> {
    let mut len = [0u8; 4];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(format!("read: {e}")),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(format!("frame of {len} bytes (allowed: 1 to {MAX_FRAME})"));
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).await.map_err(|e| format!("truncated frame: {e}"))?;
    Ok(Some(body))
}

async fn serve_connection(
    conn: ConnId,
    pid: u32,
    reader: &mut OwnedReadHalf,
    tx: &mpsc::UnboundedSender<Vec<u8>>,
    shared: &Arc<Shared>,
) -> Result<(), String> {
    let Some(first) = read_frame(reader).await? else { return Ok(()) };
    match Request::decode(&first).map_err(|e| e.to_string())? {
        Request::Status => {
            let json = serde_json::to_string(&shared.status()).map_err(|e| e.to_string())?;
            let _ = tx.send(Reply::Status { json }.encode());
            return Ok(());
        }
        Request::Hello { version, group, pod, resolver, priority, wait_timeout_ms } => {
            let _ = tx.send(Reply::Welcome { version: VERSION }.encode());
            if version != VERSION {
                return Err(format!("protocol version {version}, this arbiter speaks {VERSION}"));
            }
            if group.is_empty() {
                return Err("Hello without a group".into());
            }
            let wait_timeout = Duration::from_millis(wait_timeout_ms).min(MAX_WAIT);
            shared.writers.lock().unwrap_or_else(|p| p.into_inner()).insert(conn, tx.clone());
            tracing::info!(pid, %group, %pod, %resolver, priority, "shim connected");
            shared.policy().hello(conn, Peer { pid, group, pod, resolver, priority, wait_timeout });
        }
        other => return Err(format!("expected Hello or Status first, got {other:?}")),
    }
    loop {
        let Some(body) = read_frame(reader).await? else { return Ok(()) };
        match Request::decode(&body).map_err(|e| e.to_string())? {
            Request::Register { device, total, request, limit, held, granted } => {
                let result = shared.policy().register(conn, device, total, request, limit, held, granted);
                match result {
                    Ok(()) => {
                        tracing::info!(pid, gpu = %uuid_string(&device), request, limit, held, granted, "registered");
                        shared.send(conn, &Reply::Registered { device });
                    }
                    Err(reason) => {
                        shared.metrics.refusals.get_or_create(&Refusal { reason: "admission".into() }).inc();
                        tracing::warn!(pid, gpu = %uuid_string(&device), "registration refused: {reason}");
                        shared.send(conn, &Reply::Refused { device, reason });
                    }
                }
            }
            Request::Acquire { seq, device, bytes, preferred, held } => {
                let outcome =
                    shared.policy().acquire(conn, device, seq, bytes, preferred, held, Instant::now());
                let gpu = GpuLabel { gpu: uuid_string(&device) };
                match outcome {
                    Outcome::Granted(granted) => {
                        shared.metrics.grants.get_or_create(&gpu).inc();
                        shared.metrics.granted_bytes.get_or_create(&gpu).inc_by(granted);
                        tracing::debug!(pid, gpu = %gpu.gpu, bytes = granted, "grant");
                        shared.send(conn, &Reply::Granted { seq, bytes: granted });
                    }
                    Outcome::Queued => {
                        shared.metrics.waits.get_or_create(&gpu).inc();
                        tracing::info!(pid, gpu = %gpu.gpu, bytes, "burst waits: memory is lent out");
                        let answers = shared.policy().settle(device, Instant::now());
                        shared.deliver(answers);
                        shared.ask_to_give_back();
                    }
                    Outcome::Denied(reason) => {
                        shared
                            .metrics
                            .refusals
                            .get_or_create(&Refusal { reason: format!("{reason:?}") })
                            .inc();
                        shared.send(conn, &Reply::Denied { seq, reason });
                    }
                }
            }
            Request::Release { device, bytes, held } => {
                tracing::debug!(pid, gpu = %uuid_string(&device), bytes, "release");
                let answers = shared.policy().release(conn, device, bytes, held, Instant::now());
                shared.deliver(answers);
            }
            other => return Err(format!("unexpected {other:?} after Hello")),
        }
    }
}
