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

use super::gpus::ProcessList;
use super::metrics::{GpuLabel, Metrics, Refusal};
use super::policy::{uuid_string, Answer, ConnId, Outcome, Peer, Policy, Victim};
use crate::status::Status;

/// Longest wait a shim may ask for.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
/// How often waiters are checked against their deadlines.
const TICK: Duration = Duration::from_millis(5);
/// How often holders are reminded to give back unused grants while bursts wait.
const RECLAIM_EVERY: Duration = Duration::from_millis(200);
/// How often NVML is asked which processes use memory (for memory used outside gpufrac).
const OBSERVE_EVERY: Duration = Duration::from_millis(250);

/// Ends processes chosen by the priority resolver. Behind a trait so that tests can
/// record instead of signalling.
pub trait Terminator: Send + Sync {
    /// Sends `signal` (`libc::SIGTERM`, `libc::SIGKILL`) to `pid`.
    fn signal(&self, pid: u32, signal: i32);
}

/// Signals real processes.
pub struct Signals;

impl Terminator for Signals {
    fn signal(&self, pid: u32, signal: i32) {
        if pid > 1 {
            // SAFETY: kill has no memory preconditions; the pid came from SO_PEERCRED.
            unsafe { libc::kill(pid as libc::pid_t, signal) };
        }
    }
}

/// The priority and swap resolvers' settings.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// A holder idle this long may be ended for an equal-priority burst (`--idle-timeout`).
    pub idle_timeout: Duration,
    /// Between SIGTERM and SIGKILL (`--kill-grace`).
    pub kill_grace: Duration,
    /// How long a holder keeps its burst memory before a swap burst may swap it out
    /// (`--swap-quantum`).
    pub swap_quantum: Duration,
    /// Most host RAM, in bytes, holding swapped-out memory on the node (`--swap-limit`).
    pub swap_limit: u64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            idle_timeout: Duration::from_secs(300),
            kill_grace: Duration::from_secs(10),
            swap_quantum: Duration::from_secs(10),
            swap_limit: u64::MAX,
        }
    }
}

/// State shared by every connection.
pub struct Shared {
    options: Options,
    terminator: Box<dyn Terminator>,
    /// Connections being ended, and when they were sent SIGTERM.
    ending: Mutex<HashMap<ConnId, (u32, Instant)>>,
    policy: Mutex<Policy>,
    writers: Mutex<HashMap<ConnId, mpsc::UnboundedSender<Vec<u8>>>>,
    /// The metrics, also served over HTTP.
    pub metrics: Arc<Metrics>,
    next_conn: AtomicU64,
    /// Metric labels per GPU, made once.
    labels: HashMap<DeviceId, GpuLabel>,
    /// Where memory used outside gpufrac is learnt (NVML); none in tests and benches.
    processes: Option<Box<dyn ProcessList>>,
}

impl Shared {
    /// The server state for GPUs `(uuid, memory)`.
    pub fn new(gpus: &[(DeviceId, u64)]) -> Arc<Shared> {
        Shared::with(gpus, Options::default(), Box::new(Signals), None)
    }

    /// The server state with resolver options, a way to end processes and, if given, a
    /// way to see the processes using each GPU.
    pub fn with(
        gpus: &[(DeviceId, u64)],
        options: Options,
        terminator: Box<dyn Terminator>,
        processes: Option<Box<dyn ProcessList>>,
    ) -> Arc<Shared> {
        Arc::new(Shared {
            processes,
            options,
            terminator,
            ending: Mutex::new(HashMap::new()),
            policy: Mutex::new(Policy::new(gpus)),
            writers: Mutex::new(HashMap::new()),
            metrics: Arc::new(Metrics::new()),
            next_conn: AtomicU64::new(1),
            labels: gpus.iter().map(|(id, _)| (*id, GpuLabel { gpu: uuid_string(id) })).collect(),
        })
    }

    fn label(&self, device: &DeviceId) -> std::borrow::Cow<'_, GpuLabel> {
        match self.labels.get(device) {
            Some(label) => std::borrow::Cow::Borrowed(label),
            None => std::borrow::Cow::Owned(GpuLabel { gpu: uuid_string(device) }),
        }
    }

    fn policy(&self) -> MutexGuard<'_, Policy> {
        self.policy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The status document.
    pub fn status(&self) -> Status {
        Status { swap_limit: self.options.swap_limit, ..self.policy().status() }
    }

    fn send(&self, conn: ConnId, reply: &Reply) {
        if let Some(tx) = self.writers.lock().unwrap_or_else(|p| p.into_inner()).get(&conn) {
            let _ = tx.send(reply.encode());
        }
    }

    /// Ends `victim`: SIGTERM now, SIGKILL after `--kill-grace` if it is still connected;
    /// its memory comes back when its connection closes.
    fn end(&self, ending: &mut HashMap<ConnId, (u32, Instant)>, victim: &Victim, reason: &str, now: Instant) {
        self.metrics.terminations.get_or_create(&Refusal { reason: reason.into() }).inc();
        self.terminator.signal(victim.pid, libc::SIGTERM);
        ending.insert(victim.conn, (victim.pid, now));
    }

    /// Connections being ended: those past the grace period get SIGKILL; those gone are
    /// forgotten. Returns the ones still under way.
    fn ending(&self, now: Instant) -> MutexGuard<'_, HashMap<ConnId, (u32, Instant)>> {
        let mut ending = self.ending.lock().unwrap_or_else(|p| p.into_inner());
        for (conn, (pid, since)) in ending.iter_mut() {
            if now.saturating_duration_since(*since) >= self.options.kill_grace
                && self.policy().peer(*conn).is_some()
            {
                tracing::warn!(pid = *pid, "still running after --kill-grace: SIGKILL");
                self.terminator.signal(*pid, libc::SIGKILL);
                *since = now + Duration::from_secs(3600);
            }
        }
        ending.retain(|conn, _| self.policy().peer(*conn).is_some());
        ending
    }

    /// The priority resolver: ends the holders chosen for waiting priority bursts.
    fn resolve_priority(&self) {
        let now = Instant::now();
        let mut ending = self.ending(now);
        let spared: Vec<ConnId> = ending.keys().copied().collect();
        let victims = self.policy().priority_victims(now, self.options.idle_timeout, &spared);
        for v in victims {
            tracing::warn!(pid = v.pid, group = %v.group, bytes = v.bytes, why = %v.why, "terminating a holder of burst memory for a priority burst");
            let reason = if v.why.starts_with("idle") { "idle" } else { "lower-priority" };
            self.end(&mut ending, &v, reason, now);
        }
    }

    /// Takes loans back where the guarantees are owed memory: unused grants first, then
    /// swap-outs, then ending holders (see `policy::reclaim`).
    fn reclaim_guarantees(&self) {
        let now = Instant::now();
        let mut ending = self.ending(now);
        let under_way: Vec<ConnId> = ending.keys().copied().collect();
        let plan = self.policy().reclaim(now, &under_way, self.options.swap_limit);
        if plan.is_empty() {
            return;
        }
        for (conn, device) in &plan.give_back {
            self.send(*conn, &Reply::Reclaim { device: *device });
        }
        for v in &plan.swap_out {
            tracing::info!(pid = v.pid, group = %v.group, gpu = %uuid_string(&v.device), bytes = v.bytes, "asking a holder of burst memory to swap out for a guarantee");
            self.send(v.conn, &Reply::SwapOut { device: v.device });
        }
        for v in &plan.end {
            tracing::warn!(pid = v.pid, group = %v.group, bytes = v.bytes, why = %v.why, "ending a holder of burst memory for a guarantee");
            self.end(&mut ending, v, "guarantee", now);
        }
    }

    /// The swap resolver: asks the chosen holders to swap out, and swapped-out processes
    /// to come back when memory is free.
    fn resolve_swap(&self) {
        let victims =
            self.policy().swap_victims(Instant::now(), self.options.swap_quantum, self.options.swap_limit);
        for v in victims {
            tracing::info!(pid = v.pid, group = %v.group, gpu = %uuid_string(&v.device), bytes = v.bytes, "asking a holder of burst memory to swap out for a swap burst");
            self.send(v.conn, &Reply::SwapOut { device: v.device });
        }
        // Memory counts as free again once no burst was asked for during a quantum (at
        // most a second), so a process in the middle of a burst is not raced.
        let settle = self.options.swap_quantum.min(Duration::from_secs(1));
        let resumable = self.policy().resume_candidates(Instant::now(), settle);
        for (conn, device) in resumable {
            self.send(conn, &Reply::Resume { device });
        }
    }

    /// Learns which processes use each GPU: memory of those not registered is not lent.
    fn observe_processes(&self) {
        let Some(list) = &self.processes else { return };
        let now = Instant::now();
        for (device, listed) in list.processes() {
            let answers = self.policy().observe_processes(device, &listed, now);
            self.deliver(answers);
        }
    }

    /// While bursts wait, holders of grants are asked to give back what they do not use.
    fn ask_to_give_back(&self) {
        let holders = self.policy().contended_holders(Instant::now());
        for (conn, device) in holders {
            self.send(conn, &Reply::Reclaim { device });
        }
    }

    /// Sends the answers to queued bursts, counts and logs them.
    fn deliver(&self, answers: Vec<Answer>) {
        for a in answers {
            let gpu = self.label(&a.device);
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
    // Before the first burst: a restarted arbiter must not lend memory that shims not yet
    // back still hold.
    let observer = shared.clone();
    let _ = tokio::task::spawn_blocking(move || observer.observe_processes()).await;
    let watcher = tokio::spawn(watch_processes(shared.clone()));
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
    watcher.abort();
}

async fn watch_processes(shared: Arc<Shared>) {
    if shared.processes.is_none() {
        return;
    }
    let mut tick = tokio::time::interval(OBSERVE_EVERY);
    // After a slow NVML answer, wait a whole period rather than ask again at once.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let observer = shared.clone();
        let _ = tokio::task::spawn_blocking(move || observer.observe_processes()).await;
    }
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
        // Keep reminding holders while anyone waits (they keep no slack meanwhile), and
        // let the priority resolver look again (holders become idle over time).
        if last_reclaim.elapsed() >= RECLAIM_EVERY {
            last_reclaim = Instant::now();
            shared.ask_to_give_back();
            shared.resolve_priority();
        }
        shared.resolve_swap();
        shared.reclaim_guarantees();
    }
}

async fn handle(stream: UnixStream, shared: Arc<Shared>) {
    // The peer's PID comes from the kernel, never from a message.
    let pid = stream.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0) as u32;
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let (mut reader, mut writer) = stream.into_split();
    // Answers decided elsewhere (a grant after a wait) arrive here; direct replies are
    // written by this task at once, without a hop through another task.
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let mut state = Connection { conn, pid, greeted: false };
    let mut buf = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(256);
    let result: Result<(), String> = loop {
        tokio::select! {
            frame = next_frame(&mut reader, &mut buf) => {
                let body = match frame {
                    Ok(Some(body)) => body,
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(e),
                };
                out.clear();
                let flow = on_frame(&shared, &mut state, &tx, &body, &mut out);
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
        }
    };
    if let Err(reason) = result {
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
}

/// The next frame body from `reader`, buffering in `buf`; `Ok(None)` at a clean end of
/// stream. Cancel-safe: bytes already read stay in `buf`.
async fn next_frame(reader: &mut OwnedReadHalf, buf: &mut Vec<u8>) -> Result<Option<Vec<u8>>, String> {
    loop {
        if buf.len() >= 4 {
            let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            if len == 0 || len > MAX_FRAME {
                return Err(format!("frame of {len} bytes (allowed: 1 to {MAX_FRAME})"));
            }
            if buf.len() >= 4 + len {
                let body = buf[4..4 + len].to_vec();
                buf.drain(..4 + len);
                return Ok(Some(body));
            }
        }
        match reader.read_buf(buf).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => return Err(format!("connection closed in the middle of a frame ({} bytes)", buf.len())),
            Ok(_) => {}
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// What one connection has said so far.
struct Connection {
    conn: ConnId,
    pid: u32,
    greeted: bool,
}

enum Flow {
    Continue,
    Close,
}

fn reply(out: &mut Vec<u8>, r: &Reply) {
    out.extend_from_slice(&r.encode());
}

/// Applies one frame; direct replies go into `out`.
fn on_frame(
    shared: &Arc<Shared>,
    c: &mut Connection,
    tx: &mpsc::UnboundedSender<Vec<u8>>,
    body: &[u8],
    out: &mut Vec<u8>,
) -> Result<Flow, String> {
    let (conn, pid) = (c.conn, c.pid);
    let request = Request::decode(body).map_err(|e| e.to_string())?;
    if !c.greeted {
        return match request {
            Request::Status => {
                let json = serde_json::to_string(&shared.status()).map_err(|e| e.to_string())?;
                reply(out, &Reply::Status { json });
                Ok(Flow::Close)
            }
            Request::Hello { version, group, pod, resolver, priority, wait_timeout_ms } => {
                reply(out, &Reply::Welcome { version: VERSION });
                if version != VERSION {
                    return Err(format!("protocol version {version}, this arbiter speaks {VERSION}"));
                }
                if group.is_empty() {
                    return Err("Hello without a group".into());
                }
                let wait_timeout = Duration::from_millis(wait_timeout_ms).min(MAX_WAIT);
                shared.writers.lock().unwrap_or_else(|p| p.into_inner()).insert(conn, tx.clone());
                tracing::info!(pid, %group, %pod, %resolver, priority, "shim connected");
                let now = Instant::now();
                let peer =
                    Peer { pid, group, pod, resolver, priority, wait_timeout, last_active: now, activity: 0 };
                shared.policy().hello(conn, peer);
                c.greeted = true;
                Ok(Flow::Continue)
            }
            other => Err(format!("expected Hello or Status first, got {other:?}")),
        };
    }
    match request {
        Request::Register { device, total, request, limit, held, granted, swapped } => {
            let result =
                shared.policy().register(conn, device, total, request, limit, held, granted, swapped);
            match result {
                Ok(()) => {
                    tracing::info!(pid, gpu = %uuid_string(&device), request, limit, held, granted, swapped, "registered");
                    reply(out, &Reply::Registered { device });
                    // Its request may be lent out: take it back now.
                    shared.reclaim_guarantees();
                }
                Err(reason) => {
                    shared.metrics.refusals.get_or_create(&Refusal { reason: "admission".into() }).inc();
                    tracing::warn!(pid, gpu = %uuid_string(&device), "registration refused: {reason}");
                    reply(out, &Reply::Refused { device, reason });
                }
            }
        }
        Request::Acquire { seq, device, bytes, preferred, held, resume } => {
            let outcome =
                shared.policy().acquire(conn, device, seq, bytes, preferred, held, resume, Instant::now());
            let gpu = shared.label(&device);
            match outcome {
                Outcome::Granted(granted) => {
                    shared.metrics.grants.get_or_create(&gpu).inc();
                    shared.metrics.granted_bytes.get_or_create(&gpu).inc_by(granted);
                    reply(out, &Reply::Granted { seq, bytes: granted });
                }
                Outcome::Queued => {
                    shared.metrics.waits.get_or_create(&gpu).inc();
                    tracing::info!(pid, gpu = %gpu.gpu, bytes, "burst waits: memory is lent out");
                    let answers = shared.policy().settle(device, Instant::now());
                    shared.deliver(answers);
                    shared.ask_to_give_back();
                    shared.resolve_priority();
                    shared.resolve_swap();
                }
                Outcome::Denied(reason) => {
                    shared.metrics.refusals.get_or_create(&Refusal { reason: format!("{reason:?}") }).inc();
                    reply(out, &Reply::Denied { seq, reason });
                }
            }
        }
        Request::Activity { count } => shared.policy().activity(conn, count, Instant::now()),
        Request::Release { device, bytes, held } => {
            let answers = shared.policy().release(conn, device, bytes, held, Instant::now());
            if !answers.is_empty() {
                shared.deliver(answers);
            }
        }
        Request::Swapped { device, direction, bytes, granted, host_bytes, held, micros } => {
            let direction = direction.as_str();
            let gpu = shared.label(&device);
            let took = Duration::from_micros(micros);
            tracing::info!(pid, gpu = %gpu.gpu, bytes, host_bytes, granted, ms = took.as_millis() as u64, us = micros, "swapped {direction}");
            if bytes > 0 {
                shared.metrics.count_swap(&gpu, direction, bytes, took);
            }
            let answers = shared.policy().swapped(conn, device, granted, host_bytes, held, Instant::now());
            shared.deliver(answers);
        }
        other => return Err(format!("unexpected {other:?} after Hello")),
    }
    Ok(Flow::Continue)
}
