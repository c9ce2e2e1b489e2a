//! `gpufrac top` against a real arbiter on two simulated GPUs: run in a pseudo-terminal
//! (libc's `openpty`; the screen read back with the `vt100` parser), it shows each GPU's
//! bar with its legend, a row per process, the burst waiting and then the event of its
//! wait; its keys act, `q` leaves with status 0 and the terminal as it was. With stdout
//! piped it prints one plain frame and exits 0 (1 when the arbiter does not answer).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{
    artifact, skip_on_real_gpu, status, unique, wait_for, Arbiter, ChildProcess, ShimSettings, SimGpu,
    TIMEOUT,
};

/// Why the tests here need simgpu: the sizes and the collision are made for its two
/// 8 GiB devices and 64 MiB contexts.
const SIZED: &str = "the collision is sized for two simulated 8 GiB devices with 64 MiB contexts";

const ROWS: std::num::NonZero<u16> = std::num::NonZero::new(50).expect("not zero");
const COLUMNS: std::num::NonZero<u16> = std::num::NonZero::new(160).expect("not zero");

/// A program running in a pseudo-terminal of its own, whose screen a VT100 parser keeps.
struct Terminal {
    master: std::fs::File,
    child: Child,
    parser: Arc<Mutex<vt100::Parser>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Terminal {
    /// Starts `cmd` as the session leader of a new pseudo-terminal of `ROWS` x `COLUMNS`,
    /// its controlling terminal and its stdin, stdout and stderr.
    fn spawn(mut cmd: Command) -> Terminal {
        let (mut master, mut slave) = (-1, -1);
        let size = libc::winsize { ws_row: ROWS.get(), ws_col: COLUMNS.get(), ws_xpixel: 0, ws_ypixel: 0 };
        // SAFETY: valid out-pointers for both descriptors; no name asked for, default
        // terminal settings (null), and a valid window size.
        let rc =
            unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), &size) };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: openpty succeeded: both are open descriptors that nothing else owns.
        let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let clone = |fd: &OwnedFd| fd.try_clone().expect("dup the terminal");
        cmd.stdin(Stdio::from(clone(&slave))).stdout(Stdio::from(clone(&slave))).stderr(Stdio::from(slave));
        cmd.env("TERM", "xterm-256color");
        // SAFETY: between fork and exec only async-signal-safe calls (setsid, ioctl).
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                // Its stdin, the terminal, becomes its controlling terminal.
                if libc::ioctl(0, libc::TIOCSCTTY, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
        let child = cmd.spawn().expect("start the program in the terminal");
        // The command's copies of the terminal go: the master reads end of file once the
        // program and its children have closed theirs.
        drop(cmd);
        let master = std::fs::File::from(master);
        let parser = Arc::new(Mutex::new(vt100::Parser::new(ROWS, COLUMNS, 0)));
        let (mut reading, screen) = (master.try_clone().expect("dup the master"), parser.clone());
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            // EIO once the other side is closed.
            while let Ok(n @ 1..) = reading.read(&mut buf) {
                screen.lock().unwrap_or_else(PoisonError::into_inner).process(&buf[..n]);
            }
        });
        Terminal { master, child, parser, reader: Some(reader) }
    }

    /// The screen's text now.
    fn screen(&self) -> String {
        self.parser.lock().unwrap_or_else(PoisonError::into_inner).screen().contents()
    }

    /// Waits until the screen satisfies `cond`; fails the test after [`TIMEOUT`].
    fn wait_screen(&self, what: &str, cond: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let screen = self.screen();
            if cond(&screen) {
                return screen;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; the screen:\n{screen}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Types `keys`.
    fn press(&mut self, keys: &str) {
        self.master.write_all(keys.as_bytes()).expect("type on the terminal");
    }

    /// Waits for the program to exit; its status, then the reader's end.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "the program did not exit; the screen:\n{}", self.screen());
            std::thread::sleep(Duration::from_millis(20));
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        status
    }

    /// The terminal's line settings (what raw mode changes).
    fn termios(&self) -> libc::termios {
        // SAFETY: termios is plain data, all zeroes a valid value.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: the master is an open terminal descriptor and `t` a valid out-pointer.
        let rc = unsafe { libc::tcgetattr(self.master.as_raw_fd(), &mut t) };
        assert_eq!(rc, 0, "tcgetattr: {}", std::io::Error::last_os_error());
        t
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `simgpu_probe` with the shim, held to `request` and `limit` in `group` (resolver wait).
fn shimmed(gpu: &SimGpu, arbiter: &Arbiter, group: &str, request: u64, limit: u64) -> Command {
    let mut cmd = gpu.shimmed(env!("CARGO_BIN_EXE_simgpu_probe"));
    cmd.memory_request(request.to_string())
        .memory_limit(limit.to_string())
        .resolver("wait")
        .arbiter_socket(arbiter.socket())
        .group(group)
        .wait_timeout("60s")
        .log("info");
    cmd
}

/// Whether a line of `screen` has `word` as one of its words.
fn has_word(screen: &str, word: &str) -> bool {
    screen.lines().any(|l| l.split_whitespace().any(|w| w == word))
}

fn gib(bytes: u64) -> String {
    format!("{:.2}GiB", bytes as f64 / GIB as f64)
}

fn top(socket: &Path) -> Command {
    let mut cmd = Command::new(artifact("gpufrac"));
    cmd.arg("top").arg("--socket").arg(socket);
    cmd
}

#[test]
fn top_shows_the_gpus_the_processes_the_queue_and_the_wait_and_q_restores_the_terminal() {
    skip_on_real_gpu!(SIZED);
    let gpu = SimGpu::new("8GiB,8GiB").with_context_overhead("64MiB");
    let arbiter = Arbiter::start(&gpu);
    // Every process registers on both GPUs (its request reserved on each) and allocates
    // on the first. C: a guarantee of 1 GiB, holding 512 MiB.
    let mut c = ChildProcess::spawn(
        shimmed(&gpu, &arbiter, &unique("steady"), GIB, GIB).args(["hold", &(512 * MIB).to_string()]),
    );
    c.ready();
    // A: 512 MiB guaranteed, borrowing most of the rest in one 5 GiB allocation.
    let mut a = ChildProcess::spawn(
        shimmed(&gpu, &arbiter, &unique("lender"), 512 * MIB, 6 * GIB).args(["hold", &(5 * GIB).to_string()]),
    );
    a.ready();
    // B: 512 MiB guaranteed, a 3 GiB burst that cannot be lent while A holds its own.
    let mut b = ChildProcess::spawn(shimmed(&gpu, &arbiter, &unique("waiter"), 512 * MIB, 6 * GIB).args([
        "timed-alloc",
        &(256 * MIB).to_string(),
        &(3 * GIB).to_string(),
    ]));
    let (pa, pb, pc) = (a.pid().to_string(), b.pid().to_string(), c.pid().to_string());
    let s = wait_for(&arbiter, "B's burst waiting", |s| {
        s.gpus[0].processes.iter().any(|p| p.pid == b.pid() && p.state == "waiting")
    });
    let waiting_since = Instant::now();
    let guaranteed: Vec<u64> = s.gpus.iter().map(|g| g.guaranteed).collect();
    assert_eq!(guaranteed, [2 * GIB, 2 * GIB], "every request on both GPUs: {s:?}");

    let mut term = Terminal::spawn(top(arbiter.socket()));
    let screen = term.wait_screen("the three processes and B in the queue", |s| {
        s.contains("bursts waiting") && [&pa, &pb, &pc].iter().all(|pid| has_word(s, pid))
    });
    // Each GPU: its heading, its bar, its legend with the figures.
    for (number, g) in s.gpus.iter().enumerate() {
        let heading = format!("[{}] {}  {}", number + 1, g.uuid, gib(g.total));
        assert!(screen.contains(&heading), "{heading}:\n{screen}");
        let legend = format!("█ guaranteed {}  ▓ lent ", gib(g.guaranteed));
        assert!(screen.contains(&legend), "GPU {}'s legend:\n{screen}", number + 1);
    }
    let bars = screen
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('█') && l.chars().count() > 100 && l.chars().all(|c| "█▓▒░·".contains(c)))
        .count();
    assert_eq!(bars, 2, "a bar per GPU:\n{screen}");
    for legend in ["▒ swapped ", "░ outside ", "· free "] {
        assert_eq!(screen.matches(legend).count(), 2, "{legend:?} in each legend:\n{screen}");
    }
    // A row per process on each GPU (each is registered on both); B's says it waits.
    for pid in [&pa, &pb, &pc] {
        let rows = screen.lines().filter(|l| has_word(l, pid) && l.contains(" wait ")).count();
        assert_eq!(rows, 2, "a row on each GPU for {pid}:\n{screen}");
    }
    assert!(
        screen.lines().any(|l| has_word(l, &pb) && l.contains(" waiting ") && l.contains(" wait ")),
        "B's row says it waits:\n{screen}"
    );
    // The queue: B's burst with what it needs, as the arbiter serves it.
    let document = gpufrac_daemon::status::fetch_document(arbiter.socket()).expect("the document");
    let needs: Vec<(u32, u64)> = document.queue.iter().map(|q| (q.pid, q.bytes)).collect();
    assert!(
        matches!(needs[..], [(pid, bytes)] if pid == b.pid() && bytes > 2 * GIB),
        "B alone waits, for about 3 GiB: {:?}",
        document.queue
    );
    let queue: Vec<&str> = screen.lines().skip_while(|l| !l.contains("bursts waiting")).take(3).collect();
    assert!(
        queue.iter().any(|l| has_word(l, &pb) && l.contains(&gib(needs[0].1))),
        "B's burst in the queue:\n{screen}"
    );

    // B has waited more than a second: A exits, B is granted after its wait.
    std::thread::sleep(Duration::from_millis(1300).saturating_sub(waiting_since.elapsed()));
    a.close_stdin();
    a.finish();
    let granted = b.expect_line(&["GRANTED", "REFUSED"], TIMEOUT);
    let waited_us: u64 =
        granted.strip_prefix("GRANTED ").and_then(|us| us.parse().ok()).unwrap_or_else(|| {
            panic!("B's burst: {granted}\n{}", arbiter.log_text());
        });
    assert!(waited_us >= 1_000_000, "B waited {waited_us} µs");
    assert!(arbiter.log_text().contains("a burst waited"), "{}", arbiter.log_text());
    let screen = term.wait_screen("the event of B's wait", |s| {
        s.lines().any(|l| has_word(l, &pb) && l.contains(" waited ") && l.contains("ms for its memory"))
    });
    assert!(
        !screen.lines().any(|l| has_word(l, &pa) && l.contains(" wait ")),
        "A's rows are gone:\n{screen}"
    );

    // Another user (when the test may be one) sees the GPUs but none of these processes,
    // waiters or events, as `gpufrac status` would show it.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(gpu.lib_dir(), std::fs::Permissions::from_mode(0o755))
            .expect("open the simgpu folder to others");
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(artifact("gpufrac"))
            .args(["top", "--once", "--socket"])
            .arg(arbiter.socket())
            .output()
            .expect("gpufrac top as another user");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("[1] GPU-") && text.contains("[2] GPU-"), "{text}");
        assert!(!has_word(&text, &pb) && !has_word(&text, &pc), "{text}");
        for empty in ["processes:\n  no processes", "(longest first):\n  none", "(newest first):\n  none"] {
            assert!(text.contains(empty), "{empty:?}:\n{text}");
        }
    }

    // The keys: one GPU, all again, the sort.
    term.press("2");
    term.wait_screen("GPU 2 alone", |s| {
        s.contains("GPU 2 only") && !s.contains("[1] GPU-") && s.contains("[2] GPU-")
    });
    term.press("a");
    term.wait_screen("every GPU", |s| s.contains("[1] GPU-") && s.contains("[2] GPU-"));
    term.press("s");
    term.wait_screen("sorted by request", |s| s.contains("sorted by request"));

    // q leaves: status 0, the main screen back, the cursor shown, the line discipline
    // cooked again.
    term.press("q");
    let exit = term.wait_exit();
    assert!(exit.success(), "gpufrac top exited with {exit:?}:\n{}", term.screen());
    let parser = term.parser.lock().unwrap_or_else(PoisonError::into_inner);
    assert!(!parser.screen().alternate_screen(), "the alternate screen is left");
    assert!(!parser.screen().hide_cursor(), "the cursor is shown again");
    drop(parser);
    let t = term.termios();
    assert_ne!(t.c_lflag & libc::ICANON, 0, "canonical mode is back");
    assert_ne!(t.c_lflag & libc::ECHO, 0, "echo is back");

    b.close_stdin();
    b.finish();
    c.close_stdin();
    c.finish();
}

#[test]
fn top_with_stdout_piped_prints_one_plain_frame() {
    skip_on_real_gpu!(SIZED);
    let gpu = SimGpu::new("8GiB,8GiB").with_context_overhead("64MiB");
    let arbiter = Arbiter::start(&gpu);
    let mut c = ChildProcess::spawn(
        shimmed(&gpu, &arbiter, &unique("steady"), GIB, 2 * GIB).args(["hold", &(512 * MIB).to_string()]),
    );
    c.ready();
    let out = top(arbiter.socket()).stdin(Stdio::null()).output().expect("run gpufrac top");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{:?}: {text}{}", out.status, String::from_utf8_lossy(&out.stderr));
    assert!(!text.contains('\x1b'), "no escape codes:\n{text}");
    let s = status(&arbiter);
    for (number, g) in s.gpus.iter().enumerate() {
        assert!(text.contains(&format!("[{}] {}  8.00GiB", number + 1, g.uuid)), "{text}");
    }
    // C's 1 GiB guarantee is an eighth of each 8 GiB GPU: 8 of the 64 characters.
    let bar = format!("  [{}", "█".repeat(8));
    assert_eq!(text.lines().filter(|l| l.starts_with(&bar) && l.ends_with("·]")).count(), 2, "{text}");
    assert_eq!(text.matches("█ guaranteed 1.00GiB  ▓ lent ").count(), 2, "{text}");
    assert_eq!(
        text.lines().filter(|l| has_word(l, &c.pid().to_string()) && l.contains("running")).count(),
        2,
        "C's row on each GPU:\n{text}"
    );
    assert!(text.contains("recent events (newest first):"), "{text}");

    // Nobody there: the frame says so, and the exit status too.
    let dead = gpu.lib_dir().join("nobody.sock");
    let out = top(&dead).output().expect("run gpufrac top");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("arbiter unreachable: cannot reach the arbiter at"), "{text}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("gpufrac: error: cannot reach the arbiter at"), "{stderr}");
    c.close_stdin();
    c.finish();
}
