//! The webhook's decision, as a pure function: an AdmissionReview (`admission.k8s.io/v1`)
//! in, the AdmissionReview answer out. No I/O, so every rule is tested without a server.
//!
//! The review is read and answered with kube's admission types: [`AdmissionReview`] of a
//! [`DynamicObject`] (so that any kind is read, and passed), the object read again as a
//! `k8s_openapi` [`Pod`] when it is the creation of one, and an [`AdmissionResponse`]
//! (uid echoed, the request's apiVersion and kind, `patchType` `JSONPatch`). Two things are
//! done by hand: the envelope is checked before kube reads it, so that each mistake gets a
//! plain message, and the patch is written in base64 (kube writes its bytes as an array of
//! numbers: kube-rs/kube#1781). The JSON Patch is built from the containers' JSON as sent
//! (`patch.rs`), so an env entry the API server knows and these types do not is kept.
//!
//! The rules (docs/kubernetes.md and docs/interface.md are the contract):
//! - Only `CREATE` of a Pod (`kind` group `""`, version `v1`, kind `Pod`, no
//!   sub-resource) is looked at; every other request, `UPDATE` of a Pod included, is
//!   allowed unchanged (a running pod's share cannot change).
//! - A pod with none of the `gpufrac.io/*` annotations is allowed unchanged.
//! - A pod with `gpufrac.io/gpu-fraction-limit`, `gpufrac.io/resolver`,
//!   `gpufrac.io/container`, `gpufrac.io/park-after`, `gpufrac.io/compute-fraction` or
//!   `gpufrac.io/compute-fraction-limit` but no `gpufrac.io/gpu-fraction` is refused:
//!   those alone
//!   would do nothing, which is a mistake worth telling.
//! - Bad values are refused (`allowed: false`, `status.code` 400) with a message naming
//!   the annotation, the value and what is expected; every problem is listed.
//! - A good pod is patched: its container (`gpufrac.io/container`, default the first)
//!   gets `resources.limits` and `resources.requests` `gpufrac.io/gpu` =
//!   `ceil(fraction × 100)`, and env `GPUFRAC_MEMORY_LIMIT`, `GPUFRAC_RESOLVER`,
//!   `GPUFRAC_PRIORITY` (`spec.priority`, else `0`) and `GPUFRAC_POD`
//!   (`<namespace>/<name>`), and `GPUFRAC_PARK_AFTER` when `gpufrac.io/park-after` is set
//!   (a duration the shim's parser accepts, such as `30s`; passed on as written), and
//!   `GPUFRAC_COMPUTE_REQUEST` / `GPUFRAC_COMPUTE_LIMIT` when `gpufrac.io/compute-fraction`
//!   / `gpufrac.io/compute-fraction-limit` is set (a share of the GPU's time, `30%` or
//!   `0.3`, checked with the shim's parser, together too: limit > 0 and >= request; passed
//!   on written as a percentage). Whether a GPU's compute requests add up to more than
//!   100% is not known at admission (the scheduler places the pod later): the arbiter
//!   refuses the process that would overcommit when it registers.
//! - The request is granted in whole shares, so the device plugin's
//!   `GPUFRAC_MEMORY_REQUEST` is `shares / 100`; `GPUFRAC_MEMORY_LIMIT` is the limit
//!   annotation (default the request) but never below `shares / 100`, so the shim's
//!   `limit >= request` holds (`0.333` → 34 shares, limit `0.34`). Rounding up is
//!   reported as an AdmissionReview warning.
//! - `gpufrac.io/gpu-fraction-num-devices: "N"` (1 to 16) asks the fraction on each of N
//!   GPUs: `gpufrac.io/gpu` is N times the shares, which the device plugin's preferred
//!   allocation splits evenly over N GPUs. It sees only the count, so N GPUs are certain
//!   only when N - 1 GPUs cannot hold it (`shares × N > 100 × (N - 1)`, more than 0.5 of
//!   each of 2 GPUs); a smaller fraction is refused, pointing to a DRA claim.
//! - The pod's author sets none of gpufrac's variables (`owned.rs`): in the chosen
//!   container, an author-written `GPUFRAC_MEMORY_LIMIT`, `GPUFRAC_RESOLVER`,
//!   `GPUFRAC_PRIORITY`, `GPUFRAC_POD` or (with their annotations) `GPUFRAC_PARK_AFTER`,
//!   `GPUFRAC_COMPUTE_REQUEST` and `GPUFRAC_COMPUTE_LIMIT` is replaced, and every other `GPUFRAC_*` (but
//!   `GPUFRAC_WAIT_TIMEOUT` and `GPUFRAC_LOG`), `LD_PRELOAD` and `NVIDIA_VISIBLE_DEVICES`
//!   is removed, so the device plugin's values win; in every other container and init
//!   container those `GPUFRAC_*` are removed too (the same two kept), and in any of them
//!   that asks for `gpufrac.io/gpu` itself, `LD_PRELOAD` and `NVIDIA_VISIBLE_DEVICES`
//!   also. Each container's takeover is an AdmissionReview warning.
//! - A container that gets shares (the chosen one, or one asking for `gpufrac.io/gpu`)
//!   with an `envFrom` source whose `prefix` could form one of those names (no prefix,
//!   `GPU`, `LD_`, …) is refused: its keys cannot be read at admission.

use base64::Engine as _;
use k8s_openapi::api::core::v1::Pod;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::{DynamicObject, Status};
use serde::Deserialize as _;
use serde_json::{json, Map, Value};

use super::owned::{env_from_problems, strip_env, Role};
use super::patch::{container_patch, ContainerGrant, PodName, TakenOver, RESOURCE};
use super::settings::{
    cut, shown, shown_json, Fraction, Settings, CONTAINER, FRACTION, NUM_DEVICES, SHARES_PER_GPU,
};

/// Where a refusal of `gpufrac.io/gpu-fraction-num-devices` sends the user.
const DRA_DOC: &str = "docs/kubernetes.md#fractions-across-gpus-tensor-parallel";

/// The only AdmissionReview version served.
pub const API_VERSION: &str = "admission.k8s.io/v1";

/// A body that is not an AdmissionReview `admission.k8s.io/v1` with a request and a uid:
/// there is no one to answer, so the server answers HTTP 400 with this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an AdmissionReview admission.k8s.io/v1 request: {0}")]
pub struct BadReview(String);

/// The answer to an AdmissionReview: `review` for a well-formed request, and for anything
/// else an AdmissionReview that refuses (code 400) with the [`BadReview`] message, with
/// the request's uid when one could be read.
///
/// The server uses [`try_review`], which tells the two apart.
pub fn review(request: &Value) -> Value {
    try_review(request).unwrap_or_else(|bad| {
        let mut response = AdmissionResponse::invalid(bad.to_string());
        response.uid = request.pointer("/request/uid").and_then(Value::as_str).unwrap_or_default().to_owned();
        response.result = refusal_status(&bad.to_string());
        wire(response)
    })
}

/// The answer to an AdmissionReview `admission.k8s.io/v1`: the same apiVersion and kind,
/// `response.uid` = `request.uid`, `allowed`, and either a JSON Patch (`patchType`
/// `JSONPatch`, `patch` in base64) or, on refusal, `status.code` 400 and
/// `status.message`. `Err` when the body is not such a review (see [`BadReview`]).
pub fn try_review(body: &Value) -> Result<Value, BadReview> {
    let request = parse(body)?;
    Ok(wire(admit(&request)))
}

/// The request of an AdmissionReview `admission.k8s.io/v1`, read with kube's types; the
/// envelope is checked first, so that each mistake is named plainly.
pub(super) fn parse(body: &Value) -> Result<AdmissionRequest<DynamicObject>, BadReview> {
    let Some(fields) = body.as_object() else {
        return Err(BadReview(format!("expected a JSON object, got {}", json_type(body))));
    };
    match fields.get("apiVersion") {
        Some(Value::String(v)) if v == API_VERSION => {}
        Some(v) => {
            return Err(BadReview(format!(
                "apiVersion {} is not served: expected {API_VERSION:?}",
                shown_json(v)
            )))
        }
        None => return Err(BadReview("apiVersion is missing".into())),
    }
    match fields.get("kind") {
        Some(Value::String(k)) if k == "AdmissionReview" => {}
        Some(k) => {
            return Err(BadReview(format!(
                "kind {} is not served: expected \"AdmissionReview\"",
                shown_json(k)
            )))
        }
        None => return Err(BadReview("kind is missing".into())),
    }
    let Some(request) = fields.get("request").filter(|r| r.is_object()) else {
        return Err(BadReview("request is missing or not an object".into()));
    };
    match request.get("uid") {
        Some(Value::String(uid)) if !uid.is_empty() => {}
        _ => return Err(BadReview("request.uid is missing or not a string".into())),
    }
    let review = AdmissionReview::<DynamicObject>::deserialize(body)
        .map_err(|e| BadReview(cut(&format!("request: {e}"))))?;
    let request: Result<AdmissionRequest<DynamicObject>, _> = review.try_into();
    request.map_err(|e: kube::core::admission::ConvertAdmissionReviewError| BadReview(e.to_string()))
}

/// The webhook's answer to a well-formed request (see the module's documentation).
pub fn admit(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    match decide(request) {
        Decision::Allow => response,
        Decision::Patch(ops, warnings) => {
            let mut response = response;
            response.warnings = (!warnings.is_empty()).then_some(warnings);
            // kube's JSON Patch type, read from the operations built (never fails: they
            // are `add` and `replace` operations with a path and a value).
            match serde_json::from_value(Value::Array(ops)).map(|patch| response.clone().with_patch(patch)) {
                Ok(Ok(patched)) => patched,
                Ok(Err(e)) => refuse(response, &format!("cannot write the patch: {e}")),
                Err(e) => refuse(response, &format!("cannot write the patch: {e}")),
            }
        }
        Decision::Refuse(message) => refuse(response, &message),
    }
}

/// `response` refusing with `message` (code 400).
pub(super) fn refuse(response: AdmissionResponse, message: &str) -> AdmissionResponse {
    let mut response = response.deny(message);
    response.result = refusal_status(message);
    response.warnings = None;
    response
}

/// The `status` of a refusal: code 400, reason `BadRequest`, the message.
fn refusal_status(message: &str) -> Status {
    Status::failure(message, "BadRequest").with_code(400)
}

/// The AdmissionReview around `response` as the API server reads it: kube serializes the
/// patch's bytes as an array of numbers (kube-rs/kube#1781), the API server's `[]byte`
/// is base64.
pub(super) fn wire(mut response: AdmissionResponse) -> Value {
    let patch = response.patch.take();
    let mut review = serde_json::to_value(response.into_review()).unwrap_or_else(|e| {
        // Plain strings, numbers and maps: serializing them cannot fail.
        json!({"apiVersion": API_VERSION, "kind": "AdmissionReview",
               "response": {"uid": "", "allowed": false, "status": {"code": 500, "message": e.to_string()}}})
    });
    if let (Some(patch), Some(fields)) = (patch, review.get_mut("response").and_then(Value::as_object_mut)) {
        fields.insert("patch".into(), Value::from(base64::engine::general_purpose::STANDARD.encode(patch)));
    }
    review
}

/// What the webhook does with one request.
#[derive(Debug)]
enum Decision {
    /// Allowed, unchanged.
    Allow,
    /// Allowed with this JSON Patch, and these warnings for the user.
    Patch(Vec<Value>, Vec<String>),
    /// Refused with this message.
    Refuse(String),
}

/// The decision for a well-formed `request`.
fn decide(request: &AdmissionRequest<DynamicObject>) -> Decision {
    let kind = &request.kind;
    if (kind.group.as_str(), kind.version.as_str(), kind.kind.as_str()) != ("", "v1", "Pod") {
        return Decision::Allow;
    }
    if request.sub_resource.as_deref().is_some_and(|s| !s.is_empty()) {
        return Decision::Allow;
    }
    if request.operation != Operation::Create {
        return Decision::Allow;
    }
    let Some(object) = &request.object else {
        return Decision::Refuse("request.object is not a Pod: expected the pod to create".into());
    };
    // The pod as sent, whole: the patch rewrites containers' env as the author wrote them,
    // fields this build's types do not know included.
    let pod_json = match serde_json::to_value(object) {
        Ok(value) if value.is_object() => value,
        _ => return Decision::Refuse("request.object is not a Pod: expected the pod to create".into()),
    };
    let pod: Pod = match serde_json::from_value(pod_json.clone()) {
        Ok(pod) => pod,
        Err(e) => return Decision::Refuse(cut(&format!("request.object is not a Pod: {e}"))),
    };

    let annotations: Option<Map<String, Value>> = pod
        .metadata
        .annotations
        .as_ref()
        .map(|map| map.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect());
    let settings = match Settings::from_annotations(annotations.as_ref()) {
        Ok(None) => return Decision::Allow,
        Ok(Some(settings)) => settings,
        Err(message) => return Decision::Refuse(message),
    };

    let containers =
        pod_json.pointer("/spec/containers").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let spec = pod.spec.as_ref();
    let names: Vec<&str> =
        spec.map(|s| s.containers.iter().map(|c| c.name.as_str()).collect()).unwrap_or_default();
    let index = match &settings.container {
        None if names.is_empty() => {
            return Decision::Refuse("the pod has no containers to give the GPU to".into())
        }
        None => 0,
        Some(wanted) => match names.iter().position(|name| name == wanted) {
            Some(index) => index,
            None => {
                return Decision::Refuse(format!(
                    "{CONTAINER}={}: expected the name of one of the pod's containers ({})",
                    shown(wanted),
                    container_names(containers),
                ));
            }
        },
    };

    let shares = settings.request.shares();
    let granted = Fraction::from_shares(shares);
    // The device plugin sees only a count of shares: N GPUs' fractions are asked as N
    // times the shares, which it splits evenly over the fewest GPUs that hold them. That is
    // N GPUs only when one GPU fewer cannot hold them all.
    let devices = settings.devices;
    if devices > 1 && shares * devices <= SHARES_PER_GPU * (devices - 1) {
        return Decision::Refuse(format!(
            "{NUM_DEVICES}=\"{devices}\" with {FRACTION}={:?}: the device plugin sees only a count of \
             shares ({}), which {} can hold; ask for more than {} of each GPU, or use a DRA claim with \
             count: {devices} ({DRA_DOC})",
            cut(&settings.request.to_string()),
            shares * devices,
            match devices - 1 {
                1 => "one GPU".to_owned(),
                n => format!("{n} GPUs"),
            },
            Fraction::from_shares(SHARES_PER_GPU * (devices - 1) / devices)
                .map_or_else(|| "0".to_owned(), |f| f.to_string()),
        ));
    }
    let mut warnings: Vec<String> = Vec::new();
    if granted.as_ref() != Some(&settings.request) {
        warnings.push(format!(
            "gpufrac.io/gpu-fraction={} is granted in whole shares of 1/100 GPU: {shares} \
             shares ({} GPU)",
            cut(&settings.request.to_string()),
            granted.as_ref().map(ToString::to_string).unwrap_or_default(),
        ));
    }
    let memory_limit = match (settings.limit, granted) {
        (Some(limit), Some(granted)) => limit.max(granted),
        (Some(limit), None) => limit,
        (None, Some(granted)) => granted,
        (None, None) => settings.request,
    };

    let non_empty = |v: Option<&str>| v.filter(|s| !s.is_empty()).map(str::to_owned);
    let namespace = non_empty(request.namespace.as_deref())
        .or_else(|| non_empty(pod.metadata.namespace.as_deref()))
        .unwrap_or_else(|| "default".to_owned());
    let name =
        match non_empty(Some(request.name.as_str())).or_else(|| non_empty(pod.metadata.name.as_deref())) {
            Some(name) => PodName::Known(name),
            None => PodName::Generated,
        };
    let priority = spec.and_then(|s| s.priority).unwrap_or(0).to_string();

    let init_containers = pod_json
        .pointer("/spec/initContainers")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    // Every container of the pod, with its place in the patch and what it is to gpufrac.
    let all: Vec<Member<'_>> = init_containers
        .iter()
        .enumerate()
        .map(|(i, c)| Member::new(c, "initContainers", "init container", i, false))
        .chain(
            containers
                .iter()
                .enumerate()
                .map(|(i, c)| Member::new(c, "containers", "container", i, i == index)),
        )
        .collect();

    let problems: Vec<String> = all
        .iter()
        .filter(|m| m.role == Role::Gpu)
        .flat_map(|m| env_from_problems(m.json, &m.label))
        .collect();
    if !problems.is_empty() {
        return Decision::Refuse(listed(problems, "more envFrom sources"));
    }

    let grant = ContainerGrant {
        index,
        shares: shares * devices,
        memory_limit: memory_limit.to_string(),
        resolver: settings.resolver.as_str(),
        priority,
        park_after: settings.park_after,
        compute: settings.compute,
        namespace,
        name,
    };
    let mut ops = Vec::new();
    let mut taken_over = Vec::new();
    for member in &all {
        if member.chosen {
            let (patch, taken) = container_patch(member.json, &grant);
            ops.extend(patch);
            taken_over.extend(taken_over_warnings(&member.label, &taken));
            continue;
        }
        let env = member.json.get("env").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        if let Some((kept, removed)) = strip_env(env, member.role) {
            ops.push(json!({"op": "replace", "path": format!("{}/env", member.path), "value": kept}));
            let taken = TakenOver { replaced: Vec::new(), removed };
            taken_over.extend(taken_over_warnings(&member.label, &taken));
        }
    }
    if taken_over.len() > WARNINGS_LISTED {
        let more = taken_over.len() - WARNINGS_LISTED;
        taken_over.truncate(WARNINGS_LISTED);
        taken_over.push(format!("and {more} more warnings like these"));
    }
    warnings.extend(taken_over);
    Decision::Patch(ops, warnings)
}

/// One container or init container of a pod that asks for a fraction.
struct Member<'a> {
    /// Its JSON in the pod.
    json: &'a Value,
    /// Its JSON Pointer (`/spec/containers/1`).
    path: String,
    /// How messages name it (`container "main"`).
    label: String,
    /// Whether the webhook gives it the pod's fraction.
    chosen: bool,
    /// What it is to gpufrac: the chosen container, and any that asks for
    /// `gpufrac.io/gpu` itself, get shares.
    role: Role,
}

impl<'a> Member<'a> {
    fn new(json: &'a Value, list: &str, what: &str, index: usize, chosen: bool) -> Member<'a> {
        let asks = ["limits", "requests"].iter().any(|l| {
            json.pointer(&format!("/resources/{l}"))
                .and_then(Value::as_object)
                .is_some_and(|m| m.contains_key(RESOURCE))
        });
        let name = json.get("name").and_then(Value::as_str).unwrap_or_default();
        Member {
            json,
            path: format!("/spec/{list}/{index}"),
            label: format!("{what} {}", shown(name)),
            chosen,
            role: if chosen || asks { Role::Gpu } else { Role::Other },
        }
    }
}

/// The most warnings about taken-over env entries in one answer, and the most names in one.
const WARNINGS_LISTED: usize = 10;

/// What a user is told about the env entries the webhook took over in one container
/// (kept short: the API server may cut warnings over 256 characters).
fn taken_over_warnings(label: &str, taken: &TakenOver) -> Vec<String> {
    let mut warnings = Vec::new();
    if !taken.replaced.is_empty() {
        warnings.push(format!("{label}: env {} replaced by the webhook's values", names(&taken.replaced)));
    }
    if !taken.removed.is_empty() {
        warnings.push(format!("{label}: env {} removed: only gpufrac sets them", names(&taken.removed)));
    }
    warnings
}

/// Env names for a message: the first [`WARNINGS_LISTED`], quoted and cut, then how many more.
fn names(list: &[String]) -> String {
    let mut shown_names: Vec<String> = list.iter().take(WARNINGS_LISTED).map(|n| shown(n)).collect();
    if list.len() > WARNINGS_LISTED {
        shown_names.push(format!("and {} more", list.len() - WARNINGS_LISTED));
    }
    shown_names.join(", ")
}

/// Problems joined with `; `: the first [`WARNINGS_LISTED`], then how many more.
pub(super) fn listed(mut problems: Vec<String>, more_of: &str) -> String {
    if problems.len() > WARNINGS_LISTED {
        let more = problems.len() - WARNINGS_LISTED;
        problems.truncate(WARNINGS_LISTED);
        problems.push(format!("and {more} {more_of}"));
    }
    problems.join("; ")
}

/// The most container names listed in a refusal; a pod may have thousands.
const NAMES_LISTED: usize = 10;

/// The pod's container names for a refusal: the first [`NAMES_LISTED`], each cut to a
/// sane length, then how many more.
fn container_names(containers: &[Value]) -> String {
    if containers.is_empty() {
        return "it has none".to_owned();
    }
    let mut names: Vec<String> = containers
        .iter()
        .take(NAMES_LISTED)
        .map(|c| shown(c.get("name").and_then(Value::as_str).unwrap_or_default()))
        .collect();
    if containers.len() > NAMES_LISTED {
        names.push(format!("and {} more", containers.len() - NAMES_LISTED));
    }
    names.join(", ")
}

/// The JSON type of a value, for messages.
pub(super) fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(object: Value) -> Value {
        json!({
            "apiVersion": API_VERSION,
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "ns",
                "operation": "CREATE",
                "userInfo": {"username": "admin"},
                "object": object,
            },
        })
    }

    fn patch_of(answer: &Value) -> Vec<Value> {
        let b64 = answer["response"]["patch"].as_str().expect("a patch");
        let bytes = base64::engine::general_purpose::STANDARD.decode(b64).expect("base64");
        serde_json::from_slice(&bytes).expect("a JSON array")
    }

    #[test]
    fn rounded_request_raises_the_limit_and_warns() {
        let pod = json!({
            "metadata": {"name": "p", "annotations": {"gpufrac.io/gpu-fraction": "0.333"}},
            "spec": {"containers": [{"name": "a"}]},
        });
        let answer = review(&admission(pod));
        assert_eq!(answer["response"]["allowed"], true);
        let ops = patch_of(&answer);
        assert_eq!(ops[0]["value"]["limits"]["gpufrac.io/gpu"], "34");
        assert_eq!(ops[1]["value"][0], json!({"name": "GPUFRAC_MEMORY_LIMIT", "value": "0.34"}));
        let warning = answer["response"]["warnings"][0].as_str().expect("a warning");
        assert!(warning.contains("34 shares"), "{warning}");
    }

    #[test]
    fn bad_envelopes() {
        assert!(try_review(&json!([])).is_err());
        assert!(try_review(&json!({"apiVersion": "admission.k8s.io/v1beta1",
                                   "kind": "AdmissionReview", "request": {"uid": "x"}}))
        .is_err());
        assert!(try_review(&json!({"apiVersion": API_VERSION, "kind": "AdmissionReview"})).is_err());
        let mut no_uid = admission(json!({}));
        no_uid["request"]["uid"] = Value::Null;
        assert!(try_review(&no_uid).is_err());
        // `review` still answers, refusing, with the uid.
        let answer = review(&json!({"apiVersion": API_VERSION, "kind": "AdmissionReview",
                                    "request": {"uid": "u-9"}, "extra": 1}));
        assert_eq!(answer["response"]["allowed"], false);
        assert_eq!(answer["response"]["uid"], "u-9");
        let message = answer["response"]["status"]["message"].as_str().expect("a message");
        assert!(message.contains("missing field"), "{message}");
        let answer = review(&json!({"apiVersion": API_VERSION, "kind": "AdmissionReview",
                                    "request": "x"}));
        assert_eq!(answer["response"]["allowed"], false);
        assert_eq!(answer["response"]["status"]["code"], 400);
    }

    #[test]
    fn refusals_stay_small() {
        let containers: Vec<Value> = (0..3_500).map(|i| json!({"name": format!("c{i}")})).collect();
        let pod = json!({
            "metadata": {"name": "p", "annotations": {"gpufrac.io/gpu-fraction": "0.5",
                                                      "gpufrac.io/container": "x".repeat(5_000)}},
            "spec": {"containers": containers},
        });
        let answer = review(&admission(pod));
        let message = answer["response"]["status"]["message"].as_str().expect("a refusal");
        assert!(message.len() < 1_000, "{} bytes: {message}", message.len());
        assert!(message.starts_with("gpufrac.io/container=\"xxx"), "{message}");
        assert!(message.contains(r#""c0", "c1""#) && message.contains("\"c9\", and 3490 more"), "{message}");
        let huge = json!({"apiVersion": "x".repeat(100_000), "kind": "AdmissionReview"});
        assert!(try_review(&huge).expect_err("bad").to_string().len() < 200);
    }

    #[test]
    fn subresources_and_updates_pass() {
        let pod = json!({
            "metadata": {"name": "p", "annotations": {"gpufrac.io/gpu-fraction": "7"}},
            "spec": {"containers": [{"name": "a"}]},
        });
        let mut update = admission(pod.clone());
        update["request"]["operation"] = json!("UPDATE");
        assert_eq!(review(&update)["response"], json!({"uid": "u-1", "allowed": true, "status": {}}));
        let mut status = admission(pod);
        status["request"]["subResource"] = json!("status");
        assert_eq!(review(&status)["response"], json!({"uid": "u-1", "allowed": true, "status": {}}));
    }
}
