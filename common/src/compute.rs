//! Compute shares: a group's guaranteed share of a GPU's time (its compute *request*) and
//! the most it may take while others leave time idle (its compute *limit*), as users
//! write them (`GPUFRAC_COMPUTE_REQUEST`, `GPUFRAC_COMPUTE_LIMIT`, `gpufrac run
//! --compute-request`, the `gpufrac.io/compute-fraction` annotations, the DRA claim's
//! `computeRequest`) and as they travel (per mille of one GPU's time).

use std::fmt;

/// A share of one GPU's time, in per mille (0 to 1000).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ComputeShare(u16);

/// Why a share could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {input}={value:?}: {reason}")]
pub struct ComputeError {
    /// The setting (variable, flag, annotation or field).
    pub input: String,
    /// Its value as given.
    pub value: String,
    /// Why it was refused.
    pub reason: String,
}

const EXPECTED: &str =
    "expected a share of one GPU's time: a percentage such as 30% or 12.5%, or a fraction such as 0.3";

impl ComputeShare {
    /// The whole GPU.
    pub const WHOLE: ComputeShare = ComputeShare(1000);
    /// Nothing.
    pub const ZERO: ComputeShare = ComputeShare(0);

    /// `per_mille` (at most 1000).
    pub fn from_per_mille(per_mille: u16) -> Option<ComputeShare> {
        (per_mille <= 1000).then_some(ComputeShare(per_mille))
    }

    /// The share in per mille.
    pub fn per_mille(self) -> u16 {
        self.0
    }

    /// The share as a fraction of the GPU's time (0.0 to 1.0).
    pub fn fraction(self) -> f64 {
        f64::from(self.0) / 1000.0
    }

    /// Reads `30%`, `12.5%` or `0.3` (`input` names the setting in errors). Shares are
    /// kept to a tenth of a percent; finer ones are refused rather than rounded.
    pub fn parse(input: &str, text: &str) -> Result<ComputeShare, ComputeError> {
        let err = |reason: &str| ComputeError {
            input: input.to_owned(),
            value: text.to_owned(),
            reason: reason.to_owned(),
        };
        let trimmed = text.trim();
        let (number, scale) = match trimmed.strip_suffix('%') {
            Some(n) => (n.trim_end(), 10.0),
            None => (trimmed, 1000.0),
        };
        let ok_chars = !number.is_empty() && number.chars().all(|c| c.is_ascii_digit() || c == '.');
        let value: f64 = match number.parse() {
            Ok(v) if ok_chars => v,
            _ => return Err(err(EXPECTED)),
        };
        let per_mille = value * scale;
        if !(0.0..=1000.0).contains(&per_mille) {
            return Err(err(
                "a share is at most one whole GPU (100% or 1.0); shares of several GPUs are not supported",
            ));
        }
        if (per_mille - per_mille.round()).abs() > 1e-6 {
            return Err(err("shares are kept to a tenth of a percent (0.001 of the GPU)"));
        }
        Ok(ComputeShare(per_mille.round() as u16))
    }
}

impl fmt::Display for ComputeShare {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_multiple_of(10) {
            write!(f, "{}%", self.0 / 10)
        } else {
            write!(f, "{}.{}%", self.0 / 10, self.0 % 10)
        }
    }
}

/// A group's compute request and limit (`request <= limit`, `limit > 0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeSpec {
    /// Guaranteed whenever the group has work.
    pub request: ComputeShare,
    /// Most it takes, even alone on the GPU.
    pub limit: ComputeShare,
}

impl ComputeSpec {
    /// From the two settings as written, either possibly absent; `None` when both are.
    /// A request alone may use idle time up to the whole GPU (limit 100%); a limit alone
    /// guarantees nothing (request 0%). Both must be above 0. `request_name` and `limit_name` name the settings
    /// in errors.
    pub fn from_texts(
        (request_name, request): (&str, Option<&str>),
        (limit_name, limit): (&str, Option<&str>),
    ) -> Result<Option<ComputeSpec>, ComputeError> {
        let request_share = request.map(|t| ComputeShare::parse(request_name, t)).transpose()?;
        let limit_share = limit.map(|t| ComputeShare::parse(limit_name, t)).transpose()?;
        let spec = match (request_share, limit_share) {
            (None, None) => return Ok(None),
            (Some(r), None) => ComputeSpec { request: r, limit: ComputeShare::WHOLE },
            (r, Some(l)) => ComputeSpec { request: r.unwrap_or(ComputeShare::ZERO), limit: l },
        };
        if request_share == Some(ComputeShare::ZERO) {
            return Err(ComputeError {
                input: request_name.to_owned(),
                value: request.unwrap_or_default().to_owned(),
                reason: format!(
                    "a compute request must be above 0 (for a limit with nothing guaranteed, leave it unset and set {limit_name})"
                ),
            });
        }
        let limit_text = limit.unwrap_or_default();
        if spec.limit == ComputeShare::ZERO {
            return Err(ComputeError {
                input: limit_name.to_owned(),
                value: limit_text.to_owned(),
                reason: "a limit of 0% would never let the group run".to_owned(),
            });
        }
        if spec.limit < spec.request {
            return Err(ComputeError {
                input: limit_name.to_owned(),
                value: limit_text.to_owned(),
                reason: format!(
                    "the limit must be at least {request_name} ({})",
                    request.unwrap_or_default().trim()
                ),
            });
        }
        Ok(Some(spec))
    }

    /// As carried on the wire: (request, limit) in per mille; (0, 0) for none.
    pub fn to_wire(spec: Option<ComputeSpec>) -> (u16, u16) {
        spec.map_or((0, 0), |s| (s.request.per_mille(), s.limit.per_mille()))
    }

    /// From the wire: `Ok(None)` for (0, 0); `Err` naming what is wrong otherwise.
    pub fn from_wire(request: u16, limit: u16) -> Result<Option<ComputeSpec>, &'static str> {
        if request == 0 && limit == 0 {
            return Ok(None);
        }
        if limit == 0 || limit > 1000 || request > limit {
            return Err("compute request/limit");
        }
        Ok(Some(ComputeSpec { request: ComputeShare(request), limit: ComputeShare(limit) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(request: Option<&str>, limit: Option<&str>) -> Result<Option<ComputeSpec>, ComputeError> {
        ComputeSpec::from_texts(("REQ", request), ("LIM", limit))
    }

    #[test]
    fn percentages_and_fractions_are_read_to_a_tenth_of_a_percent() {
        assert_eq!(ComputeShare::parse("X", "30%").unwrap().per_mille(), 300);
        assert_eq!(ComputeShare::parse("X", " 12.5 % ").unwrap().per_mille(), 125);
        assert_eq!(ComputeShare::parse("X", "0.3").unwrap().per_mille(), 300);
        assert_eq!(ComputeShare::parse("X", "1").unwrap(), ComputeShare::WHOLE);
        assert_eq!(ComputeShare::parse("X", "100%").unwrap(), ComputeShare::WHOLE);
        assert_eq!(ComputeShare::parse("X", "0%").unwrap(), ComputeShare::ZERO);
        assert_eq!(ComputeShare::parse("X", "12.5%").unwrap().to_string(), "12.5%");
        assert_eq!(ComputeShare::parse("X", "0.7").unwrap().to_string(), "70%");
    }

    #[test]
    fn bad_shares_are_refused_naming_the_setting() {
        for bad in ["", "%", "abc", "-10%", "30 percent", "150%", "1.5", "0.0001", "12.34%", "1e-1", "NaN"] {
            let e = ComputeShare::parse("GPUFRAC_COMPUTE_REQUEST", bad).unwrap_err();
            assert_eq!(e.input, "GPUFRAC_COMPUTE_REQUEST", "{bad}");
            assert!(e.to_string().contains("GPUFRAC_COMPUTE_REQUEST"), "{e}");
        }
    }

    #[test]
    fn a_request_alone_may_burst_to_the_whole_gpu_and_a_limit_alone_guarantees_nothing() {
        assert_eq!(spec(None, None).unwrap(), None);
        let r = spec(Some("30%"), None).unwrap().unwrap();
        assert_eq!((r.request.per_mille(), r.limit), (300, ComputeShare::WHOLE));
        let l = spec(None, Some("40%")).unwrap().unwrap();
        assert_eq!((l.request, l.limit.per_mille()), (ComputeShare::ZERO, 400));
    }

    #[test]
    fn a_limit_below_the_request_or_of_zero_is_refused_naming_the_limit() {
        let e = spec(Some("50%"), Some("40%")).unwrap_err();
        assert_eq!(e.input, "LIM");
        assert!(e.reason.contains("REQ (50%)"), "{e}");
        assert_eq!(spec(None, Some("0%")).unwrap_err().input, "LIM");
        let zero = spec(Some("0"), Some("50%")).unwrap_err();
        assert!(
            zero.input == "REQ" && zero.reason.contains("above 0") && zero.reason.contains("LIM"),
            "{zero}"
        );
    }

    #[test]
    fn the_wire_form_round_trips_and_checks_its_values() {
        let s = spec(Some("30%"), Some("80%")).unwrap();
        let (r, l) = ComputeSpec::to_wire(s);
        assert_eq!(ComputeSpec::from_wire(r, l).unwrap(), s);
        assert_eq!(ComputeSpec::from_wire(0, 0).unwrap(), None);
        assert!(ComputeSpec::from_wire(500, 400).is_err());
        assert!(ComputeSpec::from_wire(0, 1001).is_err());
        assert!(ComputeSpec::from_wire(10, 0).is_err());
    }
}
