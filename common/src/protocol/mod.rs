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

use std::io;

use crate::Resolver;

mod codec;

pub use codec::{read_frame, write_frame};

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

#[cfg(test)]
mod tests;
