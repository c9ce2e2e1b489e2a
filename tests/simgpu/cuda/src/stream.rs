//! Streams and events. Each stream has its own worker thread that runs the stream's work
//! in order, after the call that queued it has returned, as a GPU does: a program that
//! forgets to synchronize can observe it.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::Instant;

use crossbeam_channel::{unbounded, Sender};
use cudarc::driver::sys::{CUcontext, CUevent, CUstream};
use parking_lot::{Condvar, Mutex};

use crate::context::{self, Context};
use crate::ffi::{write_out, CUresult, CuResult};
use crate::graph::{self, Capture, Node, NodeType, Task};

/// Work queued on a stream.
pub(crate) type Job = Box<dyn FnOnce() -> CuResult + Send>;

/// A job and whether it is a kernel that needs the device (see `simgpu_state::sched`).
struct Queued {
    job: Job,
    kernel: bool,
    /// An event's marker: it counts as done on this stream before it signals the event,
    /// so that a stream query after an event synchronize sees the stream at that point.
    marker: bool,
}

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`, the special stream handles.
const STREAM_LEGACY: usize = 0x1;
const STREAM_PER_THREAD: usize = 0x2;
const EVENT_DISABLE_TIMING: c_uint = 0x2;

/// Which stream a null handle means: the legacy default stream or the per-thread one
/// (the `_ptsz`/`_ptds` entry points).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum DefaultStream {
    Legacy,
    PerThread,
}

struct Progress {
    completed: Mutex<u64>,
    done: Condvar,
}

/// One stream: a queue and the worker that drains it.
pub(crate) struct Stream {
    pub ctx: usize,
    pub device: usize,
    pub flags: c_uint,
    pub priority: c_int,
    sender: Mutex<Option<Sender<Queued>>>,
    submitted: AtomicU64,
    progress: Arc<Progress>,
    /// The context's sticky error cell: an illegal access poisons the whole context.
    sticky: Arc<AtomicU32>,
    /// The capture this stream records into, while it captures (see `graph`).
    pub capture: Mutex<Option<Arc<Capture>>>,
}

impl Stream {
    pub(crate) fn new(
        ctx: usize,
        device: usize,
        sticky: Arc<AtomicU32>,
        flags: c_uint,
        priority: c_int,
    ) -> Arc<Stream> {
        Arc::new(Stream {
            ctx,
            device,
            flags,
            priority,
            sender: Mutex::new(None),
            submitted: AtomicU64::new(0),
            progress: Arc::new(Progress { completed: Mutex::new(0), done: Condvar::new() }),
            sticky,
            capture: Mutex::new(None),
        })
    }

    fn for_context(ctx: &Context, flags: c_uint, priority: c_int) -> Arc<Stream> {
        Stream::new(ctx.handle(), ctx.device, ctx.sticky.clone(), flags, priority)
    }

    /// Queues `job`; it runs after everything queued before it on this stream.
    pub(crate) fn submit(&self, job: Job) -> CuResult {
        self.queue(Queued { job, kernel: false, marker: false })
    }

    /// Queues an event's marker (see [`Queued::marker`]).
    fn submit_marker(&self, job: Job) -> CuResult {
        self.queue(Queued { job, kernel: false, marker: true })
    }

    /// Queues a kernel that runs on the device: it runs after everything queued before it
    /// on this stream, while this process owns the device (time-slicing).
    pub(crate) fn submit_kernel(&self, job: Job) -> CuResult {
        self.queue(Queued { job, kernel: true, marker: false })
    }

    /// Queues `run` (a kernel when `device_time`), or records it as a node of type `ty`
    /// while the stream captures.
    pub(crate) fn enqueue(&self, ty: NodeType, run: Task, device_time: bool) -> CuResult {
        if let Some(capture) = self.capturing() {
            return capture.record(Node::Task { ty, run, device_time });
        }
        let job: Job = Box::new(move || run());
        if device_time {
            self.submit_kernel(job)
        } else {
            self.submit(job)
        }
    }

    /// The capture this stream records into, if it captures.
    pub(crate) fn capturing(&self) -> Option<Arc<Capture>> {
        if !graph::any_capture() {
            return None;
        }
        self.capture.lock().clone()
    }

    fn queue(&self, queued: Queued) -> CuResult {
        if graph::any_capture() {
            // Work that reached a capturing stream without being recorded would run
            // now: refuse it, as the driver refuses what capture does not support.
            if let Some(capture) = self.capturing() {
                capture.invalidate();
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            if is_legacy(self) {
                graph::legacy_use(self.ctx)?;
            }
        }
        let mut sender = self.sender.lock();
        if sender.is_none() {
            *sender = Some(self.spawn_worker()?);
        }
        self.submitted.fetch_add(1, Ordering::AcqRel);
        PENDING_JOBS.fetch_add(1, Ordering::SeqCst);
        let sent = sender.as_ref().map(|s| s.send(queued).is_ok()).unwrap_or(false);
        if sent {
            Ok(())
        } else {
            PENDING_JOBS.fetch_sub(1, Ordering::SeqCst);
            Err(CUresult::CUDA_ERROR_UNKNOWN)
        }
    }

    fn spawn_worker(&self) -> CuResult<Sender<Queued>> {
        let (tx, rx) = unbounded::<Queued>();
        let progress = self.progress.clone();
        let sticky = self.sticky.clone();
        let device = self.device;
        std::thread::Builder::new()
            .name("simgpu-stream".into())
            .spawn(move || {
                // Sleep kernels sleep in short chunks: wake on time, not 50 µs late.
                // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack.
                unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
                let sched = crate::driver::driver().ok().map(|d| &d.sched);
                // Whether this stream keeps the device: it runs kernels back to back.
                let mut claimed = false;
                for Queued { job, kernel, marker } in rx.iter() {
                    if let Some(sched) = sched.filter(|_| kernel != claimed) {
                        if kernel {
                            sched.claim(device);
                        } else {
                            sched.unclaim(device);
                        }
                        claimed = kernel;
                    }
                    let bump = || {
                        let mut done = progress.completed.lock();
                        *done += 1;
                        progress.done.notify_all();
                        drop(done);
                        PENDING_JOBS.fetch_sub(1, Ordering::SeqCst);
                    };
                    if marker {
                        bump();
                    }
                    if let Err(code) = job() {
                        // First error wins, as a context's sticky error does.
                        let _ = sticky.compare_exchange(0, code as u32, Ordering::AcqRel, Ordering::Acquire);
                    }
                    // Nothing queued behind: the device may go to another process before
                    // this stream's waiters see the work done, as on a GPU.
                    if let Some(sched) = sched.filter(|_| claimed && rx.is_empty()) {
                        sched.unclaim(device);
                        claimed = false;
                    }
                    if !marker {
                        bump();
                    }
                }
            })
            .map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
        Ok(tx)
    }

    /// Waits for everything queued so far.
    pub(crate) fn synchronize(&self) -> CuResult {
        let target = self.submitted.load(Ordering::Acquire);
        let mut done = self.progress.completed.lock();
        while *done < target {
            self.progress.done.wait(&mut done);
        }
        drop(done);
        self.sticky_error()
    }

    /// Whether everything queued so far has run.
    pub(crate) fn idle(&self) -> bool {
        *self.progress.completed.lock() >= self.submitted.load(Ordering::Acquire)
    }

    pub(crate) fn sticky_error(&self) -> CuResult {
        sticky_to_result(self.sticky.load(Ordering::Acquire))
    }
}

pub(crate) fn sticky_to_result(code: u32) -> CuResult {
    match code {
        0 => Ok(()),
        700 => Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
        _ => Err(CUresult::CUDA_ERROR_LAUNCH_FAILED),
    }
}

/// Jobs queued on any stream of this process and not finished yet: what the checkpoint
/// lock waits for (per-thread default streams are in no table, so a count it is).
static PENDING_JOBS: AtomicU64 = AtomicU64::new(0);

/// How many queued jobs have not finished yet, on all streams of the process.
pub(crate) fn pending_jobs() -> u64 {
    PENDING_JOBS.load(Ordering::SeqCst)
}

static STREAMS: LazyLock<Mutex<HashMap<usize, Arc<Stream>>>> = LazyLock::new(Default::default);

thread_local! {
    /// This thread's per-thread default stream, one per context.
    static PER_THREAD: std::cell::RefCell<Vec<(usize, Arc<Stream>)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The stream a caller's handle names; null means the current context's default stream.
pub(crate) fn resolve(handle: CUstream, default: DefaultStream) -> CuResult<Arc<Stream>> {
    let raw = handle as usize;
    let per_thread = raw == STREAM_PER_THREAD || (raw == 0 && default == DefaultStream::PerThread);
    if raw == 0 || raw == STREAM_LEGACY || raw == STREAM_PER_THREAD {
        let ctx = context::current()?;
        if !per_thread {
            return Ok(ctx.null_stream.clone());
        }
        let found = PER_THREAD.try_with(|cell| {
            let mut streams = cell.borrow_mut();
            streams.retain(|(c, _)| context::lookup(*c).is_ok());
            if let Some((_, s)) = streams.iter().find(|(c, _)| *c == ctx.handle()) {
                return s.clone();
            }
            let s = Stream::for_context(&ctx, 0, 0);
            streams.push((ctx.handle(), s.clone()));
            s
        });
        // A call from a thread-local destructor at thread exit, after this thread's
        // streams are gone: the context's default stream keeps its work in order.
        return Ok(found.unwrap_or_else(|_| ctx.null_stream.clone()));
    }
    STREAMS.lock().get(&raw).cloned().ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

pub(crate) fn stream_create(out: *mut CUstream, flags: c_uint, priority: c_int) -> CuResult {
    if flags & !1 != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    stream_create_in(&context::current()?, out, flags, priority)
}

/// Creates a stream of `ctx` (`cuStreamCreate` in the current context, `cuGreenCtxStreamCreate`
/// in a green context's).
pub(crate) fn stream_create_in(
    ctx: &Arc<context::Context>,
    out: *mut CUstream,
    flags: c_uint,
    priority: c_int,
) -> CuResult {
    let stream = Stream::for_context(ctx, flags, priority.clamp(-5, 0));
    let handle = Arc::as_ptr(&stream) as usize;
    write_out(out, handle as CUstream)?;
    STREAMS.lock().insert(handle, stream);
    Ok(())
}

/// `cuStreamDestroy`: returns at once; queued work still completes, as on a GPU.
pub(crate) fn stream_destroy(handle: CUstream) -> CuResult {
    STREAMS.lock().remove(&(handle as usize)).map(|_| ()).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

/// Whether `s` is its context's legacy default stream (the one capture cannot use).
pub(crate) fn is_legacy(s: &Stream) -> bool {
    context::lookup(s.ctx).is_ok_and(|c| std::ptr::eq(Arc::as_ptr(&c.null_stream), s))
}

/// A synchronize or query of a capturing stream can never see its work done: the
/// capture is invalidated and the call refused. The legacy stream cannot wait for a
/// blocking stream that captures.
fn check_waitable(stream: &Stream) -> CuResult {
    if let Some(capture) = stream.capturing() {
        capture.invalidate();
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    if graph::any_capture() && is_legacy(stream) {
        graph::legacy_use(stream.ctx)?;
    }
    Ok(())
}

pub(crate) fn stream_synchronize(handle: CUstream, default: DefaultStream) -> CuResult {
    let stream = resolve(handle, default)?;
    check_waitable(&stream)?;
    stream.synchronize()?;
    crate::pool::trim_after_sync(stream.device);
    Ok(())
}

pub(crate) fn stream_query(handle: CUstream, default: DefaultStream) -> CuResult {
    let stream = resolve(handle, default)?;
    check_waitable(&stream)?;
    stream.sticky_error()?;
    if stream.idle() {
        Ok(())
    } else {
        Err(CUresult::CUDA_ERROR_NOT_READY)
    }
}

pub(crate) fn stream_get_ctx(handle: CUstream, out: *mut CUcontext, default: DefaultStream) -> CuResult {
    let stream = resolve(handle, default)?;
    write_out(out, stream.ctx as CUcontext)
}

pub(crate) fn stream_get_priority(handle: CUstream, out: *mut c_int, default: DefaultStream) -> CuResult {
    write_out(out, resolve(handle, default)?.priority)
}

pub(crate) fn stream_get_flags(handle: CUstream, out: *mut c_uint, default: DefaultStream) -> CuResult {
    write_out(out, resolve(handle, default)?.flags)
}

/// Priorities run from 0 (least) to -5 (greatest), as on current GPUs.
pub(crate) fn priority_range(least: *mut c_int, greatest: *mut c_int) -> CuResult {
    context::current()?;
    if !least.is_null() {
        write_out(least, 0)?;
    }
    if !greatest.is_null() {
        write_out(greatest, -5)?;
    }
    Ok(())
}

/// Streams of a context, for `cuCtxSynchronize`.
pub(crate) fn streams_of(ctx: usize) -> Vec<Arc<Stream>> {
    let mut all: Vec<_> = STREAMS.lock().values().filter(|s| s.ctx == ctx).cloned().collect();
    // During thread-local destruction this thread's per-thread streams are already gone
    // (and were drained as they went), so there is nothing more to add.
    let _ = PER_THREAD
        .try_with(|cell| all.extend(cell.borrow().iter().filter(|(c, _)| *c == ctx).map(|(_, s)| s.clone())));
    all
}

/// Forgets the streams of a destroyed context.
pub(crate) fn forget_streams_of(ctx: usize) {
    STREAMS.lock().retain(|_, s| s.ctx != ctx);
}

/// An event: a marker recorded into a stream, complete when the stream reaches it.
pub(crate) struct Event {
    flags: c_uint,
    /// The capture it was last recorded in, if it was recorded on a capturing stream.
    captured: Mutex<Option<Weak<Capture>>>,
    state: Mutex<EventState>,
    done: Condvar,
}

#[derive(Default)]
struct EventState {
    recorded: u64,
    completed: u64,
    at: Option<Instant>,
}

static EVENTS: LazyLock<Mutex<HashMap<usize, Arc<Event>>>> = LazyLock::new(Default::default);

fn event(handle: CUevent) -> CuResult<Arc<Event>> {
    EVENTS.lock().get(&(handle as usize)).cloned().ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

pub(crate) fn event_create(out: *mut CUevent, flags: c_uint) -> CuResult {
    context::current()?;
    if flags & !0xf != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let ev = Arc::new(Event {
        flags,
        captured: Mutex::new(None),
        state: Mutex::new(EventState::default()),
        done: Condvar::new(),
    });
    let handle = Arc::as_ptr(&ev) as usize;
    write_out(out, handle as CUevent)?;
    EVENTS.lock().insert(handle, ev);
    Ok(())
}

pub(crate) fn event_destroy(handle: CUevent) -> CuResult {
    EVENTS.lock().remove(&(handle as usize)).map(|_| ()).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

/// `cuEventRecordWithFlags`: as `cuEventRecord`; the one flag (CU_EVENT_RECORD_EXTERNAL,
/// an event node in a captured graph) is not modelled: the event marks the capture.
pub(crate) fn event_record_with_flags(
    handle: CUevent,
    stream: CUstream,
    flags: c_uint,
    default: DefaultStream,
) -> CuResult {
    if flags & !1 != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    event_record(handle, stream, default)
}

pub(crate) fn event_record(handle: CUevent, stream: CUstream, default: DefaultStream) -> CuResult {
    let ev = event(handle)?;
    let stream = resolve(stream, default)?;
    // On a capturing stream the event marks a point of the capture (no work is queued):
    // a stream that waits for it joins the capture.
    if let Some(capture) = stream.capturing() {
        *ev.captured.lock() = Some(Arc::downgrade(&capture));
        return Ok(());
    }
    *ev.captured.lock() = None;
    let generation = {
        let mut st = ev.state.lock();
        st.recorded += 1;
        st.recorded
    };
    let marker = ev.clone();
    stream.submit_marker(Box::new(move || {
        let mut st = marker.state.lock();
        if st.completed < generation {
            st.completed = generation;
            st.at = Some(Instant::now());
        }
        marker.done.notify_all();
        Ok(())
    }))
}

/// An event last recorded in a capture that is still going on has no completion to
/// wait for or query.
fn check_not_captured(ev: &Event) -> CuResult {
    if graph::any_capture() && ev.captured.lock().as_ref().is_some_and(graph::is_active) {
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}

pub(crate) fn event_synchronize(handle: CUevent) -> CuResult {
    let ev = event(handle)?;
    check_not_captured(&ev)?;
    let mut st = ev.state.lock();
    let target = st.recorded;
    while st.completed < target {
        ev.done.wait(&mut st);
    }
    Ok(())
}

pub(crate) fn event_query(handle: CUevent) -> CuResult {
    let ev = event(handle)?;
    check_not_captured(&ev)?;
    let st = ev.state.lock();
    if st.completed >= st.recorded {
        Ok(())
    } else {
        Err(CUresult::CUDA_ERROR_NOT_READY)
    }
}

pub(crate) fn event_elapsed_time(ms: *mut f32, start: CUevent, end: CUevent) -> CuResult {
    let (start, end) = (event(start)?, event(end)?);
    if start.flags & EVENT_DISABLE_TIMING != 0 || end.flags & EVENT_DISABLE_TIMING != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    let time = |ev: &Event| {
        let st = ev.state.lock();
        match st.at {
            _ if st.recorded == 0 => Err(CUresult::CUDA_ERROR_INVALID_HANDLE),
            Some(at) if st.completed >= st.recorded => Ok(at),
            _ => Err(CUresult::CUDA_ERROR_NOT_READY),
        }
    };
    let (a, b) = (time(&start)?, time(&end)?);
    let millis = if b >= a {
        b.duration_since(a).as_secs_f32() * 1000.0
    } else {
        -(a.duration_since(b).as_secs_f32() * 1000.0)
    };
    write_out(ms, millis)
}

pub(crate) fn stream_wait_event(
    stream: CUstream,
    handle: CUevent,
    flags: c_uint,
    default: DefaultStream,
) -> CuResult {
    if flags & !1 != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let ev = event(handle)?;
    let stream = resolve(stream, default)?;
    let captured = ev.captured.lock().as_ref().and_then(Weak::upgrade);
    if let Some(capture) = captured.filter(|_| graph::any_capture()) {
        return graph::join(&stream, &capture);
    }
    // A capture may not depend on work outside it.
    if let Some(capture) = stream.capturing() {
        capture.invalidate();
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    }
    let target = ev.state.lock().recorded;
    stream.submit(Box::new(move || {
        let mut st = ev.state.lock();
        while st.completed < target {
            ev.done.wait(&mut st);
        }
        Ok(())
    }))
}

/// `cuStreamIsCapturing`: NONE, ACTIVE or INVALIDATED (see `graph`).
pub(crate) fn stream_is_capturing(handle: CUstream, status: *mut c_uint, default: DefaultStream) -> CuResult {
    let s = resolve(handle, default)?;
    write_out(status, graph::capture_status(&s)?.0)
}

/// Optional outputs of `cuStreamGetCaptureInfo` (`_v2` adds the graph and its
/// dependencies, `_v3` their edge data), all of which read as empty when not capturing.
#[derive(Clone, Copy)]
pub(crate) struct CaptureOuts {
    pub id: *mut u64,
    pub graph: *mut *mut c_void,
    pub deps: *mut *const c_void,
    pub edges: *mut *const c_void,
    pub count: *mut usize,
}

impl CaptureOuts {
    pub(crate) fn id_only(id: *mut u64) -> CaptureOuts {
        use std::ptr::null_mut;
        CaptureOuts { id, graph: null_mut(), deps: null_mut(), edges: null_mut(), count: null_mut() }
    }
}

/// `cuStreamGetCaptureInfo` (all versions): the status and, while a capture is active,
/// its id (unique in the process), its graph, its dependency (the last node recorded)
/// and no edge data (all edges are plain); outside a capture the outputs read as empty.
pub(crate) fn stream_get_capture_info(
    handle: CUstream,
    status: *mut c_uint,
    outs: CaptureOuts,
    default: DefaultStream,
) -> CuResult {
    let s = resolve(handle, default)?;
    let (code, capture) = graph::capture_status(&s)?;
    write_out(status, code)?;
    let (id, graph, deps, count) = capture.map_or((0, 0, std::ptr::null(), 0), |c| graph::capture_info(&c));
    if !outs.id.is_null() {
        write_out(outs.id, id)?;
    }
    if !outs.graph.is_null() {
        write_out(outs.graph, graph as *mut c_void)?;
    }
    if !outs.deps.is_null() {
        write_out(outs.deps, if count > 0 { deps.cast() } else { std::ptr::null() })?;
    }
    if !outs.edges.is_null() {
        write_out(outs.edges, std::ptr::null())?;
    }
    if !outs.count.is_null() {
        write_out(outs.count, count)?;
    }
    Ok(())
}

thread_local! {
    /// This thread's `CUstreamCaptureMode` (`CU_STREAM_CAPTURE_MODE_GLOBAL` = 0).
    static CAPTURE_MODE: std::cell::Cell<c_uint> = const { std::cell::Cell::new(0) };
}

/// The calling thread's capture mode, which decides which calls a capture forbids it.
pub(crate) fn thread_capture_mode() -> c_uint {
    CAPTURE_MODE.try_with(|m| m.get()).unwrap_or(0)
}

/// `cuThreadExchangeStreamCaptureMode`: swaps the thread's capture mode with `*mode`.
pub(crate) fn exchange_capture_mode(mode: *mut c_uint) -> CuResult {
    let wanted = crate::ffi::read_in(mode.cast_const())?;
    if wanted > 2 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // At thread exit the mode is gone with the thread: answer the default.
    let previous = CAPTURE_MODE.try_with(|m| m.replace(wanted)).unwrap_or(0);
    write_out(mode, previous)
}
