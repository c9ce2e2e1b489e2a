//! The shim's settings on a test's [`Command`], one method per environment variable the
//! shim reads (docs/interface.md, "Read by the shim"), so that a test says which settings it uses
//! and nothing else:
//!
//! ```no_run
//! use gpufrac_e2e::{compile_c, Arbiter, ShimSettings, SimGpu};
//!
//! let gpu = SimGpu::new("4GiB");
//! let arbiter = Arbiter::start(&gpu);
//! let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
//! cmd.memory_request("1GiB").memory_limit("3GiB").arbiter_socket(arbiter.socket()).arg("alloc");
//! ```
//!
//! [`SimGpu::shimmed`](crate::SimGpu::shimmed) is [`SimGpu::command`](crate::SimGpu::command)
//! with the shim preloaded; [`ShimSettings::preload_shim`] preloads it on a command made
//! another way. Each setting method sets its variable to the value given, as is: a test of
//! a bad setting passes the bad value. Unset variables stay unset ([`SimGpu::command`]
//! removes those inherited from the test's environment), so the shim's defaults apply.
//!
//! [`SimGpu::command`]: crate::SimGpu::command

use std::ffi::OsStr;
use std::process::Command;

use crate::artifact;

/// The shim's settings, set on a [`Command`] (the only implementation). Each method sets
/// one environment variable and returns the command, so they chain with each other and
/// with `Command`'s own methods.
pub trait ShimSettings {
    /// Preloads the shim: `LD_PRELOAD` is the built `libgpufrac.so` ([`artifact`]).
    fn preload_shim(&mut self) -> &mut Command;
    /// `GPUFRAC_MEMORY_REQUEST`: the group's guaranteed memory on each device.
    fn memory_request(&mut self, size: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_MEMORY_LIMIT`: the most the group may hold.
    fn memory_limit(&mut self, size: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_RESOLVER`: `wait`, `priority` or `swap`.
    fn resolver(&mut self, resolver: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_PRIORITY`: higher wins under the priority resolver.
    fn priority(&mut self, priority: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_WAIT_TIMEOUT`: how long a blocked burst waits (`30s`, `500ms`).
    fn wait_timeout(&mut self, wait: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_GROUP`: processes of one group share one request and one limit.
    fn group(&mut self, group: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_ARBITER_SOCKET`: the arbiter's socket ([`Arbiter::socket`](crate::Arbiter::socket)).
    fn arbiter_socket(&mut self, socket: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_POD`: `namespace/name` shown in status and metrics.
    fn pod(&mut self, pod: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_LOG`: the shim's log filter (`info`, `debug`...).
    fn log(&mut self, filter: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_PARK_AFTER`: how long idle before the group may be parked.
    fn park_after(&mut self, idle: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_COMPUTE_REQUEST`: the guaranteed share of one GPU's time.
    fn compute_request(&mut self, share: impl AsRef<OsStr>) -> &mut Command;
    /// `GPUFRAC_COMPUTE_LIMIT`: the most of one GPU's time the group may use.
    fn compute_limit(&mut self, share: impl AsRef<OsStr>) -> &mut Command;
}

impl ShimSettings for Command {
    fn preload_shim(&mut self) -> &mut Command {
        self.env("LD_PRELOAD", artifact("libgpufrac.so"))
    }
    fn memory_request(&mut self, size: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_MEMORY_REQUEST", size)
    }
    fn memory_limit(&mut self, size: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_MEMORY_LIMIT", size)
    }
    fn resolver(&mut self, resolver: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_RESOLVER", resolver)
    }
    fn priority(&mut self, priority: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_PRIORITY", priority)
    }
    fn wait_timeout(&mut self, wait: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_WAIT_TIMEOUT", wait)
    }
    fn group(&mut self, group: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_GROUP", group)
    }
    fn arbiter_socket(&mut self, socket: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_ARBITER_SOCKET", socket)
    }
    fn pod(&mut self, pod: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_POD", pod)
    }
    fn log(&mut self, filter: impl AsRef<OsStr>) -> &mut Command {
        // `GPUFRAC_TEST_SHIM_LOG` (a `GPUFRAC_LOG` filter) raises what every shimmed
        // process of a test run writes, for a failure that needs the shim's reasons.
        match std::env::var_os("GPUFRAC_TEST_SHIM_LOG") {
            Some(raised) => self.env("GPUFRAC_LOG", raised),
            None => self.env("GPUFRAC_LOG", filter),
        }
    }
    fn park_after(&mut self, idle: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_PARK_AFTER", idle)
    }
    fn compute_request(&mut self, share: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_COMPUTE_REQUEST", share)
    }
    fn compute_limit(&mut self, share: impl AsRef<OsStr>) -> &mut Command {
        self.env("GPUFRAC_COMPUTE_LIMIT", share)
    }
}
