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
    round_trip_request(Request::Parked { device: [1; 16], host_bytes: 1 << 30, held: 2 << 20, micros: 900 });
    round_trip_request(Request::Wake { seq: 11, device: [1; 16] });
    round_trip_request(Request::Woken { device: [1; 16], held: 1 << 30, micros: 700 });
    round_trip_request(Request::ContextMeasured { device: [1; 16], bytes: 500 << 20 });
    round_trip_request(Request::Want { device: [1; 16] });
    round_trip_request(Request::LeaseDone { device: [1; 16], lease: 7, drain_us: 1500, more: true });
    round_trip_request(Request::LeaseDone { device: [1; 16], lease: 8, drain_us: 0, more: false });
    assert!(Request::decode(&Request::ContextMeasured { device: [1; 16], bytes: 0 }.encode()[4..]).is_err());
    for reply in [
        Reply::Welcome { version: 1, pid: 4242, managed: vec![] },
        Reply::Welcome { version: 1, pid: 4242, managed: vec![([2; 16], 16 << 30), ([3; 16], 1)] },
        Reply::Registered { device: [2; 16], request: 1 << 30, limit: u64::MAX, parked: false, context: 0 },
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
