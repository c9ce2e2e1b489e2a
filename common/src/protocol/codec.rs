//! Messages to and from bytes: the field writer and the strict reader behind
//! `Request::encode`/`decode` and `Reply::encode`/`decode`, and framing on blocking I/O.

use std::io::{self, Read, Write};

use super::*;

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
