//! The environment variables gpufrac owns in a pod that asks for a fraction, and the
//! checks that keep the pod's author from setting them.
//!
//! The arbiter decides what a container is entitled to from the kubelet (its
//! `gpufrac.io/gpu` shares) and the pod's annotations, not from the environment; these
//! rules keep the environment a container starts with equal to that entitlement, so the
//! shim asks for what the arbiter will grant and nothing in the pod's spec claims more.
//!
//! How the kubelet builds a container's environment decides what must be done:
//! the device plugin's `Allocate` envs come first, then `envFrom` (each source's keys,
//! with its `prefix`), then `env`, and a later entry of the same name wins. So:
//! - a variable the webhook sets (`GPUFRAC_MEMORY_LIMIT`, `GPUFRAC_RESOLVER`,
//!   `GPUFRAC_PRIORITY`, `GPUFRAC_POD`, and `GPUFRAC_PARK_AFTER` from
//!   `gpufrac.io/park-after`, `GPUFRAC_COMPUTE_REQUEST` and `GPUFRAC_COMPUTE_LIMIT` from
//!   the compute annotations) is overwritten in `env`, which also beats `envFrom`; without
//!   its annotation an author-written `GPUFRAC_PARK_AFTER` is removed (parking lets a
//!   group's request count past the GPU, so it is an entitlement, not a tuning), and so
//!   are `GPUFRAC_COMPUTE_*` (a compute request is a guarantee other pods pay for);
//! - a variable `Allocate` sets (`GPUFRAC_MEMORY_REQUEST`, `GPUFRAC_GROUP`,
//!   `GPUFRAC_ARBITER_SOCKET`, `LD_PRELOAD`, `NVIDIA_VISIBLE_DEVICES`) must not be in
//!   `env` at all, or the author's value would replace the plugin's: the webhook removes it;
//! - `envFrom` cannot be read at admission (a ConfigMap or Secret changes later), and a
//!   source whose keys reach the container unprefixed could set any of the plugin's
//!   variables: on a container that gets GPU shares, a source whose `prefix` could form
//!   one of those names is refused.
//!
//! Every `GPUFRAC_*` name is owned except the two that only tune the author's own
//! process ([`USER_SETTINGS`]), so a variable added to the shim later is owned by default.

use serde_json::Value;

use super::settings::shown;

/// The `GPUFRAC_*` variables a pod's author may set: they change how the author's own
/// processes behave, never what they are entitled to.
pub(crate) const USER_SETTINGS: [&str; 2] = ["GPUFRAC_WAIT_TIMEOUT", "GPUFRAC_LOG"];

/// The prefix of gpufrac's variables.
const FAMILY: &str = "GPUFRAC_";

/// Variables outside `GPUFRAC_*` that the device plugin's `Allocate` sets for a container
/// with shares: the shim it preloads and the one GPU the shares are on.
const ALLOCATED: [&str; 2] = ["LD_PRELOAD", "NVIDIA_VISIBLE_DEVICES"];

/// What a container is to gpufrac.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// It gets `gpufrac.io/gpu` shares (the webhook's choice, or the author asked for
    /// them): `Allocate` gives it the shim, the socket and the GPU.
    Gpu,
    /// Any other container or init container of the pod: no shares, so no shim, no
    /// socket and no entitlement, but it still may not claim gpufrac's settings.
    Other,
}

/// Whether an `env` entry named `name` is gpufrac's in a container of this role.
pub(crate) fn is_owned(name: &str, role: Role) -> bool {
    (name.starts_with(FAMILY) && !USER_SETTINGS.contains(&name))
        || (role == Role::Gpu && ALLOCATED.contains(&name))
}

/// Whether an `envFrom` `prefix` could make a name gpufrac owns in a container with
/// shares: the empty prefix (every key as it is), a start of `GPUFRAC_`, `LD_PRELOAD` or
/// `NVIDIA_VISIBLE_DEVICES` (`GPU` + key `FRAC_GROUP`), or anything starting `GPUFRAC_`.
pub(crate) fn prefix_can_form_owned(prefix: &str) -> bool {
    FAMILY.starts_with(prefix)
        || prefix.starts_with(FAMILY)
        || ALLOCATED.iter().any(|name| name.starts_with(prefix))
}

/// The container's `env` without the entries owned in this role, and the names removed
/// (each once, in order). `None` when nothing is removed.
pub(crate) fn strip_env(env: &[Value], role: Role) -> Option<(Vec<Value>, Vec<String>)> {
    let mut removed: Vec<String> = Vec::new();
    let kept: Vec<Value> = env
        .iter()
        .filter(|entry| match entry.get("name").and_then(Value::as_str) {
            Some(name) if is_owned(name, role) => {
                if !removed.iter().any(|r| r == name) {
                    removed.push(name.to_owned());
                }
                false
            }
            _ => true,
        })
        .cloned()
        .collect();
    (!removed.is_empty()).then_some((kept, removed))
}

/// Refuses the `envFrom` sources of a container with shares whose prefix could form a
/// name gpufrac owns: one message per such source, naming the container, the source and
/// its prefix, and saying what to do instead.
pub(crate) fn env_from_problems(container: &Value, label: &str) -> Vec<String> {
    let Some(sources) = container.get("envFrom").and_then(Value::as_array) else {
        return Vec::new();
    };
    let mut problems = Vec::new();
    for (i, source) in sources.iter().enumerate() {
        let prefix = source.get("prefix").and_then(Value::as_str).unwrap_or_default();
        if !prefix_can_form_owned(prefix) {
            continue;
        }
        let what = ["configMapRef", "secretRef"]
            .iter()
            .find_map(|kind| {
                let name = source.pointer(&format!("/{kind}/name")).and_then(Value::as_str)?;
                Some(format!("{kind} {}", shown(name)))
            })
            .unwrap_or_else(|| "a source".to_owned());
        let prefix_said = if prefix.is_empty() {
            "has no prefix".to_owned()
        } else {
            format!("has prefix {}", shown(prefix))
        };
        problems.push(format!(
            "{label}: envFrom[{i}] ({what}) {prefix_said}, so its keys could set GPUFRAC_* \
             variables, LD_PRELOAD or NVIDIA_VISIBLE_DEVICES, which gpufrac sets for the \
             container that gets the GPU; give it a prefix that cannot form those names \
             (such as APP_), or name the keys you need under env with valueFrom"
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn owned_names() {
        for name in [
            "GPUFRAC_MEMORY_REQUEST",
            "GPUFRAC_MEMORY_LIMIT",
            "GPUFRAC_RESOLVER",
            "GPUFRAC_PRIORITY",
            "GPUFRAC_GROUP",
            "GPUFRAC_POD",
            "GPUFRAC_POD_NAME",
            "GPUFRAC_ARBITER_SOCKET",
            "GPUFRAC_PARK_AFTER",
            "GPUFRAC_COMPUTE_REQUEST",
            "GPUFRAC_COMPUTE_LIMIT",
            "GPUFRAC_SOMETHING_NEW",
        ] {
            assert!(is_owned(name, Role::Gpu), "{name}");
            assert!(is_owned(name, Role::Other), "{name}");
        }
        for name in ["LD_PRELOAD", "NVIDIA_VISIBLE_DEVICES"] {
            assert!(is_owned(name, Role::Gpu), "{name}");
            assert!(!is_owned(name, Role::Other), "{name}");
        }
        for name in
            ["GPUFRAC_WAIT_TIMEOUT", "GPUFRAC_LOG", "GPUFRAC", "PATH", "gpufrac_group", "LD_PRELOAD_X"]
        {
            assert!(!is_owned(name, Role::Gpu), "{name}");
        }
    }

    #[test]
    fn prefixes() {
        for bad in ["", "G", "GPU", "GPUFRAC", "GPUFRAC_", "GPUFRAC_X_", "L", "LD_", "LD_PRELOAD", "NVIDIA_"]
        {
            assert!(prefix_can_form_owned(bad), "{bad:?}");
        }
        for good in ["APP_", "CONFIG_", "GPUX", "LDX", "NVIDIAX", "gpufrac_", "X_GPUFRAC_"] {
            assert!(!prefix_can_form_owned(good), "{good:?}");
        }
    }

    #[test]
    fn strip_removes_every_owned_entry_and_keeps_order() {
        let env = vec![
            json!({"name": "A", "value": "1"}),
            json!({"name": "GPUFRAC_GROUP", "value": "theirs"}),
            json!({"name": "LD_PRELOAD", "value": "/x.so"}),
            json!({"name": "GPUFRAC_GROUP", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}),
            json!({"name": "GPUFRAC_WAIT_TIMEOUT", "value": "5s"}),
        ];
        let (kept, removed) = strip_env(&env, Role::Gpu).expect("something removed");
        assert_eq!(kept, vec![env[0].clone(), env[4].clone()]);
        assert_eq!(removed, ["GPUFRAC_GROUP", "LD_PRELOAD"]);
        let (kept, removed) = strip_env(&env, Role::Other).expect("something removed");
        assert_eq!(kept, vec![env[0].clone(), env[2].clone(), env[4].clone()]);
        assert_eq!(removed, ["GPUFRAC_GROUP"]);
        assert!(strip_env(&[json!({"name": "A"})], Role::Gpu).is_none());
    }

    #[test]
    fn env_from_refusals_name_the_source() {
        let container = json!({"envFrom": [
            {"configMapRef": {"name": "app"}},
            {"prefix": "APP_", "secretRef": {"name": "ok"}},
            {"prefix": "GPU", "secretRef": {"name": "tokens"}},
        ]});
        let problems = env_from_problems(&container, "container \"main\"");
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].starts_with("container \"main\": envFrom[0] (configMapRef \"app\") has no prefix")
        );
        assert!(problems[1]
            .starts_with("container \"main\": envFrom[2] (secretRef \"tokens\") has prefix \"GPU\""));
        assert!(env_from_problems(&json!({"name": "x"}), "c").is_empty());
    }
}
