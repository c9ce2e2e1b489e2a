//! The arbiter's server with a source of entitlements (a fixed verdict standing in for the
//! kubelet or a policy file), spoken to over its socket with raw protocol frames: the
//! source is asked about the peer the kernel names (once per process); a Kubernetes-like entitlement caps the
//! request, limit, priority, resolver and compute share, and puts every process in its derived group
//! whatever group it names; `Registered` carries what is believed; a process that is not
//! entitled gets no guarantee and no burst; a GPU outside the entitlement gets nothing; a
//! lookup that fails is no verdict: never cached, asked again before a registration.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpufrac_common::protocol::{read_frame, Denial, Reply, Request, MAX_FRAME, VERSION};
use gpufrac_common::{ComputeShare, ComputeSpec, Resolver};
use gpufrac_daemon::arbiter::server::{serve, Options, Shared, Signals};
use gpufrac_daemon::entitlement::{Amount, DeviceCaps, Entitlement, Entitlements, Identity, Verdict};
use gpufrac_daemon::status::Status;

const GIB: u64 = 1 << 30;
const GPU: [u8; 16] = [7; 16];
const OTHER_GPU: [u8; 16] = [8; 16];

/// Answers one verdict (after the `first` ones, if any), recording who it was asked about.
struct Fixed {
    verdict: Verdict,
    asked: Mutex<Vec<Identity>>,
}

impl Fixed {
    fn new(verdict: Verdict) -> Arc<Fixed> {
        Arc::new(Fixed { verdict, asked: Mutex::new(Vec::new()) })
    }
}

impl Entitlements for Fixed {
    fn lookup(&self, who: &Identity) -> Verdict {
        let mut asked = self.asked.lock().unwrap();
        asked.push(who.clone());
        // A failed lookup first (the kubelet down), then the answer.
        match &self.verdict {
            Verdict::Entitled(e) if e.source.starts_with("after-a-failure") && asked.len() == 1 => {
                Verdict::Unknown { why: "the kubelet did not answer".into() }
            }
            other => other.clone(),
        }
    }
}

/// An arbiter serving two 16 GiB GPUs with `source`, on a socket in a temporary folder.
struct Served {
    socket: PathBuf,
    _dir: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    fn start(source: Arc<Fixed>) -> Served {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let socket = dir.path().join("arbiter.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        listener.set_nonblocking(true).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime =
                tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            runtime.block_on(async move {
                let gpus = [(GPU, 16 * GIB), (OTHER_GPU, 16 * GIB)];
                let source: Arc<dyn Entitlements> = source;
                let shared =
                    Shared::entitled(&gpus, Options::default(), Box::new(Signals), None, Some(source));
                let listener = tokio::net::UnixListener::from_std(listener).unwrap();
                serve(listener, shared, async move {
                    let _ = stopped.await;
                })
                .await;
            });
        });
        Served { socket, _dir: dir, stop: Some(stop), thread: Some(thread) }
    }

    fn status(&self) -> Status {
        gpufrac_daemon::status::fetch(&self.socket).expect("status")
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Client(UnixStream);

impl Client {
    fn hello(served: &Served, group: &str, resolver: Resolver, priority: i32) -> Client {
        Client::hello_with_compute(served, group, resolver, priority, (0, 0))
    }

    /// Says `Hello` declaring a compute share: (request, limit) per mille, (0, 0) for none.
    fn hello_with_compute(
        served: &Served,
        group: &str,
        resolver: Resolver,
        priority: i32,
        (compute_request_pm, compute_limit_pm): (u16, u16),
    ) -> Client {
        let s = UnixStream::connect(&served.socket).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut c = Client(s);
        c.send(Request::Hello {
            version: VERSION,
            group: group.into(),
            pod: String::new(),
            resolver,
            priority,
            wait_timeout_ms: 100,
            park_after_ms: 0,
            compute_request_pm,
            compute_limit_pm,
        });
        assert!(matches!(c.reply(), Reply::Welcome { .. }));
        c
    }

    fn send(&mut self, r: Request) {
        self.0.write_all(&r.encode()).expect("send");
    }

    fn reply(&mut self) -> Reply {
        Reply::decode(&read_frame(&mut self.0, MAX_FRAME).expect("a reply")).expect("a reply frame")
    }

    /// Registers and returns what the arbiter believes: (request, limit), or the refusal.
    fn register(&mut self, device: [u8; 16], request: u64, limit: u64) -> Result<(u64, u64), String> {
        self.send(Request::Register {
            device,
            total: 16 * GIB,
            request,
            limit,
            held: 0,
            granted: 0,
            swapped: 0,
        });
        match self.reply() {
            Reply::Registered { device: d, request, limit, .. } if d == device => Ok((request, limit)),
            Reply::Refused { reason, .. } => Err(reason),
            other => panic!("unexpected {other:?}"),
        }
    }

    fn acquire(&mut self, seq: u64, bytes: u64) -> Reply {
        self.send(Request::Acquire { seq, device: GPU, bytes, preferred: bytes, held: 0, resume: false });
        self.reply()
    }
}

fn kubernetes_like() -> Verdict {
    Verdict::Entitled(Entitlement {
        source: "kubelet: ns/pod container c".into(),
        devices: Some(BTreeMap::from([(
            GPU,
            DeviceCaps { max_request: Amount::Fraction(0.25), max_limit: Amount::Fraction(0.5) },
        )])),
        max_request: Amount::Fraction(0.25),
        max_limit: Amount::Fraction(0.5),
        max_priority: 3,
        resolver: Some(Resolver::Wait),
        group: Some("k8s-0f3c-c".into()),
        max_compute: Some(ComputeSpec {
            request: ComputeShare::from_per_mille(300).unwrap(),
            limit: ComputeShare::from_per_mille(800).unwrap(),
        }),
    })
}

#[test]
fn an_entitled_client_gets_its_entitlement_and_its_derived_group() {
    let source = Fixed::new(kubernetes_like());
    let served = Served::start(source.clone());
    let mut a = Client::hello(&served, "chosen-by-a", Resolver::Priority, 1_000_000);
    assert_eq!(a.register(GPU, 12 * GIB, 16 * GIB), Ok((4 * GIB, 8 * GIB)), "capped to 0.25 / 0.5 of 16 GiB");
    // Another process naming another group lands in the same derived group.
    let mut b = Client::hello(&served, "chosen-by-b", Resolver::Swap, 0);
    assert_eq!(b.register(GPU, GIB, 2 * GIB), Ok((4 * GIB, 8 * GIB)), "the group's request and limit");
    // Not entitled to the other GPU: nothing there.
    assert_eq!(a.register(OTHER_GPU, GIB, 2 * GIB), Ok((0, 0)));
    let s = served.status();
    let gpu = s.gpus.iter().find(|g| g.uuid == gpufrac_common::gpu_uuid::format(&GPU)).expect("the GPU");
    assert_eq!(gpu.guaranteed, 4 * GIB, "one guarantee for the derived group: {gpu:?}");
    for p in &gpu.processes {
        assert_eq!((p.group.as_str(), p.resolver.as_str()), ("k8s-0f3c-c", "wait"), "{p:?}");
        assert_eq!(p.entitlement, "kubelet: ns/pod container c");
    }
    // Priorities are capped, not raised: a's 1000000 is 3, b's own 0 stays.
    let mut priorities: Vec<i32> = gpu.processes.iter().map(|p| p.priority).collect();
    priorities.sort();
    assert_eq!(priorities, vec![0, 3]);
    let a_status = gpu.processes.iter().find(|p| p.capped.contains("priority")).expect("a's cuts shown");
    assert!(a_status.capped.contains("priority 1000000 -> 3"), "{a_status:?}");
    assert!(a_status.capped.contains("group chosen-by-a -> k8s-0f3c-c"), "{a_status:?}");
    assert!(a_status.capped.contains("request 12884901888 -> 4294967296"), "{a_status:?}");
    // Bursts stop at the entitled limit: 4 GiB above the request, no more.
    assert!(matches!(a.acquire(1, 5 * GIB), Reply::Denied { seq: 1, .. }));
    assert_eq!(a.acquire(2, 4 * GIB), Reply::Granted { seq: 2, bytes: 4 * GIB });
    // The source was asked about the peer the kernel names, once: the verdict is kept for
    // the process (its PID and start time) while its shim reconnects.
    let asked = source.asked.lock().unwrap();
    assert_eq!(asked.len(), 1);
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    assert!(asked.iter().all(|who| who.pid == std::process::id() && who.uid == uid), "{asked:?}");
}

#[test]
fn a_declared_compute_share_is_cut_to_the_entitlement() {
    let served = Served::start(Fixed::new(kubernetes_like()));
    // 80% declared, 30% vouched; the limit, 100%, is cut to 80%.
    let mut a = Client::hello_with_compute(&served, "g", Resolver::Wait, 0, (800, 1000));
    assert_eq!(a.register(GPU, GIB, 2 * GIB), Ok((GIB, 2 * GIB)));
    let s = served.status();
    let gpu = s.gpus.iter().find(|g| !g.processes.is_empty()).expect("registered");
    let p = &gpu.processes[0];
    assert_eq!((p.compute_request_pm, p.compute_limit_pm), (300, 800), "{p:?}");
    assert!(p.capped.contains("compute request 80% -> 30%"), "{p:?}");
    assert!(p.capped.contains("compute limit 100% -> 80%"), "{p:?}");
    // Another process of the group declaring the same share is believed the same, and is
    // its group's member (a group's processes must have one share).
    let mut b = Client::hello_with_compute(&served, "h", Resolver::Wait, 0, (800, 1000));
    assert_eq!(b.register(GPU, GIB, 2 * GIB), Ok((GIB, 2 * GIB)));
    // A share within the entitlement is kept as declared: a second arbiter, the same source.
    let served = Served::start(Fixed::new(kubernetes_like()));
    let mut c = Client::hello_with_compute(&served, "g", Resolver::Wait, 0, (200, 500));
    assert_eq!(c.register(GPU, GIB, 2 * GIB), Ok((GIB, 2 * GIB)));
    let s = served.status();
    let p = &s.gpus.iter().find(|g| !g.processes.is_empty()).expect("registered").processes[0];
    assert_eq!((p.compute_request_pm, p.compute_limit_pm), (200, 500), "{p:?}");
    assert!(!p.capped.contains("compute"), "{p:?}");
}

#[test]
fn a_client_that_is_not_entitled_gets_no_guarantee_and_no_burst() {
    let verdict = Verdict::NotEntitled { why: "no gpufrac.io/gpu shares".into() };
    let served = Served::start(Fixed::new(verdict));
    let mut c = Client::hello_with_compute(&served, "g", Resolver::Priority, 50, (500, 1000));
    assert_eq!(c.register(GPU, 8 * GIB, 16 * GIB), Ok((0, 0)));
    let reply = c.acquire(1, GIB);
    assert!(
        matches!(reply, Reply::Denied { seq: 1, reason: Denial::OverLimit | Denial::NeverFits }),
        "{reply:?}"
    );
    let s = served.status();
    let gpu = s.gpus.iter().find(|g| !g.processes.is_empty()).expect("registered somewhere");
    assert_eq!((gpu.guaranteed, gpu.burst), (0, 0));
    let p = &gpu.processes[0];
    assert_eq!((p.priority, p.resolver.as_str()), (0, "wait"), "{p:?}");
    assert!(p.entitlement.contains("not entitled: no gpufrac.io/gpu shares"), "{p:?}");
    // Nor any of the GPU's time.
    assert_eq!((p.compute_request_pm, p.compute_limit_pm), (0, 0), "{p:?}");
    assert!(p.capped.contains("compute 50%/100% -> none"), "{p:?}");
}

#[test]
fn a_failed_lookup_is_no_verdict_and_is_asked_again_at_registration() {
    let Verdict::Entitled(mut e) = kubernetes_like() else { unreachable!() };
    e.source = "after-a-failure: ns/pod container c".into();
    let source = Fixed::new(Verdict::Entitled(e));
    let served = Served::start(source.clone());
    // The lookup at Hello fails; the one before the registration answers.
    let mut a = Client::hello_with_compute(&served, "chosen", Resolver::Wait, 0, (500, 1000));
    assert_eq!(
        a.register(GPU, 12 * GIB, 16 * GIB),
        Ok((4 * GIB, 8 * GIB)),
        "entitled once the source answers"
    );
    assert_eq!(source.asked.lock().unwrap().len(), 2, "asked again, not a cached failure");
    let s = served.status();
    let gpu = s.gpus.iter().find(|g| !g.processes.is_empty()).expect("registered");
    assert_eq!(gpu.processes[0].group, "k8s-0f3c-c", "the derived group, not a group of its own");
    assert_eq!(gpu.guaranteed, 4 * GIB);
    // Its compute share, none while unknown, is the one believed under the answer.
    let p = &gpu.processes[0];
    assert_eq!((p.compute_request_pm, p.compute_limit_pm), (300, 800), "{p:?}");
    // The answer is cached for the process: a new connection is not asked again.
    let mut b = Client::hello_with_compute(&served, "other", Resolver::Wait, 0, (500, 1000));
    assert_eq!(b.register(GPU, GIB, GIB), Ok((4 * GIB, 8 * GIB)));
    assert_eq!(source.asked.lock().unwrap().len(), 2);
}

#[test]
fn a_lookup_that_keeps_failing_gives_nothing_and_is_never_cached() {
    let source = Fixed::new(Verdict::Unknown { why: "the API server did not answer".into() });
    let served = Served::start(source.clone());
    let mut a = Client::hello(&served, "g", Resolver::Priority, 9);
    assert_eq!(a.register(GPU, 8 * GIB, 16 * GIB), Ok((0, 0)), "nothing while unknown");
    assert!(matches!(a.acquire(1, GIB), Reply::Denied { seq: 1, .. }));
    let s = served.status();
    let p = &s.gpus.iter().find(|g| !g.processes.is_empty()).expect("registered").processes[0];
    assert!(
        p.entitlement.contains("entitlement unknown") && p.entitlement.contains("did not answer"),
        "{p:?}"
    );
    assert_eq!(source.asked.lock().unwrap().len(), 2, "at Hello and again before the registration");
    // A reconnecting shim is asked about again: a failure is no verdict to keep.
    let mut b = Client::hello(&served, "g", Resolver::Wait, 0);
    assert_eq!(b.register(GPU, GIB, GIB), Ok((0, 0)));
    assert_eq!(source.asked.lock().unwrap().len(), 4);
}
