//! The stage every act plays on: a fresh simulated GPU and arbiter per act, the servers
//! started on their cues, their lines read until every one has finished (or was ended,
//! as the act expects).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use simgpu_state::env::SimGpuDir;

use super::timeline::Timeline;
use super::{io_err, Act, DemoConfig, DemoError, DemoSummary, Server};

/// Kills the arbiters and any server left when the demo ends, however it ends.
#[derive(Default)]
pub(super) struct Reaper(pub(super) Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What all acts share.
pub(super) struct Stage<'a> {
    pub(super) config: &'a DemoConfig,
    pub(super) server_bin: PathBuf,
    pub(super) shim: Option<PathBuf>,
    pub(super) arbiter_bin: Option<PathBuf>,
}

/// One act's simulated GPU and arbiter.
struct Gpu {
    sim: SimGpuDir,
    socket: PathBuf,
}

impl Stage<'_> {
    /// A fresh simulated GPU of `memory`, with an arbiter serving it when under gpufrac.
    fn gpu(&self, memory: &str, timeline: &Timeline, reaper: &mut Reaper) -> Result<Gpu, DemoError> {
        let sim = SimGpuDir::new(&std::env::temp_dir(), &self.config.bin_dir, memory)
            .map_err(io_err("preparing the simulated GPU"))?
            .with_context_overhead("256MiB");
        let socket = sim.lib_dir().join("arbiter.sock");
        if let Some(bin) = &self.arbiter_bin {
            let mut cmd = Command::new(bin);
            cmd.arg("--socket")
                .arg(&socket)
                .args(["--swap-quantum", "2s", "--kill-grace", "3s", "--reclaim-grace", "2s"])
                // The demo narrates every wait, short ones too (debug in the arbiter's log).
                .env("GPUFRAC_LOG", "info,gpufrac_daemon::arbiter::server=debug")
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            sim.apply(&mut cmd);
            let mut child = cmd.spawn().map_err(io_err(format!("starting {}", bin.display())))?;
            if let Some(err) = child.stderr.take() {
                timeline.forward("arbiter", Box::new(err));
            }
            reaper.0.push(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::os::unix::net::UnixStream::connect(&socket).is_err() {
                if Instant::now() > deadline {
                    return Err(DemoError::Server {
                        name: "arbiter".into(),
                        detail: "did not start serving".into(),
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(Gpu { sim, socket })
    }

    fn spawn(
        &self,
        gpu: &Gpu,
        server: &Server,
        act: usize,
        timeline: &mut Timeline,
    ) -> Result<Child, DemoError> {
        let mut cmd = Command::new(&self.server_bin);
        cmd.arg("--name").arg(&server.name).args(&server.args).stdout(Stdio::piped()).stderr(Stdio::piped());
        gpu.sim.apply(&mut cmd);
        if let Some(shim) = &self.shim {
            cmd.env("LD_PRELOAD", shim)
                .env("GPUFRAC_MEMORY_REQUEST", server.request)
                .env("GPUFRAC_MEMORY_LIMIT", server.limit)
                .env("GPUFRAC_RESOLVER", server.resolver)
                .env("GPUFRAC_PRIORITY", server.priority.to_string())
                .env("GPUFRAC_ARBITER_SOCKET", &gpu.socket)
                .env("GPUFRAC_GROUP", format!("demo-{}-{act}-{}", std::process::id(), server.name))
                .env("GPUFRAC_WAIT_TIMEOUT", "60s");
        }
        let mut child = cmd.spawn().map_err(io_err(format!("starting {}", self.server_bin.display())))?;
        timeline.names_by_pid.insert(child.id().to_string(), server.name.clone());
        if let Some(out) = child.stdout.take() {
            timeline.forward(&server.name, Box::new(out));
        }
        if let Some(err) = child.stderr.take() {
            timeline.forward(&server.name, Box::new(err));
        }
        Ok(child)
    }

    /// Prints a server's line, counting it in `summary`.
    fn server_line(
        name: &str,
        line: &str,
        expected_to_end: bool,
        timeline: &Timeline,
        summary: &mut DemoSummary,
        errors: &mut Vec<(String, String)>,
    ) -> String {
        let event = line.strip_prefix(name).map(str::trim).unwrap_or(line).to_owned();
        if event.starts_with("batch=") {
            summary.batches_served += 1;
        } else if event.starts_with("out-of-memory") {
            summary.out_of_memory += 1;
        } else if event.starts_with("kept-memory-intact") && !expected_to_end {
            summary.kept_intact += 1;
        } else if event.contains("error") {
            errors.push((name.to_owned(), event.clone()));
        }
        timeline.print(name, &event);
        event
    }

    /// Runs one act to its end: every server finished (or was ended, as expected). A
    /// server that fails ends the act at once.
    pub(super) fn run_act(
        &self,
        number: usize,
        act: &Act,
        timeline: &mut Timeline,
        summary: &mut DemoSummary,
        reaper: &mut Reaper,
    ) -> Result<(), DemoError> {
        let gpu = self.gpu(&act.device_memory, timeline, reaper)?;
        let mut errors: Vec<(String, String)> = Vec::new();
        let mut next = 0;
        // name → (index in the reaper, expected to be ended)
        let mut running: HashMap<String, (usize, bool)> = HashMap::new();
        let mut seen: Vec<(String, String)> = Vec::new();
        let mut last_progress = Instant::now();
        let expected_to_end: HashMap<&str, bool> =
            act.servers.iter().map(|s| (s.name.as_str(), s.ended)).collect();
        loop {
            // Start every server whose cue has come.
            while let Some(server) = act.servers.get(next) {
                if let Some((who, event, delay)) = &server.after {
                    if !seen.iter().any(|(n, e)| n == who && e.starts_with(event)) {
                        break;
                    }
                    std::thread::sleep(*delay);
                }
                let child = self.spawn(&gpu, server, number, timeline)?;
                running.insert(server.name.clone(), (reaper.0.len(), server.ended));
                reaper.0.push(child);
                next += 1;
            }
            // Reap who exited: one ended by the priority resolver prints nothing more; any
            // other failure ends the act.
            let mut failed = None;
            running.retain(|n, &mut (i, ended)| match reaper.0[i].try_wait().ok().flatten() {
                None => true,
                Some(status) => {
                    if !status.success() {
                        if ended {
                            timeline.print(n, &format!("ended ({status})"));
                        } else {
                            failed = Some((n.clone(), status));
                        }
                    }
                    false
                }
            });
            if let Some((name, status)) = failed {
                // Its last lines may still be on their way.
                while let Ok((who, line)) = timeline.rx.recv_timeout(Duration::from_millis(300)) {
                    if who == "arbiter" {
                        timeline.arbiter_event(&line, summary);
                    } else {
                        let ends = expected_to_end.get(who.as_str()).copied().unwrap_or(false);
                        Self::server_line(&who, &line, ends, timeline, summary, &mut errors);
                    }
                }
                let detail = errors
                    .iter()
                    .rev()
                    .find(|(n, _)| *n == name)
                    .map_or_else(|| status.to_string(), |(_, e)| e.clone());
                return Err(DemoError::Server { name, detail });
            }
            timeline.show_waits(false, summary);
            // Often while a burst is queued, to show it once it has waited a few ms.
            let tick = if timeline.queued.values().any(|q| !q.shown) { 2 } else { 200 };
            let (name, line) = match timeline.rx.recv_timeout(Duration::from_millis(tick)) {
                Ok(got) => {
                    last_progress = Instant::now();
                    got
                }
                // Everyone exited and every line is in.
                Err(_) if running.is_empty() && next == act.servers.len() => break,
                Err(_) if running.is_empty() => {
                    let server = &act.servers[next];
                    let (who, event) = server.after.as_ref().map_or(("?", "?"), |(w, e, _)| (w.as_str(), *e));
                    return Err(DemoError::Server {
                        name: server.name.clone(),
                        detail: format!("not started: {who} exited before printing {event:?}"),
                    });
                }
                Err(_) if last_progress.elapsed() < Duration::from_secs(90) => continue,
                Err(_) => {
                    return Err(DemoError::Server {
                        name: act.title.into(),
                        detail: "no progress for 90 s".into(),
                    })
                }
            };
            if name == "arbiter" {
                timeline.arbiter_event(&line, summary);
                continue;
            }
            let ends = expected_to_end.get(name.as_str()).copied().unwrap_or(false);
            let event = Self::server_line(&name, &line, ends, timeline, summary, &mut errors);
            seen.push((name, event));
        }
        timeline.queued.clear();
        Ok(())
    }
}
