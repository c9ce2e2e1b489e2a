//! The wire protocol between shims (and the CLI) and the arbiter, over a unix socket.
//!
//! Every message is a frame: a 4-byte little-endian body length, then the body. The body
//! starts with a tag byte; fields follow in a fixed order, integers little-endian,
//! strings as a 2-byte length and UTF-8 bytes, device UUIDs as 16 raw bytes. Decoding is
//! strict: an unknown tag, a short or overlong body, bad UTF-8 or an out-of-range value is
//! an error, and the receiver closes that connection. The first frame of a connection is
//! `Hello` (a shim) or `Status` (the CLI); `Hello` carries [`VERSION`], so both sides can
//! refuse a peer they do not understand. The peer's process ID is never in a message: the
//! arbiter takes it from the socket (`SO_PEERCRED`).
//!
//! Replies to `Acquire` carry its sequence number, so a shim may have several in flight;
//! tags from 0x80 up are commands the arbiter pushes (reclaim, swap out, resume).

use std::io::{self, Read, Write};

use crate::Resolver;

/// The protocol version this build speaks.
pub const VERSION: u16 = 8;
/// Largest frame a shim may send, and the arbiter may send a shim.
pub const MAX_FRAME: usize = 4096;
/// Largest status document the arbiter sends the CLI.
pub const MAX_STATUS_FRAME: usize = 16 << 20;
/// Longest string field.
pub const MAX_STRING: usize = 512;
/// Most GPUs a `Welcome` lists.
pub const MAX_GPUS: usize = 128;

/// A device, by its UUID bytes.
pub type DeviceId = [u8; 16];

/// Messages to the arbiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First frame of a shim's connection: who it is.
    Hello {
        /// Protocol version.
        version: u16,
        /// The group (`GPUFRAC_GROUP`, or a name unique to the process).
        group: String,
        /// `namespace/name`, or empty.
        pod: String,
        /// The group's resolver.
        resolver: Resolver,
        /// The group's priority.
        priority: i32,
        /// How long the shim waits for a grant, in milliseconds.
        wait_timeout_ms: u64,
        /// Idle this many milliseconds, the group may be parked (`GPUFRAC_PARK_AFTER`);
        /// 0: never parked.
        park_after_ms: u64,
        /// The group's compute request (`GPUFRAC_COMPUTE_REQUEST`), per mille of a GPU's
        /// time; with `compute_limit_pm`, 0 and 0 for no compute control.
        compute_request_pm: u16,
        /// The group's compute limit (`GPUFRAC_COMPUTE_LIMIT`), per mille; at least the
        /// request, at most 1000.
        compute_limit_pm: u16,
    },
    /// A device the shim uses, with what it holds and was granted (non-zero after a
    /// reconnect, so the arbiter rebuilds its ledger).
    Register {
        /// The device.
        device: DeviceId,
        /// Its physical memory as the shim sees it.
        total: u64,
        /// The group's request.
        request: u64,
        /// The group's limit.
        limit: u64,
        /// Bytes this process holds on it.
        held: u64,
        /// Burst bytes this process was granted and still holds.
        granted: u64,
        /// Bytes of its burst memory it keeps swapped out in host RAM.
        swapped: u64,
    },
    /// Asks for at least `bytes` more burst memory, `preferred` if there is room (a
    /// chunk, so that a steady server rarely asks).
    Acquire {
        /// Echoed in the reply.
        seq: u64,
        /// The device.
        device: DeviceId,
        /// Bytes needed now.
        bytes: u64,
        /// Bytes wanted if free (at least `bytes`).
        preferred: u64,
        /// Bytes this process holds now (for status).
        held: u64,
        /// To swap its burst memory back in (at most what it has swapped out): waits an hour
        /// at most, then the shim asks again.
        resume: bool,
    },
    /// Gives back `bytes` of burst memory.
    Release {
        /// The device.
        device: DeviceId,
        /// Bytes given back.
        bytes: u64,
        /// Bytes this process holds now (for status).
        held: u64,
    },
    /// First and only frame of a CLI connection: asks for the status document.
    Status,
    /// The shim's count of launches, copies and sets moved (sent at most every second,
    /// only when it moved): the arbiter's measure of idleness.
    Activity {
        /// The count.
        count: u64,
    },
    /// Where the process's burst memory is after a swap: out (the answer to `SwapOut`)
    /// or in (after a granted `resume`, or swapped-out memory freed). Every field but
    /// `bytes` and `micros` is its state now (not a change), so a message repeated after
    /// a reconnect does no harm.
    Swapped {
        /// The device.
        device: DeviceId,
        /// Which way this swap went.
        direction: SwapDirection,
        /// Bytes this swap moved.
        bytes: u64,
        /// Burst bytes it is granted now.
        granted: u64,
        /// Bytes it keeps in host RAM now.
        host_bytes: u64,
        /// Bytes it holds on the device now.
        held: u64,
        /// How long the swap took, in microseconds.
        micros: u64,
    },
    /// The answer to `Park`: this process's memory on the device is parked. After the
    /// shim's own swap-out, `host_bytes` is what it moved; for the driver's checkpoint,
    /// its gate is closed and the arbiter may checkpoint it now (`host_bytes` 0).
    Parked {
        /// The device.
        device: DeviceId,
        /// Bytes moved to host RAM.
        host_bytes: u64,
        /// Bytes it still holds on the device (what could not be moved).
        held: u64,
        /// How long parking took, in microseconds.
        micros: u64,
    },
    /// A call waits at the gate of this parked process: bring its memory back. Answered
    /// `Granted` (with the burst bytes it holds again) or `Denied` (`Timeout`).
    Wake {
        /// Echoed in the answer.
        seq: u64,
        /// The device.
        device: DeviceId,
    },
    /// After the shim's own swap-in of a granted `Wake`: the memory is back.
    Woken {
        /// The device.
        device: DeviceId,
        /// Bytes it holds on the device now.
        held: u64,
        /// How long the swap-in took, in microseconds.
        micros: u64,
    },
    /// A context's size on `device`, measured cleanly (the process's own usage around
    /// its creation): the arbiter keeps the first one NVML confirms for the GPU.
    ContextMeasured {
        /// The device.
        device: DeviceId,
        /// Bytes the context took.
        bytes: u64,
    },
    /// A process of a group with a compute share has work to start on `device` and no
    /// lease there: its calls wait at its gate until the arbiter answers `Lease`.
    Want {
        /// The device.
        device: DeviceId,
    },
    /// The process is done with lease `lease` on `device`: its gate is closed and the work
    /// it started has finished (or it had nothing to run, and gives the lease back early).
    /// `drain_us` is how long its work ran on past the lease's end; `more`: calls wait at
    /// its gate already (a `Want` in the same breath).
    LeaseDone {
        /// The device.
        device: DeviceId,
        /// The lease's number, from its `Lease` (`Held`).
        lease: u32,
        /// Microseconds its work ran past the lease's end (0: done before it), at most
        /// [`MAX_DRAIN_US`].
        drain_us: u32,
        /// It has more to run.
        more: bool,
    },
}

/// Longest lease the arbiter gives, in microseconds (10 s).
pub const MAX_LEASE_US: u32 = 10_000_000;
/// Longest drain a shim reports, in microseconds (60 s: a shim that measured more says
/// this much).
pub const MAX_DRAIN_US: u32 = 60_000_000;

/// What a process of a group with a compute share may do on a GPU now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// The GPU is open to it: its calls pass without a deadline (it is the only group
    /// that wants the GPU and its limit is the whole GPU), until told otherwise; a `Wait`
    /// then ends it like a lease's end (answered `LeaseDone` for `lease`).
    Open {
        /// The turn's number (echoed in `LeaseDone`), above 0.
        lease: u32,
    },
    /// Its group holds the GPU for `micros` from now: calls pass until then; then its gate
    /// closes, and it answers `LeaseDone` once its work has finished.
    Held {
        /// The lease's number (echoed in `LeaseDone`), above 0.
        lease: u32,
        /// How long it holds the GPU, 1 to [`MAX_LEASE_US`].
        micros: u32,
    },
    /// Its calls wait (a lease held now ends: close the gate, answer `LeaseDone` once the
    /// work finished); the first waiting call says `Want`.
    Wait,
}

/// Which way a swap moved memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapDirection {
    /// From the device to host RAM.
    Out,
    /// From host RAM back to the device.
    In,
}

impl SwapDirection {
    /// `out` or `in`, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            SwapDirection::Out => "out",
            SwapDirection::In => "in",
        }
    }
}

/// Why an `Acquire` was denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// Waited `GPUFRAC_WAIT_TIMEOUT` without memory being freed.
    Timeout,
    /// More than the group's limit.
    OverLimit,
    /// The device was not registered on this connection.
    UnknownDevice,
    /// Every holder of burst memory on the GPU waits for more: this waiter is refused so
    /// that the others can go on (it holds the most).
    Deadlock,
    /// More than the GPU could ever lend the group: what no request reserves, less what
    /// the group already borrows. Refused at once rather than block the queue.
    NeverFits,
    /// A swap-in (`resume`) from a process with nothing swapped out, or for more than it
    /// has swapped out.
    NotSwapped,
}

/// Messages from the arbiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Answer to `Hello`.
    Welcome {
        /// The arbiter's protocol version.
        version: u16,
        /// The client's PID as the arbiter sees it (`SO_PEERCRED`): the host's PID when
        /// the client runs in a PID namespace of its own (a container), which is the PID
        /// NVML reports for it.
        pid: u32,
        /// The memory the arbiter manages on each of its GPUs (`gpufrac-arbiter
        /// --gpu-memory`; else the whole GPU as NVML reports it), at most [`MAX_GPUS`]:
        /// a shim's fractions are of it, and its device is never shown larger.
        managed: Vec<(DeviceId, u64)>,
    },
    /// The device is registered; the group's request is guaranteed.
    Registered {
        /// The device.
        device: DeviceId,
        /// The request the arbiter believes (what it declared, capped by its entitlement):
        /// the most the shim may use without asking.
        request: u64,
        /// The limit the arbiter believes: bursts past it are denied.
        limit: u64,
        /// Admitted parked (a parkable group on an oversubscribed GPU): its first call
        /// waits at its gate until the group is woken.
        parked: bool,
        /// What a context takes on this GPU, as first measured cleanly by a shim and
        /// confirmed by NVML (0: not known yet): a new context's first charge.
        context: u64,
    },
    /// The registration was refused (e.g. the request no longer fits).
    Refused {
        /// The device.
        device: DeviceId,
        /// Why, for the user.
        reason: String,
    },
    /// An `Acquire` was granted.
    Granted {
        /// The request's sequence number.
        seq: u64,
        /// Bytes granted.
        bytes: u64,
    },
    /// An `Acquire` was denied.
    Denied {
        /// The request's sequence number.
        seq: u64,
        /// Why.
        reason: Denial,
    },
    /// The status document (JSON), to the CLI.
    Status {
        /// The document.
        json: String,
    },
    /// Pushed: others wait on this device; give back burst memory not in use, keep no
    /// slack for a while.
    Reclaim {
        /// The device.
        device: DeviceId,
    },
    /// Pushed: a swap-resolver burst needs this process's burst memory on the device:
    /// move it to host RAM and answer `Swapped` (out).
    SwapOut {
        /// The device.
        device: DeviceId,
    },
    /// Pushed: memory is free again on the device; a swapped-out process may come back.
    Resume {
        /// The device.
        device: DeviceId,
    },
    /// Pushed: the group is idle and its memory wanted: park this process's memory on the
    /// device and answer `Parked`. With `checkpoint`, the shim only closes its gate (the
    /// arbiter moves the memory with the driver's checkpoint API); otherwise the shim
    /// moves it itself.
    Park {
        /// The device.
        device: DeviceId,
        /// The arbiter checkpoints the process.
        checkpoint: bool,
    },
    /// Pushed: the process is not parked (any more) without a `Wake` to answer: parking
    /// was abandoned (the checkpoint failed) or its memory came back. The gate opens.
    Unparked {
        /// The device.
        device: DeviceId,
    },
    /// Pushed to every process of a group with a compute share, whenever what it may do
    /// on the device changes.
    Lease {
        /// The device.
        device: DeviceId,
        /// What it may do now.
        state: LeaseState,
    },
}

/// A frame that cannot be accepted.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The connection failed or closed.
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    /// A frame longer than allowed.
    #[error("frame of {0} bytes is over the limit of {1}")]
    TooLarge(usize, usize),
    /// An empty frame.
    #[error("empty frame")]
    Empty,
    /// A tag this version does not know.
    #[error("unknown message tag {0:#04x}")]
    UnknownTag(u8),
    /// The body ended early.
    #[error("truncated message")]
    Truncated,
    /// Bytes after the last field.
    #[error("{0} unexpected bytes after the message")]
    Trailing(usize),
    /// A string that is not UTF-8 or too long.
    #[error("bad string field")]
    BadString,
    /// A field with a value out of its range.
    #[error("bad value for {0}")]
    BadValue(&'static str),
}

struct Writer(Vec<u8>);

impl Writer {
    fn new(tag: u8) -> Writer {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&[0, 0, 0, 0, tag]);
        Writer(v)
    }
    fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i32(mut self, v: i32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn device(mut self, d: &DeviceId) -> Self {
        self.0.extend_from_slice(d);
        self
    }
    fn string(mut self, s: &str) -> Self {
        // Cut an overlong string at a character boundary, so that it still decodes.
        let mut end = s.len().min(MAX_STRING);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        let bytes = &s.as_bytes()[..end];
        self.0.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
        self.0.extend_from_slice(bytes);
        self
    }
    fn long_string(mut self, s: &str) -> Self {
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn finish(mut self) -> Vec<u8> {
        let len = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], ProtocolError> {
        if self.0.len() < n {
            return Err(ProtocolError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, ProtocolError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, ProtocolError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, ProtocolError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn i32(&mut self) -> Result<i32, ProtocolError> {
        Ok(self.u32()? as i32)
    }
    fn device(&mut self) -> Result<DeviceId, ProtocolError> {
        let mut d = [0u8; 16];
        d.copy_from_slice(self.take(16)?);
        Ok(d)
    }
    fn string(&mut self) -> Result<String, ProtocolError> {
        let n = self.u16()? as usize;
        if n > MAX_STRING {
            return Err(ProtocolError::BadString);
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| ProtocolError::BadString)
    }
    fn long_string(&mut self) -> Result<String, ProtocolError> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| ProtocolError::BadString)
    }
    fn end(self) -> Result<(), ProtocolError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(ProtocolError::Trailing(n)),
        }
    }
}

fn flag(byte: u8, field: &'static str) -> Result<bool, ProtocolError> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(ProtocolError::BadValue(field)),
    }
}

fn resolver_code(r: Resolver) -> u8 {
    match r {
        Resolver::Wait => 0,
        Resolver::Priority => 1,
        Resolver::Swap => 2,
    }
}

fn resolver_from(code: u8) -> Result<Resolver, ProtocolError> {
    Ok(match code {
        0 => Resolver::Wait,
        1 => Resolver::Priority,
        2 => Resolver::Swap,
        _ => return Err(ProtocolError::BadValue("resolver")),
    })
}

impl Request {
    /// The frame (length prefix included).
    pub fn encode(&self) -> Vec<u8> {
        match self {
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
            } => Writer::new(1)
                .u16(*version)
                .string(group)
                .string(pod)
                .u8(resolver_code(*resolver))
                .i32(*priority)
                .u64(*wait_timeout_ms)
                .u64(*park_after_ms)
                .u16(*compute_request_pm)
                .u16(*compute_limit_pm),
            Request::Register { device, total, request, limit, held, granted, swapped } => Writer::new(2)
                .device(device)
                .u64(*total)
                .u64(*request)
                .u64(*limit)
                .u64(*held)
                .u64(*granted)
                .u64(*swapped),
            Request::Acquire { seq, device, bytes, preferred, held, resume } => Writer::new(3)
                .u64(*seq)
                .device(device)
                .u64(*bytes)
                .u64(*preferred)
                .u64(*held)
                .u8(u8::from(*resume)),
            Request::Release { device, bytes, held } => Writer::new(4).device(device).u64(*bytes).u64(*held),
            Request::Status => Writer::new(5),
            Request::Activity { count } => Writer::new(6).u64(*count),
            Request::Swapped { device, direction, bytes, granted, host_bytes, held, micros } => {
                Writer::new(7)
                    .device(device)
                    .u8(match direction {
                        SwapDirection::Out => 0,
                        SwapDirection::In => 1,
                    })
                    .u64(*bytes)
                    .u64(*granted)
                    .u64(*host_bytes)
                    .u64(*held)
                    .u64(*micros)
            }
            Request::Parked { device, host_bytes, held, micros } => {
                Writer::new(8).device(device).u64(*host_bytes).u64(*held).u64(*micros)
            }
            Request::Wake { seq, device } => Writer::new(9).u64(*seq).device(device),
            Request::Woken { device, held, micros } => Writer::new(10).device(device).u64(*held).u64(*micros),
            Request::ContextMeasured { device, bytes } => Writer::new(11).device(device).u64(*bytes),
            Request::Want { device } => Writer::new(12).device(device),
            Request::LeaseDone { device, lease, drain_us, more } => {
                Writer::new(13).device(device).u32(*lease).u32(*drain_us).u8(u8::from(*more))
            }
        }
        .finish()
    }

    /// Parses a frame body.
    pub fn decode(body: &[u8]) -> Result<Request, ProtocolError> {
        let mut r = Reader(body);
        let request = match r.u8().map_err(|_| ProtocolError::Empty)? {
            1 => {
                let hello = Request::Hello {
                    version: r.u16()?,
                    group: r.string()?,
                    pod: r.string()?,
                    resolver: resolver_from(r.u8()?)?,
                    priority: r.i32()?,
                    wait_timeout_ms: r.u64()?,
                    park_after_ms: r.u64()?,
                    compute_request_pm: r.u16()?,
                    compute_limit_pm: r.u16()?,
                };
                if let Request::Hello { compute_request_pm, compute_limit_pm, .. } = hello {
                    crate::ComputeSpec::from_wire(compute_request_pm, compute_limit_pm)
                        .map_err(ProtocolError::BadValue)?;
                }
                hello
            }
            2 => {
                let device = r.device()?;
                let (total, request, limit, held, granted, swapped) =
                    (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
                if request > limit || limit > total {
                    return Err(ProtocolError::BadValue("request/limit"));
                }
                Request::Register { device, total, request, limit, held, granted, swapped }
            }
            3 => {
                let (seq, device, bytes, preferred, held) =
                    (r.u64()?, r.device()?, r.u64()?, r.u64()?, r.u64()?);
                if preferred < bytes {
                    return Err(ProtocolError::BadValue("preferred"));
                }
                let resume = match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(ProtocolError::BadValue("resume")),
                };
                Request::Acquire { seq, device, bytes, preferred, held, resume }
            }
            4 => Request::Release { device: r.device()?, bytes: r.u64()?, held: r.u64()? },
            5 => Request::Status,
            6 => Request::Activity { count: r.u64()? },
            7 => Request::Swapped {
                device: r.device()?,
                direction: match r.u8()? {
                    0 => SwapDirection::Out,
                    1 => SwapDirection::In,
                    _ => return Err(ProtocolError::BadValue("direction")),
                },
                bytes: r.u64()?,
                granted: r.u64()?,
                host_bytes: r.u64()?,
                held: r.u64()?,
                micros: r.u64()?,
            },
            8 => Request::Parked {
                device: r.device()?,
                host_bytes: r.u64()?,
                held: r.u64()?,
                micros: r.u64()?,
            },
            9 => Request::Wake { seq: r.u64()?, device: r.device()? },
            10 => Request::Woken { device: r.device()?, held: r.u64()?, micros: r.u64()? },
            11 => {
                let (device, bytes) = (r.device()?, r.u64()?);
                if bytes == 0 {
                    return Err(ProtocolError::BadValue("context bytes"));
                }
                Request::ContextMeasured { device, bytes }
            }
            12 => Request::Want { device: r.device()? },
            13 => {
                let (device, lease, drain_us) = (r.device()?, r.u32()?, r.u32()?);
                if lease == 0 {
                    return Err(ProtocolError::BadValue("lease"));
                }
                if drain_us > MAX_DRAIN_US {
                    return Err(ProtocolError::BadValue("drain"));
                }
                Request::LeaseDone { device, lease, drain_us, more: flag(r.u8()?, "more")? }
            }
            tag => return Err(ProtocolError::UnknownTag(tag)),
        };
        r.end()?;
        Ok(request)
    }
}

impl Reply {
    /// The frame (length prefix included).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Welcome { version, pid, managed } => {
                let managed = &managed[..managed.len().min(MAX_GPUS)];
                managed.iter().fold(
                    Writer::new(0x41).u16(*version).u32(*pid).u16(managed.len() as u16),
                    |w, (d, bytes)| w.device(d).u64(*bytes),
                )
            }
            Reply::Registered { device, request, limit, parked, context } => {
                Writer::new(0x42).device(device).u64(*request).u64(*limit).u8(u8::from(*parked)).u64(*context)
            }
            Reply::Refused { device, reason } => Writer::new(0x43).device(device).string(reason),
            Reply::Granted { seq, bytes } => Writer::new(0x44).u64(*seq).u64(*bytes),
            Reply::Denied { seq, reason } => Writer::new(0x45).u64(*seq).u8(match reason {
                Denial::Timeout => 0,
                Denial::OverLimit => 1,
                Denial::UnknownDevice => 2,
                Denial::Deadlock => 3,
                Denial::NeverFits => 4,
                Denial::NotSwapped => 5,
            }),
            Reply::Status { json } => Writer::new(0x46).long_string(json),
            Reply::Reclaim { device } => Writer::new(0x80).device(device),
            Reply::SwapOut { device } => Writer::new(0x81).device(device),
            Reply::Resume { device } => Writer::new(0x82).device(device),
            Reply::Park { device, checkpoint } => Writer::new(0x83).device(device).u8(u8::from(*checkpoint)),
            Reply::Unparked { device } => Writer::new(0x84).device(device),
            Reply::Lease { device, state } => {
                let w = Writer::new(0x85).device(device);
                match state {
                    LeaseState::Open { lease } => w.u8(0).u32(*lease),
                    LeaseState::Held { lease, micros } => w.u8(1).u32(*lease).u32(*micros),
                    LeaseState::Wait => w.u8(2),
                }
            }
        }
        .finish()
    }

    /// Parses a frame body.
    pub fn decode(body: &[u8]) -> Result<Reply, ProtocolError> {
        let mut r = Reader(body);
        let reply = match r.u8().map_err(|_| ProtocolError::Empty)? {
            0x41 => {
                let (version, pid, count) = (r.u16()?, r.u32()?, r.u16()? as usize);
                if count > MAX_GPUS {
                    return Err(ProtocolError::BadValue("managed"));
                }
                let managed =
                    (0..count).map(|_| Ok((r.device()?, r.u64()?))).collect::<Result<_, ProtocolError>>()?;
                Reply::Welcome { version, pid, managed }
            }
            0x42 => Reply::Registered {
                device: r.device()?,
                request: r.u64()?,
                limit: r.u64()?,
                parked: flag(r.u8()?, "parked")?,
                context: r.u64()?,
            },
            0x43 => Reply::Refused { device: r.device()?, reason: r.string()? },
            0x44 => Reply::Granted { seq: r.u64()?, bytes: r.u64()? },
            0x45 => Reply::Denied {
                seq: r.u64()?,
                reason: match r.u8()? {
                    0 => Denial::Timeout,
                    1 => Denial::OverLimit,
                    2 => Denial::UnknownDevice,
                    3 => Denial::Deadlock,
                    4 => Denial::NeverFits,
                    5 => Denial::NotSwapped,
                    _ => return Err(ProtocolError::BadValue("denial")),
                },
            },
            0x46 => Reply::Status { json: r.long_string()? },
            0x80 => Reply::Reclaim { device: r.device()? },
            0x81 => Reply::SwapOut { device: r.device()? },
            0x82 => Reply::Resume { device: r.device()? },
            0x83 => Reply::Park { device: r.device()?, checkpoint: flag(r.u8()?, "checkpoint")? },
            0x84 => Reply::Unparked { device: r.device()? },
            0x85 => {
                let device = r.device()?;
                let state = match r.u8()? {
                    0 => match r.u32()? {
                        0 => return Err(ProtocolError::BadValue("lease")),
                        lease => LeaseState::Open { lease },
                    },
                    1 => {
                        let (lease, micros) = (r.u32()?, r.u32()?);
                        if lease == 0 {
                            return Err(ProtocolError::BadValue("lease"));
                        }
                        if micros == 0 || micros > MAX_LEASE_US {
                            return Err(ProtocolError::BadValue("lease length"));
                        }
                        LeaseState::Held { lease, micros }
                    }
                    2 => LeaseState::Wait,
                    _ => return Err(ProtocolError::BadValue("lease state")),
                };
                Reply::Lease { device, state }
            }
            tag => return Err(ProtocolError::UnknownTag(tag)),
        };
        r.end()?;
        Ok(reply)
    }
}

/// Reads one frame body of at most `max` bytes (blocking I/O).
pub fn read_frame(reader: &mut impl Read, max: usize) -> Result<Vec<u8>, ProtocolError> {
    let mut len = [0u8; 4];
    reader.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(ProtocolError::TooLarge(len, max));
    }
    if len == 0 {
        return Err(ProtocolError::Empty);
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body)?;
    Ok(body)
}

/// Writes an encoded frame (blocking I/O).
pub fn write_frame(writer: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    writer.write_all(frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip_request(r: Request) {
        let frame = r.encode();
        let body = read_frame(&mut &frame[..], MAX_FRAME).unwrap();
        assert_eq!(Request::decode(&body).unwrap(), r);
    }

    #[test]
    fn requests_and_replies_round_trip() {
        round_trip_request(Request::Hello {
            version: VERSION,
            group: "web".into(),
            pod: "default/web-0".into(),
            resolver: Resolver::Swap,
            priority: -4,
            wait_timeout_ms: 30_000,
            park_after_ms: 60_000,
            compute_request_pm: 300,
            compute_limit_pm: 800,
        });
        round_trip_request(Request::Register {
            device: [3; 16],
            total: 100,
            request: 10,
            limit: 20,
            held: 5,
            granted: 2,
            swapped: 1,
        });
        round_trip_request(Request::Acquire {
            seq: 9,
            device: [1; 16],
            bytes: 1 << 30,
            preferred: 1 << 31,
            held: 7,
            resume: true,
        });
        round_trip_request(Request::Release { device: [1; 16], bytes: 4096, held: 0 });
        round_trip_request(Request::Status);
        round_trip_request(Request::Activity { count: 42 });
        for direction in [SwapDirection::Out, SwapDirection::In] {
            round_trip_request(Request::Swapped {
                device: [1; 16],
                direction,
                bytes: 1 << 30,
                granted: 5,
                host_bytes: 1 << 30,
                held: 3,
                micros: 12,
            });
        }
        round_trip_request(Request::Parked {
            device: [1; 16],
            host_bytes: 1 << 30,
            held: 2 << 20,
            micros: 900,
        });
        round_trip_request(Request::Wake { seq: 11, device: [1; 16] });
        round_trip_request(Request::Woken { device: [1; 16], held: 1 << 30, micros: 700 });
        round_trip_request(Request::ContextMeasured { device: [1; 16], bytes: 500 << 20 });
        round_trip_request(Request::Want { device: [1; 16] });
        round_trip_request(Request::LeaseDone { device: [1; 16], lease: 7, drain_us: 1500, more: true });
        round_trip_request(Request::LeaseDone { device: [1; 16], lease: 8, drain_us: 0, more: false });
        assert!(
            Request::decode(&Request::ContextMeasured { device: [1; 16], bytes: 0 }.encode()[4..]).is_err()
        );
        for reply in [
            Reply::Welcome { version: 1, pid: 4242, managed: vec![] },
            Reply::Welcome { version: 1, pid: 4242, managed: vec![([2; 16], 16 << 30), ([3; 16], 1)] },
            Reply::Registered {
                device: [2; 16],
                request: 1 << 30,
                limit: u64::MAX,
                parked: false,
                context: 0,
            },
            Reply::Registered {
                device: [2; 16],
                request: 1 << 30,
                limit: 1 << 31,
                parked: true,
                context: 500 << 20,
            },
            Reply::Refused { device: [2; 16], reason: "no room".into() },
            Reply::Granted { seq: 3, bytes: 77 },
            Reply::Denied { seq: 4, reason: Denial::Timeout },
            Reply::Denied { seq: 5, reason: Denial::OverLimit },
            Reply::Denied { seq: 6, reason: Denial::UnknownDevice },
            Reply::Denied { seq: 7, reason: Denial::Deadlock },
            Reply::Denied { seq: 8, reason: Denial::NeverFits },
            Reply::Denied { seq: 9, reason: Denial::NotSwapped },
            Reply::Status { json: "{}".into() },
            Reply::Reclaim { device: [5; 16] },
            Reply::SwapOut { device: [6; 16] },
            Reply::Resume { device: [7; 16] },
            Reply::Park { device: [8; 16], checkpoint: true },
            Reply::Park { device: [8; 16], checkpoint: false },
            Reply::Unparked { device: [9; 16] },
            Reply::Lease { device: [9; 16], state: LeaseState::Open { lease: 2 } },
            Reply::Lease { device: [9; 16], state: LeaseState::Held { lease: 3, micros: 12_000 } },
            Reply::Lease { device: [9; 16], state: LeaseState::Wait },
        ] {
            let frame = reply.encode();
            let body = read_frame(&mut &frame[..], MAX_STATUS_FRAME).unwrap();
            assert_eq!(Reply::decode(&body).unwrap(), reply);
        }
    }

    #[test]
    fn bad_frames_are_refused() {
        assert!(matches!(Request::decode(&[]), Err(ProtocolError::Empty)));
        assert!(matches!(Request::decode(&[99]), Err(ProtocolError::UnknownTag(99))));
        assert!(matches!(Request::decode(&[3, 1, 2]), Err(ProtocolError::Truncated)));
        let mut frame = Request::Status.encode();
        frame.push(0);
        frame[..4].copy_from_slice(&2u32.to_le_bytes());
        assert!(matches!(Request::decode(&frame[4..]), Err(ProtocolError::Trailing(1))));
        let big = (MAX_FRAME as u32 + 1).to_le_bytes();
        assert!(matches!(read_frame(&mut &big[..], MAX_FRAME), Err(ProtocolError::TooLarge(..))));
        let bad_register = Request::Register {
            device: [0; 16],
            total: 10,
            request: 20,
            limit: 20,
            held: 0,
            granted: 0,
            swapped: 0,
        };
        assert!(matches!(Request::decode(&bad_register.encode()[4..]), Err(ProtocolError::BadValue(_))));
        let mut hello = Request::Hello {
            version: 1,
            group: "g".into(),
            pod: String::new(),
            resolver: Resolver::Wait,
            priority: 0,
            wait_timeout_ms: 1,
            park_after_ms: 0,
            compute_request_pm: 0,
            compute_limit_pm: 0,
        }
        .encode();
        let mut bad_share = hello.clone();
        let n = bad_share.len();
        bad_share[n - 4..].copy_from_slice(&[0xf4, 0x01, 0x90, 0x01]); // request 500 over limit 400
        assert!(matches!(
            Request::decode(&bad_share[4..]),
            Err(ProtocolError::BadValue("compute request/limit"))
        ));
        let held = |lease: u32, micros: u32| {
            Reply::Lease { device: [1; 16], state: LeaseState::Held { lease, micros } }.encode()
        };
        assert!(matches!(Reply::decode(&held(1, 0)[4..]), Err(ProtocolError::BadValue("lease length"))));
        let long = held(1, MAX_LEASE_US + 1);
        assert!(matches!(Reply::decode(&long[4..]), Err(ProtocolError::BadValue("lease length"))));
        assert!(matches!(Reply::decode(&held(0, 5)[4..]), Err(ProtocolError::BadValue("lease"))));
        let mut state = Reply::Lease { device: [1; 16], state: LeaseState::Wait }.encode();
        *state.last_mut().unwrap() = 3;
        assert!(matches!(Reply::decode(&state[4..]), Err(ProtocolError::BadValue("lease state"))));
        let done = |lease: u32, drain_us: u32| {
            Request::LeaseDone { device: [1; 16], lease, drain_us, more: false }.encode()
        };
        assert!(matches!(Request::decode(&done(0, 1)[4..]), Err(ProtocolError::BadValue("lease"))));
        let slow = done(1, MAX_DRAIN_US + 1);
        assert!(matches!(Request::decode(&slow[4..]), Err(ProtocolError::BadValue("drain"))));
        let mut more = done(1, 1);
        *more.last_mut().unwrap() = 2;
        assert!(matches!(Request::decode(&more[4..]), Err(ProtocolError::BadValue("more"))));
        hello[9] = 0xff; // the group's single byte (after length, tag, version, string length)
        assert!(matches!(Request::decode(&hello[4..]), Err(ProtocolError::BadString)));
        let mut denied = Reply::Denied { seq: 1, reason: Denial::NotSwapped }.encode();
        *denied.last_mut().unwrap() = 6;
        assert!(matches!(Reply::decode(&denied[4..]), Err(ProtocolError::BadValue("denial"))));
    }

    #[test]
    fn an_overlong_string_is_cut_at_a_character_boundary() {
        // 511 ASCII bytes then a 2-byte character: cut at 512 it would split the character.
        let reason = format!("{}é and more", "x".repeat(MAX_STRING - 1));
        let frame = Reply::Refused { device: [1; 16], reason }.encode();
        let Reply::Refused { reason, .. } = Reply::decode(&frame[4..]).unwrap() else { panic!() };
        assert_eq!(reason, "x".repeat(MAX_STRING - 1));
    }
}
