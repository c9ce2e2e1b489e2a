//! A client of the arbiter's protocol written by hand, frame by frame, for the tests that
//! play a shim that lies, floods or misbehaves (`hardening.rs`, `trust.rs`): what a real
//! shim would never send is exactly what they need to send.

use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{read_frame, Reply, Request, MAX_FRAME, VERSION};
use gpufrac_common::Resolver;

use crate::{status, Arbiter, TIMEOUT};

/// The ID of the arbiter's first GPU, as the protocol names devices.
pub fn device_id(arbiter: &Arbiter) -> [u8; 16] {
    gpufrac_common::gpu_uuid::parse(&status(arbiter).gpus[0].uuid).expect("a GPU UUID")
}

/// A `Hello` of group `group` (pod `pod`), with `resolver` and `priority`, a wait timeout
/// of `wait_timeout_ms` and no parking or compute share.
pub fn hello(group: &str, pod: &str, resolver: Resolver, priority: i32, wait_timeout_ms: u64) -> Request {
    Request::Hello {
        version: VERSION,
        group: group.into(),
        pod: pod.into(),
        resolver,
        priority,
        wait_timeout_ms,
        park_after_ms: 0,
        compute_request_pm: 0,
        compute_limit_pm: 0,
    }
}

/// A `Register` on `device` of a fresh process (nothing held, granted or swapped).
pub fn register(device: [u8; 16], total: u64, request: u64, limit: u64) -> Request {
    Request::Register { device, total, request, limit, held: 0, granted: 0, swapped: 0 }
}

/// One connection to the arbiter, every read bounded by [`TIMEOUT`].
pub struct RawClient {
    stream: UnixStream,
}

impl RawClient {
    /// Connects, saying nothing yet.
    pub fn connect(arbiter: &Arbiter) -> RawClient {
        let stream = UnixStream::connect(arbiter.socket()).expect("connect to the arbiter");
        stream.set_read_timeout(Some(TIMEOUT)).expect("a read timeout");
        RawClient { stream }
    }

    /// Connects and says `hello`, which the arbiter must welcome.
    pub fn hello(arbiter: &Arbiter, hello: &Request) -> RawClient {
        let mut raw = RawClient::connect(arbiter);
        raw.send(hello);
        let reply = raw.reply();
        assert!(matches!(reply, Reply::Welcome { .. }), "not welcomed: {reply:?}");
        raw
    }

    /// The connection itself, for tests that write bytes no frame encodes.
    pub fn stream(&mut self) -> &mut UnixStream {
        &mut self.stream
    }

    /// Sends one frame.
    pub fn send(&mut self, request: &Request) {
        self.stream.write_all(&request.encode()).expect("send a frame");
    }

    /// The next frame the arbiter sends, decoded.
    pub fn reply(&mut self) -> Reply {
        Reply::decode(&read_frame(&mut self.stream, MAX_FRAME).expect("a reply")).expect("a reply frame")
    }

    /// The next frame, or why none could be read (a closed connection).
    pub fn try_reply(&mut self) -> Result<Reply, String> {
        let frame = read_frame(&mut self.stream, MAX_FRAME).map_err(|e| e.to_string())?;
        Reply::decode(&frame).map_err(|e| e.to_string())
    }

    /// Asks `bytes` of burst memory (`held` held already) as request `seq`; returns the
    /// answer and its round trip, skipping what the arbiter pushes meanwhile.
    pub fn acquire(&mut self, device: [u8; 16], seq: u64, bytes: u64, held: u64) -> (Reply, Duration) {
        let started = Instant::now();
        self.send(&Request::Acquire { seq, device, bytes, preferred: bytes, held, resume: false });
        loop {
            match self.reply() {
                reply @ (Reply::Granted { seq: s, .. } | Reply::Denied { seq: s, .. }) if s == seq => {
                    return (reply, started.elapsed())
                }
                _ => continue,
            }
        }
    }

    /// Returns once the arbiter has handled every frame sent so far on this connection:
    /// it handles them in order, so the answer to one more `Acquire` (`seq`, past any
    /// limit and reporting what the frames before it did: denied at once, granting
    /// nothing) comes after all of them.
    pub fn handled(&mut self, device: [u8; 16], seq: u64) {
        self.send(&Request::Acquire {
            seq,
            device,
            bytes: u64::MAX / 2,
            preferred: u64::MAX,
            held: u64::MAX,
            resume: false,
        });
        loop {
            match self.reply() {
                Reply::Granted { seq: s, .. } | Reply::Denied { seq: s, .. } if s == seq => return,
                _ => continue,
            }
        }
    }
}
