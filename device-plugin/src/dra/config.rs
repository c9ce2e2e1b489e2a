//! A claim's opaque configuration for this driver:
//! `{"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": SIZE,
//! "resolver": "wait|priority|swap", "priority": N, "parkAfter": DURATION,
//! "computeRequest": SHARE, "computeLimit": SHARE}`, every field but the first two
//! optional (a SHARE is a share of the GPU's time: `"30%"`, `"12.5%"` or `"0.3"`). A configuration that is not exactly this is refused, naming
//! the field, so that a typo never silently becomes "no burst".

use gpufrac_common::compute::ComputeShare;
use gpufrac_common::resolver::Resolver;
use gpufrac_common::size::{parse_duration, parse_size, SizeSpec};
use serde_json::Value;

/// The configuration's `apiVersion`.
pub const API_VERSION: &str = "gpufrac.io/v1";
/// The configuration's `kind`.
pub const KIND: &str = "GpuFractionConfig";

/// What one configuration says (each field optional).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FractionConfig {
    /// The burst ceiling: bytes, or a fraction of the GPU.
    pub limit: Option<SizeSpec>,
    /// The resolver for the claim's bursts.
    pub resolver: Option<Resolver>,
    /// The priority of the claim's processes (otherwise the pod's).
    pub priority: Option<i32>,
    /// Idle this long, the claim's group may be parked (`GPUFRAC_PARK_AFTER`): a duration
    /// the shim's parser accepts, kept as written but for surrounding whitespace.
    pub park_after: Option<String>,
    /// The guaranteed share of the GPU's time (`GPUFRAC_COMPUTE_REQUEST`). Whether it fits
    /// beside the other claims' is checked by the arbiter, or by the scheduler when the
    /// claim asks for the device's `compute` capacity instead.
    pub compute_request: Option<ComputeShare>,
    /// The most of the GPU's time the claim's processes may take (`GPUFRAC_COMPUTE_LIMIT`).
    pub compute_limit: Option<ComputeShare>,
}

impl FractionConfig {
    /// This configuration with the fields `later` sets taken from it: the claim's own
    /// configuration overrides its class's, and a later entry an earlier one.
    pub fn overridden_by(self, later: FractionConfig) -> FractionConfig {
        FractionConfig {
            limit: later.limit.or(self.limit),
            resolver: later.resolver.or(self.resolver),
            priority: later.priority.or(self.priority),
            park_after: later.park_after.or(self.park_after),
            compute_request: later.compute_request.or(self.compute_request),
            compute_limit: later.compute_limit.or(self.compute_limit),
        }
    }
}

/// Why a configuration was refused: `field` is its path (`parameters.limit`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("opaque configuration for {driver}: {field}: {reason}", driver = super::DRIVER)]
pub struct ConfigError {
    /// The offending field, as a path in the configuration.
    pub field: String,
    /// What is wrong and what is accepted.
    pub reason: String,
}

fn refuse(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: format!("parameters.{field}"), reason: reason.into() }
}

/// Reads the `parameters` of one opaque configuration for this driver.
pub fn parse(parameters: &Value) -> Result<FractionConfig, ConfigError> {
    let Some(object) = parameters.as_object() else {
        return Err(ConfigError {
            field: "parameters".into(),
            reason: format!("expected an object with apiVersion {API_VERSION:?} and kind {KIND:?}"),
        });
    };
    match object.get("apiVersion") {
        Some(Value::String(v)) if v == API_VERSION => {}
        other => return Err(refuse("apiVersion", format!("expected {API_VERSION:?}, not {}", shown(other)))),
    }
    match object.get("kind") {
        Some(Value::String(v)) if v == KIND => {}
        other => return Err(refuse("kind", format!("expected {KIND:?}, not {}", shown(other)))),
    }
    let mut config = FractionConfig::default();
    for (field, value) in object {
        match field.as_str() {
            "apiVersion" | "kind" => {}
            "limit" => config.limit = Some(limit(value)?),
            "resolver" => {
                let name = value.as_str().ok_or_else(|| {
                    refuse("resolver", format!("expected \"wait\", \"priority\" or \"swap\", not {value}"))
                })?;
                config.resolver =
                    Some(name.parse().map_err(|e: String| refuse("resolver", format!("{name:?}: {e}")))?);
            }
            "priority" => {
                let n = value
                    .as_i64()
                    .and_then(|n| i32::try_from(n).ok())
                    .ok_or_else(|| refuse("priority", format!("expected a 32-bit integer, not {value}")))?;
                config.priority = Some(n);
            }
            "parkAfter" => config.park_after = Some(park_after(value)?),
            "computeRequest" => config.compute_request = Some(compute_share("computeRequest", value)?),
            "computeLimit" => config.compute_limit = Some(compute_share("computeLimit", value)?),
            other => {
                return Err(refuse(
                    other,
                    "unknown field (known: apiVersion, kind, limit, resolver, priority, parkAfter, \
                     computeRequest, computeLimit)",
                ))
            }
        }
    }
    Ok(config)
}

fn limit(value: &Value) -> Result<SizeSpec, ConfigError> {
    let text = match value {
        Value::String(text) => text.clone(),
        Value::Number(n) if n.is_u64() => n.to_string(),
        other => {
            return Err(refuse(
                "limit",
                format!("expected a size such as \"40Gi\" or \"0.5\" (of the GPU), not {other}"),
            ))
        }
    };
    parse_size("limit", &text).map_err(|e| refuse("limit", format!("{:?}: {}", e.value, e.reason)))
}

/// A `parkAfter` duration string (`30s`, `500ms`, `5m`), checked with the shim's own
/// parser so that the CDI spec never gives the shim a value it refuses.
fn park_after(value: &Value) -> Result<String, ConfigError> {
    let Value::String(text) = value else {
        return Err(refuse(
            "parkAfter",
            format!("expected a duration such as \"30s\", \"500ms\" or \"5m\", not {value}"),
        ));
    };
    parse_duration("parkAfter", text).map_err(|e| refuse("parkAfter", format!("{text:?}: {}", e.reason)))?;
    Ok(text.trim().to_owned())
}

/// A `computeRequest` or `computeLimit` (`"30%"`, `"12.5%"`, `"0.3"`), read with the
/// shim's own parser. Whether the limit covers the request is checked once the claim's and
/// its class's configurations are merged (`claim.rs`).
fn compute_share(field: &str, value: &Value) -> Result<ComputeShare, ConfigError> {
    let Value::String(text) = value else {
        return Err(refuse(
            field,
            format!("expected a share of the GPU's time such as \"30%\" or \"0.3\" (a string), not {value}"),
        ));
    };
    ComputeShare::parse(field, text).map_err(|e| refuse(field, format!("{text:?}: {}", e.reason)))
}

fn shown(value: Option<&Value>) -> String {
    value.map_or_else(|| "nothing".to_owned(), Value::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(extra: Value) -> Value {
        let mut base = json!({"apiVersion": API_VERSION, "kind": KIND});
        base.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        base
    }

    #[test]
    fn every_field_is_read() {
        let c =
            parse(&config(json!({"limit": "40Gi", "resolver": "swap", "priority": 7, "parkAfter": " 30s "})))
                .unwrap();
        assert_eq!(c.limit, Some(SizeSpec::Bytes(40 << 30)));
        assert_eq!(c.resolver, Some(Resolver::Swap));
        assert_eq!(c.priority, Some(7));
        assert_eq!(c.park_after.as_deref(), Some("30s"));
        assert_eq!(
            parse(&config(json!({"parkAfter": "1h 30m"}))).unwrap().park_after.as_deref(),
            Some("1h 30m")
        );
        assert_eq!(parse(&config(json!({}))).unwrap(), FractionConfig::default());
        let c = parse(&config(json!({"computeRequest": "30%", "computeLimit": " 0.8 "}))).unwrap();
        assert_eq!(c.compute_request.map(ComputeShare::per_mille), Some(300));
        assert_eq!(c.compute_limit.map(ComputeShare::per_mille), Some(800));
        assert_eq!(
            parse(&config(json!({"computeRequest": "12.5%"})))
                .unwrap()
                .compute_request
                .map(|s| s.to_string()),
            Some("12.5%".to_owned())
        );
        assert_eq!(parse(&config(json!({"limit": "0.5"}))).unwrap().limit, Some(SizeSpec::Fraction(0.5)));
        assert_eq!(
            parse(&config(json!({"limit": 1073741824}))).unwrap().limit,
            Some(SizeSpec::Bytes(1 << 30))
        );
    }

    #[test]
    fn a_bad_field_is_named() {
        let cases = [
            (json!({"apiVersion": "gpufrac.io/v2", "kind": KIND}), "parameters.apiVersion"),
            (json!({"apiVersion": API_VERSION}), "parameters.kind"),
            (config(json!({"limit": "lots"})), "parameters.limit"),
            (config(json!({"limit": -3})), "parameters.limit"),
            (config(json!({"resolver": "fast"})), "parameters.resolver"),
            (config(json!({"resolver": 1})), "parameters.resolver"),
            (config(json!({"priority": "high"})), "parameters.priority"),
            (config(json!({"priority": 1u64 << 40})), "parameters.priority"),
            (config(json!({"parkAfter": "soon"})), "parameters.parkAfter"),
            (config(json!({"parkAfter": "30"})), "parameters.parkAfter"),
            (config(json!({"parkAfter": 30})), "parameters.parkAfter"),
            (config(json!({"computeRequest": "1.5"})), "parameters.computeRequest"),
            (config(json!({"computeRequest": 0.3})), "parameters.computeRequest"),
            (config(json!({"computeLimit": "130%"})), "parameters.computeLimit"),
            (config(json!({"computeLimit": "lots"})), "parameters.computeLimit"),
            (config(json!({"limt": "40Gi"})), "parameters.limt"),
            (json!("limit=40Gi"), "parameters"),
        ];
        for (parameters, field) in cases {
            let e = parse(&parameters).unwrap_err();
            assert_eq!(e.field, field, "{parameters}: {e}");
            assert!(e.to_string().contains(field) && e.to_string().contains("gpu.gpufrac.io"), "{e}");
        }
    }

    #[test]
    fn a_bad_compute_share_is_named_with_its_value() {
        let e = parse(&config(json!({"computeRequest": "1.5"}))).unwrap_err();
        assert!(e.reason.starts_with("\"1.5\": a share is at most one whole GPU"), "{e}");
        assert!(e.to_string().contains("parameters.computeRequest: \"1.5\": "), "{e}");
        let e = parse(&config(json!({"computeLimit": "12.34%"}))).unwrap_err();
        assert!(e.reason.starts_with("\"12.34%\": shares are kept to a tenth of a percent"), "{e}");
    }

    #[test]
    fn a_later_configuration_overrides_an_earlier_one_field_by_field() {
        let class = FractionConfig {
            limit: Some(SizeSpec::Fraction(1.0)),
            resolver: Some(Resolver::Wait),
            priority: None,
            park_after: Some("5m".into()),
            compute_request: ComputeShare::from_per_mille(200),
            compute_limit: ComputeShare::from_per_mille(500),
        };
        let claim = FractionConfig {
            limit: None,
            resolver: Some(Resolver::Swap),
            priority: Some(3),
            park_after: None,
            compute_request: ComputeShare::from_per_mille(300),
            compute_limit: None,
        };
        let merged = class.clone().overridden_by(claim);
        assert_eq!(merged.limit, Some(SizeSpec::Fraction(1.0)));
        assert_eq!(merged.resolver, Some(Resolver::Swap));
        assert_eq!(merged.priority, Some(3));
        assert_eq!(merged.park_after.as_deref(), Some("5m"));
        assert_eq!(merged.compute_request, ComputeShare::from_per_mille(300));
        assert_eq!(merged.compute_limit, ComputeShare::from_per_mille(500));
        let sooner = FractionConfig { park_after: Some("30s".into()), ..FractionConfig::default() };
        assert_eq!(class.overridden_by(sooner).park_after.as_deref(), Some("30s"));
    }
}
