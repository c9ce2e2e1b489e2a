//! The pod annotations the webhook reads (`gpufrac.io/*`), parsed and checked into
//! [`Settings`], with the refusal messages a user sees in `kubectl`.
//!
//! Fractions are kept as exact decimals ([`Fraction`]), never as `f64`: `0.07 × 100` must
//! be 7 shares, not 8, and `0.3` must compare equal to `0.30`.

use std::fmt;

use gpufrac_common::compute::{ComputeError, ComputeShare, ComputeSpec};
use serde_json::{Map, Value};

/// The request, as a fraction of one GPU.
pub(crate) const FRACTION: &str = "gpufrac.io/gpu-fraction";
/// The limit (burst ceiling), as a fraction of one GPU.
pub(crate) const FRACTION_LIMIT: &str = "gpufrac.io/gpu-fraction-limit";
/// The resolver: `wait`, `priority` or `swap`.
pub(crate) const RESOLVER: &str = "gpufrac.io/resolver";
/// The container that gets the GPU share.
pub(crate) const CONTAINER: &str = "gpufrac.io/container";
/// Idle this long, the group may be parked (`GPUFRAC_PARK_AFTER`): a duration such as
/// `30s`, `500ms` or `5m`.
pub(crate) const PARK_AFTER: &str = "gpufrac.io/park-after";
/// The guaranteed share of the GPU's time (`GPUFRAC_COMPUTE_REQUEST`): a percentage such
/// as `30%` or a fraction such as `0.3`.
pub(crate) const COMPUTE: &str = "gpufrac.io/compute-fraction";
/// The most of the GPU's time the pod may take (`GPUFRAC_COMPUTE_LIMIT`), in the same
/// syntax.
pub(crate) const COMPUTE_LIMIT: &str = "gpufrac.io/compute-fraction-limit";

/// The fraction on each of N GPUs (tensor parallel; Run:ai's name for it): `N` GPUs'
/// worth of shares are asked, which the device plugin splits evenly over N GPUs.
pub(crate) const NUM_DEVICES: &str = "gpufrac.io/gpu-fraction-num-devices";
/// The most GPUs one pod's container may hold a fraction of.
pub(crate) const MAX_DEVICES: u32 = 16;

/// Shares per whole GPU: a fraction `f` asks for `ceil(f × 100)` shares.
pub(crate) const SHARES_PER_GPU: u32 = 100;

/// What an annotation value must look like, said in every refusal of a fraction.
const FRACTION_EXPECTED: &str = "expected a fraction 0 < f <= 1, such as 0.25";

/// An exact decimal `0 < f <= 1`.
///
/// `whole` is true for exactly 1 (and then `digits` is empty); otherwise the value is
/// `0.<digits>` with no trailing zeros and at least one non-zero digit. The derived order
/// is the numeric order: `whole` first, then the digits lexicographically (`0.2 < 0.25`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Fraction {
    whole: bool,
    digits: Vec<u8>,
}

impl Fraction {
    /// Parses a plain decimal number `0 < f <= 1` (`0.25`, `.5`, `1`, `1.0`), surrounding
    /// whitespace allowed. Signs, exponents, `NaN`, `inf` and percentages are refused.
    pub(crate) fn parse(text: &str) -> Option<Fraction> {
        let text = text.trim();
        let (int, frac) = match text.split_once('.') {
            Some((int, frac)) => (int, frac),
            None => (text, ""),
        };
        if int.is_empty() && frac.is_empty() {
            return None;
        }
        if !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let whole = match int.trim_start_matches('0') {
            "" => false,
            "1" => true,
            _ => return None,
        };
        let digits: Vec<u8> = frac.trim_end_matches('0').bytes().map(|b| b - b'0').collect();
        match (whole, digits.is_empty()) {
            (true, true) => Some(Fraction { whole, digits }),
            (false, false) => Some(Fraction { whole, digits }),
            // 1.x with x > 0 is above one GPU; 0.0 is nothing.
            _ => None,
        }
    }

    /// The fraction of `shares` out of [`SHARES_PER_GPU`]; `None` for 0 or above 100.
    pub(crate) fn from_shares(shares: u32) -> Option<Fraction> {
        match shares {
            0 => None,
            SHARES_PER_GPU => Some(Fraction { whole: true, digits: Vec::new() }),
            s if s < SHARES_PER_GPU => {
                let mut digits = vec![(s / 10) as u8, (s % 10) as u8];
                while digits.last() == Some(&0) {
                    digits.pop();
                }
                Some(Fraction { whole: false, digits })
            }
            _ => None,
        }
    }

    /// `ceil(self × 100)`, exactly: between 1 and 100.
    pub(crate) fn shares(&self) -> u32 {
        if self.whole {
            return SHARES_PER_GPU;
        }
        let digit = |i: usize| u32::from(self.digits.get(i).copied().unwrap_or(0));
        // Trailing zeros are trimmed, so any digit past the hundredths is a non-zero rest.
        let rest = u32::from(self.digits.len() > 2);
        digit(0) * 10 + digit(1) + rest
    }
}

impl fmt::Display for Fraction {
    /// The canonical plain number: `1`, or `0.` and the digits (`0.25`, `0.5`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.whole {
            return f.write_str("1");
        }
        f.write_str("0.")?;
        for d in &self.digits {
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

/// What a workload does when its burst collides with another's (`GPUFRAC_RESOLVER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resolver {
    /// Wait until the memory is free (the default).
    Wait,
    /// The higher `GPUFRAC_PRIORITY` wins.
    Priority,
    /// Swap the other workload's burst out.
    Swap,
}

impl Resolver {
    fn parse(text: &str) -> Option<Resolver> {
        match text.trim() {
            "wait" => Some(Resolver::Wait),
            "priority" => Some(Resolver::Priority),
            "swap" => Some(Resolver::Swap),
            _ => None,
        }
    }

    /// The value of `GPUFRAC_RESOLVER`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Resolver::Wait => "wait",
            Resolver::Priority => "priority",
            Resolver::Swap => "swap",
        }
    }
}

/// A pod's checked `gpufrac.io/*` annotations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Settings {
    /// `gpufrac.io/gpu-fraction`.
    pub(crate) request: Fraction,
    /// `gpufrac.io/gpu-fraction-limit`, when set (then `>= request`).
    pub(crate) limit: Option<Fraction>,
    /// `gpufrac.io/resolver`, `wait` when unset.
    pub(crate) resolver: Resolver,
    /// `gpufrac.io/container`, when set (not yet checked against the pod's containers).
    pub(crate) container: Option<String>,
    /// `gpufrac.io/park-after`, when set: a duration the shim reads (checked with the
    /// shim's own parser), kept as written but for surrounding whitespace.
    pub(crate) park_after: Option<String>,
    /// `gpufrac.io/compute-fraction` and `gpufrac.io/compute-fraction-limit`, checked with
    /// the shim's own parser (and together: limit > 0 and >= request).
    pub(crate) compute: Compute,
    /// `gpufrac.io/gpu-fraction-num-devices`: on how many GPUs the fraction is held (1 to
    /// [`MAX_DEVICES`]), 1 when unset.
    pub(crate) devices: u32,
}

/// A pod's compute annotations, each as the shim's variable will hold it: the share
/// written canonically (`30%`, `12.5%`), `None` when the annotation is absent (then the
/// variable is not set, and the shim's defaults apply: a request alone may burst to the
/// whole GPU, a limit alone guarantees nothing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Compute {
    /// `GPUFRAC_COMPUTE_REQUEST`.
    pub(crate) request: Option<String>,
    /// `GPUFRAC_COMPUTE_LIMIT`.
    pub(crate) limit: Option<String>,
}

impl Compute {
    /// Reads the two annotations' values (either possibly absent); every problem is pushed
    /// on `problems`, naming the annotation and its value.
    fn read(request: Option<&str>, limit: Option<&str>, problems: &mut Vec<String>) -> Compute {
        let problem = |e: ComputeError| format!("{}={}: {}", e.input, shown(&e.value), e.reason);
        let mut each = |key: &str, text: Option<&str>| match text.map(|t| ComputeShare::parse(key, t)) {
            None => Ok(None),
            Some(Ok(share)) => Ok(Some(share.to_string())),
            Some(Err(e)) => {
                problems.push(problem(e));
                Err(())
            }
        };
        let (Ok(request_share), Ok(limit_share)) = (each(COMPUTE, request), each(COMPUTE_LIMIT, limit))
        else {
            return Compute::default();
        };
        // Each is a share; together, the limit must let the group run and cover the request.
        if let Err(e) = ComputeSpec::from_texts((COMPUTE, request), (COMPUTE_LIMIT, limit)) {
            problems.push(problem(e));
            return Compute::default();
        }
        Compute { request: request_share, limit: limit_share }
    }
}

impl Settings {
    /// Reads the annotations of a pod (`metadata.annotations`, absent or an object).
    ///
    /// `Ok(None)`: no `gpufrac.io/gpu-fraction` and none of the other `gpufrac.io/*`
    /// annotations above, so the pod is not ours. `Err`: every problem found, each naming
    /// the annotation and its value, joined with `; `. The companions of the fraction
    /// without the fraction itself are a mistake (a limit or resolver that would silently
    /// do nothing), so they are refused, naming `gpufrac.io/gpu-fraction` as missing.
    pub(crate) fn from_annotations(
        annotations: Option<&Map<String, Value>>,
    ) -> Result<Option<Settings>, String> {
        let empty = Map::new();
        let annotations = annotations.unwrap_or(&empty);
        let mut problems = Vec::new();
        let mut get = |key: &str| -> Option<String> {
            match annotations.get(key)? {
                Value::String(s) => Some(s.clone()),
                other => {
                    problems.push(format!("{key}={}: expected a string", shown_json(other)));
                    None
                }
            }
        };
        let request_text = get(FRACTION);
        let limit_text = get(FRACTION_LIMIT);
        let resolver_text = get(RESOLVER);
        let container = get(CONTAINER);
        let park_after_text = get(PARK_AFTER);
        let compute_text = get(COMPUTE);
        let compute_limit_text = get(COMPUTE_LIMIT);
        let devices_text = get(NUM_DEVICES);

        let Some(request_text) = request_text else {
            let companions: Vec<&str> =
                [FRACTION_LIMIT, RESOLVER, CONTAINER, PARK_AFTER, COMPUTE, COMPUTE_LIMIT, NUM_DEVICES]
                    .into_iter()
                    .filter(|k| annotations.contains_key(*k))
                    .collect();
            if companions.is_empty() && problems.is_empty() {
                return Ok(None);
            }
            if !annotations.contains_key(FRACTION) {
                problems.insert(
                    0,
                    format!(
                        "{FRACTION} is missing: the pod sets {} but no GPU fraction to \
                         request; add {FRACTION} (a fraction 0 < f <= 1, such as 0.25) or \
                         remove {}",
                        companions.join(", "),
                        if companions.len() == 1 { "it" } else { "them" },
                    ),
                );
                if companions.iter().any(|k| [COMPUTE, COMPUTE_LIMIT].contains(k)) {
                    problems.insert(
                        1,
                        format!(
                            "compute shares ({COMPUTE}, {COMPUTE_LIMIT}) are for pods whose GPU \
                             share gpufrac manages: the arbiter enforces them only for the \
                             processes of a pod with {FRACTION}"
                        ),
                    );
                }
            }
            return Err(problems.join("; "));
        };

        let request = Fraction::parse(&request_text);
        if request.is_none() {
            problems.push(fraction_problem(FRACTION, &request_text, FRACTION_EXPECTED));
        }
        let limit = match &limit_text {
            None => None,
            Some(text) => match Fraction::parse(text) {
                None => {
                    problems.push(fraction_problem(
                        FRACTION_LIMIT,
                        text,
                        "expected a fraction 0 < f <= 1 and >= gpufrac.io/gpu-fraction",
                    ));
                    None
                }
                Some(limit) => {
                    if let Some(request) = &request {
                        if limit < *request {
                            problems.push(format!(
                                "{FRACTION_LIMIT}={}: expected a fraction >= {FRACTION} \
                                 ({}) and <= 1",
                                shown(text),
                                cut(&request.to_string()),
                            ));
                        }
                    }
                    Some(limit)
                }
            },
        };
        let resolver = match &resolver_text {
            None => Some(Resolver::Wait),
            Some(text) => {
                let resolver = Resolver::parse(text);
                if resolver.is_none() {
                    problems.push(format!("{RESOLVER}={}: expected wait, priority or swap", shown(text),));
                }
                resolver
            }
        };
        let park_after = match park_after_text {
            None => None,
            Some(text) => match gpufrac_common::parse_duration(PARK_AFTER, &text) {
                Ok(_) => Some(text.trim().to_owned()),
                Err(e) => {
                    problems.push(format!("{PARK_AFTER}={}: {}", shown(&text), e.reason));
                    None
                }
            },
        };
        let compute = Compute::read(compute_text.as_deref(), compute_limit_text.as_deref(), &mut problems);
        let devices = match devices_text {
            None => 1,
            Some(text) => {
                let trimmed = text.trim();
                let plain =
                    !trimmed.is_empty() && trimmed.len() <= 3 && trimmed.bytes().all(|b| b.is_ascii_digit());
                match trimmed.parse::<u32>().ok().filter(|n| plain && (1..=MAX_DEVICES).contains(n)) {
                    Some(n) => n,
                    None => {
                        problems.push(format!(
                            "{NUM_DEVICES}={}: expected a whole number of GPUs from 1 to {MAX_DEVICES}",
                            shown(&text)
                        ));
                        1
                    }
                }
            }
        };
        match (request, resolver) {
            (Some(request), Some(resolver)) if problems.is_empty() => {
                Ok(Some(Settings { request, limit, resolver, container, park_after, compute, devices }))
            }
            _ => Err(problems.join("; ")),
        }
    }
}

/// The refusal of a fraction annotation, with a hint for a percentage.
fn fraction_problem(key: &str, text: &str, expected: &str) -> String {
    let hint = match text.trim().strip_suffix('%') {
        Some(_) => " (a fraction, not a percentage: 0.25 for 25%)",
        None => "",
    };
    format!("{key}={}: {expected}{hint}", shown(text))
}

/// The most characters of a user's value echoed in a message.
const SHOWN_CHARS: usize = 64;

/// An annotation value as shown in a message: quoted as JSON, cut after 64 characters so
/// a huge value does not make a huge message.
pub(crate) fn shown(text: &str) -> String {
    match text.char_indices().nth(SHOWN_CHARS) {
        None => Value::from(text).to_string(),
        Some((cut, _)) => format!("{}…", Value::from(&text[..cut])),
    }
}

/// Any JSON value as shown in a message: its JSON text, cut after 64 characters.
pub(crate) fn shown_json(value: &Value) -> String {
    cut(&value.to_string())
}

/// `text` cut after 64 characters, with `…` when cut.
pub(crate) fn cut(text: &str) -> String {
    match text.char_indices().nth(SHOWN_CHARS) {
        None => text.to_owned(),
        Some((cut, _)) => format!("{}…", &text[..cut]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(text: &str) -> Option<String> {
        Fraction::parse(text).map(|f| f.to_string())
    }

    #[test]
    fn fractions_accepted_are_plain_numbers_in_range() {
        assert_eq!(parse("0.25").as_deref(), Some("0.25"));
        assert_eq!(parse(".5").as_deref(), Some("0.5"));
        assert_eq!(parse("0.50").as_deref(), Some("0.5"));
        assert_eq!(parse("1").as_deref(), Some("1"));
        assert_eq!(parse("1.000").as_deref(), Some("1"));
        assert_eq!(parse("001.").as_deref(), Some("1"));
        assert_eq!(parse(" 0.3 ").as_deref(), Some("0.3"));
        assert_eq!(parse("0.001").as_deref(), Some("0.001"));
    }

    #[test]
    fn fractions_refused() {
        for bad in [
            "", " ", ".", "0", "0.0", "00", "1.5", "1.01", "2", "10", "-0.5", "+0.5", "abc", "25%", "NaN",
            "nan", "inf", "infinity", "1e-1", "0.2.5", "0,25", "0x1", "½",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn shares_round_up_exactly() {
        let shares = |t: &str| Fraction::parse(t).map(|f| f.shares());
        assert_eq!(shares("0.25"), Some(25));
        assert_eq!(shares("0.07"), Some(7)); // 0.07 * 100.0 is 7.000000000000001 in f64
        assert_eq!(shares("0.29"), Some(29));
        assert_eq!(shares("0.333"), Some(34));
        assert_eq!(shares("0.001"), Some(1));
        assert_eq!(shares("0.5"), Some(50));
        assert_eq!(shares("0.991"), Some(100));
        assert_eq!(shares("1"), Some(100));
        assert_eq!(shares("0.2500000000000000000000000001"), Some(26));
    }

    #[test]
    fn from_shares_round_trips() {
        for s in 1..=100 {
            let f = Fraction::from_shares(s).expect("1..=100 is a fraction");
            assert_eq!(f.shares(), s);
            assert_eq!(Fraction::parse(&f.to_string()), Some(f));
        }
        assert_eq!(Fraction::from_shares(0), None);
        assert_eq!(Fraction::from_shares(101), None);
        assert_eq!(Fraction::from_shares(40).map(|f| f.to_string()).as_deref(), Some("0.4"));
    }

    #[test]
    fn order_is_numeric() {
        let f = |t: &str| Fraction::parse(t).expect("valid");
        assert!(f("0.2") < f("0.25"));
        assert!(f("0.25") < f("0.3"));
        assert!(f("0.99999") < f("1"));
        assert_eq!(f("0.30"), f(".3"));
    }

    fn settings(annotations: Value) -> Result<Option<Settings>, String> {
        Settings::from_annotations(annotations.as_object())
    }

    #[test]
    fn annotations_read() {
        assert_eq!(settings(json!({"other": "x"})), Ok(None));
        assert_eq!(Settings::from_annotations(None), Ok(None));
        let s = settings(json!({FRACTION: "0.25", FRACTION_LIMIT: "0.5", RESOLVER: "swap",
                                CONTAINER: "b"}))
        .expect("valid")
        .expect("ours");
        assert_eq!(s.request.to_string(), "0.25");
        assert_eq!(s.limit.map(|l| l.to_string()).as_deref(), Some("0.5"));
        assert_eq!(s.resolver, Resolver::Swap);
        assert_eq!(s.container.as_deref(), Some("b"));
        assert_eq!(s.park_after, None);
        // A limit equal to the request, written differently, is fine.
        assert!(settings(json!({FRACTION: "0.3", FRACTION_LIMIT: "0.30"})).is_ok());
    }

    #[test]
    fn park_after_is_a_duration_kept_as_written() {
        for (text, kept) in [("30s", "30s"), (" 5m ", "5m"), ("500ms", "500ms"), ("1h 30m", "1h 30m")] {
            let s = settings(json!({FRACTION: "0.25", PARK_AFTER: text})).expect("valid").expect("ours");
            assert_eq!(s.park_after.as_deref(), Some(kept), "{text:?}");
        }
        for bad in ["soon", "", "30", "-5s", "5 parsecs"] {
            let err = settings(json!({FRACTION: "0.25", PARK_AFTER: bad})).expect_err(bad);
            assert!(
                err.starts_with(&format!("{PARK_AFTER}={}: expected a duration such as 30s", shown(bad))),
                "{bad:?}: {err}"
            );
        }
        // Alone it would do nothing.
        let err = settings(json!({PARK_AFTER: "30s"})).expect_err("no fraction");
        assert!(err.starts_with("gpufrac.io/gpu-fraction is missing"), "{err}");
        assert!(err.contains(PARK_AFTER), "{err}");
    }

    fn compute(request: Option<&str>, limit: Option<&str>) -> Result<Compute, String> {
        let mut annotations = json!({FRACTION: "0.25"});
        if let Some(request) = request {
            annotations[COMPUTE] = json!(request);
        }
        if let Some(limit) = limit {
            annotations[COMPUTE_LIMIT] = json!(limit);
        }
        settings(annotations).map(|s| s.expect("ours").compute)
    }

    #[test]
    fn compute_shares_are_read_with_the_shims_parser_and_written_as_percentages() {
        let both = |r: Option<&str>, l: Option<&str>| {
            let c = compute(r, l).expect("valid");
            (c.request, c.limit)
        };
        let some = |t: &str| Some(t.to_owned());
        assert_eq!(both(None, None), (None, None));
        assert_eq!(both(Some("30%"), Some("0.8")), (some("30%"), some("80%")));
        assert_eq!(both(Some(" 12.5 % "), None), (some("12.5%"), None));
        assert_eq!(both(None, Some("1")), (None, some("100%")));
        assert_eq!(both(Some("0.5"), Some("50%")), (some("50%"), some("50%")));
    }

    #[test]
    fn bad_compute_shares_are_refused_naming_the_annotation() {
        for (request, limit, expected) in [
            (Some("130%"), None, r#"gpufrac.io/compute-fraction="130%": a share is at most one whole GPU"#),
            (Some("1.5"), None, r#"gpufrac.io/compute-fraction="1.5": a share is at most"#),
            (Some("fast"), None, r#"gpufrac.io/compute-fraction="fast": expected a share of one GPU's time"#),
            (Some("12.34%"), None, r#"gpufrac.io/compute-fraction="12.34%": shares are kept to a tenth"#),
            (None, Some("-5%"), r#"gpufrac.io/compute-fraction-limit="-5%": expected a share"#),
            (None, Some("0%"), r#"gpufrac.io/compute-fraction-limit="0%": a limit of 0% would never"#),
            (
                Some("0%"),
                Some("10%"),
                r#"gpufrac.io/compute-fraction="0%": a compute request must be above 0"#,
            ),
            (
                Some("50%"),
                Some("40%"),
                r#"gpufrac.io/compute-fraction-limit="40%": the limit must be at least gpufrac.io/compute-fraction (50%)"#,
            ),
        ] {
            let err = compute(request, limit).expect_err("refused");
            assert!(err.starts_with(expected), "{request:?} {limit:?}: {err}");
        }
        // Both bad: both named.
        let err = compute(Some("2"), Some("x")).expect_err("refused");
        assert!(err.contains(COMPUTE) && err.contains(&format!("{COMPUTE_LIMIT}=\"x\"")), "{err}");
        // Not a string.
        let err = settings(json!({FRACTION: "0.25", COMPUTE: 0.3})).expect_err("refused");
        assert!(err.starts_with("gpufrac.io/compute-fraction=0.3: expected a string"), "{err}");
        // A huge value is cut.
        let err = compute(Some(&"9".repeat(10_000)), None).expect_err("refused");
        assert!(err.len() < 300, "{err}");
    }

    #[test]
    fn compute_shares_without_a_gpu_fraction_are_refused() {
        for annotations in [json!({COMPUTE: "50%"}), json!({COMPUTE_LIMIT: "50%"}), json!({COMPUTE: "bad"})] {
            let err = settings(annotations.clone()).expect_err("no fraction");
            assert!(err.starts_with("gpufrac.io/gpu-fraction is missing"), "{annotations}: {err}");
            assert!(err.contains("compute shares (gpufrac.io/compute-fraction"), "{annotations}: {err}");
            assert!(err.contains("pods whose GPU share gpufrac manages"), "{annotations}: {err}");
        }
    }

    #[test]
    fn annotations_refused_with_every_problem() {
        let err = settings(json!({FRACTION: "1.5", RESOLVER: "fast"})).expect_err("bad");
        assert!(err.contains(r#"gpufrac.io/gpu-fraction="1.5": expected a fraction 0 < f <= 1"#));
        assert!(err.contains(r#"gpufrac.io/resolver="fast": expected wait, priority or swap"#));
        let err = settings(json!({FRACTION: "25%"})).expect_err("bad");
        assert!(err.contains("not a percentage"), "{err}");
        let err = settings(json!({FRACTION: "0.5", FRACTION_LIMIT: "0.25"})).expect_err("bad");
        assert!(err.contains(r#"gpufrac.io/gpu-fraction-limit="0.25": expected a fraction >= gpufrac.io/gpu-fraction (0.5)"#), "{err}");
        let err = settings(json!({FRACTION_LIMIT: "0.5"})).expect_err("bad");
        assert!(err.starts_with("gpufrac.io/gpu-fraction is missing"), "{err}");
        assert!(err.contains(FRACTION_LIMIT), "{err}");
        let err = settings(json!({FRACTION: 0.5})).expect_err("bad");
        assert!(err.contains("expected a string"), "{err}");
    }

    #[test]
    fn long_values_are_cut_in_messages() {
        let long = "9".repeat(10_000);
        let err = settings(json!({FRACTION: long})).expect_err("bad");
        assert!(err.len() < 200, "{err}");
        let err = settings(json!({FRACTION: {"x": long}})).expect_err("bad");
        assert!(err.len() < 200, "{err}");
        // A valid but absurdly precise request, echoed in another refusal.
        let precise = format!("0.9{}", "9".repeat(10_000));
        let err = settings(json!({FRACTION: precise, FRACTION_LIMIT: "0.5"})).expect_err("bad");
        assert!(err.len() < 300, "{err}");
    }
}
