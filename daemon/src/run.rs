//! `gpufrac run`: runs a command under the shim with a request, a limit and the other
//! settings of the shim (docs/shim.md), validated here with the
//! shim's own reader, `gpufrac_common::config`. A request, a limit or both must be given:
//! a limit alone guarantees nothing and is enforced (memory above the request of 0 is a
//! loan, as any burst); with neither the shim would hold the command to nothing, so it is
//! refused.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpufrac_common::config::Config;
use libloading::os::unix::{RTLD_LAZY, RTLD_LOCAL};

/// Settings for the command, as given on the command line (`gpufrac run` flags).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RunSettings {
    /// Guaranteed GPU memory on each device (512MiB, 4GiB, 0.25, 25%); default: nothing
    /// guaranteed, when --limit is given.
    #[arg(long)]
    pub request: Option<String>,
    /// Burst ceiling, at least the request (default: the request). Alone, without
    /// --request: nothing guaranteed, all of it a loan, this limit enforced.
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
    /// Idle this long (30s, 5m), the group may be parked: its GPU memory moved to host RAM
    /// when the room is wanted, brought back at its next CUDA call.
    #[arg(long)]
    pub park_after: Option<String>,
    /// Guaranteed share of each GPU's time (30%, 0.3); needs --arbiter-socket.
    #[arg(long)]
    pub compute_request: Option<String>,
    /// Most of each GPU's time the group takes, even alone (default 100% with
    /// --compute-request).
    #[arg(long)]
    pub compute_limit: Option<String>,
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
    /// Neither `--request` nor `--limit`: nothing to hold the command to.
    #[error(
        "give --request SIZE (guaranteed GPU memory), --limit SIZE (the most the command may hold; \
         alone, nothing is guaranteed) or both: with neither, the shim would hold the command to nothing"
    )]
    NoSlice,
    /// The shim library is not where it should be.
    #[error(
        "the shim {0} does not exist; build it (cargo build --release --workspace) or name it with --shim"
    )]
    NoShim(PathBuf),
    /// The shim's core is not beside it.
    #[error(
        "the shim's core {0} does not exist: libgpufrac.so loads it from its own folder at the first CUDA call; \
         install the two together (cargo build --release --workspace builds both)"
    )]
    NoCore(PathBuf),
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
        if self.request.is_none() && self.limit.is_none() {
            return Err(RunError::NoSlice);
        }
        let optional = [
            ("GPUFRAC_MEMORY_REQUEST", self.request.clone()),
            ("GPUFRAC_MEMORY_LIMIT", self.limit.clone()),
            ("GPUFRAC_RESOLVER", self.resolver.clone()),
            ("GPUFRAC_PRIORITY", self.priority.map(|p| p.to_string())),
            ("GPUFRAC_GROUP", self.group.clone()),
            ("GPUFRAC_WAIT_TIMEOUT", self.wait_timeout.clone()),
            ("GPUFRAC_PARK_AFTER", self.park_after.clone()),
            ("GPUFRAC_COMPUTE_REQUEST", self.compute_request.clone()),
            ("GPUFRAC_COMPUTE_LIMIT", self.compute_limit.clone()),
            ("GPUFRAC_ARBITER_SOCKET", self.arbiter_socket.as_ref().map(|p| p.display().to_string())),
            ("GPUFRAC_POD", self.pod.clone()),
        ];
        let env: Vec<(&'static str, String)> =
            optional.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect();
        let map: HashMap<&str, String> = env.iter().map(|(k, v)| (*k, v.clone())).collect();
        Config::from_lookup(|name| map.get(name).cloned()).map_err(|e| {
            let (name, value, reason) = e.parts();
            RunError::Setting(format!("invalid {} {value:?}: {}", flag_of(name), with_flag_names(reason)))
        })?;
        Ok(env)
    }

    /// A warning when `--arbiter-socket` names a socket nobody answers on: bursts above the
    /// request would otherwise each wait out their timeout before anyone learns why.
    pub fn arbiter_warning(&self) -> Option<String> {
        let path = self.arbiter_socket.clone()?;
        let (tx, rx) = std::sync::mpsc::channel();
        let probe = path.clone();
        // A connect to a full backlog blocks: ask from a thread and wait a moment only.
        std::thread::spawn(move || {
            let _ = tx.send(std::os::unix::net::UnixStream::connect(&probe).is_ok());
        });
        match rx.recv_timeout(std::time::Duration::from_millis(500)) {
            Ok(true) => None,
            _ => Some(format!(
                "no arbiter answers on {}: bursts above the request will wait for it",
                path.display()
            )),
        }
    }

    /// The shim to preload.
    pub fn shim_path(&self, own_dir: Option<&Path>) -> Result<PathBuf, RunError> {
        let path = match (&self.shim, own_dir) {
            (Some(p), _) => p.clone(),
            (None, Some(dir)) => dir.join("libgpufrac.so"),
            (None, None) => PathBuf::from("libgpufrac.so"),
        };
        let path = std::fs::canonicalize(&path).map_err(|_| RunError::NoShim(path))?;
        let core = path.with_file_name(SHIM_CORE);
        if !core.is_file() {
            return Err(RunError::NoCore(core));
        }
        Ok(path)
    }

    /// The command, ready to run: environment set and the shim first on `LD_PRELOAD`.
    pub fn command(&self, argv: &[OsString], own_dir: Option<&Path>) -> Result<Command, RunError> {
        let (program, args) = argv.split_first().ok_or(RunError::NoCommand)?;
        let env = self.environment()?;
        if let Some(warning) = self.arbiter_warning() {
            eprintln!("gpufrac: warning: {warning}");
        }
        let shim = self.shim_path(own_dir)?;
        let mut preload = OsString::from(shim.as_os_str());
        if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
            preload.push(":");
            preload.push(old);
        }
        let mut cmd = Command::new(program);
        cmd.args(args).env("LD_PRELOAD", preload);
        // The slice is what the flags say: a request or limit inherited from this
        // environment would otherwise change it (a request under `--limit` alone, a limit
        // under `--request` alone) past the validation above.
        for name in SLICE_VARIABLES {
            if !env.iter().any(|(k, _)| *k == name) {
                cmd.env_remove(name);
            }
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        Ok(cmd)
    }
}

/// The variables that size the command's slice, set from `--request` and `--limit` only.
const SLICE_VARIABLES: [&str; 2] = ["GPUFRAC_MEMORY_REQUEST", "GPUFRAC_MEMORY_LIMIT"];

/// The library `libgpufrac.so` loads from its own folder.
const SHIM_CORE: &str = "libgpufrac_core.so";

/// Each `GPUFRAC_*` variable `gpufrac run` sets, with the flag that sets it.
const FLAGS: [(&str, &str); 11] = [
    ("GPUFRAC_MEMORY_REQUEST", "--request"),
    ("GPUFRAC_MEMORY_LIMIT", "--limit"),
    ("GPUFRAC_RESOLVER", "--resolver"),
    ("GPUFRAC_PRIORITY", "--priority"),
    ("GPUFRAC_GROUP", "--group"),
    ("GPUFRAC_WAIT_TIMEOUT", "--wait-timeout"),
    ("GPUFRAC_PARK_AFTER", "--park-after"),
    ("GPUFRAC_COMPUTE_REQUEST", "--compute-request"),
    ("GPUFRAC_COMPUTE_LIMIT", "--compute-limit"),
    ("GPUFRAC_ARBITER_SOCKET", "--arbiter-socket"),
    ("GPUFRAC_POD", "--pod"),
];

/// The flag that sets `variable`.
fn flag_of(variable: &str) -> &str {
    FLAGS.iter().find(|(v, _)| *v == variable).map_or(variable, |(_, flag)| flag)
}

/// `reason` with the variables it mentions named by their flags (no name is a prefix of
/// another).
fn with_flag_names(reason: &str) -> String {
    FLAGS.iter().fold(reason.to_owned(), |text, (variable, flag)| text.replace(variable, flag))
}

/// Replaces this process with the command (returns only on failure). Warns, on one line
/// on stderr, when no CUDA driver can be loaded ([`driver_warning`]).
pub fn exec(settings: &RunSettings, argv: &[OsString], own_dir: Option<&Path>) -> RunError {
    use std::os::unix::process::CommandExt;
    match settings.command(argv, own_dir) {
        Ok(mut cmd) => {
            if let Some(warning) = driver_warning(CUDA_DRIVER) {
                eprintln!("{warning}");
            }
            let err = cmd.exec();
            RunError::Exec { command: argv[0].to_string_lossy().into_owned(), source: err }
        }
        Err(e) => e,
    }
}

/// The name programs (and the CUDA runtime) load the driver by.
pub const CUDA_DRIVER: &str = "libcuda.so.1";

/// The one-line warning `gpufrac run` prints when no CUDA driver can be loaded by `name`
/// from this process (with its `LD_LIBRARY_PATH`, as the command will look for it), or
/// `None` when one loads. The command still runs: it may bring its own driver path.
pub fn driver_warning(name: &str) -> Option<String> {
    let why = match load_library(name) {
        Ok(()) => return None,
        Err(why) => why,
    };
    Some(format!(
        "gpufrac: warning: no CUDA driver can be loaded ({why}); the command's CUDA calls will \
         fail. Without a GPU, put a folder with {name} -> target/release/libsimgpu_cuda.so first \
         on LD_LIBRARY_PATH (README, \"Quick start\")"
    ))
}

/// dlopens and closes `name`: Ok if it loads, else what the dynamic loader said.
fn load_library(name: &str) -> Result<(), String> {
    if name.contains('\0') {
        return Err(format!("{name:?} contains NUL"));
    }
    // SAFETY: loading runs the library's initialisers, as the command will when it loads
    // its driver; nothing from the library is used, and dropping it dlcloses it at once.
    match unsafe { libloading::os::unix::Library::open(Some(name), RTLD_LAZY | RTLD_LOCAL) } {
        Ok(_library) => Ok(()),
        Err(libloading::Error::DlOpenUnknown) => Err(format!("{name}: cannot be loaded")),
        // The dynamic loader's own words (dlerror).
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_validated_as_the_shim_does() {
        let ok =
            RunSettings { request: Some("1GiB".into()), limit: Some("2GiB".into()), ..Default::default() };
        let env = ok.environment().unwrap();
        assert!(env.contains(&("GPUFRAC_MEMORY_LIMIT", "2GiB".into())));
        for bad in [
            RunSettings { request: Some("lots".into()), ..Default::default() },
            RunSettings { request: Some("2GiB".into()), limit: Some("1GiB".into()), ..Default::default() },
            RunSettings {
                request: Some("1GiB".into()),
                resolver: Some("fight".into()),
                ..Default::default()
            },
            RunSettings { request: Some("1GiB".into()), group: Some("a/b".into()), ..Default::default() },
            RunSettings { limit: Some("lots".into()), ..Default::default() },
            RunSettings { limit: Some("1GiB".into()), resolver: Some("fight".into()), ..Default::default() },
        ] {
            assert!(matches!(bad.environment(), Err(RunError::Setting(_))), "{bad:?}");
        }
    }

    #[test]
    fn a_missing_driver_is_warned_about_on_one_line() {
        let warning = driver_warning("libgpufrac-no-such-driver.so.1").expect("a missing library warns");
        assert!(warning.starts_with("gpufrac: warning: no CUDA driver can be loaded"), "{warning}");
        assert!(warning.contains("libgpufrac-no-such-driver.so.1"), "names the library: {warning}");
        assert!(warning.contains("LD_LIBRARY_PATH"), "says what to do: {warning}");
        assert!(!warning.contains('\n'), "one line: {warning}");
        assert!(driver_warning("bad\0name").is_some());
    }

    #[test]
    fn a_shim_without_its_core_beside_it_is_refused_naming_the_core() {
        let dir = std::env::temp_dir().join(format!("gpufrac-run-core-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libgpufrac.so"), b"").unwrap();
        let settings = RunSettings { request: Some("1GiB".into()), ..Default::default() };
        let refused = settings.shim_path(Some(&dir)).expect_err("no core beside the shim");
        std::fs::write(dir.join(SHIM_CORE), b"").unwrap();
        let found = settings.shim_path(Some(&dir));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            matches!(&refused, RunError::NoCore(core) if core.ends_with("libgpufrac_core.so")),
            "{refused}"
        );
        assert!(refused.to_string().contains("install the two together"), "{refused}");
        assert!(found.is_ok_and(|p| p.ends_with("libgpufrac.so")));
    }

    #[test]
    fn a_loadable_driver_is_not_warned_about() {
        // Any library the loader finds stands in for the driver here.
        assert_eq!(driver_warning("libc.so.6"), None);
    }

    fn refusal(settings: RunSettings) -> String {
        settings.environment().expect_err("a bad setting").to_string()
    }

    #[test]
    fn refusals_name_the_flag_typed() {
        let request = |r: &str| RunSettings { request: Some(r.into()), ..Default::default() };
        assert_eq!(
            refusal(request("0")),
            "invalid --request \"0\": expected a size above 0 such as 512MiB, 4GiB, 0.25 (of the device) or 25%"
        );
        assert!(refusal(request("lots")).starts_with("invalid --request \"lots\": expected a size"));
        let limit = refusal(RunSettings { limit: Some("1GiB".into()), ..request("2GiB") });
        assert_eq!(limit, "invalid --limit \"1GiB\": the limit must be at least --request (2GiB)");
        let park = refusal(RunSettings { park_after: Some("soon".into()), ..request("1GiB") });
        assert!(park.starts_with("invalid --park-after \"soon\""), "{park}");
        let socket = Some("/run/gpufrac/arbiter.sock".into());
        let share = refusal(RunSettings {
            compute_request: Some("130%".into()),
            arbiter_socket: socket.clone(),
            ..request("1GiB")
        });
        assert!(share.starts_with("invalid --compute-request \"130%\""), "{share}");
        let alone = refusal(RunSettings { compute_limit: Some("50%".into()), ..request("1GiB") });
        assert!(alone.contains("--compute-limit") && alone.contains("--arbiter-socket"), "{alone}");
        let timeout = refusal(RunSettings { wait_timeout: Some("5parsecs".into()), ..request("1GiB") });
        assert_eq!(
            timeout,
            "invalid --wait-timeout \"5parsecs\": expected a duration such as 30s, 500ms or 2m"
        );
        for (settings, flag) in [
            (RunSettings { resolver: Some("fight".into()), ..request("1GiB") }, "--resolver"),
            (RunSettings { group: Some("a/b".into()), ..request("1GiB") }, "--group"),
            (RunSettings { pod: Some("no-slash".into()), ..request("1GiB") }, "--pod"),
            (RunSettings { arbiter_socket: Some("rel.sock".into()), ..request("1GiB") }, "--arbiter-socket"),
        ] {
            let text = refusal(settings);
            assert!(text.starts_with(&format!("invalid {flag} \"")), "{text}");
            assert!(!text.contains("GPUFRAC_"), "{text}");
        }
    }

    #[test]
    fn a_silent_arbiter_socket_is_warned_of() {
        let dir = std::env::temp_dir().join(format!("gpufrac-run-warning-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary folder");
        let path = dir.join("arbiter.sock");
        let settings = RunSettings {
            request: Some("1GiB".into()),
            arbiter_socket: Some(path.clone()),
            ..Default::default()
        };
        let warning = settings.arbiter_warning().expect("nobody listens");
        assert_eq!(
            warning,
            format!("no arbiter answers on {}: bursts above the request will wait for it", path.display())
        );
        let _listener = std::os::unix::net::UnixListener::bind(&path).expect("binding a test socket");
        assert_eq!(settings.arbiter_warning(), None);
        assert_eq!(
            RunSettings { request: Some("1GiB".into()), ..Default::default() }.arbiter_warning(),
            None
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_limit_alone_is_enough_and_sets_no_request() {
        let settings = RunSettings { limit: Some("2GiB".into()), ..Default::default() };
        let env = settings.environment().expect("--limit alone is accepted");
        assert_eq!(env, vec![("GPUFRAC_MEMORY_LIMIT", "2GiB".to_owned())]);
        let settings = RunSettings {
            limit: Some("25%".into()),
            resolver: Some("swap".into()),
            group: Some("web".into()),
            ..Default::default()
        };
        let env = settings.environment().expect("with other settings too");
        assert!(!env.iter().any(|(k, _)| *k == "GPUFRAC_MEMORY_REQUEST"), "{env:?}");
        assert!(env.contains(&("GPUFRAC_RESOLVER", "swap".into())), "{env:?}");
        // Its bad values are named by the flag, as any other.
        let text = refusal(RunSettings { limit: Some("0".into()), ..Default::default() });
        assert!(text.starts_with("invalid --limit \"0\": expected a size above 0"), "{text}");
    }

    #[test]
    fn neither_request_nor_limit_is_refused_naming_both_flags() {
        for settings in [
            RunSettings::default(),
            RunSettings { resolver: Some("swap".into()), group: Some("g".into()), ..Default::default() },
            RunSettings { arbiter_socket: Some("/run/gpufrac/arbiter.sock".into()), ..Default::default() },
        ] {
            let err = settings.environment().expect_err("nothing to hold the command to");
            assert!(matches!(err, RunError::NoSlice), "{err:?}");
            let text = err.to_string();
            assert!(text.contains("--request") && text.contains("--limit"), "{text}");
            assert!(!text.contains('\n') && !text.contains("GPUFRAC_"), "{text}");
        }
        // Before anything else is looked at (the shim, the arbiter's socket).
        let err = RunSettings::default()
            .command(&["true".into()], Some(Path::new("/nonexistent")))
            .expect_err("refused");
        assert!(matches!(err, RunError::NoSlice), "{err:?}");
    }

    #[test]
    fn the_slice_is_what_the_flags_say_not_what_the_environment_inherited() {
        let dir = std::env::temp_dir().join(format!("gpufrac-run-slice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libgpufrac.so"), b"").unwrap();
        std::fs::write(dir.join(SHIM_CORE), b"").unwrap();
        let envs = |settings: RunSettings| -> Vec<(String, Option<String>)> {
            let cmd = settings.command(&["true".into()], Some(&dir)).expect("a command");
            cmd.get_envs()
                .filter(|(k, _)| k.to_string_lossy().starts_with("GPUFRAC_MEMORY_"))
                .map(|(k, v)| (k.to_string_lossy().into_owned(), v.map(|v| v.to_string_lossy().into_owned())))
                .collect()
        };
        let limit_alone = envs(RunSettings { limit: Some("2GiB".into()), ..Default::default() });
        let request_alone = envs(RunSettings { request: Some("1GiB".into()), ..Default::default() });
        let both = envs(RunSettings {
            request: Some("1GiB".into()),
            limit: Some("2GiB".into()),
            ..Default::default()
        });
        let _ = std::fs::remove_dir_all(&dir);
        // An inherited request would guarantee what --limit alone does not; an inherited
        // limit would let --request alone burst: both are removed from the command's
        // environment (None), the flags' values set.
        assert_eq!(
            limit_alone,
            vec![
                ("GPUFRAC_MEMORY_LIMIT".into(), Some("2GiB".into())),
                ("GPUFRAC_MEMORY_REQUEST".into(), None)
            ]
        );
        assert_eq!(
            request_alone,
            vec![
                ("GPUFRAC_MEMORY_LIMIT".into(), None),
                ("GPUFRAC_MEMORY_REQUEST".into(), Some("1GiB".into()))
            ]
        );
        assert_eq!(
            both,
            vec![
                ("GPUFRAC_MEMORY_LIMIT".into(), Some("2GiB".into())),
                ("GPUFRAC_MEMORY_REQUEST".into(), Some("1GiB".into()))
            ]
        );
    }
}
