//! Property tests of the frame codec: random byte strings and mutated valid frames never
//! make a decoder panic; every valid message survives encode then decode; a body that
//! decodes encodes back to the same bytes (the encoding is canonical), so nothing a peer
//! sends is read two ways. Seeded and bounded (well under a second); set
//! `GPUFRAC_PROPS_CASES` to fuzz longer.

use gpufrac_common::protocol::{
    read_frame, Denial, ProtocolError, Reply, Request, SwapDirection, MAX_FRAME, MAX_STATUS_FRAME, MAX_STRING,
};
use gpufrac_common::Resolver;

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn u64(&mut self) -> u64 {
        match self.below(4) {
            0 => self.below(256),
            1 => u64::MAX - self.below(2),
            _ => self.next(),
        }
    }
    fn device(&mut self) -> [u8; 16] {
        let mut d = [0u8; 16];
        d.iter_mut().for_each(|b| *b = self.next() as u8);
        d
    }
    /// A string the codec carries whole: at most `max` bytes of mixed ASCII and wider
    /// characters.
    fn string(&mut self, max: usize) -> String {
        let mut s = String::new();
        let want = self.below(max as u64 + 1) as usize;
        loop {
            let c = match self.below(5) {
                0 => 'é',
                1 => '€',
                2 => '🦀',
                3 => char::from(self.below(128) as u8),
                _ => char::from(b'a' + self.below(26) as u8),
            };
            if s.len() + c.len_utf8() > want {
                return s;
            }
            s.push(c);
        }
    }
    fn resolver(&mut self) -> Resolver {
        [Resolver::Wait, Resolver::Priority, Resolver::Swap][self.below(3) as usize]
    }
    fn denial(&mut self) -> Denial {
        [
            Denial::Timeout,
            Denial::OverLimit,
            Denial::UnknownDevice,
            Denial::Deadlock,
            Denial::NeverFits,
            Denial::NotSwapped,
        ][self.below(6) as usize]
    }
}

fn request(rng: &mut Rng) -> Request {
    match rng.below(11) {
        0 => Request::Hello {
            version: rng.next() as u16,
            group: rng.string(MAX_STRING),
            pod: rng.string(MAX_STRING),
            resolver: rng.resolver(),
            priority: rng.next() as i32,
            wait_timeout_ms: rng.u64(),
            park_after_ms: rng.u64(),
            compute_request_pm: (rng.next() % 501) as u16,
            compute_limit_pm: 500 + (rng.next() % 501) as u16,
        },
        1 => {
            // Valid: request ≤ limit ≤ total.
            let mut v = [rng.u64(), rng.u64(), rng.u64()];
            v.sort_unstable();
            Request::Register {
                device: rng.device(),
                total: v[2],
                request: v[0],
                limit: v[1],
                held: rng.u64(),
                granted: rng.u64(),
                swapped: rng.u64(),
            }
        }
        2 => {
            let bytes = rng.u64();
            Request::Acquire {
                seq: rng.u64(),
                device: rng.device(),
                bytes,
                preferred: bytes.saturating_add(rng.u64()),
                held: rng.u64(),
                resume: rng.below(2) == 1,
            }
        }
        3 => Request::Release { device: rng.device(), bytes: rng.u64(), held: rng.u64() },
        4 => Request::Status,
        5 => Request::Activity { count: rng.u64() },
        6 => Request::Parked {
            device: rng.device(),
            host_bytes: rng.u64(),
            held: rng.u64(),
            micros: rng.u64(),
        },
        7 => Request::Wake { seq: rng.u64(), device: rng.device() },
        8 => Request::Woken { device: rng.device(), held: rng.u64(), micros: rng.u64() },
        9 => Request::ContextMeasured { device: rng.device(), bytes: rng.u64().max(1) },
        _ => Request::Swapped {
            device: rng.device(),
            direction: if rng.below(2) == 0 { SwapDirection::Out } else { SwapDirection::In },
            bytes: rng.u64(),
            granted: rng.u64(),
            host_bytes: rng.u64(),
            held: rng.u64(),
            micros: rng.u64(),
        },
    }
}

fn reply(rng: &mut Rng) -> Reply {
    match rng.below(11) {
        0 => Reply::Welcome {
            version: rng.next() as u16,
            pid: rng.next() as u32,
            managed: (0..rng.below(4)).map(|_| (rng.device(), rng.u64())).collect(),
        },
        1 => Reply::Registered {
            device: rng.device(),
            request: rng.u64(),
            limit: rng.u64(),
            parked: rng.below(2) == 1,
            context: rng.u64(),
        },
        2 => Reply::Refused { device: rng.device(), reason: rng.string(MAX_STRING) },
        3 => Reply::Granted { seq: rng.u64(), bytes: rng.u64() },
        4 => Reply::Denied { seq: rng.u64(), reason: rng.denial() },
        5 => Reply::Status { json: rng.string(3 * MAX_STRING) },
        6 => Reply::Reclaim { device: rng.device() },
        7 => Reply::SwapOut { device: rng.device() },
        8 => Reply::Park { device: rng.device(), checkpoint: rng.below(2) == 1 },
        9 => Reply::Unparked { device: rng.device() },
        _ => Reply::Resume { device: rng.device() },
    }
}

fn cases(default: u64) -> u64 {
    std::env::var("GPUFRAC_PROPS_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Decodes `body` both ways; whatever decodes must encode back to exactly `body`.
fn decode_any(body: &[u8]) {
    if let Ok(r) = Request::decode(body) {
        assert_eq!(&r.encode()[4..], body, "{r:?} is not read back the way it was written");
    }
    if let Ok(r) = Reply::decode(body) {
        assert_eq!(&r.encode()[4..], body, "{r:?} is not read back the way it was written");
    }
}

#[test]
fn valid_messages_round_trip() {
    let mut rng = Rng(1);
    for _ in 0..cases(3000) {
        let r = request(&mut rng);
        let frame = r.encode();
        assert!(frame.len() <= MAX_FRAME + 4, "{r:?} is larger than a frame may be");
        let body = read_frame(&mut &frame[..], MAX_FRAME).unwrap();
        assert_eq!(Request::decode(&body).unwrap(), r);
        let r = reply(&mut rng);
        let frame = r.encode();
        let body = read_frame(&mut &frame[..], MAX_STATUS_FRAME).unwrap();
        assert_eq!(Reply::decode(&body).unwrap(), r);
    }
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(2);
    for _ in 0..cases(20_000) {
        let longest = if rng.below(4) == 0 { 700 } else { 48 };
        let len = rng.below(longest) as usize;
        let mut body: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        // Mostly a known tag, so that the fields are read too.
        if !body.is_empty() && rng.below(4) != 0 {
            body[0] = [1, 2, 3, 4, 5, 6, 7, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x80, 0x81, 0x82]
                [rng.below(16) as usize];
        }
        decode_any(&body);
        // As a stream: a length prefix of any value, then whatever follows.
        let mut stream = body.clone();
        if rng.below(2) == 0 {
            let mut framed = (len as u32).to_le_bytes().to_vec();
            framed.extend_from_slice(&body);
            stream = framed;
        }
        if let Ok(frame) = read_frame(&mut &stream[..], MAX_FRAME) {
            assert!(!frame.is_empty() && frame.len() <= MAX_FRAME);
            decode_any(&frame);
        }
    }
}

#[test]
fn mutated_valid_frames_never_panic() {
    let mut rng = Rng(3);
    for _ in 0..cases(10_000) {
        let mut frame = if rng.below(2) == 0 { request(&mut rng).encode() } else { reply(&mut rng).encode() };
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(frame.len() as u64) as usize;
            match rng.below(5) {
                0 => frame[i] ^= 1 << rng.below(8),
                1 => frame[i] = rng.next() as u8,
                2 => frame.truncate(i.max(4)),
                3 => frame.insert(i, rng.next() as u8),
                _ => {
                    let extra = rng.below(8);
                    frame.extend((0..extra).map(|_| rng.next() as u8));
                }
            }
        }
        decode_any(&frame[4.min(frame.len())..]);
        let _ = read_frame(&mut &frame[..], MAX_STATUS_FRAME).map(|body| decode_any(&body));
    }
}

#[test]
fn overlong_strings_still_decode() {
    let mut rng = Rng(4);
    for _ in 0..cases(300) {
        let group = rng.string(3 * MAX_STRING);
        let hello = Request::Hello {
            version: 2,
            group: group.clone(),
            pod: String::new(),
            resolver: Resolver::Wait,
            priority: 0,
            wait_timeout_ms: 0,
            park_after_ms: 0,
            compute_request_pm: 0,
            compute_limit_pm: 0,
        };
        let Request::Hello { group: read, .. } = Request::decode(&hello.encode()[4..]).unwrap() else {
            panic!("not a Hello")
        };
        assert!(read.len() <= MAX_STRING && group.starts_with(&read));
        // Whole if it fits; else cut by less than one character.
        if group.len() <= MAX_STRING {
            assert_eq!(read, group);
        } else {
            assert!(read.len() > MAX_STRING - 4, "{} bytes kept of {}", read.len(), group.len());
        }
    }
}

#[test]
fn a_frame_over_the_limit_is_refused_before_it_is_read() {
    let big = ((MAX_FRAME + 1) as u32).to_le_bytes();
    assert!(matches!(read_frame(&mut &big[..], MAX_FRAME), Err(ProtocolError::TooLarge(..))));
}
