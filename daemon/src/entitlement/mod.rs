//! What a client may have, decided from who the kernel says it is, never from what it says.
//!
//! The arbiter learns a peer's [`Identity`] from its socket (`SO_PEERCRED`, a pidfd) and its
//! cgroup, then asks one [`Entitlements`] source (the kubelet and the API server on a
//! Kubernetes node, an admin policy file on a shared machine, or none) for a [`Verdict`].
//! What the client's shim declares (request, limit, priority, resolver, group) is believed
//! only up to that verdict.

pub mod kubernetes;

pub mod identity;

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
    /// From /proc/<pid>/cgroup, when it is a known container layout (cgroup v1 or v2;
    /// containerd, CRI-O, docker; systemd and cgroupfs drivers).
    pub container: Option<ContainerRef>,
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
    /// The GPUs (by UUID) it may register on; `None`: any.
    pub devices: Option<Vec<[u8; 16]>>,
    /// Most request it is guaranteed per device.
    pub max_request: Amount,
    /// Most it may hold per device (its burst ceiling).
    pub max_limit: Amount,
    /// Highest priority it is believed about.
    pub max_priority: i32,
    /// The resolver it is held to, if its entitlement names one (the pod's annotation).
    pub resolver: Option<Resolver>,
    /// The group it belongs to, derived (Kubernetes: `k8s-<pod uid>-<container name>`);
    /// `None`: the client's own choice, scoped to its UID.
    pub group: Option<String>,
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
}

/// Why a source could not answer. A lookup failure is treated as
/// [`Verdict::NotEntitled`] with the error as `why`, except where a variant says otherwise.
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
}

/// No source configured: every client is [`Verdict::Unrestricted`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPolicy;

impl Entitlements for NoPolicy {
    fn lookup(&self, _who: &Identity) -> Verdict {
        Verdict::Unrestricted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_resolve_within_the_device() {
        assert_eq!(Amount::Bytes(5).bytes(10), 5);
        assert_eq!(Amount::Fraction(0.25).bytes(16), 4);
        assert_eq!(Amount::Fraction(7.0).bytes(16), 16);
        assert_eq!(Amount::Fraction(f64::NAN).bytes(16), 0);
        assert_eq!(Amount::Fraction(-1.0).bytes(16), 0);
    }
}
