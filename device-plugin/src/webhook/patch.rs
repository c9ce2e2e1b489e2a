//! The JSON Patch (RFC 6902) that gives one container of a pod its GPU share: the
//! `gpufrac.io/gpu` resource and the shim's `GPUFRAC_*` variables.
//!
//! The patch is correct whether or not the container already has `resources`,
//! `resources.limits`, `resources.requests` or `env`: missing parents are added whole,
//! and existing ones are added to (an `add` on an existing object member replaces it).

use serde_json::{json, Value};

use super::owned::{is_owned, Role};
use super::settings::Compute;

/// The extended resource the device plugin advertises.
pub(crate) const RESOURCE: &str = "gpufrac.io/gpu";

/// The env variable holding the pod's generated name, when the name is not known at
/// admission (`metadata.generateName`); `GPUFRAC_POD` refers to it as `$(…)`.
pub(crate) const POD_NAME_HELPER: &str = "GPUFRAC_POD_NAME";

/// How `GPUFRAC_POD` gets the pod's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PodName {
    /// The name is known at admission: `GPUFRAC_POD=<namespace>/<name>`.
    Known(String),
    /// Only `generateName` is set, so the API server picks the name after admission: the
    /// kubelet fills `GPUFRAC_POD_NAME` from the downward API (`metadata.name`) and
    /// expands `GPUFRAC_POD=<namespace>/$(GPUFRAC_POD_NAME)`.
    Generated,
}

/// What the chosen container gets.
#[derive(Clone, Debug)]
pub(crate) struct ContainerGrant {
    /// Index in `spec.containers`.
    pub(crate) index: usize,
    /// `ceil(request × 100)`: the value of `gpufrac.io/gpu` in limits and requests.
    pub(crate) shares: u32,
    /// `GPUFRAC_MEMORY_LIMIT`.
    pub(crate) memory_limit: String,
    /// `GPUFRAC_RESOLVER`.
    pub(crate) resolver: &'static str,
    /// `GPUFRAC_PRIORITY`.
    pub(crate) priority: String,
    /// `GPUFRAC_PARK_AFTER`, when the pod may be parked; `None`: the variable is not set
    /// (and an author-written one is removed, like any other `GPUFRAC_*` it owns).
    pub(crate) park_after: Option<String>,
    /// `GPUFRAC_COMPUTE_REQUEST` and `GPUFRAC_COMPUTE_LIMIT`, each when its annotation is
    /// set (an author-written one without the annotation is removed).
    pub(crate) compute: Compute,
    /// The namespace for `GPUFRAC_POD`.
    pub(crate) namespace: String,
    /// The name for `GPUFRAC_POD`.
    pub(crate) name: PodName,
}

/// A JSON Pointer token, escaped (`~` → `~0`, `/` → `~1`).
pub(crate) fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// The author's `env` entries that the webhook took over in one container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TakenOver {
    /// Variables the webhook sets, whose author-written values it replaced.
    pub(crate) replaced: Vec<String>,
    /// Variables the device plugin sets (or other owned ones), whose entries it removed.
    pub(crate) removed: Vec<String>,
}

impl TakenOver {
    /// Whether nothing was taken over.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.replaced.is_empty() && self.removed.is_empty()
    }
}

/// The patch operations for `container` (the current JSON of
/// `spec.containers[grant.index]`), and what of the author's env they replace or remove.
pub(crate) fn container_patch(container: &Value, grant: &ContainerGrant) -> (Vec<Value>, TakenOver) {
    let base = format!("/spec/containers/{}", grant.index);
    let quantity = Value::from(grant.shares.to_string());
    let mut ops = Vec::new();

    match container.get("resources").and_then(Value::as_object) {
        None => ops.push(json!({
            "op": "add",
            "path": format!("{base}/resources"),
            "value": {
                "limits": { RESOURCE: quantity },
                "requests": { RESOURCE: quantity },
            },
        })),
        Some(resources) => {
            // Extended resources need request == limit, so both are set.
            for list in ["limits", "requests"] {
                if resources.get(list).is_some_and(Value::is_object) {
                    ops.push(json!({
                        "op": "add",
                        "path": format!("{base}/resources/{list}/{}", escape(RESOURCE)),
                        "value": quantity,
                    }));
                } else {
                    ops.push(json!({
                        "op": "add",
                        "path": format!("{base}/resources/{list}"),
                        "value": { RESOURCE: quantity },
                    }));
                }
            }
        }
    }

    let existing = container.get("env").and_then(Value::as_array);
    let (env, taken) = merged_env(existing.map(Vec::as_slice).unwrap_or_default(), grant);
    // The whole array is replaced: removals by index would have to be ordered, and a
    // `replace` of `env` is one operation whatever the author wrote.
    ops.push(json!({
        "op": if existing.is_some() { "replace" } else { "add" },
        "path": format!("{base}/env"),
        "value": env,
    }));
    (ops, taken)
}

/// The container's env with ours in: a variable of ours that the container already has is
/// replaced where it stands (later duplicates dropped); the others are appended
/// (`GPUFRAC_PARK_AFTER`, when the pod may be parked, then `GPUFRAC_COMPUTE_REQUEST` and
/// `GPUFRAC_COMPUTE_LIMIT`, when set, last). Every
/// other variable gpufrac owns in a container with shares (`owned.rs`: the device
/// plugin's `GPUFRAC_MEMORY_REQUEST`, `GPUFRAC_GROUP`, `GPUFRAC_ARBITER_SOCKET`,
/// `LD_PRELOAD`, `NVIDIA_VISIBLE_DEVICES`, any other `GPUFRAC_*` but the user settings)
/// is removed, whether a `value` or a `valueFrom`, so that `Allocate`'s value is the one
/// the container gets. The helper `GPUFRAC_POD_NAME`, when used, always stands right
/// before `GPUFRAC_POD`, since the kubelet expands `$(VAR)` only from variables defined
/// earlier.
fn merged_env(existing: &[Value], grant: &ContainerGrant) -> (Vec<Value>, TakenOver) {
    let var = |name: &str, value: &str| json!({ "name": name, "value": value });
    let pod_value = match &grant.name {
        PodName::Known(name) => format!("{}/{name}", grant.namespace),
        PodName::Generated => format!("{}/$({POD_NAME_HELPER})", grant.namespace),
    };
    let helper = match grant.name {
        PodName::Known(_) => None,
        PodName::Generated => Some(json!({
            "name": POD_NAME_HELPER,
            "valueFrom": { "fieldRef": { "apiVersion": "v1", "fieldPath": "metadata.name" } },
        })),
    };
    let mut ours: Vec<(&str, Value)> = vec![
        ("GPUFRAC_MEMORY_LIMIT", var("GPUFRAC_MEMORY_LIMIT", &grant.memory_limit)),
        ("GPUFRAC_RESOLVER", var("GPUFRAC_RESOLVER", grant.resolver)),
        ("GPUFRAC_PRIORITY", var("GPUFRAC_PRIORITY", &grant.priority)),
        ("GPUFRAC_POD", var("GPUFRAC_POD", &pod_value)),
    ];
    if let Some(park_after) = &grant.park_after {
        ours.push(("GPUFRAC_PARK_AFTER", var("GPUFRAC_PARK_AFTER", park_after)));
    }
    if let Some(request) = &grant.compute.request {
        ours.push(("GPUFRAC_COMPUTE_REQUEST", var("GPUFRAC_COMPUTE_REQUEST", request)));
    }
    if let Some(limit) = &grant.compute.limit {
        ours.push(("GPUFRAC_COMPUTE_LIMIT", var("GPUFRAC_COMPUTE_LIMIT", limit)));
    }
    let mut taken = TakenOver::default();
    let mut emitted = vec![false; ours.len()];
    let mut out = Vec::with_capacity(existing.len() + ours.len() + 1);
    let mut emit = |i: usize, out: &mut Vec<Value>| {
        if emitted[i] {
            return;
        }
        emitted[i] = true;
        if ours[i].0 == "GPUFRAC_POD" {
            out.extend(helper.clone());
        }
        out.push(ours[i].1.clone());
    };
    for entry in existing {
        let name = entry.get("name").and_then(Value::as_str);
        if name == Some(POD_NAME_HELPER) {
            // Put back, if needed, right before GPUFRAC_POD.
            match &helper {
                Some(ours) if ours == entry => {}
                Some(_) => note(&mut taken.replaced, POD_NAME_HELPER),
                None => note(&mut taken.removed, POD_NAME_HELPER),
            }
            continue;
        }
        match (ours.iter().position(|(ours, _)| Some(*ours) == name), name) {
            (Some(i), Some(name)) => {
                // The same entry as ours (a pod already patched, sent again) is no news.
                if *entry != ours[i].1 {
                    note(&mut taken.replaced, name);
                }
                emit(i, &mut out);
            }
            (None, Some(name)) if is_owned(name, Role::Gpu) => note(&mut taken.removed, name),
            _ => out.push(entry.clone()),
        }
    }
    for i in 0..ours.len() {
        emit(i, &mut out);
    }
    (out, taken)
}

/// Adds `name` to `names` unless it is there.
fn note(names: &mut Vec<String>, name: &str) {
    if !names.iter().any(|n| n == name) {
        names.push(name.to_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(name: PodName) -> ContainerGrant {
        ContainerGrant {
            index: 1,
            shares: 25,
            memory_limit: "0.5".into(),
            resolver: "wait",
            priority: "0".into(),
            park_after: None,
            compute: Compute::default(),
            namespace: "ns".into(),
            name,
        }
    }

    fn names(env: &[Value]) -> Vec<&str> {
        env.iter().map(|e| e["name"].as_str().unwrap_or("?")).collect()
    }

    #[test]
    fn escapes_pointer_tokens() {
        assert_eq!(escape("gpufrac.io/gpu"), "gpufrac.io~1gpu");
        assert_eq!(escape("a~b/c"), "a~0b~1c");
    }

    #[test]
    fn bare_container_gets_parents_added() {
        let (ops, taken) = container_patch(&json!({"name": "a"}), &grant(PodName::Known("p".into())));
        assert!(taken.is_empty());
        assert_eq!(
            ops[0],
            json!({"op": "add", "path": "/spec/containers/1/resources",
                   "value": {"limits": {"gpufrac.io/gpu": "25"},
                             "requests": {"gpufrac.io/gpu": "25"}}})
        );
        assert_eq!(ops[1]["op"], "add");
        assert_eq!(ops[1]["path"], "/spec/containers/1/env");
        assert_eq!(ops[1]["value"][3], json!({"name": "GPUFRAC_POD", "value": "ns/p"}));
    }

    #[test]
    fn existing_env_is_replaced_in_place() {
        let existing = vec![
            json!({"name": "A", "value": "1"}),
            json!({"name": "GPUFRAC_RESOLVER", "value": "swap"}),
            json!({"name": "GPUFRAC_POD_NAME", "value": "stale"}),
            json!({"name": "B", "value": "$(GPUFRAC_RESOLVER)"}),
            json!({"name": "GPUFRAC_RESOLVER", "value": "dup"}),
            json!({"name": "GPUFRAC_POD", "value": "x"}),
        ];
        let (env, taken) = merged_env(&existing, &grant(PodName::Generated));
        assert_eq!(taken.replaced, ["GPUFRAC_RESOLVER", "GPUFRAC_POD_NAME", "GPUFRAC_POD"]);
        assert!(taken.removed.is_empty());
        assert_eq!(
            names(&env),
            [
                "A",
                "GPUFRAC_RESOLVER",
                "B",
                "GPUFRAC_POD_NAME",
                "GPUFRAC_POD",
                "GPUFRAC_MEMORY_LIMIT",
                "GPUFRAC_PRIORITY"
            ]
        );
        assert_eq!(env[1]["value"], "wait");
        assert_eq!(env[4]["value"], "ns/$(GPUFRAC_POD_NAME)");
        assert_eq!(env[3]["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
    }

    #[test]
    fn park_after_is_set_replaced_or_removed() {
        let parkable = ContainerGrant { park_after: Some("30s".into()), ..grant(PodName::Known("p".into())) };
        // Set, after the others, on a container without env.
        let (env, taken) = merged_env(&[], &parkable);
        assert!(taken.is_empty());
        assert_eq!(
            names(&env),
            [
                "GPUFRAC_MEMORY_LIMIT",
                "GPUFRAC_RESOLVER",
                "GPUFRAC_PRIORITY",
                "GPUFRAC_POD",
                "GPUFRAC_PARK_AFTER"
            ]
        );
        assert_eq!(env[4], json!({"name": "GPUFRAC_PARK_AFTER", "value": "30s"}));
        // An author-written value is replaced where it stands.
        let existing = vec![
            json!({"name": "A", "value": "1"}),
            json!({"name": "GPUFRAC_PARK_AFTER", "value": "1s"}),
            json!({"name": "B", "value": "2"}),
        ];
        let (env, taken) = merged_env(&existing, &parkable);
        assert_eq!(taken.replaced, ["GPUFRAC_PARK_AFTER"]);
        assert_eq!(names(&env)[..3], ["A", "GPUFRAC_PARK_AFTER", "B"]);
        assert_eq!(env[1]["value"], "30s");
        // Without the annotation, the author may not make the pod parkable.
        let (env, taken) = merged_env(&existing, &grant(PodName::Known("p".into())));
        assert_eq!(taken.removed, ["GPUFRAC_PARK_AFTER"]);
        assert!(!names(&env).contains(&"GPUFRAC_PARK_AFTER"), "{env:?}");
    }

    #[test]
    fn compute_shares_are_set_replaced_or_removed() {
        let shared = ContainerGrant {
            park_after: Some("30s".into()),
            compute: Compute { request: Some("30%".into()), limit: Some("80%".into()) },
            ..grant(PodName::Known("p".into()))
        };
        let (env, taken) = merged_env(&[], &shared);
        assert!(taken.is_empty());
        assert_eq!(
            names(&env)[4..],
            ["GPUFRAC_PARK_AFTER", "GPUFRAC_COMPUTE_REQUEST", "GPUFRAC_COMPUTE_LIMIT"]
        );
        assert_eq!(env[5], json!({"name": "GPUFRAC_COMPUTE_REQUEST", "value": "30%"}));
        assert_eq!(env[6], json!({"name": "GPUFRAC_COMPUTE_LIMIT", "value": "80%"}));
        // The author's own values are replaced where they stand.
        let existing = vec![
            json!({"name": "GPUFRAC_COMPUTE_LIMIT", "value": "100%"}),
            json!({"name": "A", "value": "1"}),
            json!({"name": "GPUFRAC_COMPUTE_REQUEST", "value": "90%"}),
        ];
        let (env, taken) = merged_env(&existing, &shared);
        assert_eq!(taken.replaced, ["GPUFRAC_COMPUTE_LIMIT", "GPUFRAC_COMPUTE_REQUEST"]);
        assert_eq!(names(&env)[..3], ["GPUFRAC_COMPUTE_LIMIT", "A", "GPUFRAC_COMPUTE_REQUEST"]);
        assert_eq!((env[0]["value"].as_str(), env[2]["value"].as_str()), (Some("80%"), Some("30%")));
        // A request alone sets only the request; without the annotations, the author's
        // values are removed.
        let request_only = ContainerGrant {
            compute: Compute { request: Some("50%".into()), limit: None },
            ..grant(PodName::Known("p".into()))
        };
        let (env, taken) = merged_env(&existing, &request_only);
        assert_eq!(taken.replaced, ["GPUFRAC_COMPUTE_REQUEST"]);
        assert_eq!(taken.removed, ["GPUFRAC_COMPUTE_LIMIT"]);
        assert!(!names(&env).contains(&"GPUFRAC_COMPUTE_LIMIT"), "{env:?}");
        let (env, taken) = merged_env(&existing, &grant(PodName::Known("p".into())));
        assert_eq!(taken.removed, ["GPUFRAC_COMPUTE_LIMIT", "GPUFRAC_COMPUTE_REQUEST"]);
        assert_eq!(names(&env)[0], "A");
    }
}
