//! The webhook's check of DRA objects (`POST /validate`), as a pure function: an
//! AdmissionReview (`admission.k8s.io/v1`) in, the answer out. A typo in a claim's
//! `GpuFractionConfig` is refused when the claim is created, with the field named,
//! instead of failing the pod when the kubelet prepares the claim.
//!
//! The rules (docs/kubernetes.md, "A claim's configuration checked at admission"):
//! - Looked at: `resource.k8s.io` (`v1`, `v1beta1`, `v1beta2`) ResourceClaims,
//!   ResourceClaimTemplates and DeviceClasses, on `CREATE`, and on `UPDATE` when their
//!   list of configurations changed (a claim's spec cannot change, but its metadata can:
//!   a finalizer removed from an old claim is never refused). Every other request,
//!   sub-resources (`status`) included, is allowed.
//! - Their configurations are at `spec.devices.config` (claims),
//!   `spec.spec.devices.config` (templates) and `spec.config` (classes), the same in the
//!   three versions. Each entry whose `opaque.driver` is `gpu.gpufrac.io` is read with
//!   the kubelet plugin's own parser ([`config::parse`]), so that the webhook and the
//!   plugin never disagree; other drivers' entries are left alone.
//! - Within one entry, `computeLimit` and `computeRequest` must make a share (limit
//!   above 0 and at least the request), as the plugin checks when it prepares the claim.
//!   What needs the allocation (the consumed capacity, the class's and the claim's
//!   configurations merged) is left to the plugin.
//! - A bad entry is refused (`allowed: false`, `status.code` 400) with a message that
//!   names the object's field: `spec.devices.config[0].opaque.parameters.limit: ...`;
//!   every bad entry is listed.

use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::core::DynamicObject;
use serde_json::Value;

use gpufrac_common::compute::ComputeSpec;

use super::review::{json_type, listed, parse, refuse, wire, BadReview};
use crate::dra::config::{self, FractionConfig};
use crate::dra::DRIVER;

/// The API group of the objects checked.
pub const GROUP: &str = "resource.k8s.io";
/// The versions of [`GROUP`] read (their configuration lists are shaped alike).
pub const VERSIONS: &[&str] = &["v1", "v1beta1", "v1beta2"];

/// The most characters of one problem in a refusal: a reason echoes the user's value,
/// which may be as long as the object.
const PROBLEM_CHARS: usize = 512;

/// The answer to an AdmissionReview `admission.k8s.io/v1` sent to `/validate`: the same
/// apiVersion and kind, `response.uid` = `request.uid`, `allowed`, and on refusal
/// `status.code` 400 and `status.message`. `Err` when the body is not such a review.
pub fn try_validate(body: &Value) -> Result<Value, BadReview> {
    let request = parse(body)?;
    Ok(wire(validate(&request)))
}

/// The answer to a well-formed request (see the module's documentation).
pub fn validate(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    let problems = problems(request);
    if problems.is_empty() {
        response
    } else {
        refuse(response, &listed(problems, "more bad configurations"))
    }
}

/// Where a kind keeps its list of device configurations.
fn config_path(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "ResourceClaim" => Some(&["spec", "devices", "config"]),
        "ResourceClaimTemplate" => Some(&["spec", "spec", "devices", "config"]),
        "DeviceClass" => Some(&["spec", "config"]),
        _ => None,
    }
}

/// What is wrong with the request's object; empty when it is allowed.
fn problems(request: &AdmissionRequest<DynamicObject>) -> Vec<String> {
    let kind = &request.kind;
    if kind.group != GROUP || !VERSIONS.contains(&kind.version.as_str()) {
        return Vec::new();
    }
    let Some(path) = config_path(&kind.kind) else { return Vec::new() };
    if request.sub_resource.as_deref().is_some_and(|s| !s.is_empty()) {
        return Vec::new();
    }
    if !matches!(request.operation, Operation::Create | Operation::Update) {
        return Vec::new();
    }
    let Some(object) = request.object.as_ref().and_then(|o| serde_json::to_value(o).ok()) else {
        return vec![format!("request.object is missing: expected the {} to admit", kind.kind)];
    };
    let configs = configs_at(&object, path);
    if request.operation == Operation::Update {
        let old = request.old_object.as_ref().and_then(|o| serde_json::to_value(o).ok());
        if old.is_some_and(|old| configs_at(&old, path) == configs) {
            return Vec::new();
        }
    }
    config_problems(configs, &path.join("."))
}

/// The value at `path` in `object`, `None` where a step is missing or null.
fn configs_at<'a>(object: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(object, |at, key| at.get(key)).filter(|v| !v.is_null())
}

/// The problems of the configuration list `configs` found at `field`.
fn config_problems(configs: Option<&Value>, field: &str) -> Vec<String> {
    let Some(configs) = configs else { return Vec::new() };
    let Some(entries) = configs.as_array() else {
        return vec![format!("{field}: expected a list of configurations, not {}", json_type(configs))];
    };
    let mut problems = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let Some(opaque) =
            entry.get("opaque").filter(|o| o.get("driver").and_then(Value::as_str) == Some(DRIVER))
        else {
            continue;
        };
        let parameters = opaque.get("parameters").unwrap_or(&Value::Null);
        let at = format!("{field}[{index}].opaque");
        let problem = match config::parse(parameters) {
            Err(e) => Some(format!("{at}.{}: {}", e.field, e.reason)),
            Ok(parsed) => {
                compute_problem(&parsed).map(|(name, reason)| format!("{at}.parameters.{name}: {reason}"))
            }
        };
        problems.extend(problem.map(|p| clipped(&p)));
    }
    problems
}

/// Whether one entry's `computeRequest` and `computeLimit` make a share, checked as the
/// plugin checks them when it prepares the claim (`dra/claim.rs`): the field and why not.
fn compute_problem(parsed: &FractionConfig) -> Option<(&'static str, String)> {
    let request = parsed.compute_request.map(|s| s.to_string());
    let limit = parsed.compute_limit.map(|s| s.to_string());
    ComputeSpec::from_texts(("computeRequest", request.as_deref()), ("computeLimit", limit.as_deref()))
        .err()
        .map(|e| {
            let field = if e.input == "computeLimit" { "computeLimit" } else { "computeRequest" };
            (field, format!("{:?}: {}", e.value, e.reason))
        })
}

/// `text` cut after [`PROBLEM_CHARS`] characters, with `…` when cut.
fn clipped(text: &str) -> String {
    match text.char_indices().nth(PROBLEM_CHARS) {
        None => text.to_owned(),
        Some((cut, _)) => format!("{}…", &text[..cut]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// An AdmissionReview of `operation` on `object` (group, version and kind read from it).
    fn review_of(operation: &str, object: &Value, old: Option<&Value>) -> Value {
        let api_version = object["apiVersion"].as_str().unwrap_or("resource.k8s.io/v1");
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let kind = object["kind"].as_str().unwrap_or_default();
        let resource = match kind {
            "ResourceClaim" => "resourceclaims",
            "ResourceClaimTemplate" => "resourceclaimtemplates",
            "DeviceClass" => "deviceclasses",
            other => other,
        };
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "d8f7a1c2",
                "kind": {"group": group, "version": version, "kind": kind},
                "resource": {"group": group, "version": version, "resource": resource},
                "operation": operation,
                "name": "x",
                "namespace": "default",
                "userInfo": {"username": "someone"},
                "object": object,
                "oldObject": old,
            }
        })
    }

    fn answer(operation: &str, object: &Value, old: Option<&Value>) -> Value {
        try_validate(&review_of(operation, object, old)).expect("a well-formed review")["response"].clone()
    }

    /// The refusal's message for creating `object`, `None` when it is allowed.
    fn refusal(object: &Value) -> Option<String> {
        let response = answer("CREATE", object, None);
        assert_eq!(response["uid"], "d8f7a1c2");
        if response["allowed"] == true {
            return None;
        }
        assert_eq!(response["status"]["code"], 400, "{response}");
        Some(response["status"]["message"].as_str().expect("a message").to_owned())
    }

    fn parameters(extra: Value) -> Value {
        let mut base = json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig"});
        base.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
        base
    }

    fn ours(parameters: Value) -> Value {
        json!({"opaque": {"driver": DRIVER, "parameters": parameters}})
    }

    fn claim(version: &str, config: Vec<Value>) -> Value {
        json!({
            "apiVersion": format!("resource.k8s.io/{version}"),
            "kind": "ResourceClaim",
            "metadata": {"name": "x", "namespace": "default"},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
                "config": config,
            }}
        })
    }

    fn template(version: &str, config: Vec<Value>) -> Value {
        json!({
            "apiVersion": format!("resource.k8s.io/{version}"),
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "x", "namespace": "default"},
            "spec": {"spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
                "config": config,
            }}}
        })
    }

    fn class(version: &str, config: Vec<Value>) -> Value {
        json!({
            "apiVersion": format!("resource.k8s.io/{version}"),
            "kind": "DeviceClass",
            "metadata": {"name": "x"},
            "spec": {
                "selectors": [{"cel": {"expression": "device.driver == \"gpu.gpufrac.io\""}}],
                "config": config,
            }
        })
    }

    /// Every kind in every version, with its configuration list's path.
    fn shapes(config: Vec<Value>) -> Vec<(Value, &'static str)> {
        let mut all = Vec::new();
        for version in VERSIONS {
            all.push((claim(version, config.clone()), "spec.devices.config"));
            all.push((template(version, config.clone()), "spec.spec.devices.config"));
            all.push((class(version, config.clone()), "spec.config"));
        }
        all
    }

    #[test]
    fn a_good_configuration_is_allowed_in_every_shape() {
        let good = ours(parameters(json!({
            "limit": "40Gi", "resolver": "swap", "priority": 7, "parkAfter": "5m",
            "computeRequest": "30%", "computeLimit": "0.8",
        })));
        for (object, path) in shapes(vec![good.clone(), ours(parameters(json!({})))]) {
            assert_eq!(refusal(&object), None, "{path}: {object}");
        }
        // No configuration at all, and an empty list.
        let mut bare = claim("v1", vec![]);
        bare["spec"]["devices"].as_object_mut().expect("devices").remove("config");
        assert_eq!(refusal(&bare), None);
        assert_eq!(refusal(&class("v1", vec![])), None);
    }

    #[test]
    fn a_bad_field_is_named_with_its_path_in_every_shape() {
        let other = json!({"opaque": {"driver": "gpu.example.com", "parameters": {"anything": true}}});
        let bad = ours(parameters(json!({"limit": "lots"})));
        for (object, path) in shapes(vec![other, bad]) {
            let message = refusal(&object).unwrap_or_else(|| panic!("{path} allowed: {object}"));
            let field = format!("{path}[1].opaque.parameters.limit: \"lots\"");
            assert!(message.starts_with(&field), "{path}: {message}");
            assert!(!message.contains("[0]"), "another driver's entry was judged: {message}");
        }
    }

    #[test]
    fn each_field_of_the_configuration_is_checked() {
        let cases = [
            (json!({"apiVersion": "gpufrac.io/v2", "kind": "GpuFractionConfig"}), "parameters.apiVersion"),
            (json!({"apiVersion": "gpufrac.io/v1"}), "parameters.kind"),
            (json!({"apiVersion": "gpufrac.io/v1", "kind": "FractionConfig"}), "parameters.kind"),
            (parameters(json!({"limit": "lots"})), "parameters.limit"),
            (parameters(json!({"limit": -3})), "parameters.limit"),
            (parameters(json!({"resolver": "fast"})), "parameters.resolver"),
            (parameters(json!({"priority": "high"})), "parameters.priority"),
            (parameters(json!({"priority": 1u64 << 40})), "parameters.priority"),
            (parameters(json!({"parkAfter": "soon"})), "parameters.parkAfter"),
            (parameters(json!({"computeRequest": "1.5"})), "parameters.computeRequest"),
            (parameters(json!({"computeRequest": "0"})), "parameters.computeRequest"),
            (parameters(json!({"computeLimit": "130%"})), "parameters.computeLimit"),
            (parameters(json!({"computeLimit": "0%"})), "parameters.computeLimit"),
            (parameters(json!({"computeRequest": "50%", "computeLimit": "30%"})), "parameters.computeLimit"),
            (parameters(json!({"limt": "40Gi"})), "parameters.limt"),
            (json!("limit=40Gi"), "parameters"),
            (Value::Null, "parameters"),
        ];
        for (parameters, field) in cases {
            let message = refusal(&claim("v1", vec![ours(parameters.clone())]))
                .unwrap_or_else(|| panic!("{parameters} allowed"));
            let expected = format!("spec.devices.config[0].opaque.{field}: ");
            assert!(message.starts_with(&expected), "{parameters}: {message}");
        }
        // The plugin's own words, whole.
        let message = refusal(&claim(
            "v1",
            vec![ours(parameters(json!({"computeRequest": "50%", "computeLimit": "30%"})))],
        ));
        assert_eq!(
            message.as_deref(),
            Some("spec.devices.config[0].opaque.parameters.computeLimit: \"30%\": the limit must be at least computeRequest (50%)")
        );
    }

    #[test]
    fn every_bad_entry_is_listed() {
        let object = claim(
            "v1beta1",
            vec![
                ours(parameters(json!({"resolver": "fast"}))),
                ours(parameters(json!({}))),
                ours(parameters(json!({"priority": "high"}))),
            ],
        );
        let message = refusal(&object).expect("refused");
        assert!(message.starts_with("spec.devices.config[0].opaque.parameters.resolver: "), "{message}");
        assert!(message.contains("; spec.devices.config[2].opaque.parameters.priority: "), "{message}");
        assert!(!message.contains("config[1]"), "{message}");
    }

    #[test]
    fn other_objects_and_operations_pass() {
        let bad = vec![ours(parameters(json!({"limit": "lots"})))];
        // Another group, another version, another kind.
        let mut elsewhere = claim("v1", bad.clone());
        elsewhere["apiVersion"] = json!("example.com/v1");
        assert_eq!(refusal(&elsewhere), None);
        assert_eq!(refusal(&claim("v1alpha3", bad.clone())), None);
        let mut slice = claim("v1", bad.clone());
        slice["kind"] = json!("ResourceSlice");
        assert_eq!(refusal(&slice), None);
        // A status update, and a delete (no object).
        let mut status = review_of("UPDATE", &claim("v1", bad.clone()), None);
        status["request"]["subResource"] = json!("status");
        assert_eq!(try_validate(&status).expect("well-formed")["response"]["allowed"], true);
        let mut delete = review_of("DELETE", &claim("v1", bad.clone()), None);
        delete["request"]["oldObject"] = delete["request"]["object"].take();
        assert_eq!(try_validate(&delete).expect("well-formed")["response"]["allowed"], true);
    }

    #[test]
    fn an_update_is_judged_only_when_the_configurations_change() {
        let bad = claim("v1", vec![ours(parameters(json!({"limit": "lots"})))]);
        // A finalizer removed from a claim admitted before the webhook was installed.
        let mut unfinalized = bad.clone();
        unfinalized["metadata"]["finalizers"] = json!([]);
        assert_eq!(answer("UPDATE", &unfinalized, Some(&bad))["allowed"], true);
        // A class whose configuration is changed to a bad one.
        let good = class("v1", vec![ours(parameters(json!({"limit": "0.5"})))]);
        let worse = class("v1", vec![ours(parameters(json!({"limit": "half"})))]);
        let response = answer("UPDATE", &worse, Some(&good));
        assert_eq!(response["allowed"], false);
        assert!(
            response["status"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("spec.config[0].opaque.parameters.limit: \"half\"")),
            "{response}"
        );
        // Without the old object (never sent for an update, but read safely), judged.
        assert_eq!(answer("UPDATE", &worse, None)["allowed"], false);
    }

    #[test]
    fn a_malformed_list_or_a_long_value_is_refused_plainly() {
        let mut object = claim("v1", vec![]);
        object["spec"]["devices"]["config"] = json!("limit=40Gi");
        assert_eq!(
            refusal(&object).as_deref(),
            Some("spec.devices.config: expected a list of configurations, not a string")
        );
        let long = "x".repeat(100_000);
        let message =
            refusal(&claim("v1", vec![ours(parameters(json!({"resolver": long})))])).expect("refused");
        assert!(message.chars().count() <= PROBLEM_CHARS + 1 && message.ends_with('…'), "{}", message.len());
    }

    #[test]
    fn a_body_that_is_no_review_is_an_error() {
        assert!(try_validate(&json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}))
            .is_err());
        assert!(try_validate(&json!([])).is_err());
    }
}
