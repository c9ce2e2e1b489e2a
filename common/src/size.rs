//! Memory sizes and durations as users write them in environment variables, flags and
//! annotations (see the README, "Sizes").
//!
//! A size is one of:
//! - a number with a unit: binary `KiB MiB GiB TiB` (also `Ki Mi Gi Ti`), decimal
//!   `KB MB GB TB` (also `K M G T`, as Kubernetes reads them) or `B`; units are case-insensitive;
//! - a plain integer above 1: bytes;
//! - a plain number `0 < f <= 1`: a fraction of the device's physical memory;
//! - a percentage `0% < p <= 100%`: the same fraction.

use std::time::Duration;

/// A size as written, before it is applied to a device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizeSpec {
    /// An absolute number of bytes.
    Bytes(u64),
    /// A fraction of the device's physical memory, in `(0, 1]`.
    Fraction(f64),
}

impl SizeSpec {
    /// Bytes this size stands for on a device of `device_total` bytes.
    pub fn resolve(self, device_total: u64) -> u64 {
        match self {
            SizeSpec::Bytes(bytes) => bytes,
            // A fraction is at most 1, so the product never exceeds device_total.
            SizeSpec::Fraction(f) => (device_total as f64 * f).round() as u64,
        }
    }
}

/// A size or duration that could not be read; names the input it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {input}={value:?}: {reason}")]
pub struct SizeError {
    /// The variable, flag or annotation the value came from.
    pub input: String,
    /// The value as given.
    pub value: String,
    /// Why it was refused, with the accepted forms.
    pub reason: String,
}

const SIZE_FORMS: &str = "expected a size such as 512MiB, 4GiB, 0.25 (of the device) or 25%";

const POSITIVE_SIZE_FORMS: &str = "expected a size above 0 such as 512MiB, 4GiB, 0.25 (of the device) or 25%";

const DURATION_FORMS: &str = "expected a duration such as 30s, 500ms or 2m";

fn refuse(input: &str, value: &str, reason: impl Into<String>) -> SizeError {
    SizeError { input: input.to_owned(), value: value.to_owned(), reason: reason.into() }
}

/// Reads a size written by a user; `input` names where it came from, for the error.
pub fn parse_size(input: &str, value: &str) -> Result<SizeSpec, SizeError> {
    let text = value.trim();
    if text.is_empty() {
        return Err(refuse(input, value, format!("empty; {SIZE_FORMS}")));
    }
    if let Some(percent) = text.strip_suffix('%') {
        let p = parse_number(percent.trim()).ok_or_else(|| refuse(input, value, SIZE_FORMS))?;
        if !(p > 0.0 && p <= 100.0) {
            return Err(refuse(input, value, "a percentage must be above 0% and at most 100%"));
        }
        return Ok(SizeSpec::Fraction(p / 100.0));
    }
    let split = text.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(text.len());
    let (number, unit) = (text[..split].trim(), text[split..].trim());
    let n = parse_number(number).ok_or_else(|| refuse(input, value, SIZE_FORMS))?;
    if unit.is_empty() {
        if n > 0.0 && n <= 1.0 {
            return Ok(SizeSpec::Fraction(n));
        }
        if n <= 0.0 {
            return Err(refuse(input, value, POSITIVE_SIZE_FORMS));
        }
        if n.fract() != 0.0 {
            return Err(refuse(
                input,
                value,
                format!("a plain number is a fraction of the device (at most 1) or a whole byte count; {SIZE_FORMS}"),
            ));
        }
        let bytes: u64 = number.parse().map_err(|_| refuse(input, value, "byte count out of range"))?;
        return Ok(SizeSpec::Bytes(bytes));
    }
    let multiplier = unit_multiplier(unit)
        .ok_or_else(|| refuse(input, value, format!("unknown unit {unit:?}; {SIZE_FORMS}")))?;
    let bytes = n * multiplier as f64;
    if bytes < 1.0 {
        return Err(refuse(input, value, POSITIVE_SIZE_FORMS));
    }
    if bytes >= u64::MAX as f64 {
        return Err(refuse(input, value, "size out of range"));
    }
    Ok(SizeSpec::Bytes(bytes.round() as u64))
}

/// Reads an absolute size (fractions and percentages refused), e.g. a simulated device's memory.
pub fn parse_bytes(input: &str, value: &str) -> Result<u64, SizeError> {
    match parse_size(input, value)? {
        SizeSpec::Bytes(bytes) => Ok(bytes),
        SizeSpec::Fraction(_) => Err(refuse(
            input,
            value,
            "an absolute size is needed here (such as 16GiB), not a fraction or percentage",
        )),
    }
}

/// Reads a duration such as `30s`, `500ms`, `5m` or `1h 30m`.
pub fn parse_duration(input: &str, value: &str) -> Result<Duration, SizeError> {
    // humantime's own message ("expected number at 0") speaks of its parser, not of what
    // the user may write.
    humantime::parse_duration(value.trim()).map_err(|_| refuse(input, value, DURATION_FORMS))
}

/// `bytes` as people read it: `20.00 GiB`, `512.00 MiB`, `4.00 KiB` or `100 bytes`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    match UNITS.iter().find(|(_, size)| bytes >= *size) {
        Some((unit, size)) => format!("{:.2} {unit}", bytes as f64 / *size as f64),
        None => format!("{bytes} bytes"),
    }
}

fn parse_number(text: &str) -> Option<f64> {
    // Plain decimal notation only: no signs, exponents, "inf" or "nan".
    let digits_and_point = !text.is_empty()
        && text.chars().all(|c| c.is_ascii_digit() || c == '.')
        && text.chars().filter(|&c| c == '.').count() <= 1
        && text.chars().any(|c| c.is_ascii_digit());
    digits_and_point.then(|| text.parse().ok()).flatten()
}

fn unit_multiplier(unit: &str) -> Option<u64> {
    const KI: u64 = 1 << 10;
    Some(match unit.to_ascii_lowercase().as_str() {
        "b" => 1,
        "kib" | "ki" => KI,
        "mib" | "mi" => KI.pow(2),
        "gib" | "gi" => KI.pow(3),
        "tib" | "ti" => KI.pow(4),
        "kb" | "k" => 1_000,
        "mb" | "m" => 1_000_000,
        "gb" | "g" => 1_000_000_000,
        "tb" | "t" => 1_000_000_000_000,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn units_binary_and_decimal() {
        assert_eq!(parse_size("X", "512MiB").unwrap(), SizeSpec::Bytes(512 << 20));
        assert_eq!(parse_size("X", "4GiB").unwrap(), SizeSpec::Bytes(4 * GIB));
        assert_eq!(parse_size("X", "1.5GiB").unwrap(), SizeSpec::Bytes(3 * GIB / 2));
        assert_eq!(parse_size("X", "4GB").unwrap(), SizeSpec::Bytes(4_000_000_000));
        assert_eq!(parse_size("X", "4096M").unwrap(), SizeSpec::Bytes(4_096_000_000));
        assert_eq!(parse_size("X", "2Gi").unwrap(), SizeSpec::Bytes(2 * GIB));
        assert_eq!(parse_size("X", " 8 gib ").unwrap(), SizeSpec::Bytes(8 * GIB));
        assert_eq!(parse_size("X", "100B").unwrap(), SizeSpec::Bytes(100));
    }

    #[test]
    fn plain_numbers_are_bytes_or_fractions() {
        assert_eq!(parse_size("X", "1048576").unwrap(), SizeSpec::Bytes(1 << 20));
        assert_eq!(parse_size("X", "2").unwrap(), SizeSpec::Bytes(2));
        assert_eq!(parse_size("X", "1").unwrap(), SizeSpec::Fraction(1.0));
        assert_eq!(parse_size("X", "0.25").unwrap(), SizeSpec::Fraction(0.25));
        assert_eq!(parse_size("X", "25%").unwrap(), SizeSpec::Fraction(0.25));
        assert_eq!(parse_size("X", "100%").unwrap(), SizeSpec::Fraction(1.0));
        assert_eq!(SizeSpec::Fraction(0.25).resolve(16 * GIB), 4 * GIB);
        assert_eq!(SizeSpec::Bytes(7).resolve(16 * GIB), 7);
    }

    #[test]
    fn bad_values_are_refused_naming_the_input() {
        for bad in
            ["", "0", "0%", "101%", "-1GiB", "1.5", "abc", "4XB", "1e9", "inf", "NaN", "0.0", "5.5.5G", "%"]
        {
            let err = parse_size("GPUFRAC_MEMORY_LIMIT", bad).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("GPUFRAC_MEMORY_LIMIT"), "{text}");
            assert!(text.contains(&format!("{bad:?}")), "{text}");
        }
    }

    #[test]
    fn absolute_sizes_refuse_fractions() {
        assert_eq!(parse_bytes("SIMGPU_DEVICES", "16GiB").unwrap(), 16 * GIB);
        let err = parse_bytes("SIMGPU_DEVICES", "0.5").unwrap_err();
        assert!(err.to_string().contains("SIMGPU_DEVICES"));
    }

    #[test]
    fn refusals_say_what_is_accepted() {
        assert_eq!(
            parse_size("--request", "0").unwrap_err().to_string(),
            "invalid --request=\"0\": expected a size above 0 such as 512MiB, 4GiB, 0.25 (of the device) or 25%"
        );
        assert!(parse_size("X", "0GiB").unwrap_err().reason.starts_with("expected a size above 0"));
        let lots = parse_size("X", "lots").unwrap_err().reason;
        assert_eq!(lots, "expected a size such as 512MiB, 4GiB, 0.25 (of the device) or 25%");
        let fraction = parse_size("X", "1.5").unwrap_err().reason;
        assert!(
            fraction.contains("fraction of the device") && fraction.contains("whole byte count"),
            "{fraction}"
        );
        assert_eq!(
            parse_duration("GPUFRAC_WAIT_TIMEOUT", "5parsecs").unwrap_err().to_string(),
            "invalid GPUFRAC_WAIT_TIMEOUT=\"5parsecs\": expected a duration such as 30s, 500ms or 2m"
        );
    }

    #[test]
    fn sizes_are_formatted_for_people() {
        assert_eq!(format_size(20 * GIB), "20.00 GiB");
        assert_eq!(format_size(3 * GIB / 2), "1.50 GiB");
        assert_eq!(format_size(512 << 20), "512.00 MiB");
        assert_eq!(format_size(4096), "4.00 KiB");
        assert_eq!(format_size(100), "100 bytes");
        assert_eq!(format_size(2 << 40), "2.00 TiB");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("T", "30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("T", "500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("T", "5m").unwrap(), Duration::from_secs(300));
        assert!(parse_duration("GPUFRAC_WAIT_TIMEOUT", "soon")
            .unwrap_err()
            .to_string()
            .contains("GPUFRAC_WAIT_TIMEOUT"));
    }
}
