//! The shim's side of the arbiter protocol (`GPUFRAC_ARBITER_SOCKET`). Started at
//! `cuInit`, never before: it connects, says who the process is and registers each
//! device (a refused registration fails `cuInit`), then one background thread reads
//! replies and, if the arbiter goes away, reconnects with backoff and re-registers what
//! the process holds and was granted, so the arbiter's ledger is rebuilt with nothing
//! lost. Meanwhile the process keeps what it holds; bursts wait for the arbiter up to
//! `GPUFRAC_WAIT_TIMEOUT`. Allocations within what was granted never touch the socket.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{read_frame, DeviceId, Reply, Request, MAX_FRAME};

pub(crate) use crate::enforcer::NotGranted;

/// (held, granted, swapped out to host) of this process on a device, for re-registration.
pub(crate) type UsageFn = Box<dyn Fn(&DeviceId) -> (u64, u64, u64) + Send + Sync>;
/// Where the client hands everything that is not the answer to a question it asked: one
/// route, given at [`Client::connect`] (wired in `registry::init`), so that the client
/// names nothing it serves.
pub(crate) type RouteFn = Box<dyn Fn(Event<'_>) + Send + Sync>;

/// What the client hands up its route.
pub(crate) enum Event<'a> {
    /// A message the arbiter pushed unasked: reclaim, swap out, resume, park, unparked,
    /// a compute lease.
    Pushed(&'a Reply),
    /// The arbiter admitted this process parked on `device` (at a registration).
    AdmittedParked(DeviceId),
    /// Registered again with a restarted arbiter.
    Reconnected,
    /// The connection to the arbiter is lost.
    Disconnected,
    /// Once a second: how many launches, copies and sets passed the gate so far.
    Tick { activity: u64 },
}

/// Longest a write to the arbiter may block before the connection is given up.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a device registered again waits for the client to be connected (then, with
/// the arbiter away, the request stands until the registration after the reconnection).
const CONNECTED_WAIT: Duration = Duration::from_secs(2);
/// Longest a device registered again waits for the arbiter's answer (then the request
/// stands, as with an arbiter away).
const REGISTER_AGAIN_WAIT: Duration = Duration::from_secs(10);
/// How long after a reclaim request this process keeps no slack grant.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// The client, once `cuInit` connected it ([`install`]).
static CLIENT: OnceLock<Arc<Client>> = OnceLock::new();

/// Makes `client` the process's arbiter client, for [`client`].
pub(crate) fn install(client: Arc<Client>) {
    let _ = CLIENT.set(client);
}

/// The arbiter client, when the process registered with an arbiter at `cuInit`.
pub(crate) fn client() -> Option<&'static Arc<Client>> {
    CLIENT.get()
}

/// What a device's registration says; held and granted are read when (re)registering.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Registration {
    pub device: DeviceId,
    pub total: u64,
    pub request: u64,
    pub limit: u64,
}

struct Waiting {
    frame: Vec<u8>,
    device: DeviceId,
    reply: Option<Reply>,
    /// The asking thread gave up; a grant arriving now is given straight back.
    abandoned: bool,
}

/// The arbiter's answer to a device registered again: the request and limit it
/// believes, or why it refused.
type RegisteredAgain = Result<(u64, u64), String>;

/// The connection to the arbiter.
pub(crate) struct Client {
    path: PathBuf,
    hello: Request,
    /// Set at [`Client::start`], after the first `Welcome` (fractions are of the memory
    /// it says the arbiter manages) or without one; a device registered again
    /// ([`Client::register_again`]) is updated here, for the registrations after a
    /// reconnection.
    registrations: Mutex<Vec<Registration>>,
    /// Devices registered again since the start, and the arbiter's answer once it came:
    /// the request and limit it believes, or why it refused.
    registered_again: Mutex<HashMap<DeviceId, Option<RegisteredAgain>>>,
    /// Signalled when an answer to a device registered again arrives.
    registered_again_answered: Condvar,
    /// The connection greeted at the start, until the registrations go on it.
    greeted: Mutex<Option<UnixStream>>,
    /// Per device, the memory the arbiter manages (its first `Welcome`).
    managed: Mutex<HashMap<DeviceId, u64>>,
    usage: UsageFn,
    route: RouteFn,
    /// Devices someone waits on, until when.
    contended: Mutex<HashMap<DeviceId, Instant>>,
    writer: Mutex<Option<UnixStream>>,
    waiting: Mutex<HashMap<u64, Waiting>>,
    answered: Condvar,
    next_seq: AtomicU64,
    connected: AtomicBool,
    /// Per device, the request and limit the arbiter believes (its last `Registered`).
    believed: Mutex<HashMap<DeviceId, (u64, u64)>>,
    /// Per device, what a context takes there as the arbiter learnt it (its last
    /// `Registered`; absent or 0: not known).
    contexts: Mutex<HashMap<DeviceId, u64>>,
    /// Per device, this process's clean measurement of a context, told to the arbiter at
    /// once if connected and again at every (re)connection.
    measured: Mutex<HashMap<DeviceId, u64>>,
    /// This process's PID as the arbiter sees it (its `Welcome`), 0 until known.
    seen_pid: AtomicU32,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Connects, says who the process is and registers every device.
fn handshake(c: &Client) -> Result<UnixStream, Handshake> {
    register(c, greet(c)?)
}

/// Connects and says who the process is; the `Welcome` says the PID the arbiter sees and,
/// the first time, the memory it manages of each GPU.
fn greet(c: &Client) -> Result<UnixStream, Handshake> {
    let mut stream = UnixStream::connect(&c.path).map_err(|e| Handshake::Unreachable(e.to_string()))?;
    let io = |e: std::io::Error| Handshake::Unreachable(e.to_string());
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(io)?;
    stream.write_all(&c.hello.encode()).map_err(io)?;
    let body = read_frame(&mut stream, MAX_FRAME).map_err(|e| Handshake::Unreachable(e.to_string()))?;
    match Reply::decode(&body).map_err(|e| Handshake::Unreachable(e.to_string()))? {
        Reply::Welcome { pid, managed, .. } => {
            c.seen_pid.store(pid, Ordering::Relaxed);
            // The slices were resolved against the first arbiter's sizes and stay so: a
            // restarted one with another --gpu-memory holds them to its own.
            let mut known = lock(&c.managed);
            if known.is_empty() {
                known.extend(managed);
            }
        }
        other => return Err(Handshake::Unreachable(format!("unexpected {other:?}"))),
    }
    Ok(stream)
}

/// Registers every device on a greeted connection; the answers come back synchronously.
fn register(c: &Client, mut stream: UnixStream) -> Result<UnixStream, Handshake> {
    let io = |e: std::io::Error| Handshake::Unreachable(e.to_string());
    let registrations = lock(&c.registrations).clone();
    for r in &registrations {
        let (held, granted, swapped) = (c.usage)(&r.device);
        let frame = Request::Register {
            device: r.device,
            total: r.total,
            request: r.request,
            limit: r.limit,
            held,
            granted,
            swapped,
        }
        .encode();
        stream.write_all(&frame).map_err(io)?;
    }
    let mut answers = 0;
    while answers < registrations.len() {
        let body = read_frame(&mut stream, MAX_FRAME).map_err(|e| Handshake::Unreachable(e.to_string()))?;
        match Reply::decode(&body).map_err(|e| Handshake::Unreachable(e.to_string()))? {
            Reply::Registered { device, request, limit, parked, context } => {
                answers += 1;
                lock(&c.believed).insert(device, (request, limit));
                lock(&c.contexts).insert(device, context);
                if context > request {
                    tracing::warn!(
                        request,
                        context,
                        "gpufrac: GPUFRAC_MEMORY_REQUEST ({request} bytes) is smaller than a context on this GPU ({context} bytes): \
                         the context alone takes memory above the request, a loan that a guarantee can take back"
                    );
                }
                if parked {
                    (c.route)(Event::AdmittedParked(device));
                }
                // The arbiter believes what this process's entitlement allows (docs/security.md):
                // say so at each registration, so that a cut request or limit is no mystery.
                let declared = registrations.iter().find(|r| r.device == device);
                if let Some(r) = declared.filter(|r| request < r.request || limit < r.limit) {
                    tracing::warn!(
                        declared_request = r.request,
                        declared_limit = r.limit,
                        request,
                        limit,
                        "the arbiter holds this process to less than it declared (its entitlement): memory past its request is counted as used outside gpufrac, bursts past its limit are refused"
                    );
                }
            }
            Reply::Refused { reason, .. } => return Err(Handshake::Refused(reason)),
            // The arbiter may tell a registered device's lease before the last answer.
            lease @ Reply::Lease { .. } => (c.route)(Event::Pushed(&lease)),
            other => return Err(Handshake::Unreachable(format!("unexpected {other:?}"))),
        }
    }
    stream.set_read_timeout(None).map_err(io)?;
    Ok(stream)
}

/// The memory the arbiter at `path` manages of each GPU, asked with `hello` on a
/// connection of its own that registers nothing (for a process that reads NVML without
/// `cuInit`); empty when it cannot be reached.
pub(crate) fn managed_sizes(path: &Path, hello: Request) -> HashMap<DeviceId, u64> {
    let ask = || -> Result<HashMap<DeviceId, u64>, String> {
        let mut stream = UnixStream::connect(path).map_err(|e| e.to_string())?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
        stream.write_all(&hello.encode()).map_err(|e| e.to_string())?;
        match Reply::decode(&read_frame(&mut stream, MAX_FRAME).map_err(|e| e.to_string())?) {
            Ok(Reply::Welcome { managed, .. }) => Ok(managed.into_iter().collect()),
            other => Err(format!("unexpected {other:?}")),
        }
    };
    ask().unwrap_or_else(|why| {
        tracing::warn!(socket = %path.display(), "cannot ask the arbiter what it manages of each GPU ({why}): NVML shows slices of the whole GPU");
        HashMap::new()
    })
}

enum Handshake {
    Unreachable(String),
    Refused(String),
}

impl Client {
    /// Connects to the arbiter at `path` and says who the process is, to learn the
    /// memory it manages ([`Client::managed`]) before the process's slices are decided;
    /// [`Client::start`] registers them. An arbiter that cannot be reached is no error.
    pub(crate) fn connect(path: &Path, hello: Request, usage: UsageFn, route: RouteFn) -> Arc<Client> {
        let client = Arc::new(Client {
            path: path.to_owned(),
            hello,
            registrations: Mutex::new(Vec::new()),
            registered_again: Mutex::new(HashMap::new()),
            registered_again_answered: Condvar::new(),
            greeted: Mutex::new(None),
            managed: Mutex::new(HashMap::new()),
            usage,
            route,
            contended: Mutex::new(HashMap::new()),
            writer: Mutex::new(None),
            waiting: Mutex::new(HashMap::new()),
            answered: Condvar::new(),
            next_seq: AtomicU64::new(1),
            connected: AtomicBool::new(false),
            believed: Mutex::new(HashMap::new()),
            contexts: Mutex::new(HashMap::new()),
            measured: Mutex::new(HashMap::new()),
            seen_pid: AtomicU32::new(0),
        });
        match greet(&client) {
            Ok(stream) => *lock(&client.greeted) = Some(stream),
            Err(Handshake::Unreachable(why) | Handshake::Refused(why)) => {
                tracing::warn!(socket = %path.display(), "arbiter unreachable ({why}); bursts wait for it");
            }
        }
        client
    }

    /// The memory the arbiter manages of `device`, if it said (its first `Welcome`).
    pub(crate) fn managed(&self, device: &DeviceId) -> Option<u64> {
        lock(&self.managed).get(device).copied()
    }

    /// Registers `registrations` (on the connection [`Client::connect`] greeted, if it
    /// was) and starts the client's threads. A refusal is an error (for `cuInit`); an
    /// arbiter that cannot be reached is not: the client keeps trying in the background.
    pub(crate) fn start(self: &Arc<Client>, registrations: Vec<Registration>) -> Result<(), String> {
        let path = &self.path;
        let client = self.clone();
        *lock(&client.registrations) = registrations;
        let greeted = lock(&client.greeted).take();
        let first = match greeted.map(|stream| register(&client, stream)) {
            None => None,
            Some(Ok(stream)) => Some(stream),
            Some(Err(Handshake::Refused(reason))) => {
                return Err(format!("gpufrac: the arbiter refused this process: {reason}"))
            }
            Some(Err(Handshake::Unreachable(why))) => {
                tracing::warn!(socket = %path.display(), "arbiter unreachable ({why}); bursts wait for it");
                None
            }
        };
        let background = client.clone();
        std::thread::Builder::new()
            .name("gpufrac-arbiter".into())
            .spawn(move || background.run(first))
            .map_err(|e| format!("gpufrac: cannot start the arbiter client thread: {e}"))?;
        let reporter = client.clone();
        std::thread::Builder::new()
            .name("gpufrac-activity".into())
            .spawn(move || reporter.report_activity())
            .map_err(|e| format!("gpufrac: cannot start the activity thread: {e}"))?;
        Ok(())
    }

    /// Registers `registration`'s device again, with a larger request (the process's
    /// first context there under `GPUFRAC_RESERVE=first-use`): the request and limit the
    /// arbiter believes, or why it refused. With the arbiter away, the request stands (the
    /// registration after the reconnection carries it, and may still be refused then).
    pub(crate) fn register_again(&self, registration: Registration) -> RegisteredAgain {
        let device = registration.device;
        let before = {
            let mut registrations = lock(&self.registrations);
            match registrations.iter_mut().find(|r| r.device == device) {
                Some(r) => Some(std::mem::replace(r, registration)),
                None => {
                    registrations.push(registration);
                    None
                }
            }
        };
        let answer = self.ask_registration(registration);
        if answer.is_err() {
            // Refused: the registrations after a reconnection keep what was believed
            // before, not a request the arbiter turned down.
            let mut registrations = lock(&self.registrations);
            match before {
                Some(before) => {
                    if let Some(r) = registrations.iter_mut().find(|r| r.device == device) {
                        *r = before;
                    }
                }
                None => registrations.retain(|r| r.device != device),
            }
        }
        answer
    }

    /// Sends `registration` on the connection and waits for the arbiter's answer.
    fn ask_registration(&self, registration: Registration) -> RegisteredAgain {
        let device = registration.device;
        lock(&self.registered_again).insert(device, None);
        let (held, granted, swapped) = (self.usage)(&device);
        let frame = Request::Register {
            device,
            total: registration.total,
            request: registration.request,
            limit: registration.limit,
            held,
            granted,
            swapped,
        }
        .encode();
        // The client's thread takes the connection over just after `cuInit`, which a first
        // context may follow at once: it is waited for, briefly.
        let connecting = Instant::now() + CONNECTED_WAIT;
        while !self.connected.load(Ordering::Acquire) && Instant::now() < connecting {
            std::thread::sleep(Duration::from_millis(5));
        }
        if !self.write(&frame) {
            lock(&self.registered_again).remove(&device);
            return Ok((registration.request, registration.limit));
        }
        let deadline = Instant::now() + REGISTER_AGAIN_WAIT;
        let mut answers = lock(&self.registered_again);
        loop {
            if let Some(Some(answer)) = answers.get(&device) {
                let answer = answer.clone();
                answers.remove(&device);
                return answer;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                answers.remove(&device);
                return Ok((registration.request, registration.limit));
            }
            answers = self
                .registered_again_answered
                .wait_timeout(answers, left)
                .map(|(a, _)| a)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// The arbiter's answer to a device registered again, for the thread waiting for it.
    fn answer_registration(&self, device: DeviceId, answer: RegisteredAgain) {
        let mut answers = lock(&self.registered_again);
        if let Some(slot) = answers.get_mut(&device) {
            *slot = Some(answer);
            drop(answers);
            self.registered_again_answered.notify_all();
        }
    }

    /// This process's PID as the arbiter sees it (the host's, in a container), once the
    /// arbiter has answered.
    pub(crate) fn seen_pid(&self) -> Option<u32> {
        Some(self.seen_pid.load(Ordering::Relaxed)).filter(|&pid| pid != 0)
    }

    /// The request and limit the arbiter believes for `device`, once it has registered.
    pub(crate) fn believed(&self, device: &DeviceId) -> Option<(u64, u64)> {
        lock(&self.believed).get(device).copied()
    }

    /// What a context takes on `device`, if the arbiter knew it at registration.
    pub(crate) fn context_bytes(&self, device: &DeviceId) -> Option<u64> {
        lock(&self.contexts).get(device).copied().filter(|&bytes| bytes > 0)
    }

    /// Reads replies; reconnects when the arbiter goes away.
    fn run(self: Arc<Client>, mut stream: Option<UnixStream>) {
        let mut backoff = Duration::from_millis(50);
        loop {
            let Some(mut reader) = stream.take() else {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(2));
                match handshake(&self) {
                    Ok(s) => {
                        tracing::info!(socket = %self.path.display(), "reconnected to the arbiter");
                        (self.route)(Event::Reconnected);
                        backoff = Duration::from_millis(50);
                        stream = Some(s);
                    }
                    Err(Handshake::Refused(reason)) => {
                        tracing::error!("the restarted arbiter refused this process: {reason}");
                    }
                    Err(Handshake::Unreachable(_)) => {}
                }
                continue;
            };
            // Requests are written under the `waiting` lock: a write must not block for
            // ever on an arbiter that stopped reading.
            match reader.try_clone() {
                Ok(w) if w.set_write_timeout(Some(WRITE_TIMEOUT)).is_ok() => *lock(&self.writer) = Some(w),
                _ => continue,
            }
            {
                // Bursts asked while the arbiter was away are asked again. Under the lock
                // `acquire` sends under, so each is sent exactly once on this connection:
                // a burst asked twice would be granted twice.
                let mut waiting = lock(&self.waiting);
                self.connected.store(true, Ordering::Release);
                waiting.retain(|_, w| !w.abandoned);
                for w in waiting.values().filter(|w| w.reply.is_none()) {
                    self.write(&w.frame);
                }
            }
            for (&device, &bytes) in lock(&self.measured).iter() {
                self.write(&Request::ContextMeasured { device, bytes }.encode());
            }
            loop {
                let body = match read_frame(&mut reader, MAX_FRAME) {
                    Ok(body) => body,
                    Err(e) => {
                        tracing::warn!("lost the arbiter: {e}");
                        break;
                    }
                };
                match Reply::decode(&body) {
                    Ok(reply @ (Reply::Granted { .. } | Reply::Denied { .. })) => {
                        let (seq, granted) = match reply {
                            Reply::Granted { seq, bytes } => (seq, bytes),
                            Reply::Denied { seq, .. } => (seq, 0),
                            _ => continue,
                        };
                        let mut waiting = lock(&self.waiting);
                        match waiting.get_mut(&seq) {
                            Some(w) if w.abandoned => {
                                let device = w.device;
                                waiting.remove(&seq);
                                drop(waiting);
                                if granted > 0 {
                                    let (held, _, _) = (self.usage)(&device);
                                    self.release(device, granted, held);
                                }
                            }
                            Some(w) => {
                                w.reply = Some(reply);
                                drop(waiting);
                                self.answered.notify_all();
                            }
                            None => tracing::warn!(seq, granted, "an answer to a burst nobody asked for"),
                        }
                    }
                    Ok(command @ Reply::Reclaim { device }) => {
                        lock(&self.contended).insert(device, Instant::now() + CONTENDED_FOR);
                        (self.route)(Event::Pushed(&command));
                    }
                    Ok(
                        command @ (Reply::SwapOut { .. }
                        | Reply::Resume { .. }
                        | Reply::Park { .. }
                        | Reply::Unparked { .. }),
                    ) => (self.route)(Event::Pushed(&command)),
                    Ok(lease @ Reply::Lease { .. }) => (self.route)(Event::Pushed(&lease)),
                    Ok(Reply::Registered { device, request, limit, .. }) => {
                        lock(&self.believed).insert(device, (request, limit));
                        self.answer_registration(device, Ok((request, limit)));
                    }
                    Ok(Reply::Refused { device, reason }) => self.answer_registration(device, Err(reason)),
                    Ok(other) => tracing::debug!("arbiter says {other:?}"),
                    Err(e) => {
                        tracing::warn!("bad frame from the arbiter: {e}");
                        break;
                    }
                }
            }
            self.connected.store(false, Ordering::Release);
            *lock(&self.writer) = None;
            (self.route)(Event::Disconnected);
        }
    }

    /// Tells the arbiter, once a second and only when it moved, how many launches, copies
    /// and sets passed the gate: its measure of whether this process is idle. Also watches for idleness with memory above the request, to give back what the
    /// frameworks keep (`GPUFRAC_GIVE_BACK_IDLE`).
    fn report_activity(self: Arc<Client>) {
        let mut last = None;
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let count = crate::control::gate::activity();
            (self.route)(Event::Tick { activity: count });
            let moved = last != Some(count) && self.connected.load(Ordering::Acquire);
            if moved && self.write(&Request::Activity { count }.encode()) {
                last = Some(count);
            }
        }
    }

    /// Sends `request` if connected (no answer). What is lost while the arbiter is away
    /// is rebuilt by the re-registration.
    pub(crate) fn send(&self, request: &Request) -> bool {
        self.is_connected() && self.write(&request.encode())
    }

    /// Tells the arbiter what a context took on `device` (a clean measurement): now if it
    /// is connected, and at every connection from now on (a report lost while it was away,
    /// or made before this client's connection was up, is not lost).
    pub(crate) fn report_context(&self, device: DeviceId, bytes: u64) {
        lock(&self.measured).insert(device, bytes);
        self.send(&Request::ContextMeasured { device, bytes });
    }

    /// Sends `request`, waiting for the arbiter to be back if it is away. For messages
    /// that state where things are (not changes), which may harmlessly arrive again.
    pub(crate) fn send_until_delivered(&self, request: &Request) {
        let frame = request.encode();
        while !(self.is_connected() && self.write(&frame)) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn write(&self, frame: &[u8]) -> bool {
        let mut writer = lock(&self.writer);
        let written = writer.as_mut().is_some_and(|w| w.write_all(frame).is_ok());
        if !written {
            // Possibly half a frame went out: end the connection so that the reader
            // reconnects and asks again what is pending, rather than go on garbled.
            if let Some(w) = writer.take() {
                let _ = w.shutdown(std::net::Shutdown::Both);
            }
        }
        written
    }

    /// Whether the arbiter answers now.
    pub(crate) fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Whether bursts wait on `device` (so this process should keep no slack).
    pub(crate) fn contended(&self, device: &DeviceId) -> bool {
        lock(&self.contended).get(device).is_some_and(|until| Instant::now() < *until)
    }

    /// Asks for at least `bytes` (`preferred` if free) of burst memory and waits up to
    /// `timeout` for the answer: the bytes granted, or why not. A `resume` (to swap back
    /// in) waits at the arbiter without deadline.
    pub(crate) fn acquire(
        &self,
        device: DeviceId,
        bytes: u64,
        preferred: u64,
        held: u64,
        timeout: Duration,
        resume: bool,
    ) -> Result<u64, NotGranted> {
        self.ask(device, timeout, |seq| Request::Acquire { seq, device, bytes, preferred, held, resume })
    }

    /// Asks the arbiter to wake this parked process on `device` and waits up to `timeout`
    /// for the answer: the burst bytes it holds again, or why not.
    pub(crate) fn wake(&self, device: DeviceId, timeout: Duration) -> Result<u64, NotGranted> {
        self.ask(device, timeout, |seq| Request::Wake { seq, device })
    }

    /// Sends the request `make(seq)` and waits up to `timeout` for its `Granted` or
    /// `Denied`.
    fn ask(
        &self,
        device: DeviceId,
        timeout: Duration,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<u64, NotGranted> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let frame = make(seq).encode();
        {
            // Sent here only if connected; otherwise the reader thread sends it when it
            // connects. The lock makes it one or the other, never both.
            let mut waiting = lock(&self.waiting);
            if self.connected.load(Ordering::Acquire) {
                self.write(&frame);
            }
            waiting.insert(seq, Waiting { frame, device, reply: None, abandoned: false });
        }
        // The arbiter answers at its own deadline; allow a little more for the reply.
        let deadline = Instant::now() + timeout + Duration::from_millis(500);
        let mut waiting = lock(&self.waiting);
        let reply = loop {
            if let Some(reply) = waiting.get(&seq).and_then(|w| w.reply.clone()) {
                break Some(reply);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break None;
            }
            waiting = self
                .answered
                .wait_timeout(waiting, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        };
        match reply {
            Some(_) => {
                waiting.remove(&seq);
            }
            None => {
                if let Some(w) = waiting.get_mut(&seq) {
                    w.abandoned = true;
                }
            }
        }
        drop(waiting);
        match reply {
            Some(Reply::Granted { bytes, .. }) => Ok(bytes),
            Some(Reply::Denied { reason, .. }) => Err(NotGranted::Denied(reason)),
            _ => Err(NotGranted::NoAnswer { connected: self.is_connected() }),
        }
    }

    /// Gives back `bytes` of burst memory (no answer).
    pub(crate) fn release(&self, device: DeviceId, bytes: u64, held: u64) {
        if self.connected.load(Ordering::Acquire) {
            self.write(&Request::Release { device, bytes, held }.encode());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn writing_to_a_dead_arbiter_is_an_error_not_a_sigpipe() {
        // Host programs often keep SIGPIPE's default action (end the process); the test
        // runner ignores it, so restore the default around the write. std sends on Unix
        // sockets with MSG_NOSIGNAL: the write fails with EPIPE and the process lives.
        // SAFETY: changing a signal disposition has no preconditions.
        let previous = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let (ours, theirs) = UnixStream::pair().unwrap();
        drop(theirs);
        let result = (&ours).write_all(b"hello");
        // SAFETY: as above, restoring what was there.
        unsafe { libc::signal(libc::SIGPIPE, previous) };
        assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::EPIPE));
    }
}
