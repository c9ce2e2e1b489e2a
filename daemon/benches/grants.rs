//! Grant round trips through the arbiter against the bare unix-socket round trip, in one
//! run: p50/p99 with 1 and 64 concurrent clients, and grants per second.
//! Run: `cargo bench -p gpufrac-daemon`.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{read_frame, Reply, Request, MAX_FRAME, VERSION};
use gpufrac_common::Resolver;
use gpufrac_daemon::arbiter::server;

const GPU: [u8; 16] = [9; 16];
const ROUNDS: usize = 20_000;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

/// Runs `clients` threads each doing `rounds` round trips with `trip`; returns all
/// latencies (sorted) and the elapsed wall time.
fn measure(
    clients: usize,
    rounds: usize,
    setup: impl Fn(usize) -> Box<dyn FnMut() + Send> + Sync,
) -> (Vec<Duration>, Duration) {
    let barrier = Arc::new(Barrier::new(clients + 1));
    let setup = &setup;
    let mut all = Vec::new();
    let mut elapsed = Duration::ZERO;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|i| {
                let barrier = barrier.clone();
                scope.spawn(move || {
                    let mut trip = setup(i);
                    let mut lat = Vec::with_capacity(rounds);
                    barrier.wait();
                    for _ in 0..rounds {
                        let t = Instant::now();
                        trip();
                        lat.push(t.elapsed());
                    }
                    lat
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        for h in handles {
            all.extend(h.join().expect("client"));
        }
        elapsed = start.elapsed();
    });
    all.sort();
    (all, elapsed)
}

fn echo_server(path: &Path) {
    let listener = UnixListener::bind(path).expect("bind echo");
    std::thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                let mut stream = stream;
                while let Ok(body) = read_frame(&mut stream, MAX_FRAME) {
                    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
                    frame.extend_from_slice(&body);
                    if stream.write_all(&frame).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

fn arbiter(path: &Path) {
    let listener = std::os::unix::net::UnixListener::bind(path).expect("bind arbiter");
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::from_std(listener).expect("listener");
            let shared = server::Shared::new(&[(GPU, 1 << 50)]);
            server::serve(listener, shared, std::future::pending()).await;
        });
    });
}

fn connect(path: &Path) -> UnixStream {
    for _ in 0..1000 {
        if let Ok(s) = UnixStream::connect(path) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("cannot connect to {}", path.display());
}

fn shim_like_client(path: &Path, i: usize) -> Box<dyn FnMut() + Send> {
    let mut s = connect(path);
    let hello = Request::Hello {
        version: VERSION,
        group: format!("bench-{i}"),
        pod: String::new(),
        resolver: Resolver::Wait,
        priority: 0,
        wait_timeout_ms: 30_000,
        park_after_ms: 0,
        compute_request_pm: 0,
        compute_limit_pm: 0,
    };
    s.write_all(&hello.encode()).expect("hello");
    let register = Request::Register {
        device: GPU,
        total: 1 << 50,
        request: 0,
        limit: 1 << 40,
        held: 0,
        granted: 0,
        swapped: 0,
    };
    s.write_all(&register.encode()).expect("register");
    for _ in 0..2 {
        read_frame(&mut s, MAX_FRAME).expect("welcome/registered");
    }
    let mut seq = 0u64;
    Box::new(move || {
        seq += 1;
        let acquire =
            Request::Acquire { seq, device: GPU, bytes: 4096, preferred: 4096, held: 0, resume: false };
        s.write_all(&acquire.encode()).expect("acquire");
        match Reply::decode(&read_frame(&mut s, MAX_FRAME).expect("reply")).expect("decode") {
            Reply::Granted { .. } => {}
            other => panic!("expected a grant, got {other:?}"),
        }
        let release = Request::Release { device: GPU, bytes: 4096, held: 0 };
        s.write_all(&release.encode()).expect("release");
    })
}

fn bare_client(path: &Path) -> Box<dyn FnMut() + Send> {
    let mut s = connect(path);
    let frame =
        Request::Acquire { seq: 1, device: GPU, bytes: 4096, preferred: 4096, held: 0, resume: false }
            .encode();
    let mut buf = vec![0u8; frame.len()];
    Box::new(move || {
        s.write_all(&frame).expect("write");
        s.read_exact(&mut buf).expect("read");
    })
}

fn main() {
    let dir: PathBuf = std::env::temp_dir().join(format!("gpufrac-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (echo, arb) = (dir.join("echo.sock"), dir.join("arbiter.sock"));
    echo_server(&echo);
    arbiter(&arb);
    println!("{:<34} {:>10} {:>10} {:>14}", "", "p50", "p99", "per second");
    for clients in [1usize, 64] {
        let rounds = if clients == 1 { ROUNDS } else { ROUNDS / 16 };
        let (bare, bare_time) = measure(clients, rounds, |_| bare_client(&echo));
        let (grant, grant_time) = measure(clients, rounds, |i| shim_like_client(&arb, clients * 1000 + i));
        let rate = |n: usize, t: Duration| n as f64 / t.as_secs_f64();
        println!(
            "{:<34} {:>8.1}us {:>8.1}us {:>14.0}",
            format!("bare round trip, {clients} client(s)"),
            percentile(&bare, 0.5).as_secs_f64() * 1e6,
            percentile(&bare, 0.99).as_secs_f64() * 1e6,
            rate(bare.len(), bare_time)
        );
        println!(
            "{:<34} {:>8.1}us {:>8.1}us {:>14.0}",
            format!("grant round trip, {clients} client(s)"),
            percentile(&grant, 0.5).as_secs_f64() * 1e6,
            percentile(&grant, 0.99).as_secs_f64() * 1e6,
            rate(grant.len(), grant_time)
        );
        println!(
            "{:<34} {:>9.2}x",
            "  grant p50 / bare p50",
            percentile(&grant, 0.5).as_secs_f64() / percentile(&bare, 0.5).as_secs_f64()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
