//! The shim's configuration, the `GPUFRAC_*` variables (docs/shim.md, docs/interface.md):
//! read once from the environment by the shim at the first CUDA or
//! NVML call, and checked by `gpufrac run` before it starts a command. A bad value is
//! refused with a message naming the variable; the shim's `cuInit` then fails with
//! `CUDA_ERROR_NOT_INITIALIZED`.
//!
//! **A limit is always a limit.** What switches the shim on is a request or a limit:
//!
//! | `GPUFRAC_MEMORY_REQUEST` | `GPUFRAC_MEMORY_LIMIT` | the shim |
//! | --- | --- | --- |
//! | set | set | guarantees the request, enforces the limit |
//! | set | unset | guarantees the request, which is also the limit |
//! | unset | set | guarantees nothing (request 0 bytes), enforces the limit: everything the group holds is a loan, granted by the arbiter when one is configured (like any burst), else taken while the device has it free |
//! | unset | unset | passes every call through, whatever other `GPUFRAC_*` variables say (but a compute share alone is refused: see below) |
//!
//! `GPUFRAC_COMPUTE_REQUEST` and `GPUFRAC_COMPUTE_LIMIT` (shares of a GPU's time, see
//! [`crate::compute`]) add compute control to a managed group; set without a memory
//! request or limit they are refused rather than ignored.
//!
//! The other variables (`GPUFRAC_RESOLVER`, `GPUFRAC_PRIORITY`, `GPUFRAC_WAIT_TIMEOUT`,
//! `GPUFRAC_GROUP`, `GPUFRAC_ARBITER_SOCKET`, `GPUFRAC_POD`, `GPUFRAC_LOG`) only say how
//! a request and a limit are kept; alone they ask for no slice, so the shim passes
//! through and does not even read them (a bad value among them is then not reported).
//! That is not a silent loss: there is no amount to hold the process to, and with an
//! arbiter a process that registers nothing has its memory counted as used outside
//! gpufrac (never lent, and the guarantees are kept despite it).

use std::path::PathBuf;
use std::time::Duration;

use crate::{parse_duration, parse_size, ComputeSpec, Resolver, SizeError, SizeSpec};

const COMPUTE_REQUEST: &str = "GPUFRAC_COMPUTE_REQUEST";
const COMPUTE_LIMIT: &str = "GPUFRAC_COMPUTE_LIMIT";

/// `GPUFRAC_GIVE_BACK_IDLE` when unset: long enough that a server between requests keeps
/// its pools warm, short enough that a neighbour's burst finds idle pooled memory free
/// well within a wait (`GPUFRAC_WAIT_TIMEOUT`, 30 s by default).
pub const DEFAULT_GIVE_BACK_IDLE: Duration = Duration::from_secs(10);

/// The static name of a compute variable (errors carry `&'static str`).
fn compute_name(input: &str) -> &'static str {
    if input == COMPUTE_LIMIT {
        COMPUTE_LIMIT
    } else {
        COMPUTE_REQUEST
    }
}

/// Why the environment could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A size or duration could not be read.
    #[error(transparent)]
    Value(#[from] SizeError),
    /// Any other bad value.
    #[error("invalid {name}={value:?}: {reason}")]
    Invalid {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// Why it was refused.
        reason: String,
    },
}

/// What the environment asks of the shim.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Guaranteed memory of the group on each visible device; `Bytes(0)` when only a
    /// limit was given (nothing guaranteed).
    pub request: SizeSpec,
    /// Most the group may hold on each device, at least the request.
    pub limit: SizeSpec,
    /// What a colliding burst does.
    pub resolver: Resolver,
    /// Higher wins under the priority resolver.
    pub priority: i32,
    /// How long a blocked burst waits (and a parked group's wake, at most).
    pub wait_timeout: Duration,
    /// Idle this long, the group may be parked (its device memory moved to host RAM);
    /// `None`: never parked.
    pub park_after: Option<Duration>,
    /// Idle this long (no launches, copies or sets) while the group holds memory above its
    /// request, the process gives back what its frameworks keep and do not use
    /// (`GPUFRAC_GIVE_BACK_IDLE`); `None`: only when the arbiter asks.
    pub give_back_idle: Option<Duration>,
    /// Where the request is reserved (`GPUFRAC_RESERVE`): on every visible device at
    /// `cuInit`, or on each device at the process's first context there.
    pub reserve: Reserve,
    /// The group's share of each GPU's time (`GPUFRAC_COMPUTE_REQUEST`,
    /// `GPUFRAC_COMPUTE_LIMIT`); `None`: no compute control, the GPU's own time-slicing.
    pub compute: Option<ComputeSpec>,
    /// Processes of one group share one request and limit; `None`: this process alone.
    pub group: Option<String>,
    /// The arbiter's socket; `None`: standalone.
    pub arbiter_socket: Option<PathBuf>,
    /// `namespace/name`, shown in status and metrics.
    pub pod: Option<String>,
    /// Log filter, `RUST_LOG` syntax.
    pub log: String,
}

/// Where a process's request is reserved (`GPUFRAC_RESERVE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reserve {
    /// On every device the process sees, at `cuInit` (`visible`, the default).
    #[default]
    Visible,
    /// On a device at the process's first context there (`first-use`): a device it never
    /// uses reserves nothing, as a tensor-parallel worker that sees every GPU and uses one.
    FirstUse,
}

impl ConfigError {
    /// The variable, its value as given and why it was refused: for callers that name the
    /// setting another way (`gpufrac run` names its flags).
    pub fn parts(&self) -> (&str, &str, &str) {
        match self {
            ConfigError::Value(e) => (&e.input, &e.value, &e.reason),
            ConfigError::Invalid { name, value, reason } => (name, value, reason),
        }
    }
}

fn invalid(name: &'static str, value: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { name, value: value.to_owned(), reason: reason.into() }
}

impl Config {
    /// Reads the process environment. `Ok(None)`: neither `GPUFRAC_MEMORY_REQUEST` nor
    /// `GPUFRAC_MEMORY_LIMIT` is set and the shim passes every call through untouched.
    pub fn from_env() -> Result<Option<Config>, ConfigError> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the configuration through `get` (the environment, or a map in tests).
    ///
    /// A request alone is also the limit; a limit alone guarantees nothing (the request is
    /// `SizeSpec::Bytes(0)`) and is enforced, everything above the request being a loan
    /// like any burst; neither is `Ok(None)`, pass-through (see the module's table).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Config>, ConfigError> {
        let (request_text, limit_text) = (get("GPUFRAC_MEMORY_REQUEST"), get("GPUFRAC_MEMORY_LIMIT"));
        let compute = ComputeSpec::from_texts(
            (COMPUTE_REQUEST, get(COMPUTE_REQUEST).as_deref()),
            (COMPUTE_LIMIT, get(COMPUTE_LIMIT).as_deref()),
        )
        .map_err(|e| ConfigError::Invalid {
            name: compute_name(&e.input),
            value: e.value,
            reason: e.reason,
        })?;
        let (request, limit) = match (request_text, limit_text) {
            (None, None) if compute.is_some() => {
                let name = if get(COMPUTE_REQUEST).is_some() { COMPUTE_REQUEST } else { COMPUTE_LIMIT };
                return Err(invalid(
                    name,
                    &get(name).unwrap_or_default(),
                    "compute shares are kept for groups gpufrac manages: set GPUFRAC_MEMORY_REQUEST or GPUFRAC_MEMORY_LIMIT too",
                ));
            }
            (None, None) => return Ok(None),
            // Nothing guaranteed, the limit enforced: a limit is always a limit.
            (None, Some(text)) => (SizeSpec::Bytes(0), parse_size("GPUFRAC_MEMORY_LIMIT", &text)?),
            (Some(request_text), limit_text) => {
                let request = parse_size("GPUFRAC_MEMORY_REQUEST", &request_text)?;
                (request, Self::limit_of(request, &request_text, limit_text)?)
            }
        };
        let resolver = match get("GPUFRAC_RESOLVER") {
            Some(text) => text.parse().map_err(|reason| invalid("GPUFRAC_RESOLVER", &text, reason))?,
            None => Resolver::Wait,
        };
        let priority = match get("GPUFRAC_PRIORITY") {
            Some(text) => text
                .trim()
                .parse()
                .map_err(|_| invalid("GPUFRAC_PRIORITY", &text, "expected an integer such as 0, 10 or -5"))?,
            None => 0,
        };
        let wait_timeout = match get("GPUFRAC_WAIT_TIMEOUT") {
            Some(text) => parse_duration("GPUFRAC_WAIT_TIMEOUT", &text)?,
            None => Duration::from_secs(30),
        };
        let park_after = match get("GPUFRAC_PARK_AFTER") {
            Some(text) => Some(parse_duration("GPUFRAC_PARK_AFTER", &text)?),
            None => None,
        };
        let give_back_idle = match get("GPUFRAC_GIVE_BACK_IDLE") {
            Some(text) if matches!(text.trim(), "0" | "off") => None,
            Some(text) => match parse_duration("GPUFRAC_GIVE_BACK_IDLE", &text)? {
                zero if zero.is_zero() => None,
                idle => Some(idle),
            },
            None => Some(DEFAULT_GIVE_BACK_IDLE),
        };
        let reserve = match get("GPUFRAC_RESERVE") {
            Some(text) => match text.trim() {
                "visible" => Reserve::Visible,
                "first-use" => Reserve::FirstUse,
                _ => return Err(invalid("GPUFRAC_RESERVE", &text, "expected visible or first-use")),
            },
            None => Reserve::Visible,
        };
        let group = match get("GPUFRAC_GROUP") {
            Some(text) => {
                let ok = !text.is_empty()
                    && text.len() <= 64
                    && text.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                    && !text.starts_with('.');
                if !ok {
                    return Err(invalid(
                        "GPUFRAC_GROUP",
                        &text,
                        "expected 1 to 64 letters, digits, '-', '_' or '.', not starting with '.'",
                    ));
                }
                Some(text)
            }
            None => None,
        };
        let arbiter_socket = match get("GPUFRAC_ARBITER_SOCKET") {
            Some(text) if text.is_empty() => None,
            Some(text) => {
                if !text.starts_with('/') {
                    return Err(invalid("GPUFRAC_ARBITER_SOCKET", &text, "expected an absolute path"));
                }
                Some(PathBuf::from(text))
            }
            None => None,
        };
        if let (Some(_), None) = (compute, &arbiter_socket) {
            // Shares of a GPU's time are kept between groups by the arbiter, which measures
            // them: alone, a process has nobody to share with and nothing to measure by.
            let name = if get(COMPUTE_REQUEST).is_some() { COMPUTE_REQUEST } else { COMPUTE_LIMIT };
            return Err(invalid(
                name,
                &get(name).unwrap_or_default(),
                "compute shares are kept by gpufrac-arbiter: set GPUFRAC_ARBITER_SOCKET",
            ));
        }
        let pod = match get("GPUFRAC_POD") {
            Some(text) => {
                let valid = text.split_once('/').is_some_and(|(ns, name)| {
                    let part = |p: &str| {
                        !p.is_empty()
                            && p.len() <= 253
                            && p.chars().all(|c| {
                                c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.')
                            })
                    };
                    part(ns) && part(name)
                });
                if !valid {
                    return Err(invalid(
                        "GPUFRAC_POD",
                        &text,
                        "expected namespace/name, as in default/my-server",
                    ));
                }
                Some(text)
            }
            None => None,
        };
        let log = get("GPUFRAC_LOG").unwrap_or_else(|| "warn".to_owned());
        if let Err(e) = log.parse::<tracing_subscriber::filter::Targets>() {
            return Err(invalid(
                "GPUFRAC_LOG",
                &log,
                format!("{e}; expected a filter such as warn or gpufrac=debug"),
            ));
        }
        Ok(Some(Config {
            request,
            limit,
            resolver,
            priority,
            wait_timeout,
            park_after,
            give_back_idle,
            reserve,
            compute,
            group,
            arbiter_socket,
            pod,
            log,
        }))
    }

    /// The limit that goes with `request` (written `request_text`): `limit_text` read, at
    /// least the request, or the request itself when unset.
    fn limit_of(
        request: SizeSpec,
        request_text: &str,
        limit_text: Option<String>,
    ) -> Result<SizeSpec, ConfigError> {
        let Some(text) = limit_text else { return Ok(request) };
        let limit = parse_size("GPUFRAC_MEMORY_LIMIT", &text)?;
        // Comparable without a device when both are bytes or both fractions; otherwise
        // the check happens per device at cuInit.
        let smaller = match (request, limit) {
            (SizeSpec::Bytes(r), SizeSpec::Bytes(l)) => l < r,
            (SizeSpec::Fraction(r), SizeSpec::Fraction(l)) => l < r,
            _ => false,
        };
        if smaller {
            return Err(invalid(
                "GPUFRAC_MEMORY_LIMIT",
                &text,
                format!("the limit must be at least GPUFRAC_MEMORY_REQUEST ({request_text})"),
            ));
        }
        Ok(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<Option<Config>, ConfigError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn neither_request_nor_limit_means_pass_through() {
        assert_eq!(read(&[]).unwrap(), None);
        // The other variables only say how a request and a limit are kept: alone they ask
        // for nothing, and are not even read (a bad value among them is not reported).
        let others = [
            ("GPUFRAC_RESOLVER", "swap"),
            ("GPUFRAC_PRIORITY", "7"),
            ("GPUFRAC_WAIT_TIMEOUT", "5s"),
            ("GPUFRAC_GROUP", "g"),
            ("GPUFRAC_ARBITER_SOCKET", "/run/gpufrac/arbiter.sock"),
            ("GPUFRAC_POD", "default/p"),
            ("GPUFRAC_LOG", "debug"),
        ];
        for var in others {
            assert_eq!(read(&[var]).unwrap(), None, "{var:?} alone");
        }
        assert_eq!(read(&others).unwrap(), None, "all of them, without a request or a limit");
        assert_eq!(read(&[("GPUFRAC_RESOLVER", "fight")]).unwrap(), None);
    }

    #[test]
    fn a_limit_alone_guarantees_nothing_and_is_enforced() {
        let c = read(&[("GPUFRAC_MEMORY_LIMIT", "2GiB")]).unwrap().expect("a limit alone enforces");
        assert_eq!((c.request, c.limit), (SizeSpec::Bytes(0), SizeSpec::Bytes(2 << 30)));
        assert_eq!((c.request.resolve(8 << 30), c.limit.resolve(8 << 30)), (0, 2 << 30));
        assert_eq!((c.resolver, c.priority, c.wait_timeout), (Resolver::Wait, 0, Duration::from_secs(30)));
        // A fraction or a percentage too; request 0 is below any limit.
        let c = read(&[("GPUFRAC_MEMORY_LIMIT", "25%")]).unwrap().unwrap();
        assert_eq!((c.request, c.limit), (SizeSpec::Bytes(0), SizeSpec::Fraction(0.25)));
        let c = read(&[("GPUFRAC_MEMORY_LIMIT", "0.5")]).unwrap().unwrap();
        assert_eq!(c.limit.resolve(8 << 30), 4 << 30);
        // The other settings apply to it as to any slice.
        let c = read(&[
            ("GPUFRAC_MEMORY_LIMIT", "1GiB"),
            ("GPUFRAC_RESOLVER", "priority"),
            ("GPUFRAC_GROUP", "web"),
            ("GPUFRAC_ARBITER_SOCKET", "/run/gpufrac/arbiter.sock"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (c.request, c.limit, c.resolver),
            (SizeSpec::Bytes(0), SizeSpec::Bytes(1 << 30), Resolver::Priority)
        );
        assert_eq!(c.group.as_deref(), Some("web"));
        assert_eq!(c.arbiter_socket, Some(PathBuf::from("/run/gpufrac/arbiter.sock")));
        // And so are their bad values, now that there is a slice to keep.
        let err = read(&[("GPUFRAC_MEMORY_LIMIT", "1GiB"), ("GPUFRAC_RESOLVER", "fight")]).unwrap_err();
        assert_eq!(err.parts().0, "GPUFRAC_RESOLVER");
    }

    #[test]
    fn a_bad_limit_alone_is_refused_naming_it() {
        for bad in ["lots", "0", "0%", "-1GiB", ""] {
            let err = read(&[("GPUFRAC_MEMORY_LIMIT", bad)]).expect_err(bad);
            assert_eq!((err.parts().0, err.parts().1), ("GPUFRAC_MEMORY_LIMIT", bad), "{err}");
        }
    }

    #[test]
    fn a_request_alone_is_also_the_limit_and_a_limit_below_it_is_refused() {
        let c = read(&[("GPUFRAC_MEMORY_REQUEST", "1GiB")]).unwrap().unwrap();
        assert_eq!((c.request, c.limit), (SizeSpec::Bytes(1 << 30), SizeSpec::Bytes(1 << 30)));
        let err = read(&[("GPUFRAC_MEMORY_REQUEST", "2GiB"), ("GPUFRAC_MEMORY_LIMIT", "1GiB")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid GPUFRAC_MEMORY_LIMIT=\"1GiB\": the limit must be at least GPUFRAC_MEMORY_REQUEST (2GiB)"
        );
        let err = read(&[("GPUFRAC_MEMORY_REQUEST", "50%"), ("GPUFRAC_MEMORY_LIMIT", "0.25")]).unwrap_err();
        assert_eq!(err.parts().0, "GPUFRAC_MEMORY_LIMIT");
        // Bytes against a fraction: checked per device at cuInit.
        assert!(read(&[("GPUFRAC_MEMORY_REQUEST", "2GiB"), ("GPUFRAC_MEMORY_LIMIT", "0.1")])
            .unwrap()
            .is_some());
    }

    #[test]
    fn defaults_and_full_settings() {
        let c = read(&[("GPUFRAC_MEMORY_REQUEST", "25%")]).unwrap().unwrap();
        assert_eq!((c.request, c.limit), (SizeSpec::Fraction(0.25), SizeSpec::Fraction(0.25)));
        assert_eq!((c.resolver, c.priority, c.wait_timeout), (Resolver::Wait, 0, Duration::from_secs(30)));
        let c = read(&[
            ("GPUFRAC_MEMORY_REQUEST", "2GiB"),
            ("GPUFRAC_MEMORY_LIMIT", "0.5"),
            ("GPUFRAC_RESOLVER", "swap"),
            ("GPUFRAC_PRIORITY", "-3"),
            ("GPUFRAC_WAIT_TIMEOUT", "500ms"),
            ("GPUFRAC_GROUP", "pod-a.web_1"),
            ("GPUFRAC_ARBITER_SOCKET", "/run/gpufrac/arbiter.sock"),
            ("GPUFRAC_POD", "default/server-0"),
            ("GPUFRAC_LOG", "gpufrac=debug"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.limit, SizeSpec::Fraction(0.5));
        assert_eq!((c.resolver, c.priority), (Resolver::Swap, -3));
        assert_eq!(c.wait_timeout, Duration::from_millis(500));
        assert_eq!(c.group.as_deref(), Some("pod-a.web_1"));
    }

    #[test]
    fn bad_durations_say_what_is_accepted() {
        let err =
            read(&[("GPUFRAC_MEMORY_REQUEST", "1GiB"), ("GPUFRAC_WAIT_TIMEOUT", "5parsecs")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid GPUFRAC_WAIT_TIMEOUT=\"5parsecs\": expected a duration such as 30s, 500ms or 2m"
        );
    }

    #[test]
    fn compute_shares_are_read_and_refused_alone_or_bad_naming_the_variable() {
        const SOCKET: (&str, &str) = ("GPUFRAC_ARBITER_SOCKET", "/run/gpufrac/arbiter.sock");
        let c = read(&[("GPUFRAC_MEMORY_LIMIT", "1GiB"), ("GPUFRAC_COMPUTE_REQUEST", "30%"), SOCKET])
            .unwrap()
            .unwrap();
        let spec = c.compute.unwrap();
        assert_eq!((spec.request.per_mille(), spec.limit.per_mille()), (300, 1000));
        assert_eq!(read(&[("GPUFRAC_MEMORY_LIMIT", "1GiB")]).unwrap().unwrap().compute, None);
        let alone = read(&[("GPUFRAC_COMPUTE_LIMIT", "50%")]).unwrap_err().to_string();
        assert!(
            alone.contains("GPUFRAC_COMPUTE_LIMIT") && alone.contains("GPUFRAC_MEMORY_REQUEST"),
            "{alone}"
        );
        let bad = read(&[("GPUFRAC_MEMORY_LIMIT", "1GiB"), ("GPUFRAC_COMPUTE_LIMIT", "120%")]).unwrap_err();
        assert!(bad.to_string().contains("GPUFRAC_COMPUTE_LIMIT=\"120%\""), "{bad}");
        let below = read(&[
            ("GPUFRAC_MEMORY_LIMIT", "1GiB"),
            ("GPUFRAC_COMPUTE_REQUEST", "60%"),
            ("GPUFRAC_COMPUTE_LIMIT", "0.5"),
        ])
        .unwrap_err();
        assert!(below.to_string().contains("GPUFRAC_COMPUTE_LIMIT"), "{below}");
        let standalone = read(&[("GPUFRAC_MEMORY_LIMIT", "1GiB"), ("GPUFRAC_COMPUTE_REQUEST", "30%")])
            .unwrap_err()
            .to_string();
        assert!(
            standalone.contains("GPUFRAC_COMPUTE_REQUEST") && standalone.contains("GPUFRAC_ARBITER_SOCKET"),
            "{standalone}"
        );
    }

    #[test]
    fn park_after_is_a_duration_and_unset_means_never_parked() {
        let c = read(&[("GPUFRAC_MEMORY_REQUEST", "1GiB")]).unwrap().unwrap();
        assert_eq!(c.park_after, None);
        let c = read(&[("GPUFRAC_MEMORY_REQUEST", "1GiB"), ("GPUFRAC_PARK_AFTER", "5m")]).unwrap().unwrap();
        assert_eq!(c.park_after, Some(Duration::from_secs(300)));
        let err = read(&[("GPUFRAC_MEMORY_REQUEST", "1GiB"), ("GPUFRAC_PARK_AFTER", "idle")]).unwrap_err();
        assert!(err.to_string().starts_with("invalid GPUFRAC_PARK_AFTER=\"idle\""), "{err}");
    }

    #[test]
    fn the_request_is_reserved_on_every_visible_device_unless_first_use_is_asked() {
        let with = |value: Option<&str>| {
            let mut vars = vec![("GPUFRAC_MEMORY_REQUEST", "1GiB")];
            vars.extend(value.map(|v| ("GPUFRAC_RESERVE", v)));
            read(&vars)
        };
        assert_eq!(with(None).unwrap().unwrap().reserve, Reserve::Visible);
        assert_eq!(with(Some("visible")).unwrap().unwrap().reserve, Reserve::Visible);
        assert_eq!(with(Some("first-use")).unwrap().unwrap().reserve, Reserve::FirstUse);
        let err = with(Some("lazy")).unwrap_err().to_string();
        assert!(
            err.contains("GPUFRAC_RESERVE") && err.contains("lazy") && err.contains("first-use"),
            "{err}"
        );
    }

    #[test]
    fn give_back_idle_defaults_to_ten_seconds_and_0_or_off_disables_it() {
        let with =
            |value: &str| read(&[("GPUFRAC_MEMORY_REQUEST", "1GiB"), ("GPUFRAC_GIVE_BACK_IDLE", value)]);
        let c = read(&[("GPUFRAC_MEMORY_REQUEST", "1GiB")]).unwrap().unwrap();
        assert_eq!(c.give_back_idle, Some(DEFAULT_GIVE_BACK_IDLE));
        assert_eq!(with("2s").unwrap().unwrap().give_back_idle, Some(Duration::from_secs(2)));
        assert_eq!(with("500ms").unwrap().unwrap().give_back_idle, Some(Duration::from_millis(500)));
        for off in ["0", "off", "0s"] {
            assert_eq!(with(off).unwrap().unwrap().give_back_idle, None, "{off}");
        }
        let err = with("soon").unwrap_err();
        assert!(err.to_string().starts_with("invalid GPUFRAC_GIVE_BACK_IDLE=\"soon\""), "{err}");
    }

    #[test]
    fn every_bad_value_names_its_variable() {
        let cases = [
            ("GPUFRAC_MEMORY_REQUEST", "lots"),
            ("GPUFRAC_MEMORY_LIMIT", "1MiB"),
            ("GPUFRAC_RESOLVER", "fight"),
            ("GPUFRAC_PRIORITY", "high"),
            ("GPUFRAC_WAIT_TIMEOUT", "forever"),
            ("GPUFRAC_GROUP", "a/b"),
            ("GPUFRAC_ARBITER_SOCKET", "relative.sock"),
            ("GPUFRAC_POD", "no-slash"),
            ("GPUFRAC_LOG", "gpufrac=loud"),
        ];
        for (name, value) in cases {
            let mut vars = vec![("GPUFRAC_MEMORY_REQUEST", "1GiB")];
            if name == "GPUFRAC_MEMORY_REQUEST" {
                vars.clear();
            }
            vars.push((name, value));
            let err = read(&vars).expect_err(name);
            assert_eq!(err.parts().0, name);
            assert_eq!(err.parts().1, value);
            let err = err.to_string();
            assert!(err.contains(name) && err.contains(value), "{err}");
        }
    }
}
