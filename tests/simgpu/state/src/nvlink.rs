//! The simulated machine's NVLink: which pairs of devices are linked (`SIMGPU_NVLINK`),
//! which NVML's `nvmlDeviceGetP2PStatus` answers from.
//!
//! Each process reads the variable for itself (like `SIMGPU_TIMESLICE`), so processes of
//! one machine should be given the same value; the memory the devices share is not
//! affected, only what NVML reports.

use std::collections::BTreeSet;

/// Why a `SIMGPU_NVLINK` value was refused.
#[derive(Debug, thiserror::Error)]
#[error("simgpu: invalid SIMGPU_NVLINK={value:?}: {reason}; expected comma-separated pairs of device indexes such as 0-1,2-3")]
pub struct NvlinkError {
    /// The value as given.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

/// The NVLinked pairs of devices, each as (smaller index, larger index).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvLinks(BTreeSet<(usize, usize)>);

impl NvLinks {
    /// No NVLink at all.
    pub const fn none() -> NvLinks {
        NvLinks(BTreeSet::new())
    }

    /// Whether devices `a` and `b` are linked (in either order).
    pub fn linked(&self, a: usize, b: usize) -> bool {
        self.0.contains(&(a.min(b), a.max(b)))
    }

    /// The linked pairs, smaller index first.
    pub fn pairs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.0.iter().copied()
    }
}

/// Reads `SIMGPU_NVLINK` for a machine of `devices` devices; unset or empty: no NVLink.
pub fn nvlink_from_env(devices: usize) -> Result<NvLinks, NvlinkError> {
    match std::env::var("SIMGPU_NVLINK") {
        Ok(text) => parse_nvlink(&text, devices),
        Err(std::env::VarError::NotPresent) => Ok(NvLinks::default()),
        Err(std::env::VarError::NotUnicode(value)) => {
            Err(NvlinkError { value: value.to_string_lossy().into_owned(), reason: "not UTF-8".to_owned() })
        }
    }
}

/// Parses a `SIMGPU_NVLINK` value (`0-1,2-3`) for a machine of `devices` devices: each
/// pair names two different devices that exist.
pub fn parse_nvlink(text: &str, devices: usize) -> Result<NvLinks, NvlinkError> {
    let refuse = |reason: String| NvlinkError { value: text.to_owned(), reason };
    let mut links = BTreeSet::new();
    if text.trim().is_empty() {
        return Ok(NvLinks(links));
    }
    for pair in text.split(',') {
        let pair = pair.trim();
        let Some((a, b)) = pair.split_once('-') else {
            return Err(refuse(format!("{pair:?} is not a pair A-B")));
        };
        let index = |part: &str| -> Result<usize, NvlinkError> {
            let part = part.trim();
            let n: usize =
                part.parse().map_err(|_| refuse(format!("{part:?} in {pair:?} is not a device index")))?;
            if n >= devices {
                return Err(refuse(format!(
                    "device {n} in {pair:?} does not exist (the machine has {devices})"
                )));
            }
            Ok(n)
        };
        let (a, b) = (index(a)?, index(b)?);
        if a == b {
            return Err(refuse(format!("{pair:?} links device {a} to itself")));
        }
        links.insert((a.min(b), a.max(b)));
    }
    Ok(NvLinks(links))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_are_read_in_either_order() {
        let links = parse_nvlink("0-1, 3-2", 4).unwrap();
        assert!(links.linked(0, 1) && links.linked(1, 0) && links.linked(2, 3));
        assert!(!links.linked(1, 2) && !links.linked(0, 3));
        assert_eq!(links.pairs().collect::<Vec<_>>(), [(0, 1), (2, 3)]);
        assert_eq!(parse_nvlink("", 2).unwrap(), NvLinks::default());
    }

    #[test]
    fn bad_values_name_the_variable_and_the_fault() {
        for (value, fault) in [
            ("0-2", "device 2 in \"0-2\" does not exist (the machine has 2)"),
            ("1-1", "links device 1 to itself"),
            ("0:1", "\"0:1\" is not a pair A-B"),
            ("0-x", "\"x\" in \"0-x\" is not a device index"),
            ("0-1,", "\"\" is not a pair A-B"),
        ] {
            let e = parse_nvlink(value, 2).unwrap_err().to_string();
            assert!(e.starts_with(&format!("simgpu: invalid SIMGPU_NVLINK={value:?}")), "{e}");
            assert!(e.contains(fault), "{value}: {e}");
        }
    }
}
