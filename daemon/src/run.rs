//! `gpufrac run`: runs a command under the shim with a request, a limit and the other
//! settings of the shim (README.md, "The shim (`libgpufrac.so`)"), validated here with the
//! shim's own reader, `gpufrac_common::config`.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpufrac_common::config::Config;

/// Settings for the command, as given on the command line (`gpufrac run` flags).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RunSettings {
    /// Guaranteed GPU memory on each device (512MiB, 4GiB, 0.25, 25%).
    #[arg(long)]
    pub request: String,
    /// Burst ceiling, at least the request (default: the request).
    #[arg(long)]
    pub limit: Option<String>,
    /// What a colliding burst does: wait, priority or swap.
    #[arg(long)]
    pub resolver: Option<String>,
    /// Higher wins under the priority resolver.
    #[arg(long, allow_negative_numbers = true)]
    pub priority: Option<i32>,
    /// Processes with the same group share one request and limit.
    #[arg(long)]
    pub group: Option<String>,
    /// How long a blocked burst waits (30s, 500ms).
    #[arg(long)]
    pub wait_timeout: Option<String>,
    /// The arbiter's unix socket (default: standalone).
    #[arg(long)]
    pub arbiter_socket: Option<PathBuf>,
    /// namespace/name shown in status and metrics.
    #[arg(long)]
    pub pod: Option<String>,
    /// The shim library (default: libgpufrac.so beside the gpufrac executable).
    #[arg(long)]
    pub shim: Option<PathBuf>,
}

/// Why the command could not be started.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A setting the shim would refuse.
    #[error("{0}")]
    Setting(String),
    /// The shim library is not where it should be.
    #[error(
        "the shim {0} does not exist; build it (cargo build --release --workspace) or name it with --shim"
    )]
    NoShim(PathBuf),
    /// Nothing to run.
    #[error("no command given: gpufrac run [options] -- COMMAND [ARGS...]")]
    NoCommand,
    /// exec failed.
    #[error("cannot run {command}")]
    Exec {
        /// The command.
        command: String,
        /// What the system said.
        source: std::io::Error,
    },
}

impl RunSettings {
    /// The environment the command gets, validated as the shim validates it.
    pub fn environment(&self) -> Result<Vec<(&'static str, String)>, RunError> {
        let mut env: Vec<(&'static str, String)> = vec![("GPUFRAC_MEMORY_REQUEST", self.request.clone())];
        let optional = [
            ("GPUFRAC_MEMORY_LIMIT", self.limit.clone()),
            ("GPUFRAC_RESOLVER", self.resolver.clone()),
            ("GPUFRAC_PRIORITY", self.priority.map(|p| p.to_string())),
            ("GPUFRAC_GROUP", self.group.clone()),
            ("GPUFRAC_WAIT_TIMEOUT", self.wait_timeout.clone()),
            ("GPUFRAC_ARBITER_SOCKET", self.arbiter_socket.as_ref().map(|p| p.display().to_string())),
            ("GPUFRAC_POD", self.pod.clone()),
        ];
        env.extend(optional.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))));
        let map: HashMap<&str, String> = env.iter().map(|(k, v)| (*k, v.clone())).collect();
        Config::from_lookup(|name| map.get(name).cloned()).map_err(|e| RunError::Setting(e.to_string()))?;
        Ok(env)
    }

    /// The shim to preload.
    pub fn shim_path(&self, own_dir: Option<&Path>) -> Result<PathBuf, RunError> {
        let path = match (&self.shim, own_dir) {
            (Some(p), _) => p.clone(),
            (None, Some(dir)) => dir.join("libgpufrac.so"),
            (None, None) => PathBuf::from("libgpufrac.so"),
        };
        let path = std::fs::canonicalize(&path).map_err(|_| RunError::NoShim(path))?;
        Ok(path)
    }

    /// The command, ready to run: environment set and the shim first on `LD_PRELOAD`.
    pub fn command(&self, argv: &[OsString], own_dir: Option<&Path>) -> Result<Command, RunError> {
        let (program, args) = argv.split_first().ok_or(RunError::NoCommand)?;
        let env = self.environment()?;
        let shim = self.shim_path(own_dir)?;
        let mut preload = OsString::from(shim.as_os_str());
        if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
            preload.push(":");
            preload.push(old);
        }
        let mut cmd = Command::new(program);
        cmd.args(args).env("LD_PRELOAD", preload);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Ok(cmd)
    }
}

/// Replaces this process with the command (returns only on failure).
pub fn exec(settings: &RunSettings, argv: &[OsString], own_dir: Option<&Path>) -> RunError {
    use std::os::unix::process::CommandExt;
    match settings.command(argv, own_dir) {
        Ok(mut cmd) => {
            let err = cmd.exec();
            RunError::Exec { command: argv[0].to_string_lossy().into_owned(), source: err }
        }
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_validated_as_the_shim_does() {
        let ok = RunSettings { request: "1GiB".into(), limit: Some("2GiB".into()), ..Default::default() };
        let env = ok.environment().unwrap();
        assert!(env.contains(&("GPUFRAC_MEMORY_LIMIT", "2GiB".into())));
        for bad in [
            RunSettings { request: "lots".into(), ..Default::default() },
            RunSettings { request: "2GiB".into(), limit: Some("1GiB".into()), ..Default::default() },
            RunSettings { request: "1GiB".into(), resolver: Some("fight".into()), ..Default::default() },
            RunSettings { request: "1GiB".into(), group: Some("a/b".into()), ..Default::default() },
        ] {
            assert!(matches!(bad.environment(), Err(RunError::Setting(_))), "{bad:?}");
        }
    }
}
