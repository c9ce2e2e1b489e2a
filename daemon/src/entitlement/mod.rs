//! What a client may have, decided from who the kernel says it is, never from what it says.
//!
//! The arbiter learns a peer's [`Identity`] from its socket (`SO_PEERCRED`, a pidfd) and its
//! cgroup, then asks one [`Entitlements`] source (the kubelet and the API server on a
//! Kubernetes node, an admin policy file on a shared machine, or none) for a [`Verdict`].
//! What the client's shim declares (request, limit, priority, resolver, group, compute
//! share) is believed only up to that verdict.

pub mod kubernetes;

pub mod identity;
pub mod policy;

use std::collections::BTreeMap;

use gpufrac_common::compute::{ComputeShare, ComputeSpec};
use gpufrac_common::resolver::Resolver;
use gpufrac_common::size::SizeSpec;

/// Who the kernel says a peer is (never from a message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The peer's PID as `SO_PEERCRED` gave it at connect.
    pub pid: u32,
    /// The peer's effective UID at connect.
    pub uid: u32,
    /// The peer's effective GID at connect.
    pub gid: u32,
    /// Where `/proc/<pid>/cgroup` places it: on the host, in a container of a known layout
    /// (cgroup v1 or v2; containerd, CRI-O, docker; systemd and cgroupfs drivers), or
    /// somewhere that is not understood (fail closed: never taken for the host).
    pub cgroup: Cgroup,
}

impl Identity {
    /// The container it runs in, if its cgroup names one.
    pub fn container(&self) -> Option<&ContainerRef> {
        match &self.cgroup {
            Cgroup::Container(container) => Some(container),
            _ => None,
        }
    }
}

/// Where a process's cgroup places it. Three answers, so that a path the arbiter does not
/// understand is never mistaken for the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cgroup {
    /// Outside any container: no path is under `kubepods` or a container runtime's cgroup.
    Host,
    /// In this container.
    Container(ContainerRef),
    /// Under `kubepods` or a container runtime, but not a layout the arbiter understands
    /// (or the cgroup file could not be read): `why` says which path.
    Unknown(String),
}

/// The container a process runs in, as its cgroup path names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerRef {
    /// The pod's UID as it appears in the cgroup path (dashes restored: `0f3c...-...`).
    pub pod_uid: String,
    /// The container ID (64 hex) as the runtime names it.
    pub container_id: String,
}

/// An amount of device memory a process may be guaranteed or burst to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Amount {
    /// An absolute number of bytes.
    Bytes(u64),
    /// Of the device's total memory, 0 < f <= 1.
    Fraction(f64),
}

impl Amount {
    /// Bytes this amount stands for on a device of `total` bytes (never above `total` for a
    /// fraction; a fraction outside (0, 1] is clamped there).
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            Amount::Bytes(bytes) => bytes,
            Amount::Fraction(f) => {
                let f = if f.is_nan() { 0.0 } else { f.clamp(0.0, 1.0) };
                ((total as f64) * f).round().min(total as f64) as u64
            }
        }
    }
}

impl From<SizeSpec> for Amount {
    fn from(spec: SizeSpec) -> Amount {
        match spec {
            SizeSpec::Bytes(bytes) => Amount::Bytes(bytes),
            SizeSpec::Fraction(f) => Amount::Fraction(f),
        }
    }
}

/// What a process may have.
#[derive(Debug, Clone, PartialEq)]
pub struct Entitlement {
    /// Where this came from, for logs and status: `kubelet: ns/pod container c`,
    /// `policy /etc/gpufrac/policy.json: uid 1000`.
    pub source: String,
    /// The GPUs (by UUID) it may register on, each with the most it may have there (a
    /// tensor-parallel pod holds a fraction of each of several GPUs, not always the same);
    /// `None`: any GPU, up to `max_request` and `max_limit`.
    pub devices: Option<BTreeMap<[u8; 16], DeviceCaps>>,
    /// Most request it is guaranteed per device (with `devices`: the most on any of them).
    pub max_request: Amount,
    /// Most it may hold per device, its burst ceiling (with `devices`: the most on any).
    pub max_limit: Amount,
    /// Highest priority it is believed about.
    pub max_priority: i32,
    /// The resolver it is held to, if its entitlement names one (the pod's annotation).
    pub resolver: Option<Resolver>,
    /// The group it belongs to, derived (Kubernetes: `k8s-<pod uid>-<container name>`);
    /// `None`: the client's own choice, scoped to its UID.
    pub group: Option<String>,
    /// The most compute share it is believed about: a declared request above `request` is
    /// cut to it, a declared limit above `limit` too ([`NO_COMPUTE_REQUEST`]: no guarantee
    /// vouched, any limit). `None`: the source says nothing of compute (the policy file
    /// without compute fields), the declared share is believed.
    pub max_compute: Option<ComputeSpec>,
}

/// What a process may have on one GPU it is entitled to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceCaps {
    /// Most request it is guaranteed there.
    pub max_request: Amount,
    /// Most it may hold there.
    pub max_limit: Amount,
}

/// What a source vouches for when it gives a process no compute share: no guarantee (a
/// declared request is cut to 0%), and a declared limit believed (a limit holds back only
/// the group that declares it).
pub const NO_COMPUTE_REQUEST: ComputeSpec =
    ComputeSpec { request: ComputeShare::ZERO, limit: ComputeShare::WHOLE };

/// A declared compute share held to `max`: the limit cut to `max.limit`, the request to
/// `max.request` and to the limit so cut. What was cut is pushed on `capped`.
pub fn cap_compute(declared: ComputeSpec, max: ComputeSpec, capped: &mut Vec<String>) -> ComputeSpec {
    let limit = declared.limit.min(max.limit);
    let request = declared.request.min(max.request).min(limit);
    if request != declared.request {
        capped.push(format!("compute request {} -> {request}", declared.request));
    }
    if limit != declared.limit {
        capped.push(format!("compute limit {} -> {limit}", declared.limit));
    }
    ComputeSpec { request, limit }
}

/// The answer of an [`Entitlements`] source about one process.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Believe the client up to this.
    Entitled(Entitlement),
    /// No guarantee and no burst (no shares allocated, or an unknown container on a
    /// Kubernetes node): `why` is logged and shown in status.
    NotEntitled {
        /// Why, for the log and status.
        why: String,
    },
    /// No source of entitlement is configured: the client is believed only about itself
    /// (its priority never ends a process of another UID).
    Unrestricted,
    /// The source could not answer (a timeout, the kubelet or the API server unreachable):
    /// no guarantee and no burst for now, like [`Verdict::NotEntitled`], but not a verdict:
    /// never cached, and asked again at the connection's next registration and at every
    /// new connection.
    Unknown {
        /// What failed, for the log and status.
        why: String,
    },
}

impl Verdict {
    /// Whether this came from a failed lookup rather than from an answer.
    pub fn is_unknown(&self) -> bool {
        matches!(self, Verdict::Unknown { .. })
    }
}

/// Why a source could not answer. A lookup failure is treated as [`Verdict::Unknown`]
/// with the error as `why`, except where a variant says otherwise.
#[derive(Debug, thiserror::Error)]
pub enum EntitlementError {
    /// The admin policy file could not be read or is invalid.
    #[error("policy file {path}: {reason}")]
    Policy {
        /// The file, as given with `--policy`.
        path: String,
        /// What is wrong, naming the entry and the field.
        reason: String,
    },
    /// The kubelet's PodResources API could not be asked.
    #[error("kubelet PodResources: {0}")]
    Kubelet(String),
    /// The API server could not be asked about a pod.
    #[error("API server: {0}")]
    ApiServer(String),
    /// The lookup did not answer in time.
    #[error("entitlement lookup timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// Another source-specific failure.
    #[error("{0}")]
    Other(String),
}

/// A source of entitlements: the kubelet and API server, an admin policy file, or none.
pub trait Entitlements: Send + Sync {
    /// May block (called from a blocking task) and cache; must answer within ~2 s.
    fn lookup(&self, who: &Identity) -> Verdict;

    /// The resolver a client entitled by `entitlement` gets when it asks for `asked`: the
    /// entitlement's if it names one, else its own choice. A source with a list of allowed
    /// resolvers (the policy file) answers from it.
    fn resolver(&self, who: &Identity, entitlement: &Entitlement, asked: Resolver) -> Resolver {
        let _ = who;
        entitlement.resolver.unwrap_or(asked)
    }
}

/// No source configured: every client is [`Verdict::Unrestricted`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPolicy;

impl Entitlements for NoPolicy {
    fn lookup(&self, _who: &Identity) -> Verdict {
        Verdict::Unrestricted
    }
}

/// What the arbiter believes of a client's `Hello`, its verdict applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Believed {
    /// The group's key in the ledger: `@<derived>` for a group the entitlement names,
    /// `<uid>/<name>` for the client's own choice (so no other user can take the name),
    /// `<uid>:<pid>/<name>` for a client not entitled (a group of its own).
    pub group_key: String,
    /// The resolver it is held to.
    pub resolver: Resolver,
    /// The priority it is believed about.
    pub priority: i32,
    /// The compute share it is believed about (`None`: none, neither guaranteed nor paced).
    pub compute: Option<ComputeSpec>,
    /// Its priority comes from an entitlement: it may get processes of other users ended.
    /// Without one a client is believed only about itself.
    pub vetted: bool,
    /// What it may have, for status: the entitlement's source, `not entitled: <why>`, or
    /// `unrestricted` (no policy).
    pub entitlement: String,
    /// What it declared beyond its entitlement (empty when nothing), for logs and status.
    pub capped: Vec<String>,
}

/// The name shown for a ledger key made by [`believe_hello`] (keys without a prefix are
/// shown whole).
pub fn shown_group(key: &str) -> &str {
    match key.strip_prefix('@') {
        Some(derived) => derived,
        None => key.split_once('/').map_or(key, |(_, name)| name),
    }
}

/// Applies `verdict` (from `source`, about `who`) to what a client said at `Hello`: its
/// group, resolver, priority and compute share (`None`: it declared none).
pub fn believe_hello(
    verdict: &Verdict,
    source: &dyn Entitlements,
    who: &Identity,
    group: &str,
    resolver: Resolver,
    priority: i32,
    compute: Option<ComputeSpec>,
) -> Believed {
    let own_group = format!("{}/{group}", who.uid);
    match verdict {
        Verdict::Unrestricted => Believed {
            group_key: own_group,
            resolver,
            priority,
            compute,
            vetted: false,
            entitlement: "unrestricted (no policy)".into(),
            capped: Vec::new(),
        },
        Verdict::NotEntitled { .. } | Verdict::Unknown { .. } => Believed {
            // A group of its own, whatever it names: joining another group (even one of
            // its own user, such as a host process's) would let it borrow that group's room.
            group_key: format!("{}:{}/{group}", who.uid, who.pid),
            // It can never burst: its resolver and priority do not matter. Nor is it
            // guaranteed any of the GPU's time.
            resolver: Resolver::Wait,
            priority: priority.min(0),
            compute: None,
            vetted: false,
            entitlement: match verdict {
                Verdict::Unknown { why } => {
                    format!("entitlement unknown (asked again at its next registration): {why}")
                }
                Verdict::NotEntitled { why } => format!("not entitled: {why}"),
                _ => unreachable!("matched above"),
            },
            capped: std::iter::once("no guarantee and no burst".to_owned())
                .chain(compute.map(|c| format!("compute {}/{} -> none", c.request, c.limit)))
                .collect(),
        },
        Verdict::Entitled(e) => {
            let mut capped = Vec::new();
            let held_to = source.resolver(who, e, resolver);
            if held_to != resolver {
                capped.push(format!("resolver {resolver} -> {held_to}"));
            }
            if priority > e.max_priority {
                capped.push(format!("priority {priority} -> {}", e.max_priority));
            }
            let group_key = match &e.group {
                Some(derived) => {
                    if derived != group {
                        capped.push(format!("group {group} -> {derived}"));
                    }
                    format!("@{derived}")
                }
                None => own_group,
            };
            let compute = match (compute, e.max_compute) {
                (Some(declared), Some(max)) => Some(cap_compute(declared, max, &mut capped)),
                (declared, _) => declared,
            };
            Believed {
                group_key,
                resolver: held_to,
                priority: priority.min(e.max_priority),
                compute,
                vetted: true,
                entitlement: e.source.clone(),
                capped,
            }
        }
    }
}

/// Applies `verdict` to a registration on `device` (of `total` bytes): the request and
/// limit believed, and what was cut, if anything.
pub fn believe_register(
    verdict: &Verdict,
    device: &[u8; 16],
    total: u64,
    request: u64,
    limit: u64,
) -> (u64, u64, Option<String>) {
    match verdict {
        Verdict::Unrestricted => (request, limit, None),
        Verdict::NotEntitled { .. } => {
            let cut = (request, limit) != (0, 0);
            (0, 0, cut.then(|| "request and limit -> 0 (not entitled)".to_owned()))
        }
        Verdict::Unknown { .. } => {
            let cut = (request, limit) != (0, 0);
            (0, 0, cut.then(|| "request and limit -> 0 (entitlement unknown: the lookup failed)".to_owned()))
        }
        Verdict::Entitled(e) => {
            let caps = match &e.devices {
                None => DeviceCaps { max_request: e.max_request, max_limit: e.max_limit },
                Some(devices) => match devices.get(device) {
                    Some(caps) => *caps,
                    None => return (0, 0, Some("request and limit -> 0 (not entitled to this GPU)".into())),
                },
            };
            let (max_request, max_limit) = (caps.max_request.bytes(total), caps.max_limit.bytes(total));
            let limit_cut = limit.min(max_limit);
            let request_cut = request.min(max_request).min(limit_cut);
            let mut cut = Vec::new();
            if request_cut != request {
                cut.push(format!("request {request} -> {request_cut}"));
            }
            if limit_cut != limit {
                cut.push(format!("limit {limit} -> {limit_cut}"));
            }
            (request_cut, limit_cut, (!cut.is_empty()).then(|| cut.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who() -> Identity {
        Identity { pid: 9, uid: 1000, gid: 1000, cgroup: Cgroup::Host }
    }

    fn entitled(group: Option<&str>) -> Verdict {
        Verdict::Entitled(Entitlement {
            source: "test".into(),
            devices: Some(BTreeMap::from([(
                [1; 16],
                DeviceCaps { max_request: Amount::Fraction(0.25), max_limit: Amount::Bytes(8) },
            )])),
            max_request: Amount::Fraction(0.25),
            max_limit: Amount::Bytes(8),
            max_priority: 5,
            resolver: Some(Resolver::Swap),
            group: group.map(str::to_owned),
            max_compute: Some(spec(300, 800)),
        })
    }

    fn spec(request: u16, limit: u16) -> ComputeSpec {
        ComputeSpec {
            request: ComputeShare::from_per_mille(request).unwrap(),
            limit: ComputeShare::from_per_mille(limit).unwrap(),
        }
    }

    #[test]
    fn a_hello_is_believed_up_to_the_entitlement() {
        let b = believe_hello(&Verdict::Unrestricted, &NoPolicy, &who(), "a", Resolver::Priority, 99, None);
        assert_eq!(
            (b.group_key.as_str(), b.resolver, b.priority, b.vetted),
            ("1000/a", Resolver::Priority, 99, false)
        );
        assert_eq!(shown_group(&b.group_key), "a");
        let b = believe_hello(
            &entitled(Some("k8s-x-c")),
            &NoPolicy,
            &who(),
            "other",
            Resolver::Priority,
            99,
            None,
        );
        assert_eq!(
            (b.group_key.as_str(), b.resolver, b.priority, b.vetted),
            ("@k8s-x-c", Resolver::Swap, 5, true)
        );
        assert_eq!(shown_group(&b.group_key), "k8s-x-c");
        assert_eq!(b.capped.len(), 3, "{:?}", b.capped);
        let b = believe_hello(&entitled(None), &NoPolicy, &who(), "a", Resolver::Swap, 1, None);
        assert!(b.capped.is_empty() && b.group_key == "1000/a");
        let b = believe_hello(
            &Verdict::NotEntitled { why: "no shares".into() },
            &NoPolicy,
            &who(),
            "a",
            Resolver::Priority,
            7,
            None,
        );
        assert_eq!((b.resolver, b.priority, b.vetted), (Resolver::Wait, 0, false));
        assert!(b.entitlement.contains("no shares"));
        assert_eq!(
            (b.group_key.as_str(), shown_group(&b.group_key)),
            ("1000:9/a", "a"),
            "a group of its own"
        );
        let b = believe_hello(
            &Verdict::Unknown { why: "timed out".into() },
            &NoPolicy,
            &who(),
            "a",
            Resolver::Priority,
            7,
            None,
        );
        assert_eq!(
            (b.group_key.as_str(), b.resolver, b.priority, b.vetted),
            ("1000:9/a", Resolver::Wait, 0, false)
        );
        assert!(
            b.entitlement.contains("unknown") && b.entitlement.contains("timed out"),
            "{}",
            b.entitlement
        );
    }

    #[test]
    fn a_compute_share_is_believed_up_to_the_entitlement() {
        let hello = |verdict: &Verdict, compute: Option<ComputeSpec>| {
            believe_hello(verdict, &NoPolicy, &who(), "a", Resolver::Swap, 1, compute)
        };
        // Cut: the request to 30%, the limit to 80%, each shown as the priority is.
        let b = hello(&entitled(None), Some(spec(900, 1000)));
        assert_eq!(b.compute, Some(spec(300, 800)));
        assert_eq!(b.capped, ["compute request 90% -> 30%", "compute limit 100% -> 80%"]);
        // Kept: within the entitlement, or nothing declared (nothing is added).
        let b = hello(&entitled(None), Some(spec(125, 500)));
        assert_eq!((b.compute, b.capped.len()), (Some(spec(125, 500)), 0));
        assert_eq!(hello(&entitled(None), None).compute, None);
        // A limit cut below the request cuts the request too.
        let mut e = match entitled(None) {
            Verdict::Entitled(e) => e,
            _ => unreachable!(),
        };
        e.max_compute = Some(spec(500, 200));
        let b = hello(&Verdict::Entitled(e.clone()), Some(spec(400, 1000)));
        assert_eq!(b.compute, Some(spec(200, 200)));
        assert_eq!(b.capped, ["compute request 40% -> 20%", "compute limit 100% -> 20%"]);
        // No compute request vouched: no guarantee, the declared limit believed.
        e.max_compute = Some(NO_COMPUTE_REQUEST);
        let b = hello(&Verdict::Entitled(e.clone()), Some(spec(300, 700)));
        assert_eq!(
            (b.compute, b.capped.as_slice()),
            (Some(spec(0, 700)), &["compute request 30% -> 0%".to_owned()][..])
        );
        // The source says nothing of compute (the policy file without compute fields).
        e.max_compute = None;
        assert_eq!(hello(&Verdict::Entitled(e), Some(spec(900, 1000))).compute, Some(spec(900, 1000)));
        // Unrestricted: believed as declared.
        let b = hello(&Verdict::Unrestricted, Some(spec(900, 1000)));
        assert_eq!((b.compute, b.capped.len()), (Some(spec(900, 1000)), 0));
        // Not entitled, or not known: no share at all (no guarantee of anything).
        for verdict in
            [Verdict::NotEntitled { why: "no shares".into() }, Verdict::Unknown { why: "timeout".into() }]
        {
            let b = hello(&verdict, Some(spec(300, 800)));
            assert_eq!(b.compute, None);
            assert!(b.capped.contains(&"compute 30%/80% -> none".to_owned()), "{:?}", b.capped);
            assert_eq!(hello(&verdict, None).capped, ["no guarantee and no burst"]);
        }
    }

    #[test]
    fn a_registration_is_capped_per_device() {
        assert_eq!(believe_register(&Verdict::Unrestricted, &[1; 16], 64, 10, 20), (10, 20, None));
        let not = Verdict::NotEntitled { why: String::new() };
        assert_eq!(believe_register(&not, &[1; 16], 64, 0, 0), (0, 0, None));
        assert!(believe_register(&not, &[1; 16], 64, 1, 2).2.is_some());
        // A failed lookup gives nothing either, but says why differently.
        let unknown = Verdict::Unknown { why: "timeout".into() };
        let (r, l, cut) = believe_register(&unknown, &[1; 16], 64, 1, 2);
        assert_eq!((r, l), (0, 0));
        assert!(cut.is_some_and(|c| c.contains("unknown")));
        // 0.25 of 64 = 16 request, limit 8: the request is cut to the limit.
        let (r, l, cut) = believe_register(&entitled(None), &[1; 16], 64, 32, 64);
        assert_eq!((r, l), (8, 8));
        assert!(cut.is_some());
        assert_eq!(believe_register(&entitled(None), &[1; 16], 64, 4, 6), (4, 6, None));
        assert_eq!(believe_register(&entitled(None), &[2; 16], 64, 4, 6).0, 0, "not its GPU");
    }

    #[test]
    fn a_fraction_of_several_gpus_is_each_gpus_own() {
        let Verdict::Entitled(mut e) = entitled(None) else { unreachable!() };
        e.devices = Some(BTreeMap::from([
            ([1; 16], DeviceCaps { max_request: Amount::Bytes(16), max_limit: Amount::Bytes(32) }),
            ([2; 16], DeviceCaps { max_request: Amount::Bytes(4), max_limit: Amount::Bytes(8) }),
        ]));
        let (e, declared) = (Verdict::Entitled(e), (16, 32));
        assert_eq!(believe_register(&e, &[1; 16], 64, declared.0, declared.1), (16, 32, None));
        let (r, l, cut) = believe_register(&e, &[2; 16], 64, declared.0, declared.1);
        assert_eq!((r, l), (4, 8), "the second GPU's own fraction, not the first's");
        assert_eq!(cut.as_deref(), Some("request 16 -> 4, limit 32 -> 8"));
        let (r, l, cut) = believe_register(&e, &[3; 16], 64, declared.0, declared.1);
        assert_eq!((r, l), (0, 0));
        assert!(cut.is_some_and(|c| c.contains("not entitled to this GPU")));
    }

    #[test]
    fn amounts_resolve_within_the_device() {
        assert_eq!(Amount::Bytes(5).bytes(10), 5);
        assert_eq!(Amount::Fraction(0.25).bytes(16), 4);
        assert_eq!(Amount::Fraction(7.0).bytes(16), 16);
        assert_eq!(Amount::Fraction(f64::NAN).bytes(16), 0);
        assert_eq!(Amount::Fraction(-1.0).bytes(16), 0);
    }
}
