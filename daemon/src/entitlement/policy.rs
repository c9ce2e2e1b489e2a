//! The admin's policy file (`--policy FILE`): entitlements per UID and per GID on a
//! machine shared without Kubernetes.
//!
//! ```json
//! {
//!   "default": { "max_request": "0", "max_limit": "25%", "max_priority": 0, "resolvers": ["wait"] },
//!   "uids": { "1000": { "max_request": "4GiB", "max_limit": "8GiB", "max_priority": 10,
//!                       "max_compute_request": "30%", "max_compute_limit": "80%" } },
//!   "gids": { "2000": { "max_request": 0.25, "max_limit": 0.5, "resolvers": ["wait", "swap"] } }
//! }
//! ```
//!
//! A process is held to the entry of its UID, else of its (primary) GID, else `default`;
//! with none of them it is not entitled. Sizes are written as everywhere in gpufrac
//! (`4GiB`, `0.25` of the device, `25%`, or `0`); `max_priority` defaults to 0 and
//! `resolvers` (those a process may use; the first is forced on one asking another) to
//! all three. `max_compute_request` and `max_compute_limit` (optional: a share of one
//! GPU's time, `30%` or `0.3`) cap the compute share a process declares
//! (`GPUFRAC_COMPUTE_REQUEST`, `GPUFRAC_COMPUTE_LIMIT`): a request alone leaves the limit
//! free (up to 100%), a limit alone caps the request too (a request is never above the
//! limit); with neither, the declared share is believed. Everything is checked when the
//! arbiter starts, and an error names the file, the entry and the field.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use gpufrac_common::compute::{ComputeShare, ComputeSpec};
use gpufrac_common::Resolver;
use serde::Deserialize;

use super::{Amount, Entitlement, EntitlementError, Entitlements, Identity, Verdict};

/// One entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    max_request: serde_json::Value,
    max_limit: serde_json::Value,
    #[serde(default)]
    max_priority: i32,
    #[serde(default)]
    resolvers: Option<Vec<String>>,
    #[serde(default)]
    max_compute_request: Option<serde_json::Value>,
    #[serde(default)]
    max_compute_limit: Option<serde_json::Value>,
}

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    default: Option<RawEntry>,
    #[serde(default)]
    uids: HashMap<String, RawEntry>,
    #[serde(default)]
    gids: HashMap<String, RawEntry>,
}

/// One checked entry.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    /// `uid 1000`, `gid 2000` or `default`, for logs.
    name: String,
    max_request: Amount,
    max_limit: Amount,
    max_priority: i32,
    /// Never empty.
    resolvers: Vec<Resolver>,
    /// `None`: no compute field, the declared share is believed.
    max_compute: Option<ComputeSpec>,
}

/// Entitlements from an admin's policy file.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyFile {
    path: PathBuf,
    default: Option<Entry>,
    uids: HashMap<u32, Entry>,
    gids: HashMap<u32, Entry>,
}

fn invalid(path: &Path, reason: impl Into<String>) -> EntitlementError {
    EntitlementError::Policy { path: path.display().to_string(), reason: reason.into() }
}

/// A size field: a string or a number as gpufrac reads sizes, or 0.
fn amount(
    path: &Path,
    entry: &str,
    field: &str,
    value: &serde_json::Value,
) -> Result<Amount, EntitlementError> {
    let text = match value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        other => {
            return Err(invalid(
                path,
                format!("{entry}: {field}: expected a size such as \"4GiB\", 0.25 or \"25%\", got {other}"),
            ))
        }
    };
    if text.trim() == "0" {
        return Ok(Amount::Bytes(0));
    }
    gpufrac_common::parse_size(field, &text)
        .map(Amount::from)
        .map_err(|e| invalid(path, format!("{entry}: {e}")))
}

/// A compute share field: a string or a number as gpufrac reads shares (`30%`, `0.3`).
fn share(
    path: &Path,
    entry: &str,
    field: &str,
    value: Option<&serde_json::Value>,
) -> Result<Option<ComputeShare>, EntitlementError> {
    let text = match value {
        None => return Ok(None),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(other) => {
            return Err(invalid(
                path,
                format!(
                "{entry}: {field}: expected a share of one GPU's time such as \"30%\" or 0.3, got {other}"
            ),
            ))
        }
    };
    ComputeShare::parse(field, &text).map(Some).map_err(|e| invalid(path, format!("{entry}: {e}")))
}

/// The compute share an entry caps declared shares to (`None`: no compute field).
fn max_compute(path: &Path, name: &str, raw: &RawEntry) -> Result<Option<ComputeSpec>, EntitlementError> {
    let request = share(path, name, "max_compute_request", raw.max_compute_request.as_ref())?;
    let limit = share(path, name, "max_compute_limit", raw.max_compute_limit.as_ref())?;
    let spec = match (request, limit) {
        (None, None) => return Ok(None),
        (Some(request), None) => ComputeSpec { request, limit: ComputeShare::WHOLE },
        // A request is never above its limit: the limit caps both.
        (None, Some(limit)) => ComputeSpec { request: limit, limit },
        (Some(request), Some(limit)) => ComputeSpec { request, limit },
    };
    if spec.limit == ComputeShare::ZERO {
        return Err(invalid(
            path,
            format!("{name}: max_compute_limit: 0% would never let a process run (use max_compute_request 0 for no guarantee)"),
        ));
    }
    if spec.limit < spec.request {
        return Err(invalid(path, format!("{name}: max_compute_limit is below max_compute_request")));
    }
    Ok(Some(spec))
}

/// Checks one entry as written (`name` for errors).
fn check_entry(path: &Path, name: String, raw: &RawEntry) -> Result<Entry, EntitlementError> {
    let max_request = amount(path, &name, "max_request", &raw.max_request)?;
    let max_limit = amount(path, &name, "max_limit", &raw.max_limit)?;
    // Comparable only when of one kind; a mixed pair is capped per device at use.
    let below = match (max_request, max_limit) {
        (Amount::Bytes(r), Amount::Bytes(l)) => l < r,
        (Amount::Fraction(r), Amount::Fraction(l)) => l < r,
        _ => false,
    };
    if below {
        return Err(invalid(path, format!("{name}: max_limit is below max_request")));
    }
    let resolvers = match &raw.resolvers {
        None => vec![Resolver::Wait, Resolver::Priority, Resolver::Swap],
        Some(list) if list.is_empty() => {
            return Err(invalid(
                path,
                format!("{name}: resolvers: empty (name at least one of wait, priority, swap)"),
            ))
        }
        Some(list) => list
            .iter()
            .map(|r| {
                r.parse::<Resolver>().map_err(|e| invalid(path, format!("{name}: resolvers: {r:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    let max_compute = max_compute(path, &name, raw)?;
    Ok(Entry { name, max_request, max_limit, max_priority: raw.max_priority, resolvers, max_compute })
}

fn ids(
    path: &Path,
    kind: &str,
    raw: &HashMap<String, RawEntry>,
) -> Result<HashMap<u32, Entry>, EntitlementError> {
    raw.iter()
        .map(|(id, entry)| {
            let n: u32 = id.trim().parse().map_err(|_| {
                invalid(path, format!("{kind}s: {id:?} is not a numeric {kind} (names are not looked up)"))
            })?;
            Ok((n, check_entry(path, format!("{kind} {n}"), entry)?))
        })
        .collect()
}

impl PolicyFile {
    /// Reads and checks the file.
    pub fn load(path: &Path) -> Result<PolicyFile, EntitlementError> {
        let text = std::fs::read_to_string(path).map_err(|e| invalid(path, format!("cannot read: {e}")))?;
        PolicyFile::parse(path, &text)
    }

    /// Checks the text of a policy file read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<PolicyFile, EntitlementError> {
        let raw: RawPolicy = serde_json::from_str(text).map_err(|e| invalid(path, e.to_string()))?;
        let default = raw.default.as_ref().map(|d| check_entry(path, "default".into(), d)).transpose()?;
        let uids = ids(path, "uid", &raw.uids)?;
        let gids = ids(path, "gid", &raw.gids)?;
        Ok(PolicyFile { path: path.to_owned(), default, uids, gids })
    }

    /// Entries in the file (for the start-up log line).
    pub fn entries(&self) -> usize {
        self.uids.len() + self.gids.len() + usize::from(self.default.is_some())
    }

    fn entry(&self, who: &Identity) -> Option<&Entry> {
        self.uids.get(&who.uid).or_else(|| self.gids.get(&who.gid)).or(self.default.as_ref())
    }
}

impl Entitlements for PolicyFile {
    fn lookup(&self, who: &Identity) -> Verdict {
        let Some(entry) = self.entry(who) else {
            return Verdict::NotEntitled {
                why: format!(
                    "policy {}: no entry for uid {} or gid {} and no default",
                    self.path.display(),
                    who.uid,
                    who.gid
                ),
            };
        };
        Verdict::Entitled(Entitlement {
            source: format!("policy {}: {}", self.path.display(), entry.name),
            devices: None,
            max_request: entry.max_request,
            max_limit: entry.max_limit,
            max_priority: entry.max_priority,
            resolver: (entry.resolvers.len() == 1).then(|| entry.resolvers[0]),
            group: None,
            max_compute: entry.max_compute,
        })
    }

    fn resolver(&self, who: &Identity, entitlement: &Entitlement, asked: Resolver) -> Resolver {
        match self.entry(who) {
            Some(entry) if entry.resolvers.contains(&asked) => asked,
            Some(entry) => entry.resolvers[0],
            None => entitlement.resolver.unwrap_or(asked),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(uid: u32, gid: u32) -> Identity {
        Identity { pid: 42, uid, gid, cgroup: crate::entitlement::Cgroup::Host }
    }

    fn parse(text: &str) -> Result<PolicyFile, String> {
        PolicyFile::parse(Path::new("/etc/gpufrac/policy.json"), text).map_err(|e| e.to_string())
    }

    #[test]
    fn uid_then_gid_then_default() {
        let p = parse(
            r#"{
              "default": { "max_request": "0", "max_limit": "25%", "resolvers": ["wait"] },
              "uids": { "1000": { "max_request": "4GiB", "max_limit": "8GiB", "max_priority": 10 } },
              "gids": { "2000": { "max_request": 0.25, "max_limit": 0.5, "resolvers": ["wait", "swap"] } }
            }"#,
        )
        .unwrap();
        let Verdict::Entitled(e) = p.lookup(&who(1000, 2000)) else { panic!() };
        assert_eq!(
            (e.max_request, e.max_limit, e.max_priority),
            (Amount::Bytes(4 << 30), Amount::Bytes(8 << 30), 10)
        );
        assert_eq!(e.source, "policy /etc/gpufrac/policy.json: uid 1000");
        assert_eq!(e.resolver, None);
        assert_eq!(p.resolver(&who(1000, 0), &e, Resolver::Priority), Resolver::Priority);
        let Verdict::Entitled(e) = p.lookup(&who(1001, 2000)) else { panic!() };
        assert_eq!(
            (e.max_request, e.max_limit, e.max_priority),
            (Amount::Fraction(0.25), Amount::Fraction(0.5), 0)
        );
        assert_eq!(p.resolver(&who(1001, 2000), &e, Resolver::Priority), Resolver::Wait);
        assert_eq!(p.resolver(&who(1001, 2000), &e, Resolver::Swap), Resolver::Swap);
        let Verdict::Entitled(e) = p.lookup(&who(7, 7)) else { panic!() };
        assert_eq!(
            (e.max_request, e.max_limit, e.resolver),
            (Amount::Bytes(0), Amount::Fraction(0.25), Some(Resolver::Wait))
        );
        assert_eq!(e.max_compute, None, "no compute field: the declared share is believed");
        let p = parse(r#"{ "uids": { "1000": { "max_request": "1GiB", "max_limit": "1GiB" } } }"#).unwrap();
        assert!(
            matches!(p.lookup(&who(7, 7)), Verdict::NotEntitled { why } if why.contains("no entry for uid 7"))
        );
    }

    #[test]
    fn compute_fields_cap_the_declared_share() {
        let spec = |r: u16, l: u16| {
            Some(ComputeSpec {
                request: ComputeShare::from_per_mille(r).unwrap(),
                limit: ComputeShare::from_per_mille(l).unwrap(),
            })
        };
        let p = parse(
            r#"{
              "default": { "max_request": "0", "max_limit": "1GiB", "max_compute_request": 0 },
              "uids": {
                "1": { "max_request": "0", "max_limit": "1GiB", "max_compute_request": "30%", "max_compute_limit": 0.8 },
                "2": { "max_request": "0", "max_limit": "1GiB", "max_compute_request": "12.5%" },
                "3": { "max_request": "0", "max_limit": "1GiB", "max_compute_limit": "50%" }
              }
            }"#,
        )
        .unwrap();
        let max = |uid| match p.lookup(&who(uid, 0)) {
            Verdict::Entitled(e) => e.max_compute,
            other => panic!("{other:?}"),
        };
        assert_eq!(max(1), spec(300, 800));
        assert_eq!(max(2), spec(125, 1000), "a request alone leaves the limit free");
        assert_eq!(max(3), spec(500, 500), "a limit alone caps the request too");
        assert_eq!(max(7), spec(0, 1000), "no guarantee");
    }

    #[test]
    fn errors_name_the_file_the_entry_and_the_field() {
        for (text, want) in [
            (
                r#"{ "uids": { "bob": { "max_request": "1GiB", "max_limit": "1GiB" } } }"#,
                "uids: \"bob\" is not a numeric uid",
            ),
            (
                r#"{ "uids": { "1": { "max_request": "lots", "max_limit": "1GiB" } } }"#,
                "uid 1: invalid max_request=\"lots\"",
            ),
            (
                r#"{ "gids": { "5": { "max_request": "1GiB", "max_limit": "2GiB", "resolvers": ["fast"] } } }"#,
                "gid 5: resolvers: \"fast\"",
            ),
            (
                r#"{ "default": { "max_request": "2GiB", "max_limit": "1GiB" } }"#,
                "default: max_limit is below max_request",
            ),
            (
                r#"{ "default": { "max_request": true, "max_limit": "1GiB" } }"#,
                "default: max_request: expected a size",
            ),
            (
                r#"{ "default": { "max_request": "1GiB", "max_limit": "1GiB", "max_prio": 3 } }"#,
                "unknown field `max_prio`",
            ),
            (
                r#"{ "default": { "max_request": "1GiB", "max_limit": "1GiB", "resolvers": [] } }"#,
                "default: resolvers: empty",
            ),
            (
                r#"{ "default": { "max_request": "0", "max_limit": "1GiB", "max_compute_request": "150%" } }"#,
                "default: invalid max_compute_request=\"150%\"",
            ),
            (
                r#"{ "default": { "max_request": "0", "max_limit": "1GiB", "max_compute_limit": [1] } }"#,
                "default: max_compute_limit: expected a share",
            ),
            (
                r#"{ "default": { "max_request": "0", "max_limit": "1GiB", "max_compute_request": "50%", "max_compute_limit": "40%" } }"#,
                "default: max_compute_limit is below max_compute_request",
            ),
            (
                r#"{ "default": { "max_request": "0", "max_limit": "1GiB", "max_compute_limit": 0 } }"#,
                "default: max_compute_limit: 0% would never let a process run",
            ),
            ("{", "EOF"),
        ] {
            let err = parse(text).expect_err(text);
            assert!(err.starts_with("policy file /etc/gpufrac/policy.json: "), "{err}");
            assert!(err.contains(want), "{text}: {err}");
        }
        let err = PolicyFile::load(Path::new("/nonexistent/policy.json")).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/policy.json: cannot read"), "{err}");
    }
}
