//! What a workload does when its burst collides with others (`GPUFRAC_RESOLVER`).

use std::fmt;
use std::str::FromStr;

/// The requester's collision resolver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Resolver {
    /// Wait until memory is freed, then retry.
    #[default]
    Wait,
    /// End idle or lower-priority holders of burst memory.
    Priority,
    /// Move another holder's burst memory to host RAM and back.
    Swap,
}

impl FromStr for Resolver {
    type Err = String;
    fn from_str(s: &str) -> Result<Resolver, String> {
        match s.trim() {
            "wait" => Ok(Resolver::Wait),
            "priority" => Ok(Resolver::Priority),
            "swap" => Ok(Resolver::Swap),
            _ => Err("expected wait, priority or swap".to_owned()),
        }
    }
}

impl fmt::Display for Resolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resolver::Wait => "wait",
            Resolver::Priority => "priority",
            Resolver::Swap => "swap",
        })
    }
}
