//! Kubernetes quantities (`resource.Quantity`) read with the API server's own semantics,
//! for every capacity a claim or slice carries: `k8s-openapi` keeps a quantity as its
//! text, and the shim's size parser means other things (`1` is a whole device there, `m`
//! mega). The grammar, from apimachinery's `quantity.go`:
//!
//! ```text
//! quantity  ::= sign? number suffix
//! number    ::= digits | digits "." digits? | "." digits
//! suffix    ::= "" | binarySI | decimalSI | ("e" | "E") sign? digits
//! binarySI  ::= Ki | Mi | Gi | Ti | Pi | Ei
//! decimalSI ::= n | u | m | k | M | G | T | P | E
//! ```
//!
//! A value is read exactly (a fraction of 128-bit integers) and rounded up to a whole
//! unit, as the API server rounds a quantity up to its smallest unit: `300m` of a count is
//! 1, `0.5` bytes is 1 byte.

/// Why a text is not a quantity this driver can use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// It does not follow the quantity grammar.
    #[error("{0:?} is not a Kubernetes quantity (such as 20Gi, 1500M, 300m, 1e3)")]
    Syntax(String),
    /// It is below zero.
    #[error("{0:?} is negative")]
    Negative(String),
    /// It is more than this driver counts (2^64 - 1 units).
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// The value of `text`, rounded up to a whole unit (bytes, per mille, a count).
pub fn ceil_u64(text: &str) -> Result<u64, QuantityError> {
    let syntax = || QuantityError::Syntax(text.to_owned());
    let too_large = || QuantityError::TooLarge(text.to_owned());
    let (negative, rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let number_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
        return Err(syntax());
    }
    // The digits as one integer, `scale` of them after the point. Leading zeros cost
    // nothing; more significant digits than 38 do not fit and no real quantity has them.
    let digits = format!("{whole}{fraction}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 38 {
        return Err(too_large());
    }
    let mantissa: u128 = if digits.is_empty() { 0 } else { digits.parse().map_err(|_| syntax())? };
    // value = mantissa × 2^binary × 10^decimal
    let (binary, decimal): (u32, i32) = match suffix {
        "" => (0, 0),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        "n" => (0, -9),
        "u" => (0, -6),
        "m" => (0, -3),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        exponent => {
            let digits = exponent.strip_prefix(['e', 'E']).ok_or_else(syntax)?;
            let unsigned = digits.strip_prefix(['+', '-']).unwrap_or(digits);
            if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
                return Err(syntax());
            }
            (0, digits.parse::<i32>().map_err(|_| too_large())?)
        }
    };
    if negative && mantissa != 0 {
        return Err(QuantityError::Negative(text.to_owned()));
    }
    if mantissa == 0 {
        return Ok(0);
    }
    // Saturating: an exponent near i32::MIN is still "smaller than any unit" below.
    let decimal = decimal.saturating_sub(i32::try_from(fraction.len()).map_err(|_| syntax())?);
    let power = |n: i32| 10u128.checked_pow(n.unsigned_abs());
    let mut numerator = mantissa.checked_mul(1u128 << binary).ok_or_else(too_large)?;
    let mut denominator = 1u128;
    if decimal >= 0 {
        numerator = power(decimal).and_then(|p| numerator.checked_mul(p)).ok_or_else(too_large)?;
    } else {
        match power(decimal) {
            Some(p) => denominator = p,
            // Smaller than any unit, and more than 0: one unit.
            None => return Ok(1),
        }
    }
    u64::try_from(numerator.div_ceil(denominator)).map_err(|_| too_large())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exponent_at_the_edge_of_i32_is_refused_not_a_panic() {
        assert_eq!(ceil_u64("1.5e-2147483648"), Ok(1));
        assert!(matches!(ceil_u64("1.5e2147483647"), Err(QuantityError::TooLarge(_))));
        assert!(matches!(ceil_u64("1e99999999999"), Err(QuantityError::TooLarge(_))));
    }

    #[test]
    fn quantities_read_as_the_api_server_reads_them() {
        // From apimachinery's quantity documentation and tests.
        for (text, value) in [
            ("0", 0),
            ("1", 1),
            ("250", 250),
            ("1k", 1000),
            ("1Ki", 1024),
            ("1M", 1_000_000),
            ("1Mi", 1 << 20),
            ("1536Mi", 1536 << 20),
            ("20Gi", 20 << 30),
            ("1.5Gi", 3 << 29),
            ("20G", 20_000_000_000),
            ("1e3", 1000),
            ("1E3", 1000),
            ("2e9", 2_000_000_000),
            ("1e+3", 1000),
            ("12e-1", 2),
            ("1000m", 1),
            ("1500m", 2),
            ("300m", 1),
            ("1m", 1),
            ("100n", 1),
            (".5", 1),
            ("5.", 5),
            ("+7", 7),
            ("-0", 0),
            ("0.000Gi", 0),
            ("1Ei", 1 << 60),
            ("1e-400", 1),
        ] {
            assert_eq!(ceil_u64(text), Ok(value), "{text}");
        }
    }

    #[test]
    fn what_is_not_a_quantity_is_refused_naming_it() {
        for text in ["", "lots", "1 Gi", "1GiB", "1gi", "1.2.3", ".", "1e", "1e3.5", "1Ki2", "e3", "0x10"] {
            let e = ceil_u64(text).unwrap_err();
            assert!(matches!(e, QuantityError::Syntax(_)), "{text}: {e}");
            assert!(e.to_string().contains(&format!("{text:?}")), "{e}");
        }
        assert!(matches!(ceil_u64("-1"), Err(QuantityError::Negative(_))));
        assert!(matches!(ceil_u64("-300m"), Err(QuantityError::Negative(_))));
        assert!(matches!(ceil_u64("20Ei"), Err(QuantityError::TooLarge(_))));
        assert!(matches!(ceil_u64("1e30"), Err(QuantityError::TooLarge(_))));
        assert!(matches!(ceil_u64("1e999999999999"), Err(QuantityError::TooLarge(_))));
    }
}
